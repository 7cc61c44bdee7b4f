"""Snapshots: atomic saves to any fsspec URL, safe loads, and validation.

A snapshot is a plain dict of tensors, numbers, strings, lists and dicts, so
it loads with torch.load(weights_only=True): a file that carries pickled code
is refused and none of it runs. Saves write a temporary file beside the target
and move it into place, so the snapshot path only ever holds a complete file.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import uuid
import zipfile
from typing import Any

import fsspec
import torch

log = logging.getLogger(__name__)


class SnapshotError(ValueError):
    """A snapshot cannot be read or does not fit this run; the message names the file."""


# The GPTConfig fields that fix the shapes of the weights.
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")


def exists(path: str) -> bool:
    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` atomically: a crash mid-save leaves the previous file intact."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fs, p = fsspec.core.url_to_fs(path)
    parent = os.path.dirname(p)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            if hasattr(f, "fileno"):  # local file: make it durable before it replaces the old one
                f.flush()
                os.fsync(f.fileno())
        fs.mv(tmp, p)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)


def load(path: str) -> dict[str, Any]:
    """Read a snapshot to CPU with weights_only=True, or raise SnapshotError naming the file."""
    try:
        with fsspec.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SnapshotError(f"snapshot not found: {path}") from None
    except (OSError, ValueError, ImportError) as e:
        raise SnapshotError(f"cannot read snapshot {path}: {e}") from None
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SnapshotError(
            f"refusing to load {path}: it holds objects other than tensors and plain data ({first})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError):
        raise SnapshotError(f"snapshot {path} is truncated or not a torch snapshot") from None
    if not isinstance(state, dict) or "model_state" not in state or "gpt_config" not in state:
        raise SnapshotError(f"{path} is not a mingpt snapshot (no model_state/gpt_config)")
    return state


def check_compatible(state: dict[str, Any], gpt_config: dict[str, Any], vocab: str, path: str) -> None:
    """Stop with one line naming the first difference between a snapshot and this run."""
    for key in SHAPE_KEYS:
        saved, current = state["gpt_config"].get(key), gpt_config.get(key)
        if saved != current:
            raise SnapshotError(f"snapshot {path} does not match: gpt_config.{key}: snapshot {saved}, config {current}")
    if state.get("vocab") != vocab:
        saved = state.get("vocab") or ""
        raise SnapshotError(
            f"snapshot {path} does not match: vocabulary of {len(saved)} characters in the snapshot, "
            f"{len(vocab)} in the data (differs: {''.join(sorted(set(saved) ^ set(vocab)))!r})"
        )
