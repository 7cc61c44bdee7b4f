"""Generate text from a snapshot and stream it to stdout (also: mingpt-generate).

Only the text goes to stdout; logs and a one-line error (exit status 2) go to stderr (docs/generation.md)."""

import logging
import math
import os
import sys
import time
from dataclasses import dataclass

import fsspec
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt.command import command, parse_args
from mingpt.config import ConfigError, GPTConfig, TrainerConfig, check, check_seed, key, one_of
from mingpt.data import CharTokenizer
from mingpt.decoding import MIN_TEMPERATURE, generate, noise_rows
from mingpt.distributed import pick_device
from mingpt.model import GPT
from mingpt.snapshot import SnapshotError, manager
from mingpt.storage import StorageError, check_regular, reason, storage_errors

log = logging.getLogger(__name__)

EXPECTED = "expected a snapshot directory, a snapshot file (export --format snapshot writes one) or a run directory"
TEXT_KEYS = ("snapshot_path", "prompt", "prompt_file", "device")  # free text, taken verbatim
SNAPSHOT_HELP = (
    "a snapshot file, a sharded snapshot's directory (its newest published snapshot, or one step-... "
    "directory) or a run directory (its best weights, else its snapshot); local path or fsspec URL"
)
# compile=auto compiles the step from this many new characters per sample, where compiling (caches warm) costs less
# than it saves. cpu: measured, one sample (a batch gains too little: never); cuda: estimated (BENCHMARKS.md).
COMPILE_PAYS_AFTER = {"cpu": 1500, "cuda": 6000}


class PromptError(ValueError):
    """The prompt cannot be read or does not fit the snapshot's vocabulary."""


class OutputError(ValueError):
    """The text cannot be written to stdout (closed, or a full device)."""


@dataclass
class GenerateConfig:
    snapshot_path: str = key("runs/default", f"the snapshot to sample from: {SNAPSHOT_HELP}")
    prompt: str = key("", "text to continue, taken verbatim (empty: start of a new line)")
    prompt_file: str = key("", "read the prompt from this file instead (local path or fsspec URL)")
    max_new_tokens: int = key(500, "characters to generate per sample, >= 0")
    temperature: float = key(
        1.0, f"0 is greedy decoding; higher is more random (0, or >= {MIN_TEMPERATURE:.3g})"
    )
    top_k: int | None = key(None, "sample only from the k most likely characters, >= 1")
    top_p: float = key(
        1.0,
        "sample only from the most likely characters whose probability reaches top_p, in (0, 1]",
    )
    num_samples: int = key(
        1,
        "samples, decoded as one batch, each headed by a separator line; sample 1 streams, "
        "the others follow when it ends",
    )
    seed: int = key(1337, "the same seed (and device) gives the same text; sample i uses seed+i-1")
    device: str = key("auto", "auto (CUDA if available), cpu or cuda")
    use_cache: bool = key(True, "key/value cache: one position's work per new character")
    compile: str = key(
        "auto",
        "torch.compile the decoding step: faster per character, but compiling takes seconds; "
        "auto: when max_new_tokens is long enough for it to pay on this device type; "
        "true or false",
    )

    def __post_init__(self) -> None:
        check(bool(self.snapshot_path), "snapshot_path", "must not be empty")
        check(
            not (self.prompt and self.prompt_file),
            "prompt_file",
            "give prompt or prompt_file, not both",
        )
        check(
            self.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0, got {self.max_new_tokens}"
        )
        check(
            math.isfinite(self.temperature)
            and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
            "temperature",
            f"must be 0 or a finite number >= {MIN_TEMPERATURE:.3g}, got {self.temperature}",
        )
        check(
            self.top_k is None or self.top_k >= 1,
            "top_k",
            f"must be >= 1 or null, got {self.top_k}",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.num_samples >= 1, "num_samples", f"must be >= 1, got {self.num_samples}")
        check_seed(self.seed, "seed")
        self.compile = str(self.compile).lower()  # `compile=true` arrives as the boolean True
        one_of(self.compile, "compile", ("auto", "true", "false"))
        check(
            self.use_cache or self.compile != "true",
            "compile",
            "compiles the cached step: needs use_cache=true",
        )
        one_of(self.device, "device", ("auto", "cpu", "cuda"))


def find_snapshot(path: str) -> str:
    """A run directory's (a local directory with .hydra/config.yaml) best weights, else its snapshot where its
    trainer_config puts it, said on stderr; any other path as given. A directory that cannot hold a snapshot (empty,
    an export) or a run directory with none yet is refused."""
    config_file = os.path.join(path, ".hydra", "config.yaml")
    if "://" in path or not os.path.isfile(config_file):
        from mingpt.export import WEIGHTS  # imported here: mingpt.export imports this module

        names = os.listdir(path) if "://" not in path and os.path.isdir(path) else None
        if names == []:
            raise SnapshotError(f"{path} is an empty directory; {EXPECTED}")
        if names and WEIGHTS in names:
            raise SnapshotError(
                f"{path} is an export in safetensors/transformers format, not a snapshot; {EXPECTED}"
            )
        return path
    try:
        saved = OmegaConf.load(config_file).get("trainer_config") or {}
        trainer_config = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(TrainerConfig), saved)
        )
    except (OmegaConfBaseException, ConfigError, OSError, ValueError) as e:
        raise SnapshotError(
            f"run directory {path}: {config_file} cannot be read ({reason(e)})"
        ) from None
    found = manager.resolve_path(trainer_config, path)
    if best := manager.find_best(found):
        log.info(
            "run directory %s: its best weights, %s (the lowest held-out loss; the latest snapshot is %s)",
            path,
            best,
            found,
        )
        return best
    if not manager.has_snapshot(found):
        old = os.path.join(path, manager.OLD_DEFAULT_PATH)  # an older ddp run's single file
        if trainer_config.snapshot_path or not os.path.isfile(old):
            raise SnapshotError(
                f"{path} is a run directory with no snapshot yet (it saves to {found})"
            )
        found = old
    log.info("run directory %s: its snapshot is %s (no best weights written yet)", path, found)
    return found


def load_model(path: str, device: torch.device) -> tuple[GPT, CharTokenizer, dict]:
    """The model (float32, in eval mode on `device`), vocabulary and state of the snapshot at `path`."""
    state = manager.read(find_snapshot(path))
    vocab = state.get("vocab")
    try:
        config = GPTConfig(**state["gpt_config"])
        if not isinstance(vocab, str) or len(vocab) != config.vocab_size:
            raise ValueError(
                f"its vocabulary does not match gpt_config.vocab_size={config.vocab_size}"
            )
        with torch.device("meta"):  # no time spent initialising weights about to be replaced
            model = GPT(config)
        model.load_state_dict(
            {name: t.float() for name, t in state["model_state"].items()}, assign=True
        )
    except (TypeError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"snapshot {path} cannot be used: {reason(e)}") from None
    return model.to(device).eval(), CharTokenizer(vocab), state


def read_prompt(config: GenerateConfig) -> str:
    if not config.prompt_file:
        return config.prompt
    check_regular(config.prompt_file, "prompt_file")
    try:
        with fsspec.open(config.prompt_file, "r", encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise PromptError(f"prompt_file not found: {config.prompt_file}") from None
    except (*storage_errors(), ValueError, ImportError) as e:  # UnicodeDecodeError is a ValueError
        raise PromptError(f"prompt_file {config.prompt_file} cannot be read: {reason(e)}") from None


def check_fits(model: GPT, config: GenerateConfig, device: torch.device) -> None:
    """Refuse a batch of num_samples that cannot fit in the GPU's free memory or the host's MemAvailable (free
    plus reclaimable page cache). One sample holds its random stream and the noise drawn ahead, its KV cache, a
    window's largest activations (one layer's MLP and attention scores, twice), a few rows of logits, its tokens."""
    c, item = model.config, next(model.parameters()).element_size()
    stream = len(torch.Generator(device).get_state()) + noise_rows(c.vocab_size) * c.vocab_size * 4
    cache = 2 * c.n_layer * c.block_size * c.n_embd * item if config.use_cache else 0
    activations = 2 * c.block_size * (4 * c.n_embd + c.n_head * c.block_size) * 4
    need = stream + cache + activations + 4 * c.vocab_size * 4 + 2 * 8 * config.max_new_tokens
    try:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            with open("/proc/meminfo") as f:
                free = next(
                    int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")
                )
    except (OSError, StopIteration, ValueError):
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need * config.num_samples > free:
        total = need * config.num_samples / 2**30
        raise ConfigError(
            f"num_samples: {config.num_samples:,} samples need about {total:,.1f} GiB on {device}, "
            f"more than the {free / 2**30:,.1f} GiB available; at most {free // need:,} fit"
        )


def write(text: str) -> None:
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        raise OutputError("stdout is closed: nowhere to write the text")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:  # e.g. `>/dev/full`; BrokenPipeError (`| head`) is not an error of ours
        if isinstance(e, BrokenPipeError):
            raise
        # the exit's flush would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise OutputError(f"cannot write the text to stdout: {e.strerror or e}") from None


def should_compile(config: GenerateConfig, device: torch.device) -> bool:
    if config.compile != "auto":
        return config.compile == "true"
    return (
        config.use_cache
        and not (device.type == "cpu" and config.num_samples > 1)
        and config.max_new_tokens >= COMPILE_PAYS_AFTER.get(device.type, math.inf)
    )


def run(config: GenerateConfig) -> None:
    device = pick_device(config.device, key="device")
    model, tokenizer, state = load_model(config.snapshot_path, device)
    prompt = read_prompt(config)
    if unknown := " ".join(repr(c) for c in tokenizer.unknown(prompt)):
        raise PromptError(f"prompt has characters outside the snapshot's vocabulary: {unknown}")
    idx = tokenizer.encode(prompt or tokenizer.line_start()).long()[None].to(device)
    check_fits(model, config, device)
    compile = should_compile(config, device)
    log.info(
        "%s: step %s, %.2fM parameters, block_size %d, on %s, %s cache%s",
        config.snapshot_path,
        state.get("step", "?"),
        model.num_params() / 1e6,
        model.config.block_size,
        device,
        "with" if config.use_cache else "without",
        ", compiled step" if compile else "",
    )
    # One random stream per sample, so sample i is the text of a one-sample run with seed + i - 1.
    generators = [
        torch.Generator(device).manual_seed(config.seed + i) for i in range(config.num_samples)
    ]
    header = "--- sample {} of %d ---\n" % config.num_samples if config.num_samples > 1 else ""
    write(header.format(1) + prompt)
    started, chunks = time.perf_counter(), [idx[:, :0].expand(config.num_samples, -1)]
    for chunk in generate(
        model,
        idx.expand(config.num_samples, -1),
        config.max_new_tokens,
        config.temperature,
        config.top_k,
        config.top_p,
        generators,
        config.use_cache,
        compile,
    ):
        write(tokenizer.decode(chunk[0].tolist()))  # the first character alone, then chunks
        chunks.append(chunk)
    for i, new in enumerate(torch.cat(chunks, dim=1).tolist()):  # sample 1 was written as it came
        text = prompt + tokenizer.decode(new)
        write(
            ("\n" + header.format(i + 1) + text if i else "")
            + ("" if text.endswith("\n") else "\n")
        )
    seconds, chars = time.perf_counter() - started, config.max_new_tokens * config.num_samples
    log.info("%d characters in %.2f s (%.1f/s)", chars, seconds, chars / max(seconds, 1e-9))


def main(argv: list[str] | None = None) -> None:
    command(
        "python -m mingpt.generate [key=value ...]",
        GenerateConfig,
        __doc__,
        lambda argv: run(parse_args(argv, GenerateConfig, TEXT_KEYS)),
        (ConfigError, SnapshotError, StorageError, PromptError, OutputError),
        argv,
    )


if __name__ == "__main__":
    main()
