"""Training throughput: tokens/s, MFU, peak memory, step-time breakdown, and the
trainer's overhead over a bare PyTorch loop of the same model in the same run.

    python benchmarks/bench_train.py [key=value ...]          # one process
    torchrun --standalone --nproc_per_node=N benchmarks/bench_train.py ...  # DDP

Overrides use the training config's keys. The default shape is the CPU target of
BENCHMARKS.md: 4 layers, 4 heads, 128 dims, block 64, batch 12, fp32, dropout 0;
your overrides and presets win over it (gpt_config=gpt2 measures GPT-2).

Model FLOPs per token (forward + backward, PaLM's accounting):
    6 * N_matmul + 12 * n_layer * n_embd * block_size
where N_matmul counts the weights of every Linear layer (embedding lookups do
no matmul work) and the second term is attention's QK^T and AV products over
the full block (mingpt/flops.py). MFU = achieved FLOP/s over the peak that
mingpt/flops.py's peak_rate measures, as the train log's `mfu`: a 1024-square
fp32 matmul on CPU, an 8192-square bf16 matmul on GPU.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _cli import help_or_go_on, with_defaults  # noqa: E402

from mingpt import flops  # noqa: E402
from mingpt.cli import CONF_DIR  # noqa: E402
from mingpt.config import register_configs  # noqa: E402
from mingpt.data import load_data  # noqa: E402
from mingpt.distributed import distributed, setup_logging  # noqa: E402
from mingpt.model import GPT  # noqa: E402
from mingpt.optim import create_optimizer  # noqa: E402
from mingpt.snapshot import sharded  # noqa: E402
from mingpt.train import build, fit_to_data  # noqa: E402

BENCH_DEFAULTS = [
    "gpt_config.n_layer=4",
    "gpt_config.n_head=4",
    "gpt_config.n_embd=128",
    "gpt_config.dropout=0.0",
    "data_config.block_size=64",
    "trainer_config.batch_size=12",
]
ROUNDS, STEPS = 30, 10


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_bare(config, data, info):
    """A fresh model (DDP-wrapped under torchrun) and its optimizer, as main.py
    builds them, plus the windows on the device."""
    torch.manual_seed(config.trainer_config.seed)
    model = GPT(config.gpt_config).to(info.device)
    optimizer = create_optimizer(model, config.optimizer_config)
    ddp = None
    if info.is_distributed:
        ddp = nn.parallel.DistributedDataParallel(
            model,
            gradient_as_bucket_view=True,
            device_ids=[info.device.index] if info.device.type == "cuda" else None,
        )
    forward = ddp or model
    if config.trainer_config.compile:
        forward = torch.compile(forward)
    return model, ddp, forward, optimizer, data.train.with_tokens(data.train.tokens.to(info.device))


def bare_steps(config, info, built, generator, steps: int, phases=None) -> None:
    """The same model, batch and optimizer in a plain loop. With `phases`, add the
    synchronised seconds of each phase to it."""
    tc = config.trainer_config
    model, ddp, forward, optimizer, windows = built
    amp = torch.autocast(
        info.device.type, dtype=torch.bfloat16, enabled=tc.use_amp and info.device.type == "cuda"
    )
    for _ in range(steps):
        marks = [time.perf_counter()]

        def mark():
            if phases is not None:
                sync(info.device)
                marks.append(time.perf_counter())

        idx = torch.randint(len(windows), (tc.batch_size,), generator=generator).to(info.device)
        x, y = windows.batch(idx)
        mark()
        with amp:
            _, loss = forward(x, y)
        mark()
        if phases is not None and ddp is not None:
            with ddp.no_sync():  # backward alone; the all-reduce is timed apart
                loss.backward()
            mark()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.flatten() for g in grads])  # one buffer, as DDP's buckets
            dist.all_reduce(flat)
            for g, reduced in zip(
                grads, flat.div_(info.world_size).split([g.numel() for g in grads])
            ):
                g.copy_(reduced.view_as(g))
            mark()
        else:
            loss.backward()
            mark()
            mark()
        nn.utils.clip_grad_norm_(model.parameters(), tc.grad_norm_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark()
        if phases is not None:
            for k, (a, b) in zip(phases, zip(marks, marks[1:])):
                phases[k] += b - a


def stop_check_and_save(
    config, data, info, checks: int = 2000, saves: int = 5
) -> tuple[float, float, int]:
    """Seconds per stop check (the trainer's per-step decision: one small all-reduce
    under torchrun, none in one process), seconds per snapshot save until it is
    published (every rank writes its part, rank 0 publishes; bench_snapshot.py --stall
    measures a background save's stall), and the snapshot's bytes."""
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build(copy.deepcopy(config), info, run_dir, data)
        # AdamW's moments exist: a full snapshot
        trainer.train_step(torch.arange(trainer.samples_per_step))
        for _ in range(10):
            trainer.saver.agree()
        t0 = time.perf_counter()
        for _ in range(checks):
            trainer.saver.agree()
        check = (time.perf_counter() - t0) / checks
        times = []
        for step in range(saves + 1):
            trainer.progress.step = step  # another position: save() writes again
            t0 = time.perf_counter()
            trainer.saver.save(trainer.progress)
            # written (a background save included): the whole save, not its stall
            trainer.snapshot.wait()
            times.append(time.perf_counter() - t0)
        newest = sharded.latest(trainer.snapshot_path)
        size = (
            sum(os.path.getsize(os.path.join(newest, f)) for f in os.listdir(newest))
            if info.is_main_process
            else 0
        )
        trainer.metrics.close()
    return check, statistics.median(times[1:]), size


def compare(config, data, info, rounds: int, steps: int) -> tuple[float, float]:
    """Median seconds per step of the bare loop and of Trainer.train_step (the
    trainer's whole step: schedule, reseeding, micro-batches, scaler, clipping),
    each on its own fresh model, in short alternating rounds so that drifts in
    the machine's speed hit both alike."""
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build(copy.deepcopy(config), info, run_dir, data)
        built = build_bare(config, data, info)
        generator = torch.Generator().manual_seed(0)
        order = torch.randperm(len(data.train), generator=generator).to(info.device)
        per_step = trainer.samples_per_step
        bare, ours = [], []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            bare_steps(config, info, built, generator, steps)
            sync(info.device)
            t1 = time.perf_counter()
            for s in range(steps):
                start = ((r * steps + s) * per_step) % (len(order) - per_step)
                trainer.train_step(order[start : start + per_step])
                trainer.progress.step += 1
            sync(info.device)
            t2 = time.perf_counter()
            if r:  # the first round warms up
                bare.append((t1 - t0) / steps)
                ours.append((t2 - t1) / steps)
        trainer.metrics.close()
    return statistics.median(bare), statistics.median(ours)


def trainer_loop(config, data, info, steps: int) -> float:
    """Tokens/s of the complete Trainer.train() loop, from its own metrics."""
    with tempfile.TemporaryDirectory() as run_dir:
        tc = config.trainer_config
        tc.max_steps, tc.log_every, tc.eval_every, tc.save_every_steps = 2 * steps, steps, 0, None
        tc.sample_chars, tc.max_epochs = 0, 10**6
        build(config, info, run_dir, data).train()
        if not info.is_main_process:
            return float("nan")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            events = [json.loads(line) for line in f]
    return [e["tokens_per_s"] for e in events if e["split"] == "train"][-1]


def data_pipeline(data, batch_size: int, seconds: float = 1.0) -> float:
    """Samples/s of the sampler plus batch gathering through the token cache's memory map
    (data.train.batch); the trainer reads batches with pread instead (data.place: host)."""
    from mingpt.data import ResumableSampler

    sampler = ResumableSampler(len(data.train), 1, 0, shuffle=True, seed=0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        order = sampler.indices()
        for i in range(0, len(order), batch_size):
            data.train.batch(order[i : i + batch_size])
            n += batch_size
            if n % (batch_size * 200) == 0 and time.perf_counter() - t0 > seconds:
                break
    return n / (time.perf_counter() - t0)


def main() -> None:
    help_or_go_on(__doc__)
    register_configs()
    overrides = with_defaults(BENCH_DEFAULTS, sys.argv[1:])
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=overrides)
    config = OmegaConf.to_object(cfg)
    with distributed(config.trainer_config.device) as info:
        setup_logging(info.rank)
        import logging

        logging.getLogger().setLevel(logging.WARNING)
        data = load_data(config.data_config)
        config.gpt_config = fit_to_data(
            config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size
        )
        device = info.device
        tokens_per_step = (
            config.trainer_config.batch_size * info.world_size * config.data_config.block_size
        )
        # Every process at once: the machine's share each gets (the trainer's MFU: rank 0 alone).
        peak_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        peak = flops.peak_rate(device, peak_dtype) * info.world_size
        peak_what = f"{1024 if device.type == 'cpu' else 8192}-square {str(peak_dtype).removeprefix('torch.')} matmul"
        g = config.gpt_config
        fpt = flops.flops_per_token(GPT(g), g.n_layer, g.n_embd, config.data_config.block_size)

        b, t = compare(config, data, info, ROUNDS, STEPS)
        loop_tokens_per_s = trainer_loop(copy.deepcopy(config), data, info, 100)
        check_s, save_s, snapshot_bytes = stop_check_and_save(config, data, info)
        phases = {k: 0.0 for k in ("data", "forward", "backward", "allreduce", "optimizer")}
        built = build_bare(config, data, info)
        generator = torch.Generator().manual_seed(1)
        bare_steps(config, info, built, generator, 10)
        bare_steps(config, info, built, generator, 100, phases)
        phases = {k: v / 100 for k, v in phases.items()}
        peak_mem = (
            f"{flops.peak_memory_mib(device):.0f} MiB "
            f"({'CUDA allocated' if device.type == 'cuda' else 'process max RSS'})"
        )
        data_rate = data_pipeline(data, config.trainer_config.batch_size)

        if not info.is_main_process:
            return
        total = sum(phases.values())
        rows = [
            ("date", time.strftime("%Y-%m-%d")),
            ("torch", torch.__version__),
            (
                "device",
                f"{device} x{info.world_size}"
                + (
                    f" ({torch.cuda.get_device_name(device)})"
                    if device.type == "cuda"
                    else f" ({torch.get_num_threads()} threads)"
                ),
            ),
            ("command", " ".join(["python"] + sys.argv)),
            (
                "model",
                f"{config.gpt_config.n_layer} layers, {config.gpt_config.n_head} heads, {config.gpt_config.n_embd} dims, block {config.data_config.block_size}, batch {config.trainer_config.batch_size}/process, compile={config.trainer_config.compile}, amp={config.trainer_config.use_amp}",
            ),
            ("FLOPs per token", f"{fpt / 1e6:.2f} M (6N + 12*L*d*T)"),
            (
                "measured peak",
                f"{peak / 1e9:.1f} GFLOP/s ({peak_what}, summed over {info.world_size} process(es))",
            ),
            (
                "bare loop",
                f"{tokens_per_step / b:,.0f} tokens/s, {b * 1e3:.2f} ms/step, MFU {tokens_per_step / b * fpt / peak:.1%}",
            ),
            (
                "trainer",
                f"{tokens_per_step / t:,.0f} tokens/s, {t * 1e3:.2f} ms/step, MFU {tokens_per_step / t * fpt / peak:.1%}",
            ),
            (
                "trainer overhead",
                f"{t / b - 1:+.1%} per step (medians of {ROUNDS} alternating rounds of {STEPS} steps)",
            ),
            (
                "trainer loop",
                f"{loop_tokens_per_s:,.0f} tokens/s in Trainer.train() over 100 steps (its own tokens_per_s)",
            ),
            (
                "stop check",
                f"{check_s * 1e6:.0f} us per step ({check_s / t:.2%} of a trainer step; "
                + ("one all-reduce MAX of 2 int64)" if info.is_distributed else "no collective)"),
            ),
            (
                "snapshot save",
                f"{save_s * 1e3:.1f} ms ({snapshot_bytes / 1e6:.1f} MB, median of 5 saves; "
                f"{save_s / t:.1f} trainer steps)",
            ),
            ("peak memory", peak_mem),
            (
                "step breakdown",
                ", ".join(f"{k} {v * 1e3:.2f} ms ({v / total:.0%})" for k, v in phases.items()),
            ),
            (
                "data pipeline",
                f"{data_rate:,.0f} samples/s, {config.trainer_config.batch_size / data_rate / t:.2%} of a trainer step",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
