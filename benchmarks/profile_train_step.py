"""Where a CPU training step's time goes, and what compiling saves.

    python benchmarks/profile_train_step.py [--threads N] [--rounds 8] [--no-compile]

The default CPU shape (4 layers, 4 heads, 128 dims, block 64, batch 12, fp32,
dropout 0), as a bare step: forward, backward, clipping, fused AdamW. It prints
the torch.profiler table of the eager step grouped into matmuls, attention,
GELU, LayerNorm, optimizer and the rest, then the median ms/step of three
variants in alternating rounds: eager, each Block compiled (`Block.compile()`,
one graph shared by the blocks), and the whole model compiled, with the time
each took to compile (the inductor cache in TORCHINDUCTOR_CACHE_DIR, by default
under /tmp, makes a second run's compile warm).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import profile

# run from a clone without installing
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mingpt.config import GPTConfig, OptimizerConfig  # noqa: E402
from mingpt.model import GPT  # noqa: E402
from mingpt.optim import create_optimizer  # noqa: E402

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=128, dropout=0.0, vocab_size=65, block_size=64)
GROUPS = {  # profiler op name fragment -> group, first match wins
    "mm": "matmuls (mm, addmm)",
    "scaled_dot_product": "attention (SDPA fwd+bwd)",
    "gelu": "GELU fwd+bwd",
    "layer_norm": "LayerNorm fwd+bwd",
    "adamw": "optimizer (fused AdamW)",
}


def build(variant: str):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    forward = model
    if variant == "blocks compiled":
        for block in model.h:
            block.compile()
    elif variant == "model compiled":
        forward = torch.compile(model)
    return model, forward, create_optimizer(model, OptimizerConfig())


def steps(built, batch: torch.Tensor, n: int) -> None:
    model, forward, optimizer = built
    for _ in range(n):
        _, loss = forward(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = torch.randint(
        0,
        CONFIG.vocab_size,
        (12, CONFIG.block_size + 1),
        generator=torch.Generator().manual_seed(0),
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, 4/4/128, block 64, batch 12, fp32"
    )

    eager = build("eager")
    steps(eager, batch, 5)
    with profile() as prof:
        steps(eager, batch, 20)
    groups = defaultdict(float)
    for event in prof.key_averages():
        name = event.key.lower()
        group = next((g for fragment, g in GROUPS.items() if fragment in name), "everything else")
        groups[group] += event.self_cpu_time_total / 20 / 1e3  # ms per step
    total = sum(groups.values())
    print(f"\nprofile of the eager step (self CPU time, {total:.1f} ms/step under the profiler):")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:<28} {ms:7.2f} ms  {ms / total:5.1%}")

    variants = {"eager": eager}
    if not args.no_compile:
        for variant in ("blocks compiled", "model compiled"):
            started = time.perf_counter()
            variants[variant] = build(variant)
            steps(variants[variant], batch, 2)
            print(f"{variant}: first two steps (compiling) {time.perf_counter() - started:.1f} s")
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant, built in variants.items():
            started = time.perf_counter()
            steps(built, batch, 10)
            times[variant].append((time.perf_counter() - started) / 10)
    base = statistics.median(times["eager"])
    print(f"\nmedian of {args.rounds} alternating rounds of 10 steps:")
    for variant, t in times.items():
        print(
            f"  {variant:<16} {statistics.median(t) * 1e3:7.1f} ms/step  {base / statistics.median(t):.2f}x eager"
        )


if __name__ == "__main__":
    main()
