"""Local paths and fsspec URLs: errors as one StorageError naming the path, atomic writes, SHA-256,
writability."""

import contextlib
import glob
import hashlib
import logging
import os
import re
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"  # temporary files are named <target>.tmp-<pid>-<host>-<random> (atomic_open)
# s3fs tries a request that timed out 5 times, and botocore's legacy retry mode, its default, each
# of those 5 times: a store that stops answering held every call for over 6 minutes. The standard
# mode of the AWS SDKs tries 3 times (AWS_MAX_ATTEMPTS), backing off from throttling as S3 asks.
# The user's fsspec config for s3 (config_kwargs) wins.
S3_CLIENT = {"retries": {"mode": "standard"}}
NOTICE_EVERY = 30.0  # seconds between the lines saying that storage is still waited for


class StorageError(ValueError):
    """Storage cannot be reached, read or written; the message names the path."""


def storage_errors() -> tuple[type[BaseException], ...]:
    """What failing storage raises through fsspec: OSError, and the client libraries' errors once
    imported."""
    errors: list[type[BaseException]] = [OSError]
    if "botocore" in sys.modules:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += [BotoCoreError, ClientError]
    if "aiohttp" in sys.modules:
        import aiohttp

        errors.append(aiohttp.ClientError)
    return tuple(errors)


def reason(error: BaseException) -> str:
    """An exception as one line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Sink:
    """A binary file keeping the first storage error a write met, which torch.save hides behind
    "unexpected pos"."""

    def __init__(self, file: Any):
        self.file = file
        self.error = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except storage_errors() as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    """While the body runs, a line every NOTICE_EVERY seconds that `what` is still waited for: a
    store that stops answering holds an upload with no timeout (botocore's bound the wait for an
    answer once the request is sent), and the others add up to minutes."""
    done = threading.Event()
    start = time.monotonic()

    def notice() -> None:
        while not done.wait(NOTICE_EVERY):
            log.warning("still waiting for %s after %.0f s", what, time.monotonic() - start)

    threading.Thread(target=notice, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def filesystem(path: str, what: str = "snapshot path") -> tuple[fsspec.AbstractFileSystem, str]:
    """The file system of a local path or URL (`what` names it in an error), and the path within
    it."""
    options = fsspec.config.conf.setdefault("s3", {})
    options["config_kwargs"] = {**S3_CLIENT, **options.get("config_kwargs", {})}
    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:  # s3fs or gcsfs not installed, unknown protocol
        raise StorageError(
            f"cannot use {what} {path}: {e} "
            '(s3:// and gs:// need pip install -e ".[s3]" or ".[gcs]")'
        ) from None


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def glob_after(fs: fsspec.AbstractFileSystem, prefix: str, pattern: str) -> list[str]:
    """The paths of `fs` that are `prefix` followed by what the glob `pattern` matches. `prefix` is
    a name, not a pattern: a run directory named x[1] holds no x1/."""
    return fs.glob(glob.escape(prefix) + pattern)


def is_glob(path: str) -> bool:
    """Whether path has a glob's characters; in an HTTP(S) URL a `?` starts the query."""
    if fsspec.utils.get_protocol(path) in ("http", "https"):
        path = path.split("?")[0]
    return glob.has_magic(path)


def exists(path: str, directory: bool = False) -> bool:  # with `directory`: is a directory
    fs, p = filesystem(path)
    try:
        return fs.isdir(p) if directory else fs.exists(p)
    except storage_errors() as e:
        raise StorageError(f"cannot reach snapshot path {path}: {reason(e)}") from None


def prepare_parent(fs: fsspec.AbstractFileSystem, p: str, path: str) -> None:
    """Make the directory that will hold `p`. An object store's bucket (a path without a leading /)
    must exist: s3fs would create a missing one, so a typo would make a new bucket."""
    if is_local(fs) or p.startswith("/"):
        fs.makedirs(fs._parent(p), exist_ok=True)
        return
    name = p.split("/", 1)[0]
    try:
        fs.info(name)  # not exists(): s3fs answers False for a bucket it cannot reach
    except FileNotFoundError:
        raise StorageError(
            f"cannot use snapshot path {path}: bucket {name!r} does not exist (create it first)"
        ) from None


def check_writable(run_dir: str, snapshot_path: str) -> None:
    """StorageError unless a file can be made and removed in the run directory and beside the
    snapshot root."""
    tag = uuid.uuid4().hex[:8]
    for label, path, probe in (
        ("run directory", run_dir, f"/.write-probe-{tag}"),
        ("snapshot path", snapshot_path, f"{TMP_MARK}probe-{tag}"),
    ):
        # errors name the path given, not the probe's
        fs, p = filesystem(path, label)
        p += probe
        try:
            with waiting(f"the {label} {path}"):
                prepare_parent(fs, p, path)
                fs.pipe_file(p, b"\0")
                fs.rm(p)
        except storage_errors() as e:
            # On a full disk the probe is made and its write fails: it stayed, in a directory
            # that was the user's or would have been taken back empty.
            if is_local(fs):
                with contextlib.suppress(OSError):
                    os.remove(p)
            why = reason(e)
            if getattr(e, "filename", None) == p:  # the probe's name is none of the user's
                why = e.strerror
            raise StorageError(f"cannot write to the {label} {path}: {why}") from None
    fs, p = filesystem(snapshot_path)
    # After the probe, which names the storage's fault: a store that does not answer is not waited
    # for twice.
    # A device, pipe or socket is no file to fs.isfile: /dev/null or a FIFO was taken, the run
    # trained to its first save, which failed, and its best weights went to a directory beside it.
    with contextlib.suppress(*storage_errors()):
        if fs.exists(p) and not fs.isdir(p):
            what = "a file"
            if not fs.isfile(p):
                what = "a device, pipe or socket"
            raise StorageError(
                f"cannot write to the snapshot path {snapshot_path}: it is {what}, "
                "and snapshots are kept in a directory there"
            )


def user_cache_dir() -> str:
    """mingpt's directory in the user's cache: $XDG_CACHE_HOME/mingpt, else ~/.cache/mingpt."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(root, "mingpt")


def fsync_dir(path: str) -> None:  # makes a rename in the local directory `path` durable
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def directory_for(directory: str) -> Iterator[None]:
    """Make `directory` (and its parents) for the block's files; where the block fails, remove it
    again if this made it: the next attempt finds things as they were, not an empty directory
    beside the user's files."""
    existed = os.path.exists(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        yield
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):  # not made, or another process's file in it
                os.rmdir(directory)
        raise


@contextlib.contextmanager
def atomic_open(path: str, fs: fsspec.AbstractFileSystem | None = None) -> Iterator[BinaryIO]:
    """A file that replaces `path` whole when the body ends, else is removed (`path` as it was);
    with `fs`, in it."""
    if fs is None:
        fs, path = filesystem(path)
    tmp = f"{path}{TMP_MARK}{os.getpid()}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    local = is_local(fs)
    try:
        with fs.open(tmp, "wb") as f:
            yield f
            if local:  # the bytes reach the disk before the new name points at them
                f.flush()
                os.fsync(f.fileno())
        if local:
            # a rename: fs.mv would move the file into a directory at `path`, and say nothing
            os.replace(tmp, path)
        else:
            fs.mv(tmp, path)  # object stores publish whole objects
    finally:
        # renamed already, or the write's own error says more
        with contextlib.suppress(*storage_errors()):
            fs.rm(tmp)
    if local:
        fsync_dir(fs._parent(path))


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporaries of the local `path` that processes now gone left on this host (not
    another host's: its processes cannot be looked up here); return their paths."""
    here = re.escape(socket.gethostname())
    folder = os.path.dirname(path)
    removed = []
    for name in os.listdir(folder or "."):
        found = re.fullmatch(
            re.escape(os.path.basename(path) + TMP_MARK) + rf"(\d+)-{here}-[0-9a-f]{{8}}", name
        )
        if not found:
            continue
        try:
            # signal 0: nothing is sent, the process is only looked up
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:  # its writer is gone
            stale = os.path.join(folder, name)
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                os.remove(stale)
                removed.append(stale)
        except PermissionError:  # it runs, as another user
            pass
    return removed


def check_regular(path: str, label: str) -> None:
    """StorageError if the local `path` exists and is not a regular file (a FIFO would block a
    read); URLs pass."""
    fs, p = filesystem(path, label)
    if not is_local(fs):
        return
    try:
        mode = os.stat(p).st_mode
    except OSError:  # missing or unreadable: opening it says which
        return
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        kind = "a directory"
    elif stat.S_ISFIFO(mode):
        kind = "a FIFO"
    else:
        kind = "a device or socket"
    raise StorageError(f"{label} is not a regular file: {path} is {kind}")


def sha256(f: Any, before: bytes = b"") -> tuple[int, str]:
    """The size and SHA-256 of what is left to read in the open binary file `f` (the hash after
    `before`), read 16 MiB at a time."""
    digest = hashlib.sha256(before)
    size = 0
    while block := f.read(16 << 20):
        digest.update(block)
        size += len(block)
    return size, digest.hexdigest()
