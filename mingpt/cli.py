"""The training command line, `python main.py [key=value ...]` and `mingpt-train`:
Hydra composes the configs, the recipe (mingpt/train.py) runs them. Bad input
(config, data, snapshot, storage) ends the run with one line on stderr and
exit status 2; a stop signal with one line and 128 + its number, after a
snapshot once training runs (mingpt/stopping.py)."""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from mingpt import stopping
from mingpt.config import Config, ConfigError, check_known_keys, drop_ignored_keys, register_configs
from mingpt.data import DataError
from mingpt.rundir import RunDirError, check_run_dir_setting, register_resolvers
from mingpt.snapshot import SnapshotError
from mingpt.storage import StorageError
from mingpt.train import run
from mingpt.trainer import TrainingError

# conf/ of the clone; a non-editable install carries the same files as the package mingpt.conf.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
CONF_PATH = CONF_DIR if os.path.isdir(CONF_DIR) else "pkg://mingpt.conf"
USER_ERRORS = (ConfigError, DataError, SnapshotError, StorageError, TrainingError, RunDirError)


def fail(message: str, status: int = 2) -> NoReturn:
    """End the process with one line on stderr (one write, so ranks' lines do not interleave),
    also given to torchrun for its summary: first the line (torchrun stops the other
    workers as soon as one exits), then the error file."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    stopping.tell_launcher(f"error: {message}")
    sys.exit(status)


def config_error_line(error: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error: the key and the problem."""
    if isinstance(error, OverrideParseException):
        return override_error_line(error.override)
    # Hydra chains the real error through __cause__ or, while composing a file, __context__.
    where = re.match(r"In '([^']+)'", str(error))
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and cause.full_key and cause.msg:
            line = f"{cause.full_key}: {cause.msg.splitlines()[0]}"
            return f"in {where.group(1)}: {line}" if where else line
        cause = cause.__cause__ or cause.__context__
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    options = getattr(error, "options", None)
    return f"{line} (choices: {', '.join(options)})" if options else line


def override_error_line(override: str) -> str:
    """Which override Hydra could not parse, and how to write it."""
    key, _, value = override.partition("=")
    if not re.fullmatch(r"[~+]{0,2}[A-Za-z_][\w.@/-]*", key, re.ASCII):
        return f"cannot parse the override {override!r}: a key is ASCII letters, digits, '_' and '.'"
    quoted = f"'{key}=\"{value}\"'" if '"' not in value else f"\"{key}='{value}'\""
    home = " (~ is not expanded inside it: write $HOME instead)" if value.startswith("~") else ""
    return f"cannot parse the override {override!r}: quote the value, as in {quoted}{home}"


def check_group_overrides(overrides: list[str]) -> None:
    """`~group` drops a config group from the defaults; `group=NAME` beside it would silently go with it."""
    dropped = {item[1:].partition("=")[0] for item in overrides if item.startswith("~")}
    for item in overrides:
        key, sep, _ = item.lstrip("+").partition("=")
        if sep and not item.startswith("~") and key in dropped:
            raise ConfigError(f"{item}: ~{key} drops the {key} group and with it this choice; give one of them")


register_configs()
register_resolvers()
_in_task = False  # an OSError outside a task is Hydra failing to create the run directory


@hydra.main(config_path=CONF_PATH, config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    global _in_task
    _in_task = True
    try:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.RUN:
            check_run_dir_setting(hydra_cfg.run.dir)
        check_group_overrides(OmegaConf.to_container(hydra_cfg.overrides.task))  # unresolved
        with open_dict(cfg):
            notices = drop_ignored_keys(cfg)
        check_known_keys(cfg)
        # A user's own file (--config-dir DIR --config-name NAME) need not build on
        # base_config: the schema goes under it, so its keys and types are checked alike.
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
        stopping.install(config.trainer_config.stop_signals)
        # Hydra's own .hydra/ is off (conf/config.yaml): it would be written before any check.
        files = {".hydra/config.yaml": OmegaConf.to_yaml(cfg),
                 ".hydra/overrides.yaml": OmegaConf.to_yaml(list(hydra_cfg.overrides.task))}
        run(config, hydra_cfg.runtime.output_dir, files, notices)
    except USER_ERRORS as e:
        fail(str(e))
    except OmegaConfBaseException as e:  # an interpolation that cannot be resolved
        fail(config_error_line(e))
    except stopping.Stopped as e:
        fail(str(e), status=e.status)
    except BaseException:  # Hydra would print "Error executing job with overrides: ..." on the way out
        stopping.park_if_exiting()
        raise
    _in_task = False  # an OSError from inside a task keeps its traceback: a bug


def take_local_rank_argument(argv: list[str]) -> list[str]:
    """Remove the `--local-rank=N` that the legacy launcher (`python -m
    torch.distributed.launch` without --use-env) passes; also `--local_rank=N`
    and `--local_rank N`. The launcher sets LOCAL_RANK too, and that stays the
    source of truth: the argument only fills it in when it is missing."""
    rest, given = [], None
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name not in ("--local-rank", "--local_rank"):
            rest.append(arg)
            continue
        value = value if eq else next(args, "")
        if not value.isdigit():
            fail(f"{name}: expects a local rank (a number >= 0), got {value!r}")
        given = value
    if given is not None:
        env = os.environ.setdefault("LOCAL_RANK", given)
        if env != given:
            fail(f"--local-rank={given} contradicts LOCAL_RANK={env} from the launcher's environment")
    return rest


def main() -> None:
    """Entry point of `python main.py` and `mingpt-train`."""
    sys.argv[1:] = take_local_rank_argument(sys.argv[1:])
    # Let composition errors reach us instead of Hydra's multi-line report;
    # any other exception is a bug and keeps its full traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    stopping.install()  # main.py did it already, before its imports
    try:
        _hydra_main()
    except (HydraException, OmegaConfBaseException) as e:
        fail(config_error_line(e))
    except KeyboardInterrupt:
        fail("interrupted", status=130)
    except OSError as e:
        if _in_task:
            raise
        fail(f"cannot create the run directory: {e.filename or ''}: {e.strerror or e}")
