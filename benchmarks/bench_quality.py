"""Time to quality: how long each optimizer takes to reach the held-out loss of nanoGPT's own CPU
recipe, at the default CPU shape (4 layers, 4 heads, 128 dims, block 64, batch 12).

usage: python benchmarks/bench_quality.py --nanogpt DIR [--seeds N] [--jobs J] [--rounds R]
                                          [--threads T] [--out DIR] [NAME=key=value,key=value ...]

DIR is a checkout of karpathy/nanoGPT (its model.py is imported). For each seed:
  nanogpt   nanoGPT's model and its README's CPU recipe (2,000 steps, AdamW lr 1e-3 with 100
            warmup steps, cosine to 1e-4, betas 0.9/0.99, weight decay 0.1 as its
            configure_optimizers groups it, gradient clip 1.0, random windows), trained here
  adamw     python main.py, the default run (2,616 steps)
  muon      python main.py optimizer_config=muon
  NAME=...  python main.py with these overrides (e.g. lr6e-3=optimizer_config.learning_rate=6e-3)
Every run is evaluated every 100 steps in the same way: mingpt's evaluation of the whole held-out
split of data/input.txt (the corpus's last tenth, non-overlapping windows of 64). The target is the
mean over the seeds of nanoGPT's best held-out loss. Step counts do not depend on the machine's
load, so the runs go J at a time with one thread each; the time of a step is then measured apart:
nanoGPT's and mingpt's with each optimizer algorithm (nothing else in a variant changes a step's
work), single steps of each in turn, R rounds, in this one process (T threads, 2 by default): the
median step, robust to bursts of other load. Printed, as a Markdown table: for each run, the first
evaluated step at or below the target (each seed's), its wall time (steps x the step time) against
nanoGPT's, and the held-out loss at the run's end. Runs already in --out DIR (nanoGPT's evaluations,
mingpt runs that ended) are kept by name, not run again: a later command adds variants to the table
(a fresh DIR after the code or its defaults change).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import (
    REPO,
    Plain,
    heldout_loss,
    machine,
    medians,
    nanogpt,
    nanogpt_checkout,
    parser,
    plain_step,
    positive,
    run_main,
    seconds,
    training_config,
    writable_dir,
)

from mingpt.config import DataConfig, GPTConfig, OptimizerConfig
from mingpt.data import load_data
from mingpt.model import GPT
from mingpt.optim import create_optimizer

CORPUS = REPO / "data" / "input.txt"
SHAPE = GPTConfig(n_layer=4, n_head=4, n_embd=128, dropout=0.0, block_size=64)
BATCH = 12
EVAL_EVERY = 100
NANOGPT_STEPS = 2000
VARIANTS = {"adamw": [], "muon": ["optimizer_config=muon"]}

OPTIONS = parser(__doc__)
OPTIONS.add_argument("--nanogpt", type=nanogpt_checkout, required=True, metavar="DIR")
OPTIONS.add_argument("--seeds", type=positive, default=3)
OPTIONS.add_argument("--jobs", type=positive, default=2)
OPTIONS.add_argument("--rounds", type=positive, default=200)
OPTIONS.add_argument("--threads", type=positive, default=2)
OPTIONS.add_argument("--out", type=writable_dir)
OPTIONS.add_argument("variants", nargs="*", metavar="NAME=key=value,key=value")


class FullLogits(torch.nn.Module):
    """nanoGPT's model called with targets, so that it returns the logits of every position."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        x = x.contiguous()
        return self.model(x, x)[0], None


def recipe(directory: str, vocab_size: int) -> Plain:
    """nanoGPT's model and optimizer as its CPU recipe configures them."""
    shape = GPTConfig(**{**vars(SHAPE), "vocab_size": vocab_size})
    model, optimizer = nanogpt(
        directory,
        shape,
        bias=False,
        betas=(0.9, 0.99),
        weight_decay=0.1,
        learning_rate=1e-3,
        device=torch.device("cpu"),
    )
    return Plain(model, model, optimizer)


def recipe_lr(step: int) -> float:
    """The recipe's schedule: linear warmup over 100 steps, cosine from 1e-3 to 1e-4 at 2,000."""
    if step < 100:
        return 1e-3 * (step + 1) / 101
    coeff = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 100) / (NANOGPT_STEPS - 100))))
    return 1e-4 + coeff * (1e-3 - 1e-4)


def nanogpt_run(directory: str, seed: int, out: Path) -> list[tuple[int, float]]:
    """nanoGPT's recipe, evaluated every EVAL_EVERY steps: [(step, held-out loss)], kept in
    `out`."""
    kept = out / f"nanogpt-{seed}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    torch.set_num_threads(1)
    data = load_data(DataConfig(path=str(CORPUS), block_size=SHAPE.block_size))
    torch.manual_seed(1337 + seed)
    p = recipe(directory, len(data.tokenizer.chars))
    start, length = data.train.segments[0]
    tokens = data.train.tokens[start : start + length].long()
    T = SHAPE.block_size
    evals = []
    for step in range(NANOGPT_STEPS):
        for group in p.optimizer.param_groups:
            group["lr"] = recipe_lr(step)
        starts = torch.randint(len(tokens) - T, (BATCH,))
        x = torch.stack([tokens[s : s + T] for s in starts])
        y = torch.stack([tokens[s + 1 : s + 1 + T] for s in starts])
        plain_step(p, x, y)
        if (step + 1) % EVAL_EVERY == 0:
            evals.append((step + 1, heldout_loss(FullLogits(p.model), data)))
    kept.write_text(json.dumps(evals))
    return evals


def mingpt_run(name: str, overrides: list[str], seed: int, out: Path) -> list[tuple[int, float]]:
    """python main.py with `overrides`, evaluated every EVAL_EVERY steps: [(step, held-out
    loss)]."""
    run_dir = out / f"{name}-{seed}"
    args = [
        sys.executable,
        str(REPO / "main.py"),
        *overrides,
        f"data_config.path={CORPUS}",
        f"trainer_config.seed={seed}",
        f"trainer_config.eval_every={EVAL_EVERY}",
        "trainer_config.sample_chars=0",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log = run_dir / "train.log"
    if not (log.exists() and " INFO done at step " in log.read_text()):  # not run to its end yet
        proc = subprocess.run(args, cwd=out, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{name} seed {seed}: {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r.get("split") == "eval"]


def step_times(directory: str, algorithms: set[str], rounds: int, threads: int) -> dict[str, float]:
    """Median ms of a training step (forward, backward, clip, optimizer step) of nanoGPT's and of
    mingpt's with each optimizer algorithm, single steps of each in turn, `rounds` times."""
    torch.set_num_threads(threads)
    x = torch.randint(65, (BATCH, SHAPE.block_size))
    steps = {"nanogpt": recipe(directory, 65)}
    for algorithm in sorted(algorithms):
        model = GPT(GPTConfig(**{**vars(SHAPE), "vocab_size": 65}))
        optimizer = create_optimizer(model, OptimizerConfig(algorithm=algorithm))
        steps[algorithm] = Plain(model, model, optimizer)
    runs = {
        name: lambda p=p: seconds(lambda: plain_step(p, x, x)) * 1000 for name, p in steps.items()
    }
    return medians(runs, rounds, warm_up=5)


def first_at(evals: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in evals if loss <= target), None)


def report(nano: dict[int, list], runs: dict[str, list[list]], ms: dict[str, float]) -> None:
    """The table, in Markdown: per run, the steps to the target (each seed's), the step time, the
    wall time against nanoGPT's, and the held-out loss at the run's end. nanoGPT's seeds that end
    above the target (the mean of their best) count their 2,000 steps."""
    best = [min(loss for _, loss in e) for e in nano.values()]
    target = statistics.mean(best)
    print(
        f"target: {target:.4f}, nanoGPT's best held-out loss (mean of "
        f"{', '.join(f'{b:.4f}' for b in best)})"
    )
    nano_steps = statistics.mean(first_at(e, target) or NANOGPT_STEPS for e in nano.values())
    nano_time = nano_steps * ms["nanogpt"]
    print(
        "| run | steps to target (per seed) | ms/step | time | vs nanoGPT "
        "| held-out loss at the end (per seed) |"
    )
    print("|---|---|---|---|---|---|")
    for name, evals in {"nanogpt": list(nano.values()), **runs}.items():
        reached = [first_at(e, target) for e in evals]
        if name == "nanogpt":
            reached = [r or NANOGPT_STEPS for r in reached]
        ends = ", ".join(f"{e[-1][1]:.3f}" for e in evals)
        end = f"{statistics.mean(e[-1][1] for e in evals):.3f} at step {evals[0][-1][0]} ({ends})"
        if None in reached:
            print(f"| {name} | not reached: {reached} | {ms[name]:.1f} | | | {end} |")
            continue
        steps = statistics.mean(reached)
        print(
            f"| {name} | {steps:.0f} ({', '.join(map(str, reached))}) | {ms[name]:.1f} | "
            f"{steps * ms[name] / 1000:.1f} s | {steps * ms[name] / nano_time:.2f}x | {end} |"
        )


def train_all(args, variants: dict[str, list[str]], out: Path) -> tuple[dict, dict]:
    """Every seed of nanoGPT's recipe and of each variant, J at a time: their evaluations."""
    seeds = range(1, args.seeds + 1)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        nano = {s: pool.submit(nanogpt_run, args.nanogpt, s, out) for s in seeds}
        runs = {
            (name, s): pool.submit(mingpt_run, name, overrides, s, out)
            for name, overrides in variants.items()
            for s in seeds
        }
        nano = {s: f.result() for s, f in nano.items()}
        runs = {key: f.result() for key, f in runs.items()}
    kept = {"nanogpt": nano, **{f"{n}-{s}": e for (n, s), e in runs.items()}}
    (out / "evals.json").write_text(json.dumps(kept))
    return nano, {name: [runs[name, s] for s in seeds] for name in variants}


def main() -> None:
    args = OPTIONS.parse_args()
    variants = dict(VARIANTS)
    for given in args.variants:
        name, eq, overrides = given.partition("=")
        if not (name and eq):
            OPTIONS.error(f"{given!r}: a variant is NAME=key=value,key=value")
        # A row's name keys its runs, its step time and its directories in --out: a second variant
        # of a name replaced the first, and one named as a run of every table took its place (as
        # nanogpt, its step time became nanoGPT's, against which every row is compared).
        if name == "nanogpt" or name in VARIANTS:
            OPTIONS.error(
                f"{given!r}: {name} is a run of every table (nanogpt, {', '.join(VARIANTS)}): give "
                "the variant another NAME"
            )
        if name in variants:
            OPTIONS.error(f"{given!r}: a variant named {name} is given twice")
        variants[name] = overrides.split(",") if overrides else []
    # Each variant's overrides composed (a key or value main.py would refuse ends here, before any
    # training): its optimizer algorithm, whose step is timed.
    algorithm = {
        name: training_config([], overrides).optimizer_config.algorithm
        for name, overrides in variants.items()
    }
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-quality-"))
    out.mkdir(parents=True, exist_ok=True)
    nano, runs = train_all(args, variants, out)
    ms = step_times(args.nanogpt, set(algorithm.values()), args.rounds, args.threads)
    print(machine(threads=args.threads))
    print(
        f"step time ({args.threads} threads), median of {args.rounds} single steps of each in "
        "turn: " + ", ".join(f"{n} {t:.1f} ms" for n, t in ms.items())
    )
    report(nano, runs, {"nanogpt": ms["nanogpt"], **{n: ms[a] for n, a in algorithm.items()}})
    print(f"runs and their evaluations: {out}")


if __name__ == "__main__":
    run_main(main)
