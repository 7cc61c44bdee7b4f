"""Test helper: join the process group as main.py does, all-reduce once, and
fail (exit 3) until torchrun's restart count reaches N.

    torchrun --max-restarts=N ... tests/restart_worker.py N
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mingpt.distributed import distributed  # noqa: E402

if __name__ == "__main__":
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with distributed("cpu") as info:
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == info.world_size
        print(f"rank {info.rank} of attempt {restart} joined", file=sys.stderr, flush=True)
        if restart < int(sys.argv[1]):
            sys.exit(3)
