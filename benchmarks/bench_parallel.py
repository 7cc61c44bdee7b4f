"""Memory per rank and step time: `ddp` against `fsdp` for several world sizes, and activation
checkpointing (`trainer_config.activation_checkpointing`) against none.

usage: python benchmarks/bench_parallel.py [--world 1 2 4] [--steps 6] [--parallelism ddp fsdp]
                                           [--checkpointing false true] [key=value ...]
       (defaults: gpt_config=gpt2, batch 2 per rank, block 64, CPU, no activation checkpointing)

For each world size, parallelism and activation checkpointing it launches torchrun (plain python for
one process) on this script's worker, which builds the trainer as main.py does, runs `--steps`
optimizer steps (the first warms up) and reports, per rank: the bytes of its parameters, of its
gradients (after a backward) and of AdamW's state that the rank itself holds (a DTensor counts its
local shard), its peak memory (max RSS on a CPU, with glibc's mmap threshold fixed: see
MMAP_THRESHOLD; peak allocated on a GPU), and the median step time. The largest rank's figures are
printed; the ranks of one run differ by at most one shard's rounding. With both checkpointing
values, the step time and peak memory of one against the other follow the table.

Activation checkpointing's own target: --world 1 --checkpointing false true gpt_config=gpt2-medium
data_config.block_size=1024 trainer_config.batch_size=1 (bf16 autocast on a GPU with
trainer_config.device=cuda trainer_config.use_amp=true).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _common import (
    at_least,
    backward,
    launch,
    machine,
    parse,
    parser,
    positive,
    run_main,
    samples_per_step,
    state,
    step,
    sync,
    trainer,
    training_config,
    with_defaults,
)
from torch.distributed.tensor import DTensor

from mingpt import flops
from mingpt.data import load_data
from mingpt.distributed import distributed, pick_device, setup_logging

DEFAULTS = [
    "gpt_config=gpt2",
    "trainer_config.batch_size=2",
    "data_config.block_size=64",
    "trainer_config.device=cpu",
    "trainer_config.sample_chars=0",
    "trainer_config.eval_every=0",
    "gpt_config.dropout=0.0",
    "trainer_config.save_every_minutes=null",
]
MIB = 2**20
# glibc serves large blocks with mmap and unmaps them when freed, but raises that threshold (up to
# 32 MiB) each time such a block is freed; from then on, freed buffers stay in the heap and in the
# RSS. FSDP frees each block's gathered parameters and gradients every step, so without a fixed
# threshold max RSS counts them as if they were all alive (measured: 2 ranks of gpt2, 2.0 GiB
# instead of 1.1 GiB). A fixed threshold keeps RSS to the memory in use.
MMAP_THRESHOLD = 128 * 1024
THRESHOLD = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))  # the caller's wins
THREADS = os.environ.get("OMP_NUM_THREADS", "1")
FIGURES = ("params", "grads", "optim", "peak")

OPTIONS = parser(__doc__)
OPTIONS.add_argument("--world", type=positive, nargs="+", default=[1, 2, 4])
OPTIONS.add_argument(
    "--steps", type=at_least(2), default=6, help="optimizer steps per run, the first a warm-up"
)
OPTIONS.add_argument("--parallelism", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
OPTIONS.add_argument("--checkpointing", nargs="+", default=["false"], choices=["false", "true"])


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def worker(steps: int, overrides: list[str]) -> None:
    """One run: rank 0 prints the largest rank's figures as a JSON line."""
    config = training_config([], overrides)
    with distributed(config.trainer_config.device) as info:
        setup_logging(info.rank)
        logging.getLogger().setLevel(logging.WARNING)
        data = load_data(config.data_config)
        with trainer(config, info, data) as t:
            per_step = samples_per_step(t)
            order = torch.randperm(
                len(data.train), generator=torch.Generator().manual_seed(info.rank)
            )
            times = []
            for k in range(steps):
                start = time.perf_counter()
                step(t, order[k * per_step : (k + 1) * per_step])
                sync(info.device)
                times.append(time.perf_counter() - start)
            backward(t, order[:per_step])  # gradients as a step holds them
            model, optimizer = state(t)
        moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        figures = [
            sum(local_bytes(p) for p in model.parameters()),
            sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            sum(local_bytes(v) for v in moments),
            flops.peak_memory_mib(info.device) * MIB,
        ]
        row = torch.tensor(figures, dtype=torch.float64)
        if info.is_distributed:
            dist.all_reduce(row, op=dist.ReduceOp.MAX)
        if info.is_main_process:
            result = dict(zip(FIGURES, row.tolist(), strict=True))
            result["step_s"] = statistics.median(times[1:])
            print(json.dumps(result), flush=True)


def run(world: int, parallelism: str, checkpointing: str, steps: int, overrides: list[str]):
    """One run's figures, or the last line of its error."""
    argv = [
        __file__,
        "--worker",
        str(steps),
        *overrides,
        f"trainer_config.parallelism={parallelism}",
        f"trainer_config.activation_checkpointing={checkpointing}",
    ]
    proc = launch(world, argv, {"MALLOC_MMAP_THRESHOLD_": THRESHOLD, "OMP_NUM_THREADS": THREADS})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return proc.stderr.strip().splitlines()[-1:]
    return json.loads(lines[-1])


def main() -> None:
    args, overrides = parse(OPTIONS)
    overrides = with_defaults(DEFAULTS, overrides)
    # What a worker would refuse (a value, a device this machine lacks, a corpus it cannot read),
    # refused before any launch: a corpus refused by every worker made each row "failed", exit 0.
    config = training_config([], overrides)
    pick_device(config.trainer_config.device)
    load_data(config.data_config)  # its token cache built here, as the workers would build it
    print(machine(threads=int(THREADS)))
    print(f"{' '.join(overrides)}; {args.steps} steps; figures per rank (the largest rank)")
    print(
        "| world | parallelism | activation checkpointing | parameters | gradients | AdamW state "
        "| sum | peak memory | step time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    for world in args.world:
        for parallelism in args.parallelism:
            if world == 1 and parallelism == "fsdp":
                continue  # one process never shards
            for checkpointing in args.checkpointing:
                r = run(world, parallelism, checkpointing, args.steps, overrides)
                what = f"| {world} | {parallelism} | {checkpointing} |"
                if isinstance(r, list):
                    print(f"{what} failed: {r} |", flush=True)
                    continue
                results[world, parallelism, checkpointing] = r
                mib = [f"{r[k] / MIB:,.0f} MiB" for k in ("params", "grads", "optim")]
                total = sum(r[k] for k in ("params", "grads", "optim"))
                print(
                    f"{what} {' | '.join(mib)} | {total / MIB:,.0f} MiB "
                    f"| {r['peak'] / MIB:,.0f} MiB | {r['step_s'] * 1e3:,.0f} ms |",
                    flush=True,
                )
    for (world, parallelism, checkpointing), on in results.items():
        off = results.get((world, parallelism, "false"))
        if checkpointing == "true" and off:
            print(
                f"activation checkpointing, world {world}, {parallelism}: step time "
                f"{on['step_s'] / off['step_s']:.2f}x, peak memory {on['peak'] / off['peak']:.2f}x"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        run_main(lambda: worker(int(sys.argv[2]), sys.argv[3:]))
    else:
        run_main(main)
