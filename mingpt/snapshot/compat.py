"""Whether a snapshot can be this run's: its model's shape and vocabulary, its corpus and
result-affecting config, the same step on every rank; a single snapshot file where the run's
snapshots should be is refused."""

import contextlib
import dataclasses
import json
import logging
import math
import os
import posixpath
import shlex
import uuid
from typing import Any

from hydra.core.hydra_config import HydraConfig

from mingpt import storage
from mingpt.config import Config, result_items, value_text
from mingpt.distributed import SAME_ON_EVERY_RANK, DistInfo, all_gather
from mingpt.rundir import directory_key, new_run_hint, shell_override
from mingpt.snapshot import SnapshotError, manifest, single_file

log = logging.getLogger(__name__)

# Set by the data, not by the user: the corpus gives the vocabulary, data_config.block_size the
# model's block.
FROM_DATA = ("gpt_config.vocab_size", "gpt_config.block_size")
# The single file that a run of mingpt wrote before its snapshots became Distributed Checkpoints.
OLD_DEFAULT_PATH = "snapshot.pt"


def _differing(saved: str, current: str) -> str:
    """The characters in one vocabulary and not the other, for a message."""
    return repr("".join(sorted(set(saved) ^ set(current))))


def check_compatible(
    state: dict[str, Any], gpt_config: dict[str, Any], vocab: str, path: str
) -> None:
    """Stop with one line naming the first difference between a snapshot's model and this run's."""
    for key in single_file.SHAPE_KEYS:
        saved = state["gpt_config"].get(key)
        current = gpt_config.get(key)
        if saved != current:
            raise SnapshotError(
                f"snapshot {path} does not match: gpt_config.{key}: snapshot {saved}, config "
                f"{current}"
            )
    saved = state["vocab"]
    if saved != vocab:
        raise SnapshotError(
            f"snapshot {path} does not match: vocabulary of {len(saved)} characters in the "
            f"snapshot, {len(vocab)} in the data (differs: {_differing(saved, vocab)})"
        )


def config_changes(state: dict[str, Any], config: Config) -> dict[str, tuple[Any, Any]]:
    """The result-affecting keys (those both configs have) whose values differ between a snapshot's
    config and `config`, in order: {key: (the snapshot's value, this config's)}."""
    saved = result_items(state)
    current = result_items(dataclasses.asdict(config))
    return {
        key: (saved[key], current[key])
        for key in sorted(saved.keys() & current.keys())
        if saved[key] != current[key]
    }


def described(changes: dict[str, tuple[Any, Any]]) -> list[str]:
    """Each change as `key: old -> new`, for a message."""
    return [f"{key}: {json.dumps(old)} -> {json.dumps(new)}" for key, (old, new) in changes.items()]


def check_same_config(
    state: dict[str, Any], config: Config, path: str, run_dir: str | None = None
) -> dict[str, tuple[Any, Any]]:
    """Refuse a snapshot written with other values of result-affecting keys (those both configs
    have), naming each, unless allow_config_change; never another optimizer, whose state would not
    load. Returns the changes (config_changes). `run_dir` (where known) names what a new run
    changes: hydra.run.dir, where it and not run_name places the run."""
    changes = config_changes(state, config)
    if "optimizer_config.algorithm" in changes:
        algorithm = described({"optimizer_config.algorithm": changes["optimizer_config.algorithm"]})
        raise SnapshotError(
            f"snapshot {path} holds another optimizer's state ({algorithm[0]}): keep its "
            f"optimizer_config.algorithm, start a new run with "
            f"{new_run_hint(config.trainer_config, run_dir)}, or fine-tune from it in one "
            "(trainer_config.init_from)"
        )
    if changes and not config.trainer_config.allow_config_change:
        own = " ".join(_override(key, old) for key, (old, _) in changes.items())
        if directory_key() == "hydra.sweep.dir":
            # Added to the sweep's command, they would make it one job, job 0 (in another job's
            # directory): they are that job's.
            own = f"{own}, as job {HydraConfig.get().job.num} of the sweep"
        raise SnapshotError(
            f"snapshot {path} was written with another config ({'; '.join(described(changes))}): "
            f"start a new run with {new_run_hint(config.trainer_config, run_dir)}, continue that "
            f"run with its own values ({own}), or with the new ones (add "
            "trainer_config.allow_config_change=true)"
        )
    return changes


def _override(key: str, value: Any) -> str:
    """`key=value` to paste into a shell: a string as Hydra reads it back, any other value as the
    command line spells it (`3`, `null`, `true`)."""
    if isinstance(value, str):
        return shell_override(key, value)
    return shlex.quote(f"{key}={value_text(value)}")


def _contents(files: list[dict]) -> list[tuple]:
    return [(f.get("size"), f.get("sha256")) for f in files]


def corpus_changes(saved: list[dict] | None, current: list[dict]) -> list[str]:
    """One line per file that differs between a snapshot's corpus (data.CharData.fingerprint, or
    None) and `current`, matched by name; none where the same texts come in the same order, however
    their paths are spelled."""
    if not isinstance(saved, list) or _contents(saved) == _contents(current):
        return []
    old = {f.get("source"): f for f in saved}
    new = {f["source"]: f for f in current}
    changes = []
    for source, now in new.items():
        before = old.get(source)
        if before is None:
            changes.append(f"{source} added")
        elif before.get("size") != now["size"]:
            changes.append(f"{source}: {before.get('size')} -> {now['size']} bytes")
        elif before.get("sha256") != now["sha256"]:
            changes.append(f"{source}: other content (same size, {now['size']} bytes)")
    changes += [f"{source} removed" for source in old if source not in new]
    if not changes:
        changes.append("the same files in another order")
    return changes


def check_fits(
    state: dict[str, Any],
    config: Config,
    vocab: str,
    path: str,
    corpus: list[dict],
    run_dir: str | None = None,
) -> None:
    """The snapshot's shapes, vocabulary, corpus and config are this run's, or allowed to differ;
    rank 0 warns of what changed (SAME_ON_EVERY_RANK). A refusal's new run is named as for `run_dir`
    (check_same_config)."""
    new_run = new_run_hint(config.trainer_config, run_dir)
    moved = corpus_changes(state.get("corpus"), corpus)
    if isinstance(state.get("corpus"), list) and not moved:
        # the same texts in the same order: a path spelled otherwise (./a.txt, the file moved) is
        # no change
        state = {**state, "data_config": {**state["data_config"], "path": config.data_config.path}}
    saved_vocab = state.get("vocab") or ""
    if moved and saved_vocab != vocab:
        raise SnapshotError(
            f"snapshot {path} was written for another corpus ({'; '.join(moved)}) whose vocabulary "
            f"differs ({len(saved_vocab)} characters in the snapshot, {len(vocab)} now; differs: "
            f"{_differing(saved_vocab, vocab)}), and a model keeps its vocabulary: start a new run "
            f"with {new_run}, or fine-tune from it "
            "(trainer_config.init_from)"
        )
    source = (state.get("trainer_config") or {}).get("init_from")
    try:
        check_compatible(state, dataclasses.asdict(config.gpt_config), vocab, path)
    except SnapshotError as e:
        if source and not config.trainer_config.init_from:
            # a fine-tuned run's shape comes from its source, given again (it is not read again)
            raise SnapshotError(
                f"{e}: that run was fine-tuned from {source}, whose shape it keeps; add "
                f"{shell_override('trainer_config.init_from', source)} as it had"
            ) from None
        # The keys the user changed, not the shape or vocabulary that follows from them
        # (data_config.truncate changes the vocabulary; data_config.block_size the model's).
        changes = config_changes(state, config)
        changed = described({key: c for key, c in changes.items() if key not in FROM_DATA})
        if not changed:
            raise
        raise SnapshotError(
            f"snapshot {path} was written with another config ({'; '.join(changed)}), which gives "
            f"the model another shape or vocabulary: start a new run with "
            f"{new_run}, or fine-tune from it "
            "(trainer_config.init_from)"
        ) from None
    if moved and not config.trainer_config.allow_config_change:
        raise SnapshotError(
            f"snapshot {path} was written for another corpus ({'; '.join(moved)}): its held-out "
            f"split is no longer this corpus's; start a new run with "
            f"{new_run}, or continue that run on the new corpus (add "
            "trainer_config.allow_config_change=true)"
        )
    changes = check_same_config(state, config, path, run_dir)
    # these keys move the held-out split within the same corpus
    split = ("data_config.train_split", "data_config.truncate")
    moved += described({key: change for key, change in changes.items() if key in split})
    if moved:
        # The best loss is not measured again: the best weights and early stopping go on comparing
        # with a loss of the old split's text.
        best = ""
        if math.isfinite(state.get("best_eval_loss", math.inf)):
            best = (
                f"; the best weights and early stopping compare with the best loss so far, "
                f"{state['best_eval_loss']:.4f} at step {state['best_step']}, of the old split"
            )
        log.warning(
            "continuing %s on a changed corpus or split (%s): the held-out split moved, so "
            "evaluation losses before and after differ in text, and text held out before may now "
            "be trained on%s",
            path,
            "; ".join(moved),
            best,
            extra=SAME_ON_EVERY_RANK,
        )
    if changes:
        log.warning(
            "continuing %s with a changed config: %s",
            path,
            "; ".join(described(changes)),
            extra=SAME_ON_EVERY_RANK,
        )


def check_same_start(dist_info: DistInfo, step: int, path: str) -> None:
    """All ranks start from the same step: a snapshot that only some of them see (a node-local path)
    would split the run."""
    steps = all_gather(dist_info, step)
    if len(set(steps)) > 1:
        raise SnapshotError(
            f"the ranks start from different steps {steps} (snapshot {path}): keep the snapshot "
            "where every node sees it (a shared file system, s3://, gs://)"
        )


def check_seen_by_all(dist_info: DistInfo, root: str) -> None:
    """Every rank sees the snapshot root that rank 0 sees: each rank writes its own files of every
    snapshot there, and rank 0 publishes them. A node-local path (runs/ under each node's own
    directory) left each node part of each snapshot: the run ended as done, and every snapshot it
    published was damaged, a file missing. Rank 0 makes a file beside the root, the others look for
    it."""
    if not dist_info.is_distributed:
        return
    fs, p = storage.filesystem(root)
    # The name rank 0 chose, beside each rank's own root: a relative root is another directory on
    # each node (rank 0's absolute name would be found on a file system all nodes mount alike).
    tag = all_gather(dist_info, uuid.uuid4().hex[:8])[0]
    probe = f"{p.rstrip('/')}{storage.TMP_MARK}seen-{tag}"
    made = None
    if dist_info.is_main_process:
        try:
            fs.pipe_file(probe, b"\0")
            made = True
        except storage.storage_errors() as e:
            made = storage.reason(e)
    made = all_gather(dist_info, made)[0]
    seen = True
    if made is True and not dist_info.is_main_process:
        try:
            seen = fs.exists(probe)
        except storage.storage_errors():
            seen = False
    seen = all_gather(dist_info, seen)
    if dist_info.is_main_process:
        with contextlib.suppress(*storage.storage_errors()):
            fs.rm(probe)
    if made is not True:
        raise SnapshotError(f"cannot write to the snapshot path {root}: {made}")
    blind = [rank for rank, found in enumerate(seen) if not found]
    if blind:
        raise SnapshotError(
            f"ranks {blind} cannot see the snapshot path {root} that rank 0 writes to (a path "
            "local to each node): keep the snapshots where every node sees them (a shared file "
            "system, s3://, gs://; trainer_config.snapshot_path)"
        )


def check_not_a_file(snapshot_path: str | None, run_dir: str, root: str) -> None:
    """A run's snapshots are directories under its snapshot root. A single snapshot file where they
    should be (the root given as `snapshot_path`, or the run directory's snapshot.pt of an older
    mingpt) is refused: neither resumed nor left beside a run that would start afresh."""
    if snapshot_path:
        path = root
    else:
        path = os.path.join(run_dir, OLD_DEFAULT_PATH)
    if "://" in path or not os.path.isfile(path) or manifest.latest(root):
        return
    if not single_file.is_snapshot_file(path):
        return
    raise SnapshotError(
        f"{path} is a single snapshot file (an export, or a run of an older mingpt): a run resumes "
        "only from its snapshot directory. Fine-tune from its weights in a new run: "
        f"{shell_override('trainer_config.init_from', path)} trainer_config.run_name=NAME"
    )


def check_not_a_snapshot(root: str) -> None:
    """A snapshot root that is one snapshot (a step-... directory, published: it holds
    manifest.json) is refused: the run started afresh there, its step directories inside that
    snapshot, where a user meant to continue from it. Once the location is found reachable."""
    if not storage.exists(f"{root.rstrip('/')}/{manifest.MANIFEST}"):
        return
    parent = posixpath.dirname(root.rstrip("/"))
    raise SnapshotError(
        f"trainer_config.snapshot_path: {root} is one snapshot, not a snapshot root: to continue "
        f"its run, give that run's root ({parent} holds this one), or start from its weights with "
        f"{shell_override('trainer_config.init_from', root)}"
    )


def check_not_a_run_directory(root: str, run_dir: str) -> None:
    """A snapshot root that is another run's directory (it holds .hydra/config.yaml) is refused: the
    run started afresh there, its step directories among that run's files, where a user meant to
    continue that run or start from its weights."""
    if "://" in root or os.path.abspath(root) == os.path.abspath(run_dir):
        return
    if not os.path.isfile(os.path.join(root, ".hydra", "config.yaml")):
        return
    raise SnapshotError(
        f"trainer_config.snapshot_path: {root} is another run's directory, not a snapshot root: "
        f"give the root its snapshots are in ({os.path.join(root, 'snapshots')} by default), or "
        f"start from its weights with {shell_override('trainer_config.init_from', root)}"
    )
