"""Tokens/s of text generation with and without the key/value cache.

    python benchmarks/bench_generate.py [--max-new-tokens 500] [--threads N] [--device cpu]

A randomly initialised 6-layer, 6-head, 384-dim model with block_size 256 and
a vocabulary of 65 (the tiny-shakespeare shape; speed does not depend on the
weights) generates one sample from a one-character prompt, once with the cache
and once recomputing the whole window for every token. Past block_size both
follow the same context policy (mingpt/sample.py), so they do the same
predictions; the cache only saves work.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from mingpt.config import GPTConfig
from mingpt.model import GPT
from mingpt.sample import generate


def tokens_per_second(model: GPT, max_new_tokens: int, use_cache: bool, device: torch.device) -> float:
    idx = torch.zeros(1, 1, dtype=torch.long, device=device)
    generator = torch.Generator(device).manual_seed(0)
    started = time.perf_counter()
    for token in generate(model, idx, max_new_tokens, generator=generator, use_cache=use_cache):
        token.item()  # wait for the device, as a streaming caller does
    return max_new_tokens / (time.perf_counter() - started)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=65, block_size=256)
    model = GPT(config).to(device).eval()

    for use_cache in (True, False):  # warm up both paths
        tokens_per_second(model, 8, use_cache, device)
    cached = tokens_per_second(model, args.max_new_tokens, True, device)
    uncached = tokens_per_second(model, args.max_new_tokens, False, device)

    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"command: python {' '.join(sys.argv)}")
    where = f"{cpu_name()}, {os.cpu_count()} cores" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"torch {torch.__version__} on {device} ({where}), {torch.get_num_threads()} threads")
    print(f"model: 6 layers, 6 heads, 384 dim, block 256, vocab 65, {model.num_params() / 1e6:.1f}M parameters; "
          f"one sample of {args.max_new_tokens} new tokens")
    print()
    print(f"| {'decoding':<18} | {'tokens/s':>9} |")
    print(f"|{'-' * 20}|{'-' * 11}|")
    print(f"| {'with the cache':<18} | {cached:>9.1f} |")
    print(f"| {'without the cache':<18} | {uncached:>9.1f} |")
    print(f"\nspeed-up with the cache: {cached / uncached:.1f}x")


if __name__ == "__main__":
    main()
