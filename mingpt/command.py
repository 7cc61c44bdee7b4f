"""generate, score and export's `key=value` parsing, --help from the fields, one-line errors."""

import gc
import os
import sys
from collections.abc import Callable

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from mingpt.config import ConfigError, check, key_lines, unknown_key
from mingpt.distributed import setup_logging
from mingpt.rundir import LOCK_FILE
from mingpt.snapshot import SnapshotError, reader
from mingpt.storage import StorageError, reason

# Where a training run of the default settings is, and generate's and score's default snapshot.
DEFAULT_RUN = "runs/default"


def typed(tool: str) -> str:
    """The command of `tool` (train, generate, score, export) as the user types it: an installed
    mingpt-train has them as mingpt-TOOL (its Python may not be the one `python` runs), a clone as
    `python main.py` and `python -m mingpt.TOOL`."""
    if os.path.basename(sys.argv[0]).startswith("mingpt-"):
        return f"mingpt-{tool}"
    if tool == "train":
        return "python main.py"
    return f"python -m mingpt.{tool}"


def find_snapshot(path: str, key: str) -> tuple[str, str]:
    """reader.find, saying what to do where `path` (given as `key`) is the default run and it is not
    there: a first command outside the directory that trained."""
    if path == DEFAULT_RUN and not os.path.exists(path):
        train = typed("train")
        # `python main.py` runs only in a clone's root; elsewhere the installed command trains (both
        # kinds of install have it), and its run is then here, where this command looks
        if train == "python main.py" and not os.path.isfile("main.py"):
            train = "mingpt-train"
        hint = f"no run here: train one with {train}, or give {key}=PATH"
        # Inside a run directory (cd runs/NAME, or a config whose hydra.run.dir is ./)
        if os.path.exists(LOCK_FILE):
            hint = f"this directory is a run's: give {key}=."
        raise SnapshotError(f"snapshot not found: {path} ({hint})")
    return reader.find(path)


def one_line(message: str) -> str:
    """`message` with each character that is not printable (a newline, a tab, a control
    character) escaped as Python writes it in a string: a path holding a newline, given where a
    path is asked for, kept its error from being the one line it is."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message
    )


class OutputError(ValueError):
    """The output cannot be written to stdout (closed, or a full device)."""


def parse_args(argv: list[str], schema: type, text_keys: tuple[str, ...] = ()):
    """`key=value` overrides on the defaults of the dataclass `schema`. The `text_keys` are taken
    verbatim, never parsed as YAML (`prompt=ROMEO:` would be a mapping, `prompt=O, Romeo!` or
    `${...}` would not survive)."""
    text = {}
    rest = []
    for arg in argv:
        check("=" in arg and not arg.startswith("="), arg, "expected key=value")
        key, value = arg.split("=", 1)
        if key in text_keys:
            text[key] = value
        else:
            rest.append(arg)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(rest))
        values = OmegaConf.to_container(merged, resolve=True)
    except ConfigKeyError as e:
        raise ConfigError(unknown_key(e.full_key, schema.__dataclass_fields__)) from None
    except OmegaConfBaseException as e:
        message = reason(e)
        if e.full_key and e.full_key not in message:
            message = f"{e.full_key}: {message}"
        raise ConfigError(message) from None
    return schema(**{**values, **text})


def freeze_startup_objects() -> None:
    """Leave the objects the imports made (torch's hundreds of thousands) out of the garbage
    collector's passes: they live as long as the process, and scanning them, in its full passes and
    in the last one at exit, cost each command close to a second of CPU (on an Intel Xeon, a
    process that only imports torch took 2.8 CPU-s, 2.0 with them frozen). Once a process: a
    second command in it (a test's) would keep the first's garbage from the collector for good."""
    if gc.get_freeze_count() == 0:
        gc.freeze()


def command(
    tool: str,
    arguments: str,
    schema: type,
    doc: str,
    body: Callable[[list[str]], None],
    errors: tuple[type[BaseException], ...],
    argv: list[str] | None = None,
) -> None:
    """Run `body(argv)` with logging on stderr. `--help` prints the usage (the command of `tool`
    as typed, then `arguments`), `doc`'s first paragraph naming the command's other form, the keys
    of `schema`, then the rest of `doc`; an error of the config, a snapshot, storage or
    the output, or one of the command's own `errors`, ends the run with one line on stderr and exit
    status 2, Ctrl-C with 130, a closed pipe (`| head`) with 1 and no message."""
    freeze_startup_objects()
    if argv is None:
        argv = sys.argv[1:]
    try:
        if any(arg in ("-h", "--help") for arg in argv):
            what, rest = doc.strip().split("\n\n", 1)  # the summary, then the details
            # the other way to type the command than `typed`'s
            other = f"mingpt-{tool}"
            if typed(tool) == other:
                other = f"python -m mingpt.{tool}"
            what = f"{what.removesuffix('.')} (also: {other})."
            usage = f"{typed(tool)} {arguments}"
            write(f"usage: {usage}\n\n{what}\n\n{key_lines(schema)}\n\n{rest}".rstrip() + "\n")
            return
        # stdout closed (`>&-`): refused before the work, not at its first write
        write("")
        setup_logging(rank=0)
        body(argv)
    except (ConfigError, SnapshotError, StorageError, OutputError, *errors) as e:
        # With stderr closed (`2>&-`), print would write the line to stdout, into the output.
        if sys.stderr is not None:
            print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        silence_stdout()
        sys.exit(1)


def silence_stdout() -> None:
    """stdout to /dev/null, once writing to it failed: the exit's flush would fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def write(text: str) -> None:
    """`text` to stdout, flushed; OutputError if it cannot be written (a BrokenPipeError is left to
    `command`, which ends quietly)."""
    # Started with stdout closed (`>&-`).
    if sys.stdout is None:
        raise OutputError("stdout is closed: nowhere to write the output")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    # BrokenPipeError (`| head`) is not an error of ours.
    except BrokenPipeError:
        raise
    # A character the encoding of stdout lacks (PYTHONIOENCODING=ascii, a latin-1 locale).
    except UnicodeEncodeError as e:
        raise OutputError(
            f"stdout's encoding, {e.encoding}, cannot write {e.object[e.start : e.end]!a} "
            "(PYTHONIOENCODING=utf-8 sets one that can)"
        ) from None
    # `>/dev/full`, say.
    except OSError as e:
        silence_stdout()
        raise OutputError(f"cannot write to stdout: {e.strerror or e}") from None
