"""Test helper: save a large snapshot over and over, until killed.

    python tests/ft_writer.py PATH MEGABYTES [snapshots]

By default the single file at PATH with single_file.save (as export writes it);
with `snapshots`, a run's snapshot under the root PATH as training saves it
(ShardedFormat, asynchronously: DCP writes on the snapshot thread), at step 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mingpt.comm_hooks import CommHook  # noqa: E402
from mingpt.snapshot import sharded, single_file  # noqa: E402

if __name__ == "__main__":
    path, megabytes = sys.argv[1], int(sys.argv[2])
    big = torch.ones(megabytes * 2**20 // 4)  # float32
    state = {
        "model_state": {"w": big},
        "optimizer_state": {},
        "gpt_config": {},
        "vocab": "ab",
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 2,
    }
    if sys.argv[3:] == ["snapshots"]:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(big)
        optimizer = torch.optim.SGD(model.parameters())
        fmt = sharded.ShardedFormat(
            path,
            model,
            optimizer,
            torch.amp.GradScaler("cpu", enabled=False),
            CommHook(),
            keep=2,
            async_save=True,
        )
        meta = {k: v for k, v in state.items() if k not in ("model_state", "optimizer_state")}
        while True:
            # returns once copied: the write goes on in the background
            fmt.save(meta, 2, lambda tensors: None)
            fmt.wait()
    while True:
        single_file.save(state, path)
