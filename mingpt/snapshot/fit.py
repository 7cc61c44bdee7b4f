"""Whether a snapshot fits this run: shapes, vocabulary, result-affecting config, the same step on every rank."""

import dataclasses
import json
import logging
from typing import Any

import torch.distributed as dist

from mingpt.config import Config, result_items
from mingpt.distributed import DistInfo
from mingpt.snapshot import SnapshotError

log = logging.getLogger(__name__)

SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")


def check_compatible(
    state: dict[str, Any], gpt_config: dict[str, Any], vocab: str, path: str
) -> None:
    """Stop with one line naming the first difference between a snapshot and this run."""
    for key in SHAPE_KEYS:
        saved, current = state["gpt_config"].get(key), gpt_config.get(key)
        if saved != current:
            raise SnapshotError(
                f"snapshot {path} does not match: gpt_config.{key}: snapshot {saved}, config {current}"
            )
    if (saved := state["vocab"]) != vocab:
        raise SnapshotError(
            f"snapshot {path} does not match: vocabulary of {len(saved)} characters in the snapshot, "
            f"{len(vocab)} in the data (differs: {''.join(sorted(set(saved) ^ set(vocab)))!r})"
        )


def check_same_config(state: dict[str, Any], config: Config, path: str) -> list[str]:
    """Refuse a snapshot written with other values of result-affecting keys (those both configs have), naming each,
    unless allow_config_change (never another optimizer: its state would not load); return them as `key: old -> new`."""
    saved = result_items(state)
    current = result_items(dataclasses.asdict(config))
    changes = [
        f"{key}: {json.dumps(saved[key])} -> {json.dumps(current[key])}"
        for key in sorted(saved.keys() & current.keys())
        if saved[key] != current[key]
    ]
    if algorithm := [c for c in changes if c.startswith("optimizer_config.algorithm:")]:
        raise SnapshotError(
            f"snapshot {path} holds another optimizer's state ({algorithm[0]}): keep its "
            f"optimizer_config.algorithm, or fine-tune from it in a new run (trainer_config.init_from)"
        )
    if changes and not config.trainer_config.allow_config_change:
        raise SnapshotError(
            f"snapshot {path} was written with another config ({'; '.join(changes)}): start a new "
            "run in another directory (trainer_config.run_name or hydra.run.dir), or continue this one "
            "with the new values by adding trainer_config.allow_config_change=true"
        )
    return changes


def corpus_changes(saved: list[dict] | None, current: list[dict]) -> list[str]:
    """One line per file that differs between a snapshot's corpus (data.CharData.fingerprint, or None) and `current`."""
    if not isinstance(saved, list):
        return []
    changes = []
    for old, new in zip(saved, current):
        if old.get("size") != new["size"]:
            changes.append(f"{new['source']}: {old.get('size')} -> {new['size']} bytes")
        elif old.get("sha256") != new["sha256"]:
            changes.append(f"{new['source']}: other content (same size, {new['size']} bytes)")
    return (
        changes
        + [f"{new['source']} added" for new in current[len(saved) :]]
        + [f"{old.get('source')} removed" for old in saved[len(current) :]]
    )


def check_fits(
    state: dict[str, Any],
    config: Config,
    vocab: str,
    path: str,
    dist_info: DistInfo,
    corpus: list[dict] | None = None,
) -> None:
    """The snapshot's shapes, vocabulary, corpus (if `corpus`) and config are this run's or allowed (rank 0 says)."""
    moved = corpus_changes(state.get("corpus"), corpus) if corpus is not None else []
    if moved and (saved := state.get("vocab") or "") != vocab:
        raise SnapshotError(
            f"snapshot {path} was written for another corpus ({'; '.join(moved)}) whose vocabulary "
            f"differs ({len(saved)} characters in the snapshot, {len(vocab)} now; differs: "
            f"{''.join(sorted(set(saved) ^ set(vocab)))!r}), and a model keeps its vocabulary: start "
            "a new run in another directory, or fine-tune this one (trainer_config.init_from)"
        )
    check_compatible(state, dataclasses.asdict(config.gpt_config), vocab, path)
    if moved and not config.trainer_config.allow_config_change:
        raise SnapshotError(
            f"snapshot {path} was written for another corpus ({'; '.join(moved)}): its held-out "
            "split is no longer this corpus's; start a new run in another directory, or continue "
            "this one on the new corpus by adding trainer_config.allow_config_change=true"
        )
    changes = check_same_config(state, config, path)
    if moved and dist_info.is_main_process:
        log.warning(
            "continuing %s on a changed corpus (%s): the held-out split moved, so evaluation losses before "
            "and after differ in text, and text held out before may now be trained on",
            path,
            "; ".join(moved),
        )
    if changes and dist_info.is_main_process:
        log.warning("continuing %s with a changed config: %s", path, "; ".join(changes))


def check_same_start(dist_info: DistInfo, step: int, path: str) -> None:
    """All ranks start from the same step: a snapshot only some of them see (a node-local path) would split the run."""
    if not dist_info.is_distributed:
        return
    steps: list[Any] = [None] * dist_info.world_size
    dist.all_gather_object(steps, step)
    if len(set(steps)) > 1:
        raise SnapshotError(
            f"the ranks start from different steps {steps} (snapshot {path}): keep the snapshot "
            "where every node sees it (a shared file system, s3://, gs://)"
        )
