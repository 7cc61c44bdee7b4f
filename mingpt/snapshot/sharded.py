"""Saving and loading a state through Distributed Checkpoint (DCP) at any fsspec URL: every rank
writes its shards, rank 0 publishes the snapshot (manifest.py), and a load reshards for any number
of processes. One asynchronous save is in flight at a time. save and load are called by every rank,
or by one process."""

import collections
import contextlib
import functools
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from mingpt import storage, torch_fixes
from mingpt.distributed import peer_ended
from mingpt.snapshot import SnapshotError, manifest
from mingpt.storage import StorageError, reason, storage_errors

log = logging.getLogger(__name__)

OWN = "rank"  # the top-level key of each rank's own state: rank0, rank1, ...
REREADS = 5  # snapshots rotated away while being read before a reader gives up

# Where torch.distributed is not initialized (no process group here), DCP saves and loads in one
# process by itself, and warns every time that it assumes so: that is the intent here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def _flatten(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors of a nested state under flat '/'-joined keys (all that goes into DCP), and the
    state's structure as JSON, which meta.json keeps to rebuild it."""
    flat: dict[str, torch.Tensor] = {}

    def encode(node: Any, path: list[str]) -> Any:
        key = "/".join(path)
        if isinstance(node, torch.Tensor):
            flat[key] = node
            return {"tensor": key}
        if isinstance(node, dict):
            for k in node:
                if not isinstance(k, (str, int)) or isinstance(k, bool) or "/" in str(k):
                    raise ValueError(
                        f"cannot save key {k!r} under {key or 'the top level'}: keys must be "
                        "strings without '/' or integers"
                    )
            return {"dict": [[k, encode(v, [*path, str(k)])] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return {type(node).__name__: [encode(v, [*path, str(i)]) for i, v in enumerate(node)]}
        if node is None or isinstance(node, (str, int, float, bool)):
            return {"value": node}
        raise TypeError(
            f"cannot save {type(node).__name__} at {key}: only tensors and plain values"
        )

    return flat, encode(tree, [])


def _unflatten(structure: Any, flat: dict[str, torch.Tensor]) -> Any:
    ((kind, body),) = structure.items()
    if kind == "tensor":
        return flat[body]
    if kind == "dict":
        return {k: _unflatten(v, flat) for k, v in body}
    if kind == "list":
        return [_unflatten(v, flat) for v in body]
    if kind == "tuple":
        return tuple(_unflatten(v, flat) for v in body)
    return body


def _tensor_keys(structure: Any) -> list[str]:
    """The flat keys of the structure's tensors, in order: those that rebuilding it looks up."""
    looked_up = collections.defaultdict(type(None))
    _unflatten(structure, looked_up)
    return list(looked_up)


# The one asynchronous save in flight, and its directory: every save, load and exit waits for it.
_pending: tuple[Future, str] | None = None
# Its thread starts at the first submit.
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mingpt-snapshot")


def wait_pending() -> str | None:
    """Wait for the save in flight, if any: its directory, or its StorageError (given once)."""
    global _pending
    if _pending is None:
        return None
    pending, directory = _pending
    _pending = None
    with storage.waiting(f"snapshot {directory}"):
        return pending.result()


# Keyed by the default group itself, which the cache keeps: a later default group (a test's next
# process group) gets its own.
@functools.cache
def _gloo_group(world: dist.ProcessGroup) -> dist.ProcessGroup:
    return dist.new_group(backend="gloo")


def _checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of all ranks, made once per default group: the snapshot thread's collectives
    must not share a communicator with the training step's."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _gloo_group(dist.group.WORLD)


def _rank(pg) -> int:
    if pg is None:
        return 0
    return dist.get_rank(pg)


def _world(pg) -> int:
    if pg is None:
        return 1
    return dist.get_world_size(pg)


def _gather(value: Any, pg) -> list[Any]:
    out = [value] * _world(pg)
    if pg is not None:
        dist.all_gather_object(out, value, group=pg)
    return out


def _by_rank0(pg, decide: Callable[[], Any]) -> Any:
    """What `decide()` returns on rank 0, on every rank; its SnapshotError or StorageError raised on
    every rank."""
    outcome = None
    if _rank(pg) == 0:
        try:
            outcome = decide()
        except (SnapshotError, StorageError) as e:
            outcome = e
    outcome = _gather(outcome, pg)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _typed(error: BaseException) -> str:
    """An exception as one line with its type, which a KeyError's text (only its key) leaves out; a
    storage error as its text, which says what it is."""
    text = reason(error)
    if isinstance(error, storage_errors()) or text == type(error).__name__:
        return text
    return f"{type(error).__name__}: {text}"


def _dcp_reason(error: BaseException) -> str:
    """One line for an exception; for DCP's, the first failing rank's exception and where it was
    raised."""
    if not isinstance(error, CheckpointException) or not error.failures:
        return _typed(error)
    rank, (inner, stack) = min(error.failures.items())
    at = ""
    # Where DCP met a storage error (an object store client's too) says nothing more to the user.
    if stack and not isinstance(inner, storage_errors()):
        at = f", at {os.path.basename(stack[-1].filename)}:{stack[-1].lineno} in {stack[-1].name}"
    return f"{_typed(inner)}{at} (rank {rank})"


class _Streams(FileSystem):
    """DCP's file system, keeping the first storage error a write met: torch.save reports it as
    "unexpected pos"."""

    error: BaseException | None = None

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            sink = storage.Sink(stream)
            try:
                yield sink
            finally:
                self.error = self.error or sink.error


def _new_stager(pinned: bool) -> DefaultStager:
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


_kept_stager = functools.cache(_new_stager)


def _stager(pinned: bool) -> DefaultStager:
    """DCP's stager, pinned only for a state on a GPU. Where torch lets a stager stage again, one is
    kept, and every asynchronous save refills its CPU copy in place; else each save gets its own."""
    if torch_fixes.stager_stages_once():
        return _new_stager(pinned)
    return _kept_stager(pinned)


def save(
    tensors: dict[str, Any],
    meta: dict[str, Any],
    root: str,
    step: int,
    *,
    keep: int = 2,
    also_keep_at_or_before: int | None = None,
    async_save: bool = True,
    own: Any = None,
    lowest_rank: bool = False,
) -> Future:
    """Save `tensors` (each rank its shards), `meta` and `own` (each rank's own state) as a new
    snapshot of `root`, keeping the newest `keep` (and the newest at or before step
    `also_keep_at_or_before`). Asynchronously, it returns once the state is copied, with
    the future of the write, whose outcome wait_pending() gives once: the snapshot's directory, or
    its StorageError, on every rank alike.
    `lowest_rank`: each plain tensor is written by its first holder (replicas that may differ)."""
    # One save at a time; the previous one's error surfaces here.
    wait_pending()
    pg = _checkpoint_group()
    flat, structure = _flatten(tensors)
    ranks = None
    if own is not None:
        # Under keys of the rank's own, which DCP writes from that rank.
        own_flat, own_structure = _flatten({f"{OWN}{_rank(pg)}": own})
        flat.update(own_flat)
        ranks = _gather(own_structure, pg)
    document = json.dumps(
        {
            "format": manifest.FORMAT,
            "step": step,
            "world_size": _world(pg),
            "meta": meta,
            "structure": structure,
            "ranks": ranks,
        }
    ).encode()
    name = _by_rank0(pg, lambda: manifest.new_name(root, step))
    directory = f"{root.rstrip('/')}/{name}"
    on_gpu = any(v.device.type == "cuda" for v in flat.values())
    writer = FsspecWriter(directory, sync_files=storage.is_local(storage.filesystem(root)[0]))
    if not on_gpu:
        # DCP's overlapping loader takes CUDA streams whenever the host has CUDA: a CPU state takes
        # the plain one.
        writer.per_thread_copy_ahead = 0
    streams = _Streams()
    streams.fs = writer.fs.fs
    writer.fs = streams
    options = {
        "storage_writer": writer,
        "planner": DefaultSavePlanner(dedup_save_to_lowest_rank=lowest_rank),
        "process_group": pg,
    }

    def complete() -> str:
        """Wait for the writes, then publish: the directory, or the StorageError, the same on
        every rank."""
        error = None
        try:
            if async_save:
                upload.result()
            else:
                dcp.save(flat, **options)
        except (Exception, CheckpointException) as e:
            if streams.error is None:
                error = _dcp_reason(e)
            else:
                error = f"{reason(streams.error)} (rank {_rank(pg)})"
        try:
            _publish(
                directory,
                root,
                document,
                (keep, also_keep_at_or_before),
                pg,
                error,
                streams.error is not None,
            )
        # One line, on every rank: any error of this rank's too, never lost.
        except Exception as e:
            raise _failure(directory, e) from None
        return directory

    if not async_save:
        written = Future()
        with storage.waiting(f"snapshot {directory}"):
            written.set_result(complete())
        return written
    try:
        upload = dcp.async_save(flat, async_stager=_stager(on_gpu), **options)
    # Staging failed: nothing was started.
    except (Exception, CheckpointException) as e:
        raise StorageError(f"cannot save sharded snapshot {directory}: {_dcp_reason(e)}") from None
    global _pending
    _pending = (_executor.submit(complete), directory)
    return _pending[0]


def _failure(directory: str, error: Exception) -> Exception:
    """What a save that failed in `error` raises: a StorageError, but another rank's end as it is.
    torchrun stops this rank next; the storage is not at fault, and rank 0 may have published the
    snapshot already."""
    if peer_ended(error):
        return error
    return StorageError(f"cannot save sharded snapshot {directory}: {reason(error)}")


def _publish(
    directory: str,
    root: str,
    document: bytes,
    keep: tuple[int, int | None],
    pg,
    error: str | None,
    storage_cause: bool,
) -> None:
    """Each rank hashes its own shards; rank 0 publishes and prunes. The error, a storage cause
    before others, raised on every rank as a StorageError."""
    shards = {}
    if error is None:
        try:
            shards = manifest.shard_hashes(directory, _rank(pg))
        except storage_errors() as e:
            error = f"rank {_rank(pg)}: {reason(e)}"
    gathered = _gather((shards, error, storage_cause), pg)

    def failed(error: str) -> StorageError:
        """Why a save was not published, and what is left of the run's saves."""
        left = "the previous snapshots are unchanged"
        with contextlib.suppress(StorageError):
            if manifest.latest(root) is None:
                left = f"no snapshot is published in {root} yet"
        return StorageError(f"{error}; {left}")

    def publish() -> None:
        """Rank 0's part. It raises only a StorageError, which _by_rank0 raises on every rank: no
        rank is left waiting for it."""
        errors = [e for _, e, _ in sorted(gathered, key=lambda g: not g[2]) if e]
        if errors:
            raise failed(errors[0])
        every_shard = {name: entry for hashes, _, _ in gathered for name, entry in hashes.items()}
        try:
            count = manifest.publish(directory, document, every_shard)
        except Exception as e:
            raise failed(_typed(e)) from None
        manifest.prune(root, os.path.basename(directory), *keep)
        log.info("published sharded snapshot %s (%d files)", directory, count)

    _by_rank0(pg, publish)


def _read(directory: str) -> manifest.Published:
    """manifest.read, and the state's structure in meta.json checked."""
    snapshot = manifest.read(directory)
    document = snapshot.document
    try:
        for structure in [document["structure"], *(document.get("ranks") or [])]:
            _tensor_keys(structure)  # rebuilding a structure checks it
    except (ValueError, AttributeError, KeyError, TypeError) as e:
        raise SnapshotError(
            f"snapshot {directory} is damaged: {manifest.META} cannot be read ({reason(e)})"
        ) from None
    return snapshot


def _check_keys(directory: str, expected: list[str], saved: list[str], metadata: Metadata) -> None:
    indexed = metadata.state_dict_metadata
    missing = [key for key in expected if key not in saved or key not in indexed]
    if missing:
        raise SnapshotError(f"snapshot {directory} does not fit: it holds no tensor {missing[0]}")
    extra = [key for key in saved if key not in expected]
    if extra:
        raise SnapshotError(
            f"snapshot {directory} does not fit: it holds a tensor {extra[0]} that this run has not"
        )


def _empty(directory: str, keys: list[str], metadata: Metadata) -> dict[str, torch.Tensor]:
    """CPU tensors of the sizes and types that the snapshot's index gives `keys`, to load into."""
    _check_keys(directory, keys, keys, metadata)
    index = metadata.state_dict_metadata
    return {key: torch.empty(index[key].size, dtype=index[key].properties.dtype) for key in keys}


def _dcp_load(flat: dict[str, Any], directory: str, metadata: Metadata, **options: Any) -> None:
    try:
        dcp.load(flat, storage_reader=manifest.CheckedReader(directory, metadata), **options)
    except (Exception, CheckpointException) as e:
        raise SnapshotError(f"snapshot {directory} cannot be loaded: {_dcp_reason(e)}") from None


def load(
    tensors: dict[str, Any],
    root_or_dir: str,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Verify the newest published snapshot of a root (or that directory), which `check(meta)` may
    refuse, and load it into `tensors` in place, resharded. Returns (its meta, this rank's own
    state if the snapshot was saved by as many ranks, else None)."""
    # A save in flight uses the same collectives.
    wait_pending()
    pg = _checkpoint_group()
    directory = _by_rank0(pg, lambda: manifest.resolve(root_or_dir))
    problem = None
    # Every rank reads the index; each checks its share of the shards.
    try:
        snapshot = _read(directory)
        manifest.verify(directory, snapshot.files, slice(_rank(pg), None, _world(pg)))
    except (SnapshotError, StorageError) as e:
        problem = str(e)
    # All ranks stop together, with the same line.
    errors = [e for e in _gather(problem, pg) if e]
    if errors:
        raise SnapshotError(errors[0])
    document = snapshot.document
    metadata = snapshot.metadata
    # The snapshot's own account of what it holds (its shapes, its optimizer) is checked first.
    if check is not None:
        check(document["meta"])
    flat, _ = _flatten(tensors)
    _check_keys(directory, sorted(flat), _tensor_keys(document["structure"]), metadata)
    ranks = document.get("ranks") or []
    mine = None
    if len(ranks) == _world(pg):
        mine = ranks[_rank(pg)]
        flat.update(_empty(directory, _tensor_keys(mine), metadata))
    _dcp_load(flat, directory, metadata)
    loaded = _unflatten(document["structure"], flat)
    tensors.update({key: loaded[key] for key in tensors if key in loaded})
    log.info("loaded sharded snapshot %s (step %s)", directory, document.get("step"))
    own_state = None
    if mine is not None:
        own_state = _unflatten(mine, flat)[f"{OWN}{_rank(pg)}"]
    return document["meta"], own_state


def _newest(root_or_dir: str, read: Callable[[str], Any]) -> Any:
    """`read` of the snapshot manifest.resolve chooses; if that one is rotated away meanwhile (its
    run saves on), of the root's newest."""
    for _ in range(REREADS):
        directory = manifest.resolve(root_or_dir)
        try:
            return read(directory)
        except (SnapshotError, StorageError):
            published = True  # if storage cannot tell, the read's own error stands
            with contextlib.suppress(StorageError):
                published = storage.exists(f"{directory.rstrip('/')}/{manifest.MANIFEST}")
            if published:
                raise
        if directory == root_or_dir:
            raise SnapshotError(
                f"snapshot {directory} was removed while being read (its run replaced it with a "
                "newer one: keep_snapshots); read the run's snapshot root for its newest"
            )
        log.info(
            "snapshot %s was replaced by a newer one while being read; reading the newest",
            directory,
        )
    raise SnapshotError(
        f"the snapshots in {root_or_dir} were replaced {REREADS} times while being read (its run "
        "saves faster than they can be read): try again, or export one while it is kept"
    )


def read_meta(root_or_dir: str) -> dict[str, Any]:
    """The meta of the newest published snapshot of a root (or of the given directory); no shard is
    read."""
    return _newest(root_or_dir, lambda directory: _read(directory).document["meta"])


def load_full(root_or_dir: str, part: str | None = None) -> tuple[Any, dict[str, Any]]:
    """A snapshot as plain CPU tensors in one process, with no process group: (what was saved, or
    only its top-level `part`, such as "model"; meta)."""

    def read(directory: str) -> tuple[Any, dict[str, Any]]:
        snapshot = _read(directory)
        manifest.verify(directory, snapshot.files)
        structure = snapshot.document["structure"]
        if part is not None:
            parts = dict(structure.get("dict", []))  # none if what was saved is not a dict
            if part not in parts:
                raise SnapshotError(f"snapshot {directory} holds no {part}")
            structure = parts[part]
        flat = _empty(directory, _tensor_keys(structure), snapshot.metadata)
        _dcp_load(flat, directory, snapshot.metadata, no_dist=True)
        return _unflatten(structure, flat), snapshot.document["meta"]

    return _newest(root_or_dir, read)
