"""The host work of a decoding step: tokens/s of a 1-layer, 1-head, 32-dim model
(block 256, vocabulary 65), whose step is mostly the work around the model
(sampling, bookkeeping, reading tokens back), one sample and 16, eager and
compiled; optionally beside another version's decoding.py in the same rounds.

    python benchmarks/bench_decode_overhead.py [--baseline OLD_DECODING_PY] [--tokens 2000] [--rounds 5]
        [--threads 1] [--no-compile]

(`git show REV:mingpt/decoding.py > old.py` makes OLD_DECODING_PY.) Rows are
medians of --rounds alternating rounds; each chunk (or token, for a version
that yields one at a time) is read back as a streaming caller does.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# run from a clone without installing
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_generate import load_baseline  # noqa: E402

import mingpt.decoding as current  # noqa: E402
from mingpt.config import GPTConfig  # noqa: E402
from mingpt.model import GPT  # noqa: E402


def seconds(decoding, model: GPT, n_tokens: int, samples: int, compile: bool) -> float:
    idx = torch.zeros(samples, 1, dtype=torch.long)
    generators = [torch.Generator().manual_seed(i) for i in range(samples)]
    started = time.perf_counter()
    for tokens in decoding.generate(model, idx, n_tokens, generator=generators, compile=compile):
        tokens[0, -1].item()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline", metavar="DECODING_PY", help="another version's mingpt/decoding.py"
    )
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, vocab_size=65, block_size=256)).eval()
    versions = {"now": current}
    if args.baseline:
        versions["before"] = load_baseline(args.baseline)
    rows = {
        (version, samples, compile): module
        for compile in ((False,) if args.no_compile else (False, True))
        for samples in (1, 16)
        for version, module in versions.items()
    }
    for (_, samples, compile), module in rows.items():  # warm up, compile
        seconds(module, model, 8, samples, compile)
    times = {row: [] for row in rows}
    for _ in range(args.rounds):
        for row, module in rows.items():
            times[row].append(seconds(module, model, args.tokens, row[1], row[2]))
    print(
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{args.tokens} tokens per sample, medians of {args.rounds} alternating rounds\n")
    print("| decoding | version | samples | µs/step | tokens/s |\n|---|---|---|---|---|")
    for (version, samples, compile), t in times.items():
        s = statistics.median(t)
        print(
            f"| {'compiled' if compile else 'eager'} | {version} | {samples} | {s / args.tokens * 1e6:,.0f} | "
            f"{samples * args.tokens / s:,.0f} |"
        )


if __name__ == "__main__":
    main()
