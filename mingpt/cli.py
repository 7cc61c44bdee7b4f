"""The training command line (`python main.py [key=value ...]`, `mingpt-train`, `python -m
mingpt.cli`): Hydra composes, run.py runs."""

import argparse
import contextlib
import os
import re
import sys
from typing import Any, NoReturn

import hydra
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import Container, DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from mingpt import rundir, stopping
from mingpt.command import freeze_startup_objects, one_line, silence_stdout, typed
from mingpt.config import (
    FIELDS,
    SECTIONS,
    Config,
    ConfigError,
    TrainerConfig,
    check,
    check_known_keys,
    drop_ignored_keys,
    keys_without_effect,
    register_configs,
    unknown_key,
    value_text,
)
from mingpt.data import DataError
from mingpt.distributed import peer_ended
from mingpt.run import run
from mingpt.rundir import (
    RunDirError,
    check_clock_names,
    check_hydra_settings,
    new_run_hint,
    shell_override,
)
from mingpt.snapshot import SnapshotError
from mingpt.storage import StorageError, atomic_open, is_glob, reason
from mingpt.trainer import TrainingError

# The keys whose values are text (a run name, a path, a URI; the corpus's path or paths): one
# typed as a number becomes text again (check_text_overrides).
TEXT_KEYS = frozenset(
    [key for key, f in FIELDS.items() if f.type in ("str", "str | None")] + ["data_config.path"]
)
# a value of an override's list, sweep or function, as typed
VALUE_WORD = r"[^\s,()\[\]]+"
# conf/ of the clone; a non-editable install carries the same files as the package mingpt.conf.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
CONF_PATH = CONF_DIR if os.path.isdir(CONF_DIR) else "pkg://mingpt.conf"
USER_ERRORS = (ConfigError, DataError, SnapshotError, StorageError, TrainingError, RunDirError)
COMPOSE = Hydra.compose_config
LOAD = ConfigLoaderImpl.load_configuration
# conf/config.yaml's, whatever the primary config (a user's own, --config-name): the run logs as
# mingpt sets up (Hydra's file handler left an empty <job>.log in the run directory), and mingpt
# writes .hydra/ once the run is accepted (Hydra's, before any check: a refused command rewrote
# an existing run's). Overrides, so that each job of a sweep has them too; first, so that the
# user's own overrides of these keys still win.
OWN_HYDRA = ["hydra/job_logging=none", "hydra.output_subdir=null"]


def fail(message: str) -> NoReturn:
    say_and_exit(f"error: {one_line(message)}", 2)


def say_and_exit(line: str, status: int, every_rank: bool = True) -> NoReturn:
    """End the process with one line on stderr (one write: ranks' lines do not interleave), then in
    torchrun's error file (after the line: torchrun stops the other workers as soon as one exits).
    On stderr a rank other than 0 heads its line with its rank, as its log lines (torchrun's
    summary names the rank itself); with `every_rank` False (a stop the user asked for, the same
    line on every rank) rank 0 alone says it there. A stop says so without `error:`; its status
    still tells a script."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"{stopping.headed(line)}\n")
    sys.stderr.flush()
    stopping.tell_launcher(line)
    sys.exit(status)


def config_error_line(error: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error: the key and the problem. Hydra chains the
    real error through __cause__ or, while composing a file, __context__."""
    if isinstance(error, OverrideParseException):
        return override_error_line(error.override)
    if isinstance(error, yaml.YAMLError):
        return yaml_error_line(error)
    # Hydra's advice for it comes on lines of its own
    ambiguous = re.match(r"Ambiguous value for argument '([^=]+)=(.*)'\n", f"{error}\n")
    if ambiguous:
        key, value = ambiguous.groups()
        return (
            f"{key}={value}: a comma makes several values; for one, quote it "
            f"({shell_override(key, value)}), or add -m to sweep over them"
        )
    where = re.match(r"In '([^']+)'", str(error))
    # Hydra's hint for a key the composed config lacks (a config file that sets only some keys)
    append = re.search(r"To append to your config use (\S+)", str(error))
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and cause.full_key and cause.msg:
            line = f"{cause.full_key}: {cause.msg.splitlines()[0]}"
            known = cause.full_key in FIELDS or cause.full_key in SECTIONS
            # OmegaConf's ConfigKeyError or ConfigAttributeError: a key no section has
            if isinstance(cause, KeyError | AttributeError) and not known:
                line = unknown_key(cause.full_key, [*SECTIONS, *FIELDS])
                # the close name suggested is no cure for a group's file without its header
                group = group_without_header(cause.full_key, where)
                if group:
                    line = (
                        f"unknown key {cause.full_key}: the keys of a file in {group} go under "
                        f"{group}; to set keys of every section, start the file with the line "
                        "'# @package _global_'"
                    )
            if append:
                line = missing_key_line(line, cause.full_key, append.group(1))
            if where:
                line = f"in {where.group(1)}: {line}"
            return line
        cause = cause.__cause__ or cause.__context__
    line = reason(error)
    options = getattr(error, "options", None)
    return f"{line} (choices: {', '.join(options)})" if options else line


def missing_key_line(line: str, key: str, added: str) -> str:
    """`line` for a `key` that a config file of one's own lacks, with Hydra's override `added`
    that adds it (+section.key=value)."""
    if key in FIELDS:
        return f"{line} (this config has no such key yet: add it with {added})"
    # without the whole section: the key's name, not the section's, which is no typo (it was
    # suggested as its own correction)
    if key in SECTIONS:
        name = added.lstrip("+").split("=", 1)[0]
        return f"{name}: this config has no {key} section yet: add the key with {added}"
    return line


def group_without_header(key: str, where: re.Match | None) -> str | None:
    """The group of the file being composed (`where`, Hydra's "In 'experiment/mine'"), where `key`
    is the group itself or a section under it: a group's file puts its keys under the group's name
    (experiment.trainer_config) unless it starts with the `@package _global_` header."""
    if where is None:
        return None
    group = where.group(1).rpartition("/")[0].replace("/", ".")
    if not group:
        return None
    if key == group:
        return group
    section = key.removeprefix(f"{group}.").partition(".")[0]
    if key.startswith(f"{group}.") and section in SECTIONS:
        return group
    return None


def yaml_error_line(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"a config file is not valid YAML: {error}"
    line = (
        f"{mark.name}: line {mark.line + 1}, column {mark.column + 1}: "
        f"not valid YAML: {error.problem}"
    )
    # a MarkedYAMLError: what the problem is inside of, where it has such a context
    start = error.context_mark
    if error.context and start and start.line != mark.line:
        line += f" ({error.context} from line {start.line + 1}, column {start.column + 1})"
    elif error.context:
        line += f" ({error.context})"
    return line


def override_error_line(override: str) -> str:
    key, eq, value = override.partition("=")
    if not eq:
        return (
            f"cannot parse the override {override!r}: expected key=value (a value with a space "
            "goes in quotes with its key, as in 'trainer_config.run_name=my run')"
        )
    if not re.fullmatch(r"[~+]{0,2}[A-Za-z_][\w.@/-]*", key, re.ASCII):
        return (
            f"cannot parse the override {override!r}: a key is ASCII letters, digits, '_' and '.'"
        )
    if not value.isprintable():
        return (
            f"cannot parse the override {override!r}: "
            "it holds a control character (a newline, a tab)"
        )
    home = " (~ is not expanded inside it: write $HOME instead)" if value.startswith("~") else ""
    return (
        f"cannot parse the override {override!r}: quote the value, as in "
        f"{shell_override(key, value)}{home}"
    )


def check_group_overrides(overrides: list[str]) -> None:
    """`~group` drops a config group from the defaults; `group=NAME` beside it would silently go
    with it. A list of a group's choices (`experiment=[gpu-quick,ddp-tutorial]`) merges them, the
    later's keys over the earlier's: a recipe of neither, silently."""
    dropped = {item[1:].partition("=")[0] for item in overrides if item.startswith("~")}
    for item in overrides:
        key = item.lstrip("+").split("=", 1)[0]  # a `~group` keeps its `~`: it is no choice
        if key in dropped:
            raise ConfigError(
                f"{item}: ~{key} drops the {key} group and with it this choice; give one of them"
            )
    for override in OverridesParser.create().parse_overrides(overrides):
        group = override.key_or_group
        # a list is a value of a key (data_config.path=[a.txt,b.txt]), and Hydra's own groups' to
        # choose
        if group in FIELDS or group.startswith("hydra") or not isinstance(override.value(), list):
            continue
        raise ConfigError(
            f"{override.input_line}: one {group} at a time; a list merges their settings into a "
            "recipe of none of them"
        )


def check_text_overrides(overrides: list[str]) -> None:
    """A value of a text key (a run name, a path) that the command line reads as a number or a
    boolean becomes text again, but not as typed: `trainer_config.run_name=3e-4` named the run
    directory runs/0.0003, and a sweep's `snapshot_path=1e3,true` its jobs' 1000.0 and True.
    Refused, with the quoting that keeps the values as typed."""
    parser = OverridesParser.create()
    for override in parser.parse_overrides(overrides):
        key = override.key_or_group
        if key not in TEXT_KEYS or override.is_delete():
            continue
        name, typed = (part.strip() for part in override.input_line.split("=", 1))
        # each value as typed (the one, or a list's or a sweep's) that is read as another text
        changed = {}
        for word in dict.fromkeys(re.findall(VALUE_WORD, typed)):
            with contextlib.suppress(HydraException):
                value = parser.parse_override(f"{key}={word}").value()
                if isinstance(value, int | float) and str(value) != word:  # 2024 stays '2024'
                    changed[word] = value
        if not changed:
            continue
        readings = []
        for word, value in changed.items():
            kind = "a number"
            if isinstance(value, bool):  # a bool is an int
                kind = "a boolean"
            readings.append(f"{word} is read as {kind}, so the value would be {str(value)!r}")
        # the typed text, with those values quoted
        parts = re.split(f"({VALUE_WORD})", typed)
        kept = "".join(f'"{part}"' if part in changed else part for part in parts)
        raise ConfigError(
            f"{override.input_line}: {'; '.join(readings)}; to keep it as typed, quote it: "
            f"{shell_override(name, kept, verbatim=True)}"
        )


def usage() -> str:
    """--help's first line, with the command as typed: torchrun runs main.py, or with --no-python an
    installed mingpt-train."""
    command = typed("train")
    launched = "main.py"
    if command != "python main.py":  # an installed script: torchrun runs it as it is
        launched = f"--no-python {command}"
    args = "[key=value ...]"
    return f"{command} {args}  (one process; or torchrun [options] {launched} {args})"


register_configs()
OmegaConf.register_new_resolver("mingpt.usage", usage, replace=True)
_in_task = False  # an OSError outside a task is Hydra failing to create the run directory
# A sweep's multirun.yaml, which Hydra's sweeper writes before any job is checked, and what it
# wrote over (an earlier sweep's record): taken back, or put back, while no job of the sweep was
# accepted.
_record: str | None = None
_earlier_sweep: bytes | None = None
# The directories Hydra is to make for the command (a sweep's jobs', runs/), the deepest first: a
# command not accepted takes them back where they are empty; one there before (the user's) stays.
_made: list[str] = []


def checked_config(cfg: DictConfig, hydra_cfg: DictConfig) -> tuple[Config, list[str]]:
    """`cfg` as a Config, every key and value checked, and the notices of its ignored keys (dropped
    in place)."""
    check_hydra_settings(hydra_cfg, sweep=hydra_cfg.mode == RunMode.MULTIRUN)
    overrides = OmegaConf.to_container(hydra_cfg.overrides.task)
    check_group_overrides(overrides)
    check_text_overrides(overrides)
    if isinstance(cfg.get("trainer_config"), DictConfig):
        check_clock_names(cfg.trainer_config)
    with open_dict(cfg):
        notices = drop_ignored_keys(cfg)
    # and a user's own file need not build on base_config: the schema goes under it
    check_known_keys(cfg)
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
    snapshot_path = str(config.trainer_config.snapshot_path)
    # fsspec's memory:// ends with the process (in-process library use keeps it)
    check(
        not snapshot_path.startswith("memory://"),
        "trainer_config.snapshot_path",
        "memory:// ends with the command, and its snapshots with it: give a path or a URL that "
        "outlives it",
    )
    # An object store's rm reads [, * and ? in a path as a pattern: pruning step-N of exp[1]/ would
    # delete exp1/'s too.
    check(
        "://" not in snapshot_path
        or snapshot_path.startswith("file://")
        or not is_glob(snapshot_path),
        "trainer_config.snapshot_path",
        f"{snapshot_path}: an object store reads [, * and ? as a pattern when it deletes old "
        "snapshots: name it without them",
    )
    return config, notices + keys_without_effect(config)


def check_composed(cfg: DictConfig) -> None:
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} in a value, as Hydra does next
    checked_config(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), cfg.hydra)


def check_package(cfg: DictConfig) -> None:
    """--cfg's package (_global_: all of it): Hydra refuses a missing one in a line of its own,
    without `error:`, with exit status 1; one value is printed here."""
    args, _ = get_args_parser().parse_known_args(sys.argv[1:])
    if not args.cfg or args.package in (None, "_global_"):
        return
    absent = object()
    value = absent
    # --cfg job prints all but hydra; --cfg hydra, hydra alone; --cfg all, both
    in_hydra = args.package.split(".")[0] == "hydra"
    if args.cfg == "all" or in_hydra == (args.cfg == "hydra"):
        value = OmegaConf.select(cfg, args.package, default=absent)
    if value is absent:
        raise ConfigError(
            f"--package {args.package}: no such key in the config that --cfg {args.cfg} prints"
        )
    # One value, resolved in the whole config, written as in it (null, true): Hydra resolves it in
    # the part --cfg prints (hydra.run.dir's ${trainer_config.run_name} is outside --cfg hydra's)
    # and took null for a missing key.
    if not isinstance(value, Container):
        print(value_text(value))
        sys.exit(0)


def check_sweep(app: Hydra, cfg: DictConfig, overrides: list[str]) -> list[str]:
    """Each job of a sweep's `cfg` checked as the launcher composes it; the jobs' run
    directories."""
    # the sweeper's params (hydra.sweeper.params of a config file) before the command line's,
    # as BasicSweeper takes them
    params = [f"{key}={value}" for key, value in (cfg.hydra.sweeper.params or {}).items()]
    parsed = OverridesParser.create().parse_overrides([*params, *overrides])
    for override in parsed:
        # The sweep's directory (its multirun.yaml) is named by the run name before the
        # sweep: the default's, while each job would go to a directory of its own name.
        if override.key_or_group == "trainer_config.run_name" and override.is_sweep_override():
            raise ConfigError(
                f"{override.input_line}: a sweep's jobs share its run name "
                "(runs/<run_name>-multirun/N); give each name its own command"
            )
    # as typed: the sweeper gives each job its values written anew (3e-4 as 0.0003, true as True)
    check_text_overrides(overrides)
    # Each job as the launcher runs it, its number set (a value may name ${hydra:job.num}),
    # and in a run directory of its own: jobs sharing one would resume or refuse each other's.
    # without a batch size, all the jobs come in one batch
    jobs = BasicSweeper.split_arguments(parsed, None)[0]
    swept = {override.key_or_group for override in parsed if override.is_sweep_override()}
    # as its .hydra/overrides.yaml has them: Hydra's own (hydra.mode) apart
    ordered = [sorted(item for item in job if not item.startswith("hydra.")) for job in jobs]
    # where the sweeper writes the sweep's record (multirun.yaml), and the same command finds
    # its jobs again
    HydraConfig.instance().set_config(cfg)
    sweep_dir = os.path.normpath(str(cfg.hydra.sweep.dir))
    dirs: dict[str, int] = {}
    for num, job in enumerate(jobs):
        job_cfg = app.config_loader.load_sweep_config(cfg, job)
        with open_dict(job_cfg):
            job_cfg.hydra.job.num = num
        check_composed(job_cfg)
        paths = job_cfg.hydra.sweep
        # A preset that names its own run (experiment=ddp-tutorial,gpu-quick) moves its job
        # to runs/<its run_name>-multirun, away from the sweep's record and the other jobs.
        if os.path.normpath(str(paths.dir)) != sweep_dir:
            choices = [item for item in job if item.split("=", 1)[0].lstrip("+~") in swept]
            raise RunDirError(
                f"{' '.join(choices) or 'hydra.sweep.dir'}: job {num} of the sweep would go "
                f"to {os.path.join(str(paths.dir), str(paths.subdir))}, outside the sweep's "
                f"directory {sweep_dir}: a sweep's jobs share its run name; give them one, "
                "as in trainer_config.run_name=NAME"
            )
        where = os.path.normpath(os.path.join(str(paths.dir), str(paths.subdir)))
        if where in dirs:
            setting = OmegaConf.to_container(paths, resolve=False)["subdir"]
            raise RunDirError(
                f"hydra.sweep.subdir: {setting!r} puts jobs {dirs[where]} and {num} of the "
                f"sweep in one run directory, {where}: give each job its own, as "
                "'hydra.sweep.subdir=${hydra.job.num}' (the default) does"
            )
        dirs[where] = num
        # A sweep numbers its jobs in the order of its keys and values: given them in another
        # order, a job would find another job's run here and resume it with its own values (with
        # allow_config_change), or be refused after the jobs before it ran.
        ran = None
        with (
            contextlib.suppress(OSError, yaml.YAMLError),
            open(os.path.join(where, ".hydra", "overrides.yaml")) as f,
        ):
            ran = yaml.safe_load(f)
        if isinstance(ran, list) and sorted(map(str, ran)) in ordered[:num] + ordered[num + 1 :]:
            mine = [item for item in job if item not in ran and not item.startswith("hydra.")]
            theirs = [str(item) for item in ran if item not in job]
            raise RunDirError(
                f"job {num} of the sweep ({' '.join(mine)}) would go to "
                f"{where}, which holds the run of its job {' '.join(theirs)}: a sweep numbers its "
                "jobs in the order of its keys and values; give them in the order of the sweep "
                "that ran there, or start a new sweep with "
                f"{new_run_hint(job_cfg.trainer_config, where)}"
            )
    return list(dirs)


def compose_checked(
    self: Hydra,
    config_name: str | None,
    overrides: list[str],
    run_mode: RunMode,
    *args: Any,
    **kwargs: Any,
) -> DictConfig:
    """Hydra.compose_config while main runs: each config (each job of a sweep) is checked once
    composed, before Hydra creates a run directory (a refused config leaves none), and for --cfg,
    which runs no task."""
    cfg = COMPOSE(self, config_name, [*OWN_HYDRA, *overrides], run_mode, *args, **kwargs)
    # --hydra-help composes Hydra's own config alone: no run of ours to check. Hydra.get_mode's
    # probe (no validate_sweep_overrides) reads hydra.mode and drops any error, then run or multirun
    # composes again, checked there; checking the probe too cost each start 0.4 s.
    if config_name is None or not kwargs.get("validate_sweep_overrides", True):
        return cfg
    global _record, _earlier_sweep
    _record = None
    _earlier_sweep = None
    rundir.accepted = False
    _made.clear()
    sweep = run_mode == RunMode.MULTIRUN and cfg.hydra.sweeper._target_.endswith(".BasicSweeper")
    if not sweep:  # a sweep's jobs are checked each, below
        check_composed(cfg)
    check_package(cfg)
    if sweep:
        dirs = check_sweep(self, cfg, overrides)
        _made.extend(where for where in dirs if not os.path.exists(where))
        HydraConfig.instance().set_config(cfg)
    top = cfg.hydra.run.dir
    if run_mode == RunMode.MULTIRUN:
        top = cfg.hydra.sweep.dir
        _record = os.path.join(str(top), "multirun.yaml")
        with contextlib.suppress(OSError), open(_record, "rb") as f:
            _earlier_sweep = f.read()
    path = os.path.abspath(str(top))
    while not os.path.exists(path):
        _made.append(path)
        path = os.path.dirname(path)
    return cfg


def load_with_run_name(self: ConfigLoaderImpl, *args: Any, **kwargs: Any) -> DictConfig:
    """ConfigLoaderImpl.load_configuration while main runs (the command's config, and each job of
    a sweep as checked and as launched), with trainer_config.run_name's default where a config file
    of one's own leaves it out: its hydra.run.dir (hydra.sweep.dir) of mingpt's layout,
    runs/${trainer_config.run_name}, names the run directory by it, and the run takes that
    default."""
    cfg = LOAD(self, *args, **kwargs)
    if "trainer_config" not in cfg:
        with open_dict(cfg):
            cfg.trainer_config = {}
    trainer = cfg.trainer_config
    if isinstance(trainer, DictConfig) and "run_name" not in trainer:
        with open_dict(trainer):
            trainer.run_name = TrainerConfig.run_name
    return cfg


def refuse(message: str) -> NoReturn:
    """A refused task leaves no trace (take_back_run_dir)."""
    take_back_run_dir()
    fail(message)


def take_back_run_dir() -> None:
    """What a command not accepted made goes: the lock files of its run, while no job of a sweep
    was accepted the multirun.yaml its sweeper wrote (an earlier sweep's put back), and the
    directories Hydra made for it that are left empty. stopping.exit_at_once calls it at any time:
    a directory not made yet, or holding a run's files, stays."""
    # refuse's Claim.release did it already; exit_at_once skips it
    if rundir.held is not None:
        rundir.held.take_back()
    if _record is not None and not rundir.accepted:
        if _earlier_sweep is None:
            with contextlib.suppress(OSError):
                os.remove(_record)
        else:
            with atomic_open(_record) as f:
                f.write(_earlier_sweep)
    for path in _made:
        # not empty: a run's files, another job's lock; or gone with another rank's
        with contextlib.suppress(OSError):
            os.rmdir(path)


@hydra.main(config_path=CONF_PATH, config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    global _in_task
    _in_task = True
    try:
        hydra_cfg = HydraConfig.get()
        config, notices = checked_config(cfg, hydra_cfg)
        stopping.install(config.trainer_config.stop_signals)
        # Hydra's .hydra/ is off (written before any check); ours: the values used, vocab_size and
        # block_size as given
        given = {
            key: OmegaConf.select(cfg, f"gpt_config.{key}") for key in ("vocab_size", "block_size")
        }
        files = {
            ".hydra/config.yaml": lambda: OmegaConf.to_yaml(
                OmegaConf.merge(config, {"gpt_config": given})
            ),
            ".hydra/overrides.yaml": OmegaConf.to_yaml(list(hydra_cfg.overrides.task)),
        }
        run(config, hydra_cfg.runtime.output_dir, files, notices)
    except USER_ERRORS as e:
        refuse(str(e))
    except OmegaConfBaseException as e:  # an interpolation that cannot be resolved
        refuse(config_error_line(e))
    except stopping.Stopped as e:
        say_and_exit(str(e), e.status, every_rank=False)
    # Hydra would print "Error executing job with overrides: ..." on the way out
    except BaseException as e:
        stopping.park_if_exiting()
        if peer_ended(e):
            stopping.park_if_peer_ended()
            # No signal came (the worker that ended was on another node, whose torchrun alone saw
            # it): one line, not the collective's traceback.
            fail("another worker of this job ended, so this one cannot go on (its output says why)")
        raise
    _in_task = False  # an OSError from inside a task keeps its traceback: a bug


def group_null_hint(message: str) -> str:
    """Hydra's refusal of `GROUP=null` (a group's preset set to null), which names no group: the
    override it refused, and the one that drops a preset."""
    if not message.startswith("Config group override must be a string or a list"):
        return message
    for arg in sys.argv[1:]:
        group = arg.removesuffix("=null")
        if group != arg and "." not in group:
            return f"{arg}: a config group takes a preset's name; ~{group} drops the preset"
    return message


def take_local_rank_argument(argv: list[str]) -> list[str]:
    """Remove the `--local-rank=N` (`--local_rank=N`, `--local_rank N`) of the legacy launcher
    (`python -m torch.distributed.launch`); LOCAL_RANK stays the source of truth: the argument only
    fills it in when missing."""
    rest = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name not in ("--local-rank", "--local_rank"):
            rest.append(arg)
            continue
        value = value if eq else next(args, "")
        if not value.isdigit():
            fail(f"{name}: expects a local rank (a number >= 0), got {value!r}")
        env = os.environ.setdefault("LOCAL_RANK", value)
        if env != value:
            fail(
                f"--local-rank={value} contradicts LOCAL_RANK={env} from the launcher's environment"
            )
    return rest


def check_arguments(argv: list[str]) -> argparse.Namespace:
    """What Hydra's argparse would refuse with its usage banner, refused in one line; the options
    given."""
    parser = get_args_parser()
    parser.error = lambda message: fail(f"{message} (see --help)")  # type: ignore[method-assign]
    args, apart = parser.parse_known_args(argv)
    # Hydra ignores a package without --cfg, and the command went on to train
    if args.package and not args.cfg:
        fail(
            f"--package {args.package}: it picks the part of the config that --cfg prints: "
            "add --cfg job"
        )
    overrides = [arg for arg in apart if "=" in arg and not arg.startswith("-")]
    if overrides:
        fail(
            f"{' '.join(overrides)}: the key=value overrides go together, all before or all after "
            "the options (--config-dir, --config-name, --cfg, ...)"
        )
    if apart:
        fail(f"unrecognized arguments: {' '.join(apart)} (see --help)")
    return args


def main() -> None:
    global _in_task
    _in_task = False  # an earlier call in this process may have left its task by an exception
    freeze_startup_objects()
    sys.argv[1:] = take_local_rank_argument(sys.argv[1:])
    args = check_arguments(sys.argv[1:])
    # composition errors reach us, not Hydra's multi-line report
    os.environ["HYDRA_FULL_ERROR"] = "1"
    stopping.install()  # main.py did it already, before its imports
    # os._exit skips refuse's cleanup: a stop or a failed join before the run is accepted
    stopping.take_back = take_back_run_dir
    Hydra.compose_config = compose_checked  # type: ignore[method-assign]
    ConfigLoaderImpl.load_configuration = load_with_run_name  # type: ignore[method-assign]
    try:
        _hydra_main()
    except USER_ERRORS as e:  # a composed config refused (compose_checked)
        fail(str(e))
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        fail(config_error_line(e))
    except KeyboardInterrupt:
        say_and_exit("interrupted", 130)
    # Hydra's own refusals before any task: two modes (--cfg with -m), a group given null
    except ValueError as e:
        if _in_task:
            raise
        fail(group_null_hint(str(e)))
    except OSError as e:
        if _in_task:
            raise
        # Where Hydra only prints (--help, --hydra-help, --cfg, --info, --shell-completion), it
        # runs no task and creates no run directory: the OSError then is stdout's.
        if not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion):
            fail(f"cannot create the run directory: {e.filename or ''}: {e.strerror or e}")
        silence_stdout()  # the exit's flush would fail again
        if isinstance(e, BrokenPipeError):  # `--help | head`: its reader has what it wanted
            sys.exit(1)
        fail(f"cannot write to stdout: {e.strerror or e}")
    finally:
        Hydra.compose_config = COMPOSE  # type: ignore[method-assign]
        ConfigLoaderImpl.load_configuration = LOAD  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
