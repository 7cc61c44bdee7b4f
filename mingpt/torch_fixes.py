"""Workarounds for bugs in PyTorch, all of them here. Each names its bug, applies only where the
installed torch has it, and changes nothing in torch itself: mingpt gets its own copy of what it
calls."""

import contextlib
import functools
import itertools
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.constants import default_pg_timeout

from mingpt import stopping


class _View(types.SimpleNamespace):
    """`_target` with the other keyword arguments in place of its attributes, for a copied
    function's globals."""

    def __getattr__(self, name: str) -> Any:  # only for names not replaced
        return getattr(self._target, name)


def _orthogonalize_takes_only_batches() -> bool:
    """Bug: batched_powerSGD_hook orthogonalizes 2-D matrices, but `_orthogonalize` takes only 3-D
    batches of them since PowerSGD batches same-shaped layers: the hook fails at its first
    compressed step (torch 2.13 has it)."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return True
    return False


def _orthogonalize_matrix_or_batch(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """A 2-D matrix as a batch of one: a view, so the result lands in the hook's own tensor."""
    if matrices.dim() == 2:
        matrices = matrices.unsqueeze(0)
    powerSGD_hook._orthogonalize(matrices, epsilon)


def powersgd_hook(batched: bool, on_cuda: bool) -> Callable:
    """torch's PowerSGD hook (batched or not) for a job on CUDA or not; where this torch needs it, a
    copy (its code, defaults, closure, name and annotations, which DDP checks) whose globals are
    fixed. Bug: both hooks end each bucket with `torch.cuda.synchronize(device)` whenever CUDA is
    available, also for gradients on the CPU, where it raises ("Expected a cuda device, but got:
    cpu"; upstream PR 196568; torch 2.13 has it): a CPU job on a GPU host dies in its first
    compressed backward. Its copy sees a torch without CUDA."""
    hook = powerSGD_hook.batched_powerSGD_hook if batched else powerSGD_hook.powerSGD_hook
    replaced: dict[str, Any] = {}
    if not on_cuda and torch.cuda.is_available():
        replaced["torch"] = _View(
            _target=torch, cuda=_View(_target=torch.cuda, is_available=lambda: False)
        )
    if batched and _orthogonalize_takes_only_batches():
        replaced["_orthogonalize"] = _orthogonalize_matrix_or_batch
    if not replaced:
        return hook
    copy = types.FunctionType(
        hook.__code__,
        {**hook.__globals__, **replaced},
        hook.__name__,
        hook.__defaults__,
        hook.__closure__,
    )
    copy.__kwdefaults__ = hook.__kwdefaults__
    return functools.update_wrapper(copy, hook)


@functools.cache
def stager_stages_once() -> bool:
    """Bug: DCP's DefaultStager closes itself at the end of each stage (torch 2.11 has it; 2.13 does
    not), so a second stage fails deep inside its copy with `KeyError: <class 'type'>`: every
    asynchronous save after the first failed on such a torch."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"probe": torch.zeros(1)}
    try:
        stager.stage(state)
        stager.stage(state)
    except KeyError:
        return True
    finally:
        stager.close()
    return False


# Bug (pytorch#135712, torch >= 2.5): torchrun lends its workers its rendezvous TCPStore, the same
# for every restart, with the keys the previous workers wrote: restarted workers read the dead ones'
# addresses, fail to connect or wait forever. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes torchrun
# start a fresh store per restart.
RESTART_FIX = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (pytorch#135712)"
INIT_AFTER_RESTART_SECONDS = 300


def _give_up(restart: int, by_hand: bool) -> None:
    """Run by a timer while the main thread waits in C to join the group: only os._exit ends it."""
    who = f"restart {restart}"
    fix = RESTART_FIX
    if by_hand:
        # rank 0 may be started without RANK, which defaults to 0
        who = f"rank {os.environ.get('RANK', 0)} of {os.environ['WORLD_SIZE']}"
        fix = (
            f"is every rank started, with MASTER_ADDR={os.environ['MASTER_ADDR']} "
            f"MASTER_PORT={os.environ['MASTER_PORT']}? (torchrun sets them)"
        )
    line = (
        f"error: {who} could not join the process group in {INIT_AFTER_RESTART_SECONDS} s: {fix}\n"
    )
    os.write(sys.stderr.fileno(), line.encode())
    stopping.exit_at_once(2)


_groups = itertools.count()


@contextlib.contextmanager
def restart_store(world_size: int) -> Iterator["dist.Store | None"]:
    """The store to join the process group with (None: env://). One torchrun agent sharing its
    store: each restart's keys under their own prefix, and each group's of the process (a sweep's
    jobs: a group under an earlier one's keys waits on its stale addresses forever). Several,
    whose restart counts can differ: a restarted worker that cannot join in
    INIT_AFTER_RESTART_SECONDS ends with one line naming the fix instead of waiting silently."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=default_pg_timeout,
        )
        yield dist.PrefixStore(f"mingpt/attempt-{restart}/group-{next(_groups)}", store)
        return
    # started without torchrun: a wrong MASTER_ADDR or MASTER_PORT waited 30 minutes in silence
    by_hand = "TORCHELASTIC_RUN_ID" not in os.environ
    if not ((shared and restart) or by_hand):
        yield None
        return
    timer = threading.Timer(INIT_AFTER_RESTART_SECONDS, _give_up, (restart, by_hand))
    timer.daemon = True
    timer.start()
    try:
        yield None
    finally:
        timer.cancel()
