"""The run's checkpointer (docs/fault-tolerance.md): what a snapshot holds, loading it at the start,
and saving.

After every step the trainer calls `save`, and the checkpointer decides whether a snapshot is due:
at the last step, every `save_every_steps` steps, at the end of every `save_every`-th epoch,
`save_every_minutes` after the last save, and on a stop signal, after which it stops the run. The
best weights are saved when the trainer says the held-out loss improved. Every rank calls every
method at the same step; what depends on a rank (a stop signal, rank 0's clock) is agreed on first,
so every rank decides alike."""

import dataclasses
import logging
import math
import os
import time
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from mingpt import stopping
from mingpt.comm_hooks import CommHook
from mingpt.config import Config
from mingpt.distributed import DistInfo, all_gather, all_max, barrier
from mingpt.metrics import SlowNotice
from mingpt.optim import set_hyperparameters
from mingpt.rundir import shown
from mingpt.snapshot import compat, manifest, sharded
from mingpt.snapshot.reader import best_path
from mingpt.storage import StorageError

log = logging.getLogger(__name__)


class NotFinite(ValueError):
    """The weights to save are not finite; nothing was written. The message says what is kept."""


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element is finite: one host sync and no copy, unless the sum of the float
    tensors' sums is not finite (nan, inf, or an overflow of finite values, which the element-wise
    check then tells apart)."""
    if math.isfinite(sum(t.sum(dtype=torch.float32) for t in tensors if t.is_floating_point())):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class Checkpointer:
    def __init__(
        self,
        config: Config,
        dist_info: DistInfo,
        root: str,
        model: torch.nn.Module,
        optimizer: Any,
        scaler: torch.amp.GradScaler,
        comm: CommHook,
        vocab: str,
        corpus: list[dict],
        run_dir: str,
    ):
        self.config = config
        self.cfg = config.trainer_config
        self.dist = dist_info
        self.root = root  # the snapshots' root; the best weights go beside it
        self.model = model
        self.optimizer = optimizer
        # torch's state-dict helpers take the optimizers of mingpt.optim.Combined (AdamW and Muon)
        # as a list.
        self.optimizers = getattr(optimizer, "optimizers", optimizer)
        self.scaler = scaler
        self.comm = comm
        self.vocab = vocab
        self.corpus = corpus  # data.CharData.fingerprint: saved, and checked on load
        self.run_dir = run_dir  # named in a refusal's new run where hydra.run.dir placed it
        # The experiment tracker's run: saved, so that a resumed run continues it.
        self.tracker_run_id: str | None = None
        # The comm hook's state from load: {name, world_size, state: this rank's own}.
        self.comm_state: dict[str, Any] | None = None
        self.saved_meta: dict[str, Any] = {}  # the record of the last snapshot written or loaded
        # The one before it, while an asynchronous save may still fail: what is left then.
        self.meta_before_pending: dict[str, Any] = {}
        self.last_save = time.monotonic()
        self.notice = SlowNotice()

    def load(self) -> dict[str, Any] | None:
        """Load the newest snapshot into the model, optimizer and scaler, once it is found to fit
        this run, and return its record (the run's position among it); None if there is none yet.
        Every rank calls it, from the same step: with ddp before DDP wraps the model, with fsdp
        after the model is sharded."""
        newest = manifest.latest(self.root)
        start = 0
        if newest is not None:
            start = manifest.step_of(newest)
        compat.check_same_start(self.dist, start, self.root)
        if newest is None:
            self._forget_later_best(None)
            return None
        # The layout to load into: this run's shards and parameter names.
        model_state, optim_state = get_state_dict(self.model, self.optimizers)
        state = {"model": model_state, "optim": optim_state}
        meta, own = sharded.load(
            state,
            newest,  # not the root: listing it again is another round trip on an object store
            check=lambda saved: compat.check_fits(
                saved, self.config, self.vocab, self.root, self.corpus, self.run_dir
            ),
        )
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        if self.scaler.is_enabled() and meta.get("scaler_state"):
            self.scaler.load_state_dict(meta["scaler_state"])
        # The current config's hyperparameters, not the snapshot's.
        set_hyperparameters(self.optimizer, self.config.optimizer_config)
        about = meta.get("comm_hook")
        if isinstance(about, dict):
            self.comm_state = {**about, "state": own}
        self.tracker_run_id = meta.get("tracker_run_id")
        self.saved_meta = meta
        log.info(
            "resumed from %s: epoch %d, %d samples into it, step %d",
            self.root,
            meta["epoch"],
            meta["samples_in_epoch"],
            meta["step"],
        )
        self._forget_later_best(self._evaluated_step())
        return meta

    def _forget_later_best(self, evaluated: int | None) -> None:
        """Best weights saved after the last step evaluated by the snapshot the run starts from
        (None: it starts afresh) are not this run's, and pruning would keep them over its own (the
        highest step stays). Resuming, they are an attempt's that stopped before its next snapshot,
        and the replayed steps evaluate again: removed, as metrics.jsonl is cut back. Starting
        afresh, they may be all that is left of a model whose snapshots were deleted: moved aside,
        not removed. Once nothing else can refuse the run; where storage refuses, the run stops
        here, on every rank, before it trains: its best weights would be mixed with them, and the
        last step's pruning would keep the others' alone."""
        problem = None
        if self.dist.is_main_process:
            try:
                self._forget_later_best_here(evaluated)
            except StorageError as e:
                problem = str(e)
        # Rank 0's outcome on every rank: all stop together, with the same line.
        problem = all_gather(self.dist, problem)[0]
        if problem is not None:
            raise StorageError(problem)

    def _forget_later_best_here(self, evaluated: int | None) -> None:
        """_forget_later_best's work, on rank 0."""
        best = best_path(self.root)
        if evaluated is None:
            if manifest.latest(best) is None:
                return
            try:
                aside = manifest.set_aside(best)
            except StorageError as e:
                raise StorageError(
                    f"{e}; this run starts afresh (no snapshot to resume), so the best weights "
                    "there are another attempt's, and this run's would be mixed with them; move "
                    "or remove them, or run this one with another name (trainer_config.run_name="
                    "NAME)"
                ) from None
            log.warning(
                "moved the best weights in %s to %s: this run starts afresh (no snapshot to "
                "resume), so they are another attempt's; remove them there once not needed",
                best,
                aside,
            )
            return
        try:
            removed = manifest.remove_after(best, evaluated)
        except StorageError as e:
            raise StorageError(
                f"{e}; this run resumes from step {self.saved_meta['step']}, and the best weights "
                f"saved there after step {evaluated} are an attempt's that stopped before its next "
                "snapshot, which would be taken for this run's; remove them"
            ) from None
        if removed:
            log.info(
                "removed %s from %s: best weights of an attempt that stopped before its next "
                "snapshot; this run resumes from step %d",
                ", ".join(removed),
                best,
                self.saved_meta["step"],
            )

    def _evaluated_step(self) -> int | None:
        """The last step whose evaluation the last snapshot written or loaded accounts for: its own,
        unless a stop cut that short (eval_due: the resumed run does it); None before the first."""
        if "step" not in self.saved_meta:
            return None
        return self.saved_meta["step"] - int(self.saved_meta.get("eval_due", False))

    def save(self, state: Any, last_step: bool, epoch_ended: bool) -> None:
        """After every step, on every rank: save `state` (the trainer's TrainState) if a snapshot is
        due; at the last step and on a stop signal, wait until it is written. On a stop signal, stop
        the run (Stopped)."""
        stop, on_time = self._agree()
        self._say_stop_from_elsewhere(stop, state.step)
        every_steps = self.cfg.save_every_steps
        on_step = every_steps is not None and state.step % every_steps == 0
        on_epoch = epoch_ended and state.epoch % self.cfg.save_every == 0
        if last_step or stop or on_time or on_step or on_epoch:
            self._save(state)
        # Wait for the save in flight (async_save); its StorageError is raised on every rank.
        if last_step or stop:
            sharded.wait_pending()
        if last_step and self.dist.is_main_process:
            self._drop_fallback_best()
        # A stop signal that came while the last snapshot was written still stops the run.
        if last_step and not stop:
            stop = self._agree()[0]
            self._say_stop_from_elsewhere(stop, state.step)
        if not stop:
            return
        # The snapshot is complete on every rank before any rank leaves.
        barrier(self.dist)
        saved = f"the run is saved in {shown(self.root)} and the same command resumes it"
        if last_step:
            saved = f"the run is complete and saved in {shown(self.root)}"
        raise stopping.Stopped(
            stop,
            f"{stopping.describe(stop)} at step {state.step}; {saved} "
            f"({stopping.signal_name(stop)}, exit status {stopping.exit_status(stop)})",
        )

    def _say_stop_from_elsewhere(self, stop: int, step: int) -> None:
        """Rank 0 logs a stop signal that only other ranks received (one sent to a worker, or to
        another node's torchrun): their own line goes to their stderr alone, and train.log would
        show a save and an end without their reason."""
        if stop and not stopping.stop_requested() and self.dist.is_main_process:
            log.warning(
                "%s received by another rank: stopping at step %d, after saving a snapshot",
                stopping.signal_name(stop),
                step,
            )

    def _drop_fallback_best(self) -> None:
        """Once the last step's snapshot is published, a resume no longer falls back to older best
        weights (save_best): the newest alone stays."""
        best = best_path(self.root)
        try:
            newest = manifest.latest(best)
        except StorageError as e:
            log.warning("%s", e)
            return
        if newest is not None:
            manifest.prune(best, os.path.basename(newest), keep=1)

    def _agree(self) -> list[int]:
        """[a stop signal some rank received (0: none), whether save_every_minutes passed by rank
        0's clock]: one all-reduce of two integers, the same on every rank."""
        minutes = self.cfg.save_every_minutes
        on_time = 0
        if minutes is not None and self.dist.is_main_process:
            on_time = int(time.monotonic() - self.last_save >= 60 * minutes)
        return all_max(self.dist, [stopping.stop_requested(), on_time])

    def _save(self, state: Any) -> None:
        """A snapshot at `state`'s step (once per step, unless the position changed: an evaluation
        that a stop cut short, done on resume), never of non-finite weights."""
        position = dataclasses.asdict(state)
        if all(self.saved_meta.get(name) == value for name, value in position.items()):
            return
        start = time.monotonic()
        if self.notice.slow:
            log.info("saving snapshot %s at step %d", self.root, state.step)
        model_state, optim_state = get_state_dict(self.model, self.optimizers)
        model_state = self._weights(model_state, state.step)
        meta = self._meta(state)
        meta["scaler_state"] = self.scaler.state_dict()
        # Without a scaler (an fp16 run from CUDA continued on a CPU) the snapshot's is carried on:
        # back on CUDA, the scale found is resumed, not searched for again over skipped steps.
        if not self.scaler.is_enabled():
            meta["scaler_state"] = self.saved_meta.get("scaler_state", {})
        own = self.comm.own_state()
        meta["comm_hook"] = None
        if own is not None:
            meta["comm_hook"] = {
                "name": self.comm.name,
                "world_size": self.dist.world_size,
                "settings": self.comm.settings,
            }
        self.meta_before_pending = self.saved_meta
        sharded.save(
            {"model": model_state, "optim": optim_state},
            meta,
            self.root,
            state.step,
            keep=self.cfg.keep_snapshots,
            async_save=self.cfg.async_save,
            own=own,
            lowest_rank=self.comm.replicas_differ,
        )
        self.saved_meta = meta
        self.last_save = time.monotonic()
        seconds = self.last_save - start
        self.notice.took(seconds)
        background = ""
        if self.cfg.async_save:
            background = " (writing on in the background)"
        log.info(
            "saved snapshot %s at step %d in %.2f s%s", self.root, state.step, seconds, background
        )

    def save_best(self, state: Any) -> None:
        """The weights (with LocalSGD, the replicas' mean) and the record, without optimizer state,
        as the best weights so far; written before this returns."""
        model_state = self._weights(get_model_state_dict(self.model), state.step)
        best = best_path(self.root)
        # Also kept: the best weights that a resume from the latest snapshot would fall back to,
        # once it has removed the later ones (_forget_later_best). The save waits for the snapshot
        # in flight first: the last saved is published by then.
        sharded.save(
            {"model": model_state},
            self._meta(state),
            best,
            state.step,
            keep=1,
            also_keep_at_or_before=self._evaluated_step(),
            async_save=False,
        )
        log.info(
            "saved the best weights so far (held-out loss %.4f at step %d) to %s",
            state.best_eval_loss,
            state.step,
            best,
        )

    def _meta(self, state: Any) -> dict[str, Any]:
        """A snapshot's record beside its tensors: the run's position, its configs, its vocabulary
        and corpus."""
        meta = {
            **dataclasses.asdict(state),
            **dataclasses.asdict(self.config),
            "world_size": self.dist.world_size,
            "vocab": self.vocab,
            "corpus": self.corpus,
        }
        if self.tracker_run_id is not None:
            meta["tracker_run_id"] = self.tracker_run_id
        return meta

    def _weights(self, model_state: dict[str, Any], step: int) -> dict[str, Any]:
        """The weights that stand for the run (with LocalSGD, the replicas' mean), found finite by
        every rank alike: with FSDP each holds other shards."""
        model_state = self.comm.model_state(model_state)
        local = [t.to_local() if hasattr(t, "to_local") else t for t in model_state.values()]
        if all_max(self.dist, [int(not all_finite(local))])[0]:
            raise NotFinite(f"weights are not finite at step {step}, not saving; {self.kept()}")
        return model_state

    def finish_in_flight(self) -> None:
        """On the way out with an error: a save still being written completes; its own error is only
        logged."""
        try:
            sharded.wait_pending()
        except StorageError as e:
            log.warning("%s", e)

    def kept(self) -> str:
        """What is left to resume from, truthfully: a save still being written completes first, and
        one that failed is not counted (an error's line named it as kept)."""
        meta = self.saved_meta
        try:
            sharded.wait_pending()
        except StorageError as e:
            log.warning("%s", e)
            meta = self.meta_before_pending
        if "step" not in meta:
            return f"no snapshot was written yet ({self.root})"
        return f"the last good snapshot is kept at {self.root}, step {meta['step']}"
