"""Test helper: save a large snapshot to PATH with single_file.save, over and over, until killed.

    python tests/ft_writer.py PATH MEGABYTES
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mingpt.snapshot import single_file  # noqa: E402

if __name__ == "__main__":
    path, megabytes = sys.argv[1], int(sys.argv[2])
    big = torch.ones(megabytes * 2**20 // 4)  # float32
    state = {"model_state": {"w": big}, "optimizer_state": {}, "gpt_config": {}, "vocab": "ab",
             "epoch": 0, "samples_in_epoch": 0, "step": 2}
    while True:
        single_file.save(state, path)
