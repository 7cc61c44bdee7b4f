"""Training throughput: tokens/s, MFU, peak memory, where a step's time goes, and the trainer's
overhead over a bare PyTorch loop of the same model (and, given a checkout, nanoGPT's step) in the
same run.

usage: python benchmarks/bench_train.py [--threads N] [--rounds R] [--nanogpt DIR] [--compare-only]
                                        [key=value ...]
       torchrun --standalone --nproc_per_node=N benchmarks/bench_train.py ...   # DDP
       python benchmarks/bench_train.py --profile [--threads N] [--rounds R] [--no-compile]
                                        [key=value ...]

Overrides use the training config's keys. The default shape is the CPU target of BENCHMARKS.md: 4
layers, 4 heads, 128 dims, block 64, batch 12, fp32, dropout 0; your overrides and presets win
over it (gpt_config=gpt2 measures GPT-2).

The step comparison: a bare loop (the same model, batch and optimizer; grad_accum_steps
micro-batches a step; clipping; DDP under torchrun; torch.compile and bf16 autocast as configured)
against Trainer.train_step, each on its own fresh model, in R alternating rounds of 10 steps
(medians). --nanogpt DIR (a checkout of karpathy/nanoGPT; its model.py is imported) adds
nanoGPT's GPT at the same shape (bias=True, the config's dropout) with its own
configure_optimizers (AdamW betas 0.9/0.95, fused on CUDA), autocast and compile as configured,
clipping at 1.0, stepped in the same rounds. With
optimizer_config=muon, the bare loop with AdamW is stepped in the same rounds too, and the row
"Muon vs AdamW" gives the ratio of their steps. --compare-only
stops there; otherwise follow Trainer.train() over 100 steps, the per-step stop check, the run's
snapshot save, the time of each phase of a bare step (its grad_accum_steps micro-batches' reads,
forwards and backwards summed, and one optimizer step), and the data pipeline's rate.

--profile: the torch.profiler table of the bare step (grad_accum_steps micro-batches under the
configured autocast, as in the comparison) grouped into matmuls, attention, GELU,
LayerNorm, optimizer and the rest, then the median ms/step of three variants in R alternating
rounds: eager, each Block compiled (`Block.compile()`, one graph shared by the blocks), and the
whole model compiled, with the time each took to compile (the inductor cache in
TORCHINDUCTOR_CACHE_DIR, by default under /tmp, makes a second run's compile warm); --no-compile:
the profile alone.

Model FLOPs per token (forward + backward, PaLM's accounting, mingpt/flops.py):
    6 * N_matmul + 12 * n_layer * n_embd * block_size
where N_matmul counts the weights of every Linear layer (embedding lookups do no matmul work) and
the second term is attention's QK^T and AV products over the full block. MFU = achieved FLOP/s
over the peak that mingpt/flops.py's peak_rate measures, as the train log's `mfu`: a 1024-square
matmul on CPU, an 8192-square one on GPU, in the dtype of the step's matmuls (AMP's, else fp32).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from _common import (
    Plain,
    fitted,
    machine,
    medians,
    nanogpt,
    nanogpt_checkout,
    parse,
    parser,
    plain_step,
    positive,
    run_main,
    samples_per_step,
    save_snapshot,
    seconds,
    step,
    stop_check,
    sync,
    train_to_end,
    trainer,
    training_config,
)
from torch import nn
from torch.profiler import profile

from mingpt import flops
from mingpt.data import ResumableSampler, load_data
from mingpt.distributed import distributed, setup_logging
from mingpt.model import GPT
from mingpt.optim import create_optimizer
from mingpt.trainer import amp_policy

DEFAULTS = [
    "gpt_config.n_layer=4",
    "gpt_config.n_head=4",
    "gpt_config.n_embd=128",
    "gpt_config.dropout=0.0",
    "data_config.block_size=64",
    "trainer_config.batch_size=12",
]
STEPS = 10  # a round's steps of each contender
PHASES = ("data", "forward", "backward", "allreduce", "optimizer")
GROUPS = {  # profiler op name fragment -> group, first match wins
    "mm": "matmuls (mm, addmm)",
    "scaled_dot_product": "attention (SDPA fwd+bwd)",
    "gelu": "GELU fwd+bwd",
    "layer_norm": "LayerNorm fwd+bwd",
    "adamw": "optimizer (fused AdamW)",
}

OPTIONS = parser(__doc__)
OPTIONS.add_argument("--threads", type=positive, help="torch's intra-op threads")
OPTIONS.add_argument("--rounds", type=positive, default=30)
OPTIONS.add_argument(
    "--nanogpt", type=nanogpt_checkout, metavar="DIR", help="a checkout of karpathy/nanoGPT"
)
OPTIONS.add_argument("--compare-only", action="store_true", help="the step comparison alone")
OPTIONS.add_argument("--profile", action="store_true", help="the profile and compile variants")
OPTIONS.add_argument("--no-compile", action="store_true", help="--profile: no compiled variants")


def autocast(config, info) -> torch.autocast:
    """Autocast as the trainer uses it (trainer.amp_policy): AMP on CUDA, or on a CPU that
    amp_on_cpu forces it on."""
    amp = amp_policy(config.trainer_config, info.device.type)
    return torch.autocast(info.device.type, dtype=amp.dtype, enabled=amp.enabled)


def wrapped(model: nn.Module, config, info) -> tuple[nn.Module | None, nn.Module]:
    """(DDP module or None, what a step calls): DDP under torchrun, compiled with compile=true."""
    ddp = None
    if info.is_distributed:
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=True, device_ids=device_ids
        )
    forward = ddp or model
    if config.trainer_config.compile:
        forward = torch.compile(forward)
    return ddp, forward


def bare(config, info) -> tuple[Plain, nn.Module | None]:
    """A fresh model and its optimizer as main.py builds them, and its DDP module under torchrun."""
    torch.manual_seed(config.trainer_config.seed)
    model = GPT(config.gpt_config).to(info.device)
    optimizer = create_optimizer(model, config.optimizer_config)
    ddp, forward = wrapped(model, config, info)
    clip = config.trainer_config.grad_norm_clip
    return Plain(model, forward, optimizer, clip, no_sync_of(ddp)), ddp


def no_sync_of(ddp: nn.Module | None) -> Callable:
    """What holds back the all-reduce of a micro-batch that accumulates: DDP's no_sync, or
    nothing."""
    if ddp is None:
        return contextlib.nullcontext
    return ddp.no_sync


def nano(config, info, directory: str) -> Plain:
    """nanoGPT's model and optimizer at the config's shape, as its train.py steps them."""
    torch.manual_seed(config.trainer_config.seed)
    oc = config.optimizer_config
    model, optimizer = nanogpt(
        directory,
        config.gpt_config,
        bias=True,
        betas=(0.9, 0.95),
        weight_decay=oc.weight_decay,
        learning_rate=oc.learning_rate,
        device=info.device,
    )
    ddp, forward = wrapped(model, config, info)

    def contiguous_targets(x, y):  # mingpt's batches are strided views; nanoGPT's loss views them
        return forward(x, y.contiguous())

    return Plain(model, contiguous_targets, optimizer, 1.0, no_sync_of(ddp))


class Batches:
    """Random batches of training windows, the tokens on the device."""

    def __init__(self, data, config, info, seed: int):
        self.windows = data.train.with_tokens(data.train.tokens.to(info.device))
        self.size = config.trainer_config.batch_size
        self.device = info.device
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(self.windows), (self.size,), generator=self.generator)
        return self.windows.batch(idx.to(self.device))


def plain_steps(
    p: Plain,
    batches: Batches,
    amp,
    steps: int,
    accumulate: int = 1,
    mark: Callable[[str], None] = lambda phase: None,
) -> None:
    """`steps` optimizer steps, each over `accumulate` micro-batches (the trainer's
    grad_accum_steps), as nanoGPT's train.py accumulates: each loss weighted by its share, DDP's
    all-reduce in the last backward alone. `mark(phase)` at the end of each phase."""
    for _ in range(steps):
        for _ in range(accumulate - 1):
            x, y = batches()
            mark("data")
            with p.no_sync():
                with amp or contextlib.nullcontext():
                    _, loss = p.forward(x, y)
                mark("forward")
                (loss / accumulate).backward()
                mark("backward")
        x, y = batches()
        mark("data")
        plain_step(p, x, y, amp, mark, weight=1 / accumulate)


def compare(config, data, info, nanogpt_dir: str | None, rounds: int) -> dict[str, float]:
    """Median seconds per step of the bare loop, Trainer.train_step (the trainer's whole step:
    schedule, reseeding, micro-batches, scaler, clipping) and nanoGPT's step, each on its own fresh
    model, in alternating rounds (the first warms up); with Muon, the bare loop with AdamW too."""
    batches = Batches(data, config, info, seed=0)
    amp = autocast(config, info)
    # The trainer's step takes grad_accum_steps micro-batches: so does every contender's.
    accumulate = config.trainer_config.grad_accum_steps
    contenders = {"bare loop": bare(config, info)[0]}
    if config.optimizer_config.algorithm == "muon":  # Muon's step against AdamW's, paired
        adamw = copy.deepcopy(config)
        adamw.optimizer_config.algorithm = "adamw"
        contenders["bare loop, AdamW"] = bare(adamw, info)[0]
    if nanogpt_dir:
        contenders["nanoGPT"] = nano(config, info, nanogpt_dir)
    runs = {
        name: lambda p=p: (
            seconds(lambda: plain_steps(p, batches, amp, STEPS, accumulate), info.device) / STEPS
        )
        for name, p in contenders.items()
    }
    with trainer(config, info, data) as t:
        order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))
        order = order.to(info.device)
        per_step = samples_per_step(t)
        starts = (i * per_step % (len(order) - per_step) for i in itertools.count())

        def trainer_steps() -> None:
            for start in itertools.islice(starts, STEPS):
                step(t, order[start : start + per_step])

        runs["trainer"] = lambda: seconds(trainer_steps, info.device) / STEPS
        return medians(runs, rounds, warm_up=1)


def stop_check_and_save(config, data, info, checks: int = 2000, saves: int = 5) -> tuple:
    """Seconds per stop check, seconds per snapshot save until it is published (every rank writes
    its part, rank 0 publishes; bench_snapshot.py measures a background save's stall), and its
    bytes."""
    with trainer(config, info, data) as t:
        step(t, torch.arange(samples_per_step(t)))  # AdamW's moments exist: a full snapshot
        for _ in range(10):
            stop_check(t)
        check = seconds(lambda: [stop_check(t) for _ in range(checks)]) / checks
        times = []
        for at_step in range(1, saves + 2):
            start = time.perf_counter()
            size = save_snapshot(t, at_step)
            times.append(time.perf_counter() - start)
    return check, statistics.median(times[1:]), size


def trainer_loop(config, data, info, steps: int = 100) -> float:
    """Tokens/s of the complete Trainer.train() loop, from its own metrics."""
    config = copy.deepcopy(config)
    tc = config.trainer_config
    tc.max_steps = 2 * steps
    tc.log_every = steps
    tc.eval_every = 0
    tc.save_every_steps = None
    tc.sample_chars = 0
    tc.max_epochs = 10**6
    events = train_to_end(config, info, data)
    return events[-1]["tokens_per_s"] if events else float("nan")


class Clock:
    """The seconds of each phase of a step, summed, the device's queued work included. Under DDP the
    backward runs without its all-reduce, which `reduce` then does alone, timed apart, after the
    last of a step's `accumulate` backwards (DDP's no_sync holds back the others')."""

    def __init__(self, device, accumulate: int = 1):
        self.device = device
        self.accumulate = accumulate
        self.backwards = 0
        self.reduce = None
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.phases[phase] += now - self.last
        self.last = now
        if phase == "backward" and self.reduce is not None:
            self.backwards += 1
            if self.backwards % self.accumulate == 0:
                self.reduce()
                self.mark("allreduce")


def all_reduce_gradients(model: nn.Module, world_size: int) -> None:
    """The gradients' mean over the ranks in one buffer, as DDP's buckets."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    reduced = flat.div_(world_size).split([g.numel() for g in grads])
    for g, r in zip(grads, reduced, strict=True):
        g.copy_(r.view_as(g))


def phases(config, data, info, steps: int = 100) -> dict[str, float]:
    """Seconds per optimizer step of each phase of the bare loop: a step's grad_accum_steps
    micro-batches (each read, forward and backward), its all-reduce and its optimizer step."""
    p, ddp = bare(config, info)
    batches = Batches(data, config, info, seed=1)
    amp = autocast(config, info)
    accumulate = config.trainer_config.grad_accum_steps
    plain_steps(p, batches, amp, 10, accumulate)
    no_sync = contextlib.nullcontext()
    clock = Clock(info.device, accumulate)
    if ddp is not None:
        no_sync = ddp.no_sync()
        clock.reduce = functools.partial(all_reduce_gradients, p.model, info.world_size)
    with no_sync:
        plain_steps(p, batches, amp, steps, accumulate, clock.mark)
    return {k: v / steps for k, v in clock.phases.items()}


def data_pipeline(data, batch_size: int, duration: float = 1.0) -> float:
    """Samples/s of the sampler plus batch gathering through the token cache's memory map
    (data.train.batch); the trainer reads batches with pread instead (data.place: host)."""
    sampler = ResumableSampler(len(data.train), 1, 0, seed=0)
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        for batch in sampler.indices().split(batch_size):
            data.train.batch(batch)
            n += len(batch)
            if n % (batch_size * 200) == 0 and time.perf_counter() - start > duration:
                break
    return n / (time.perf_counter() - start)


def rate(name: str, s: float, tokens_per_step: int, fpt: float, peak: float) -> tuple[str, str]:
    tokens_per_s = tokens_per_step / s
    return (
        name,
        f"{tokens_per_s:,.0f} tokens/s, {s * 1e3:.2f} ms/step, MFU {tokens_per_s * fpt / peak:.1%}",
    )


def step_rows(config, info, times: dict[str, float], rounds: int) -> list[tuple[str, str]]:
    """The shape, FLOPs and peak, then a row per contender and their ratios."""
    g = config.gpt_config
    tc = config.trainer_config
    block = config.data_config.block_size
    # An optimizer step's: grad_accum_steps micro-batches of batch_size on each process.
    tokens_per_step = tc.batch_size * tc.grad_accum_steps * info.world_size * block
    # Every process at once: the machine's share each gets (the trainer's MFU: rank 0 alone).
    dtype = amp_policy(tc, info.device.type).dtype
    peak = flops.peak_rate(info.device, dtype) * info.world_size
    side = 1024 if info.device.type == "cpu" else 8192
    fpt = flops.flops_per_token(GPT(g))
    rows = [
        ("command", " ".join(["python", *sys.argv])),
        (
            "model",
            f"{g.n_layer} layers, {g.n_head} heads, {g.n_embd} dims, block {block}, batch "
            f"{tc.batch_size}/process x {tc.grad_accum_steps} accum, compile={tc.compile}, "
            f"amp={tc.use_amp}, "
            f"{info.world_size} process(es) on {info.device}",
        ),
        ("FLOPs per token", f"{fpt / 1e6:.2f} M (6N + 12*L*d*T)"),
        (
            "measured peak",
            f"{peak / 1e9:.1f} GFLOP/s ({side}-square {str(dtype).removeprefix('torch.')} matmul, "
            f"summed over {info.world_size} process(es))",
        ),
    ]
    for name in ("bare loop", "trainer", "nanoGPT"):
        if name in times:
            rows.append(rate(name, times[name], tokens_per_step, fpt, peak))
    ours = times["trainer"]
    rows.append(
        (
            "trainer overhead",
            f"{ours / times['bare loop'] - 1:+.1%} per step (medians of {rounds} alternating "
            f"rounds of {STEPS} steps)",
        )
    )
    if "bare loop, AdamW" in times:
        rows.append(rate("bare loop, AdamW", times["bare loop, AdamW"], tokens_per_step, fpt, peak))
        muon = times["bare loop"] / times["bare loop, AdamW"]
        rows.append(("Muon vs AdamW", f"{muon:.2f}x the bare loop's time per step, paired"))
    if "nanoGPT" in times:
        rows.append(
            ("trainer vs nanoGPT", f"{times['nanoGPT'] / ours:.2f}x (its ms/step over ours)")
        )
    return rows


def more_rows(config, data, info, step_s: float) -> list[tuple[str, str]]:
    """The loop, the stop check, the snapshot, the phases and the data pipeline."""
    loop = trainer_loop(config, data, info)
    check, save, size = stop_check_and_save(config, data, info)
    per_phase = phases(config, data, info)
    total = sum(per_phase.values())
    batch_size = config.trainer_config.batch_size
    data_rate = data_pipeline(data, batch_size)
    # A trainer step reads grad_accum_steps batches.
    read = batch_size * config.trainer_config.grad_accum_steps / data_rate
    collective = "one all-reduce MAX of 2 int64" if info.is_distributed else "no collective"
    return [
        (
            "trainer loop",
            f"{loop:,.0f} tokens/s in Trainer.train() over 100 steps (its own tokens_per_s)",
        ),
        (
            "stop check",
            f"{check * 1e6:.0f} us per step ({check / step_s:.2%} of a trainer step; {collective})",
        ),
        (
            "snapshot save",
            f"{save * 1e3:.1f} ms ({size / 1e6:.1f} MB, median of 5 saves; "
            f"{save / step_s:.1f} trainer steps)",
        ),
        (
            "step breakdown",
            f"per step of {config.trainer_config.grad_accum_steps} micro-batch(es): "
            + ", ".join(f"{k} {v * 1e3:.2f} ms ({v / total:.0%})" for k, v in per_phase.items()),
        ),
        (
            "data pipeline",
            f"{data_rate:,.0f} samples/s, {read / step_s:.2%} of a trainer step",
        ),
    ]


def peak_memory(info) -> tuple[str, str]:
    where = "CUDA allocated" if info.device.type == "cuda" else "process max RSS"
    return "peak memory", f"{flops.peak_memory_mib(info.device):.0f} MiB ({where})"


def profile_step(config, data, info, rounds: int, no_compile: bool) -> None:
    """The profiler's table of the eager bare step, then eager against compiled variants: each
    step as the comparison's, grad_accum_steps micro-batches under the configured autocast."""
    batches = Batches(data, config, info, seed=0)
    amp = autocast(config, info)
    accumulate = config.trainer_config.grad_accum_steps
    variants = {"eager": bare(config, info)[0]}
    plain_steps(variants["eager"], batches, amp, 5, accumulate)
    with profile() as prof:
        plain_steps(variants["eager"], batches, amp, 20, accumulate)
    groups = defaultdict(float)
    for event in prof.key_averages():
        name = event.key.lower()
        group = next((g for fragment, g in GROUPS.items() if fragment in name), "everything else")
        groups[group] += event.self_cpu_time_total / 20 / 1e3  # ms per step
    total = sum(groups.values())
    print(machine(info.device))
    print(f"profile of the eager step (self CPU time, {total:.1f} ms/step under the profiler):")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:<28} {ms:7.2f} ms  {ms / total:5.1%}")
    if not no_compile:
        variants.update(compiled_variants(config, info, batches, amp, accumulate))
    times = medians(
        {
            name: lambda p=p: (
                seconds(lambda: plain_steps(p, batches, amp, STEPS, accumulate), info.device)
                / STEPS
            )
            for name, p in variants.items()
        },
        rounds,
    )
    print(f"\nmedian of {rounds} alternating rounds of {STEPS} steps:")
    for name, s in times.items():
        print(f"  {name:<16} {s * 1e3:7.1f} ms/step  {times['eager'] / s:.2f}x eager")


def compiled_variants(config, info, batches: Batches, amp, accumulate: int) -> dict[str, Plain]:
    """Each Block compiled, and the whole model; the time of their first two steps (compiling)."""
    variants = {}
    for name in ("blocks compiled", "model compiled"):
        start = time.perf_counter()
        p, _ = bare(config, info)
        if name == "blocks compiled":
            for block in p.model.h:
                block.compile()
        else:
            p = p._replace(forward=torch.compile(p.model))
        plain_steps(p, batches, amp, 2, accumulate)
        print(f"{name}: first two steps (compiling) {time.perf_counter() - start:.1f} s")
        variants[name] = p
    return variants


def main() -> None:
    args, overrides = parse(OPTIONS)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = training_config(DEFAULTS, overrides)
    with distributed(config.trainer_config.device) as info:
        setup_logging(info.rank)
        logging.getLogger().setLevel(logging.WARNING)
        data = load_data(config.data_config)
        config.gpt_config = fitted(config, data)
        if args.profile:
            profile_step(config, data, info, args.rounds, args.no_compile)
            return
        times = compare(config, data, info, args.nanogpt, args.rounds)
        rows = step_rows(config, info, times, args.rounds)
        if not args.compare_only:
            rows += more_rows(config, data, info, times["trainer"])
        rows.append(peak_memory(info))
        if not info.is_main_process:
            return
        print(machine(info.device))
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    run_main(main)
