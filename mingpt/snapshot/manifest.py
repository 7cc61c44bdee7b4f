"""Publication and integrity of snapshot directories (docs/fault-tolerance.md).

A snapshot root holds one directory per save, `step-<step>` (`step-<step>-<n>` after a save that
died there). A directory is published by its manifest.json, written last: it lists every file of the
snapshot with its size and SHA-256, so a directory without one is incomplete and a file that changed
afterwards is found. A reader checks each file it reads against the manifest, and unpickles DCP's
index (.metadata) with DCP's own classes alone allowed: a pickled payload never runs, even one whose
manifest was rewritten to match it."""

import functools
import io
import json
import logging
import os
import pickle
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from mingpt import storage
from mingpt.distributed import SAME_ON_EVERY_RANK
from mingpt.snapshot import SnapshotError
from mingpt.storage import StorageError, reason, storage_errors

log = logging.getLogger(__name__)

FORMAT = "mingpt-sharded/1"
MANIFEST = "manifest.json"
META = "meta.json"
DCP_METADATA = ".metadata"
NAME = re.compile(r"step-(\d{8,})(?:-(\d+))?")


def order(name: str) -> tuple[int, int] | None:
    """(step, number) of a snapshot directory's name, or None for other names."""
    found = NAME.fullmatch(name)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2) or 0)


def step_of(directory: str) -> int:
    return order(os.path.basename(directory.rstrip("/")))[0]


def listing(root: str, every_name: bool = False) -> tuple[list[str], list[str]]:
    """The snapshot directory names under `root` and the published ones, oldest first. A published
    directory whose name lies about its step is in neither list (neither resumed nor pruned), unless
    `every_name`."""
    fs, p = storage.filesystem(root)
    try:
        # An object store's cached listing misses what other processes wrote.
        fs.invalidate_cache(p)
        if not fs.isdir(p):
            return [], []
        entries = [os.path.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)]
        names = [name for name in entries if order(name)]
        manifests = storage.glob_after(fs, p.rstrip("/"), f"/step-*/{MANIFEST}")
        published = {os.path.basename(os.path.dirname(m.rstrip("/"))) for m in manifests}
        published &= set(names)
        lying = set()
        if not every_name:
            lying = {name for name in published if _name_lies(fs, p, root, name)}
    except storage_errors() as e:
        raise StorageError(f"cannot list the sharded snapshots in {root}: {reason(e)}") from None
    names = sorted((name for name in names if name not in lying), key=order)
    return names, [name for name in names if name in published]


# A published directory does not change: its meta.json is read, and a lie warned about, once.
@functools.cache
def _name_lies(fs, p: str, root: str, name: str) -> bool:
    """Whether a published directory's name says another step than its meta.json (a stray copy, a
    renaming)."""
    try:
        inside = json.loads(fs.cat_file(f"{p.rstrip('/')}/{name}/{META}")).get("step")
    except (FileNotFoundError, ValueError, AttributeError):
        return False  # left for the reader to report
    said = order(name)[0]
    if inside == said:
        return False
    log.warning(
        "ignoring sharded snapshot %s: its name says step %d but it holds step %s (a stray copy or "
        "a renamed directory?); it is neither resumed nor removed",
        f"{root.rstrip('/')}/{name}",
        said,
        inside,
        extra=SAME_ON_EVERY_RANK,
    )
    return True


def latest(root: str) -> str | None:
    """The newest published snapshot directory under `root`, or None."""
    published = listing(root)[1]
    if not published:
        return None
    return f"{root.rstrip('/')}/{published[-1]}"


def resolve(root_or_dir: str) -> str:
    """A published snapshot directory: `root_or_dir` itself, or the newest under it."""
    if storage.exists(f"{root_or_dir.rstrip('/')}/{MANIFEST}"):
        return root_or_dir
    if order(os.path.basename(root_or_dir.rstrip("/"))):
        raise SnapshotError(
            f"snapshot {root_or_dir} is not published (no {MANIFEST}: its save did not complete)"
        )
    found = latest(root_or_dir)
    if found is None:
        raise SnapshotError(f"no published sharded snapshot in {root_or_dir}")
    return found


def new_name(root: str, step: int) -> str:
    """`step-<step>`; after a save that died at this step, `step-<step>-<n>`: its directory is never
    reused."""
    taken = [order(name)[1] for name in listing(root, every_name=True)[0] if order(name)[0] == step]
    if not taken:
        return f"step-{step:08d}"
    return f"step-{step:08d}-{max(taken) + 1}"


def shard_hashes(directory: str, rank: int) -> dict[str, list]:
    """[size, sha256] of each file DCP wrote for `rank`: `__<rank>_<n>.distcp` (rank 0 in one
    process without a process group)."""
    fs, p = storage.filesystem(directory)
    hashes = {}
    for path in storage.glob_after(fs, p, f"/__{rank}_*.distcp"):
        with fs.open(path, "rb") as f:
            hashes[os.path.basename(path)] = list(storage.sha256(f))
    return hashes


def publish(directory: str, document: bytes, shards: dict[str, list]) -> int:
    """Write meta.json (`document`), then the manifest of it, DCP's index and `shards`: the snapshot
    is published. Returns the number of files listed."""
    fs, p = storage.filesystem(directory)
    files = dict(shards)
    with storage.atomic_open(f"{p}/{META}", fs) as f:
        f.write(document)
    for name in (DCP_METADATA, META):
        with fs.open(f"{p}/{name}", "rb") as f:
            files[name] = list(storage.sha256(f))
    with storage.atomic_open(f"{p}/{MANIFEST}", fs) as f:
        f.write(json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True).encode())
    return len(files)


def _remove(root: str, which: Callable[[list[str], list[str]], list[str]]) -> list[str]:
    """Remove the snapshot directories that `which(names, published)` picks from the root's listing;
    the names removed. A StorageError if storage refused."""
    try:
        names, published = listing(root)
        chosen = which(names, published)
        fs, p = storage.filesystem(root)
        for name in chosen:
            # The manifest first: a removal cut short leaves an unpublished directory, never a
            # damaged snapshot.
            if name in published:
                fs.rm(f"{p.rstrip('/')}/{name}/{MANIFEST}")
            fs.rm(f"{p.rstrip('/')}/{name}", recursive=True)
    except (SnapshotError, StorageError, *storage_errors()) as e:
        raise StorageError(f"could not remove sharded snapshots in {root}: {reason(e)}") from None
    return chosen


def prune(root: str, newest: str, keep: int, also_at_or_before: int | None = None) -> None:
    """Remove all but the newest `keep` published snapshots of distinct steps (and, with
    `also_at_or_before`, the newest of a step at or before it), and the unpublished ones older than
    `newest` (saves that died); a failure only warns."""

    def old(names: list[str], published: list[str]) -> list[str]:
        # A step saved again (its evaluation, cut short by a stop, redone on resume) supersedes its
        # earlier snapshot, which held a slot of an older step's.
        kept = list({order(n)[0]: n for n in published}.values())[-keep:]
        if also_at_or_before is not None:
            kept += [n for n in published if order(n)[0] <= also_at_or_before][-1:]
        unpublished = [n for n in names if n not in published and order(n) < order(newest)]
        return [n for n in published if n not in kept] + unpublished

    try:
        _remove(root, old)
    except StorageError as e:
        log.warning("%s", e)


def remove_after(root: str, step: int) -> list[str]:
    """Remove the snapshots of `root` saved after `step`, published or not; the names removed. A
    StorageError if storage refused."""
    return _remove(root, lambda names, _: [n for n in names if order(n)[0] > step])


def set_aside(root: str) -> str:
    """Move the snapshot root `root` to a new name beside it, and return that name; a StorageError
    if storage refused."""
    target = f"{root.rstrip('/')}-set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
    fs, p = storage.filesystem(root)
    try:
        fs.mv(p, storage.filesystem(target)[1], recursive=True)
    except storage_errors() as e:
        raise StorageError(f"could not move {root} aside to {target}: {reason(e)}") from None
    return target


# Everything DCP's index pickles, and nothing else.
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


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


class CheckedReader(FsspecReader):
    """DCP's fsspec reader, given the index already read and checked: DCP's own read_metadata would
    pickle.load the file."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._checked.storage_meta is None:
            self._checked.storage_meta = StorageMeta()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked


class Published(NamedTuple):
    """A published snapshot's record, each part checked against its manifest."""

    files: dict[str, list]  # the manifest: each file's [size, SHA-256]
    document: dict[str, Any]  # meta.json: the state's structure and its meta
    metadata: Metadata  # DCP's index


def read(directory: str) -> Published:
    """A published snapshot's manifest, meta.json and DCP's index, each checked against the
    manifest."""
    files = _json(directory, MANIFEST, "files")["files"]
    document = _json(directory, META, "meta", files)
    metadata = _index(directory, checked(directory, DCP_METADATA, files), files)
    return Published(files, document, metadata)


def _json(directory: str, name: str, key: str, files: dict[str, list] | None = None) -> dict:
    """A JSON file of the snapshot (checked against `files`) in this format, `key` a mapping in it.
    A manifest's entry that is not [size, SHA-256] matches no file: reading that file says so."""
    # Outside the try: a SnapshotError is a ValueError.
    data = checked(directory, name, files)
    try:
        document = json.loads(data)
        if document.get("format") != FORMAT or not isinstance(document.get(key), dict):
            raise ValueError(f"format {document.get('format')!r}")
    except (ValueError, AttributeError) as e:
        raise SnapshotError(
            f"snapshot {directory} is damaged: {name} cannot be read ({reason(e)})"
        ) from None
    return document


def _index(directory: str, data: bytes, files: dict[str, list]) -> Metadata:
    """DCP's index, unpickled with DCP's classes alone, holding only tensors, in files the manifest
    lists."""
    name = f"{directory}/{DCP_METADATA}"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise SnapshotError(
            f"refusing to load {name}: it holds pickled objects other than DCP's metadata, and "
            f"none of it was run ({reason(e)})"
        ) from None
    # Damaged bytes raise many types.
    except Exception as e:
        raise SnapshotError(
            f"snapshot {name} is damaged ({type(e).__name__}: {reason(e)})"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise SnapshotError(f"snapshot {name} is damaged (not DCP metadata)")
    for key, entry in metadata.state_dict_metadata.items():
        # DCP reads an entry that is not a tensor with torch.load(weights_only=False).
        if not isinstance(entry, TensorStorageMetadata):
            raise SnapshotError(
                f"refusing to load {name}: entry {key!r} is not a tensor, and none of it was run"
            )
    # DCP reads only files that were verified.
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path not in files:
            raise SnapshotError(
                f"snapshot {directory} is damaged: its index names a file that {MANIFEST} does not "
                f"list ({path or info!r})"
            )
    return metadata


def checked(
    directory: str, name: str, files: dict[str, list] | None = None, whole: bool = True
) -> bytes:
    """A file of the snapshot, checked against the size and sha256 that `files` lists; its bytes if
    `whole`."""
    fs, p = storage.filesystem(directory)
    try:
        with fs.open(f"{p}/{name}", "rb") as f:
            if whole:
                # hashed from memory, so that the bytes returned are the bytes checked
                data = f.read()
                size, digest = storage.sha256(io.BytesIO(data))
            else:
                data = b""
                size, digest = storage.sha256(f)
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


def verify(directory: str, files: dict[str, list], share: slice = slice(None)) -> None:
    """Check the shard files (a `share` of them, sorted by name) against the manifest."""
    shards = sorted(name for name in files if name not in (META, DCP_METADATA))
    for name in shards[share]:
        checked(directory, name, files, whole=False)
