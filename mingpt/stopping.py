"""Stop signals (`trainer_config.stop_signals`, docs/fault-tolerance.md): inside `graceful()` a
signal asks every rank to save and stop at the next step boundary; outside it, the process ends at
once with one line."""

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

log = logging.getLogger(__name__)

# SIGHUP: the terminal or ssh session of an interactive run went away (torchrun forwards it too).
DEFAULT_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1")
# Before the configured list is known (imports, composing the config): each means "stop now".
STARTUP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


class Stopped(BaseException):
    """The run stopped on a signal after saving: exit with `status`. A BaseException, so that no
    `except Exception` eats it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.status = exit_status(signum)


def exit_status(signum: int) -> int:
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def describe(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"


def parse_signal(name: str) -> int:
    """`SIGTERM` (or `TERM`) to its number; ValueError if it cannot stop a run."""
    signum = getattr(signal.Signals, "SIG" + name.removeprefix("SIG"), None)
    if signum is None or signum in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{name!r} is not a signal that can be handled")
    # Sent in a run's normal course (a child process ended, a terminal resized): none asks to stop.
    if signum in (signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG, signal.SIGCONT):
        raise ValueError(f"{name!r} comes without a request to stop: the run would stop at random")
    return int(signum)


_state = types.SimpleNamespace(
    signals=set(), previous={}, graceful=False, requested=0, watching=False, exiting=False
)
# The command line's (cli.take_back_run_dir): the lock files of a run not yet accepted, the run
# directory Hydra made for it once it is empty, and a sweep's record while none of its jobs was.
take_back: Callable[[], None] | None = None


def install(signals: Sequence[str] = STARTUP_SIGNALS) -> None:
    """Handle `signals` from now on (main thread only; again to change the list). Their numbers
    reach a thread through signal.set_wakeup_fd, so a signal is seen even while the main thread
    waits in C (a collective)."""
    wanted = {parse_signal(n) for n in signals}
    if not _state.watching:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=_watch, args=(read_fd,), name="mingpt-signals", daemon=True).start()
        _state.watching = True
    for signum in _state.signals - wanted:  # no longer ours: as before
        signal.signal(signum, _state.previous.pop(signum))
    for signum in wanted - _state.signals:
        _state.previous[signum] = signal.signal(signum, lambda *_: None)  # the thread acts
    _state.signals = wanted


def _watch(read_fd: int) -> None:
    """The signals' thread: each byte read is the number of a signal that arrived."""
    while True:
        for signum in os.read(read_fd, 64):
            if signum in _state.signals:
                _act(signum)


def _act(signum: int) -> None:
    """Outside graceful(), or at a second Ctrl-C, end the process; else ask for a stop, once."""
    second_ctrl_c = signum == signal.SIGINT and _state.requested != 0
    if not _state.graceful or second_ctrl_c:
        exit_now(signum, again=second_ctrl_c)
    if _state.requested:
        return
    _state.requested = signum
    hint = ""
    if signum == signal.SIGINT:
        hint = " (Ctrl-C again to stop at once)"
    log.warning(
        "%s received: stopping at the end of this step, after saving a snapshot%s",
        signal_name(signum),
        hint,
    )


def stop_requested() -> int:
    """The number of the stop signal this process received (0: none)."""
    return _state.requested


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """Inside, a signal asks for a stop at the next step boundary instead of ending the process."""
    _state.graceful = True
    try:
        yield
    finally:
        _state.graceful = False


def exit_now(signum: int, again: bool) -> None:
    """One line on stderr, then exit with 128 + signum, skipping every cleanup that could hang."""
    _state.exiting = True
    what = describe(signum)
    if again:
        what += " again"
    line = f"error: {what}, exiting at once"
    tell_launcher(line)
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), (headed(line) + "\n").encode())
    exit_at_once(exit_status(signum))


def exit_at_once(status: int) -> NoReturn:
    """End the process with `status`, skipping every cleanup that could hang; a run not yet
    accepted still leaves no empty run directory behind (`take_back`), as a refused one."""
    try:
        if take_back is not None:
            take_back()
    finally:  # whatever it raises: the process must end
        os._exit(status)


def park_if_exiting() -> None:
    """For the main thread on its way out with an error (under torchrun, collectives fail as workers
    are stopped): while exit_now ends the process, wait, so that its line is the only one (no
    traceback)."""
    if _state.exiting:
        threading.Event().wait()


# How long a worker whose peer ended waits for torchrun to stop it (on another node, torchrun
# learns of the failure through the rendezvous).
PEER_ENDED_WAIT_S = 60.0


def park_if_peer_ended() -> None:
    """For the main thread on its way out because a collective failed as another worker ended (that
    worker says why): under torchrun, wait for the signal with which torchrun stops this one, which
    ends it with one line instead of a traceback of the collective. Returns if none comes."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    # The signal came while the step still ran, and asked for a stop that will not come.
    if _state.requested:
        exit_now(_state.requested, again=False)
    threading.Event().wait(PEER_ENDED_WAIT_S)


def headed(line: str) -> str:
    """`line` as this process says it on stderr: headed by its rank beyond rank 0, as its log lines
    are (torchrun's failure summary names the rank itself)."""
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        return f"[rank {rank}] {line}"
    return line


def tell_launcher(line: str) -> None:
    """Under torchrun (which sets TORCHELASTIC_ERROR_FILE), the worker's one error line into that
    file, in the JSON of torch.distributed.elastic's ErrorHandler, so that torchrun's failure
    summary shows it."""
    record = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
        }
    }
    with contextlib.suppress(KeyError, OSError):
        path = os.environ["TORCHELASTIC_ERROR_FILE"]
        # Written aside, then renamed: torchrun reads the file once the process has ended, which can
        # be while the signals' thread writes it (an empty file crashed torchrun, no restart).
        part = f"{path}.{threading.get_native_id()}"
        with open(part, "w") as f:
            json.dump(record, f)
        os.replace(part, path)
