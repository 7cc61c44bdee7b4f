"""The training recipe: start-up, config -> data, model, trainer; train in the run directory, close with one line."""

import contextlib
import dataclasses
import logging
import math
import os
import re
import shlex
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mingpt import finetune, flops
from mingpt.config import DEFAULT_DATA_PATH, Config, ConfigError, GPTConfig
from mingpt.data import CharData, build_cache, download_corpus, load_data
from mingpt.distributed import DistInfo, barrier, distributed, setup_logging
from mingpt.model import GPT
from mingpt.rundir import Claim, check_record, claim, hold_log_lines
from mingpt.snapshot.manager import check_not_old, find_best, has_snapshot, resolve_path
from mingpt.snapshot.sharded import read_meta
from mingpt.storage import check_writable
from mingpt.trainer import Trainer

log = logging.getLogger(__name__)


def fit_to_data(gpt_config: GPTConfig, vocab_size: int, block_size: int) -> GPTConfig:
    for key, value in (("vocab_size", vocab_size), ("block_size", block_size)):
        given = getattr(gpt_config, key)
        if given is not None and given != value:
            raise ConfigError(
                f"gpt_config.{key}: {given} given, but the data sets it to {value}; leave it unset"
            )
    return dataclasses.replace(gpt_config, vocab_size=vocab_size, block_size=block_size)


def build_model(gpt_config: GPTConfig) -> GPT:
    """The model, or ConfigError with its size when its weights do not fit in memory."""
    try:
        return GPT(gpt_config)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        # CPU and CUDA wordings
        asked = re.search(r"allocate ([\d.]+ ?[KMGT]?i?B|\d+ bytes)", str(e))
        if not isinstance(e, MemoryError) and not re.search(
            r"can't allocate memory|out of memory", str(e)
        ):
            raise
        d, v, b = gpt_config.n_embd, gpt_config.vocab_size, gpt_config.block_size
        params = gpt_config.n_layer * (12 * d * d + 13 * d) + 2 * v * d + b * d + 2 * d
        raise ConfigError(
            f"gpt_config: the model does not fit in memory: {params:,} parameters "
            f"({params * 4 / 1e9:,.0f} GB of float32 weights, about 4x that to train with AdamW); "
            f"allocating {asked.group(1) if asked else 'them'} failed"
        ) from None


@dataclasses.dataclass(frozen=True)
class Run:  # what start-up settled
    dir: str
    snapshot_path: str
    saved: dict[str, Any] | None  # what its newest snapshot holds besides tensors (None: none yet)
    start: finetune.Start | None  # the fine-tuning source


def locate(config: Config, run_dir: str, snapshot_path: str | None = None) -> Run:
    """The fine-tuning source gives `config` the model's shape."""
    snapshot_path = snapshot_path or resolve_path(config.trainer_config, run_dir)
    saved = read_meta(snapshot_path) if has_snapshot(snapshot_path) else None
    return Run(run_dir, snapshot_path, saved, finetune.prepare(config, snapshot_path, saved))


@contextlib.contextmanager
def settle(
    config: Config, run_dir: str, dist_info: DistInfo, log_buffer: logging.Handler
) -> Iterator[tuple[Run, Claim]]:
    """Start-up, in order, before anything is written in the run directory: the run directory (writable), the
    snapshot location, the fine-tuning source, the corpus (downloaded and encoded once per node), the directory's
    owner (a lock, for the body's duration) and its record (not another run's)."""
    snapshot_path = resolve_path(config.trainer_config, run_dir)
    check_not_old(config.trainer_config, run_dir, snapshot_path)
    check_writable(run_dir, snapshot_path)
    log.info("run directory %s", os.path.abspath(run_dir))
    run = locate(config, run_dir, snapshot_path)
    if dist_info.is_local_main_process:  # once per node; the others wait
        if config.data_config.path == DEFAULT_DATA_PATH and not os.path.exists(DEFAULT_DATA_PATH):
            download_corpus(DEFAULT_DATA_PATH)
        build_cache(config.data_config)
    barrier(dist_info)
    with claim(run.dir, run.snapshot_path, dist_info, log_buffer) as owned:
        check_record(run.dir, run.snapshot_path, run.saved["step"] if run.saved else 0, dist_info)
        yield run, owned


def build(
    config: Config, dist_info: DistInfo, run: Run | str, data: CharData | None = None
) -> Trainer:
    """config -> data, model, trainer for `run` (or a run directory: the tests and benchmarks); the initial
    weights are drawn from the run's seed, or a fine-tuning run's taken from its source."""
    run = locate(config, run) if isinstance(run, str) else run
    data = load_data(config.data_config) if data is None else data
    if run.start is not None:
        data = finetune.fit_data(data, run.start, config.data_config.path)
    config.gpt_config = fit_to_data(
        config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size
    )
    torch.manual_seed(config.trainer_config.seed)
    model = build_model(config.gpt_config)
    if run.start is not None and not run.start.resuming:
        finetune.load_weights(model, run.start)
    trainer = Trainer(config, model, data, dist_info, run.dir, run.snapshot_path)
    announce(trainer)
    return trainer


def announce(t: Trainer) -> None:
    """The run's size in one line; on a CPU, how long a run sized for a GPU would take."""
    cfg, W, plan = t.cfg, t.dist.world_size, t.plan
    log.info(
        "model %.2fM parameters | %d training windows, %d held-out | global batch %d (%d per rank x %d accum x "
        "%d ranks) | %d steps per epoch, %d in all | device %s%s%s",
        t.raw_model.num_params() / 1e6,
        len(t.data.train),
        len(t.data.heldout),
        t.samples_per_step * W,
        cfg.batch_size,
        cfg.grad_accum_steps,
        W,
        plan.steps_per_epoch,
        t.total_steps,
        t.device,
        f" amp {cfg.amp_dtype}" if t.amp.enabled else "",
        f" | fsdp: 1/{W} of the model on each rank" if t.fsdp else "",
    )
    if t.device.type == "cpu" and t.dist.is_main_process and not t.finished():
        # a step takes at most an epoch's share
        samples = min(t.samples_per_step, math.ceil(len(t.data.train) / W))
        warning = flops.slow_on_cpu(
            t.pace.flops_per_token * samples * t.train_windows.block_size,
            t.total_steps - t.progress.step,
        )
        if warning:
            log.warning(warning)


def train(trainer: Trainer) -> None:
    if trainer.finished():
        log.info("%s", already_complete(trainer))
    final = None if trainer.finished() else trainer.train()
    trainer.print_sample()
    log.info("%s", summary(trainer, final))


def shown(path: str) -> str:
    """`path` as typed from the directory the run started in, where it is inside."""
    return (
        path if "://" in path or os.path.relpath(path).startswith("..") else os.path.relpath(path)
    )


def summary(t: Trainer, final: float | None) -> str:
    """The closing line: losses, snapshot, and the command that samples from the best weights (else the snapshot)."""
    p = t.progress
    losses = [f"held-out loss {final:.4f}"] if final is not None and math.isfinite(final) else []
    best = find_best(t.snapshot_path) if math.isfinite(p.best_eval_loss) else None
    if math.isfinite(p.best_eval_loss):
        losses.append(
            f"best {p.best_eval_loss:.4f} at step {p.best_step}"
            + (f" ({shown(best)})" if best else "")
        )
    stopped = " (stopped early)" if t.evaluator.stopped_early() else ""
    return (
        f"done at step {p.step}{stopped}: {', '.join(losses) or 'no held-out loss'} | snapshot "
        f"{shown(t.snapshot_path)} | sample from {'the best' if best else 'it'}: "
        f"python -m mingpt.generate snapshot_path={shlex.quote(shown(best or t.snapshot_path))}"
    )


def already_complete(t: Trainer) -> str:
    """What to type instead, when a command finds its run complete (whatever the number of processes)."""
    cfg, p, early = t.cfg, t.progress, t.evaluator.stopped_early()
    if early:
        further = "trainer_config.early_stop_patience=null"
    elif cfg.max_steps is not None and p.step >= cfg.max_steps:
        further = f"trainer_config.max_steps={2 * cfg.max_steps}"
    else:
        further = f"trainer_config.max_epochs={p.epoch + 1}"
    # hydra.run.dir=PATH names the directory itself: there a new run needs another path.
    named = os.path.basename(os.path.normpath(t.run_dir)).startswith(cfg.run_name)
    new = (
        "trainer_config.run_name=NAME (a name not used yet)"
        if named
        else "hydra.run.dir=ANOTHER_DIRECTORY"
    )
    stopped = (
        f", stopped early (best held-out loss {p.best_eval_loss:.4f} at step {p.best_step})"
        if early
        else ""
    )
    return (
        f"run already complete at step {p.step}{stopped} (snapshot {shown(t.snapshot_path)}), whatever the "
        f"number of processes: nothing to train. For a new run add {new}; "
        f"to train this one further add {further} trainer_config.allow_config_change=true"
    )


def run(
    config: Config, run_dir: str, files: dict[str, str] | None = None, notices: Sequence[str] = ()
) -> None:
    """Train in `run_dir`, in the process group torchrun describes (if any). Everything that can refuse the run
    comes before the first write in `run_dir`; then train.log and `files` ({path in run_dir: text}) are written."""
    with distributed(config.trainer_config.device) as dist_info:
        try:
            setup_logging(dist_info.rank)
            log_buffer = hold_log_lines(dist_info.rank)
            for notice in notices if dist_info.is_main_process else ():
                log.warning(notice)
            with settle(config, run_dir, dist_info, log_buffer) as (run, owned):
                trainer = build(config, dist_info, run, load_data(config.data_config, build=False))
                owned.accept(files)
                train(trainer)
        except BaseException as e:
            # What the run built (DDP's reducer holds the process group) is freed here, while the group is whole.
            traceback.clear_frames(e.__traceback__)
            raise
