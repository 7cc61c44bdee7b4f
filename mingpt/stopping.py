"""Stop signals (`trainer_config.stop_signals`): inside the training loop
(`graceful()`) a signal asks every rank to save and stop at the next step
boundary; outside it, or a second Ctrl-C, the process ends at once with one
line. Either way the exit status is 128 + the signal's number, never 0, so that
torchrun restarts the workers and SLURM does not record the job as complete."""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterator, Sequence

log = logging.getLogger(__name__)

# SIGHUP: the terminal or ssh session of an interactive run went away (torchrun forwards it too).
DEFAULT_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1")
# Before the configured list is known (imports, composing the config): each means "stop now".
STARTUP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


class Stopped(BaseException):
    """The run stopped on a signal after saving; ends the process with `status`.
    A BaseException, so that no `except Exception` on the way out can swallow it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.status = exit_status(signum)


class StepFlags(enum.IntEnum):
    """The slots of the small integer tensor that all ranks all-reduce (MAX) once
    per optimizer step, so that every rank takes the same decision at the same
    step. A new per-step decision is a new slot here."""

    STOP = 0  # the number of a stop signal that some rank received (0: none)
    SAVE_DUE = 1  # rank 0's clock: a time-based snapshot is due (1) or not (0)


def exit_status(signum: int) -> int:
    return 128 + signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe(signum: int) -> str:
    """`interrupted` for Ctrl-C, `stopped by SIGTERM` for the others."""
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"


def parse_signal(name: str) -> int:
    """`SIGTERM` (or `TERM`) to its number; ValueError if it cannot stop a run."""
    full = name if name.startswith("SIG") else f"SIG{name}"
    signum = getattr(signal.Signals, full, None)
    if signum is None or signum in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{name!r} is not a signal that can be handled")
    return int(signum)


class _Watcher:
    """Which signals are handled, whether a stop can wait for a step boundary, and
    the stop requested so far. Python's C-level handler writes each signal's number
    to a pipe (signal.set_wakeup_fd) that a thread reads, so a signal is seen even
    while the main thread waits in C code (a collective, a long save)."""

    def __init__(self) -> None:
        self.signals: set[int] = set()
        self.previous: dict[int, object] = {}
        self.graceful = False
        self.requested = 0  # signal number of the first stop request (0: none)
        self._read_fd = -1

    def install(self, names: Sequence[str]) -> None:
        wanted = {parse_signal(n) for n in names}
        if self._read_fd < 0:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._read_fd = read_fd
            threading.Thread(target=self._watch, name="mingpt-signals", daemon=True).start()
        for signum in self.signals - wanted:  # no longer ours: as before
            signal.signal(signum, self.previous.pop(signum))
        for signum in wanted - self.signals:
            self.previous[signum] = signal.signal(signum, _ignore_in_main_thread)
        self.signals = wanted

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except InterruptedError:
                continue
            for signum in data:
                if signum in self.signals:
                    self._received(signum)

    def _received(self, signum: int) -> None:
        second_ctrl_c = signum == signal.SIGINT and self.requested
        if not self.graceful or second_ctrl_c:
            exit_now(signum, "again" if second_ctrl_c else "")
        if not self.requested:
            self.requested = signum
            hint = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            log.warning("%s received: stopping at the end of this step, after saving a snapshot%s",
                        signal_name(signum), hint)


def _ignore_in_main_thread(signum: int, frame: object) -> None:
    """The Python-level handler does nothing: the watcher thread acts."""


_watcher = _Watcher()


def install(signals: Sequence[str] = STARTUP_SIGNALS) -> None:
    """Handle `signals` from now on (main thread only; again to change the list).
    Signals dropped from the list get back the handler they had before."""
    _watcher.install(signals)


def stop_requested() -> int:
    """The number of the stop signal this process received (0: none)."""
    return _watcher.requested


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """Inside, a signal asks for a stop at the next step boundary instead of ending the process."""
    _watcher.graceful = True
    try:
        yield
    finally:
        _watcher.graceful = False


_exiting = threading.Event()  # exit_now is ending the process


def exit_now(signum: int, again: str = "") -> None:
    """One line on stderr, then exit with 128 + signum, skipping every cleanup
    that could hang (threads, process groups, buffered writers)."""
    _exiting.set()
    line = f"error: {describe(signum)}{' ' + again if again else ''}, exiting at once"
    tell_launcher(line)
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    os._exit(exit_status(signum))


def park_if_exiting() -> None:
    """For the main thread on its way out with an error: when exit_now is ending
    the process (a signal came as the error rose; under torchrun, the SIGTERM that
    stops the workers beside a dead one, whose collectives fail), wait for it
    forever, so that its line is the only one (no Hydra report, no traceback)."""
    if _exiting.is_set():
        threading.Event().wait()


def tell_launcher(line: str) -> None:
    """Under torchrun, write the worker's one error line to its error file
    (TORCHELASTIC_ERROR_FILE, in the JSON of torch.distributed.elastic's
    ErrorHandler), so that torchrun's failure summary shows this line as the
    worker's "traceback" instead of a pointer to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump(record, f)

