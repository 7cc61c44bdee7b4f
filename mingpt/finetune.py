"""Fine-tuning (`trainer_config.init_from`, docs/training.md): the source's shape, vocabulary and weights.
Once the run has a snapshot of its own, the shape and vocabulary come from that, and the source is not read."""

import dataclasses
import logging
import math
from typing import Any

import torch

from mingpt.config import Config, ConfigError, DataConfig, GPTConfig
from mingpt.data import CharData, CharTokenizer, DataError
from mingpt.generate import find_snapshot
from mingpt.snapshot import SnapshotError, manager
from mingpt.snapshot.fit import SHAPE_KEYS
from mingpt.storage import StorageError, reason

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Start:
    source: str  # the snapshot read: init_from resolved, or the run's own snapshot when resuming
    state: dict[str, Any]  # what it holds (the weights only when not resuming)
    # the run has a snapshot of its own: its weights come from there (Trainer's restore)
    resuming: bool

    @property
    def named(self) -> str:  # the snapshot, and why it is read, for a message
        return f"{self.source} ({'this run' if self.resuming else 'trainer_config.init_from'})"


def prepare(config: Config, own: str, saved: dict[str, Any] | None) -> Start | None:
    """With trainer_config.init_from (None without): the source, or the run's own snapshot at `own` if it has
    one (`saved`, what it holds besides tensors). Before any data is read, `config` takes the snapshot's shape
    and data_config.block_size, said in the log; a key set to neither its default nor the snapshot's is refused."""
    if not config.trainer_config.init_from:
        return None
    try:
        source = own if saved is not None else find_snapshot(config.trainer_config.init_from)
        start = Start(
            source, manager.read(source) if saved is None else saved, resuming=saved is not None
        )
    except (SnapshotError, StorageError) as e:
        raise type(e)(f"trainer_config.init_from: {e}") from None
    shape, vocab = start.state.get("gpt_config"), start.state.get("vocab")
    if not (
        isinstance(shape, dict)
        and all(isinstance(shape.get(k), int) for k in SHAPE_KEYS)
        and isinstance(vocab, str)
        and len(vocab) == shape["vocab_size"]
    ):
        raise SnapshotError(
            f"trainer_config.init_from: snapshot {start.named} does not record its model's shape "
            "and vocabulary (gpt_config, vocab)"
        )
    given = {
        f"gpt_config.{k}": (getattr(config.gpt_config, k), getattr(GPTConfig(), k), shape[k])
        for k in SHAPE_KEYS
    }
    given["data_config.block_size"] = (
        config.data_config.block_size,
        DataConfig().block_size,
        shape["block_size"],
    )
    for key, (value, default, theirs) in given.items():
        if value != theirs and value != default:
            raise ConfigError(
                f"{key}: {value} given, but the model of {start.named} has {theirs}: "
                f"a fine-tuned model keeps its shape; leave {key} unset"
            )
    log.info(
        "the model's shape from %s: %s",
        start.named,
        ", ".join(
            f"{key}={theirs}" + (f" (replacing {value})" if value != theirs else "")
            for key, (value, _, theirs) in given.items()
            # these follow the data
            if key not in ("gpt_config.vocab_size", "gpt_config.block_size")
        ),
    )
    config.gpt_config = dataclasses.replace(config.gpt_config, **{k: shape[k] for k in SHAPE_KEYS})
    config.data_config = dataclasses.replace(config.data_config, block_size=shape["block_size"])
    return start


def fit_data(data: CharData, start: Start, corpus: Any) -> CharData:
    """The corpus in the snapshot's vocabulary; characters outside it are refused, named."""
    if unknown := CharTokenizer(start.state["vocab"]).unknown(data.tokenizer.chars):
        raise DataError(
            f"data_config.path {corpus}: {len(unknown)} character{'s' if len(unknown) > 1 else ''} "
            f"outside the vocabulary of {start.named}, which a fine-tuned model keeps: "
            f"{' '.join(map(repr, unknown))}"
        )
    return data.in_vocabulary(start.state["vocab"])


def load_weights(model: torch.nn.Module, start: Start) -> None:
    """The source's weights into `model` (built to its shape, not yet spread over the ranks)."""
    try:
        model.load_state_dict(start.state.pop("model_state"))
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise SnapshotError(
            f"trainer_config.init_from: snapshot {start.source} cannot be loaded: {reason(e)}"
        ) from None
    # a fresh optimizer: its moments are not kept in memory
    start.state.pop("optimizer_state", None)
    step, best, best_step = (start.state.get(k) for k in ("step", "best_eval_loss", "best_step"))
    known = isinstance(best, (int, float)) and math.isfinite(best) and best_step == step
    log.info(
        "initialised from %s (step %s%s)",
        start.source,
        step,
        f", held-out loss {best:.4f}" if known else "",
    )
