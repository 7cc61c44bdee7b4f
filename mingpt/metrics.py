"""Rank 0's metrics to log lines (a terminal's progress bar), TensorBoard, metrics.jsonl, the
tracker; their pace."""

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from mingpt.tracking import OFF, Tracker

log = logging.getLogger(__name__)


class SlowNotice:
    """Whether to announce work (an evaluation, a save) before it starts: the first time, and after
    it took 1 s+."""

    slow = True

    def took(self, seconds: float) -> bool:
        self.slow = seconds >= 1.0
        return self.slow


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class PaceEvent(NamedTuple):
    tokens_per_s: float  # since the last event
    mfu: float | None  # None where no peak is known
    note: str  # for the log line: the time elapsed and the ETA
    # The best tokens/s of the run so far, where this event is the second in a row, of 5 s or more
    # each, at under a third of it (else None): on a CPU, most often other work on its cores,
    # where torch's threads wait for each other. One slow event alone can be a recompile.
    slowed_from: float | None = None


class Pace:
    """For the train events: tokens/s since the last event, evaluations and saves excluded
    (`paused`); MFU against a peak measured at the first event (once again where the pace exceeds
    it); the time elapsed and the ETA; whether the pace fell far below the run's best."""

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: Callable[[], float],
        step: int,
    ):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self._peak_flops = peak_flops
        self.started = time.perf_counter()
        self._window_start = self.started
        self._window_step = step  # the step the window started at
        # The tokens that the window's steps trained short of a whole global batch each (an
        # epoch's last step; every step where the global batch exceeds the epoch).
        self._window_short = 0
        # (time, step) of the first event, whose window holds the start-up and compilation.
        self._pace_from: tuple[float, int] | None = None
        self._measured_again = False
        self._best_pace = 0.0  # tokens/s, of the events after the first
        self._slow_events = 0  # in a row

    def short_step(self, tokens: int) -> None:
        """A step that trained `tokens`, fewer than a whole global batch: tokens/s and MFU count
        those it trained, not a batch's."""
        self._window_short += self.tokens_per_step - tokens

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        # An error out of the body ends the run: no pace to keep then.
        yield
        self._window_start += time.perf_counter() - start

    def event(self, step: int, total_steps: int) -> PaceEvent:
        """Tokens/s and MFU since the last event, and the log line's note. The ETA is at this
        session's pace since its first event: the first window holds the start-up and compilation,
        so it gives none."""
        now = time.perf_counter()
        tokens = (step - self._window_step) * self.tokens_per_step - self._window_short
        tokens_per_s = tokens / (now - self._window_start)
        note = f"elapsed {duration(now - self.started)}"
        slowed_from = None
        if self._pace_from is None:
            self._peak = self._peak_flops()
            self._pace_from = (time.perf_counter(), step)
        else:
            # every later event is at a later step than the first
            since, first = self._pace_from
            left = (now - since) / (step - first) * (total_steps - step)
            note += f" eta {duration(left)}"
            if self._slowed(now - self._window_start, tokens_per_s):
                slowed_from = self._best_pace
        flops_per_s = tokens_per_s * self.flops_per_token
        # Above the peak: it was measured while other work slowed the device (a CPU's shared
        # cores), so it is measured again, once (each costs the run 0.2 s), and the higher kept.
        if self._peak and flops_per_s > self._peak and not self._measured_again:
            self._measured_again = True
            self._peak = max(self._peak, self._peak_flops())
        mfu = None
        if self._peak:
            mfu = flops_per_s / self._peak
        self._window_start = time.perf_counter()
        self._window_step = step
        self._window_short = 0
        return PaceEvent(tokens_per_s, mfu, note, slowed_from)

    def _slowed(self, seconds: float, tokens_per_s: float) -> bool:
        """Whether this event, `seconds` long, is the second in a row of 5 s or more at under a
        third of the best pace so far (PaceEvent.slowed_from)."""
        if seconds >= 5 and 3 * tokens_per_s < self._best_pace:
            self._slow_events += 1
        else:
            self._slow_events = 0
        self._best_pace = max(self._best_pace, tokens_per_s)
        return self._slow_events == 2


class Metrics:
    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        resume_step: int = 0,
        tracker: Tracker = OFF,
        eval_due: bool = False,
        sample_due: bool = False,
    ):
        self.enabled = enabled
        self.tracker = tracker
        self.run_dir = run_dir
        self.progress = enabled and sys.stderr.isatty()
        self._bar = None
        self._writer = None
        self._jsonl = None
        # The progress bar, and the redirection of log lines above it.
        self._terminal = contextlib.ExitStack()
        if not enabled:
            return
        # Imported here: slow, and only rank 0 needs it.
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        # The events a killed run logged after the snapshot it resumes from go. With `eval_due` the
        # snapshot's step is evaluated again: an evaluation of it that a killed run logged goes too.
        found = list(events(path))
        keep = []
        for line, record in found:
            redone = eval_due and record["step"] == resume_step and record["split"] == "eval"
            if record["step"] <= resume_step and not redone:
                keep.append((line, record))
        if resume_step == 0 and found:
            _set_aside(path)
        kept = b"".join(line for line, _ in keep)
        with open(path, "a+b") as f:
            f.seek(0)
            # The kept events are the file's first lines, unless a damaged line or a dropped
            # evaluation came before one: cut in one call, the file is never without them, as it
            # was while written anew (a kill, or a full disk, then lost the run's record).
            if f.read(len(kept)) == kept:
                f.truncate(len(kept))
            else:
                f.truncate(0)
                f.write(kept)
        threading.excepthook = _quiet_tensorboard_thread
        # TensorBoard hides its own from purge_step on: from the step resumed from where its
        # evaluation or sample is done again, whose kept events are then written again.
        purge_step = resume_step + 1
        if eval_due or sample_due:
            purge_step = resume_step
        self._writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=purge_step)
        for _, record in keep:
            if record["step"] == purge_step:
                self._scalars(record)
        # Open for the run's whole length, closed by close().
        self._jsonl = open(path, "ab", buffering=0)  # noqa: SIM115

    def log(self, split: str, step: int, epoch: int, note: str = "", **values: Any) -> None:
        """One event: a line in metrics.jsonl, scalars in TensorBoard and the tracker, a log line
        (and `note`, which is not recorded). A value of None (no MFU for a tiny model) is left out
        of the log line."""
        if not self.enabled:
            return
        text = " ".join(f"{k} {_fmt(v)}" for k, v in values.items() if v is not None)
        if note:
            text += f" | {note}"
        log.info("%s step %d epoch %d | %s", split, step, epoch, text)
        self.tracker.log(split, step, values)
        record = {"step": step, "epoch": epoch, "split": split, **values}

        def write() -> None:
            # A whole line or none: a write cut short (a full disk, a file-size limit) is taken
            # back. The file is unbuffered: a buffer's truncate flushes first, which fails again,
            # and the line's head stayed.
            offset = self._jsonl.seek(0, os.SEEK_END)
            left = memoryview(f"{json.dumps(record)}\n".encode())
            try:
                while left:
                    # part of it, where the storage took no more; the next write says why
                    left = left[self._jsonl.write(left) :]
            except OSError:
                with contextlib.suppress(OSError, ValueError):
                    self._jsonl.truncate(offset)
                raise
            self._scalars(record)

        self._write(write)

    def _scalars(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record's numbers, to TensorBoard."""
        for key, value in record.items():
            if key not in ("step", "epoch", "split") and isinstance(value, (int, float)):
                self._writer.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def text(self, tag: str, text: str, step: int) -> None:
        self.tracker.text(tag, text, step)
        # Markdown would reflow the sample; a code block keeps its lines.
        self._write(lambda: self._writer.add_text(tag, f"```\n{text}\n```", step))

    def _write(self, write: Callable[[], None]) -> None:
        """Not worth the run: a storage error (a full disk, a removed directory) costs one warning;
        training goes on."""
        if self._jsonl is None:
            return
        try:
            write()
        # ValueError: TensorBoard's writer on a file it could not reopen
        except (OSError, ValueError) as e:
            log.warning(
                "cannot write the metrics in %s (%s): training goes on without recording them",
                self.run_dir,
                getattr(e, "strerror", None) or e,
            )
            self._close_record()

    def _close_record(self) -> None:
        for handle in (self._writer, self._jsonl):
            if handle is not None:
                with contextlib.suppress(OSError, ValueError):
                    handle.close()
        self._writer = None
        self._jsonl = None

    def show_progress(self, step: int, total: int) -> None:
        if not self.progress:
            return
        if self._bar is None:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = self._terminal.enter_context(
                tqdm(
                    total=total,
                    initial=step - 1,
                    unit="step",
                    dynamic_ncols=True,
                    leave=False,
                )
            )
            self._terminal.enter_context(logging_redirect_tqdm())
        self._bar.update(step - self._bar.n)

    def close(self, status: str = "FINISHED") -> None:
        """`status`: how the run ended, for the tracker (FINISHED, KILLED by a signal, FAILED)."""
        self._terminal.close()
        self.tracker.close(status)
        self._write(lambda: self._writer.flush())
        self._close_record()


def _set_aside(path: str) -> None:
    """A run that starts afresh keeps the events it finds (its snapshots may have been deleted, and
    they are all that is left of that run's record) under another name."""
    stem, extension = os.path.splitext(path)
    aside = f"{stem}-set-aside-{time.strftime('%Y%m%d-%H%M%S')}{extension}"
    os.replace(path, aside)
    log.warning(
        "moved %s to %s: this run starts afresh (no snapshot to resume), so its events are another "
        "attempt's; remove it there once not needed",
        path,
        aside,
    )


_excepthook = threading.excepthook


def _quiet_tensorboard_thread(args: threading.ExceptHookArgs) -> None:
    """TensorBoard's writer thread ends with a traceback on a storage error; the writer raises it
    again at the next write, where Metrics._write turns it into one warning."""
    writer_thread = type(args.thread).__name__ == "_AsyncWriterThread"
    if not writer_thread or not isinstance(args.exc_value, OSError):
        _excepthook(args)


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + " ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def events(path: str) -> Iterator[tuple[bytes, dict]]:
    """The events of a metrics.jsonl as (line, record); a line that is not one (cut short, not JSON,
    or a hand edit's, without an integer step or a split) is left out."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or "split" not in record:
                continue
            if type(record.get("step")) is not int:
                continue
            if not line.endswith(b"\n"):
                line += b"\n"
            yield line, record


def last_step(run_dir: str) -> int | None:
    """The last step the run directory's metrics.jsonl records (None: no event)."""
    return max(
        (record["step"] for _, record in events(os.path.join(run_dir, "metrics.jsonl"))),
        default=None,
    )
