"""The run's snapshot: what it holds (docs/fault-tolerance.md), save, restore; where it lives; reading any snapshot."""

import dataclasses
import logging
import math
import os
import posixpath
import time
from typing import Any

import torch

from mingpt import storage
from mingpt.comm_hooks import CommHook
from mingpt.config import Config, TrainerConfig
from mingpt.distributed import DistInfo, all_max
from mingpt.metrics import SlowNotice
from mingpt.optim import set_hyperparameters
from mingpt.snapshot import SnapshotError, fit, sharded, single_file

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Progress:
    """Where the run is: restored from a snapshot, advanced by each step."""

    epoch: int = 0  # the epoch in progress (= epochs finished)
    samples_in_epoch: int = 0  # global samples of that epoch consumed by all ranks together
    step: int = 0  # optimizer steps done
    best_eval_loss: float = math.inf
    best_step: int = 0  # the step of the evaluation that gave best_eval_loss
    evals_without_improvement: int = 0  # in a row, by early_stop_min_delta: early stopping's count
    stopped_early: bool = False  # early stopping ended the run here


class NotFinite(ValueError):
    """The weights to save are not finite; nothing was written."""


DEFAULT_PATH = "snapshots"
OLD_DEFAULT_PATH = "snapshot.pt"  # the single file that ddp runs wrote before: refused, not resumed


def resolve_path(cfg: TrainerConfig, run_dir: str) -> str:
    """The snapshot root: relative local paths live in the run directory; URLs and absolute paths are kept."""
    path = cfg.snapshot_path or DEFAULT_PATH
    return path if "://" in path or os.path.isabs(path) else os.path.join(run_dir, path)


def best_path(path: str) -> str:
    """The root of the best weights of a run whose snapshot root is `path`: snapshots -> snapshots-best."""
    head, ext = posixpath.splitext(path.rstrip("/"))
    return f"{head}-best{ext}"


def find_best(path: str) -> str | None:
    """The best weights of the run whose snapshot root is `path`, if it has written them."""
    return best_path(path) if sharded.latest(best_path(path)) else None


def check_not_old(cfg: TrainerConfig, run_dir: str, path: str) -> None:
    """Refuse a run directory whose snapshot is ddp's former single file: not resumed, nor silently started afresh."""
    old = path if cfg.snapshot_path else os.path.join(run_dir, OLD_DEFAULT_PATH)
    if "://" not in old and os.path.isfile(old) and not has_snapshot(path):
        with open(old, "rb") as f:
            if f.read(4) == b"PK\x03\x04":  # as torch.save's zip archive starts
                raise SnapshotError(
                    f"{old} is a single-file snapshot, the ddp training format of mingpt before its "
                    "snapshots became Distributed Checkpoints: it is not resumed. Fine-tune from its "
                    f"weights in a new run (trainer_config.init_from={old} "
                    "trainer_config.run_name=NAME), or finish it with the earlier mingpt"
                )


def read(path: str) -> dict[str, Any]:
    """A snapshot of either format read whole in this process as the single-file format's dict, checked as that is."""
    if not storage.exists(path, directory=True):
        return single_file.load(path)
    tensors, meta = sharded.load_full(path)
    optim = tensors.get("optim") or {"state": {}, "param_groups": []}
    index = {
        fqn: i
        for i, fqn in enumerate(fqn for group in optim["param_groups"] for fqn in group["params"])
    }
    groups = [
        {**group, "params": [index[fqn] for fqn in group["params"]]}
        for group in optim["param_groups"]
    ]
    state = {
        **meta,
        "model_state": dict(tensors.get("model", {})),
        "optimizer_state": {
            "state": {index[fqn]: value for fqn, value in optim["state"].items() if fqn in index},
            "param_groups": groups,
        },
    }
    single_file.check_structure(state, path)
    return state


def has_snapshot(path: str) -> bool:
    return sharded.latest(path) is not None


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether all elements are finite: one host sync per device, no copy, unless a sum is not (nan, inf, overflow)."""
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            sums.setdefault(t.device, []).append(t.sum(dtype=torch.float32))
    return all(bool(torch.stack(found).isfinite().all()) for found in sums.values()) or all(
        bool(torch.isfinite(t).all()) for t in tensors
    )


class Snapshot:
    def __init__(
        self,
        config: Config,
        dist_info: DistInfo,
        path: str,
        vocab: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        comm: CommHook,
        corpus: list[dict] | None = None,
    ):
        self.config, self.dist, self.path, self.vocab = config, dist_info, path, vocab
        # the corpus's fingerprint (data.CharData.fingerprint): saved, and checked on restore
        self.corpus = corpus
        self.optimizer, self.scaler, self.notice = optimizer, scaler, SlowNotice()
        # the experiment tracker's run: saved, so a resume continues it
        self.tracker_run_id: str | None = None
        # the comm hook's, from restore: {name, world_size, state: own}
        self.comm_state: dict[str, Any] | None = None
        cfg = config.trainer_config
        self.format = sharded.ShardedFormat(
            path, model, optimizer, scaler, comm, cfg.keep_snapshots, cfg.async_save
        )

    def save(self, progress: Progress) -> None:
        """Every rank calls it; raises NotFinite, on every rank alike, if the weights are not finite."""
        start = time.monotonic()
        if self.notice.slow and self.dist.is_main_process:
            log.info("saving snapshot %s at step %d", self.path, progress.step)
        self.format.save(self._meta(progress), progress.step, self._check_finite)
        self.notice.took(seconds := time.monotonic() - start)
        if self.dist.is_main_process:
            log.info(
                "saved snapshot %s at step %d in %.2f s%s",
                self.path,
                progress.step,
                seconds,
                " (writing on in the background)" if self.format.background else "",
            )

    def _meta(self, progress: Progress) -> dict[str, Any]:
        return {
            **dataclasses.asdict(progress),
            **dataclasses.asdict(self.config),
            "world_size": self.dist.world_size,
            "vocab": self.vocab,
            **({"corpus": self.corpus} if self.corpus is not None else {}),
            **({"tracker_run_id": self.tracker_run_id} if self.tracker_run_id is not None else {}),
        }

    def save_best(self, progress: Progress) -> None:
        """The weights (LocalSGD: the replicas' mean) and meta, no optimizer state, at best_path; synchronous."""
        self.format.save_best(
            self._meta(progress), best_path(self.path), progress.step, self._check_finite
        )
        if self.dist.is_main_process:
            log.info(
                "saved the best weights so far (held-out loss %.4f at step %d) to %s",
                progress.best_eval_loss,
                progress.step,
                best_path(self.path),
            )

    def _check_finite(self, tensors) -> None:  # all ranks agree: with FSDP each holds other shards
        bad = int(not all_finite([t.to_local() if hasattr(t, "to_local") else t for t in tensors]))
        if all_max(self.dist, [bad])[0]:
            raise NotFinite("the weights are not finite")

    # for the save in flight (async_save); raises its StorageError on every rank
    def wait(self) -> None:
        self.format.wait()

    def restore(self) -> Progress | None:
        """Load the newest snapshot that fits this run; its progress, or None. Every rank calls it (with ddp before DDP
        wraps the model, with fsdp after sharding), all from the same step: one seeing none would not join the load."""
        newest = sharded.latest(self.path)
        fit.check_same_start(self.dist, sharded.step_of(newest) if newest else 0, self.path)
        if newest is None:
            return None
        state, self.comm_state = self.format.load(
            lambda meta: fit.check_fits(
                meta, self.config, self.vocab, self.path, self.dist, self.corpus
            )
        )
        if self.scaler.is_enabled() and state.get("scaler_state"):
            self.scaler.load_state_dict(state["scaler_state"])
        # the current config's, not the snapshot's
        set_hyperparameters(self.optimizer, self.config.optimizer_config)
        self.tracker_run_id = (
            run_id if isinstance(run_id := state.get("tracker_run_id"), str) and run_id else None
        )
        progress = Progress(
            **{f.name: state[f.name] for f in dataclasses.fields(Progress) if f.name in state}
        )
        log.info(
            "resumed from %s: epoch %d, %d samples into it, step %d",
            self.path,
            progress.epoch,
            progress.samples_in_epoch,
            progress.step,
        )
        return progress
