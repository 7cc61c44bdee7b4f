"""Communication per optimizer step of each DDP comm hook: collective calls and bytes, against plain
DDP, counted in the same run.

OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/bench_comm.py [key=value
...]

Every hook (and LocalSGD's averager) issues its collectives through torch.distributed.all_reduce,
which this script wraps to count calls and the bytes of the tensors reduced. Plain DDP all-reduces
from C++, so for the `none` row PyTorch's allreduce_hook (the same traffic) is registered to make it
countable. Only the training steps are counted, after every hook's plain start-up steps; a ring
all-reduce of B bytes sends about 2·B·(W-1)/W bytes per rank. The times are loopback gloo on one
machine: they show the extra compute of compression, not what a slow network saves.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from _common import (
    ddp_module,
    fail,
    fitted,
    machine,
    parse,
    parser,
    run_main,
    samples_per_step,
    step,
    trainer,
    training_config,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mingpt.data import load_data
from mingpt.distributed import distributed, setup_logging
from mingpt.model import GPT

HOOKS = ["none", "fp16", "powersgd", "batched_powersgd", "post_local_sgd"]
START = 4  # plain steps before compression or local SGD
STEPS = 40  # steps counted after them
DEFAULTS = [
    "gpt_config.n_layer=4",
    "gpt_config.n_head=4",
    "gpt_config.n_embd=128",
    "data_config.block_size=64",
    "trainer_config.batch_size=12",
    f"trainer_config.powersgd_start_step={START}",
    f"trainer_config.localsgd_start_step={START}",
    "trainer_config.localsgd_period=4",
]

calls = {"n": 0, "bytes": 0}
_all_reduce = dist.all_reduce


def counting_all_reduce(tensor, *args, **kwargs):
    calls["n"] += 1
    calls["bytes"] += tensor.numel() * tensor.element_size()
    return _all_reduce(tensor, *args, **kwargs)


def measure(config, data, info, hook: str) -> tuple[float, float, float]:
    """(calls per step, MB per step, ms per step) over STEPS optimizer steps after START, each of
    grad_accum_steps micro-batches."""
    config = copy.deepcopy(config)
    config.trainer_config.ddp_comm_hook = hook
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(info.rank))
    with trainer(config, info, data) as t:
        # A whole step's windows: the trainer splits them into its micro-batches.
        per_step = samples_per_step(t)
        if hook == "none":
            ddp_module(t).register_comm_hook(None, default_hooks.allreduce_hook)
        for k in range(START + STEPS):
            if k == START:
                dist.barrier()
                calls.update(n=0, bytes=0)
                start = time.perf_counter()
            first = k * per_step % (len(order) - per_step)
            step(t, order[first : first + per_step])
        seconds = time.perf_counter() - start
    return calls["n"] / STEPS, calls["bytes"] / STEPS / 1e6, seconds / STEPS * 1e3


def main() -> None:
    _, overrides = parse(parser(__doc__))
    config = training_config(DEFAULTS, overrides)
    with distributed(config.trainer_config.device) as info:
        if not info.is_distributed:
            fail("run it under torchrun with 2 or more processes")
        setup_logging(info.rank)
        data = load_data(config.data_config)
        config.gpt_config = fitted(config, data)
        dist.all_reduce = counting_all_reduce
        rows = [(hook, *measure(config, data, info, hook)) for hook in HOOKS]
        if not info.is_main_process:
            return
        params = sum(p.numel() for p in GPT(config.gpt_config).parameters())
        print(machine(info.device))
        print(
            f"{params / 1e6:.2f}M parameters ({params * 4 / 1e6:.2f} MB in fp32), "
            f"{info.world_size} ranks, {STEPS} steps counted after {START} plain ones, each of "
            f"{config.trainer_config.grad_accum_steps} micro-batch(es) of "
            f"{config.trainer_config.batch_size}"
        )
        base = rows[0][2]
        print(
            "| ddp_comm_hook | all-reduce calls / step | MB reduced / step | vs DDP "
            "| ms / step (loopback) |"
        )
        print("|---|---|---|---|---|")
        for hook, n, mb, ms in rows:
            print(f"| {hook} | {n:.2f} | {mb:.3f} | {mb / base:.3f} | {ms:.1f} |")


if __name__ == "__main__":
    run_main(main)
