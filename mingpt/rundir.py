"""The run directory: its one owner (a lock), writes once accepted, its one record; and the paths
that messages suggest in a command, written so that they can be pasted."""

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import logging.handlers
import os
import re
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import OmegaConf

from mingpt import storage
from mingpt.config import TrainerConfig
from mingpt.distributed import DistInfo
from mingpt.metrics import last_step

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
OTHER_NAME = "another name (trainer_config.run_name=NAME)"  # other_directory_hint's usual answer
RECORD_FILES = {"metrics.jsonl": "a file", "train.log": "a file", "tb": "a directory"}
# The claim held (claim's body): a process ended at once (stopping.exit_at_once) skips its
# release, and takes back the lock files it made through this.
held: "Claim | None" = None
# Whether a run of this process was accepted (on every rank): a sweep's multirun.yaml is then the
# record of a sweep that ran (mingpt.cli keeps it).
accepted = False


class RunDirError(ValueError):
    """The run directory cannot be used (in use by another job, cannot be created); the message
    names it."""


def shown(path: str) -> str:
    """`path` as typed from the directory the run started in, when it is inside that directory."""
    if "://" in path or os.path.relpath(path).startswith(".."):
        return path
    return os.path.relpath(path)


def shell_override(key: str, value: str, verbatim: bool = False) -> str:
    """`key=value` as one bash word that gives the command `value` back, whatever it holds. Hydra
    reads `=`, `,`, spaces, `~`, quotes and `${` in a value as syntax: such a value is quoted for
    its override grammar first, unless the command takes the text `verbatim` (generate, score and
    export's paths)."""
    if not verbatim and not _plain(key, value):
        value = _hydra_quoted(value)
    return shlex.quote(f"{key}={value}")


def _plain(key: str, value: str) -> bool:
    """Whether Hydra and OmegaConf read `key=value` back as the string `value` as it is."""
    try:
        parsed = OverridesParser.create().parse_override(f"{key}={value}").value()
    except HydraException:
        return False
    return "${" not in value and isinstance(parsed, str) and parsed == value


def _hydra_quoted(value: str) -> str:
    """`value` in Hydra's double quotes. Hydra unescapes a `"` and the backslashes before a quote or
    the end; OmegaConf reads `${` as an interpolation, and the backslashes right before it."""
    value = re.sub(r"(\\*)\$\{", lambda m: 2 * m.group(1) + "\\${", value)
    value = re.sub(r'(\\*)"', lambda m: 2 * m.group(1) + '\\"', value)
    value = re.sub(r"(\\*)\Z", lambda m: 2 * m.group(1), value)
    return f'"{value}"'


def directory_key() -> str:
    """The Hydra key that places this job's run directory where its run name does not: a sweep's
    job is in hydra.sweep.dir (hydra.run.dir does nothing under -m)."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return "hydra.sweep.dir"
    return "hydra.run.dir"


def new_run_hint(cfg: TrainerConfig, run_dir: str | None) -> str:
    """What to add for a new run instead of this one: a name not used yet, unless the name does
    not place its snapshots (a snapshot_path that is absolute, a URL or leads out of the run
    directory: shared by every name) or its run directory `run_dir` (hydra.run.dir, or a sweep's
    hydra.sweep.dir, names it)."""
    path = cfg.snapshot_path
    if path and ("://" in path or os.path.isabs(path) or os.path.normpath(path).startswith("..")):
        return "trainer_config.snapshot_path=PATH (a path not used yet)"
    if run_dir is not None and not _named_by_run_name(cfg, run_dir):
        return f"{directory_key()}=ANOTHER_DIRECTORY"
    return "trainer_config.run_name=NAME (a name not used yet)"


def other_directory_hint(cfg: TrainerConfig, run_dir: str) -> str:
    """What gives a job another run directory than `run_dir`: another name, unless hydra.run.dir
    (a sweep's hydra.sweep.dir) and not the name places it."""
    if _named_by_run_name(cfg, run_dir):
        return OTHER_NAME
    return f"another directory ({directory_key()}=ANOTHER_DIRECTORY)"


def _named_by_run_name(cfg: TrainerConfig, run_dir: str) -> bool:
    parent, base = os.path.split(os.path.normpath(run_dir))
    # a sweep's job N is in <run_name>-multirun/N
    return cfg.run_name in (base, os.path.basename(parent).removesuffix("-multirun"))


def check_hydra_settings(hydra_cfg: Any, sweep: bool) -> None:
    """Refuse the Hydra settings under which the same command would not find its run again: a run
    directory that is empty or named by the clock (Hydra's default, where a config file of the
    user's names none), a URL, which Hydra would make a local directory of, and a job that changes
    into its run directory."""
    node = "sweep" if sweep else "run"
    # as written: Hydra resolves ${now:...} when it makes the directory
    settings = OmegaConf.to_container(hydra_cfg[node], resolve=False)
    if not str(settings["dir"]).strip():
        raise RunDirError(
            f"hydra.{node}.dir: must not be empty (it would put the run into the current directory)"
        )
    # Hydra makes the run directory on the local disk: s3://b/x became ./s3:/b/x without a word.
    if "://" in str(settings["dir"]):
        raise RunDirError(
            f"hydra.{node}.dir: {settings['dir']} is a URL, and a run directory is local (its log "
            "and config): keep the snapshots there instead, with trainer_config.snapshot_path"
        )
    ours = {"dir": "runs/${trainer_config.run_name}" + "-multirun" * sweep}
    # a sweep's job N is in its subdir
    if sweep:
        ours["subdir"] = "${hydra.job.num}"
    for name, default in ours.items():
        key = f"hydra.{node}.{name}"
        setting = str(settings[name])
        if "${now:" in setting:
            raise RunDirError(
                f"{key}: {setting} is named by the clock, so the same command would start over in "
                f"a new directory instead of resuming: name it by the run, as in "
                f"'{key}={default}' (on the command line, or in the config file)"
            )
    if hydra_cfg.job.chdir:
        raise RunDirError(
            "hydra.job.chdir: true moves each process into its run directory, where relative paths "
            "(data_config.path, the commands a run prints) no longer mean what they say: leave it "
            "false"
        )


def check_clock_names(trainer_cfg: Any) -> None:
    """Refuse a run name or a snapshots' root named by the clock (`${now:...}`), as a run directory
    is (check_hydra_settings): the same command, a torchrun restart or a requeued job would start
    over beside the run instead of resuming it, and each process of a job could name another."""
    # as written; a file of one's own may leave the keys out
    settings = OmegaConf.to_container(trainer_cfg, resolve=False)
    for name, default in (("run_name", "NAME"), ("snapshot_path", "PATH")):
        setting = str(settings.get(name))
        if "${now:" in setting:
            raise RunDirError(
                f"trainer_config.{name}: {setting} is named by the clock, so the same command "
                f"would start over instead of resuming: name it, as in "
                f"trainer_config.{name}={default}"
            )


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote in the file (none yet, or a dead holder's: a job is
    starting)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        if info.get("host") == socket.gethostname():
            with contextlib.suppress(PermissionError):  # alive, another user's
                os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return "another job that is starting"
    run_id = f", torchrun run id {info['run_id']}" if info.get("run_id") else ""
    return f"pid {info.get('pid')} on host {info.get('host')} since {info.get('since')}{run_id}"


def _lock(path: str, what: str, instead: str) -> tuple[int | None, bool]:
    """A descriptor holding an exclusive flock on `path` (None where the file system refuses locks:
    Lustre mounted without flock or localflock), and whether this call created the file; or
    RunDirError naming the holder and what to give `instead`."""
    while True:
        # whether this call creates the file (check_writable made its directory)
        created = True
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                created = False
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot use {what}: {e.filename}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirError(
                f"{what} is in use by {holder}; wait for that job to end or stop it, "
                f"or run this one with {instead}"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                log.warning(
                    "cannot lock %s (%s): a second job on it would not be detected",
                    path,
                    e.strerror,
                )
                return None, False
            raise RunDirError(f"cannot lock {path}: {e.strerror}") from None
        # A refused job removes the lock file it made (Claim.release): the lock must be on the file
        # that is there now, or a job that opened the old one before would share the directory.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd, created
        os.close(fd)


def lock_paths(
    run_dir: str, snapshot_path: str, other_directory: str
) -> list[tuple[str, str, str]]:
    """The lock files of a run, what they guard and what a second job can use instead: in its
    directory, and beside a local snapshot root. The root's lock is taken wherever the root is,
    its own run directory included: another run whose snapshot_path names this root (`../a/
    snapshots`) holds no lock of this directory, and would otherwise write the same root at the
    same time."""
    paths = [
        (
            os.path.join(run_dir, LOCK_FILE),
            f"run directory {run_dir}",
            other_directory,
        )
    ]
    if "://" not in snapshot_path or snapshot_path.startswith("file://"):
        # Beside the real root: a root named through a symlink is the same root, and must take the
        # same lock.
        snapshot = os.path.realpath(snapshot_path.removeprefix("file://"))
        paths.append(
            (
                f"{snapshot}.lock",
                f"snapshot {snapshot_path}",
                "another snapshot path (trainer_config.snapshot_path=PATH)",
            )
        )
    return paths


def hold_log_lines(rank: int) -> logging.handlers.MemoryHandler | None:
    """Rank 0's log lines, kept until `Claim.accept` writes them to train.log: a refused run appends
    nothing there."""
    if rank != 0:
        return None
    buffer = logging.handlers.MemoryHandler(capacity=1_000_000, flushLevel=logging.CRITICAL + 1)
    logging.getLogger().addHandler(buffer)
    return buffer


class _LogFile(logging.FileHandler):
    """train.log: a line it cannot write costs one warning, and the log goes on on stderr only."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        # Once a write failed, no line is tried again: while the held lines are flushed into this
        # file, the warning is held behind them and came back here, failed, and warned again.
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True
        logging.getLogger().removeHandler(self)
        log.warning(
            "cannot write %s (%s): the log goes on on stderr only",
            self.baseFilename,
            sys.exc_info()[1],
        )


@dataclasses.dataclass
class Claim:
    """The locks a job holds (global main process only), and the files written once it is
    accepted."""

    run_dir: str
    snapshot_path: str
    fds: list[int]
    log_buffer: logging.handlers.MemoryHandler | None  # rank 0's alone (hold_log_lines)
    log_file: logging.FileHandler | None = None
    # the lock files it created, taken back if it is refused
    made: list[str] = dataclasses.field(default_factory=list)

    def accept(self, files: Mapping[str, str | Callable[[], str]]) -> None:
        """Every check passed: record the holder, open train.log with the lines logged so far,
        and write `files` ({path in the run directory: text, or what makes it}); on rank 0 alone."""
        global accepted
        if self.log_buffer is None:
            accepted = True
            return
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "snapshot": _comparable(self.snapshot_path, self.run_dir),
        }
        # A disk that filled since the start's probe (a traceback, before)
        try:
            for fd in self.fds:
                # Over the earlier holder's record in one write, padded to its length with spaces
                # (nothing to JSON): truncated first, a write that failed or a kill between the two
                # left the file empty, and a later run of another snapshot path was let cut back
                # the record (_record_problem).
                record = (json.dumps(info) + "\n").encode()
                os.pwrite(fd, record.ljust(os.fstat(fd).st_size), 0)
            root = logging.getLogger()
            self.log_file = _LogFile(os.path.join(self.run_dir, "train.log"))
            self.log_file.setFormatter(root.handlers[0].formatter)  # setup_logging's handler
            self.log_file.filters = list(root.handlers[0].filters)  # mingpt's INFO only
            self.log_buffer.setTarget(self.log_file)
            self.log_buffer.flush()
            root.removeHandler(self.log_buffer)
            root.addHandler(self.log_file)
            for name, text in files.items():
                path = os.path.join(self.run_dir, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                # Replaced whole: generate, score and export read .hydra/config.yaml to find the
                # run's snapshots, also while a restart of the run writes it, and a write that
                # fails (a full disk) must leave the run's earlier one as it was.
                with storage.atomic_open(path) as f:
                    f.write((text() if callable(text) else text).encode("utf-8"))
        except OSError as e:
            raise RunDirError(
                f"cannot write to the run directory {self.run_dir}: {e.strerror or e}"
            ) from None
        self.made = []  # accepted: its lock files stay
        accepted = True

    def take_back(self) -> None:
        """A job not accepted leaves no trace: the lock files it made go while it still holds them
        (a run directory left empty goes too, in mingpt.cli)."""
        for path in self.made:
            with contextlib.suppress(OSError):
                os.remove(path)
        # once: a later call (the release after an exit_at_once) must not remove another's
        self.made = []

    def release(self) -> None:
        self.take_back()
        root = logging.getLogger()
        for handler in filter(None, (self.log_buffer, self.log_file)):
            root.removeHandler(handler)
            # the last lines, to a full disk: said on stderr already
            with contextlib.suppress(OSError):
                handler.close()
        for fd in self.fds:  # the kernel also releases them when the process ends
            os.close(fd)


@contextlib.contextmanager
def claim(
    run_dir: str,
    snapshot_path: str,
    step: int,
    dist_info: DistInfo,
    log_buffer: logging.handlers.MemoryHandler | None,
    other_directory: str = OTHER_NAME,
) -> Iterator[Claim]:
    """Own the run directory (and a local snapshot location) for the body's duration, its record
    checked once it is owned: a start from `step` must not cut back the record of another run in
    `run_dir` (the run whose snapshot its lock file names), nor find a record file of the wrong
    kind. Rank 0 takes the locks and checks, so every rank of a refused job raises the same
    RunDirError before anything is written; its line suggests `other_directory`
    (other_directory_hint) for this job."""
    global held
    owned = Claim(run_dir, snapshot_path, [], log_buffer)
    held = owned
    refusal = [None]  # rank 0's, on every rank: all raise the same RunDirError, or none does
    try:
        if dist_info.is_main_process:
            try:
                for path, what, instead in lock_paths(run_dir, snapshot_path, other_directory):
                    fd, created = _lock(path, what, instead)
                    if fd is not None:
                        owned.fds.append(fd)
                    if created:
                        owned.made.append(path)
                refusal = [_record_problem(run_dir, snapshot_path, step, other_directory)]
            except RunDirError as e:
                refusal = [str(e)]
        if dist_info.is_distributed:
            dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            raise RunDirError(refusal[0])
        yield owned
    finally:
        held = None
        owned.release()


def _comparable(snapshot_path: str, run_dir: str) -> str:
    """A local root inside the run directory relative to it, as snapshot_path names it: the record
    stays its run's when the directory is copied or moved."""
    if "://" in snapshot_path:
        return snapshot_path
    inside = os.path.relpath(snapshot_path, run_dir)
    if inside.startswith(".."):
        return os.path.abspath(snapshot_path)
    return inside


def _record_problem(
    run_dir: str, snapshot_path: str, step: int, other_directory: str
) -> str | None:
    for name, kind in RECORD_FILES.items():
        path = os.path.join(run_dir, name)
        if os.path.lexists(path) and os.path.isdir(path) != (kind == "a directory"):
            return f"run directory {run_dir}: {path} must be {kind}; move it away"
    last = last_step(run_dir)
    previous = None  # the snapshot the lock file names
    with (
        contextlib.suppress(OSError, ValueError, AttributeError),
        open(os.path.join(run_dir, LOCK_FILE), "rb") as f,
    ):
        previous = json.loads(f.read()).get("snapshot")
    # an older mingpt's lock file names the root by its absolute path
    ours = (None, _comparable(snapshot_path, run_dir), os.path.abspath(snapshot_path))
    if last is None or last <= step or previous in ours:
        # nothing to cut back, or a killed attempt of this run: its events after the snapshot go
        return None
    return (
        f"run directory {run_dir} holds the record of a run up to step {last} with the snapshot "
        f"{previous}; this one starts from step {step} with the snapshot {snapshot_path} and would "
        "overwrite that record: give the snapshot path that run had "
        f"({shell_override('trainer_config.snapshot_path', previous)}), or start this run with "
        f"{other_directory}"
    )
