"""Training throughput: tokens/s, MFU, peak memory, step-time breakdown, and the
trainer's overhead over a bare PyTorch loop of the same model in the same run.

    python benchmarks/bench_train.py [key=value ...]          # one process
    torchrun --standalone --nproc_per_node=N benchmarks/bench_train.py ...  # DDP

Overrides use the training config's keys. The default shape is the CPU target of
BENCHMARKS.md: 4 layers, 4 heads, 128 dims, block 64, batch 12, fp32, dropout 0.

Model FLOPs per token (forward + backward, PaLM's accounting):
    6 * N_matmul + 12 * n_layer * n_embd * block_size
where N_matmul counts the weights of every Linear layer (embedding lookups do
no matmul work) and the second term is attention's QK^T and AV products over
the full block. MFU = achieved FLOP/s over the peak this script measures: a
large fp32 matmul on CPU, a large bf16 matmul on GPU.
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

from mingpt.config import register_configs  # noqa: E402
from mingpt.data import load_data  # noqa: E402
from mingpt.distributed import distributed, setup_logging  # noqa: E402
from mingpt.model import GPT  # noqa: E402
from mingpt.optim import create_optimizer  # noqa: E402
from mingpt.train import CONF_DIR, fit_to_data  # noqa: E402
from mingpt.trainer import Trainer  # noqa: E402

BENCH_DEFAULTS = [
    "gpt_config.n_layer=4", "gpt_config.n_head=4", "gpt_config.n_embd=128", "gpt_config.dropout=0.0",
    "data_config.block_size=64", "trainer_config.batch_size=12",
]
WARMUP, STEPS, ROUNDS = 20, 100, 5


def measure_peak(device: torch.device) -> tuple[float, str]:
    """FLOP/s of a large matmul: fp32 on CPU, bf16 on GPU."""
    n, dtype = (2048, torch.float32) if device.type == "cpu" else (8192, torch.bfloat16)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    reps, t0 = 10, time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0), f"{n}x{n} {str(dtype).removeprefix('torch.')} matmul"


def flops_per_token(model: GPT) -> float:
    cfg = model.config
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_loop(config, data, info, steps: int, breakdown: bool = False) -> tuple[float, dict[str, float]]:
    """The same model, batch and optimizer in a plain loop. Returns seconds per
    step and, with breakdown, the mean seconds of each phase (synchronised)."""
    tc = config.trainer_config
    torch.manual_seed(tc.seed)
    model = GPT(config.gpt_config).to(info.device)
    raw = model
    if info.is_distributed:
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True,
                                                    device_ids=[info.device.index] if info.device.type == "cuda" else None)
    if tc.compile:
        model = torch.compile(model)
    optimizer = create_optimizer(raw, config.optimizer_config)
    windows = data.train.to(info.device)
    amp = torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=tc.use_amp and info.device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    phases = {k: 0.0 for k in ("data", "forward", "backward", "allreduce", "optimizer")}

    def step(timed: bool) -> None:
        marks = [time.perf_counter()]

        def mark():
            if timed:
                sync(info.device)
                marks.append(time.perf_counter())

        idx = torch.randint(len(windows), (tc.batch_size,), generator=g).to(info.device)
        x, y = windows.batch(idx)
        mark()
        with amp:
            _, loss = model(x, y)
        mark()
        if timed and info.is_distributed:
            with model.no_sync():  # backward alone; the all-reduce is timed apart below
                loss.backward()
            mark()
            for p in raw.parameters():
                dist.all_reduce(p.grad)
            mark()
        else:
            loss.backward()
            mark()
            mark()
        nn.utils.clip_grad_norm_(raw.parameters(), tc.grad_norm_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark()
        if timed:
            for k, (a, b) in zip(phases, zip(marks, marks[1:])):
                phases[k] += b - a

    for _ in range(WARMUP):
        step(False)
    sync(info.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(breakdown)
    sync(info.device)
    per_step = (time.perf_counter() - t0) / steps
    return per_step, {k: v / steps for k, v in phases.items()}


def trainer_run(config, data, info, steps: int) -> float:
    """Seconds per step of the real Trainer (its own tokens/s over the steady window)."""
    with tempfile.TemporaryDirectory() as run_dir:
        tc = config.trainer_config
        tc.max_steps, tc.log_every, tc.eval_every, tc.save_every_steps = WARMUP + steps, WARMUP, 0, None
        tc.sample_chars, tc.max_epochs = 0, 10**6
        torch.manual_seed(tc.seed)
        trainer = Trainer(config, GPT(config.gpt_config), data, info, run_dir)
        trainer.evaluate = lambda: 0.0  # the benchmark times training steps only
        trainer.train()
        if not info.is_main_process:
            return float("nan")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            events = [json.loads(line) for line in f]
        tokens_per_s = [e["tokens_per_s"] for e in events if e["split"] == "train"][-1]
    global_tokens = tc.batch_size * tc.grad_accum_steps * info.world_size * config.data_config.block_size
    return global_tokens / tokens_per_s


def data_pipeline(data, batch_size: int, seconds: float = 1.0) -> float:
    """Samples/s of the sampler plus batch gathering, as the trainer does it."""
    from mingpt.data import ResumableSampler

    sampler = ResumableSampler(len(data.train), 1, 0, shuffle=True, seed=0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        order = torch.tensor(list(sampler), dtype=torch.long)
        for i in range(0, len(order), batch_size):
            data.train.batch(order[i : i + batch_size])
            n += batch_size
            if n % (batch_size * 200) == 0 and time.perf_counter() - t0 > seconds:
                break
    return n / (time.perf_counter() - t0)


def main() -> None:
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=BENCH_DEFAULTS + sys.argv[1:])
    config = OmegaConf.to_object(cfg)
    with distributed(config.trainer_config.device) as info:
        setup_logging(info.rank)
        import logging

        logging.getLogger().setLevel(logging.WARNING)
        data = load_data(config.data_config)
        config.gpt_config = fit_to_data(config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size)
        device = info.device
        tokens_per_step = config.trainer_config.batch_size * info.world_size * config.data_config.block_size
        peak, peak_what = measure_peak(device)
        fpt = flops_per_token(GPT(config.gpt_config))

        # Interleave the bare loop and the trainer so drift in the machine hits both alike.
        bare, trainer = [], []
        for _ in range(ROUNDS):
            bare.append(bare_loop(config, data, info, STEPS)[0])
            trainer.append(trainer_run(copy.deepcopy(config), data, info, STEPS))
        _, phases = bare_loop(config, data, info, STEPS, breakdown=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            bare_loop(config, data, info, 20)
            peak_mem = f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB (CUDA allocated)"
        else:
            import resource

            peak_mem = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB (process max RSS)"
        data_rate = data_pipeline(data, config.trainer_config.batch_size)

        if not info.is_main_process:
            return
        b, t = statistics.median(bare), statistics.median(trainer)
        total = sum(phases.values())
        rows = [
            ("date", time.strftime("%Y-%m-%d")),
            ("torch", torch.__version__),
            ("device", f"{device} x{info.world_size}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f" ({torch.get_num_threads()} threads)")),
            ("command", " ".join(["python"] + sys.argv)),
            ("model", f"{config.gpt_config.n_layer} layers, {config.gpt_config.n_head} heads, {config.gpt_config.n_embd} dims, block {config.data_config.block_size}, batch {config.trainer_config.batch_size}/process, compile={config.trainer_config.compile}, amp={config.trainer_config.use_amp}"),
            ("FLOPs per token", f"{fpt / 1e6:.2f} M (6N + 12*L*d*T)"),
            ("measured peak", f"{peak / 1e9:.1f} GFLOP/s ({peak_what})"),
            ("bare loop", f"{tokens_per_step / b:,.0f} tokens/s, {b * 1e3:.2f} ms/step, MFU {tokens_per_step / b * fpt / peak:.1%}"),
            ("trainer", f"{tokens_per_step / t:,.0f} tokens/s, {t * 1e3:.2f} ms/step, MFU {tokens_per_step / t * fpt / peak:.1%}"),
            ("trainer overhead", f"{t / b - 1:+.1%} per step (median of {ROUNDS} interleaved rounds of {STEPS} steps)"),
            ("peak memory", peak_mem),
            ("step breakdown", ", ".join(f"{k} {v * 1e3:.2f} ms ({v / total:.0%})" for k, v in phases.items())),
            ("data pipeline", f"{data_rate:,.0f} samples/s, {config.trainer_config.batch_size / data_rate / t:.2%} of a trainer step"),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
