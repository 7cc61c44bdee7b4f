"""The snapshot format (docs/fault-tolerance.md): Distributed Checkpoint (DCP) at any fsspec URL, published by its
manifest, and the one save in flight. save and load are called by every rank (or by one process)."""

import contextlib
import functools
import io
import json
import logging
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from mingpt import storage, torch_fixes
from mingpt.snapshot import SnapshotError
from mingpt.storage import StorageError, reason, storage_errors

log = logging.getLogger(__name__)

FORMAT = "mingpt-sharded/1"
MANIFEST = "manifest.json"
META = "meta.json"
DCP_METADATA = ".metadata"
NAME = re.compile(r"step-(\d{8,})(?:-(\d+))?")
OWN = "rank"  # the top-level key of each rank's own state: rank0, rank1, ...
REREADS = 5  # snapshots rotated away while being read before a reader gives up

# DCP warns at every single-process save and load that it assumes one process: that is the intent here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def _flatten(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors of a nested state under flat '/'-joined keys (all that goes into DCP), and a JSON structure of it."""
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
                        f"cannot save key {k!r} under {key or 'the top level'}: "
                        "keys must be strings without '/' or integers"
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
    if kind in ("list", "tuple"):
        return (list if kind == "list" else tuple)(_unflatten(v, flat) for v in body)
    return body


def _tensor_keys(structure: Any) -> list[str]:
    ((kind, body),) = structure.items()
    if kind == "tensor":
        return [body]
    children = [v for _, v in body] if kind == "dict" else body if kind in ("list", "tuple") else []
    return [key for child in children for key in _tensor_keys(child)]


def _order(name: str) -> tuple[int, int] | None:
    """(step, number) of a snapshot directory's name, or None for other names."""
    found = NAME.fullmatch(name)
    return (int(found.group(1)), int(found.group(2) or 0)) if found else None


def _listing(root: str, every_name: bool = False) -> tuple[list[str], list[str]]:
    """The snapshot directory names under `root` and the published ones, oldest first; a published one whose name
    lies about its step is in neither (neither resumed nor pruned), except in the names with `every_name`."""
    fs, p = storage.filesystem(root)
    try:
        fs.invalidate_cache(p)  # an object store's cached listing misses what other processes wrote
        if not fs.isdir(p):
            return [], []
        names = [
            n
            for n in (os.path.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))
            if _order(n)
        ]
        manifests = fs.glob(f"{p.rstrip('/')}/step-*/{MANIFEST}")
        published = {os.path.basename(os.path.dirname(m.rstrip("/"))) for m in manifests} & set(
            names
        )
        lying = set() if every_name else {n for n in published if _name_lies(fs, p, root, n)}
    except storage_errors() as e:
        raise StorageError(f"cannot list the sharded snapshots in {root}: {reason(e)}") from None
    names = sorted((n for n in names if n not in lying), key=_order)
    return names, [n for n in names if n in published]


# a published directory does not change: its meta.json is read, and a lie warned about, once
@functools.cache
def _name_lies(fs, p: str, root: str, name: str) -> bool:
    """Whether a published directory's name says another step than its meta.json."""
    try:
        inside = json.loads(fs.cat_file(f"{p.rstrip('/')}/{name}/{META}")).get("step")
    except (FileNotFoundError, ValueError, AttributeError):
        return False  # left for loading to report
    lies = inside != _order(name)[0]
    if lies and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning(
            "ignoring sharded snapshot %s: its name says step %d but it holds step %s (a stray copy or "
            "a renamed directory?); it is neither resumed nor removed",
            f"{root.rstrip('/')}/{name}",
            _order(name)[0],
            inside,
        )
    return lies


def step_of(directory: str) -> int:
    return _order(os.path.basename(directory.rstrip("/")))[0]


def latest(root: str) -> str | None:
    """The newest published snapshot directory under `root` (a URL), or None."""
    published = _listing(root)[1]
    return f"{root.rstrip('/')}/{published[-1]}" if published else None


def _resolve(root_or_dir: str) -> str:
    """A published snapshot directory: `root_or_dir` itself, or the newest under it."""
    if storage.exists(f"{root_or_dir.rstrip('/')}/{MANIFEST}"):
        return root_or_dir
    if _order(os.path.basename(root_or_dir.rstrip("/"))):
        raise SnapshotError(
            f"snapshot {root_or_dir} is not published (no {MANIFEST}: its save did not complete)"
        )
    if (found := latest(root_or_dir)) is None:
        raise SnapshotError(f"no published sharded snapshot in {root_or_dir}")
    return found


class SaveHandle:
    """A save in progress or done: `wait()` returns its directory or raises its StorageError, on every rank alike."""

    def __init__(self, target: str, future: Future | None = None, error: str | None = None):
        self.target, self._future, self._error = target, future, error

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> str:
        global _pending
        if _pending is self:  # its outcome is given here: wait_pending() does not give it again
            _pending = None
        if error := self._future.result() if self._future is not None else self._error:
            raise StorageError(error)
        return self.target


# the one asynchronous save in flight: every save, load and exit waits for it
_pending: SaveHandle | None = None
# its thread starts at a submit
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mingpt-snapshot")
# id -> (the default group, kept so its id is not reused; gloo)
_groups: dict[int, tuple[Any, dist.ProcessGroup]] = {}


def wait_pending() -> str | None:
    """Wait for the save in flight, if any: its target, or its StorageError (given once)."""
    return _pending.wait() if _pending is not None else None


def _checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of all ranks, made once per default group, for the collectives of the snapshot thread."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if id(world) not in _groups:
        _groups[id(world)] = (world, dist.new_group(backend="gloo"))
    return _groups[id(world)][1]


def _rank(pg) -> int:
    return dist.get_rank(pg) if pg is not None else 0


def _world(pg) -> int:
    return dist.get_world_size(pg) if pg is not None else 1


def _gather(value: Any, pg) -> list[Any]:
    out = [value] * _world(pg)
    if pg is not None:
        dist.all_gather_object(out, value, group=pg)
    return out


def _typed(error: BaseException) -> str:
    """An exception as one line with its type, which a KeyError's text (only its key) leaves out."""
    name, text = type(error).__name__, reason(error)
    if text == name:
        return name
    return f"{name}: {text}"


def _dcp_reason(error: BaseException) -> str:
    """One line for an exception; for DCP's, the first rank's failure and where it was raised."""
    if not isinstance(error, CheckpointException) or not error.failures:
        if isinstance(error, OSError):  # a storage error says what it is
            return reason(error)
        return _typed(error)
    rank, (inner, stack) = min(error.failures.items())
    at = ""
    if stack:
        at = f", at {os.path.basename(stack[-1].filename)}:{stack[-1].lineno} in {stack[-1].name}"
    return f"{_typed(inner)}{at} (rank {rank})"


class _Streams(FileSystem):
    """DCP's file system keeping the first storage error a write met: torch.save reports it as "unexpected pos"."""

    error: BaseException | None = None

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            sink = storage.Sink(stream)
            try:
                yield sink
            finally:
                self.error = self.error or sink.error


def _staging(pinned: bool) -> DefaultStager:
    """DCP's stager, pinned only for a state on a GPU. Where torch lets a stager stage again, one is kept, and
    every asynchronous save refills its CPU copy in place; else each save gets its own."""
    if torch_fixes.stager_stages_once():
        return _new_stager(pinned)
    return _kept_stager(pinned)


def _new_stager(pinned: bool) -> DefaultStager:
    options = StagingOptions(
        use_pinned_memory=pinned,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )
    return DefaultStager(options)


_kept_stager = functools.cache(_new_stager)


def _by_rank0(pg, decide: Callable[[], Any]) -> Any:
    """What `decide()` returns on rank 0, on every rank; its SnapshotError or StorageError raised on every rank."""
    outcome = None
    if _rank(pg) == 0:
        try:
            outcome = decide()
        except (SnapshotError, StorageError) as e:
            outcome = e
    if isinstance(outcome := _gather(outcome, pg)[0], Exception):
        raise outcome
    return outcome


def save(
    tensors: dict[str, Any],
    meta: dict[str, Any],
    root: str,
    step: int,
    *,
    keep: int = 2,
    async_save: bool = True,
    own: Any = None,
    lowest_rank: bool = False,
) -> SaveHandle:
    """Save `tensors` (each rank its shards), `meta` and `own` (each rank's own state) as a new snapshot of `root`,
    keeping `keep`; asynchronously, return once copied. `lowest_rank`: each plain tensor written by its first holder."""
    wait_pending()  # one save at a time; the previous one's error surfaces here
    pg = _checkpoint_group()
    flat, structure = _flatten(tensors)
    ranks = None
    if own is not None:  # under keys of the rank's own, which DCP writes from that rank
        own_flat, own_structure = _flatten({f"{OWN}{_rank(pg)}": own})
        flat.update(own_flat)
        ranks = _gather(own_structure, pg)
    document = json.dumps(
        {
            "format": FORMAT,
            "step": step,
            "world_size": _world(pg),
            "meta": meta,
            "structure": structure,
            "ranks": ranks,
        }
    ).encode()

    # step-<step>, or step-<step>-<n> after a crashed save's, whose directory is never reused
    def new_name() -> str:
        taken = [_order(n)[1] for n in _listing(root, every_name=True)[0] if _order(n)[0] == step]
        return f"step-{step:08d}" + (f"-{max(taken) + 1}" if taken else "")

    directory = f"{root.rstrip('/')}/{_by_rank0(pg, new_name)}"
    on_gpu = any(v.device.type == "cuda" for v in flat.values())
    # A CPU state is written by the plain loader: DCP's overlapping one takes CUDA streams whenever the host has CUDA.
    writer = FsspecWriter(
        directory,
        sync_files=storage.is_local(storage.filesystem(root)[0]),
        **({} if on_gpu else {"per_thread_copy_ahead": 0}),
    )
    streams = _Streams()
    streams.fs, writer.fs = writer.fs.fs, streams
    options = {
        "storage_writer": writer,
        "planner": DefaultSavePlanner(dedup_save_to_lowest_rank=lowest_rank),
        "process_group": pg,
        "no_dist": pg is None,
    }

    def complete() -> str | None:  # returns the error, the same on every rank, or None
        try:
            upload.result() if async_save else dcp.save(flat, **options)
            error = None
        except (Exception, CheckpointException) as e:
            error = (
                _dcp_reason(e)
                if streams.error is None
                else f"{reason(streams.error)} (rank {_rank(pg)})"
            )
        try:
            return _publish(directory, root, document, keep, pg, error, streams.error is not None)
        except Exception as e:  # one line on this rank too, never lost
            return f"cannot save sharded snapshot {directory}: {reason(e)}"

    if not async_save:
        handle = SaveHandle(directory, error=complete())
        handle.wait()
        return handle
    try:
        upload = dcp.async_save(flat, async_stager=_staging(on_gpu), **options)
    except (Exception, CheckpointException) as e:  # staging failed: nothing was started
        raise StorageError(f"cannot save sharded snapshot {directory}: {_dcp_reason(e)}") from None
    global _pending
    _pending = SaveHandle(directory, _executor.submit(complete))
    return _pending


def _publish(
    directory: str,
    root: str,
    document: bytes,
    keep: int,
    pg,
    error: str | None,
    storage_cause: bool,
) -> str | None:
    """Each rank hashes its shards; rank 0 publishes and prunes. The error (storage causes first), or None."""
    fs, p = storage.filesystem(directory)
    files: dict[str, list] = {}
    if error is None:
        # DCP names each rank's files __<rank>_<n>.distcp, or __<n>.distcp without a process group
        try:
            for path in fs.glob(
                f"{p}/__{_rank(pg)}_*.distcp" if pg is not None else f"{p}/__*.distcp"
            ):
                with fs.open(path, "rb") as f:
                    files[os.path.basename(path)] = list(storage.sha256(f))
        except storage_errors() as e:
            error = f"rank {_rank(pg)}: {reason(e)}"
    gathered = _gather((files, error, storage_cause), pg)

    # rank 0's part: raises nothing, so that no rank is left waiting
    def publish() -> str | None:
        if errors := [e for _, e, _ in sorted(gathered, key=lambda g: not g[2]) if e]:
            return errors[0]
        try:
            manifest = {
                name: entry for shard_files, *_ in gathered for name, entry in shard_files.items()
            }
            with storage.atomic_open(f"{p}/{META}", fs) as f:
                f.write(document)
            for name in (DCP_METADATA, META):
                with fs.open(f"{p}/{name}", "rb") as f:
                    manifest[name] = list(storage.sha256(f))
            with storage.atomic_open(f"{p}/{MANIFEST}", fs) as f:  # the publication
                f.write(
                    json.dumps(
                        {"format": FORMAT, "files": manifest}, indent=1, sort_keys=True
                    ).encode()
                )
        except Exception as e:
            return (
                reason(e) if isinstance(e, storage_errors()) else f"{type(e).__name__}: {reason(e)}"
            )
        _prune(root, os.path.basename(directory.rstrip("/")), keep)
        log.info("published sharded snapshot %s (%d files)", directory, len(manifest))
        return None

    error = _by_rank0(pg, publish)
    return (
        error
        and f"cannot save sharded snapshot {directory}: {error}; the previous snapshots are unchanged"
    )


def _prune(root: str, newest: str, keep: int) -> None:
    """Remove all but the newest `keep` published snapshots and unpublished ones older than `newest`; only warns."""
    try:
        names, published = _listing(root)
        doomed = published[:-keep] + [
            n for n in names if n not in published and _order(n) < _order(newest)
        ]
        fs, p = storage.filesystem(root)
        for name in doomed:
            if name in published:  # the manifest first: cut short, this leaves no damaged snapshot
                fs.rm(f"{p.rstrip('/')}/{name}/{MANIFEST}")
            fs.rm(f"{p.rstrip('/')}/{name}", recursive=True)
    except (SnapshotError, StorageError, *storage_errors()) as e:
        log.warning("could not remove old sharded snapshots in %s: %s", root, reason(e))


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
}


# a pickled payload never runs, even one with a rewritten manifest
class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


class _Reader(FsspecReader):
    """DCP's fsspec reader given the checked .metadata: DCP's own read_metadata would pickle.load the file."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._checked.storage_meta is None:
            self._checked.storage_meta = StorageMeta()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked


def _read_manifest(directory: str) -> tuple[dict[str, list], dict[str, Any], Metadata]:
    """The manifest's files, meta.json and DCP's metadata (unpickled with only DCP's classes allowed), checked."""
    data = _checked(directory, MANIFEST)  # outside the try: its SnapshotError is a ValueError
    try:
        manifest = json.loads(data)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not all(
            isinstance(v, list) and len(v) == 2 for v in files.values()
        ):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SnapshotError(
            f"snapshot {directory} is damaged: {MANIFEST} cannot be read ({reason(e)})"
        ) from None
    blobs = {name: _checked(directory, name, files) for name in (META, DCP_METADATA)}
    try:
        meta = json.loads(blobs[META])
        if meta.get("format") != FORMAT or not isinstance(meta.get("meta"), dict):
            raise ValueError(f"format {meta.get('format')!r}")
        for structure in [meta["structure"], *(meta.get("ranks") or [])]:
            _unflatten(structure, {key: None for key in _tensor_keys(structure)})
    except (ValueError, AttributeError, KeyError, TypeError) as e:
        raise SnapshotError(
            f"snapshot {directory} is damaged: {META} cannot be read ({reason(e)})"
        ) from None
    name = f"{directory}/{DCP_METADATA}"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(blobs[DCP_METADATA])).load()
    except pickle.UnpicklingError as e:
        raise SnapshotError(
            f"refusing to load {name}: it holds pickled objects other than DCP's metadata, "
            f"and none of it was run ({reason(e)})"
        ) from None
    except Exception as e:  # damaged bytes raise many types
        raise SnapshotError(
            f"snapshot {name} is damaged ({type(e).__name__}: {reason(e)})"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise SnapshotError(f"snapshot {name} is damaged (not DCP metadata)")
    for key, entry in metadata.state_dict_metadata.items():
        # bytes entries are read with torch.load(weights_only=False)
        if not isinstance(entry, TensorStorageMetadata):
            raise SnapshotError(
                f"refusing to load {name}: entry {key!r} is not a tensor, and none of it was run"
            )
    for info in (metadata.storage_data or {}).values():  # DCP reads only files that were verified
        if getattr(info, "relative_path", None) not in files:
            raise SnapshotError(
                f"snapshot {directory} is damaged: its index names a file that {MANIFEST} "
                f"does not list ({getattr(info, 'relative_path', info)!r})"
            )
    return files, meta, metadata


def _checked(
    directory: str, name: str, files: dict[str, list] | None = None, whole: bool = True
) -> bytes:
    """A file of the snapshot (its bytes if `whole`), checked against the size and sha256 that `files` lists."""
    fs, p = storage.filesystem(directory)
    try:
        with fs.open(f"{p}/{name}", "rb") as f:
            data = f.read() if whole else b""
            size, digest = storage.sha256(io.BytesIO(data) if whole else f)
    except FileNotFoundError:
        raise SnapshotError(f"snapshot {directory} is damaged: {name} is missing") from None
    except storage_errors() as e:
        raise StorageError(f"cannot read snapshot {directory}/{name}: {reason(e)}") from None
    if files is not None and [size, digest] != files.get(name):
        raise SnapshotError(
            f"snapshot {directory} is damaged: {name} does not match its size and sha256 in "
            f"{MANIFEST} (changed after it was written)"
        )
    return data


# a share of the shards
def _verify(directory: str, files: dict[str, list], share: slice = slice(None)) -> None:
    for name in sorted(n for n in files if n not in (META, DCP_METADATA))[share]:
        _checked(directory, name, files, whole=False)


def _check_keys(directory: str, expected: list[str], saved: list[str], metadata: Metadata) -> None:
    if missing := [
        key for key in expected if key not in saved or key not in metadata.state_dict_metadata
    ]:
        raise SnapshotError(f"snapshot {directory} does not fit: it holds no tensor {missing[0]}")
    if extra := [key for key in saved if key not in expected]:
        raise SnapshotError(
            f"snapshot {directory} does not fit: it holds a tensor {extra[0]} that this run has not"
        )


def _empty(directory: str, keys: list[str], metadata: Metadata) -> dict[str, torch.Tensor]:
    """CPU tensors of the sizes and types that the snapshot's index gives `keys`, to load into."""
    _check_keys(directory, keys, keys, metadata)
    return {
        key: torch.empty(
            metadata.state_dict_metadata[key].size,
            dtype=metadata.state_dict_metadata[key].properties.dtype,
        )
        for key in keys
    }


def _dcp_load(flat: dict[str, Any], directory: str, metadata: Metadata, **options: Any) -> None:
    try:
        dcp.load(flat, storage_reader=_Reader(directory, metadata), **options)
    except (Exception, CheckpointException) as e:
        raise SnapshotError(f"snapshot {directory} cannot be loaded: {_dcp_reason(e)}") from None


def load(
    tensors: dict[str, Any],
    root_or_dir: str,
    own: bool = False,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """Verify the newest published snapshot of a root (or that directory), which `check(meta)` may refuse, and load it
    into `tensors` in place, resharded; its meta, or with `own` (meta, this rank's own state if as many ranks saved)."""
    wait_pending()  # a save in flight uses the same collectives
    pg = _checkpoint_group()
    directory = _by_rank0(pg, lambda: _resolve(root_or_dir))
    problem = None
    try:  # every rank reads the index; each checks its share of the shards
        files, document, metadata = _read_manifest(directory)
        _verify(directory, files, slice(_rank(pg), None, _world(pg)))
    except (SnapshotError, StorageError) as e:
        problem = str(e)
    # so that all ranks stop together, with the same line
    if errors := [e for e in _gather(problem, pg) if e]:
        raise SnapshotError(errors[0])
    # the snapshot's own account of what it holds (its shapes, its optimizer) comes first
    if check is not None:
        check(document["meta"])
    flat, _ = _flatten(tensors)
    _check_keys(directory, sorted(flat), _tensor_keys(document["structure"]), metadata)
    ranks = document.get("ranks") or []
    mine = ranks[_rank(pg)] if own and len(ranks) == _world(pg) else None
    if mine is not None:
        flat.update(_empty(directory, _tensor_keys(mine), metadata))
    _dcp_load(flat, directory, metadata, no_dist=pg is None)
    loaded = _unflatten(document["structure"], flat)
    tensors.update({key: loaded[key] for key in tensors if key in loaded})
    log.info("loaded sharded snapshot %s (step %s)", directory, document.get("step"))
    own_state = None if mine is None else _unflatten(mine, flat)[f"{OWN}{_rank(pg)}"]
    return (document["meta"], own_state) if own else document["meta"]


def _newest(root_or_dir: str, read: Callable[[str], Any]) -> Any:
    """`read` of the snapshot `_resolve` chooses, or, if that one is rotated away meanwhile, of the root's newest."""
    for _ in range(REREADS):
        directory = _resolve(root_or_dir)
        try:
            return read(directory)
        except (SnapshotError, StorageError):
            published = True  # if storage cannot tell, the read's own error stands
            with contextlib.suppress(StorageError):
                published = storage.exists(f"{directory.rstrip('/')}/{MANIFEST}")
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
        f"the snapshots in {root_or_dir} were replaced {REREADS} times while being read "
        "(its run saves faster than they can be read): try again, or export one while it is kept"
    )


def read_meta(root_or_dir: str) -> dict[str, Any]:
    """The `meta` of the newest published snapshot of a root (or of the given directory); no shard is read."""
    return _newest(root_or_dir, lambda directory: _read_manifest(directory)[1]["meta"])


def load_full(root_or_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A whole snapshot as plain CPU tensors in one process, with no process group: (what was saved, meta)."""

    def read(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
        files, document, metadata = _read_manifest(directory)
        _verify(directory, files)
        flat = _empty(directory, _tensor_keys(document["structure"]), metadata)
        _dcp_load(flat, directory, metadata, no_dist=True)
        return _unflatten(document["structure"], flat), document["meta"]

    return _newest(root_or_dir, read)


class ShardedFormat:
    """The run's snapshot (manager.py): each rank's shards of the model and optimizer, and its own comm hook state."""

    def __init__(
        self,
        root: str,
        model: torch.nn.Module,
        optimizer: Any,
        scaler: torch.amp.GradScaler,
        comm: Any,
        keep: int,
        async_save: bool,
    ):
        self.root, self.model, self.optimizer, self.scaler, self.comm = (
            root,
            model,
            optimizer,
            scaler,
            comm,
        )
        # mingpt.optim.Combined: AdamW and Muon
        self.optimizers = getattr(optimizer, "optimizers", optimizer)
        self.keep, self.background = keep, async_save

    def save(self, meta: dict[str, Any], step: int, check_finite: Callable) -> SaveHandle:
        model_state, optim_state = get_state_dict(self.model, self.optimizers)
        model_state = self.comm.model_state(self.model, model_state)
        check_finite(model_state.values())
        own = self.comm.state_dict(self.model, self.optimizer, self.scaler)
        meta = {**meta, "scaler_state": self.scaler.state_dict(), "comm_hook": own and own["about"]}
        return save(
            {"model": model_state, "optim": optim_state},
            meta,
            self.root,
            step,
            keep=self.keep,
            async_save=self.background,
            own=own and own["state"],
            lowest_rank=self.comm.replicas_differ,
        )

    def save_best(self, meta: dict[str, Any], root: str, step: int, check_finite: Callable) -> None:
        model_state = self.comm.model_state(self.model, get_model_state_dict(self.model))
        check_finite(model_state.values())
        save({"model": model_state}, meta, root, step, keep=1, async_save=False)

    # meta, comm hook's
    def load(self, check_fits: Callable) -> tuple[dict[str, Any], dict[str, Any] | None]:
        # the layout to load into
        model_state, optim_state = get_state_dict(self.model, self.optimizers)
        state = {"model": model_state, "optim": optim_state}
        meta, own = load(state, self.root, own=True, check=check_fits)
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        about = meta.get("comm_hook")
        return meta, ({**about, "state": own} if isinstance(about, dict) else None)

    wait = staticmethod(wait_pending)
