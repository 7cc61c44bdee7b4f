"""Generate text from a snapshot and stream it to stdout.

Only the text goes to stdout; logs and a one-line error (exit status 2) go to stderr
(docs/generation.md)."""

import logging
import time
from dataclasses import dataclass

import fsspec
import torch
from omegaconf import BooleanNode
from omegaconf.errors import ValidationError

from mingpt.command import DEFAULT_RUN, command, find_snapshot, parse_args, write
from mingpt.config import ConfigError, check, check_fields, key
from mingpt.decoding import (
    MIN_TEMPERATURE,
    block_weights,
    can_package,
    generate,
    noise_rows,
    one_row_products_lag,
    package_path,
)
from mingpt.distributed import pick_device
from mingpt.flops import available_memory
from mingpt.model import GPT
from mingpt.snapshot import reader
from mingpt.storage import check_regular, filesystem, reason, storage_errors

log = logging.getLogger(__name__)

# Free text, taken verbatim.
TEXT_KEYS = ("snapshot_path", "prompt", "prompt_file", "device")
# compile=auto compiles the step from this many new characters per sample, where compiling costs
# less than it saves (BENCHMARKS.md). On a CPU, one sample only (a batch gains too little: never).
# "cpu": where one-row products lag (an AMD EPYC: 21 s with cold caches against 2 ms a character
# saved over an eager step on oneDNN); "cpu, products keep up": an Intel Xeon, 17 to 23 s against
# 0.4 ms; "cuda": the median of four measurements, 10,000 to 15,000 (an H100 and an H200: 15 to
# 17.5 s with cold caches against 1.1 to 1.4 ms). A CPU step compiled by an earlier run is loaded
# whatever the length.
COMPILE_PAYS_AFTER = {"cpu": 10000, "cpu, products keep up": 50000, "cuda": 12000}
# The host memory that reading and encoding a prompt_file takes at its peak, per byte of the file:
# measured for ASCII, the most characters a byte (its text, and the encoding's arrays of each
# character's code point and id).
PROMPT_BYTES_PER_BYTE = 25
GIB = 2**30


class PromptError(ValueError):
    """The prompt cannot be read or does not fit the snapshot's vocabulary."""


@dataclass
class GenerateConfig:
    snapshot_path: str = key(DEFAULT_RUN, f"the snapshot to sample from: {reader.HELP}")
    prompt: str = key(
        "",
        "text to continue, taken verbatim (empty: start of a new line; with no newline in the "
        "vocabulary, after its first character)",
    )
    prompt_file: str = key("", "read the prompt from this file instead (local path or fsspec URL)")
    max_new_tokens: int = key(500, "characters to generate per sample", valid=">= 0")
    temperature: float = key(
        1.0,
        f"0 is greedy decoding; higher is more random (below {MIN_TEMPERATURE:.3g}, as "
        f"{MIN_TEMPERATURE:.3g}: the most likely character, as greedy)",
        valid=">= 0",
    )
    top_k: int | None = key(None, "sample only from the k most likely characters", valid=">= 1")
    top_p: float = key(
        1.0,
        "sample only from the most likely characters whose probability reaches top_p",
        valid="(0, 1]",
    )
    num_samples: int = key(
        1,
        "samples, decoded as one batch, each headed by a separator line; sample 1 streams, the "
        "others follow when it ends",
        valid=">= 1",
    )
    seed: int = key(
        1337,
        "the same seed (and device) gives the same text; sample i uses seed+i-1",
        valid="[0, 2**63)",
    )
    device: str = key(
        "auto", "auto (CUDA if available), cpu or cuda", valid=("auto", "cpu", "cuda")
    )
    use_cache: bool = key(True, "key/value cache: one position's work per new character")
    compile: str = key(
        "auto",
        "compile the decoding step: faster per character, but compiling takes seconds (on a CPU "
        "once per model shape and machine: later runs load it); auto: where a compiled step is "
        "kept, or max_new_tokens is long enough for compiling to pay on this device; or a boolean "
        "as use_cache takes one (true, yes, on, 1; false, no, off, 0)",
    )

    def __post_init__(self) -> None:
        # `compile=yes` arrives as the string 'True', `compile=1` as '1'
        self.compile = str(self.compile).lower()
        if self.compile != "auto":
            try:
                self.compile = str(BooleanNode().validate_and_convert(self.compile)).lower()
            except ValidationError:
                raise ConfigError(
                    f"compile: {self.compile!r} is neither auto nor a boolean (true, yes, on, 1; "
                    "false, no, off, 0)"
                ) from None
        check_fields(self)
        check(bool(self.snapshot_path), "snapshot_path", "must not be empty")
        check(
            not (self.prompt and self.prompt_file),
            "prompt_file",
            "give prompt or prompt_file, not both",
        )
        # sample i must be what a one-sample run with seed+i-1 gives, and such a seed is valid
        last = self.seed + self.num_samples - 1
        check(
            last < 2**63,
            "seed",
            f"sample {self.num_samples} would use seed {last}, above 2**63 - 1",
        )
        check(
            self.use_cache or self.compile != "true",
            "compile",
            "compiles the cached step: needs use_cache=true",
        )


def check_prompt_fits(path: str) -> None:
    """Refuse a prompt_file too large to read and encode in the host's memory by its size, before it
    is read: read, it ended in a MemoryError's traceback (or the kernel's kill)."""
    fs, p = filesystem(path, "prompt_file")
    try:
        size = fs.size(p)
    # missing or unreadable: reading it says which
    except (*storage_errors(), ValueError):
        return
    # A server that does not say.
    if size is None:
        return
    need = PROMPT_BYTES_PER_BYTE * size
    free = available_memory(torch.device("cpu"))
    if need <= free:
        return
    raise ConfigError(
        f"prompt_file: {path} has {size / GIB:,.1f} GiB; reading and encoding it takes about "
        f"{need / GIB:,.1f} GiB, more than the {free / GIB:,.1f} GiB available"
    )


def read_prompt(config: GenerateConfig) -> str:
    if not config.prompt_file:
        return config.prompt
    check_regular(config.prompt_file, "prompt_file")
    check_prompt_fits(config.prompt_file)
    try:
        # newline="": the text as it is, a \r\n included; utf-8-sig: a byte-order mark at the
        # start is not text (the corpus is read so)
        with fsspec.open(config.prompt_file, "r", encoding="utf-8-sig", newline="") as f:
            return f.read()
    except FileNotFoundError:
        raise PromptError(f"prompt_file not found: {config.prompt_file}") from None
    # UnicodeDecodeError is a ValueError.
    except (*storage_errors(), ValueError, ImportError) as e:
        raise PromptError(f"prompt_file {config.prompt_file} cannot be read: {reason(e)}") from None


def check_fits(model: GPT, config: GenerateConfig, device: torch.device) -> None:
    """Refuse a generation that cannot fit in memory, naming the key to change. One sample holds its
    random stream and the noise drawn ahead, its KV cache, a window's largest activations (one
    layer's MLP and attention scores, twice), a few rows of logits, and its tokens: two int64 per
    new character (generate's, and their concatenation that run decodes). Several samples on a CPU
    may also hold a copy of the blocks' weights, once, that their products multiply by
    (decoding.step_linear)."""
    c = model.config
    item = next(model.parameters()).element_size()
    stream = len(torch.Generator(device).get_state()) + noise_rows(c.vocab_size) * c.vocab_size * 4
    cache = 0
    if config.use_cache:
        cache = 2 * c.n_layer * c.block_size * c.n_embd * item
    activations = 2 * c.block_size * (4 * c.n_embd + c.n_head * c.block_size) * 4
    fixed = stream + cache + activations + 4 * c.vocab_size * 4
    per_token = 2 * torch.long.itemsize
    tokens = per_token * config.max_new_tokens
    free = available_memory(device)
    if fixed + tokens > free:
        most = max(0, (free - fixed) // per_token)
        raise ConfigError(
            f"max_new_tokens: {config.max_new_tokens:,} characters need about "
            f"{(fixed + tokens) / GIB:,.1f} GiB on {device}, more than the {free / GIB:,.1f} GiB "
            f"available; at most {most:,} fit"
        )
    copy = 0
    if config.num_samples > 1 and device.type == "cpu":
        copy = sum(w.numel() * w.element_size() for w in block_weights(model))
    need = (fixed + tokens) * config.num_samples + copy
    if need > free:
        most = max(1, (free - copy) // (fixed + tokens))
        raise ConfigError(
            f"num_samples: {config.num_samples:,} samples need about {need / GIB:,.1f} GiB on "
            f"{device}, more than the {free / GIB:,.1f} GiB available; at most {most:,} fit"
        )


def compile_pays_after(device: torch.device) -> int:
    """The characters per sample from which compile=auto compiles on device (a CPU or a GPU, as
    pick_device gives)."""
    kind = device.type
    if kind == "cpu" and not one_row_products_lag():
        kind = "cpu, products keep up"
    return COMPILE_PAYS_AFTER[kind]


def kept_step(model: GPT, device: torch.device, batch_size: int) -> bool:
    """Whether an earlier run kept a compiled step for model's shape and batch_size on this CPU."""
    return device.type == "cpu" and can_package() and package_path(model, batch_size).exists()


def should_compile(config: GenerateConfig, model: GPT, device: torch.device) -> bool:
    if config.compile != "auto":
        return config.compile == "true"
    # On a CPU a batch gains too little from compiling (measured).
    if not config.use_cache or (device.type == "cpu" and config.num_samples > 1):
        return False
    # A step compiled by an earlier run loads in milliseconds.
    if kept_step(model, device, 1):
        return True
    if config.max_new_tokens < compile_pays_after(device):
        if device.type == "cpu" and can_package():
            log.info(
                "compile=true compiles the decoding step for this model shape once (up to a "
                "minute): later runs on this machine load it, and decode faster (BENCHMARKS.md)"
            )
        return False
    return True


def run(config: GenerateConfig) -> None:
    device = pick_device(config.device, key="device")
    # Which snapshot of a run directory is read is said once the prompt fits it: a refusal is the
    # only line.
    snapshot, note = find_snapshot(config.snapshot_path, "snapshot_path")
    model, tokenizer, state = reader.load_model(snapshot, device)
    prompt = read_prompt(config)
    unknown = tokenizer.unknown(prompt)
    if unknown:
        raise PromptError(
            "prompt has characters outside the snapshot's vocabulary: "
            + " ".join(map(repr, unknown))
        )
    idx = tokenizer.encode(prompt or tokenizer.line_start()).long()[None].to(device)
    check_fits(model, config, device)
    if note:
        log.info("%s", note)
    compile = should_compile(config, model, device)
    log.info(
        "%s: step %s, %.2fM parameters, block_size %d, on %s, %s cache%s",
        config.snapshot_path,
        state["step"],
        model.num_params() / 1e6,
        model.config.block_size,
        device,
        "with" if config.use_cache else "without",
        ", compiled step" if compile else "",
    )
    n = config.num_samples
    # where this run compiles the step, compiling is in the closing line's time
    compiling = compile and not kept_step(model, device, n)
    # One random stream per sample, so that sample i is the text of a one-sample run with seed + i -
    # 1.
    generators = [torch.Generator(device).manual_seed(config.seed + i) for i in range(n)]
    header = ""
    if n > 1:
        header = f"--- sample {{}} of {n} ---\n"
    write(header.format(1) + prompt)
    started = time.perf_counter()
    chunks = [idx[:, :0].expand(n, -1)]
    new_tokens = generate(
        model,
        idx.expand(n, -1),
        config.max_new_tokens,
        config.temperature,
        config.top_k,
        config.top_p,
        generators,
        config.use_cache,
        compile,
    )
    # Sample 1 streams: its first character alone, then chunks.
    for chunk in new_tokens:
        write(tokenizer.decode(chunk[0].tolist()))
        chunks.append(chunk)
    # The other samples follow when it ends, decoded a piece at a time: whole, a sample's list of
    # ids and its text would hold some 20 bytes a character beyond what check_fits counts.
    tokens = torch.cat(chunks, dim=1)
    for i in range(n):
        if i:
            write("\n" + header.format(i + 1) + prompt)
            for piece in tokens[i].split(1 << 14):
                write(tokenizer.decode(piece.tolist()))
        # a sample of no new character ends as its prompt does
        last = tokenizer.decode(tokens[i, -1:].tolist()) or prompt[-1:]
        if last != "\n":
            write("\n")
    # The closing line: how many characters in how long, and whether compiling the step is in
    # that time.
    seconds = time.perf_counter() - started
    chars = config.max_new_tokens * n
    plural = "" if chars == 1 else "s"
    rate = chars / max(seconds, 1e-9)
    included = ""
    if compiling:
        included = ", compiling the step included"
    log.info("%d character%s in %.2f s (%.1f/s%s)", chars, plural, seconds, rate, included)


def main(argv: list[str] | None = None) -> None:
    command(
        "generate",
        "[key=value ...]",
        GenerateConfig,
        __doc__,
        lambda argv: run(parse_args(argv, GenerateConfig, TEXT_KEYS)),
        (PromptError,),
        argv,
    )


if __name__ == "__main__":
    main()
