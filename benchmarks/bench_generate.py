"""Text generation: tokens/s of the decoding step against its floor, compiled or
not, several samples as one batch, and full recomputation as the baseline.

    python benchmarks/bench_generate.py [--max-new-tokens 500] [--threads N] [--rounds 3] [--device cpu]
        [--no-compile] [--no-uncached] [--baseline OLD_DECODING_PY]

A randomly initialised 6-layer, 6-head, 384-dim model with block_size 256 and
a vocabulary of 65 (the tiny-shakespeare shape; speed does not depend on the
weights) generates from a one-character prompt. Rows, each the median of
--rounds alternating rounds, so that the machine's drifts hit every row alike:

- cached: mingpt.decoding.generate with the KV cache, eager or compiled
  (torch.compile of the fixed-shape step; its compile time is reported apart);
  with N samples, the N rows are one batch;
- uncached: the same context policy, recomputing the whole window per token;
- sliding window: the whole last block_size tokens recomputed per token with no
  cache, as nanoGPT's `generate` does (the baseline of the targets);
- baseline (--baseline FILE): the same cached rows with the generate of
  another version's decoding.py, in the same rounds (a before/after side by side);
- floor: the matmuls of one decoding step alone, F.linear on the same weights
  and shapes in a loop, eager or compiled as the compiled step runs them; "of
  floor" is floor time / step time (the compiled step against the compiled
  floor), and the memory speed (the weights read once by a sum) is printed
  below the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# run from a clone without installing
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mingpt.config import GPTConfig  # noqa: E402
from mingpt.decoding import compile_for_decoding, generate, next_token  # noqa: E402
from mingpt.model import GPT  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def seconds_generating(
    model: GPT, n_tokens: int, device: torch.device, samples: int = 1, decoding=None, **kwargs
) -> float:
    """Seconds to generate n_tokens per sample with mingpt.decoding.generate, or with
    the generate of `decoding` (another version's module, --baseline)."""
    idx = torch.zeros(samples, 1, dtype=torch.long, device=device)
    generators = [torch.Generator(device).manual_seed(i) for i in range(samples)]
    started = time.perf_counter()
    for tokens in (decoding.generate if decoding else generate)(
        model, idx, n_tokens, generator=generators, **kwargs
    ):
        # wait for the device, as a streaming caller does (once per chunk, or per token)
        tokens[0, -1].item()
    return time.perf_counter() - started


def load_baseline(path: str):
    """A decoding.py of another version, imported beside this one (it imports mingpt.model
    from this checkout: the model's code must be the same)."""
    spec = importlib.util.spec_from_file_location("baseline_decoding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.inference_mode()
def seconds_sliding(model: GPT, n_tokens: int, device: torch.device) -> float:
    """No cache: each token recomputes the last block_size tokens (a sliding window)."""
    idx = torch.zeros(1, 1, dtype=torch.long, device=device)
    generator = torch.Generator(device).manual_seed(0)
    started = time.perf_counter()
    for _ in range(n_tokens):
        logits, _ = model(idx[:, -model.config.block_size :])
        token = next_token(logits[:, -1], generator=generator)
        token.item()
        idx = torch.cat([idx, token], dim=1)
    return time.perf_counter() - started


def floor(model: GPT, device: torch.device, samples: int = 1, compiled: bool = False):
    """A function of n_steps timing the matmuls of n_steps decoding steps and
    nothing else: F.linear on the step's weights and shapes, as the eager step
    runs them, or compiled as the compiled step runs them (on CPU, one-row
    products become reductions over the weights)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(samples, m.in_features, device=device) for m in linears]

    def matmuls(xs):
        return [F.linear(x, m.weight, m.bias) for x, m in zip(xs, linears)]

    run = compile_for_decoding(matmuls, device) if compiled else matmuls

    @torch.inference_mode()
    def seconds(n_steps: int) -> float:
        sync(device)
        started = time.perf_counter()
        for _ in range(n_steps):
            run(inputs)
        sync(device)
        return time.perf_counter() - started

    return seconds


def seconds_streaming(device: torch.device, nbytes: int) -> float:
    """Seconds to read nbytes of float32 once (a sum over a fresh tensor of that
    size): the memory-speed floor of anything that reads every weight."""
    data = torch.ones(nbytes // 4, device=device)
    data.sum()
    sync(device)
    started = time.perf_counter()
    for _ in range(5):
        data.sum()
    sync(device)
    return (time.perf_counter() - started) / 5


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled step")
    parser.add_argument(
        "--no-uncached", action="store_true", help="skip the two recomputing baselines (slow)"
    )
    parser.add_argument(
        "--baseline",
        metavar="DECODING_PY",
        help="also time the generate of this file, another version's mingpt/decoding.py "
        "(git show REV:mingpt/decoding.py > old.py), in the same rounds: rows 'baseline: ...'",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=65, block_size=256)
    model = GPT(config).to(device).eval()
    n = args.max_new_tokens

    rows = {  # name -> (samples, function of the token count returning seconds)
        "floor (matmuls only)": (1, floor(model, device)),
        "cached, eager": (1, lambda k: seconds_generating(model, k, device)),
        "cached, 4 samples": (4, lambda k: seconds_generating(model, k, device, 4)),
        "cached, 16 samples": (16, lambda k: seconds_generating(model, k, device, 16)),
        "floor, 16 samples": (16, floor(model, device, 16)),
    }
    old = load_baseline(args.baseline) if args.baseline else None
    if old:
        rows["baseline: cached, eager"] = (
            1,
            lambda k: seconds_generating(model, k, device, decoding=old),
        )
        rows["baseline: 16 samples"] = (
            16,
            lambda k: seconds_generating(model, k, device, 16, decoding=old),
        )
    compile_seconds = None
    if not args.no_compile:
        started = time.perf_counter()
        seconds_generating(model, 8, device, compile=True)  # compiles the step
        compile_seconds = time.perf_counter() - started - seconds_generating(model, 8, device)
        rows["floor, compiled matmuls"] = (1, floor(model, device, compiled=True))
        rows["cached, compiled"] = (1, lambda k: seconds_generating(model, k, device, compile=True))
        rows["compiled, 16 samples"] = (
            16,
            lambda k: seconds_generating(model, k, device, 16, compile=True),
        )
        if old:
            rows["baseline: compiled"] = (
                1,
                lambda k: seconds_generating(model, k, device, decoding=old, compile=True),
            )
            rows["baseline: compiled, 16 samples"] = (
                16,
                lambda k: seconds_generating(model, k, device, 16, decoding=old, compile=True),
            )
    if not args.no_uncached:
        rows["uncached (restarting window)"] = (
            1,
            lambda k: seconds_generating(model, k, device, use_cache=False),
        )
        rows["sliding window, no cache"] = (1, lambda k: seconds_sliding(model, k, device))
    for _, run in rows.values():  # warm up every path
        run(8)
    times = {name: [] for name in rows}
    for r in range(args.rounds):
        for name, (_, run) in rows.items():
            times[name].append(run(n))
            print(f"round {r + 1}: {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    seconds = {name: statistics.median(t) for name, t in times.items()}

    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"command: python {' '.join(sys.argv)}")
    where = (
        f"{cpu_name()}, {os.cpu_count()} cores"
        if device.type == "cpu"
        else torch.cuda.get_device_name(device)
    )
    print(f"torch {torch.__version__} on {device} ({where}), {torch.get_num_threads()} threads")
    print(f"load average: {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "")
    print(
        f"model: 6 layers, 6 heads, 384 dim, block 256, vocab 65, {model.num_params() / 1e6:.1f}M parameters; "
        f"{n} new tokens per sample, medians of {args.rounds} alternating rounds"
    )
    print()
    print(
        f"| {'decoding':<30} | {'samples':>7} | {'seconds':>8} | {'tokens/s':>9} | {'ms/step':>8} | {'of floor':>8} |"
    )
    print(f"|{'-' * 32}|{'-' * 9}|{'-' * 10}|{'-' * 11}|{'-' * 10}|{'-' * 10}|")
    floors = {1: seconds["floor (matmuls only)"], 16: seconds["floor, 16 samples"]}
    for name, (samples, _) in rows.items():
        s = seconds[name]
        base = (
            seconds["floor, compiled matmuls"]
            if name == "cached, compiled"
            else floors.get(samples)
        )
        of_floor = (
            f"{base / s:.0%}"
            if base is not None and name.startswith(("cached", "compiled"))
            else ""
        )
        print(
            f"| {name:<30} | {samples:>7} | {s:>8.2f} | {samples * n / s:>9.1f} | {s / n * 1e3:>8.2f} | {of_floor:>8} |"
        )
    weights = (
        sum(
            m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
            for m in model.modules()
            if isinstance(m, nn.Linear)
        )
        * 4
    )
    streaming = seconds_streaming(device, weights)
    print(
        f"\nmemory speed: the step's {weights / 1e6:.1f} MB of matmul weights read once in {streaming * 1e3:.2f} ms "
        f"({weights / streaming / 1e9:.1f} GB/s, a sum over a tensor of that size); the eager one-row matmuls "
        f"stream them at {weights / (seconds['floor (matmuls only)'] / n) / 1e9:.1f} GB/s"
        + (
            f", the compiled ones at {weights / (seconds['floor, compiled matmuls'] / n) / 1e9:.1f} GB/s"
            if compile_seconds is not None
            else ""
        )
    )
    print()
    one = seconds["cached, eager"]
    print(
        f"16 samples in {seconds['cached, 16 samples'] / one:.2f}x the time of one (eager), "
        f"4 samples in {seconds['cached, 4 samples'] / one:.2f}x"
    )
    if compile_seconds is not None:
        saved = one - seconds["cached, compiled"]
        print(
            f"compile: {compile_seconds:.1f} s (first call, this process; the inductor cache may be warm); "
            f"saves {saved / n * 1e3:.2f} ms/token, {saved:.2f} s per {n} tokens: "
            + (
                f"pays off after {compile_seconds / saved * n:,.0f} tokens"
                if saved > 0
                else "never pays off"
            )
        )
    if not args.no_uncached:
        base = seconds["sliding window, no cache"]
        print(
            f"one sample, cached eager vs sliding window without cache: {base / one:.1f}x"
            + (
                f", compiled: {base / seconds['cached, compiled']:.1f}x"
                if compile_seconds is not None
                else ""
            )
        )
        print(
            f"cached eager vs uncached restarting window: {seconds['uncached (restarting window)'] / one:.1f}x"
        )


if __name__ == "__main__":
    main()
