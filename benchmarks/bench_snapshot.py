"""What verifying a snapshot's checksums costs, next to the rest of a load.

usage: python benchmarks/bench_snapshot.py [preset] [directory]   (defaults: gpt2, a temporary directory)

Builds the preset's model with a vocabulary of 65 and block 1024 (gpt2: 86M
parameters) with AdamW state, saves it with mingpt.snapshot.single_file.save
(1.03 GB for gpt2: weights and two moments in fp32), then times, alternating,
in 3 rounds: reading the file's bytes, single_file.verify (every zip record's
CRC-32), and torch.load of the verified bytes. Prints the medians.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time

import torch
from omegaconf import OmegaConf

from mingpt.snapshot import single_file
from mingpt.config import GPTConfig
from mingpt.model import GPT

from _cli import help_or_go_on


def preset_with_moments(preset: str, vocab_size: int, grad: float = 0.0):
    """(config, model, AdamW) of a preset's shape, block 1024, after one step with
    gradients `grad`: the optimizer holds both moments, as in a real snapshot."""
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "gpt_config")
    shape = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GPTConfig),
                                                OmegaConf.load(os.path.join(conf, f"{preset}.yaml"))))
    config = GPTConfig(**{**vars(shape), "vocab_size": vocab_size, "block_size": 1024})
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return config, model, optimizer


def main() -> None:
    help_or_go_on(__doc__)
    preset = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    directory = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
    config, model, optimizer = preset_with_moments(preset, vocab_size=65)
    state = {"model_state": model.state_dict(), "optimizer_state": optimizer.state_dict(), "gpt_config": vars(config),
             "vocab": "x" * 65, "epoch": 0, "samples_in_epoch": 0, "step": 1}
    path = os.path.join(directory, "bench-snapshot.pt")
    single_file.save(state, path)
    size = os.path.getsize(path)
    del state, optimizer, model
    print(f"{preset}: {config.n_layer}/{config.n_head}/{config.n_embd}, snapshot {size / 1e9:.2f} GB at {path}")

    times: dict[str, list[float]] = {"read": [], "verify": [], "torch.load": []}
    for _ in range(3):
        start = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        times["read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        single_file.verify(data, path)
        times["verify"].append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        times["torch.load"].append(time.perf_counter() - start)
        del data
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:>10}: {median:.2f} s median of {len(values)} ({size / 1e9 / median:.2f} GB/s), "
              f"all: {', '.join(f'{v:.2f}' for v in values)}")
    os.remove(path)


if __name__ == "__main__":
    main()
