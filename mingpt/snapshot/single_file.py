"""The single snapshot file: export's format (`export format=snapshot`), and what runs of an older
mingpt wrote. One torch.save file at any fsspec URL: the weights as `model_state` beside the run's
record (its configs, vocabulary, step). Read with its CRC-32s checked and only tensors and plain
data unpickled."""

import contextlib
import io
import pickle
import re
import zipfile
from typing import Any

import torch

from mingpt import storage
from mingpt.config import SECTIONS
from mingpt.snapshot import SnapshotError
from mingpt.storage import StorageError, reason, storage_errors

COUNTS = ("epoch", "samples_in_epoch", "step")
# the counts, those a record may lack too
WHOLE_NUMBERS = (*COUNTS, "best_step", "evals_without_improvement")
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
REQUIRED_KEYS = ("model_state", "gpt_config", "vocab", *COUNTS)
# What each field must be: (accepted types, in words).
FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model_state": ((dict,), "a mapping of names to tensors"),
    **{key: ((dict,), "a mapping") for key in ("optimizer_state", *SECTIONS, "scaler_state")},
    "vocab": ((str,), "a string"),
    **{key: ((int,), "a whole number >= 0") for key in WHOLE_NUMBERS},
    "best_eval_loss": ((float, int), "a number"),
    "early_stop_reference": ((float, int), "a number"),
    "last_eval_loss": ((float, int, type(None)), "a number or null"),
    **{key: ((bool,), "true or false") for key in ("stopped_early", "eval_due", "sample_due")},
}


def save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` atomically, streamed; StorageError if storage fails, the file before
    intact."""
    fs, p = storage.filesystem(path)
    try:
        storage.prepare_parent(fs, p, path)
        # Left by a save that was killed.
        for stale in storage.glob_after(fs, p, f"{storage.TMP_MARK}*"):
            fs.rm(stale)
        with storage.atomic_open(p, fs) as f:
            # torch.save hides a failed write's cause.
            sink = storage.Sink(f)
            try:
                torch.save(state, sink)
            finally:
                if sink.error is not None:
                    raise sink.error
    except storage_errors() as e:
        kept = ""
        with contextlib.suppress(*storage_errors()):
            if fs.exists(p):
                kept = "; the file there before is unchanged"
        # An OSError's own text names the temporary file that the save writes first.
        why = getattr(e, "strerror", None) or reason(e)
        raise StorageError(f"cannot save snapshot {path}: {why}{kept}") from None


def is_snapshot_file(path: str) -> bool:
    """Whether the local file at `path` is a snapshot file, not some other file of the user's: a zip
    archive (torch.save writes one) or another program's torch file. Its record alone is read, the
    tensors mapped, not loaded."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    # Any file at all: torch.load on one that is not its own raises many types.
    except Exception:
        return False
    return isinstance(state, dict) and all(key in state for key in REQUIRED_KEYS)


def verify(data: bytes, name: str) -> None:
    """Check a snapshot file's bytes against the CRC-32 that torch.save stored with each record of
    its zip archive (the pickle, every tensor's storage); SnapshotError naming the file otherwise.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise SnapshotError(f"snapshot {name} is damaged ({reason(e)})") from None
    if bad is not None:
        raise SnapshotError(
            f"snapshot {name} is damaged: the checksum of its record {bad} does not match its "
            "bytes (changed after it was written)"
        )


def check_structure(state: Any, path: str) -> None:
    """SnapshotError naming the first field missing or of another type, or a weight that is not a
    finite float tensor."""
    missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise SnapshotError(f"{path} is not a mingpt snapshot (no {', '.join(missing)})")
    for key, (types, what) in FIELD_TYPES.items():
        if key not in state:
            continue
        value = state[key]
        # isinstance takes True for an int: no count or number
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise SnapshotError(
                f"snapshot {path} is not usable: {key} must be {what}, got {type(value).__name__}"
            )
        if key in WHOLE_NUMBERS and value < 0:
            raise SnapshotError(f"snapshot {path} is not usable: {key} must be {what}, got {value}")
    for name, tensor in state["model_state"].items():
        is_float = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
        if not is_float or not isinstance(name, str):
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise SnapshotError(
                f"snapshot {path} is not usable: model_state[{name!r}] is {kind}, not a float "
                "tensor"
            )
        if not torch.isfinite(tensor).all():
            raise SnapshotError(
                f"snapshot {path} has non-finite weights (nan or inf in {name}): it cannot be used"
            )


def check_model(meta: dict[str, Any], path: str) -> None:
    """SnapshotError unless a record that check_structure passed gives its model's whole shape, and
    a vocabulary of gpt_config.vocab_size sorted distinct characters: what a model is built from."""
    shape = meta["gpt_config"]
    vocab = meta["vocab"]
    shaped = all(isinstance(shape.get(k), int) for k in SHAPE_KEYS)
    # token i is the i-th character in sorted order (data.CharTokenizer)
    if not shaped or vocab != "".join(sorted(set(vocab))) or len(vocab) != shape["vocab_size"]:
        raise SnapshotError(
            f"snapshot {path} is not usable: it does not record its model's shape and vocabulary "
            "(gpt_config, and vocab: its sorted distinct characters, gpt_config.vocab_size of them)"
        )


def check_record(meta: dict[str, Any], path: str) -> None:
    """check_structure for a sharded snapshot's record (its meta.json, where reading it found a
    mapping), read before its weights."""
    check_structure({**meta, "model_state": {}}, path)


def _unpickling_error(error: pickle.UnpicklingError, path: str) -> SnapshotError:
    """torch's weights-only unpickler refuses a global it does not allow (code that would run) and
    fails on damaged bytes alike: its message tells them apart."""
    found = re.search(r"WeightsUnpickler error: (.*?)(?:\. Please|\n|$)", str(error))
    refused = (
        found and found.group(1).strip() and not found.group(1).startswith("Unsupported operand")
    )
    if not refused:
        return SnapshotError(
            f"snapshot {path} is damaged (its pickle cannot be read: {reason(error)})"
        )
    return SnapshotError(
        f"refusing to load {path}: it holds pickled objects other than tensors and plain data, and "
        f"none of it was run ({found.group(1)})"
    )


def load(path: str) -> dict[str, Any]:
    """A snapshot file read to CPU, its checksums, pickle and structure checked; SnapshotError
    naming the file otherwise."""
    storage.check_regular(path, "snapshot")
    fs, p = storage.filesystem(path)
    try:
        data = fs.cat_file(p)
    except FileNotFoundError:
        raise SnapshotError(f"snapshot not found: {path}") from None
    except storage_errors() as e:
        raise StorageError(f"cannot read snapshot {path}: {reason(e)}") from None
    # torch.save writes a zip archive, whose index is at its end.
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise SnapshotError(
            f"snapshot {path} is truncated or not a torch snapshot ({len(data)} bytes)"
        )
    verify(data, path)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _unpickling_error(e, path) from None
    # torch.load on damaged bytes raises many types.
    except Exception as e:
        raise SnapshotError(
            f"snapshot {path} is damaged ({type(e).__name__}: {reason(e)})"
        ) from None
    check_structure(state, path)
    return state
