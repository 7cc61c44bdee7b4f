"""Test helper: save a large snapshot to PATH with single_file.save, over and over, until killed;
with `background`, as a run does with async_save (SingleFileFormat: the write on the snapshot thread).

    python tests/ft_writer.py PATH MEGABYTES [background]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mingpt.comm_hooks import CommHook  # noqa: E402
from mingpt.snapshot import single_file  # noqa: E402

if __name__ == "__main__":
    path, megabytes = sys.argv[1], int(sys.argv[2])
    big = torch.ones(megabytes * 2**20 // 4)  # float32
    state = {"model_state": {"w": big}, "optimizer_state": {}, "gpt_config": {}, "vocab": "ab",
             "epoch": 0, "samples_in_epoch": 0, "step": 2}
    if sys.argv[3:] == ["background"]:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(big)
        optimizer = torch.optim.SGD(model.parameters())
        fmt = single_file.SingleFileFormat(path, model, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                                           CommHook(), is_main_process=True, async_save=True)
        meta = {k: v for k, v in state.items() if k not in ("model_state", "optimizer_state")}
        while True:
            fmt.save(meta, 2, lambda tensors: None)  # returns at once: the write goes on in the background
            fmt.wait()
    while True:
        single_file.save(state, path)
