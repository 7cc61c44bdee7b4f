"""Test helper: save a large snapshot over and over, until killed.

    python tests/ft_writer.py PATH MEGABYTES [snapshots]

By default the single file at PATH with single_file.save (as export writes it);
with `snapshots`, a run's snapshot under the root PATH as the checkpointer saves it
(asynchronously: DCP writes on the snapshot thread), at step 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

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
        meta = {k: v for k, v in state.items() if k not in ("model_state", "optimizer_state")}
        while True:
            model_state, optim_state = get_state_dict(model, optimizer)
            tensors = {"model": model_state, "optim": optim_state}
            # Returns once copied: the write goes on in the background.
            sharded.save(tensors, meta, path, 2, keep=2, async_save=True)
            sharded.wait_pending()
    while True:
        single_file.save(state, path)
