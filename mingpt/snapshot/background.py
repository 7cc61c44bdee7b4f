"""The one save in flight (async_save), written on the process's snapshot thread, and the snapshot's own gloo group:
every save, load, stop and the end of a run first waits for it (`wait_pending`), and its outcome is the same on
every rank.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch.distributed as dist

from mingpt.storage import StorageError


class SaveHandle:
    """A save in progress or done: `wait()` returns its target (a published directory) or raises its StorageError."""

    def __init__(self, target: str, future: Optional[Future] = None, error: Optional[str] = None):
        self.target, self._future, self._error = target, future, error

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> str:
        global _pending
        if _pending is self:  # its outcome is given here: wait_pending() does not give it again
            _pending = None
        if self._future is not None:
            self._error = self._future.result()
            self._future = None
        if self._error:
            raise StorageError(self._error)
        return self.target


_pending: Optional[SaveHandle] = None
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mingpt-snapshot")  # its thread starts at a submit


def pending() -> SaveHandle:
    """The save in flight, or a handle that is done if there is none."""
    return _pending or SaveHandle("")


def wait_pending() -> Optional[str]:
    """Wait for the save in flight, if any: its target, or its StorageError (given once)."""
    global _pending
    handle, _pending = _pending, None
    return handle.wait() if handle is not None else None


def submit(target: str, write: Callable[[], Optional[str]]) -> SaveHandle:
    """Run `write` on the snapshot thread after any save in flight: the save in flight from now on. `write` returns
    its error as one line, the same on every rank, or None; it must not raise."""
    global _pending
    wait_pending()
    _pending = SaveHandle(target, _executor.submit(write))
    return _pending


_groups: dict[int, tuple[Any, dist.ProcessGroup]] = {}  # id -> (the default group, kept so its id is not reused; gloo)


def checkpoint_group() -> Optional[dist.ProcessGroup]:
    """A gloo group over all ranks for the snapshot's collectives (the background thread must not share the training
    group's), made once per default group; None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if id(world) not in _groups:
        _groups[id(world)] = (world, dist.new_group(backend="gloo"))
    return _groups[id(world)][1]


def broadcast(value: Any, pg: Optional[dist.ProcessGroup]) -> Any:
    """`value` as `pg`'s first rank has it, on every rank of `pg` (itself without a group)."""
    if pg is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]
