"""Fine-tuning (`trainer_config.init_from`, docs/training.md): the source's shape, vocabulary and
weights. Once the run has a snapshot of its own, the shape and vocabulary come from that, and the
source is not read."""

import dataclasses
import logging
import math
import os
from typing import Any

import torch

from mingpt.config import FIELDS, Config, ConfigError
from mingpt.data import CharData, CharTokenizer, DataError
from mingpt.snapshot import SnapshotError, reader
from mingpt.snapshot.compat import FROM_DATA
from mingpt.snapshot.single_file import SHAPE_KEYS
from mingpt.storage import StorageError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Start:
    source: str  # the snapshot read: init_from's, or the run's own snapshot when resuming
    meta: dict[str, Any]  # its record: configs, vocabulary, step
    # The run has a snapshot of its own: its weights come from there, when the trainer loads it.
    resuming: bool
    # The source's weights until they are loaded; never read when resuming.
    weights: dict[str, torch.Tensor] | None = None

    @property
    def named(self) -> str:
        """The snapshot, and why it is read, for a message."""
        why = "this run" if self.resuming else "trainer_config.init_from"
        return f"{self.source} ({why})"


def prepare(config: Config, run_dir: str, own: str, saved: dict[str, Any] | None) -> Start | None:
    """With trainer_config.init_from (None without): the source, or the run's own snapshot at `own`
    if it has one (`saved`, its record), for a run in `run_dir`. Before any data is read, `config`
    takes the snapshot's shape and data_config.block_size, said in the log; a key set to neither
    its default nor the snapshot's is refused."""
    init_from = config.trainer_config.init_from
    if not init_from:
        return None
    if saved is not None:
        start = Start(own, saved, resuming=True)
    else:
        # the run's own place, which has no snapshot yet: said so, not "an empty directory"
        if os.path.realpath(init_from) in (os.path.realpath(run_dir), os.path.realpath(own)):
            raise SnapshotError(
                f"trainer_config.init_from: {init_from} is this run itself, which has no snapshot "
                "yet: give another run or snapshot to start from"
            )
        try:
            source, note = reader.find(init_from)
            weights, meta = reader.read(source)
        except (SnapshotError, StorageError) as e:
            raise type(e)(f"trainer_config.init_from: {e}") from None
        if note:
            log.info("%s", note)
        start = Start(source, meta, resuming=False, weights=weights)
    # whole, as reader.read checked it or this run wrote it (its meta.json checked on reading)
    shape = start.meta["gpt_config"]
    taken = []
    for key in [f"gpt_config.{k}" for k in SHAPE_KEYS] + ["data_config.block_size"]:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        theirs = shape[name]
        if value != theirs and value != FIELDS[key].default:
            raise ConfigError(
                f"{key}: {value} given, but the model of {start.named} has {theirs}: a fine-tuned "
                f"model keeps its shape; leave {key} unset"
            )
        # set by the data, not by the source: left out of the log line
        if key in FROM_DATA:
            continue
        said = f"{key}={theirs}"
        if value != theirs:
            said += f" (replacing {value})"
        taken.append(said)
    log.info("the model's shape from %s: %s", start.named, ", ".join(taken))
    config.gpt_config = dataclasses.replace(config.gpt_config, **{k: shape[k] for k in SHAPE_KEYS})
    config.data_config = dataclasses.replace(config.data_config, block_size=shape["block_size"])
    return start


def fit_data(data: CharData, start: Start, corpus: Any) -> CharData:
    """The corpus in the snapshot's vocabulary; characters outside it are refused, named."""
    vocab = start.meta["vocab"]
    unknown = CharTokenizer(vocab).unknown(data.tokenizer.chars)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise DataError(
            f"data_config.path {corpus}: {len(unknown)} character{plural} outside the vocabulary "
            f"of {start.named}, which a fine-tuned model keeps: {' '.join(map(repr, unknown))}"
        )
    return data.in_vocabulary(vocab)


def load_weights(model: torch.nn.Module, start: Start) -> None:
    """The source's weights into `model` (built to its shape, not yet spread over the ranks)."""
    try:
        model.load_state_dict(start.weights)
        # The copy is not kept for the whole run.
        start.weights = None
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise SnapshotError(
            f"trainer_config.init_from: snapshot {start.source} cannot be loaded: "
            f"{reader.load_error(e)}"
        ) from None
    step = start.meta["step"]
    # a number where the record has one (reader.read checked it)
    best = start.meta.get("best_eval_loss", math.inf)
    loss = ""
    # The source's best loss is its weights' own when it was reached at its last step.
    if math.isfinite(best) and start.meta.get("best_step") == step:
        loss = f", held-out loss {best:.4f}"
    log.info("initialised from %s (step %s%s)", start.source, step, loss)
