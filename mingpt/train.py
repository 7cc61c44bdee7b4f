"""The training recipe: compose the configs, build data, model and trainer, train.

`python main.py` and the `mingpt-train` console script both run `main` here.
Any problem with the input (config, data, snapshot) ends the run with one line
on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from typing import NoReturn

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt.checkpoint import SnapshotError, check_writable
from mingpt.config import DEFAULT_DATA_PATH, Config, ConfigError, GPTConfig, check_known_keys, register_configs
from mingpt.data import DataError, download_corpus, load_data
from mingpt.distributed import barrier, distributed, setup_logging
from mingpt.model import GPT
from mingpt.trainer import Trainer, TrainingError, resolve_snapshot_path

log = logging.getLogger(__name__)

# conf/ of the clone; a non-editable install carries the same files as the package mingpt.conf.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
CONF_PATH = CONF_DIR if os.path.isdir(CONF_DIR) else "pkg://mingpt.conf"
USER_ERRORS = (ConfigError, DataError, SnapshotError, TrainingError)


def fit_to_data(gpt_config: GPTConfig, vocab_size: int, block_size: int) -> GPTConfig:
    """The model's vocabulary and context length come from the data."""
    for key, value in (("vocab_size", vocab_size), ("block_size", block_size)):
        given = getattr(gpt_config, key)
        if given is not None and given != value:
            raise ConfigError(f"gpt_config.{key}: {given} given, but the data sets it to {value}; leave it unset")
    return dataclasses.replace(gpt_config, vocab_size=vocab_size, block_size=block_size)


def build_model(gpt_config: GPTConfig) -> GPT:
    """The model, or ConfigError with its size when its weights do not fit in memory."""
    try:
        return GPT(gpt_config)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        asked = re.search(r"allocate ([\d.]+ ?[KMGT]?i?B|\d+ bytes)", str(e))  # CPU and CUDA wordings
        if not isinstance(e, MemoryError) and not re.search(r"can't allocate memory|out of memory", str(e)):
            raise
        d, v, b = gpt_config.n_embd, gpt_config.vocab_size, gpt_config.block_size
        params = gpt_config.n_layer * (12 * d * d + 13 * d) + 2 * v * d + b * d + 2 * d
        raise ConfigError(
            f"gpt_config: the model does not fit in memory: {params:,} parameters "
            f"({params * 4 / 1e9:,.0f} GB of float32 weights, about 4x that to train with AdamW); "
            f"allocating {asked.group(1) if asked else 'them'} failed"
        ) from None


def run(config: Config, run_dir: str) -> None:
    with distributed(config.trainer_config.device) as dist_info:
        check_writable(run_dir, resolve_snapshot_path(config.trainer_config.snapshot_path, run_dir))
        setup_logging(dist_info.rank, os.path.join(run_dir, "train.log"))
        log.info("run directory %s", os.path.abspath(run_dir))
        data_path = config.data_config.path
        if data_path == DEFAULT_DATA_PATH and not os.path.exists(data_path):
            if dist_info.is_local_main_process:  # once per node; the others wait
                download_corpus(data_path)
            barrier(dist_info)
        data = load_data(config.data_config)
        config.gpt_config = fit_to_data(config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size)
        torch.manual_seed(config.trainer_config.seed)
        model = build_model(config.gpt_config)
        Trainer(config, model, data, dist_info, run_dir).train()


def fail(message: str, status: int = 2) -> NoReturn:
    """End the process with one line on stderr (one write, so ranks' lines do not interleave)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
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


@hydra.main(config_path=CONF_PATH, config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    try:
        check_group_overrides(OmegaConf.to_container(HydraConfig.get().overrides.task))  # unresolved
        check_known_keys(cfg)
        config = OmegaConf.to_object(cfg)
        run(config, HydraConfig.get().runtime.output_dir)
    except USER_ERRORS as e:
        fail(str(e))
    except OmegaConfBaseException as e:  # an interpolation that cannot be resolved
        fail(config_error_line(e))


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
