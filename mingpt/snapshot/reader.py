"""Finding and reading a snapshot in one process: the one way generate, score, export and init_from
read a model.

A path given to them is a run directory (its best weights, else its latest snapshot), a snapshot
root (its newest published snapshot), one snapshot directory, or a single snapshot file (export's
format, or a run of an older mingpt). What is read is the model's weights under their names and the
run's record (its configs, vocabulary, step), never the optimizer state."""

import os
import posixpath
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt import storage
from mingpt.config import GPTConfig, TrainerConfig
from mingpt.data import CharTokenizer
from mingpt.model import GPT, parameter_count
from mingpt.snapshot import SnapshotError, compat, manifest, sharded, single_file
from mingpt.storage import StorageError, reason

DEFAULT_PATH = "snapshots"
# The files of a safetensors or transformers export (mingpt/export.py): a directory that is not a
# snapshot.
EXPORT_WEIGHTS = "model.safetensors"
EXPECTED = (
    "expected a snapshot directory, a snapshot file (export format=snapshot writes one) or a run "
    "directory"
)
HELP = (
    "a run directory (its best weights, else its latest snapshot), a snapshot root (its newest), "
    "one step-... snapshot directory or a snapshot file; local path or fsspec URL"
)


def resolve_path(snapshot_path: str | None, run_dir: str) -> str:
    """A run's snapshot root: a relative local path lives in the run directory; URLs and absolute
    paths are kept, and a leading `~` is the home directory, as in the other keys' paths."""
    path = snapshot_path or DEFAULT_PATH
    if "://" in path:
        return path
    # an absolute path as it is
    return os.path.join(run_dir, os.path.expanduser(path))


def best_path(root: str) -> str:
    """The root of the best weights of a run whose snapshot root is `root`: snapshots ->
    snapshots-best."""
    head, ext = posixpath.splitext(root.rstrip("/"))
    return f"{head}-best{ext}"


def find_best(root: str) -> str | None:
    """The best weights of the run whose snapshot root is `root`, if it has written them."""
    best = best_path(root)
    if not has_snapshot(best):
        return None
    return best


def has_snapshot(root: str) -> bool:
    return manifest.latest(root) is not None


def _run_snapshot(run_dir: str, config_file: str) -> tuple[str, str]:
    """A run directory's best weights, else its latest snapshot, where its config puts them; and
    which of the two it is, for the log."""
    try:
        saved = OmegaConf.load(config_file).get("trainer_config") or {}
        merged = OmegaConf.merge(OmegaConf.structured(TrainerConfig), saved)
        snapshot_path = OmegaConf.to_object(merged).snapshot_path
    # TrainerConfig's own check raises a ConfigError, a ValueError
    except (OmegaConfBaseException, OSError, ValueError, yaml.YAMLError) as e:
        raise SnapshotError(
            f"run directory {run_dir}: {config_file} cannot be read ({reason(e)})"
        ) from None
    root = resolve_path(snapshot_path, run_dir)
    best = find_best(root)
    if best:
        return best, (
            f"run directory {run_dir}: its best weights, {best} (the lowest held-out loss; the "
            f"latest snapshot is {root})"
        )
    if not has_snapshot(root):
        # a run of an older mingpt: its single file, where its config or the default put it
        old = root
        if not snapshot_path:
            old = os.path.join(run_dir, compat.OLD_DEFAULT_PATH)
        if not os.path.isfile(old):
            raise SnapshotError(
                f"{run_dir} is a run directory with no snapshot yet (it saves to {root})"
            )
        root = old
    return root, f"run directory {run_dir}: its snapshot is {root} (no best weights written yet)"


def find(path: str) -> tuple[str, str]:
    """The snapshot that `path` names, and for a run directory (a local directory with
    .hydra/config.yaml) a line for the log saying which it took: its best weights, else its latest
    snapshot. Any other path as given, with no line. A directory that cannot hold a snapshot (empty,
    an export) is refused."""
    local = path.removeprefix("file://")
    # A file of a snapshot directory is not a snapshot file: a .distcp would be called damaged.
    # Only beside a snapshot's own files: an export may be named meta.json or x.distcp.
    folder, name = posixpath.split(path)
    marks = (manifest.MANIFEST, manifest.DCP_METADATA)
    named_as_part = name in (*marks, manifest.META) or name.endswith(".distcp")
    if named_as_part and any(storage.exists(posixpath.join(folder, mark)) for mark in marks):
        raise SnapshotError(f"{path} is one file of the snapshot {folder}: give that directory")
    if "://" in local or not os.path.isdir(local):
        return path, ""
    config_file = os.path.join(local, ".hydra", "config.yaml")
    if os.path.isfile(config_file):
        return _run_snapshot(local, config_file)
    try:
        names = os.listdir(local)
    # A directory this user may not list (its permissions): what is in it cannot be known.
    except OSError as e:
        raise StorageError(f"cannot read snapshot {path}: {e.strerror or reason(e)}") from None
    if not names:
        raise SnapshotError(f"{path} is an empty directory; {EXPECTED}")
    if EXPORT_WEIGHTS in names:
        raise SnapshotError(
            f"{path} is an export in safetensors/transformers format, not a snapshot; {EXPECTED}"
        )
    return path, ""


def read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights (CPU tensors under the model's names) and the record of the snapshot that `path`
    names (`find`: the caller says which one of a run directory it took, once its input fits),
    its integrity checked; SnapshotError naming what is wrong."""
    path, _ = find(path)
    if storage.exists(path, directory=True):
        weights, meta = sharded.load_full(path, part="model")
        single_file.check_structure({"model_state": weights, **meta}, path)
    else:
        meta = single_file.load(path)
        weights = meta.pop("model_state")
        # An older file's optimizer state: nothing that reads a snapshot whole uses it.
        meta.pop("optimizer_state", None)
    single_file.check_model(meta, path)
    return weights, meta


def load_error(error: BaseException) -> str:
    """An error of load_state_dict as one line: its first line names only the model, what is wrong
    follows it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] or type(error).__name__


def check_size(config: GPTConfig, weights: dict[str, torch.Tensor]) -> None:
    """ValueError where the model that the record describes has more parameters than the
    snapshot's weights: the model is built on the host for its record, and a record that claims a
    million layers would fill memory before the weights could be found not to fit."""
    described = parameter_count(config)
    held = sum(t.numel() for t in weights.values())
    if described > held:
        raise ValueError(
            f"its record (gpt_config) describes a model of {described:,} parameters, and it holds "
            f"{held:,}"
        )


def load_model(path: str, device: torch.device) -> tuple[GPT, CharTokenizer, dict[str, Any]]:
    """The model of the snapshot that `path` names (float32, in eval mode, on `device`), its
    vocabulary and record."""
    weights, meta = read(path)
    # its vocabulary fits its shape: read checked the record (single_file.check_model)
    try:
        config = GPTConfig(**meta["gpt_config"])
        check_size(config, weights)
        # Built on the host, not on the meta device: there the embeddings' initialisation (normal_)
        # imports torch._dynamo, a second or two of a sampling command's start on a CPU.
        model = GPT(config, init_weights=False)
        model.load_state_dict({name: t.float() for name, t in weights.items()}, assign=True)
    except (TypeError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"snapshot {path} cannot be used: {load_error(e)}") from None
    return model.to(device).eval(), CharTokenizer(meta["vocab"]), meta
