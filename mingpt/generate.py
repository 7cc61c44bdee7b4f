"""Generate text from a snapshot and stream it to stdout.

usage: python -m mingpt.generate [key=value ...]   (or: mingpt-generate [key=value ...])

  snapshot_path=runs/default  snapshot to sample from (local path or fsspec URL): a snapshot
                            file, a sharded snapshot (a directory: its newest published snapshot),
                            or a run directory (its best weights: the lowest held-out loss, beside
                            the snapshot its config names; that snapshot while there are none)
  prompt=                   text to continue, taken verbatim (empty: start of a new line)
  prompt_file=              read the prompt from this file instead (local path or fsspec URL)
  max_new_tokens=500        characters to generate per sample (>= 0)
  temperature=1.0           0 is greedy decoding; higher is more random (0, or >= 1.18e-38)
  top_k=null                sample only from the k most likely characters (>= 1)
  top_p=1.0                 sample only from the most likely characters whose probability reaches top_p, in (0, 1]
  num_samples=1             samples, decoded as one batch, each headed by a separator line;
                            sample 1 streams, the others follow when it ends
  seed=1337                 the same seed (and device) gives the same text; sample i uses seed + i - 1
  device=auto               auto (CUDA if available), cpu or cuda
  use_cache=true            key/value cache: one position's work per new character
  compile=auto              torch.compile the decoding step (CUDA graphs on GPUs; on CPU,
                            one-row matmuls at memory speed): faster per character, but
                            compiling takes seconds; auto: when max_new_tokens is long
                            enough for it to pay on this device type; true or false

The model and its vocabulary come from the snapshot alone. Only the text goes
to stdout; logs and errors go to stderr. A bad value, snapshot or prompt ends
with one line on stderr and exit status 2.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import fsspec
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt.config import ConfigError, GPTConfig, TrainerConfig, check, check_seed, one_of
from mingpt.data import CharTokenizer
from mingpt.decoding import MIN_TEMPERATURE, generate, noise_rows
from mingpt.distributed import pick_device, setup_logging
from mingpt.model import GPT
from mingpt.snapshot import SnapshotError, manager
from mingpt.storage import StorageError, check_regular, reason, storage_errors

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """The prompt cannot be read or does not fit the snapshot's vocabulary."""


class OutputError(ValueError):
    """The text cannot be written to stdout (closed, or a full device)."""


@dataclass
class GenerateConfig:
    snapshot_path: str = "runs/default"
    prompt: str = ""
    prompt_file: str = ""
    max_new_tokens: int = 500
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    num_samples: int = 1
    seed: int = 1337
    device: str = "auto"
    use_cache: bool = True
    compile: str = "auto"

    def __post_init__(self) -> None:
        check(bool(self.snapshot_path), "snapshot_path", "must not be empty")
        check(not (self.prompt and self.prompt_file), "prompt_file", "give prompt or prompt_file, not both")
        check(self.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        check(
            math.isfinite(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
            "temperature", f"must be 0 or a finite number >= {MIN_TEMPERATURE:.3g}, got {self.temperature}",
        )
        check(self.top_k is None or self.top_k >= 1, "top_k", f"must be >= 1 or null, got {self.top_k}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.num_samples >= 1, "num_samples", f"must be >= 1, got {self.num_samples}")
        check_seed(self.seed, "seed")
        self.compile = str(self.compile).lower()  # `compile=true` arrives as the boolean True
        one_of(self.compile, "compile", ("auto", "true", "false"))
        check(self.use_cache or self.compile != "true", "compile", "compiles the cached step: needs use_cache=true")
        one_of(self.device, "device", ("auto", "cpu", "cuda"))


# Free text: taken verbatim from `key=value`, never parsed as YAML (`prompt=ROMEO:`
# would otherwise be a mapping, and `prompt=O, Romeo!` or `${...}` would not survive).
TEXT_KEYS = ("snapshot_path", "prompt", "prompt_file", "device")


def parse_args(argv: list[str], schema: type = GenerateConfig, text_keys: tuple[str, ...] = TEXT_KEYS):
    """`key=value` overrides on the defaults of the dataclass `schema` (GenerateConfig;
    mingpt.score passes its own). OmegaConf rejects unknown keys and wrong types;
    __post_init__ rejects bad values. The `text_keys` take their value verbatim."""
    text, rest = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg}: expected key=value")
        if key in text_keys:
            text[key] = value
        else:
            rest.append(arg)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(rest))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        message = str(e).strip().splitlines()[0]
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key}: {message}" if key and key not in message else message) from None
    return replace(config, **text)


def find_snapshot(path: str) -> str:
    """The best weights of a run directory (a local directory with .hydra/config.yaml),
    beside the snapshot where that run's trainer_config puts it, or that snapshot while
    the run has none; said on stderr. Any other path as given."""
    config_file = os.path.join(path, ".hydra", "config.yaml")
    if "://" in path or not os.path.isfile(config_file):
        return path
    try:
        saved = OmegaConf.load(config_file).get("trainer_config") or {}
        trainer_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig), saved))
    except (OmegaConfBaseException, ConfigError, OSError, ValueError) as e:
        raise SnapshotError(f"run directory {path}: {config_file} cannot be read ({reason(e)})") from None
    found = manager.resolve_path(trainer_config, path)
    best = manager.find_best(found)
    if best:
        log.info("run directory %s: its best weights, %s (the lowest held-out loss; the latest snapshot is %s)",
                 path, best, found)
        return best
    log.info("run directory %s: its snapshot is %s (no best weights written yet)", path, found)
    return found


def load_model(path: str, device: torch.device) -> tuple[GPT, CharTokenizer, dict]:
    """The model and vocabulary of a snapshot (a file, a sharded snapshot's
    directory read in this one process, or a run directory's snapshot), ready
    for inference on `device`."""
    state = manager.read(find_snapshot(path))
    vocab = state.get("vocab")
    try:
        config = GPTConfig(**state["gpt_config"])
        if not isinstance(vocab, str) or len(vocab) != config.vocab_size:
            raise ValueError(f"its vocabulary does not match gpt_config.vocab_size={config.vocab_size}")
        with torch.device("meta"):  # no time spent initialising weights about to be replaced
            model = GPT(config)
        # As training keeps them: float32, whatever precision the file holds.
        weights = {name: tensor.float() for name, tensor in state["model_state"].items()}
        model.load_state_dict(weights, assign=True)
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


def encode_prompt(prompt: str, tokenizer: CharTokenizer) -> torch.Tensor:
    """The prompt's token ids, (1, T); an empty prompt starts a line (CharTokenizer.line_start)."""
    unknown = tokenizer.unknown(prompt)
    if unknown:
        shown = " ".join(repr(c) for c in unknown)
        raise PromptError(f"prompt has characters outside the snapshot's vocabulary: {shown}")
    return tokenizer.encode(prompt or tokenizer.line_start()).long()[None]


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the GPU's free memory, or the
    host's available memory (MemAvailable: free plus reclaimable page cache)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_per_sample(model: GPT, config: GenerateConfig, device: torch.device) -> int:
    """What one more sample of a batch holds while decoding: its random stream and
    the noise drawn ahead from it, its key/value cache, a window's largest
    activations (one layer's MLP and attention scores, twice over), a few rows of
    logits, and its tokens (kept, then joined)."""
    c, item = model.config, next(model.parameters()).element_size()
    stream = len(torch.Generator(device).get_state()) + noise_rows(c.vocab_size) * c.vocab_size * 4
    cache = 2 * c.n_layer * c.block_size * c.n_embd * item if config.use_cache else 0
    activations = 2 * c.block_size * (4 * c.n_embd + c.n_head * c.block_size) * 4
    return stream + cache + activations + 4 * c.vocab_size * 4 + 2 * 8 * config.max_new_tokens


def check_fits(model: GPT, config: GenerateConfig, device: torch.device) -> None:
    """num_samples are decoded as one batch: refuse a batch that cannot fit in memory."""
    need, free = bytes_per_sample(model, config, device), available_memory(device)
    if need * config.num_samples > free:
        total = need * config.num_samples / 2**30
        raise ConfigError(f"num_samples: {config.num_samples:,} samples need about {total:,.1f} GiB on {device}, "
                          f"more than the {free / 2**30:,.1f} GiB available; at most {free // need:,} fit")


def write(text: str) -> None:
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        raise OutputError("stdout is closed: nowhere to write the text")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away, e.g. `| head`: not an error of ours
        raise
    except OSError as e:  # e.g. `>/dev/full`
        raise OutputError(f"cannot write the text to stdout: {e.strerror or e}") from None


# compile=auto compiles the decoding step when a sample has at least this many new
# characters on this device type: where compiling (PyTorch's compile caches warm, as for
# a second invocation) costs less time than it saves. cpu: measured, one sample (a batch
# gains too little there: never); cuda: estimated from the H100 figures of the decoding
# before sampling moved to the device, to be measured again (BENCHMARKS.md).
COMPILE_PAYS_AFTER = {"cpu": 1500, "cuda": 6000}


def should_compile(config: GenerateConfig, device: torch.device) -> bool:
    """compile=true or false as said; auto by the crossover of COMPILE_PAYS_AFTER."""
    if config.compile != "auto":
        return config.compile == "true"
    if not config.use_cache or (device.type == "cpu" and config.num_samples > 1):
        return False
    return config.max_new_tokens >= COMPILE_PAYS_AFTER.get(device.type, math.inf)


def run(config: GenerateConfig) -> None:
    device = pick_device(config.device, key="device")
    model, tokenizer, state = load_model(config.snapshot_path, device)
    prompt = read_prompt(config)
    idx = encode_prompt(prompt, tokenizer).to(device)
    check_fits(model, config, device)
    compile = should_compile(config, device)
    log.info(
        "%s: step %s, %.2fM parameters, block_size %d, on %s, %s cache%s",
        config.snapshot_path, state.get("step", "?"), model.num_params() / 1e6, model.config.block_size,
        device, "with" if config.use_cache else "without", ", compiled step" if compile else "",
    )
    # One random stream per sample, so sample i is the text of a one-sample run with seed + i - 1.
    generators = [torch.Generator(device).manual_seed(config.seed + i) for i in range(config.num_samples)]
    header = "--- sample {} of %d ---\n" % config.num_samples if config.num_samples > 1 else ""
    write(header.format(1) + prompt)
    last, started = prompt[-1:], time.perf_counter()
    rest = []  # the tokens of samples 2.., printed when sample 1 is complete
    tokens = generate(model, idx.expand(config.num_samples, -1), config.max_new_tokens, config.temperature,
                      config.top_k, config.top_p, generators, config.use_cache, compile)
    for chunk in tokens:  # the first character alone, then chunks (one wait for the device each)
        text = tokenizer.decode(chunk[0].tolist())
        write(text)
        last = text[-1]
        rest.append(chunk[1:])
    if last != "\n":
        write("\n")
    for i, new in enumerate(torch.cat(rest, dim=1).tolist() if rest else [[]] * (config.num_samples - 1), 2):
        text = prompt + tokenizer.decode(new)
        write("\n" + header.format(i) + text + ("" if text.endswith("\n") else "\n"))
    seconds = time.perf_counter() - started
    chars = config.max_new_tokens * config.num_samples
    log.info("%d characters in %.2f s (%.1f/s)", chars, seconds, chars / max(seconds, 1e-9))


def command(doc: str, body: Callable[[list[str]], None], errors: tuple[type[BaseException], ...],
            argv: Optional[list[str]] = None) -> None:
    """A command line of mingpt's (mingpt.export, mingpt.score): `--help` prints `doc`;
    `body(argv)` runs with logging on stderr; one of `errors` ends it with one line on
    stderr and exit status 2, Ctrl-C with status 130."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(doc.strip())
        return
    try:
        setup_logging(rank=0)
        body(argv)
    except errors as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if any(arg in ("-h", "--help") for arg in argv):
            write(__doc__.strip() + "\n")
            return
        setup_logging(rank=0)
        run(parse_args(argv))
    except (ConfigError, SnapshotError, StorageError, PromptError, OutputError) as e:
        if isinstance(e, OutputError) and sys.stdout is not None:  # the exit's flush would fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # stdout closed early, e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
