"""A run's snapshot: what it holds, which format, how it is saved and restored.

One object over the run's stateful parts (model, optimizer, gradient scaler,
comm hook, progress). The format follows `trainer_config.parallelism`:

- `ddp`: one file (mingpt/checkpoint.py): rank 0 writes it, streamed to a
  temporary file and renamed; the model's weights, AdamW's state, the
  scaler's, the comm hook's per-rank state (gathered to rank 0).
- `fsdp`: a sharded snapshot (mingpt/sharded.py, PyTorch Distributed
  Checkpoint): every rank writes its own shards, asynchronously by default,
  and a snapshot counts once it is published; it loads into any world size.

Both hold the progress (epoch, samples of it consumed, step, best held-out
loss), the configs, the vocabulary and the world size that wrote them, and
both are verified (checksums, structure, shapes, config) before anything of
them is used.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mingpt import checkpoint
from mingpt.comm_hooks import CommHook
from mingpt.config import Config, TrainerConfig
from mingpt.distributed import DistInfo, all_max

log = logging.getLogger(__name__)

# Saves that take this long are announced before they start (the next time).
SLOW_SECONDS = 1.0
CONFIG_SECTIONS = ("gpt_config", "optimizer_config", "data_config", "trainer_config")


@dataclass
class Progress:
    """Where the run is: restored from a snapshot, advanced by each step."""

    epoch: int = 0  # the epoch in progress (= epochs finished)
    samples_in_epoch: int = 0  # global samples of that epoch consumed by all ranks together
    step: int = 0  # optimizer steps done
    best_eval_loss: float = math.inf


def _sharded():
    """mingpt.sharded, imported on first use: Distributed Checkpoint adds about a
    second to the start of every process, which `ddp` runs do not need."""
    from mingpt import sharded

    return sharded


class NotFinite(ValueError):
    """The weights to save are not finite; nothing was written."""


def default_path(cfg: TrainerConfig) -> str:
    return cfg.snapshot_path or ("snapshots" if cfg.parallelism == "fsdp" else "snapshot.pt")


def resolve_path(cfg: TrainerConfig, run_dir: str) -> str:
    """The snapshot's location: relative local paths live in the run directory;
    URLs and absolute paths are kept."""
    path = default_path(cfg)
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.join(run_dir, path)


class Snapshot:
    def __init__(self, config: Config, dist_info: DistInfo, path: str, vocab: str, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, comm: CommHook):
        self.config = config
        self.dist = dist_info
        self.path = path
        self.vocab = vocab
        self.model = model  # the unwrapped model (with FSDP: the sharded module)
        self.optimizer = optimizer
        self.scaler = scaler
        self.comm = comm
        self.sharded = config.trainer_config.parallelism == "fsdp"
        self.comm_state: dict[str, Any] | None = None  # the comm hook's saved state, set by restore
        self._slow = True  # announce the first save

    def exists(self) -> bool:
        if self.sharded:
            return _sharded().latest(self.path) is not None
        return checkpoint.exists(self.path)

    # ------------------------------------------------------------------ saving

    def save(self, progress: Progress) -> None:
        """Save the run at `progress`. Every rank calls it (with FSDP every rank
        writes its shards; with a comm hook its state is gathered). Raises
        NotFinite, on every rank alike, if the weights are not finite."""
        start = time.monotonic()
        if self._slow and self.dist.is_main_process:
            log.info("saving snapshot %s at step %d", self.path, progress.step)
        meta: dict[str, Any] = {
            "finished_epoch": progress.epoch,
            **dataclasses.asdict(progress),
            "world_size": self.dist.world_size,
            "vocab": self.vocab,
            **{name: dataclasses.asdict(getattr(self.config, name)) for name in CONFIG_SECTIONS},
        }
        if self.sharded:
            self._save_sharded(meta, progress.step)
        else:
            self._save_file(meta)
        seconds = time.monotonic() - start
        self._slow = seconds >= SLOW_SECONDS
        if self.dist.is_main_process:
            log.info("saved snapshot %s at step %d in %.2f s%s", self.path, progress.step, seconds,
                     " (writing on in the background)" if self.sharded and self.config.trainer_config.async_save
                     else "")

    def _save_file(self, meta: dict[str, Any]) -> None:
        model_state = self.comm.model_state(self.model)
        self._check_finite(model_state.values())
        comm_state = self.comm.state_dict(self.model, self.optimizer, self.scaler)
        if not self.dist.is_main_process:
            return
        state = {"model_state": model_state, "comm_hook": comm_state, "optimizer_state": self.optimizer.state_dict(),
                 "scaler_state": self.scaler.state_dict(), **meta}
        checkpoint.save(state, self.path)

    def _save_sharded(self, meta: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        self._check_finite(model_state.values())
        cfg = self.config.trainer_config
        meta["scaler_state"] = self.scaler.state_dict()
        _sharded().save({"model": model_state, "optim": optim_state}, meta, self.path, step,
                     keep=cfg.keep_snapshots, async_save=cfg.async_save)

    def _check_finite(self, tensors) -> None:
        """All ranks agree: with FSDP each holds other shards."""
        bad = 0
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            if not torch.isfinite(local).all():
                bad = 1
                break
        if all_max(self.dist, [bad])[0]:
            raise NotFinite("the weights are not finite")

    def wait(self) -> None:
        """Wait for a save still being written (sharded, asynchronous); raise its StorageError."""
        if self.sharded:
            _sharded().wait_pending()

    # --------------------------------------------------------------- restoring

    def restore(self) -> Progress:
        """Load the snapshot into the model, optimizer and scaler, after checking
        that it fits this run (shapes, vocabulary, config). With `ddp`, before
        DDP wraps the model; with `fsdp`, after the model is sharded. Returns
        the progress it was saved at."""
        if self.sharded:
            state = self._load_sharded()
        else:
            state = checkpoint.load(self.path)
            self._check_fits(state)
            try:
                self.model.load_state_dict(state["model_state"])
                self.optimizer.load_state_dict(state["optimizer_state"])
            except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as e:
                raise checkpoint.SnapshotError(
                    f"snapshot {self.path} cannot be restored: {checkpoint.reason(e)}") from None
            self.comm_state = state.get("comm_hook")  # per rank: restored once DDP has wrapped the model
        if self.scaler.is_enabled() and state.get("scaler_state"):
            self.scaler.load_state_dict(state["scaler_state"])
        # The current config decides the hyperparameters, not the snapshot.
        opt_cfg = self.config.optimizer_config
        for group, decay in zip(self.optimizer.param_groups, (opt_cfg.weight_decay, 0.0)):
            group.update(weight_decay=decay, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
        fields = {f.name for f in dataclasses.fields(Progress)}
        progress = Progress(**{k: state[k] for k in fields if k in state})
        log.info("resumed from %s: epoch %d, %d samples into it, step %d",
                 self.path, progress.epoch, progress.samples_in_epoch, progress.step)
        return progress

    def _load_sharded(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)  # the layout to load into
        tensors = {"model": model_state, "optim": optim_state}
        meta = _sharded().load(tensors, self.path)
        self._check_fits(meta)
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optim"])
        return meta

    def _check_fits(self, state: dict[str, Any]) -> None:
        checkpoint.check_compatible(state, dataclasses.asdict(self.config.gpt_config), self.vocab, self.path)
        changes = checkpoint.check_same_config(state, self.config, self.path)
        if changes and self.dist.is_main_process:
            log.warning("continuing %s with a changed config: %s", self.path, "; ".join(changes))

    def check_same_start(self, step: int) -> None:
        """All ranks must start from the same step: a snapshot that only some of
        them see (a node-local path in a multi-node job) would split the run."""
        if not self.dist.is_distributed:
            return
        mine = torch.tensor([step], device=self.dist.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.dist.world_size)]
        dist.all_gather(gathered, mine)
        steps = [int(t) for t in gathered]
        if len(set(steps)) > 1:
            raise checkpoint.SnapshotError(
                f"the ranks start from different steps {steps} (snapshot {self.path}): "
                "keep the snapshot where every node sees it (a shared file system, s3://, gs://)"
            )
