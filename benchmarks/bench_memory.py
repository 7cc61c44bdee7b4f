"""Activation checkpointing: peak memory and step time of training steps with
and without `trainer_config.activation_checkpointing`, side by side.

    python benchmarks/bench_memory.py [--steps N] [key=value ...]

The default shape is the issue's target: gpt2-medium (24 layers, 16 heads,
1024 dims) with block 1024, batch 1, fp32 on a CPU (bf16 autocast on a GPU
with trainer_config.use_amp=true); your overrides and presets win over it.
Each variant runs in a fresh process (a CPU's peak memory is the process's
max RSS, which never goes down): the model, AdamW and the trainer's step
(`Trainer.train_step`) on random windows, one warm-up step, then the median of
--steps timed steps. Peak memory: CUDA's max allocated on a GPU, max RSS on a CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _cli import help_or_go_on, with_defaults  # noqa: E402

DEFAULTS = [
    "gpt_config=gpt2-medium",
    "data_config.block_size=1024",
    "trainer_config.batch_size=1",
    "trainer_config.eval_every=0",
    "trainer_config.sample_chars=0",
]


def one_variant(overrides: list[str], steps: int) -> dict:
    """Build the trainer as main.py does and time `steps` of its training step."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mingpt import flops
    from mingpt.cli import CONF_DIR
    from mingpt.config import register_configs
    from mingpt.data import load_data
    from mingpt.distributed import DistInfo, pick_device
    from mingpt.train import build

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        config = OmegaConf.to_object(compose("config", overrides=overrides))
    device = pick_device(config.trainer_config.device, 0)
    data = load_data(config.data_config)
    run_dir = tempfile.mkdtemp(prefix="bench-memory-")  # the trainer's metrics; nothing is saved
    trainer = build(config, DistInfo(0, 0, 1, 1, device), run_dir, data)
    generator = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 1):
        indices = torch.randint(
            len(data.train), (config.trainer_config.batch_size,), generator=generator
        )
        start = time.perf_counter()
        trainer.train_step(indices)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "peak_mib": flops.peak_memory_mib(device)}


def main() -> None:
    help_or_go_on(__doc__)
    args = sys.argv[1:]
    steps = 3
    if "--steps" in args:
        at = args.index("--steps")
        steps = int(args[at + 1])
        del args[at : at + 2]
    if args and args[0] == "--variant":  # a child: one variant, its figures as JSON on stdout
        print(json.dumps(one_variant(args[1:], steps)))
        return
    overrides = with_defaults(DEFAULTS, args)
    rows = {}
    for checkpointing in ("false", "true"):
        child = [
            sys.executable,
            os.path.abspath(__file__),
            "--steps",
            str(steps),
            "--variant",
            *overrides,
            f"trainer_config.activation_checkpointing={checkpointing}",
        ]
        proc = subprocess.run(child, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(
                f"error: the variant activation_checkpointing={checkpointing} failed:\n{proc.stderr[-3000:]}"
            )
        rows[checkpointing] = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = rows["false"], rows["true"]
    print(f"overrides: {' '.join(overrides)}; median of {steps} steps")
    print("| activation_checkpointing | step time | peak memory |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['step_s'] * 1e3:,.0f} ms | {row['peak_mib']:,.0f} MiB |")
    print(
        f"with/without: step time {on['step_s'] / off['step_s']:.2f}x, peak memory {on['peak_mib'] / off['peak_mib']:.2f}x"
    )


if __name__ == "__main__":
    main()
