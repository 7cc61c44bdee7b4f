"""The training recipe: config -> data, model, trainer; train in the run directory.
The command line around it is mingpt/cli.py, the loop mingpt/trainer.py."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import traceback
from typing import Sequence

import torch

from mingpt import finetune
from mingpt.config import DEFAULT_DATA_PATH, Config, ConfigError, GPTConfig
from mingpt.data import CharData, build_cache, download_corpus, load_data
from mingpt.distributed import DistInfo, barrier, distributed, setup_logging
from mingpt.model import GPT
from mingpt.rundir import claim, hold_log_lines
from mingpt.snapshot.manager import is_sharded, resolve_path
from mingpt.storage import check_writable
from mingpt.trainer import Trainer

log = logging.getLogger(__name__)


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


def build(config: Config, dist_info: DistInfo, run_dir: str, data: CharData | None = None,
          start: finetune.Start | None = None) -> Trainer:
    """The recipe, config -> data, model, trainer, for a run in `run_dir` (also
    for the tests and benchmarks). The model's vocabulary and context length
    are set from the data; its initial weights are drawn from the run's seed.
    A fine-tuning run (trainer_config.init_from; `start`, if finetune.prepare was
    called already) takes both, and its first weights, from the snapshot."""
    start = finetune.prepare(config, run_dir) if start is None else start
    data = load_data(config.data_config) if data is None else data
    if start is not None:
        data = finetune.fit_data(data, start, config.data_config.path)
    config.gpt_config = fit_to_data(config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size)
    torch.manual_seed(config.trainer_config.seed)
    model = build_model(config.gpt_config)
    if start is not None and not start.resuming:
        finetune.load_weights(model, start)
    return Trainer(config, model, data, dist_info, run_dir)


def run(config: Config, run_dir: str, files: dict[str, str] | None = None,
        notices: Sequence[str] = ()) -> None:
    """Train in `run_dir`, in the process group torchrun describes (if any)."""
    with distributed(config.trainer_config.device) as dist_info:
        try:
            _run(config, run_dir, dist_info, files, notices)
        except BaseException as e:
            # What the run built (DDP's reducer holds the process group) is freed
            # here, while the group is whole, not in the interpreter's teardown.
            traceback.clear_frames(e.__traceback__)
            raise


def _run(config: Config, run_dir: str, dist_info: DistInfo, files: dict[str, str] | None,
         notices: Sequence[str]) -> None:
    """Everything that can refuse the run (the corpus, the directory's owner,
    the snapshot's compatibility) comes before the first write in `run_dir`;
    then train.log and `files` ({path in run_dir: text}) are written."""
    setup_logging(dist_info.rank)
    log_buffer = hold_log_lines(dist_info.rank)
    for notice in notices if dist_info.is_main_process else ():
        log.warning(notice)
    snapshot_path = resolve_path(config.trainer_config, run_dir)
    check_writable(run_dir, snapshot_path, directory=is_sharded(config.trainer_config))
    log.info("run directory %s", os.path.abspath(run_dir))
    start = finetune.prepare(config, run_dir)  # the model's shape (and the windows' length) from init_from
    data_path = config.data_config.path
    if dist_info.is_local_main_process:  # once per node; the others wait
        if data_path == DEFAULT_DATA_PATH and not os.path.exists(data_path):
            download_corpus(data_path)
        build_cache(config.data_config)  # encode the corpus unless its token cache is up to date
    barrier(dist_info)
    data = load_data(config.data_config, build=False)
    with claim(run_dir, snapshot_path, dist_info, log_buffer) as owned:
        trainer = build(config, dist_info, run_dir, data, start)  # refuses a snapshot that does not fit
        owned.accept(files)
        trainer.train()
