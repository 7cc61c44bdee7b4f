"""Snapshots: atomic saves to any fsspec URL, safe loads, and validation.

A snapshot is a plain dict of tensors, numbers, strings, lists and dicts, so
it loads with torch.load(weights_only=True): a file that carries pickled code
is refused and none of it runs. Saves write a temporary file beside the target
and move it into place, so the snapshot path only ever holds a complete file.
One snapshot is kept: since a crash can never leave a broken file there, an
unreadable snapshot means outside damage, and the run stops rather than
quietly going back to an older state.

Every snapshot is verified before it is used: torch.save writes a zip archive
whose records each carry a CRC-32 of their bytes, and `verify` recomputes them
all, so a flipped bit anywhere in the file is caught, not loaded. Storage that
fails (a full disk, a read-only or missing location, an unreachable object
store) is one StorageError naming the path; `check_writable` finds most of
these at start, before any training.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import re
import struct
import sys
import uuid
import zipfile
import zlib
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from mingpt.config import Config, result_items

log = logging.getLogger(__name__)


class SnapshotError(ValueError):
    """A snapshot cannot be read or does not fit this run; the message names the file."""


class StorageError(SnapshotError):
    """Storage cannot be reached, read or written; the message names the path."""


def storage_errors() -> tuple[type[BaseException], ...]:
    """What fsspec operations raise when the storage behind them fails: OSError,
    and the client libraries' own exceptions that are not OSErrors (botocore's
    EndpointConnectionError for an unreachable S3 endpoint, aiohttp's for GCS).
    A library that is not imported yet cannot have raised anything."""
    errors: list[type[BaseException]] = [OSError]
    if "botocore" in sys.modules:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += [BotoCoreError, ClientError]
    if "aiohttp" in sys.modules:
        from aiohttp import ClientError as AiohttpClientError

        errors.append(AiohttpClientError)
    return tuple(errors)


def reason(error: BaseException) -> str:
    """An exception as one line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# The GPTConfig fields that fix the shapes of the weights.
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
# What every mingpt snapshot holds (the trainer writes more).
REQUIRED_KEYS = ("model_state", "optimizer_state", "gpt_config", "vocab", "epoch", "samples_in_epoch", "step")
TMP_MARK = ".tmp-"


def _filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:  # s3fs or gcsfs not installed, unknown protocol
        raise SnapshotError(
            f"cannot use snapshot path {path}: {e} (s3:// and gs:// need pip install -e \".[s3]\" or \".[gcs]\")"
        ) from None


def exists(path: str) -> bool:
    fs, p = _filesystem(path)
    try:
        return fs.exists(p)
    except storage_errors() as e:
        raise StorageError(f"cannot reach snapshot path {path}: {reason(e)}") from None


def is_directory(path: str) -> bool:
    """Whether `path` is a directory: a sharded snapshot (mingpt/sharded.py), not a snapshot file."""
    fs, p = _filesystem(path)
    try:
        return fs.isdir(p)
    except storage_errors() as e:
        raise StorageError(f"cannot reach snapshot path {path}: {reason(e)}") from None


def _bucket(fs: fsspec.AbstractFileSystem, p: str) -> str | None:
    """The bucket of an object-store path (s3, gs, ...: paths without a leading /), else None."""
    if isinstance(fs, LocalFileSystem) or p.startswith("/"):
        return None
    return p.split("/", 1)[0]


def _check_bucket(fs: fsspec.AbstractFileSystem, p: str, path: str) -> None:
    """s3fs creates a missing bucket on makedirs, so a typo would make a new one: refuse instead."""
    bucket = _bucket(fs, p)
    if bucket is None:
        return
    try:
        fs.info(bucket)  # not exists(): s3fs answers False for a bucket it cannot reach
    except FileNotFoundError:
        raise StorageError(
            f"cannot use snapshot path {path}: bucket {bucket!r} does not exist (create it first)"
        ) from None


def check_writable(run_dir: str, snapshot_path: str) -> None:
    """Before any training: the run directory and the snapshot location can be
    written (a file is created there and removed), and an object store's bucket
    exists. Raises StorageError naming the path."""
    for label, path, probe in (
        ("run directory", run_dir, os.path.join(run_dir, f".write-probe-{uuid.uuid4().hex[:8]}")),
        ("snapshot path", snapshot_path, f"{snapshot_path}{TMP_MARK}probe-{uuid.uuid4().hex[:8]}"),
    ):
        fs, p = _filesystem(probe)
        try:
            _check_bucket(fs, p, path)
            if _bucket(fs, p) is None:
                fs.makedirs(fs._parent(p), exist_ok=True)
            with fs.open(p, "wb") as f:
                f.write(b"\0")
            fs.rm(p)
        except storage_errors() as e:
            raise StorageError(f"cannot write to the {label} {path}: {reason(e)}") from None


class _Sink:
    """The file torch.save writes to, keeping the first storage error a write met:
    torch reports it as a RuntimeError ("unexpected pos ...") that hides the cause."""

    def __init__(self, file: Any):
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except storage_errors() as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.file.flush()


def _save_to(state: dict[str, Any], file: Any) -> None:
    """torch.save into an open file, raising the storage error behind a failed write."""
    sink = _Sink(file)
    try:
        torch.save(state, sink)
    except RuntimeError:
        if sink.error is None:
            raise
    if sink.error is not None:
        raise sink.error


def save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` atomically: a crash mid-save leaves the previous
    file intact. A storage failure raises StorageError, with the previous file
    intact too. torch.save streams into the temporary file (an object store's
    file uploads in parts as it fills), so the snapshot is never built whole in memory."""
    fs, p = _filesystem(path)
    tmp = f"{p}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    local = isinstance(fs, LocalFileSystem)
    try:
        _check_bucket(fs, p, path)
        if _bucket(fs, p) is None:
            fs.makedirs(fs._parent(p), exist_ok=True)
        for stale in fs.glob(f"{p}{TMP_MARK}*"):  # left by a save that was killed
            fs.rm(stale)
        try:
            with fs.open(tmp, "wb") as f:
                _save_to(state, f)
                if local:  # the bytes reach the disk before the new name points at them
                    f.flush()
                    os.fsync(f.fileno())
            fs.mv(tmp, p)  # a rename on local disks; object stores publish whole objects
        finally:
            try:
                if fs.exists(tmp):
                    fs.rm(tmp)
            except storage_errors():
                pass  # the save's own error says more; the next save removes it
        if local:  # make the rename itself durable
            fd = os.open(fs._parent(p), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except storage_errors() as e:
        raise StorageError(f"cannot save snapshot {path}: {reason(e)}; the file there before is unchanged") from None


def verify(data: bytes, name: str) -> None:
    """Check a snapshot file's bytes against the CRC-32 that torch.save stored
    with each record of its zip archive (the pickle, every tensor's storage),
    or raise SnapshotError naming the file. Every file of a snapshot passes
    here before torch reads it; a sharded format would pass each shard.
    The checksums are computed over the bytes in place, without copies."""
    view = memoryview(data)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = archive.infolist()
        for record in records:
            h = record.header_offset
            if bytes(view[h : h + 4]) != b"PK\x03\x04" or record.compress_type != zipfile.ZIP_STORED:
                raise zipfile.BadZipFile(f"record {record.filename} has no valid header")
            name_len, extra_len = struct.unpack("<HH", view[h + 26 : h + 30])
            begin = h + 30 + name_len + extra_len
            if begin + record.compress_size > len(data):
                raise zipfile.BadZipFile(f"record {record.filename} ends past the end of the file")
            if zlib.crc32(view[begin : begin + record.compress_size]) != record.CRC:
                break
        else:
            return
    except (zipfile.BadZipFile, struct.error, ValueError, EOFError) as e:
        raise SnapshotError(f"snapshot {name} is damaged ({reason(e)})") from None
    raise SnapshotError(
        f"snapshot {name} is damaged: the checksum of its record {record.filename} does not match its bytes "
        "(changed after it was written)"
    )


# What each field of a snapshot must be: (accepted types, description).
FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model_state": ((dict,), "a mapping of names to tensors"),
    "optimizer_state": ((dict,), "a mapping"),
    "gpt_config": ((dict,), "a mapping"),
    "vocab": ((str,), "a string"),
    "epoch": ((int,), "a whole number >= 0"),
    "samples_in_epoch": ((int,), "a whole number >= 0"),
    "step": ((int,), "a whole number >= 0"),
    "scaler_state": ((dict,), "a mapping"),
    "best_eval_loss": ((float, int), "a number"),
}


def check_structure(state: Any, path: str) -> None:
    """The snapshot is a dict with every required field, each of the right
    type, and finite floating-point weights; else SnapshotError naming the field."""
    missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise SnapshotError(f"{path} is not a mingpt snapshot (no {', '.join(missing)})")
    for key, (types, what) in FIELD_TYPES.items():
        value = state.get(key)
        if key not in state or (isinstance(value, types) and not isinstance(value, bool)):
            if key in ("epoch", "samples_in_epoch", "step") and value < 0:
                raise SnapshotError(f"snapshot {path} is not usable: {key} must be {what}, got {value}")
            continue
        raise SnapshotError(f"snapshot {path} is not usable: {key} must be {what}, got {type(value).__name__}")
    for name, tensor in state["model_state"].items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise SnapshotError(f"snapshot {path} is not usable: model_state[{name!r}] is {kind}, not a float tensor")
        if not torch.isfinite(tensor).all():
            raise SnapshotError(f"snapshot {path} has non-finite weights (nan or inf in {name}): it cannot be used")


def load(path: str) -> dict[str, Any]:
    """Read a snapshot to CPU with weights_only=True after verifying its
    checksums and before checking its structure, or raise SnapshotError naming the file."""
    fs, p = _filesystem(path)
    try:
        with fs.open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SnapshotError(f"snapshot not found: {path}") from None
    except storage_errors() as e:
        raise StorageError(f"cannot read snapshot {path}: {reason(e)}") from None
    if not zipfile.is_zipfile(io.BytesIO(data)):  # torch.save writes a zip archive; its index is at the end
        raise SnapshotError(f"snapshot {path} is truncated or not a torch snapshot ({len(data)} bytes)")
    verify(data, path)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"WeightsUnpickler error: (.*?)(?:\. Please|\n|$)", str(e))
        if not found or not found.group(1).strip() or found.group(1).startswith("Unsupported operand"):
            # Nothing was refused: the pickle itself is malformed.
            raise SnapshotError(f"snapshot {path} is damaged (its pickle cannot be read: {reason(e)})") from None
        raise SnapshotError(
            f"refusing to load {path}: it holds pickled objects other than tensors and plain data, "
            f"and none of it was run ({found.group(1)})"
        ) from None
    except Exception as e:  # torch.load on damaged bytes raises many types
        raise SnapshotError(f"snapshot {path} is damaged ({type(e).__name__}: {reason(e)})") from None
    check_structure(state, path)
    return state


def check_compatible(state: dict[str, Any], gpt_config: dict[str, Any], vocab: str, path: str) -> None:
    """Stop with one line naming the first difference between a snapshot and this run."""
    for key in SHAPE_KEYS:
        saved, current = state["gpt_config"].get(key), gpt_config.get(key)
        if saved != current:
            raise SnapshotError(f"snapshot {path} does not match: gpt_config.{key}: snapshot {saved}, config {current}")
    if state["vocab"] != vocab:
        saved = state["vocab"]
        raise SnapshotError(
            f"snapshot {path} does not match: vocabulary of {len(saved)} characters in the snapshot, "
            f"{len(vocab)} in the data (differs: {''.join(sorted(set(saved) ^ set(vocab)))!r})"
        )


def config_changes(state: dict[str, Any], config: Config) -> list[str]:
    """`key: old -> new` for each result-affecting key (mingpt.config.OPERATIONAL_KEYS
    lists the others) whose value in the snapshot's saved configs differs from
    `config`'s. Keys that one of them lacks (an older snapshot) are not compared."""
    saved = result_items(state)
    current = result_items({f.name: dataclasses.asdict(getattr(config, f.name)) for f in dataclasses.fields(config)})
    return [f"{key}: {json.dumps(saved[key])} -> {json.dumps(current[key])}"
            for key in sorted(saved.keys() & current.keys()) if saved[key] != current[key]]


def check_same_config(state: dict[str, Any], config: Config, path: str) -> list[str]:
    """Refuse to resume a snapshot written with other result-affecting values,
    naming each, unless trainer_config.allow_config_change; return the changes."""
    changes = config_changes(state, config)
    if changes and not config.trainer_config.allow_config_change:
        raise SnapshotError(
            f"snapshot {path} was written with another config ({'; '.join(changes)}): start a new run in another "
            f"directory (trainer_config.run_name or hydra.run.dir), or continue this one with the new values "
            f"by adding trainer_config.allow_config_change=true"
        )
    return changes
