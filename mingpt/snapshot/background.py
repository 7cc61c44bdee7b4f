"""Saves written in the background: the one save in flight.

An asynchronous save (sharded.save) has DCP copy the state it saves (training
goes on changing the model in place), then hands the rest to `submit`, which runs
it on the process's one snapshot thread and returns a SaveHandle. At most one
save is in flight: every save, and everything that must see a save complete
(the end of a run, a stop by signal, a load), first calls `wait_pending()`.

Every rank submits its part of each save, and the part ends with a collective
on a gloo group of the snapshot's own (`checkpoint_group`: the background
thread must not share the training group's collectives), whose outcome is the
same on every rank: an error met by any rank is raised by `wait()` on every
rank, as one StorageError line.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch.distributed as dist

from mingpt.storage import StorageError


class SaveHandle:
    """A save in progress (asynchronous) or done. `wait()` returns what was saved
    (a file, a published directory), or raises StorageError on every rank if the
    save failed."""

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
_executor: Optional[ThreadPoolExecutor] = None
_lock = threading.Lock()


def pending() -> SaveHandle:
    """The save in flight, or a handle that is done if there is none."""
    return _pending or SaveHandle("")


def wait_pending() -> Optional[str]:
    """Wait for the asynchronous save in flight, if any; return its target or
    raise its StorageError (once: the handle is then forgotten)."""
    global _pending
    handle, _pending = _pending, None
    return handle.wait() if handle is not None else None


def submit(target: str, write: Callable[[], Optional[str]]) -> SaveHandle:
    """Run `write` (which returns its error as one line, the same on every rank, or
    None; it must not raise) on the snapshot thread, after any save in flight:
    the save in flight from now on. Called after wait_pending()."""
    global _pending, _executor
    wait_pending()
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mingpt-snapshot")
    _pending = SaveHandle(target, _executor.submit(write))
    return _pending


# ---------------------------------------------------------------- the snapshot's process group

# (id of the default group, ranks) -> (the default group, the gloo group). Holding
# the default group keeps its id from being reused by a later process group.
_groups: dict[tuple[int, tuple[int, ...]], tuple[Any, dist.ProcessGroup]] = {}


def checkpoint_group(group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group over `group`'s ranks for the snapshot's own collectives
    (the background thread must not share the training group), created once
    per process group (every rank of it calls this); None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    key = (id(world), tuple(dist.get_process_group_ranks(group or world)))
    if key not in _groups:
        _groups[key] = (world, dist.new_group(ranks=list(key[1]), backend="gloo"))
    return _groups[key][1]


def broadcast(value: Any, pg: Optional[dist.ProcessGroup]) -> Any:
    """`value` as `pg`'s first rank has it, on every rank of `pg` (itself without a group)."""
    if pg is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]
