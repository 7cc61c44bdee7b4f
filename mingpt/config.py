"""The config dataclasses: each key's default, type, valid values, help and whether it is
operational; __post_init__ checks each value against its field, then what spans several keys."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import pathlib
import re
import sys
import textwrap
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import ListConfig, OmegaConf

from mingpt.stopping import DEFAULT_SIGNALS, parse_signal


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


def check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}")


def key(
    default: Any = dataclasses.MISSING,
    help: str = "",
    operational: bool = False,
    valid: str | tuple[str, ...] | None = None,
    acts_with: tuple[Any, ...] | None = None,
    **factory: Any,
) -> Any:
    """A config key: its default (or default_factory), its one-line help (docs/configuration.md,
    --help), its valid values (a range such as `>= 1` or `[0, 1)`, or a tuple of choices; null is
    valid where the type allows it), whether it is operational: it changes how a run is carried
    out, logged or saved, never what it computes (but for `eval_every` under early stopping); and,
    for a key that acts only with some values of another key of its section, `acts_with`: that
    key's name and those values (none: any value but null)."""
    return field(
        default=default,
        **factory,
        metadata={"help": help, "operational": operational, "valid": valid, "acts_with": acts_with},
    )


def _bound(text: str) -> float:
    """A range's bound as written: a number, or a power such as 2**63 (exact)."""
    if "**" in text:
        base, exponent = text.split("**")
        return int(base) ** int(exponent)
    return float(text)


def in_range(value: Any, valid: str) -> bool:
    """Whether `value` is a finite number in `valid`: `>= 1`, `> 0`, or an interval such as
    `[0, 1)`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if valid.startswith(">="):
        return value >= _bound(valid[2:])
    if valid.startswith(">"):
        return value > _bound(valid[1:])
    low, high = (_bound(b) for b in valid[1:-1].split(", "))
    # at a bound, its bracket says whether the interval holds it
    if value == low:
        return valid[0] == "["
    if value == high:
        return valid[-1] == "]"
    return low < value < high


def _nullable(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)


def range_text(f: dataclasses.Field) -> str:
    """A field's range in words: `>= 1 or null`, `in [0, 1)`, `a finite number > 0`."""
    valid = f.metadata["valid"]
    text = f"in {valid}"
    if valid.startswith(">"):
        text = valid
        if "float" in str(f.type):
            text = f"a finite number {valid}"
    if _nullable(f):
        text += " or null"
    return text


def check_fields(section: Any, prefix: str = "") -> None:
    """Each field's value against its `valid`: ConfigError naming the first that is not valid."""
    for f in dataclasses.fields(section):
        valid = f.metadata.get("valid")
        value = getattr(section, f.name)
        if valid is None or (value is None and _nullable(f)):
            continue
        name = prefix + f.name
        if isinstance(valid, tuple):
            choices = ", ".join(valid)
            if _nullable(f):
                choices += ", or null"
            check(value in valid, name, f"{value!r} is not one of {choices}")
        else:
            check(in_range(value, valid), name, f"must be {range_text(f)}, got {value}")


@dataclass
class GPTConfig:
    """Model shape. The defaults are the CPU default run (measured, see BENCHMARKS.md)."""

    n_layer: int = key(4, "transformer blocks", valid=">= 1")
    n_head: int = key(4, "attention heads; must divide `n_embd`", valid=">= 1")
    n_embd: int = key(128, "embedding width", valid=">= 1")
    dropout: float = key(
        0.0, "dropout on embeddings, attention and residual branches", valid="[0, 1)"
    )
    vocab_size: int | None = key(
        None, "the vocabulary's size, set from the data; leave unset", valid=">= 1"
    )
    block_size: int | None = key(
        None, "the context length, set from `data_config.block_size`; leave unset", valid=">= 1"
    )

    def __post_init__(self) -> None:
        check_fields(self, "gpt_config.")
        check(
            self.n_embd % self.n_head == 0,
            "gpt_config.n_embd",
            f"{self.n_embd} is not divisible by gpt_config.n_head={self.n_head}",
        )


@dataclass
class OptimizerConfig:
    learning_rate: float = key(3e-3, "peak learning rate", valid="> 0")
    weight_decay: float = key(
        0.1,
        "on the weights of Linear layers only; none on biases, LayerNorms, embeddings",
        valid=">= 0",
    )
    betas: tuple[float, float] = key((0.9, 0.99), "AdamW betas")
    # float32's smallest normal number: AdamW computes in float32, where a smaller eps can round to
    # 0, and a parameter whose gradient is still 0 then steps by 0 / 0 (eps=1e-300 diverged)
    eps: float = key(1e-8, "AdamW epsilon", valid=">= 1e-38")
    lr_schedule: str = key(
        "cosine",
        "`cosine`: linear warmup, then cosine decay to `min_lr_ratio * learning_rate` at the "
        "last step; `constant`: warmup, then flat; `wsd`: warmup, flat, then over the run's last "
        "`cooldown_fraction` a linear decay to `min_lr_ratio * learning_rate`",
        valid=("cosine", "constant", "wsd"),
    )
    warmup_steps: int = key(100, "optimizer steps of linear warmup (0: none)", valid=">= 0")
    min_lr_ratio: float = key(
        0.1,
        "floor of the cosine or wsd decay, as a fraction of `learning_rate`",
        valid="[0, 1]",
        acts_with=("lr_schedule", "cosine", "wsd"),
    )
    cooldown_fraction: float = key(
        0.6,
        "`lr_schedule=wsd`: the fraction of the run's steps its decay takes",
        valid="(0, 1]",
        acts_with=("lr_schedule", "wsd"),
    )
    algorithm: str = key(
        "adamw",
        "`adamw`; or `muon`: torch.optim.Muon for the 2-D weights of the transformer blocks, "
        "AdamW for the embeddings, head, biases and LayerNorms; not with "
        "`trainer_config.parallelism=fsdp`",
        valid=("adamw", "muon"),
    )
    muon_learning_rate: float = key(
        0.01,
        "Muon's peak learning rate (`algorithm=muon`), on the same schedule "
        "([measured](../BENCHMARKS.md#time-to-quality))",
        valid="> 0",
        acts_with=("algorithm", "muon"),
    )
    muon_momentum: float = key(
        0.95, "Muon's (Nesterov) momentum", valid="[0, 1)", acts_with=("algorithm", "muon")
    )
    muon_momentum_warmup_steps: int = key(
        0,
        "optimizer steps over which Muon's momentum rises linearly from 0.85 to `muon_momentum` "
        "(0: none)",
        valid=">= 0",
        acts_with=("algorithm", "muon"),
    )

    def __post_init__(self) -> None:
        check_fields(self, "optimizer_config.")
        check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "optimizer_config.betas",
            f"must be two numbers in [0, 1), got {list(self.betas)}",
        )


DEFAULT_DATA_PATH = "data/input.txt"


@dataclass
class DataConfig:
    path: Any = key(
        DEFAULT_DATA_PATH,
        "local path or fsspec URL of a UTF-8 text (`s3://`, `gs://`: the `s3` or `gcs` extra), a "
        "glob, or a list of them (`'data_config.path=[a.txt,more/*.txt]'`), read as one corpus; "
        "the default is downloaded when missing ([The corpus](data.md))",
    )
    block_size: int = key(64, "context length in characters", valid=">= 1")
    train_split: float = key(
        0.9,
        "the first `train_split` of each file trains, the rest of it is held out",
        valid="(0, 1)",
    )
    truncate: float = key(1.0, "use only this leading fraction of each file", valid="(0, 1]")
    stride: int = key(
        64,
        "a training window starts every `stride` characters (1: at every character; above "
        "`block_size`, the characters between windows are never trained on, said at start); "
        "held-out windows never overlap",
        valid=">= 1",
    )
    cache_dir: str | None = key(
        None,
        "directory of the token cache; null: `.mingpt-cache/` beside a local corpus if writable, "
        "else `$XDG_CACHE_HOME/mingpt`",
        operational=True,
    )
    placement: str = key(
        "auto",
        "where batches are gathered: `device` (the whole corpus in the device's memory), `host` "
        "(each batch read from the token cache file), `auto` (on a GPU `device` when the corpus "
        "takes at most 1/8 of its memory; else `host`)",
        operational=True,
        valid=("auto", "device", "host"),
    )

    def __post_init__(self) -> None:
        if isinstance(self.path, (tuple, ListConfig)):
            self.path = list(self.path)
        paths = self.paths
        # A file named 1 or 2.5 is read as a number on the command line.
        hint = ""
        if isinstance(self.path, int | float) and not isinstance(self.path, bool):
            hint = f" (a number: for a file of that name, 'data_config.path=\"{self.path}\"')"
        check(
            isinstance(paths, list)
            and len(paths) > 0
            and all(isinstance(p, str) and p for p in paths),
            "data_config.path",
            f"must be a non-empty path, glob or list of them, got {self.path!r}{hint}",
        )
        check_fields(self, "data_config.")
        check(
            self.cache_dir is None or (bool(self.cache_dir) and "://" not in self.cache_dir),
            "data_config.cache_dir",
            f"must be a local directory (the cache is memory-mapped), got {self.cache_dir!r}",
        )

    @property
    def paths(self) -> list[str]:
        """`path` as a list: one path or glob, or several."""
        if isinstance(self.path, str):
            return [self.path]
        return self.path


# the values of ddp_comm_hook that read the powersgd_* keys, and the localsgd_* keys
POWERSGD = ("ddp_comm_hook", "powersgd", "batched_powersgd")
LOCALSGD = ("ddp_comm_hook", "post_local_sgd")


@dataclass
class TrainerConfig:
    run_name: str = key(
        "default",
        "the run directory is `runs/<run_name>`, whatever the config: a command with other "
        "values needs another name (see [Run directory](run-directory.md))",
        operational=True,
    )
    max_epochs: int = key(2, "epochs over the training windows", valid=">= 1")
    max_steps: int | None = key(None, "stop earlier, after this many optimizer steps", valid=">= 1")
    batch_size: int = key(
        12,
        "windows per process per micro-step; global batch = `batch_size * grad_accum_steps * "
        "world size`",
        valid=">= 1",
    )
    grad_accum_steps: int = key(1, "micro-steps per optimizer step", valid=">= 1")
    grad_norm_clip: float = key(1.0, "clip the global gradient norm to this", valid="> 0")
    seed: int = key(1337, "the same seed and config give the same run", valid="[0, 2**63)")
    device: str = key(
        "auto",
        "`auto` (CUDA if available, else CPU), `cpu` or `cuda`",
        operational=True,
        valid=("auto", "cpu", "cuda"),
    )
    eval_every: int = key(
        500,
        "evaluate every this many optimizer steps (0: at the end of each epoch); always at the "
        "end of the run; with `early_stop_patience` set, it also decides where the run stops",
        operational=True,
        valid=">= 0",
    )
    eval_tokens: int = key(
        131_072,
        "evaluate on at most this many held-out tokens (but one window at least), whole windows "
        "spread evenly over the split, for any number of processes (0: all)",
        valid=">= 0",
    )
    early_stop_patience: int | None = key(
        None,
        "stop the run, as finished, after this many evaluations in a row without the best "
        "held-out loss dropping by `early_stop_min_delta` (null: never)",
        valid=">= 1",
    )
    early_stop_min_delta: float = key(
        0.0,
        "the least drop of the held-out loss, below the best loss at the last improvement "
        "counted, that counts as an improvement for `early_stop_patience` (the best weights "
        "are kept at any drop)",
        valid=">= 0",
        acts_with=("early_stop_patience",),
    )
    log_every: int = key(
        50,
        "log a train event every this many optimizer steps, and at the run's last step (with "
        "`early_stop_patience` set, at each evaluation: any can end the run)",
        operational=True,
        valid=">= 1",
    )
    sample_chars: int = key(
        200,
        "characters sampled at each evaluation and at the end (0: none)",
        operational=True,
        # a bound: a larger count crashed the run at its first evaluation (torch takes no size
        # past 64 bits) or stalled it there
        valid="[0, 2**20]",
    )
    snapshot_path: str | None = key(
        None,
        "the snapshots' root directory: local path or fsspec URL, relative to the run directory; "
        "null: `snapshots`",
        operational=True,
    )
    save_every: int = key(
        1,
        "save a snapshot every this many epochs, and always at the end",
        operational=True,
        valid=">= 1",
    )
    save_every_steps: int | None = key(
        None, "also save every this many optimizer steps", operational=True, valid=">= 1"
    )
    save_every_minutes: float | None = key(
        5.0,
        "also save when this many minutes have passed since the last save (null: never by time), "
        "a bound on the work a crash can lose",
        operational=True,
        valid="> 0",
    )
    keep_snapshots: int = key(
        2,
        "snapshots kept (the newest), the older removed once a new one is published",
        operational=True,
        valid=">= 1",
    )
    async_save: bool = key(
        True,
        "save in the background: training waits only for the copy of the state to CPU memory; "
        "the next save, a stop and the end wait for it, and its failure stops the run on every "
        "rank",
        operational=True,
    )
    stop_signals: list[str] = key(
        help="signals that stop the run at the next step boundary after a snapshot, exit "
        "status 128 + the signal ([Fault "
        "tolerance](fault-tolerance.md#stopping-a-run-signals-and-exit-statuses))",
        operational=True,
        default_factory=lambda: list(DEFAULT_SIGNALS),
    )
    init_from: str | None = key(
        None,
        "fine-tune from a snapshot file, a sharded snapshot or a run directory (its best "
        "weights): its shape, vocabulary and weights, with a fresh optimizer and schedule on "
        "this run's corpus ([Fine-tuning](training.md#fine-tuning))",
    )
    use_amp: bool = key(False, "mixed precision on CUDA")
    amp_dtype: str = key(
        "bf16",
        "`bf16`, or `fp16` (with a gradient scaler)",
        valid=("bf16", "fp16"),
        acts_with=("use_amp", True),
    )
    amp_on_cpu: bool = key(
        False,
        "apply `use_amp` on a CPU too (ignored there otherwise: slower without bf16 units)",
        acts_with=("use_amp", True),
    )
    compile: bool = key(False, "`torch.compile` the model", operational=True)
    activation_checkpointing: bool = key(
        False,
        "recompute each transformer block's activations in backward instead of keeping them: "
        "less memory for more compute, the same gradients (`benchmarks/bench_parallel.py "
        "--checkpointing false true` measures both)",
        operational=True,
    )
    profile_steps: int = key(
        0,
        "record this many optimizer steps, after one of warm-up, with `torch.profiler` and write "
        "each rank's trace into `profile/` in the run directory, for TensorBoard or Perfetto (0: "
        "off; see [Performance](training.md#performance))",
        operational=True,
        valid=">= 0",
    )
    parallelism: str = key(
        "ddp",
        "`ddp` (every rank holds the whole model) or `fsdp` (FSDP2: model, gradients and AdamW "
        "state sharded over the ranks; see [Distributed "
        "training](training.md#distributed-training))",
        valid=("ddp", "fsdp"),
    )
    ddp_comm_hook: str = key(
        "none",
        "DDP gradient communication: `none`, `fp16`, `bf16` (NCCL only), `powersgd`, "
        "`batched_powersgd`, `post_local_sgd` (see [Distributed "
        "training](training.md#distributed-training))",
        valid=("none", "fp16", "bf16", "powersgd", "batched_powersgd", "post_local_sgd"),
    )
    powersgd_rank: int = key(
        8,
        "PowerSGD's matrix rank; with `powersgd_start_step`'s default it keeps `powersgd` within "
        "about 2% of DDP's held-out loss "
        "([measured](../BENCHMARKS.md#powersgds-defaults-what-the-compression-costs-in-loss))",
        valid=">= 1",
        acts_with=POWERSGD,
    )
    powersgd_start_step: int = key(
        100,
        "the step PowerSGD starts compressing at, after plain all-reduce steps",
        valid=">= 2",
        acts_with=POWERSGD,
    )
    allow_config_change: bool = key(
        False,
        "resume a snapshot written with other values (see [Fault tolerance](fault-tolerance.md))",
        operational=True,
    )
    localsgd_start_step: int = key(
        100, "LocalSGD: plain DDP steps before it starts", valid=">= 0", acts_with=LOCALSGD
    )
    localsgd_period: int = key(
        4,
        "LocalSGD: steps between averagings (1 would average every step: plain DDP, "
        "`ddp_comm_hook=none`)",
        valid=">= 2",
        acts_with=LOCALSGD,
    )
    localsgd_group: str = key(
        "rank",
        "LocalSGD's replica: `rank`, or `node` (a node's ranks all-reduce gradients every step)",
        valid=("rank", "node"),
        acts_with=LOCALSGD,
    )
    tracker: str | None = key(
        None,
        "`mlflow` (needs the `mlflow` extra) or null: rank 0 also logs the config, scalars and "
        "samples there, and a resumed run continues the same tracker run ([Experiment "
        "tracking](tracking.md))",
        operational=True,
        valid=("mlflow",),
    )
    tracker_uri: str | None = key(
        None,
        "the tracker's store: an MLflow tracking URI (`http://host:5000`, `sqlite:///mlflow.db`, "
        "`file:./mlruns` or a directory); null: MLflow's default (`MLFLOW_TRACKING_URI`, else "
        "`sqlite:///mlflow.db` in the working directory)",
        operational=True,
        acts_with=("tracker", "mlflow"),
    )

    def __post_init__(self) -> None:
        check(
            self.run_name not in ("", ".", "..")
            and "/" not in self.run_name
            and self.run_name.isprintable(),
            "trainer_config.run_name",
            "must be one directory name (not empty, '.' or '..', without '/' or control "
            f"characters such as a newline), got {self.run_name!r}",
        )
        # A sweep (-m) of run_name NAME is in runs/NAME-multirun: a run of that name would share it.
        check(
            not self.run_name.endswith("-multirun"),
            "trainer_config.run_name",
            f"must not end in '-multirun', got {self.run_name!r}: runs/{self.run_name} is the "
            f"directory of the sweep (-m) named {self.run_name.removesuffix('-multirun')!r}",
        )
        check_fields(self, "trainer_config.")
        per_step = self.batch_size * self.grad_accum_steps
        check(
            per_step < 2**31,
            "trainer_config.grad_accum_steps",
            f"batch_size * grad_accum_steps must be < 2**31 windows per step, got {per_step}",
        )
        # A list nested in the list ([[SIGTERM]]) gets past OmegaConf's check of List[str].
        check(
            all(isinstance(name, str) for name in self.stop_signals),
            "trainer_config.stop_signals",
            f"must be a list of signal names such as SIGTERM, got {list(self.stop_signals)}",
        )
        try:
            signals = {parse_signal(name) for name in self.stop_signals}
        except ValueError as e:
            raise ConfigError(f"trainer_config.stop_signals: {e}") from None
        check(
            len(signals) == len(self.stop_signals),
            "trainer_config.stop_signals",
            f"lists a signal twice: {list(self.stop_signals)}",
        )
        check(self.snapshot_path != "", "trainer_config.snapshot_path", "must not be empty")
        check(
            self.init_from != "",
            "trainer_config.init_from",
            "must be a snapshot file, a sharded snapshot or a run directory (null: train from "
            "scratch), got ''",
        )
        if self.parallelism == "fsdp":
            check(
                self.ddp_comm_hook == "none",
                "trainer_config.ddp_comm_hook",
                f"{self.ddp_comm_hook} is a DDP comm hook; parallelism=fsdp has none (use none, "
                "or parallelism=ddp)",
            )
            check(
                not (self.use_amp and self.amp_dtype == "fp16"),
                "trainer_config.amp_dtype",
                "fp16 needs a gradient scaler over the shards; with parallelism=fsdp use bf16",
            )
        if self.tracker_uri is not None:
            check(
                bool(self.tracker_uri.strip()),
                "trainer_config.tracker_uri",
                "must not be empty (null: MLflow's default)",
            )
            # SQLite's in-memory database: what is logged goes at exit
            check(
                self.tracker_uri.rstrip("/") != "sqlite:",
                "trainer_config.tracker_uri",
                f"{self.tracker_uri} names no database file (sqlite:///PATH)",
            )

    def amp_on(self, device_type: str) -> bool:
        """Whether AMP applies on a device of device_type: on CUDA with use_amp; on a CPU only where
        amp_on_cpu forces it."""
        return self.use_amp and (device_type == "cuda" or self.amp_on_cpu)


@dataclass
class Config:
    gpt_config: GPTConfig = field(default_factory=GPTConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    trainer_config: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        check(
            self.optimizer_config.algorithm != "muon" or self.trainer_config.parallelism != "fsdp",
            "optimizer_config.algorithm",
            "muon orthogonalises whole matrices, which parallelism=fsdp shards (torch.optim.Muon "
            "takes no sharded parameters): use adamw, or parallelism=ddp",
        )


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}
# every key, as "section.key": its field
FIELDS = {
    f"{name}.{f.name}": f for name, section in SECTIONS.items() for f in dataclasses.fields(section)
}


def keys_without_effect(config: Config) -> list[str]:
    """A warning for each key set to another value than its default where it has no effect, by its
    `acts_with` (muon_momentum with algorithm=adamw): not an error, as a file of settings may
    hold it for other runs, but never silent, as the user expects it to act."""
    warnings = []
    for name in SECTIONS:
        section = getattr(config, name)
        for f in dataclasses.fields(section):
            acts_with = f.metadata["acts_with"]
            value = getattr(section, f.name)
            if acts_with is None or value == _default(f):
                continue
            other, *values = acts_with
            setting = getattr(section, other)
            if setting in values or (not values and setting is not None):
                continue
            acts = " or ".join(map(value_text, values)) or "any value but null"
            warnings.append(
                f"{name}.{f.name}={value_text(value)} has no effect with {name}.{other}="
                f"{value_text(setting)}: it acts with {acts}"
            )
    return warnings


# Every key not operational is result-affecting: the run directory's name and the check on resume
# compare those.
OPERATIONAL_KEYS = frozenset(key for key, f in FIELDS.items() if f.metadata["operational"])


def result_items(sections: Mapping[str, Mapping]) -> dict[str, object]:
    """The result-affecting values of {section: {key: value}} (a composed config, a snapshot's
    saved configs), flat as {"section.key": value}, in JSON's types, so a tuple and a list of the
    same numbers compare equal."""
    flat = {
        f"{name}.{key}": value
        for name in SECTIONS
        if isinstance(sections.get(name), Mapping)
        for key, value in sections[name].items()
        if f"{name}.{key}" not in OPERATIONAL_KEYS
    }
    return json.loads(json.dumps(flat))


def check_known_keys(cfg: Mapping) -> None:
    """Reject keys the dataclasses do not declare: Hydra's `+key=value` adds keys past OmegaConf's
    check."""
    for name, section in cfg.items():
        if name not in SECTIONS:
            raise ConfigError(unknown_key(name, SECTIONS))
        for key in section:
            if f"{name}.{key}" not in FIELDS:
                raise ConfigError(unknown_key(f"{name}.{key}", FIELDS))


def unknown_key(key: str, known: Collection[str]) -> str:
    """The line for a key a command does not have: the `known` keys with the name (after the last
    dot) closest to its name are suggested, so a key given without its section, or in another one,
    gets its own."""
    section = key.rpartition(".")[0]
    name = key.rpartition(".")[2]
    names = [known_key.rpartition(".")[2] for known_key in known]
    close = difflib.get_close_matches(name, names, n=1)
    # every known key of that name
    meant = [known_key for known_key in known if known_key.rpartition(".")[2] in close]
    # a name that two sections have (block_size): the one of the section given
    meant = [known_key for known_key in meant if known_key.startswith(f"{section}.")] or meant
    hint = f"did you mean {' or '.join(meant)}? " if meant else ""
    return f"unknown key {key} ({hint}see --help)"


def drop_ignored_keys(cfg: MutableMapping) -> list[str]:
    """Remove the PyTorch DDP minGPT tutorial's trainer_config.data_loader_workers (a file with it
    still runs); the warnings to log."""
    trainer = cfg.get("trainer_config")
    if not isinstance(trainer, MutableMapping) or "data_loader_workers" not in trainer:
        return []
    del trainer["data_loader_workers"]
    return [
        "trainer_config.data_loader_workers ignored: each process reads its own batches from the "
        "token cache (or gathers them on the GPU), so there is no DataLoader to give worker "
        "processes"
    ]


def register_configs() -> None:
    """The dataclasses as Hydra's schema (`base_config`, `gpt_config=default`,
    `optimizer_config=default`), and `${mingpt.keys:}`: every key with its value in the composed
    config (for --help)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="gpt_config", name="default", node=GPTConfig)
    cs.store(group="optimizer_config", name="default", node=OptimizerConfig)
    # Hydra fills in the help template with string.Template: a `$` of the text is written `$$`.
    OmegaConf.register_new_resolver(
        "mingpt.keys",
        lambda _root_: "\n".join(
            key_lines(section, _root_[name], f"{name}.") for name, section in SECTIONS.items()
        ).replace("$", "$$"),
        replace=True,
    )


def value_text(value: Any) -> str:
    """A value as it is typed on the command line."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return json.dumps(value)  # null, true, false
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def help_text(f: dataclasses.Field, space: str = " ") -> str:
    """A key's help, and its range if it has one, written with `space` between its words."""
    if isinstance(f.metadata.get("valid"), str):
        return f"{f.metadata['help']}; {range_text(f).replace(' ', space)}"
    return f.metadata["help"]


def key_table(section: type) -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(section):
        kind = str(f.type).replace(" | None", " or null").replace("Any", "str or list")
        note = " (operational)" if f.metadata["operational"] else ""
        rows.append(f"| `{f.name}` | {kind} | {value_text(_default(f))} | {help_text(f)}{note} |")
    return "\n".join(rows)


def _for_terminal(help: str) -> str:
    """A key's help as a terminal shows it: a Markdown link by its text alone (its target is a path
    relative to docs/), that text kept on one line (its spaces are NULs until wrapped)."""
    return re.sub(r"\[([^]]*)\]\([^)]*\)", lambda m: m.group(1).replace(" ", "\0"), help)


def key_lines(section: type, values: Mapping | None = None, prefix: str = "") -> str:
    """A config dataclass's keys for a --help: `key=value` (the default, or the value in `values`),
    its meaning."""
    fields = dataclasses.fields(section)
    if values is None:
        values = {f.name: _default(f) for f in fields}
    # A range stays on one line: its spaces are NULs until wrapped, as a link's.
    rows = [(f"{prefix}{f.name}={value_text(values[f.name])}", help_text(f, "\0")) for f in fields]
    width = min(max(len(k) for k, _ in rows), 28) + 4
    indent = "\n" + " " * width
    lines = []
    for k, help in rows:
        head = f"  {k}".ljust(width)
        if len(k) + 4 > width:  # a long key: its meaning starts on the next line
            head = f"  {k}" + indent
        wrapped = textwrap.wrap(_for_terminal(help), 100 - width, break_on_hyphens=False)
        lines.append(head + indent.join(wrapped))
    return "\n".join(lines).replace("\0", " ")


def markdown(doc: str) -> str:
    """`doc` with the table of each section between its `<!-- keys: SECTION -->` and
    `<!-- end -->` made anew; ValueError naming the first of those lines it lacks."""
    for name, section in SECTIONS.items():
        begin = f"<!-- keys: {name} -->\n"
        if begin not in doc:
            raise ValueError(f"no line {begin.strip()}")
        start = doc.index(begin) + len(begin)
        end = doc.find("<!-- end -->", start)
        if end < 0:
            raise ValueError(f"no line <!-- end --> after {begin.strip()}")
        doc = doc[:start] + key_table(section) + "\n" + doc[end:]
    return doc


# python -m mingpt.config --markdown docs/configuration.md: the key tables made anew
if __name__ == "__main__":
    if sys.argv[1:2] != ["--markdown"] or len(sys.argv) != 3:
        sys.exit("usage: python -m mingpt.config --markdown docs/configuration.md")
    path = pathlib.Path(sys.argv[2])
    # A file that cannot be read, or is not such a page, was a traceback.
    try:
        path.write_text(markdown(path.read_text(encoding="utf-8")), encoding="utf-8")
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        print(f"error: {path}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        sys.exit(2)
