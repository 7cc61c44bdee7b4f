"""The single-file snapshot: one torch.save file of plain data and tensors at any fsspec URL, written by export and
read by generate, score, export and init_from with torch.load(weights_only=True) after its CRC-32s are checked.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import zipfile
import zlib
from typing import Any

import torch

from mingpt import storage
from mingpt.snapshot import SnapshotError
from mingpt.storage import StorageError, reason, storage_errors

REQUIRED_KEYS = ("model_state", "optimizer_state", "gpt_config", "vocab", "epoch", "samples_in_epoch", "step")


def is_torch_file(path: str) -> bool:
    """Whether the local file at `path` starts as torch.save's zip archive does."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` atomically, streamed (never built whole in memory); StorageError if storage fails,
    the previous file intact."""
    fs, p = storage.filesystem(path)
    try:
        storage.prepare_parent(fs, p, path)
        for stale in fs.glob(f"{p}{storage.TMP_MARK}*"):  # left by a save that was killed
            fs.rm(stale)
        with storage.atomic_open(p, fs) as f:
            sink = storage.Sink(f)  # torch.save hides a failed write's cause
            try:
                torch.save(state, sink)
            except RuntimeError:
                if sink.error is None:
                    raise
            if sink.error is not None:
                raise sink.error
    except storage_errors() as e:
        raise StorageError(f"cannot save snapshot {path}: {reason(e)}; the file there before is unchanged") from None


def verify(data: bytes, name: str) -> None:
    """Check a snapshot file's bytes, in place, against the CRC-32 that torch.save stored with each record of its zip
    archive (the pickle, every tensor's storage); SnapshotError naming the file otherwise."""
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
    """The snapshot is a dict with every required field, each of its type, and finite floating-point weights; else
    SnapshotError naming the field."""
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
    """A snapshot read to CPU, its checksums, pickle and structure checked; SnapshotError naming the file otherwise."""
    storage.check_regular(path, "snapshot")
    fs, p = storage.filesystem(path)
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
