"""Snapshots: how long a save stalls training and how much memory it takes, the run's own save
(Distributed Checkpoint) synchronous and in the background against the single file export writes;
and what loading that file costs.

usage: python benchmarks/bench_snapshot.py [--rounds 3] [--saves 3] [--vocab 65] [--nproc 1]
                                           [--mode file|sync|async ...]
                                           [--device cpu|cuda] [--dir DIR] [preset]
       (defaults: gpt2, a temporary directory)

Builds the preset's model with a vocabulary of --vocab (65, the characters'; 50257, GPT-2's, makes
gpt2 163M parameters, its output layer not tied to the embedding) and block 1024, with AdamW after
one step (both moments populated, as in a real snapshot: 1.03 GB for gpt2 at 65), and saves it
--saves times, the state changed in place before each later save, as training changes it. Each mode
runs in fresh processes (a process's peak memory never goes down), the modes in turn over --rounds
rounds, the order reversed every other round:

  file    the single file (mingpt.snapshot.single_file: export's format, which generate, score and
          init_from read), written synchronously; then read back, verified (every zip record's
          CRC-32) and loaded with torch.load, each timed
  sync    the run's own save with async_save=false: the trainer's finiteness check, DCP's write,
          the publication
  async   the same with async_save=true: the stall is the copy of the state to CPU memory (pinned
          on a GPU; the first save also allocates it), the write goes on in the background while a
          small training step (batch 1, 64 tokens) is timed, against the same step without a save

Per save: its stall (from the call until training can go on) and the time until it is published;
per process: the peak extra RAM over the saves (VmHWM, reset before the first, minus VmRSS then).
With --nproc N > 1 the saves run under torchrun with the model sharded by FSDP2 over the ranks, as
parallelism=fsdp shards it (each rank writes its shards; the slowest rank's stall counts); the
single file, one process's, is left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from _common import (
    device,
    fail,
    finite_check,
    launch,
    machine,
    parser,
    positive,
    reset_peak,
    result_of,
    rss,
    run_main,
    run_saver,
    save_file,
    shard,
    sync,
    training_config,
    verify_file,
    writable_dir,
)

from mingpt.distributed import distributed, setup_logging
from mingpt.model import GPT

OPTIONS = parser(__doc__)
OPTIONS.add_argument("--rounds", type=positive, default=3)
OPTIONS.add_argument(
    "--saves", type=positive, default=3, help="saves per process (the first, then later)"
)
OPTIONS.add_argument("--vocab", type=positive, default=65)
OPTIONS.add_argument("--nproc", type=positive, default=1)
OPTIONS.add_argument(
    "--mode",
    action="append",
    dest="modes",
    choices=["file", "sync", "async"],
    help="a mode to run, repeated for more (default: all three in one process, sync and async "
    "under torchrun)",
)
OPTIONS.add_argument("--device", type=device, default="cpu", choices=["cpu", "cuda"])
OPTIONS.add_argument(
    "--dir", type=writable_dir, help="where the snapshots go (default: a temporary directory)"
)
OPTIONS.add_argument("--child", help=argparse.SUPPRESS)  # one mode's process
OPTIONS.add_argument("preset", nargs="?", default="gpt2")


def with_moments(preset: str, vocab: int, info) -> tuple:
    """(shape, model, AdamW) of the preset at block 1024 on the device, sharded over the ranks under
    torchrun, after one step: the optimizer holds both moments, as in a real snapshot."""
    shape = training_config([], [f"gpt_config={preset}"]).gpt_config
    shape = dataclasses.replace(shape, vocab_size=vocab, block_size=1024)
    model = GPT(shape)
    if info.is_distributed:
        shard(model, info)
    model.to(info.device)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return shape, model, optimizer


def tensors(model, optimizer) -> list[torch.Tensor]:
    moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*model.parameters(), *moments]


def small_step(model, device) -> float:
    """Seconds of a forward and backward on one window of 64 tokens."""
    tokens = torch.zeros(1, 64, dtype=torch.long, device=device)
    start = time.perf_counter()
    model(tokens, tokens)[1].backward()
    model.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def file_saver(shape, model, optimizer, directory: str):
    path = os.path.join(directory, "snapshot.pt")

    def save(at_step: int) -> None:
        state = {
            "model_state": model.state_dict(),
            "optimizer_state": optimizer.state_dict(),
            "gpt_config": vars(shape),
            "vocab": "x" * 65,
            "epoch": 0,
            "samples_in_epoch": 0,
            "step": at_step,
        }
        save_file(state, path)

    return save


def load_times(path: str) -> dict[str, float]:
    """Seconds to read the single file, to verify it, and to torch.load the verified bytes."""
    start = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    read = time.perf_counter() - start
    start = time.perf_counter()
    verify_file(data, path)
    verify = time.perf_counter() - start
    start = time.perf_counter()
    torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return {"read": read, "verify": verify, "torch.load": time.perf_counter() - start}


def series(args, info) -> dict:
    """This process's figures of --saves saves in mode args.child."""
    shape, model, optimizer = with_moments(args.preset, args.vocab, info)
    state = tensors(model, optimizer)
    # Small steps only in one process: under torchrun each would need every rank in step.
    one = not info.is_distributed
    idle_steps = 3 if one else 0
    if args.child == "file":
        save = file_saver(shape, model, optimizer, args.dir)
    else:
        save = run_saver(args.dir, model, optimizer, info, async_save=args.child == "async")
    idle = [small_step(model, info.device) for _ in range(idle_steps)]
    start = time.perf_counter()
    finite_check(state)
    figures = {"check": time.perf_counter() - start, "stall": [], "published": [], "during": []}
    before = rss("VmRSS")
    reset_peak()
    for k in range(args.saves):
        if k:
            with torch.no_grad():
                for t in state:
                    t.add_(1e-3)
            sync(info.device)
        start = time.perf_counter()
        handle = save(k + 1)
        figures["stall"].append(time.perf_counter() - start)
        while one and handle is not None and not handle.done():
            figures["during"].append(small_step(model, info.device))
        if handle is not None:
            handle.result()
        figures["published"].append(time.perf_counter() - start)
    figures["extra_ram"] = rss("VmHWM") - before
    figures["idle"] = idle + [small_step(model, info.device) for _ in range(idle_steps)]
    figures["params"] = sum(p.numel() for p in model.parameters())
    figures["state_bytes"] = sum(t.numel() * t.element_size() for t in state)
    if args.child == "file":
        figures.update(load_times(os.path.join(args.dir, "snapshot.pt")))
    return figures


def child(args) -> None:
    """One mode's process (each rank under torchrun): every rank's figures, as JSON from rank 0."""
    with distributed(args.device) as info:
        setup_logging(info.rank)
        figures = series(args, info)
        ranks = [figures]
        if info.is_distributed:
            ranks = [None] * info.world_size
            dist.all_gather_object(ranks, figures)
        if info.is_main_process:
            files = [os.path.join(d, f) for d, _, names in os.walk(args.dir) for f in names]
            on_disk = sum(os.path.getsize(f) for f in files)
            print(json.dumps({"ranks": ranks, "bytes": on_disk}), flush=True)


def slowest(ranks: list[dict], key: str) -> list[float]:
    """Per save, the slowest rank's seconds: training goes on when every rank can."""
    return [max(values) for values in zip(*(r[key] for r in ranks), strict=True)]


def one_round(args, mode: str, directory: str) -> dict:
    """A fresh process (or torchrun's) of `mode`: its figures, and one line on them."""
    os.makedirs(directory)
    argv = [__file__, "--child", mode, "--saves", str(args.saves), "--vocab", str(args.vocab)]
    argv += ["--device", args.device, "--dir", directory, args.preset]
    result = result_of(launch(args.nproc, argv), mode)
    shutil.rmtree(directory)
    ranks = result["ranks"]
    stalls = ", ".join(f"{s:.2f}" for s in slowest(ranks, "stall"))
    line = f"{mode:>5}: stall {stalls} s"
    if mode == "async":
        line += f", published after {', '.join(f'{s:.2f}' for s in slowest(ranks, 'published'))} s"
    extra = " / ".join(f"{r['extra_ram'] / 1e9:.2f}" for r in ranks)
    line += f"; extra RAM {extra} GB; {result['bytes'] / 1e9:.2f} GB on disk"
    if mode == "file":
        line += "; " + ", ".join(
            f"{k} {ranks[0][k]:.2f} s" for k in ("read", "verify", "torch.load")
        )
    print(line, flush=True)
    return result


def summary(args, results: dict[str, list[dict]]) -> None:
    """The medians over the rounds."""
    names = {
        "file": "single file (export's), synchronous",
        "sync": "DCP, synchronous",
        "async": "DCP, in the background",
    }
    print("| save | stall, first save | stall, later saves | published after | peak extra RAM |")
    print("|---|---|---|---|---|")
    later = {}
    for mode, rounds in results.items():
        stalls = [slowest(r["ranks"], "stall") for r in rounds]
        published = [p for r in rounds for p in slowest(r["ranks"], "published")[1:]]
        later[mode] = statistics.median([s for each in stalls for s in each[1:]] or [math.nan])
        extra = statistics.median(max(x["extra_ram"] for x in r["ranks"]) for r in rounds)
        print(
            f"| {names[mode]} | {statistics.median(s[0] for s in stalls):.2f} s "
            f"| {later[mode]:.2f} s | {statistics.median(published or [math.nan]):.2f} s "
            f"| {extra / 1e9:.2f} GB |"
        )
    first = [r["ranks"][0] for rounds in results.values() for r in rounds]
    print(f"\nthe finiteness check: {statistics.median(f['check'] for f in first):.2f} s")
    if "file" in results:
        files = [r["ranks"][0] for r in results["file"]]
        load = {k: statistics.median(f[k] for f in files) for k in ("read", "verify", "torch.load")}
        speed = results["file"][0]["bytes"] / 1e9 / load["verify"]
        print(
            f"the single file: read {load['read']:.2f} s, verify {load['verify']:.2f} s "
            f"({speed:.2f} GB/s), torch.load {load['torch.load']:.2f} s"
        )
    if "sync" in later and "async" in later:
        print(
            f"stall of a background save: {later['async'] / later['sync']:.1%} of a synchronous "
            "one's"
        )
    idle = [t for f in first for t in f["idle"]]
    during = [t for r in results.get("async", []) for t in r["ranks"][0]["during"]]
    if idle and "async" in results:
        print(
            f"training step (batch 1, 64 tokens): {statistics.median(idle):.3f} s median without a "
            f"save, {statistics.median(during or [math.nan]):.3f} s median of {len(during)} during "
            "background writes"
        )


def main() -> None:
    args = OPTIONS.parse_args()
    if args.child:
        child(args)
        return
    modes = ["file", "sync", "async"] if args.nproc == 1 else ["sync", "async"]
    if args.modes:
        if args.nproc > 1 and "file" in args.modes:
            OPTIONS.error("--mode file: the single file is one process's (--nproc 1)")
        modes = [mode for mode in modes if mode in args.modes]
    training_config([], [f"gpt_config={args.preset}"])  # a preset not there: refused here
    if args.dir:
        rounds = [f"{mode}-{r}" for mode in modes for r in range(args.rounds)]
        left = [name for name in rounds if os.path.exists(os.path.join(args.dir, name))]
        if left:
            fail(f"--dir {args.dir}: {left[0]} is left from an earlier run: remove it first")
    base = args.dir or tempfile.mkdtemp(prefix="bench-snapshot-")
    results = {mode: [] for mode in modes}
    for r in range(args.rounds):
        print(f"round {r + 1}", flush=True)
        for mode in modes if r % 2 == 0 else modes[::-1]:
            results[mode].append(one_round(args, mode, os.path.join(base, f"{mode}-{r}")))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    f = results[modes[0]][0]["ranks"][0]
    print(machine(args.device))
    print(
        f"{args.preset}: {f['params'] / 1e6:.0f}M parameters (vocabulary {args.vocab}), model and "
        f"AdamW {f['state_bytes'] / 1e9:.2f} GB on {args.device}, {args.nproc} process(es); "
        f"medians of {args.rounds} rounds of {args.saves} saves"
    )
    summary(args, results)


if __name__ == "__main__":
    run_main(main)
