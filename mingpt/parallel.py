"""How the model is spread over the processes (`trainer_config.parallelism`): DDP replicas, or FSDP2
shards of every block and the root; one process is plain."""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.comm_hooks import CommHook
from mingpt.distributed import DistInfo
from mingpt.model import GPT


def shard(model: GPT, dist_info: DistInfo, mixed_precision: torch.dtype | None) -> None:
    """FSDP2 in place, before the optimizer is built: each block, then the root, over all ranks."""
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=mixed_precision, reduce_dtype=torch.float32 if mixed_precision else None
    )
    for unit in [*model.h, model]:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        # decoding calls `step` on the model and on each block: FSDP gathers their parameters for it
        register_fsdp_forward_method(unit, "step")


def gather_outside_inference(model: nn.Module) -> None:
    """Gather and free each FSDP unit's parameters once, outside inference mode: FSDP makes a
    unit's buffers for its gathered parameters at its first gather and keeps them. Made in a
    sample's inference mode (a resumed run's sample, before any step), they would be inference
    tensors, which the next training step's gather cannot write."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()
            unit.reshard()


def replicate(model: GPT, dist_info: DistInfo, comm: CommHook) -> DDP:
    """DDP around the model, with its comm hook's options; DDP copies rank 0's weights to every
    rank."""
    return DDP(
        model,
        device_ids=[dist_info.device.index] if dist_info.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        **comm.ddp_options,
    )


@contextlib.contextmanager
def gradient_sync(model: nn.Module, raw_model: nn.Module, enabled: bool) -> Iterator[None]:
    """While in the body, backward reduces the gradients over the ranks only if `enabled`: on the
    last micro-batch."""
    with contextlib.ExitStack() as stack:
        if not enabled and isinstance(raw_model, FSDPModule):
            raw_model.set_requires_gradient_sync(False)
            stack.callback(raw_model.set_requires_gradient_sync, True)
        # DDP, or a compiled DDP (which passes the attribute on)
        elif not enabled and hasattr(model, "no_sync"):
            stack.enter_context(model.no_sync())
        yield


def full_value(value: Any) -> Any:
    """A DTensor (a sharded model's gradient norm) as the plain tensor it stands for."""
    return value.full_tensor() if isinstance(value, DTensor) else value
