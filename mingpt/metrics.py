"""Where metrics go: log lines (and a tqdm progress bar with rate and ETA when
stderr is a terminal), TensorBoard scalars and text, and metrics.jsonl in the
run directory. Only the global main process writes; the others get a logger
that does nothing."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Optional

log = logging.getLogger(__name__)


class SlowNotice:
    """Whether to announce work (an evaluation, a save) before it starts: the first time, and after it took 1 s or more."""

    slow = True

    def took(self, seconds: float) -> bool:
        self.slow = seconds >= 1.0
        return self.slow


class Metrics:
    def __init__(self, run_dir: str, enabled: bool, resume_step: Optional[int] = None):
        self.enabled = enabled
        self.progress = enabled and sys.stderr.isatty()
        self._bar = None  # the progress bar, created at the first step shown
        self._redirect = None  # log lines go through tqdm.write while the bar is on
        self._writer = None
        self._jsonl = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and only rank 0 needs it

        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is not None:
            _truncate_after(path, resume_step)
        # TensorBoard hides earlier events at steps >= purge_step: those after the snapshot we resume from.
        purge_step = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=purge_step)
        self._jsonl = open(path, "a", encoding="utf-8")

    def log(self, split: str, step: int, epoch: int, note: str = "", **values: Any) -> None:
        """One event: a line in metrics.jsonl, scalars in TensorBoard, a log line
        (followed by `note`, which is not recorded)."""
        if not self.enabled:
            return
        record = {"step": step, "epoch": epoch, "split": split, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in values.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(f"{split}/{key}", value, step)
        text = " ".join(f"{k} {_fmt(v)}" for k, v in values.items())
        log.info("%s step %d epoch %d | %s%s", split, step, epoch, text, f" | {note}" if note else "")

    def text(self, tag: str, text: str, step: int) -> None:
        if self.enabled:
            # Markdown would reflow the sample; a code block keeps its lines.
            self._writer.add_text(tag, "```\n" + text + "\n```", step)

    def show_progress(self, step: int, total: int) -> None:
        """The bar at `step` of `total` (on a terminal only)."""
        if not self.progress:
            return
        if self._bar is None:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, initial=step - 1, unit="step", dynamic_ncols=True, leave=False,
                             file=sys.stderr)
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
        self._bar.total = total
        self._bar.update(step - self._bar.n)

    def end_progress(self) -> None:
        if self._bar is not None:
            self._redirect.__exit__(None, None, None)
            self._bar.close()
            self._bar = self._redirect = None

    def close(self) -> None:
        self.end_progress()
        if self.enabled:
            self._writer.close()
            self._jsonl.close()


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + " ".join(_fmt(v) for v in value) + "]"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _truncate_after(path: str, step: int) -> None:
    """Drop the events a killed run logged after the snapshot it resumes from."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError):
            continue
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(keep)
