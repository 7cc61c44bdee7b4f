"""One training run, from start-up to its closing line: the run directory settled (writable, the
snapshot root, the fine-tuning source, the corpus, its one owner), then config -> data, model and
trainer; train; the sample and the closing line."""

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import traceback
from collections.abc import Iterator, Sequence

import torch

from mingpt import finetune, flops
from mingpt.command import OutputError, silence_stdout, typed, write
from mingpt.config import DEFAULT_DATA_PATH, Config, ConfigError, GPTConfig
from mingpt.data import CharData, DataError, build_cache, download_corpus, load_data
from mingpt.distributed import (
    SAME_ON_EVERY_RANK,
    DistInfo,
    all_gather,
    distributed,
    setup_logging,
)
from mingpt.model import GPT, parameter_count
from mingpt.rundir import (
    Claim,
    claim,
    hold_log_lines,
    new_run_hint,
    other_directory_hint,
    shell_override,
    shown,
)
from mingpt.snapshot import compat, reader, single_file
from mingpt.snapshot.sharded import read_meta
from mingpt.storage import check_writable
from mingpt.trainer import Trainer

log = logging.getLogger(__name__)


def fit_to_data(gpt_config: GPTConfig, vocab_size: int, block_size: int) -> GPTConfig:
    fitted = {"vocab_size": vocab_size, "block_size": block_size}
    for key, value in fitted.items():
        given = getattr(gpt_config, key)
        if given is not None and given != value:
            raise ConfigError(
                f"gpt_config.{key}: {given} given, but the data sets it to {value}; leave it unset"
            )
    return dataclasses.replace(gpt_config, **fitted)


def build_model(gpt_config: GPTConfig) -> GPT:
    """The model, or ConfigError with its size when its weights do not fit in memory: more than the
    host has available (an allocation that the kernel grants beyond it ends in its OOM killer, with
    no message), or an allocation that fails."""
    try:
        params = parameter_count(gpt_config)
    # A weight of 2**63 bytes or more, which torch cannot even count: its size overflows (a
    # TypeError past 64 bits), which was a traceback.
    except (RuntimeError, TypeError) as e:
        if "overflow" not in str(e).lower():
            raise
        raise ConfigError(
            f"gpt_config: the model does not fit in memory: gpt_config.n_embd={gpt_config.n_embd} "
            "makes a weight of 2**63 bytes or more"
        ) from None
    too_large = (
        f"gpt_config: the model does not fit in memory: {params:,} parameters "
        f"({params * 4 / 1e9:,.1f} GB of float32 weights, about 4x that to train with AdamW)"
    )
    available = flops.available_memory(torch.device("cpu"))  # it is built on the host
    if params * 4 > available:
        raise ConfigError(f"{too_large}; {available / 1e9:,.1f} GB available")
    try:
        return GPT(gpt_config)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        # CPU and CUDA wordings
        asked = re.search(r"allocate ([\d.]+ ?[KMGT]?i?B|\d+ bytes)", str(e))
        if not isinstance(e, MemoryError) and not re.search(
            r"can't allocate memory|out of memory", str(e)
        ):
            raise
        raise ConfigError(
            f"{too_large}; allocating {asked.group(1) if asked else 'them'} failed"
        ) from None


@dataclasses.dataclass(frozen=True)
class Run:  # what start-up settled
    dir: str
    snapshot_path: str
    step: int  # the step its newest snapshot reached (0: none yet)
    start: finetune.Start | None  # the fine-tuning source


def locate(config: Config, run_dir: str) -> Run:
    """What the run starts from; a fine-tuning source gives `config` the model's shape."""
    snapshot_path = reader.resolve_path(config.trainer_config.snapshot_path, run_dir)
    saved = None
    step = 0
    if reader.has_snapshot(snapshot_path):
        # The root, not the newest just listed: before this run's lock, a job that holds the run
        # directory may rotate that one away meanwhile, and the root's read takes the next.
        saved = read_meta(snapshot_path)
        # Its fields are used before the weights are read: one of another type would fail there
        # as a traceback.
        single_file.check_record(saved, snapshot_path)
        step = saved["step"]
    return Run(
        run_dir, snapshot_path, step, finetune.prepare(config, run_dir, snapshot_path, saved)
    )


@contextlib.contextmanager
def settle(
    config: Config, run_dir: str, dist_info: DistInfo, log_buffer: logging.Handler
) -> Iterator[tuple[Run, Claim]]:
    """Start-up, in order, before anything is written in the run directory: the run directory
    (writable), the snapshot location, the fine-tuning source, the corpus (downloaded and encoded
    once per node), the directory's owner (a lock, for the body's duration) and its record (not
    another run's)."""
    snapshot_path = reader.resolve_path(config.trainer_config.snapshot_path, run_dir)
    compat.check_not_a_file(config.trainer_config.snapshot_path, run_dir, snapshot_path)
    compat.check_not_a_run_directory(snapshot_path, run_dir)
    check_writable(run_dir, snapshot_path)
    compat.check_seen_by_all(dist_info, snapshot_path)
    compat.check_not_a_snapshot(snapshot_path)
    log.info("run directory %s", os.path.abspath(run_dir))
    run = locate(config, run_dir)
    # The corpus is downloaded and encoded once per node; the other processes wait, and stop with
    # its error: left waiting in a collective, they would end in a stack trace instead.
    failed = None
    if dist_info.is_local_main_process:
        try:
            path = config.data_config.path
            # however spelled: the tutorial's config file names it ./data/input.txt
            default = isinstance(path, str) and os.path.normpath(path) == DEFAULT_DATA_PATH
            if default and not os.path.exists(path):
                download_corpus(path)
            build_cache(config.data_config)
        except DataError as e:
            failed = e
    errors = [e for e in all_gather(dist_info, failed) if e is not None]
    if errors:
        raise errors[0]
    other = other_directory_hint(config.trainer_config, run.dir)
    with claim(run.dir, run.snapshot_path, run.step, dist_info, log_buffer, other) as owned:
        yield run, owned


# What each node may set for itself: its own copy of the corpus (compared by its contents) or of
# the fine-tuning source, its own cache, device and batch placement, and its own spelling of the
# snapshot path (which every rank must see: compat.check_seen_by_all).
PER_NODE_KEYS = (
    "data_config.path",
    "data_config.cache_dir",
    "data_config.placement",
    "trainer_config.init_from",
    "trainer_config.device",
    "trainer_config.snapshot_path",
)


def check_same_on_every_rank(config: Config, dist_info: DistInfo) -> None:
    """Every rank runs with rank 0's values, but for PER_NODE_KEYS. Each node is started with its
    own command: one with another learning rate, model or batch trained its replica with it,
    averaged into the others' gradients, silently; one that saved, evaluated or logged at other
    steps met the others in another collective, and gloo aborted the job."""
    sections = dataclasses.asdict(config)
    items = {
        f"{name}.{key}": value
        for name, section in sections.items()
        for key, value in section.items()
        if f"{name}.{key}" not in PER_NODE_KEYS
    }
    mine = json.loads(json.dumps(items, default=str))  # a tuple and a list compare equal
    configs = all_gather(dist_info, mine)
    for rank, other in enumerate(configs):
        changes = {
            key: (configs[0].get(key), other.get(key))
            for key in sorted(configs[0].keys() | other.keys())
            if configs[0].get(key) != other.get(key)
        }
        if changes:
            raise ConfigError(
                f"rank {rank} runs with another config than rank 0 "
                f"({'; '.join(compat.described(changes))}): start every node with the same command"
            )


def build(
    config: Config, dist_info: DistInfo, run: Run | str, data: CharData | None = None
) -> Trainer:
    """config -> data, model, trainer for `run` (or a run directory: the tests and benchmarks); the
    initial weights are drawn from the run's seed, or a fine-tuning run's taken from its source."""
    if isinstance(run, str):
        run = locate(config, run)
    if data is None:
        data = load_data(config.data_config)
    check_same_on_every_rank(config, dist_info)
    # Each node encodes its own copy of the corpus: one that differs would train the nodes on
    # different texts, silently where the vocabularies agree.
    corpora = all_gather(dist_info, data.fingerprint())
    for rank, corpus in enumerate(corpora):
        changes = compat.corpus_changes(corpora[0], corpus)
        if changes:
            raise DataError(
                f"rank {rank} reads another corpus than rank 0 ({'; '.join(changes)}): every node "
                "needs the same copy of data_config.path"
            )
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
    cfg = t.cfg
    W = t.dist.world_size
    global_batch = t.samples_per_step * W
    n_train = len(t.data.train)
    amp = ""
    if t.amp.enabled:
        amp = f" amp {cfg.amp_dtype}"
    fsdp = ""
    if t.fsdp:
        fsdp = f" | fsdp: 1/{W} of the model on each rank"
    log.info(
        "model %.2fM parameters | %d training windows, %d held-out | global batch %d (%d per "
        "rank x %d accum x %d ranks) | %d steps per epoch, %d in all | device %s%s%s",
        t.raw_model.num_params() / 1e6,
        n_train,
        len(t.data.heldout),
        global_batch,
        cfg.batch_size,
        cfg.grad_accum_steps,
        W,
        t.plan.steps_per_epoch,
        t.total_steps,
        t.device,
        amp,
        fsdp,
    )
    if global_batch > n_train:
        log.warning(
            "the global batch (%d) is larger than the %d training windows: each step takes the "
            "epoch's windows, %d",
            global_batch,
            n_train,
            n_train,
            extra=SAME_ON_EVERY_RANK,
        )
    block = t.train_windows.block_size
    stride = t.data.train.stride
    if stride > block:
        log.warning(
            "data_config.stride (%d) is larger than data_config.block_size (%d): the %d characters "
            "between one training window's targets and the next's are never predicted, about %d%% "
            "of the training text (data_config.stride=%d or less trains on all of it)",
            stride,
            block,
            stride - block,
            100 * (stride - block) // stride,
            block,
            extra=SAME_ON_EVERY_RANK,
        )
    if t.device.type != "cpu" or not t.dist.is_main_process or t.finished():
        return
    # A step takes at most an epoch's share of the windows.
    samples = min(t.samples_per_step, math.ceil(n_train / W))
    step_flops = t.pace.flops_per_token * samples * t.train_windows.block_size
    warning = flops.slow_on_cpu(step_flops, t.total_steps - t.state.step)
    if warning:
        log.warning(warning)


def train(trainer: Trainer) -> None:
    """Train the run to its end and print a sample, or say that it is complete (no sample: it would
    be the one its end printed, from the same weights and seed); then the closing line."""
    if trainer.finished():
        log.info("%s", already_complete(trainer))
        log.info("%s", summary(trainer, trainer.state.last_eval_loss))
        return
    final = trainer.train()
    sample = trainer.sample_for_all()
    if sample is not None:
        try:
            write(f"--- sample after step {trainer.state.step} ---\n{sample}\n")
        except BrokenPipeError:  # `| head`: its reader has what it wanted
            silence_stdout()
        except OutputError as e:  # `>/dev/full`: the run is saved; its sample alone is lost
            log.warning("%s: the sample is not shown", e)
    log.info("%s", summary(trainer, final))


def summary(t: Trainer, final: float | None) -> str:
    """The closing line: the losses, the snapshot, and the command that samples from the best
    weights (else from the snapshot)."""
    state = t.state
    losses = []
    if final is not None and math.isfinite(final):
        losses.append(f"held-out loss {final:.4f}")
    best = None
    if math.isfinite(state.best_eval_loss):
        best = reader.find_best(t.snapshot_path)
        where = ""
        if best:
            where = f" ({shown(best)})"
        losses.append(f"best {state.best_eval_loss:.4f} at step {state.best_step}{where}")
    stopped = ""
    if t.evaluator.stopped_early(state):
        stopped = " (stopped early)"
    source = "the best" if best else "it"
    sampled = shell_override("snapshot_path", shown(best or t.snapshot_path), verbatim=True)
    command = f"{typed('generate')} {sampled}"
    return (
        f"done at step {state.step}{stopped}: {', '.join(losses) or 'no held-out loss'} | snapshot "
        f"{shown(t.snapshot_path)} | sample from {source}: {command}"
    )


def already_complete(t: Trainer) -> str:
    """What to type instead, when a command finds its run complete (whatever the number of
    processes): the same command with more steps continues this run, in this directory."""
    cfg = t.cfg
    state = t.state
    stopped = ""
    further = []
    if t.evaluator.stopped_early(state):
        further.append("trainer_config.early_stop_patience=null")
        stopped = (
            f", stopped early (best held-out loss {state.best_eval_loss:.4f} at step "
            f"{state.best_step})"
        )
    elif cfg.max_steps is not None and state.step >= cfg.max_steps:
        # from the step reached, at or past max_steps: where this command lowered max_steps below
        # it, twice the lower limit could be no more steps at all
        steps = 2 * state.step
        further.append(f"trainer_config.max_steps={steps}")
        # and the epochs those steps take, where max_epochs would stop them sooner
        epochs = math.ceil(steps / t.plan.steps_per_epoch)
        if epochs > cfg.max_epochs:
            further.append(f"trainer_config.max_epochs={epochs}")
    else:
        further.append(f"trainer_config.max_epochs={state.epoch + 1}")
    return (
        f"run already complete at step {state.step}{stopped} (snapshot {shown(t.snapshot_path)}), "
        f"whatever the number of processes: nothing to train. For a new run add "
        f"{new_run_hint(cfg, t.run_dir)}; to train this one further add {' '.join(further)} "
        "trainer_config.allow_config_change=true"
    )


def run(config: Config, run_dir: str, files: dict[str, str], notices: Sequence[str]) -> None:
    """Train in `run_dir`, in the process group torchrun describes (if any). Everything that can
    refuse the run comes before the first write in `run_dir`; then train.log and `files` ({path in
    run_dir: text}) are written."""
    with distributed(config.trainer_config.device) as dist_info:
        setup_logging(dist_info.rank)
        log_buffer = hold_log_lines(dist_info.rank)
        try:
            if dist_info.is_main_process:
                for notice in notices:
                    log.warning(notice)
            with settle(config, run_dir, dist_info, log_buffer) as (run, owned):
                trainer = build(config, dist_info, run, load_data(config.data_config, build=False))
                owned.accept(files)
                train(trainer)
        except BaseException as e:
            # What the run built (DDP's reducer holds the process group) is freed here, while the
            # group is whole.
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            # refused before its claim took them (Claim.release): the held lines go
            logging.getLogger().removeHandler(log_buffer)
