"""FLOPs per token, the matmul rate MFU is measured against, peak and available memory, the warning
for a run too slow on a CPU."""

import os
import resource

import torch
from torch import nn

from mingpt.metrics import duration
from mingpt.model import GPT

SLOW_STEP_SECONDS = 1.0
CPU = torch.device("cpu")
# Steps under this many FLOPs take well under a second on any CPU (the default run's is 4 GFLOP),
# so the CPU is not measured for them.
MEASURE_ABOVE_FLOPS = 1e10
# Steps of fewer FLOPs per process get no MFU: overheads, not matmuls, set their pace (the tests'
# take a few MFLOP).
MFU_ABOVE_FLOPS = 1e9


def flops_per_token(model: GPT) -> float:
    """Forward and backward FLOPs per token: 6 per Linear weight, plus attention's two matmuls over
    the model's block."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    g = model.config
    return 6 * linear + 12 * g.n_layer * g.n_embd * g.block_size


def matmul_rate(
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
    n: int = 512,
    seconds: float = 0.05,
) -> float:
    """FLOP/s of n x n matmuls timed for about `seconds` on all of torch's threads: as fast as the
    device is now."""
    from torch.utils import benchmark  # imported here: only large runs measure

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = benchmark.Timer("a @ b", globals={"a": a, "b": b}, num_threads=torch.get_num_threads())
    return 2 * n**3 / timer.blocked_autorange(min_run_time=seconds).median


def peak_rate(device: torch.device, dtype: torch.dtype) -> float:
    """The FLOP/s that MFU is measured against: a large matmul in the step's precision, at present
    speed."""
    return matmul_rate(device, dtype, n=1024 if device.type == "cpu" else 8192, seconds=0.2)


def peak_for_mfu(step_flops: float, dist_info, dtype: torch.dtype) -> float:
    """peak_rate of all ranks, measured by rank 0 alone; 0 (no MFU) elsewhere and for steps too
    small for it."""
    if not dist_info.is_main_process or step_flops < MFU_ABOVE_FLOPS:
        return 0.0
    return peak_rate(dist_info.device, dtype) * dist_info.world_size


def peak_memory_mib(device: torch.device) -> float:
    """The most memory this process has held: CUDA's allocated memory on a GPU, max RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def available_memory(device: torch.device) -> int:
    """Bytes free on the GPU, or the host's MemAvailable (free plus reclaimable page cache)."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def slow_on_cpu(flops_per_step: float, total_steps: int, rate: float | None = None) -> str | None:
    """The warning for a run whose steps take over SLOW_STEP_SECONDS on this CPU, else None."""
    if flops_per_step < MEASURE_ABOVE_FLOPS:
        return None
    if rate is None:
        rate = matmul_rate()
    seconds = flops_per_step / rate
    if seconds <= SLOW_STEP_SECONDS:
        return None
    return (
        f"this run is sized for a GPU: expect about {seconds:,.0f} s per step on this CPU, "
        f"{duration(seconds * total_steps)} for {total_steps:,} steps "
        f"({flops_per_step / 1e9:,.0f} GFLOP per step and process at the "
        f"{rate / 1e9:,.0f} GFLOP/s this CPU measured in fp32 matmuls); "
        "train it on a GPU, or here with a smaller model or batch"
    )
