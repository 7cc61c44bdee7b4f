"""Text generation: tokens/s of the decoding step against its floor, compiled or not, several
samples as one batch, full recomputation as the baseline, and another version's model and decoding
beside this one.

usage: python benchmarks/bench_generate.py [--shape 6/6/384] [--max-new-tokens 500] [--threads N]
           [--rounds 3] [--device cpu] [--no-compile] [--no-uncached] [--baseline REV]

A randomly initialised model of --shape (layers/heads/dims; by default 6/6/384, the tiny-shakespeare
shape) with block_size 256 and a vocabulary of 65 (speed does not depend on the weights) generates
from a one-character prompt. With --shape 1/1/32 a step is mostly the host work around the model
(sampling, bookkeeping, reading tokens back). Rows, each the median of --rounds alternating rounds,
so that the machine's drifts hit every row alike:

- cached: mingpt.decoding.generate with the KV cache, eager or compiled (on a CPU the AOTInductor
  package that generate keeps, compiled here into a directory of this run's, its compile and load
  times reported apart; elsewhere torch.compile of the fixed-shape step); with N samples, the N rows
  are one batch;
- uncached: the same context policy, recomputing the whole window per token;
- sliding window: the whole last block_size tokens recomputed per token with no cache, as nanoGPT's
  `generate` does (the baseline of the targets);
- baseline (--baseline REV, a git revision of this checkout, such as HEAD~1): the same cached rows
  with that version's mingpt/model.py and mingpt/decoding.py, on the same weights, in the same
  rounds: a change to either is measured against its parent in one process;
- floor: the matmuls of one decoding step alone, on the same weights and shapes in a loop, as the
  eager step runs them (F.linear, or oneDNN's where it is faster: decoding.step_linear) or as the
  compiled step does; "of floor" is floor time / step time (the
  compiled step against the compiled floor), and the memory speed (the weights read once by a sum)
  is printed below the table.

Each chunk (or token, for a version that yields one at a time) is read back as a streaming caller
does. On a CPU the last line says what `python -m mingpt.generate`'s compile=auto does there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import types

import torch
import torch.nn.functional as F
from _common import REPO, device, fail, machine, parser, positive, run_main, seconds
from torch import nn

from mingpt import decoding
from mingpt.config import GPTConfig
from mingpt.generate import GenerateConfig, compile_pays_after, should_compile
from mingpt.model import GPT


def shape(text: str) -> tuple[int, int, int]:
    """--shape: layers/heads/dims, each at least 1, the heads dividing the dims."""
    parts = text.split("/")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != 3:
        raise argparse.ArgumentTypeError(
            f"expected layers/heads/dims, three whole numbers such as 6/6/384, got {text!r}"
        )
    layers, heads, dims = values
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"layers, heads and dims are each >= 1, got {text!r}")
    if dims % heads:
        raise argparse.ArgumentTypeError(f"the heads ({heads}) must divide the dims ({dims})")
    return layers, heads, dims


def revision(text: str) -> str:
    """--baseline: a git revision of this checkout, checked before any measuring."""
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{text}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
    )
    if found.returncode != 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a revision of this checkout")
    return text


OPTIONS = parser(__doc__)
OPTIONS.add_argument("--shape", type=shape, default="6/6/384", help="layers/heads/dims")
OPTIONS.add_argument("--max-new-tokens", type=positive, default=500)
OPTIONS.add_argument(
    "--threads", type=positive, help="torch intra-op threads (default: torch's choice)"
)
OPTIONS.add_argument("--rounds", type=positive, default=3)
OPTIONS.add_argument("--device", type=device, default="cpu")
OPTIONS.add_argument("--no-compile", action="store_true", help="skip the compiled step")
OPTIONS.add_argument(
    "--no-uncached", action="store_true", help="skip the two recomputing baselines (slow)"
)
OPTIONS.add_argument(
    "--baseline",
    type=revision,
    metavar="REV",
    help="also time the model and decoding of this git revision (HEAD~1, a tag, a hash) on the "
    "same weights, in the same rounds: rows 'baseline: ...'",
)


def generating(model: GPT, device: torch.device, samples: int = 1, module=decoding, **kwargs):
    """A function of n_tokens: seconds to generate them per sample with `module`'s generate."""

    def run(n_tokens: int) -> float:
        idx = torch.zeros(samples, 1, dtype=torch.long, device=device)
        generators = [torch.Generator(device).manual_seed(i) for i in range(samples)]
        start = time.perf_counter()
        for tokens in module.generate(model, idx, n_tokens, generator=generators, **kwargs):
            tokens[0, -1].item()  # wait for the device, as a streaming caller does
        return time.perf_counter() - start

    return run


def version_of(rev: str, name: str) -> types.ModuleType:
    """mingpt/<name>.py as it is at git revision rev, imported under a name of its own."""
    path = f"mingpt/{name}.py"
    shown = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True
    )
    if shown.returncode != 0:
        fail(f"--baseline {rev}: {shown.stderr.strip()}")
    module = types.ModuleType(f"{name}_at_{rev}")
    sys.modules[module.__name__] = module
    exec(compile(shown.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def load_baseline(rev: str, model: GPT, device: torch.device) -> tuple[nn.Module, types.ModuleType]:
    """Revision rev's model, with this model's weights, and its decoding, which imports that model
    (both import this checkout's mingpt.config)."""
    old_model = version_of(rev, "model")
    ours = sys.modules["mingpt.model"]
    sys.modules["mingpt.model"] = old_model
    try:
        old_decoding = version_of(rev, "decoding")
    finally:
        sys.modules["mingpt.model"] = ours
    baseline = old_model.GPT(model.config).to(device).eval()
    baseline.load_state_dict(model.state_dict())
    return baseline, old_decoding


def sliding(model: GPT, device: torch.device):
    """No cache: each token recomputes the last block_size tokens (a sliding window)."""

    @torch.inference_mode()
    def run(n_tokens: int) -> float:
        idx = torch.zeros(1, 1, dtype=torch.long, device=device)
        generator = torch.Generator(device).manual_seed(0)
        start = time.perf_counter()
        for _ in range(n_tokens):
            logits, _ = model(idx[:, -model.config.block_size :])
            token = decoding.next_token(logits[:, -1], generator=generator)
            token.item()
            idx = torch.cat([idx, token], dim=1)
        return time.perf_counter() - start

    return run


def floor(model: GPT, device: torch.device, samples: int = 1, compiled: bool = False):
    """A function of n_steps timing the matmuls of n_steps decoding steps and nothing else: on the
    step's weights and shapes, as the eager step runs them, or compiled as the compiled step runs
    them (on CPU, one-row products become reductions over the weights)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(samples, m.in_features, device=device) for m in linears]
    linear = F.linear
    if not compiled:
        linear = decoding.step_linear(model, samples)

    def matmuls(xs):
        return [linear(x, m.weight, m.bias) for x, m in zip(xs, linears, strict=True)]

    run_matmuls = decoding.compile_for_decoding(matmuls, device) if compiled else matmuls

    @torch.inference_mode()
    def run(n_steps: int) -> float:
        def steps() -> None:
            for _ in range(n_steps):
                run_matmuls(inputs)

        return seconds(steps, device)

    return run


def rows(model: GPT, device: torch.device, args) -> dict[str, tuple[int, object]]:
    """name -> (samples, function of the token count returning seconds)."""
    table = {
        "floor (matmuls only)": (1, floor(model, device)),
        "cached, eager": (1, generating(model, device)),
        "cached, 4 samples": (4, generating(model, device, 4)),
        "cached, 16 samples": (16, generating(model, device, 16)),
        "floor, 16 samples": (16, floor(model, device, 16)),
    }
    if args.baseline:
        old, module = load_baseline(args.baseline, model, device)
        table["baseline: cached, eager"] = (1, generating(old, device, module=module))
        table["baseline: 16 samples"] = (16, generating(old, device, 16, module=module))
    if not args.no_compile:
        table["floor, compiled matmuls"] = (1, floor(model, device, compiled=True))
        table["cached, compiled"] = (1, generating(model, device, compile=True))
        table["compiled, 16 samples"] = (16, generating(model, device, 16, compile=True))
    if args.baseline and not args.no_compile:
        table["baseline: compiled"] = (1, generating(old, device, module=module, compile=True))
        table["baseline: compiled, 16 samples"] = (
            16,
            generating(old, device, 16, module=module, compile=True),
        )
    if not args.no_uncached:
        table["uncached (restarting window)"] = (1, generating(model, device, use_cache=False))
        table["sliding window, no cache"] = (1, sliding(model, device))
    return table


def measure(table: dict, n: int, rounds: int) -> dict[str, float]:
    """Median seconds of each row, rounds alternating; every path warmed up first."""
    for _, run in table.values():
        run(8)
    times = {name: [] for name in table}
    for r in range(rounds):
        for name, (_, run) in table.items():
            times[name].append(run(n))
            print(f"round {r + 1}: {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    return {name: statistics.median(t) for name, t in times.items()}


def print_table(table: dict, secs: dict[str, float], n: int) -> None:
    print(
        f"| {'decoding':<30} | {'samples':>7} | {'seconds':>8} | {'tokens/s':>9} | {'ms/step':>8} "
        f"| {'of floor':>8} |"
    )
    print(f"|{'-' * 32}|{'-' * 9}|{'-' * 10}|{'-' * 11}|{'-' * 10}|{'-' * 10}|")
    floors = {1: secs["floor (matmuls only)"], 16: secs["floor, 16 samples"]}
    if "floor, compiled matmuls" in secs:
        floors["compiled"] = secs["floor, compiled matmuls"]
    for name, (samples, _) in table.items():
        s = secs[name]
        of_floor = ""
        base = floors.get("compiled" if name == "cached, compiled" else samples)
        if base is not None and name.startswith(("cached", "compiled")):
            of_floor = f"{base / s:.0%}"
        print(
            f"| {name:<30} | {samples:>7} | {s:>8.2f} | {samples * n / s:>9.1f} "
            f"| {s / n * 1e3:>8.3f} | {of_floor:>8} |"
        )


def memory_speed(model: GPT, device: torch.device, secs: dict[str, float], n: int) -> str:
    """The step's matmul weights read once by a sum over a fresh tensor of their size (the
    memory-speed floor of anything that reads every weight), against the floors' speed."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weights = 4 * sum(sum(p.numel() for p in m.parameters()) for m in linears)
    data = torch.ones(weights // 4, device=device)
    data.sum()
    streaming = seconds(lambda: [data.sum() for _ in range(5)], device) / 5
    line = (
        f"memory speed: the step's {weights / 1e6:.1f} MB of matmul weights read once in "
        f"{streaming * 1e3:.2f} ms ({weights / streaming / 1e9:.1f} GB/s, a sum over a tensor of "
        f"that size); the eager one-row matmuls stream them at "
        f"{weights / (secs['floor (matmuls only)'] / n) / 1e9:.1f} GB/s"
    )
    if "floor, compiled matmuls" in secs:
        compiled = weights / (secs["floor, compiled matmuls"] / n)
        line += f", the compiled ones at {compiled / 1e9:.1f} GB/s"
    return line


def compile_seconds(model: GPT, device: torch.device) -> float:
    """The first compiled call's time less an eager one's: compiling the step (on a CPU into a
    package of this run's directory), and on a CPU the time to load that package."""
    compiled = generating(model, device, compile=True)(8)
    if device.type == "cpu" and decoding.can_package():
        path = decoding.package_path(model, 1)
        load = min(timeit.repeat(lambda: decoding.load_package(path, model), number=1, repeat=5))
        print(
            f"compiled step kept in {path.stat().st_size / 1e6:.1f} MB, "
            f"loaded in {load * 1e3:.1f} ms"
        )
    return compiled - generating(model, device)(8)


def summary(secs: dict[str, float], n: int, compiling: float | None) -> None:
    one = secs["cached, eager"]
    print(
        f"16 samples in {secs['cached, 16 samples'] / one:.2f}x the time of one (eager), "
        f"4 samples in {secs['cached, 4 samples'] / one:.2f}x"
    )
    if "baseline: cached, eager" in secs:
        print(
            f"against the baseline: one sample in {one / secs['baseline: cached, eager']:.3f}x its "
            f"time, 16 samples in {secs['cached, 16 samples'] / secs['baseline: 16 samples']:.3f}x"
        )
    if compiling is not None:
        saved = one - secs["cached, compiled"]
        pays = "never pays off"
        if saved > 0:
            pays = f"pays off after {compiling / saved * n:,.0f} tokens"
        print(
            f"compile: {compiling:.1f} s (first call, this process; the inductor cache may be "
            "warm); "
            f"saves {saved / n * 1e3:.2f} ms/token, {saved:.2f} s per {n} tokens: {pays}"
        )
    if "sliding window, no cache" in secs:
        base = secs["sliding window, no cache"]
        line = f"one sample, cached eager vs sliding window without cache: {base / one:.1f}x"
        if compiling is not None:
            line += f", compiled: {base / secs['cached, compiled']:.1f}x"
        print(line)
        restarting = secs["uncached (restarting window)"]
        print(f"cached eager vs uncached restarting window: {restarting / one:.1f}x")


def main() -> None:
    args = OPTIONS.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    layers, heads, dims = args.shape
    torch.manual_seed(0)
    config = GPTConfig(n_layer=layers, n_head=heads, n_embd=dims, vocab_size=65, block_size=256)
    model = GPT(config).to(device).eval()
    n = args.max_new_tokens
    kept = tempfile.TemporaryDirectory()  # compiled steps: this run's, not the user's
    os.environ["XDG_CACHE_HOME"] = kept.name
    # the command's own rule, asked about one long sample before any step is kept
    policy = "eager unless an earlier run kept a compiled step"
    if should_compile(GenerateConfig(max_new_tokens=10**9), model, device):
        policy = f"compiled from {compile_pays_after(device):,} characters, or where kept"
    compiling = None if args.no_compile else compile_seconds(model, device)
    table = rows(model, device, args)
    secs = measure(table, n, args.rounds)
    print(machine(device))
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"model: {layers} layers, {heads} heads, {dims} dims, block 256, vocab 65, "
        f"{model.num_params() / 1e6:.2f}M parameters; {n} new tokens per sample, medians of "
        f"{args.rounds} alternating rounds\n"
    )
    print_table(table, secs, n)
    print()
    print(memory_speed(model, device, secs, n))
    print()
    summary(secs, n, compiling)
    if device.type == "cpu":
        print(f"compile=auto on this CPU (python -m mingpt.generate, one sample): {policy}")


if __name__ == "__main__":
    run_main(main)
