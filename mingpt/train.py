"""The training recipe: compose the configs, build data, model and trainer, train.

`python main.py` and the `mingpt-train` console script both run `main` here.
Any problem with the input (config, data, snapshot) ends the run with one line
on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import NoReturn

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt.checkpoint import SnapshotError
from mingpt.config import DEFAULT_DATA_PATH, Config, ConfigError, GPTConfig, check_known_keys, register_configs
from mingpt.data import DataError, download_corpus, load_data
from mingpt.distributed import barrier, distributed, setup_logging
from mingpt.model import GPT
from mingpt.rundir import RunDirError, check_run_dir_setting, claim, hold_log_lines, register_resolvers
from mingpt.trainer import Trainer, TrainingError, resolve_snapshot_path

log = logging.getLogger(__name__)

# conf/ of the clone; a non-editable install carries the same files as the package mingpt.conf.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
CONF_PATH = CONF_DIR if os.path.isdir(CONF_DIR) else "pkg://mingpt.conf"
USER_ERRORS = (ConfigError, DataError, SnapshotError, TrainingError, RunDirError)


def fit_to_data(gpt_config: GPTConfig, vocab_size: int, block_size: int) -> GPTConfig:
    """The model's vocabulary and context length come from the data."""
    for key, value in (("vocab_size", vocab_size), ("block_size", block_size)):
        given = getattr(gpt_config, key)
        if given is not None and given != value:
            raise ConfigError(f"gpt_config.{key}: {given} given, but the data sets it to {value}; leave it unset")
    return dataclasses.replace(gpt_config, vocab_size=vocab_size, block_size=block_size)


def run(config: Config, run_dir: str, files: dict[str, str] | None = None) -> None:
    """Train in `run_dir`. Everything that can refuse the run (the corpus, the
    directory's owner, the snapshot's compatibility) comes before the first
    write there; then train.log and `files` ({path in run_dir: text}) are written."""
    with distributed(config.trainer_config.device) as dist_info:
        setup_logging(dist_info.rank)
        log_buffer = hold_log_lines(dist_info.rank)
        log.info("run directory %s", os.path.abspath(run_dir))
        data_path = config.data_config.path
        if data_path == DEFAULT_DATA_PATH and not os.path.exists(data_path):
            if dist_info.is_local_main_process:  # once per node; the others wait
                download_corpus(data_path)
            barrier(dist_info)
        data = load_data(config.data_config)
        config.gpt_config = fit_to_data(config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size)
        torch.manual_seed(config.trainer_config.seed)
        model = GPT(config.gpt_config)
        snapshot_path = resolve_snapshot_path(config.trainer_config.snapshot_path, run_dir)
        with claim(run_dir, snapshot_path, dist_info, log_buffer) as owned:
            trainer = Trainer(config, model, data, dist_info, run_dir)  # refuses a snapshot that does not fit
            owned.accept(files)
            trainer.train()


def fail(message: str, status: int = 2) -> NoReturn:
    """End the process with one line on stderr (one write, so ranks' lines do not interleave)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(status)


def config_error_line(error: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error: the key and the problem."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and cause.full_key and cause.msg:
            return f"{cause.full_key}: {cause.msg.splitlines()[0]}"
        cause = cause.__cause__
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    options = getattr(error, "options", None)
    return f"{line} (choices: {', '.join(options)})" if options else line


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
        check_known_keys(cfg)
        config = OmegaConf.to_object(cfg)
        # Hydra's own .hydra/ is off (conf/config.yaml): it would be written before any check.
        files = {".hydra/config.yaml": OmegaConf.to_yaml(cfg),
                 ".hydra/overrides.yaml": OmegaConf.to_yaml(list(hydra_cfg.overrides.task))}
        run(config, hydra_cfg.runtime.output_dir, files)
    except USER_ERRORS as e:
        fail(str(e))
    _in_task = False  # an OSError from inside a task keeps its traceback: a bug


def main() -> None:
    """Entry point of `python main.py` and `mingpt-train`."""
    # Let composition errors reach us instead of Hydra's multi-line report;
    # any other exception is a bug and keeps its full traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
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
