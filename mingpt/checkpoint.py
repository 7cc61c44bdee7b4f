"""Snapshots: atomic saves to any fsspec URL, safe loads, and validation.

A snapshot is a plain dict of tensors, numbers, strings, lists and dicts, so
it loads with torch.load(weights_only=True): a file that carries pickled code
is refused and none of it runs. Saves write a temporary file beside the target
and move it into place, so the snapshot path only ever holds a complete file.
One snapshot is kept: since a crash can never leave a broken file there, an
unreadable snapshot means outside damage, and the run stops rather than
quietly going back to an older state.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import re
import uuid
import zipfile
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from mingpt.config import Config, result_items

log = logging.getLogger(__name__)


class SnapshotError(ValueError):
    """A snapshot cannot be read or does not fit this run; the message names the file."""


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
    except OSError as e:
        raise SnapshotError(f"cannot reach snapshot path {path}: {e}") from None


def save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` atomically: a crash mid-save leaves the previous file intact."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fs, p = _filesystem(path)
    fs.makedirs(fs._parent(p), exist_ok=True)
    for stale in fs.glob(f"{p}{TMP_MARK}*"):  # left by a save that was killed
        fs.rm(stale)
    tmp = f"{p}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    local = isinstance(fs, LocalFileSystem)
    try:
        with fs.open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            if local:  # the bytes reach the disk before the new name points at them
                f.flush()
                os.fsync(f.fileno())
        fs.mv(tmp, p)  # a rename on local disks; object stores publish whole objects
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)
    if local:  # make the rename itself durable
        fd = os.open(fs._parent(p), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load(path: str) -> dict[str, Any]:
    """Read a snapshot to CPU with weights_only=True, or raise SnapshotError naming the file."""
    fs, p = _filesystem(path)
    try:
        with fs.open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SnapshotError(f"snapshot not found: {path}") from None
    except OSError as e:
        raise SnapshotError(f"cannot read snapshot {path}: {e}") from None
    if not zipfile.is_zipfile(io.BytesIO(data)):  # torch.save writes a zip archive; its index is at the end
        raise SnapshotError(f"snapshot {path} is truncated or not a torch snapshot ({len(data)} bytes)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"WeightsUnpickler error: (.*?)(?:\. Please|\n|$)", str(e))
        reason = found.group(1) if found else "objects other than tensors and plain data"
        raise SnapshotError(
            f"refusing to load {path}: it holds pickled objects other than tensors and plain data, "
            f"and none of it was run ({reason})"
        ) from None
    except Exception as e:  # torch.load on damaged bytes raises many types
        first_line = str(e).partition("\n")[0]
        raise SnapshotError(f"snapshot {path} is damaged ({type(e).__name__}: {first_line})") from None
    missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise SnapshotError(f"{path} is not a mingpt snapshot (no {', '.join(missing)})")
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
