"""Memory per rank and step time: `ddp` against `fsdp`, for several world sizes.

usage: python benchmarks/bench_parallel.py [--world 1 2 4] [--steps 6] [key=value ...]
       (defaults: gpt_config=gpt2, batch 2 per rank, block 64, CPU)

For each world size and parallelism it launches torchrun (plain python for
one process) on this script's worker, which builds the trainer as main.py
does, runs `--steps` optimizer steps and reports, per rank: the bytes of its
parameters, of its gradients (after a backward) and of AdamW's state that
the rank itself holds (a DTensor counts its local shard), its peak memory
(max RSS on a CPU, with glibc's mmap threshold fixed: see MMAP_THRESHOLD; peak
allocated on a GPU), and the median step time. Rank
0's row is printed; the ranks of one run differ by at most one shard's rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from _cli import with_defaults  # noqa: E402

DEFAULTS = [
    "gpt_config=gpt2",
    "trainer_config.batch_size=2",
    "data_config.block_size=64",
    "trainer_config.device=cpu",
    "trainer_config.sample_chars=0",
    "gpt_config.dropout=0.0",
    "trainer_config.save_every_minutes=null",
]
MIB = 2**20
# glibc serves large blocks with mmap and unmaps them when freed, but raises that
# threshold (up to 32 MiB) each time such a block is freed; from then on, freed
# buffers stay in the heap and in the RSS. FSDP frees each block's gathered
# parameters and gradients every step, so without a fixed threshold max RSS
# counts them as if they were all alive (measured: 2 ranks of gpt2, 2.0 GiB
# instead of 1.1 GiB). A fixed threshold keeps RSS to the memory in use.
MMAP_THRESHOLD = 128 * 1024


def worker(overrides: list[str], steps: int) -> None:
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from torch.distributed.tensor import DTensor

    from mingpt.cli import CONF_DIR
    from mingpt.config import register_configs
    from mingpt.distributed import distributed, setup_logging
    from mingpt.train import build

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        config = OmegaConf.to_object(compose("config", overrides=overrides))
    with (
        distributed(config.trainer_config.device) as info,
        tempfile.TemporaryDirectory() as run_dir,
    ):
        setup_logging(info.rank)
        import logging

        logging.getLogger().setLevel(logging.WARNING)
        trainer = build(config, info, run_dir)
        per_step = trainer.samples_per_step
        order = torch.randperm(
            len(trainer.data.train), generator=torch.Generator().manual_seed(info.rank)
        )
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            trainer.train_step(
                order[step * per_step : (step + 1) * per_step].to(
                    trainer.train_windows.tokens.device
                )
            )
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            trainer.progress.step += 1
        x, y = trainer.train_windows.batch(order[:per_step].to(trainer.train_windows.tokens.device))
        trainer.model(x, y)[1].backward()  # gradients as a step holds them
        params = sum(local_bytes(p) for p in trainer.raw_model.parameters())
        grads = sum(
            local_bytes(p.grad) for p in trainer.raw_model.parameters() if p.grad is not None
        )
        optim = sum(
            local_bytes(v)
            for s in trainer.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        if info.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        row = torch.tensor([params, grads, optim, peak], dtype=torch.float64)
        if info.is_distributed:  # the largest rank's figures
            dist.all_reduce(row, op=dist.ReduceOp.MAX)
        trainer.metrics.close()
        if info.is_main_process:
            print(
                "RESULT "
                + json.dumps(
                    {
                        "params": row[0].item(),
                        "grads": row[1].item(),
                        "optim": row[2].item(),
                        "peak": row[3].item(),
                        "step_s": statistics.median(times[1:]),
                        "n_params": trainer.raw_model.num_params(non_embedding=False),
                    }
                ),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--parallelism", nargs="+", default=["ddp", "fsdp"])
    args, overrides = parser.parse_known_args()
    overrides = with_defaults(DEFAULTS, overrides)
    print(f"{' '.join(overrides)}; {args.steps} steps; figures per rank (the largest rank)")
    print(
        "| world | parallelism | parameters | gradients | AdamW state | sum | peak memory | step time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in args.world:
        for parallelism in args.parallelism:
            if world == 1 and parallelism == "fsdp":
                continue  # one process never shards
            launcher = (
                [sys.executable]
                if world == 1
                else [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={world}",
                ]
            )
            env = {
                **os.environ,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "PYTHONPATH": REPO,
                "MALLOC_MMAP_THRESHOLD_": os.environ.get(
                    "MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD)
                ),
            }
            cmd = [
                *launcher,
                __file__,
                "--worker",
                str(args.steps),
                *overrides,
                f"trainer_config.parallelism={parallelism}",
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(
                    f"| {world} | {parallelism} | failed: {proc.stderr.strip().splitlines()[-1:]} |"
                )
                continue
            r = json.loads(lines[0][len("RESULT ") :])
            total = r["params"] + r["grads"] + r["optim"]
            print(
                f"| {world} | {parallelism} | {r['params'] / MIB:,.0f} MiB | {r['grads'] / MIB:,.0f} MiB | "
                f"{r['optim'] / MIB:,.0f} MiB | {total / MIB:,.0f} MiB | {r['peak'] / MIB:,.0f} MiB | "
                f"{r['step_s'] * 1e3:,.0f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[3:], int(sys.argv[2]))
    else:
        main()
