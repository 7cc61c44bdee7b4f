"""Score a text under a snapshot: loss, bits per character, perplexity.

A file, or the run's held-out split exactly as the run evaluated it, in non-overlapping windows of
block_size, each predicted from its own start, in float32 (docs/generation.md)."""

import logging
from dataclasses import dataclass

import torch

from mingpt import evaluation, token_cache
from mingpt.command import command, find_snapshot, parse_args, write
from mingpt.config import DataConfig, TrainerConfig, check, check_fields, in_range, key
from mingpt.data import CharTokenizer, DataError, TokenWindows, cache_location, load_data
from mingpt.distributed import DistInfo, pick_device
from mingpt.generate import GenerateConfig
from mingpt.snapshot import SnapshotError, compat, reader

log = logging.getLogger(__name__)


@dataclass
class ScoreConfig:
    snapshot_path: str = key(GenerateConfig.snapshot_path, f"the model: {reader.HELP}")
    path: str = key(
        "",
        "the text to score (local path or fsspec URL, UTF-8); empty: the held-out split of the "
        "run's own corpus, as the run evaluates it",
    )
    device: str = key(
        "auto", "auto (CUDA if available), cpu or cuda", valid=("auto", "cpu", "cuda")
    )
    allow_corpus_change: bool = key(
        False,
        "score the held-out split of a corpus changed since the snapshot was written (with a "
        "warning: that split moved)",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        check(bool(self.snapshot_path), "snapshot_path", "must not be empty")


# Free text, taken verbatim.
TEXT_KEYS = ("snapshot_path", "path", "device")


class TextError(ValueError):
    """The text to score cannot be read or does not fit the snapshot's vocabulary."""


@dataclass(frozen=True)
class Score(evaluation.EvalResult):  # loss per scored character, in nats; tokens: those scored
    source: str  # what was scored, in words
    step: int  # the snapshot's step


def evaluated_with(state: dict, name: str) -> int:
    """The run's trainer_config.NAME (eval_tokens or batch_size), checked as its config checked it:
    a crafted record's (0, -5, a string) reached torch, a traceback, or scored too few windows."""
    field = TrainerConfig.__dataclass_fields__[name]
    value = (state.get("trainer_config") or {}).get(name, field.default)
    if not isinstance(value, int) or not in_range(value, field.metadata["valid"]):
        raise SnapshotError(
            f"the snapshot's trainer_config.{name} cannot be used: {value!r}, not a whole number "
            f"{field.metadata['valid']}"
        )
    return value


def _fingerprint(data_config: DataConfig) -> list[dict]:
    """The corpus as data.CharData.fingerprint has it: its files by the names data_config.path gives
    them."""
    sources = cache_location(data_config)[0]
    keys = token_cache.source_keys(sources)
    return [{**key, "source": source} for source, key in zip(sources, keys, strict=True)]


def heldout_windows(
    state: dict, tokenizer: CharTokenizer, device: torch.device, allow_corpus_change: bool
):
    """The held-out windows of the snapshot's run, from its data_config; refused when the corpus
    changed since, unless `allow_corpus_change` (then a warning)."""
    if "data_config" not in state:
        raise SnapshotError(
            "the snapshot holds no data_config: give the text to score with path=..."
        )
    try:
        data_config = DataConfig(**state["data_config"])
        # The windows the model reads: longer than its context, they ended in a traceback.
        context = state["gpt_config"]["block_size"]
        check(
            data_config.block_size <= context,
            "data_config.block_size",
            f"{data_config.block_size}, longer than the model's block_size {context}",
        )
    # A key this version does not know, or a value no run has (a ConfigError).
    except (TypeError, ValueError) as e:
        raise SnapshotError(
            f"the snapshot's data_config cannot be used ({e}): give the text with path=..."
        ) from None
    try:
        # Compared before its token cache is checked or built: a refusal is the only line.
        moved = compat.corpus_changes(state.get("corpus"), _fingerprint(data_config))
        if moved:
            if not allow_corpus_change:
                raise TextError(
                    f"the corpus changed since the snapshot was written ({'; '.join(moved)}), so "
                    "its held-out split is not the run's: give the text with path=..., or score "
                    "the new split with allow_corpus_change=true"
                )
            log.warning(
                "the corpus changed since the snapshot was written (%s): scoring its new "
                "held-out split, which is not the one the run evaluated",
                "; ".join(moved),
            )
        data = load_data(data_config)
    # Its hint, data_config.cache_dir, is no key of score's: the run's setting is used.
    except token_cache.CacheWriteError as e:
        raise DataError(
            f"the run's corpus: cannot write its token cache {e.path}: {e.why} (where the run's "
            "data_config.cache_dir puts it, read from the current directory: score where that "
            "can be written, or give the text with path=...)"
        ) from None
    except DataError as e:
        raise DataError(
            f"the run's corpus: {e} (its data_config.path, read from the current directory as the "
            "run read it from its own: score from there, or give the text with path=...)"
        ) from None
    if tokenizer.unknown(data.tokenizer.chars):
        raise TextError(
            f"the corpus {data_config.path} no longer has the snapshot's vocabulary (it changed "
            "since the run): give the text with path=..."
        )
    # A fine-tuned model's corpus may use fewer characters.
    data = data.in_vocabulary(tokenizer.chars)
    _, heldout = data.place(device, data_config.placement)
    return heldout, f"the held-out split of {data_config.path}"


def _text_windows(path: str, tokenizer: CharTokenizer, block_size: int, device: torch.device):
    """The text at `path` in windows of `block_size` that do not overlap, and the characters after
    the last whole one as a shorter window: each character after the first is predicted once."""
    chunks = []
    # chunk by chunk: a large file is refused at its first unknown character, not once read whole
    for _, text in token_cache.decoded_chunks(path, "path"):
        unknown = tokenizer.unknown(text)
        if unknown:
            raise TextError(
                f"{path} has characters outside the snapshot's vocabulary: "
                f"{' '.join(repr(c) for c in unknown[:20])}"
            )
        chunks.append(tokenizer.encode(text))
    tokens = torch.cat(chunks).to(device)
    if not len(tokens):
        raise DataError(f"path is empty: {path}")
    if len(tokens) < 2:
        raise TextError(f"{path} has {len(tokens)} character: nothing to predict")
    targets = len(tokens) - 1
    block = min(block_size, targets)
    windows = [TokenWindows(tokens, block, block)]
    whole = targets // block * block
    if whole < targets:
        windows.append(TokenWindows(tokens[whole:], targets - whole, 1))
    return windows


def score(config: ScoreConfig) -> Score:
    device = pick_device(config.device, key="device")
    # Which snapshot of a run directory is read is said once the text fits it: a refusal is the
    # only line.
    snapshot, note = find_snapshot(config.snapshot_path, "snapshot_path")
    model, tokenizer, state = reader.load_model(snapshot, device)
    # In batches as the run's evaluation; its settings checked before the text is read.
    batch_size = 4 * evaluated_with(state, "batch_size")
    if config.path:
        windows = _text_windows(config.path, tokenizer, model.config.block_size, device)
        source = config.path
        eval_tokens = 0  # all of it
    else:
        eval_tokens = evaluated_with(state, "eval_tokens")
        heldout, source = heldout_windows(state, tokenizer, device, config.allow_corpus_change)
        windows = [heldout]
    if note:
        log.info("%s", note)
    one_process = DistInfo(0, 0, 1, 1, device)
    results = [evaluation.evaluate(model, w, one_process, eval_tokens, batch_size) for w in windows]
    tokens = sum(r.tokens for r in results)
    loss = sum(r.loss * r.tokens for r in results) / tokens
    # one process: its loss is the only rank's
    return Score(
        loss=loss,
        rank_losses=[loss],
        tokens=tokens,
        interrupted=False,
        source=source,
        step=state["step"],
    )


def run(argv: list[str]) -> None:
    config = parse_args(argv, ScoreConfig, TEXT_KEYS)
    result = score(config)
    plural = "" if result.tokens == 1 else "s"
    scored = f"{result.tokens:,} character{plural} scored"
    write(
        f"{config.snapshot_path} (step {result.step}) on {result.source}: {scored}\n"
        f"loss        {result.loss:.6f} nats per character\n"
        f"bpc         {result.bpc:.6f}\n"
        f"perplexity  {result.perplexity:.6f}\n"
    )


def main(argv: list[str] | None = None) -> None:
    command(
        "score",
        "[key=value ...]",
        ScoreConfig,
        __doc__,
        run,
        (DataError, TextError),
        argv,
    )


if __name__ == "__main__":
    main()
