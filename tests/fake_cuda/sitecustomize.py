"""Test-only: make a CPU-only host look like a host with CUDA, to catch code that asks
`torch.cuda.is_available()` when it means "is this job on a GPU".

Active in a Python process whose PYTHONPATH holds this directory and whose
environment has MINGPT_TEST_FAKE_CUDA=<number of GPUs> (conftest's
`fake_cuda_env`). `torch.cuda.is_available()` then answers True and
`torch.cuda.device_count()` the number given; nothing else changes, so any
actual CUDA work still fails ("Torch not compiled with CUDA enabled"). A job
that names `trainer_config.device=cpu` must run as it does on a real GPU host.
"""

import os

_gpus = os.environ.get("MINGPT_TEST_FAKE_CUDA")
if _gpus:
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: int(_gpus)
