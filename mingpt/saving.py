"""When and what the run saves: the latest snapshot on schedule, on a stop signal and at the end; the best weights."""

import dataclasses
import logging
import time
from collections.abc import Callable

from mingpt import stopping
from mingpt.config import TrainerConfig
from mingpt.distributed import DistInfo, all_max, barrier
from mingpt.snapshot.manager import NotFinite, Progress, Snapshot
from mingpt.stopping import StepFlags
from mingpt.storage import StorageError

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (for example, the loss diverged)."""


class Saver:
    """Every rank calls every method at the same step; what depends on a rank (a stop signal, rank 0's clock) is
    agreed on first (`agree`). `check_diverged(step)` stops the run before non-finite weights are written."""

    def __init__(
        self,
        cfg: TrainerConfig,
        dist_info: DistInfo,
        snapshot: Snapshot,
        check_diverged: Callable[[int], None],
    ):
        self.cfg, self.dist, self.snapshot, self.check_diverged = (
            cfg,
            dist_info,
            snapshot,
            check_diverged,
        )
        # saved: the last write's position, or None
        self.saved, self.last_save = snapshot.restore(), time.monotonic()

    def agree(self) -> list[int]:
        """This step's StepFlags, the same on every rank; rank 0's clock decides for all whether a save is due."""
        minutes = self.cfg.save_every_minutes
        due = (
            minutes is not None
            and self.dist.is_main_process
            and time.monotonic() - self.last_save >= 60 * minutes
        )
        # StepFlags.STOP, StepFlags.SAVE_DUE
        return all_max(self.dist, [stopping.stop_requested(), int(due)])

    def after_step(self, progress: Progress) -> None:
        flags = self.agree()
        self.stop_if_requested(progress, flags)
        every = self.cfg.save_every_steps
        if (every and progress.step % every == 0) or flags[StepFlags.SAVE_DUE]:
            self.save(progress)

    def after_epoch(self, progress: Progress) -> None:
        if progress.epoch % self.cfg.save_every == 0:
            self.save(progress)

    def at_end(self, progress: Progress) -> None:
        """The last save, written before the run ends; a stop signal that came meanwhile still stops."""
        self.save(progress)
        self.snapshot.wait()
        self.stop_if_requested(progress, self.agree())

    def stop_if_requested(self, progress: Progress, flags: list[int]) -> None:
        """Some rank received a stop signal: every rank saves (rank 0 writes) and stops."""
        if not (signum := flags[StepFlags.STOP]):
            return
        self.save(progress)
        self.snapshot.wait()
        barrier(self.dist)  # the save is complete before any rank leaves
        raise stopping.Stopped(
            signum,
            f"{stopping.describe(signum)} at step {progress.step}; the snapshot "
            f"{self.snapshot.path} resumes the run ({stopping.signal_name(signum)}, exit status "
            f"{stopping.exit_status(signum)})",
        )

    def save(self, progress: Progress) -> None:
        """Save at `progress`, never non-finite weights; a second call at the same position does nothing."""
        if self.saved == progress:
            return
        self.check_diverged(progress.step)
        try:
            self.snapshot.save(progress)
        except NotFinite:
            raise TrainingError(
                f"weights are not finite at step {progress.step}, not saving; {self.kept()}"
            ) from None
        self.saved, self.last_save = dataclasses.replace(progress), time.monotonic()

    def save_best(self, progress: Progress) -> None:
        try:
            self.snapshot.save_best(progress)
        except NotFinite:
            raise TrainingError(
                f"weights are not finite at step {progress.step}, not saving; {self.kept()}"
            ) from None

    def finish_in_flight(self) -> None:
        """On the way out with an error: a save still being written completes; its own error is only logged."""
        try:
            self.snapshot.wait()
        except StorageError as e:
            log.warning("%s", e)

    def kept(self) -> str:
        """What is left to resume from, truthfully."""
        if self.saved is None:
            return f"no snapshot was written yet ({self.snapshot.path})"
        return f"the last good snapshot is kept at {self.snapshot.path}, step {self.saved.step}"
