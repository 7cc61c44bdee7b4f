"""Configuration: the dataclasses are the one source of defaults and types.

Hydra composes them (registered in its ConfigStore below) with the YAML files in
``conf/``, which only override. OmegaConf rejects unknown keys and wrong types
while composing; ``__post_init__`` rejects bad values when the composed config
is turned into these objects (``OmegaConf.to_object``), before any work starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import ListConfig

from mingpt.stopping import DEFAULT_SIGNALS as DEFAULT_STOP_SIGNALS
from mingpt.stopping import parse_signal


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


def check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}")


def check_seed(value: int, key: str) -> None:
    """torch takes seeds of 64 bits; the runs add the step or epoch to it."""
    check(0 <= value < 2**63, key, f"must be in [0, 2**63), got {value}")


def one_of(value: str, key: str, choices: tuple[str, ...]) -> None:
    check(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def operational(**kwargs: Any) -> Any:
    """A field that changes how a run is carried out, logged or saved, never what it computes."""
    return field(metadata={"operational": True}, **kwargs)


@dataclass
class GPTConfig:
    """Model shape. The defaults are the CPU default run (measured, see BENCHMARKS.md)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # Filled in from the data (vocabulary size, data_config.block_size); leave unset.
    vocab_size: Optional[int] = None
    block_size: Optional[int] = None

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_head", "n_embd"):
            check(getattr(self, key) >= 1, f"gpt_config.{key}", f"must be >= 1, got {getattr(self, key)}")
        check(
            self.n_embd % self.n_head == 0,
            "gpt_config.n_embd",
            f"{self.n_embd} is not divisible by gpt_config.n_head={self.n_head}",
        )
        check(0.0 <= self.dropout < 1.0, "gpt_config.dropout", f"must be in [0, 1), got {self.dropout}")
        for key in ("vocab_size", "block_size"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"gpt_config.{key}", f"must be >= 1, got {value}")


@dataclass
class OptimizerConfig:
    """AdamW with decoupled weight decay and a warmup + cosine learning-rate schedule."""

    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    # "cosine": linear warmup, then cosine decay to min_lr_ratio * learning_rate
    # over the whole run. "constant": linear warmup, then constant.
    lr_schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        check(
            math.isfinite(self.learning_rate) and self.learning_rate > 0,
            "optimizer_config.learning_rate",
            f"must be > 0, got {self.learning_rate}",
        )
        check(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "optimizer_config.weight_decay", f"must be a finite number >= 0, got {self.weight_decay}",
        )
        check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "optimizer_config.betas",
            f"must be two numbers in [0, 1), got {list(self.betas)}",
        )
        check(math.isfinite(self.eps) and self.eps > 0, "optimizer_config.eps",
              f"must be a finite number > 0, got {self.eps}")
        one_of(self.lr_schedule, "optimizer_config.lr_schedule", ("cosine", "constant"))
        check(self.warmup_steps >= 0, "optimizer_config.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(
            0.0 <= self.min_lr_ratio <= 1.0,
            "optimizer_config.min_lr_ratio",
            f"must be in [0, 1], got {self.min_lr_ratio}",
        )


DEFAULT_DATA_PATH = "data/input.txt"


@dataclass
class DataConfig:
    """The corpus and how it is cut into training and held-out windows."""

    # Any fsspec URL or local path, a glob of them, or a list of either: the
    # files form one corpus. The default is downloaded when missing. (Typed
    # Any because OmegaConf has no Union[str, List[str]]; checked below.)
    path: Any = DEFAULT_DATA_PATH
    block_size: int = 64
    # The first train_split of the (truncated) text trains; the rest is held out.
    train_split: float = 0.9
    # Use only this leading fraction of the corpus (0.05: the first 5%).
    truncate: float = 1.0
    # Training windows start every `stride` characters (1: every position).
    # Held-out windows never overlap (stride block_size), so each held-out
    # character is predicted once.
    stride: int = 64
    # Directory of the token cache (the encoded corpus, read by every
    # process). null: .mingpt-cache/ beside a local corpus if that directory is
    # writable, else $XDG_CACHE_HOME/mingpt (~/.cache/mingpt).
    cache_dir: Optional[str] = operational(default=None)
    # Where batches are gathered: "device" (the whole corpus read into the
    # device's memory), "host" (each batch read from the token cache file, on
    # a GPU into pinned memory and copied asynchronously), "auto" (on a GPU:
    # device if the corpus takes at most 1/8 of its memory; on a CPU: host).
    placement: str = operational(default="auto")

    def __post_init__(self) -> None:
        paths = [self.path] if isinstance(self.path, str) else self.path
        check(isinstance(paths, (list, tuple, ListConfig)) and len(paths) > 0
              and all(isinstance(p, str) and p for p in paths),
              "data_config.path", f"must be a non-empty path, glob or list of them, got {self.path!r}")
        if not isinstance(self.path, str):
            self.path = list(self.path)
        check(self.block_size >= 1, "data_config.block_size", f"must be >= 1, got {self.block_size}")
        check(
            0.0 < self.train_split < 1.0,
            "data_config.train_split",
            f"must be in (0, 1), got {self.train_split}",
        )
        check(0.0 < self.truncate <= 1.0, "data_config.truncate", f"must be in (0, 1], got {self.truncate}")
        check(self.stride >= 1, "data_config.stride", f"must be >= 1, got {self.stride}")
        check(self.cache_dir is None or (bool(self.cache_dir) and "://" not in self.cache_dir),
              "data_config.cache_dir", f"must be a local directory (the cache is memory-mapped), got {self.cache_dir!r}")
        one_of(self.placement, "data_config.placement", ("auto", "device", "host"))


@dataclass
class TrainerConfig:
    """The training run: length, evaluation, logging, snapshots, devices, precision."""

    # Names the run directory runs/<run_name>: every rank and every restart of a
    # job agree on it, so they share one snapshot. `hydra.run.dir=...` overrides.
    run_name: str = operational(default="default")
    max_epochs: int = 2
    # Stop after this many optimizer steps (null: run all epochs).
    max_steps: Optional[int] = None
    # Samples per process per micro-step; the global batch is
    # batch_size * grad_accum_steps * world_size.
    batch_size: int = 12
    grad_accum_steps: int = 1
    grad_norm_clip: float = 1.0
    seed: int = 1337
    # "auto" (CUDA if available, else CPU), "cpu" or "cuda".
    device: str = operational(default="auto")
    # Evaluate every eval_every optimizer steps (0: at the end of each epoch);
    # always at the end of the run.
    eval_every: int = operational(default=500)
    # Evaluate on at most this many held-out tokens: whole non-overlapping
    # windows spread evenly over the held-out split, the same for any world
    # size (0: all of it). 131,072 covers tiny shakespeare's whole held-out
    # split (111,488 tokens) and caps a large one at ~1/3 of the training
    # tokens between two default evaluations (500 steps x 12 x 64).
    eval_tokens: int = 131_072
    # Early stopping: stop (a finished run) once early_stop_patience evaluations in a
    # row have not lowered the best held-out loss by at least early_stop_min_delta
    # (null: never). The run's best weights are kept whatever this says (README, Snapshots).
    early_stop_patience: Optional[int] = None
    early_stop_min_delta: float = 0.0
    log_every: int = operational(default=50)
    # Characters generated from the model at each evaluation (0: none).
    sample_chars: int = operational(default=200)
    # Snapshot path (fsspec URL or local path); relative paths are inside the run
    # directory. null: snapshot.pt (parallelism=ddp: one file) or snapshots
    # (parallelism=fsdp: a directory of sharded snapshots).
    snapshot_path: Optional[str] = operational(default=None)
    save_every: int = operational(default=1)
    # Also save every this many optimizer steps (null: only per epoch and at the end).
    save_every_steps: Optional[int] = operational(default=None)
    # Also save when this many minutes have passed since the last save, by rank
    # 0's clock (null: never by time): a bound on the work a crash can lose.
    save_every_minutes: Optional[float] = operational(default=5.0)
    # Sharded snapshots (parallelism=fsdp): keep the newest keep_snapshots published
    # snapshots, removing older ones once a new one is published.
    keep_snapshots: int = operational(default=2)
    # Sharded snapshots only: training waits for the state's copy to CPU memory, not
    # for the write; the next save, the end of the run and a stop wait for it.
    async_save: bool = operational(default=True)
    # Signals that stop the run at the next step boundary, after a snapshot
    # (exit status 128 + the signal's number; docs/fault-tolerance.md).
    stop_signals: list[str] = operational(default_factory=lambda: list(DEFAULT_STOP_SIGNALS))
    # Fine-tuning: start from the weights of this snapshot (a snapshot file, a
    # sharded snapshot, or a run directory: its best weights, else its latest
    # snapshot), with a fresh optimizer and schedule from step 0, on this run's
    # corpus. The model's shape and vocabulary are the snapshot's (docs/training.md, Fine-tuning).
    init_from: Optional[str] = None
    # Mixed precision on CUDA: amp_dtype "bf16" or "fp16" (fp16 uses a GradScaler).
    use_amp: bool = False
    amp_dtype: str = "bf16"
    # AMP on a CPU is ignored unless forced: without bf16 units it is far slower.
    amp_on_cpu: bool = False
    compile: bool = operational(default=False)
    # Recompute each transformer block's activations in backward instead of keeping them:
    # less memory for more compute, the same gradients (mingpt/model.py).
    activation_checkpointing: bool = operational(default=False)
    # How the model is spread over the processes (mingpt/parallel.py): "ddp"
    # (each rank holds all of it) or "fsdp" (FSDP2: parameters, gradients and
    # optimizer state sharded over the ranks; snapshots sharded too).
    parallelism: str = "ddp"
    # DDP gradient communication: "none", "fp16", "bf16" (NCCL only), "powersgd",
    # "batched_powersgd", "post_local_sgd" (see mingpt/comm_hooks.py).
    ddp_comm_hook: str = "none"
    # PowerSGD's rank, and its start: after the warmup (measured in BENCHMARKS.md: 2% behind DDP).
    powersgd_rank: int = 8
    powersgd_start_step: int = 100
    # Resuming a snapshot written with other values of result-affecting keys is
    # refused; true continues it with this config's values (more epochs, a lower
    # learning rate). The model's shape and vocabulary can never change.
    allow_config_change: bool = operational(default=False)
    # post_local_sgd: plain all-reduce for localsgd_start_step steps, then each
    # replica steps on its own and all are averaged every localsgd_period steps.
    # A replica is a rank, or with "node" the ranks of a node (their gradients
    # are all-reduced every step).
    localsgd_start_step: int = 100
    localsgd_period: int = 4
    localsgd_group: str = "rank"
    # An experiment tracker beside metrics.jsonl and TensorBoard (mingpt/tracking.py):
    # "mlflow" (needs `pip install -e .[mlflow]`) or null (none). Rank 0 logs.
    tracker: Optional[str] = operational(default=None)
    # Its tracking store: an MLflow tracking URI (http://host:5000, sqlite:///mlflow.db,
    # file:./mlruns or a directory). null: MLflow's default (MLFLOW_TRACKING_URI, else ./mlruns).
    tracker_uri: Optional[str] = operational(default=None)

    def __post_init__(self) -> None:
        check(bool(self.run_name) and "/" not in self.run_name and self.run_name not in (".", ".."),
              "trainer_config.run_name", f"must be a directory name (not empty, '.', '..' or with '/'), "
              f"got {self.run_name!r}")
        positive = ("max_epochs", "batch_size", "grad_accum_steps", "log_every", "save_every", "powersgd_rank",
                    "keep_snapshots")
        for key in positive:
            check(getattr(self, key) >= 1, f"trainer_config.{key}", f"must be >= 1, got {getattr(self, key)}")
        per_step = self.batch_size * self.grad_accum_steps
        check(per_step < 2**31, "trainer_config.grad_accum_steps",
              f"batch_size * grad_accum_steps must be < 2**31 windows per step, got {per_step}")
        check_seed(self.seed, "trainer_config.seed")
        for key in ("max_steps", "save_every_steps", "early_stop_patience"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"trainer_config.{key}", f"must be >= 1 or null, got {value}")
        for key in ("eval_every", "sample_chars", "eval_tokens"):
            check(getattr(self, key) >= 0, f"trainer_config.{key}", f"must be >= 0, got {getattr(self, key)}")
        check(math.isfinite(self.early_stop_min_delta) and self.early_stop_min_delta >= 0,
              "trainer_config.early_stop_min_delta", f"must be a finite number >= 0, got {self.early_stop_min_delta}")
        check(self.powersgd_start_step >= 2, "trainer_config.powersgd_start_step",
               f"must be >= 2 (PowerSGD starts after plain all-reduce steps), got {self.powersgd_start_step}")
        check(self.save_every_minutes is None or self.save_every_minutes > 0, "trainer_config.save_every_minutes",
              f"must be > 0 or null, got {self.save_every_minutes}")
        for name in self.stop_signals:
            try:
                parse_signal(name)
            except ValueError as e:
                raise ConfigError(f"trainer_config.stop_signals: {e}") from None
        check(len({parse_signal(n) for n in self.stop_signals}) == len(self.stop_signals),
              "trainer_config.stop_signals", f"lists a signal twice: {list(self.stop_signals)}")
        check(self.grad_norm_clip > 0, "trainer_config.grad_norm_clip", f"must be > 0, got {self.grad_norm_clip}")
        check(self.snapshot_path is None or bool(self.snapshot_path), "trainer_config.snapshot_path",
              "must not be empty")
        check(self.init_from is None or bool(self.init_from), "trainer_config.init_from",
              "must be a snapshot file, a sharded snapshot or a run directory (null: train from scratch), got ''")
        one_of(self.device, "trainer_config.device", ("auto", "cpu", "cuda"))
        one_of(self.amp_dtype, "trainer_config.amp_dtype", ("bf16", "fp16"))
        one_of(self.ddp_comm_hook, "trainer_config.ddp_comm_hook",
               ("none", "fp16", "bf16", "powersgd", "batched_powersgd", "post_local_sgd"))
        one_of(self.parallelism, "trainer_config.parallelism", ("ddp", "fsdp"))
        if self.parallelism == "fsdp":
            check(self.ddp_comm_hook == "none", "trainer_config.ddp_comm_hook",
                  f"{self.ddp_comm_hook} is a DDP comm hook; parallelism=fsdp has none (use none, or parallelism=ddp)")
            check(not (self.use_amp and self.amp_dtype == "fp16"), "trainer_config.amp_dtype",
                  "fp16 needs a gradient scaler over the shards; with parallelism=fsdp use bf16")
        check(self.localsgd_start_step >= 0, "trainer_config.localsgd_start_step",
              f"must be >= 0, got {self.localsgd_start_step}")
        check(self.localsgd_period >= 2, "trainer_config.localsgd_period",
              f"must be >= 2 (1 averages every step: that is plain DDP, ddp_comm_hook=none), got {self.localsgd_period}")
        one_of(self.localsgd_group, "trainer_config.localsgd_group", ("rank", "node"))
        check(self.tracker in (None, "mlflow"), "trainer_config.tracker",
              f"{self.tracker!r} is not a tracker mingpt has: mlflow, or null (none)")
        check(self.tracker_uri is None or bool(self.tracker_uri.strip()), "trainer_config.tracker_uri",
              "must not be empty (null: MLflow's default)")


@dataclass
class Config:
    gpt_config: GPTConfig = field(default_factory=GPTConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    trainer_config: TrainerConfig = field(default_factory=TrainerConfig)


# The keys of the fields marked `operational` above. Every other key is
# result-affecting: the run directory's name and the check on resume
# (mingpt/rundir.py, mingpt/snapshot/fit.py) compare those.
OPERATIONAL_KEYS = frozenset(f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
                             for f in dataclasses.fields(section.default_factory) if f.metadata.get("operational"))


def result_items(sections: Mapping[str, Mapping]) -> dict[str, object]:
    """The result-affecting values of a config given as {section: {key: value}}
    (a composed config, a snapshot's saved configs), flat as {"section.key": value},
    in JSON's types, so a tuple and a list of the same numbers compare equal."""
    names = [f.name for f in dataclasses.fields(Config)]
    flat = {f"{name}.{key}": value for name in names if isinstance(sections.get(name), Mapping)
            for key, value in sections[name].items()}
    return json.loads(json.dumps({k: v for k, v in flat.items() if k not in OPERATIONAL_KEYS}))


def check_known_keys(cfg: Mapping) -> None:
    """Reject keys the dataclasses do not declare. OmegaConf does so for plain
    overrides, but Hydra's `+key=value` adds keys past it."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    for name, section in cfg.items():
        check(name in sections, name, "unknown key")
        fields = {f.name for f in dataclasses.fields(sections[name])}
        for key in section:
            check(key in fields, f"{name}.{key}", f"unknown key (not a field of {sections[name].__name__})")


# Keys of the PyTorch DDP minGPT tutorial's config file that mean nothing here:
# a user's file that has them still runs, and the run says they are ignored.
IGNORED_KEYS = {
    ("trainer_config", "data_loader_workers"): "each process reads its own batches from the token cache "
    "(or gathers them on the GPU), so there is no DataLoader to give worker processes",
}


def drop_ignored_keys(cfg: MutableMapping) -> list[str]:
    """Remove IGNORED_KEYS from `cfg`; return one notice per key removed."""
    notices = []
    for (section, key), why in IGNORED_KEYS.items():
        if isinstance(cfg.get(section), MutableMapping) and key in cfg[section]:
            del cfg[section][key]
            notices.append(f"{section}.{key} ignored: {why}")
    return notices


def register_configs() -> None:
    """Make the dataclasses Hydra's schema: `base_config` for the whole config,
    and `gpt_config=default` (the dataclass defaults) beside the YAML presets."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="gpt_config", name="default", node=GPTConfig)
