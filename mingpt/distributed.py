"""Process group, device, roles and per-rank logging under torchrun, or one process, no group."""

import contextlib
import gc
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mingpt import torch_fixes
from mingpt.config import ConfigError

# Per-step decisions travel between CPUs (a gloo group beside NCCL): on a CUDA tensor, reading them
# would make the host wait for every step.
_control_group: "dist.ProcessGroup | None" = None


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def pick_device(
    preference: str, local_rank: int = 0, key: str = "trainer_config.device"
) -> torch.device:
    """`auto` (CUDA if available), `cpu` or `cuda`: the GPU of this local rank."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: cuda, but CUDA is not available")
    # auto or cuda (whose absence is refused above)
    if preference != "cpu" and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible "
                f"(start at most that many processes per node)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _own_info(record: logging.LogRecord) -> bool:
    """mingpt's own INFO lines (and `python -m mingpt.X`'s, logged as __main__); other libraries'
    from WARNING up."""
    if record.levelno >= logging.WARNING:
        return True
    return record.name.partition(".")[0] in ("mingpt", "__main__")


# `extra=` of a warning that every rank would log alike: rank 0 logs it alone.
SAME_ON_EVERY_RANK = {"same_on_every_rank": True}


def setup_logging(rank: int) -> None:
    """Rank 0 logs mingpt's INFO to stderr; other ranks, warnings and errors prefixed by rank,
    except those marked SAME_ON_EVERY_RANK."""
    handler = logging.StreamHandler()  # on stderr
    handler.addFilter(_own_info)
    prefix = ""
    level = logging.INFO
    if rank != 0:
        prefix = f"[rank {rank}] "
        level = logging.WARNING
        handler.addFilter(lambda record: not getattr(record, "same_on_every_rank", False))
    handler.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def launcher_number(name: str, default: int) -> int:
    """The launcher's variable `name` (torchrun sets it); set by hand or by another launcher, a
    value that is no number is refused in one line, where int() gave a traceback."""
    value = os.environ.get(name, str(default))
    if not re.fullmatch(r"-?\d+", value):
        raise ConfigError(f"{name}={value} in the environment is not a number (torchrun sets it)")
    return int(value)


@contextlib.contextmanager
def distributed(device_preference: str) -> Iterator[DistInfo]:
    """Join torchrun's process group (if any) and leave it at exit, also when the body raises."""
    global _control_group
    local_rank = launcher_number("LOCAL_RANK", 0)
    info = DistInfo(
        launcher_number("RANK", 0),
        local_rank,
        launcher_number("WORLD_SIZE", 1),
        launcher_number("LOCAL_WORLD_SIZE", 1),
        pick_device(device_preference, local_rank),
    )
    # torch's errors for these are tracebacks, and a rank beyond the world waits forever
    names = ("MASTER_ADDR", "MASTER_PORT")
    unset = info.is_distributed and not all(name in os.environ for name in names)
    if unset or not 0 <= info.rank < info.world_size:
        address = " ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in names)
        raise ConfigError(
            f"RANK={info.rank} of WORLD_SIZE={info.world_size}, {address} in the environment: "
            "start the processes with torchrun, which sets them (docs/training.md)"
        )
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if info.is_distributed:
        launcher_number("MASTER_PORT", 0)  # a number, or one line
        with torch_fixes.restart_store(info.world_size) as store:
            dist.init_process_group(
                info.backend,
                rank=info.rank,
                world_size=info.world_size,
                device_id=info.device if info.device.type == "cuda" else None,
                store=store,
            )
        if info.backend == "nccl":
            _control_group = dist.new_group(backend="gloo")
    try:
        yield info
        # leave together: a rank that tears down gloo while rank 0 still saves can abort at exit
        barrier(info)
    finally:
        _control_group = None
        if dist.is_initialized():
            gc.collect()  # objects in reference cycles that hold the group go while it is whole
            dist.destroy_process_group()


def peer_ended(error: BaseException) -> bool:
    """Whether `error` is gloo's for a connection that another rank's process closed or reset."""
    return (
        isinstance(error, RuntimeError)
        and re.search(r"by peer|Broken pipe", str(error)) is not None
    )


def all_max(info: DistInfo, values: list[int]) -> list[int]:
    """The element-wise maximum of every rank's `values`: one small all-reduce of CPU integers."""
    if not info.is_distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control_group)
    return tensor.tolist()


def all_gather(info: DistInfo, value: Any) -> list[Any]:
    """Every rank's `value` (picklable), in rank order."""
    if not info.is_distributed:
        return [value]
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, value, group=_control_group)
    return gathered


def global_mean(info: DistInfo, value: torch.Tensor) -> float:
    """The mean over the ranks of a one-element tensor."""
    if info.is_distributed:
        value = value.clone()
        dist.all_reduce(value)  # a sum: gloo has no AVG
        value /= info.world_size
    return value.item()


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()
