"""Decoding: sampling from a GPT (temperature, top-k, top-p) with or without the KV cache, the same
windows either way (docs/generation.md); on the device, never waiting for it per token: the
exponential race on noise drawn ahead."""

import contextlib
import copy
import functools
import hashlib
import logging
import math
import os
import platform
import tempfile
import time
import timeit
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mingpt import model as model_code
from mingpt.model import GPT, KVCache
from mingpt.storage import atomic_open, reason, user_cache_dir

log = logging.getLogger(__name__)

# the smallest normal float32: logits / it is no nan
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
# The smallest E = -log(1 - U) of a uniform float32 draw U above 0: a CPU's draws are multiples of
# 2**-24 (24 random bits), and E is about U there.
MIN_EXPONENTIAL = 2.0**-24
# Token i of a generation takes noise row i % rows of the block drawn for tokens i - i % rows
# onward, whatever the path or chunk size; a block holds NOISE_ROWS tokens' worth per sample, fewer
# for a large vocabulary (noise_rows).
NOISE_ROWS = 128
NOISE_ELEMENTS = 1 << 16  # at most this many noise values per sample held at once
CHUNK_TOKENS = 64  # the first token is yielded alone; later ones in chunks of up to this many,
CHUNK_SECONDS = 0.1  # or fewer once this long has passed since the last chunk
STOP_CHECK_EVERY = 16  # tokens of a stoppable sample between two looks for a stop request

Generators = torch.Generator | Sequence[torch.Generator] | None


def noise_rows(vocab_size: int) -> int:
    """Tokens of noise drawn at once per sample: it depends on the vocabulary alone, so that the
    text does too."""
    return max(1, min(NOISE_ROWS, NOISE_ELEMENTS // vocab_size))


def draw_noise(noise: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """Fill `noise` (B, rows, vocab) in place with standard Gumbel noise, -log(E) with E ~ Exp(1),
    from one generator for the batch, or one per row (row b then holds what a batch of one draws
    with its generator)."""
    if isinstance(generator, (list, tuple)):
        for part, g in zip(noise, generator, strict=True):
            part.uniform_(generator=g)
    else:
        noise.uniform_(generator=generator)
    return gumbel_(noise)


def gumbel_(uniform: torch.Tensor) -> torch.Tensor:
    """Turn draws U of a float32 uniform on [0, 1) into Gumbel noise -log(E), E = -log(1 - U), in
    place. E is at least MIN_EXPONENTIAL, so U = 0 counts as the next draw up and the noise is at
    most 16.6: were E only kept from 0 (float32's tiny), U = 0 would give a noise of 87, and a
    token of any probability above e**-87 would beat the most likely one once in 2**24 draws."""
    return uniform.neg_().log1p_().neg_().clamp_min_(MIN_EXPONENTIAL).log_().neg_()


def pick(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The next token (B, 1) from last-position logits (B, vocab) and Gumbel noise (B, vocab):
    argmax(log probs - log E), token k with probability probs[k]. temperature 0 is greedy (the noise
    is not read); top_k keeps the k most likely tokens; top_p the fewest most likely whose
    probability reaches top_p (at least one); of tokens tied at the cut, those of lower id."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # Shifted so the largest is 0: scaled, they are 0 or negative (-inf at worst), never inf or nan.
    shifted = logits.float()
    shifted = shifted - shifted.amax(dim=-1, keepdim=True)
    logits = shifted / max(temperature, MIN_TEMPERATURE)
    # Which tokens are the most likely is read from the logits before they are scaled: a large
    # temperature rounds their differences to ties (above float32's largest number, all to 0), and
    # top_k and top_p then kept any tokens, not the most likely. Tokens tied there rank by id (a
    # stable sort): the order a sort leaves ties in is up to its algorithm, which differs by device
    # and torch version.
    top_p_cuts = top_p is not None and top_p < 1.0
    if top_k is not None or top_p_cuts:
        order = shifted.argsort(dim=-1, descending=True, stable=True)
        ranked = logits.gather(-1, order)
        if top_k is not None:
            ranked[..., top_k:] = float("-inf")
        if top_p_cuts:
            probs = torch.softmax(ranked, dim=-1)
            # the tokens before it already reach top_p
            drop = probs.cumsum(dim=-1) - probs >= top_p
            # The most likely is kept: a top_p below float32's range compares as 0, and dropped all.
            drop[..., 0] = False
            ranked = ranked.masked_fill(drop, float("-inf"))
        logits = logits.scatter(-1, order, ranked)
    return (logits + noise).argmax(dim=-1, keepdim=True)


def next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: Generators = None,
) -> torch.Tensor:
    """pick, with one row of noise drawn now (generate draws it ahead, in blocks)."""
    noise = torch.empty(logits.size(0), logits.size(-1), device=logits.device)
    if temperature != 0:
        draw_noise(noise, generator)
    return pick(logits, noise, temperature, top_k, top_p)


# On CPU, one-row matrix products as inductor reductions: BLAS streams the weights at a quarter to a
# third of the memory's speed, the reduction at close to it (BENCHMARKS.md).
CPU_DECODING_OPTIONS = {"post_grad_fusion_options": {"decompose_mm_pass": {}}}


def compile_for_decoding(
    fn: Callable, device: torch.device, static: Sequence[torch.Tensor] = ()
) -> Callable:
    """torch.compile of a fixed-shape decoding function: CUDA graphs on GPUs, memory-speed
    reductions on CPU. The graphs update the tensors of `static` in place: their addresses stay."""
    if device.type == "cuda":
        for t in static:
            torch._dynamo.mark_static_address(t)
        return torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
    return torch.compile(fn, fullgraph=True, dynamic=False, options=CPU_DECODING_OPTIONS)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear computed by oneDNN (the op of inductor's CPU code), not by the BLAS."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def one_row_seconds() -> dict[str, float]:
    """This CPU's time to multiply one row by a 2048 x 2048 matrix, by the BLAS ("blas") and by
    oneDNN ("onednn"; inf where it is missing or disagrees), and to read the matrix ("read"). The
    fastest of five runs each: the ones least disturbed by other work. Measured once per process,
    in about 50 ms."""
    # 16 MB: more than a core's L2 cache holds. Ones: torch's random stream is left as it was.
    weight = torch.ones(2048, 2048)
    row = torch.ones(1, 2048)
    seconds = {
        "blas": min(timeit.repeat(lambda: F.linear(row, weight), number=1, repeat=5)),
        "read": min(timeit.repeat(weight.sum, number=1, repeat=5)),
        "onednn": math.inf,
    }
    try:
        agrees = torch.equal(onednn_linear(row, weight), F.linear(row, weight))
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        agrees = False
    if agrees:
        product = functools.partial(onednn_linear, row, weight)
        seconds["onednn"] = min(timeit.repeat(product, number=1, repeat=5))
    return seconds


def one_row_products_lag() -> bool:
    """Whether this CPU's BLAS multiplies one row by a matrix at under half the speed at which it
    reads the matrix. A compiled step pays on a CPU only then: its products are inductor's
    reductions, at the reading speed. MKL on an AMD EPYC ran at a quarter of it, and compiling
    made decoding 2.7x faster; on Intel Xeons the products run at the reading speed, and compiling
    saved at most a fifth of a character's time, for 7 to 17 s of compiling (BENCHMARKS.md)."""
    seconds = one_row_seconds()
    return seconds["blas"] > 2 * seconds["read"]


def batch_copies(model: GPT, rows: int) -> Callable | None:
    """Where the BLAS multiplies one row: the blocks' products for `rows` rows by a copy of their
    weights, where this CPU multiplies by one at least a fifth faster than F.linear by the weights
    (else None). The faster of two copies: stored transposed (in_features x out_features), for the
    BLAS, or packed for `rows` rows by oneDNN, where oneDNN agrees with F.linear (one_row_seconds).
    MKL on an Intel Xeon took 0.7x the time for 4 to 16 rows by the transposed copy, and longer
    for 2 or 3; on an AMD EPYC with AVX2, whose one-row products came out on the BLAS's side in
    some runs, oneDNN's packed copy made 16 samples' step 0.83x (BENCHMARKS.md).

    Timed on all of the blocks' products, the weights streamed from memory as a step streams them,
    the fastest of five passes each: about a quarter of a second for 16 rows at 6/6/384. One copy
    is held at a time: the faster is made again, not kept beside the other."""
    params = block_weights(model)
    weights = [p.detach() for p in params]
    # ones: torch's random stream is left as it was
    inputs = [torch.ones(rows, w.size(1)) for w in weights]

    def seconds(product: Callable, matrices: list[torch.Tensor]) -> float:
        def products() -> None:
            for x, w in zip(inputs, matrices, strict=True):
                product(x, w)

        return min(timeit.repeat(products, number=1, repeat=5))

    def transposed() -> list[torch.Tensor]:
        return [w.t().contiguous().t() for w in weights]

    copies = {F.linear: transposed, onednn_linear: lambda: packed(weights, rows)}
    with without_onednn():  # as the step multiplies
        plain = seconds(F.linear, weights)
        timed = {F.linear: seconds(F.linear, transposed())}
        if one_row_seconds()["onednn"] < math.inf:
            # a torch without the op, or that refuses the shape
            with contextlib.suppress(AttributeError, RuntimeError):
                timed[onednn_linear] = seconds(onednn_linear, packed(weights, rows))
    fastest = min(timed, key=timed.__getitem__)
    if timed[fastest] >= 0.8 * plain:
        return None
    return by_copy(fastest, params, copies[fastest]())


def step_linear(model: GPT, batch_size: int = 1) -> Callable:
    """The matrix product of an eager cached step for batch_size rows on a CPU: oneDNN's where it
    multiplies one row at least a quarter faster than the BLAS (MKL on an AMD EPYC: 1.8x, and
    decoding 1.5x faster, BENCHMARKS.md), else F.linear. Only for a model of plain float32
    parameters: not a sharded model's, whose parameters are DTensors.

    For several rows, oneDNN multiplies by a copy of the blocks' weights that it packed once for
    that many rows: 16 rows' products in two thirds of the time, the plain weights' products up to
    rounding (bitwise with AVX-512 kernels, not with oneDNN's AVX2 ones). Where the BLAS multiplies
    one row, several go by the faster copy where one is faster (batch_copies). Either copy costs the
    weights' size in memory for the generation; one row gains nothing from it."""
    weight = model.lm_head.weight
    if (
        type(weight) is not nn.Parameter
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
    ):
        return F.linear
    seconds = one_row_seconds()
    if seconds["onednn"] >= 0.8 * seconds["blas"]:
        if batch_size > 1:
            batched = batch_copies(model, batch_size)
            if batched is not None:
                return batched
        return F.linear
    if batch_size == 1:
        return onednn_linear
    weights = block_weights(model)
    try:
        copies = packed(weights, batch_size)
    except (AttributeError, RuntimeError):  # a torch without the op, or that refuses the shape
        return onednn_linear
    return by_copy(onednn_linear, weights, copies)


def block_weights(model: GPT) -> list[torch.Tensor]:
    """The blocks' weight matrices: the products a step's time goes to, and what a copy of them
    holds."""
    return [p for p in model.h.parameters() if p.dim() == 2]


def packed(weights: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """oneDNN's copy of each weight, packed for products of `rows` rows (AttributeError or
    RuntimeError: a torch without the op, or one that refuses the shape)."""
    return [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]


def by_copy(product: Callable, weights: list[torch.Tensor], copies: list[torch.Tensor]) -> Callable:
    """product(x, weight, bias) by the copy of each of `weights`, found by the weight's identity:
    the step passes each block's own parameters; any other weight goes as it is."""
    by_id = dict(zip(map(id, weights), copies, strict=True))
    return lambda x, weight, bias=None: product(x, by_id.get(id(weight), weight), bias)


def decode_step(
    forward: Callable,
    token: torch.Tensor,
    pos: torch.Tensor,
    cache: KVCache,
    noise: torch.Tensor,
    row: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    """One cached step on the device: the token (B, 1) at pos is replaced by the next, sampled with
    noise row `row` from the logits of forward(token, pos, cache) (GPT.step's), and pos and row move
    on. Nothing is read back and no shape changes, so it compiles to one graph."""
    logits = forward(token, pos, cache)
    token.copy_(pick(logits, noise.index_select(1, row).squeeze(1), temperature, top_k, top_p))
    pos.add_(1)
    row.add_(1)


# ---------------------------------------------------------------- a compiled step kept on disk
# On a CPU, the compiled step is an AOTInductor package: compiled once per shape, batch size, dtype,
# torch version, CPU and step code, kept under the user's cache directory, and loaded by later runs
# in milliseconds, where torch.compile would trace and compile again for seconds. The weights are
# not in it: any snapshot of the shape feeds it its own.


CPUINFO = Path("/proc/cpuinfo")
CPU_FACTS = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")


class _Step(nn.Module):
    """GPT.step over the cache's tensors, as arguments: what torch.export traces."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, token, pos, k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
        return self.model.step(token, pos, KVCache(k, v))


def can_package() -> bool:
    """Whether this torch loads AOTInductor packages whose weights are given at load time, by
    reference."""
    # torch 2.11 (2.11.0+cu130, on an H100 and an H200) has the loader, and ended the process with a
    # segmentation fault loading a package this module built; 2.13, which mingpt needs, loads it.
    if torch.__version__ < "2.13":
        return False
    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    return loader is not None and "user_managed" in (loader.load_constants.__doc__ or "")


def by_reference(model: GPT) -> bool:
    """Whether a package can compute with weights given at load time: inductor writes a 1-D tensor
    of at most 8 elements into the code as numbers (GraphLowering.can_inline_constant), so the step
    of a model with n_embd <= 8 would keep the weights it was compiled with."""
    return all(p.dim() != 1 or p.numel() > 8 for p in model.parameters())


def package_path(model: GPT, batch_size: int, cache_dtype: torch.dtype | None = None) -> Path:
    """Where the package of model's step for batch_size rows, a cache in cache_dtype (None: the
    parameters'), is kept: a name derived from everything the compiled code depends on. Inductor
    compiles for this CPU's instruction set (-march=native)."""
    dtype = next(model.parameters()).dtype
    cpu = [platform.processor()]
    with contextlib.suppress(OSError):  # the first CPU's model and instruction sets, not its clock
        for line in CPUINFO.read_text().split("\n\n")[0].splitlines():
            if line.split(":")[0].strip() in CPU_FACTS:
                cpu.append(line)
    facts = [
        torch.__version__,
        platform.machine(),
        *cpu,
        Path(model_code.__file__).read_text(),
        repr(model.config),
        str(dtype),
        str(cache_dtype or dtype),
        str(batch_size),
    ]
    name = hashlib.sha256("\0".join(facts).encode()).hexdigest()[:16]
    return Path(user_cache_dir(), "decoding", f"step-{name}.pt2")


def load_package(path: Path, model: GPT) -> Callable:
    """The package's step, computing with model's parameters where they are (not copied). Loaded by
    torch's own loader, in milliseconds: torch._inductor.aoti_load_package takes about 2 s more in
    a new process, importing the compiler and checking the CPU's vector instructions by compiling
    probes, where the package's name already says which CPU it is for."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    weights = {f"model.{name}": p for name, p in model.named_parameters()}
    loader.load_constants(weights, False, True, user_managed=True)
    return lambda token, pos, cache: loader.run([token, pos, *cache.k, *cache.v])[0]


def build_package(path: Path, model: GPT, cache: KVCache) -> Callable:
    """Compile model's step over cache (6/6/384 on an AMD EPYC: 14 s, 21 s with inductor's caches
    cold), keep it at path (renamed into place: a reader never sees half of it), and return it."""
    log.info("compiling the decoding step for this shape, once: later runs load it from %s", path)
    token = torch.zeros(cache.k[0].size(0), 1, dtype=torch.long)
    args = (token, torch.zeros(1, dtype=torch.long), cache.k, cache.v)
    options = {**CPU_DECODING_OPTIONS, "aot_inductor.package_constants_in_so": False}
    # torch's own deprecation warnings: nothing a user of this command can act on
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # A copy is traced: export leaves fake tensors in the dicts of parameters that a block's
        # step holds (model.py).
        with torch.no_grad():
            program = torch.export.export(_Step(copy.deepcopy(model)), args, strict=False)
        built = torch._inductor.aoti_compile_and_package(
            program, package_path=os.path.join(tmp, "step.pt2"), inductor_configs=options
        )
        step = load_package(Path(built), model)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(str(path)) as f:
                f.write(Path(built).read_bytes())
        except OSError as e:
            log.warning("the compiled decoding step cannot be kept in %s: %s", path.parent, e)
    return step


def check_package(path: Path) -> None:
    """RuntimeError if a file of the package does not match its CRC-32: torch's loader runs the
    shared library in it unchecked, and a damaged one can crash the process."""
    try:
        with zipfile.ZipFile(path) as package:
            damaged = package.testzip()
    except (OSError, zipfile.BadZipFile) as e:
        raise RuntimeError(str(e)) from None
    if damaged is not None:
        raise RuntimeError(f"{damaged} is damaged")


def packaged_step(model: GPT, cache: KVCache) -> Callable:
    """model's step over cache from its package, compiled first where none is kept (or the one
    kept does not load: it is compiled again)."""
    path = package_path(model, cache.k[0].size(0), cache.k[0].dtype)
    if path.exists():
        try:
            check_package(path)
            return load_package(path, model)
        except RuntimeError as e:
            log.warning("the compiled decoding step in %s does not load (%s)", path, e)
    return build_package(path, model, cache)


def cached_step(
    model: GPT, cache: KVCache, compile: bool, state: Sequence[torch.Tensor]
) -> tuple[Callable, bool]:
    """decode_step over model's step, and whether it is compiled: eager; compiled, on a CPU from its
    package where this torch makes one for the model (eager, with a warning, where it cannot compile
    it: no C++ compiler, say); else torch.compile'd, updating cache and `state` in place."""
    device = cache.k[0].device
    if compile and device.type == "cpu" and can_package() and by_reference(model):
        try:
            return functools.partial(decode_step, packaged_step(model, cache)), True
        # inductor's and export's errors are RuntimeErrors; a TypeError, a torch whose loader
        # takes other arguments
        except (RuntimeError, TypeError) as e:
            log.warning(
                "the decoding step cannot be compiled here (%s): it runs eagerly", reason(e)
            )
            compile = False
    if compile:
        step = functools.partial(decode_step, model.step)
        return compile_for_decoding(step, device, [*cache.k, *cache.v, *state]), True
    eager = functools.partial(model.step, linear=step_linear(model, cache.k[0].size(0)))
    return functools.partial(decode_step, eager), False


@contextlib.contextmanager
def without_onednn() -> Iterator[None]:
    """ATen's own CPU kernels while a token is computed, not oneDNN's: oneDNN's exact GELU, which
    nn.GELU calls on a CPU, spends about 10 us setting up each call, five times what ATen's kernel
    takes for a decoding step's rows (BENCHMARKS.md). The setting is the process's, so it is put
    back before each chunk is yielded."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def _window(idx: torch.Tensor, out: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """The last n tokens of the prompt idx followed by the first i new ones, in out."""
    if n <= i:
        return out[:, i - n : i]
    return torch.cat([idx[:, idx.size(1) - (n - i) :], out[:, :i]], dim=1)


@torch.inference_mode()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: Generators = None,
    use_cache: bool = True,
    compile: bool = False,
    chunk_tokens: int = CHUNK_TOKENS,
    chunk_seconds: float | None = CHUNK_SECONDS,
    cache_dtype: torch.dtype | None = None,
) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens tokens continuing idx (B, T), T >= 1, in chunks (B, n), views of one
    tensor: the first token alone, then up to chunk_tokens, fewer once chunk_seconds (None: no
    limit) have passed since the last. The cache holds keys and values in `cache_dtype`, the dtype
    the model computes in (None: its parameters').

    Token i always uses noise row i, so the same generator state gives the same tokens with or
    without the cache, compiled or not, whatever the chunks; with one generator per row of idx, each
    row gets what it would alone. The model is in eval mode until the generator is exhausted or
    closed."""
    B, T = idx.shape
    device = idx.device
    block_size = model.config.block_size
    sampling = (temperature, top_k, top_p)
    rows = noise_rows(model.config.vocab_size)
    noise = torch.empty(B, rows, model.config.vocab_size, device=device)
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    cache = None
    # the cache, the newest token, its position and noise row: decode_step's state, on the device
    if use_cache:
        dtype = cache_dtype or next(model.parameters()).dtype
        cache = KVCache.empty(model.config, B, device, dtype)
        token = torch.zeros((B, 1), dtype=torch.long, device=device)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        row = torch.zeros(1, dtype=torch.long, device=device)
        step, compiled = cached_step(model, cache, compile, [token, pos, row, noise])

    was_training = model.training
    model.eval()
    try:
        n = min(T, block_size)  # tokens in the window
        refill = True  # the cache does not hold the window yet
        start = 0  # of the chunk not yet yielded
        last_chunk = time.perf_counter()
        for i in range(max_new_tokens):
            r = i % rows
            if r == 0 and temperature != 0:
                draw_noise(noise, generator)
            with without_onednn():
                if cache is None or refill:
                    logits = model(_window(idx, out, n, i), cache=cache)[0][:, -1]
                    new = pick(logits, noise[:, r], *sampling)
                    out[:, i : i + 1] = new
                    if cache is not None:
                        token.copy_(new)
                        pos.fill_(n)
                        row.fill_(r + 1)
                else:
                    if r == 0:
                        row.zero_()
                    # Eager: the window alone is read (the token at pos its last). Compiled: all
                    # of the cache, masked (cache.filled stays None: its shapes must not change).
                    if not compiled:
                        cache.filled = n
                    step(token, pos, cache, noise, row, *sampling)
                    out[:, i : i + 1] = token
            n += 1
            refill = n > block_size
            if refill:
                n = max(1, block_size // 2)  # tokens kept when the window restarts
            if (
                start == 0
                or i + 1 - start >= chunk_tokens
                or i + 1 == max_new_tokens
                or (chunk_seconds is not None and time.perf_counter() - last_chunk >= chunk_seconds)
            ):
                yield out[:, start : i + 1]
                start = i + 1
                last_chunk = time.perf_counter()
    finally:
        model.train(was_training)


def sample_line(
    model: GPT,
    tokenizer,
    seed: int,
    n_chars: int,
    stop_requested: Callable[[], int] | None,
    cache_dtype: torch.dtype | None,
) -> str | None:
    """n_chars (>= 1) of text after the start of a line, seeded by `seed`; None once
    `stop_requested()`, asked every STOP_CHECK_EVERY tokens (by count, so a sharded model's ranks
    agree). The cache is kept in `cache_dtype` (generate's)."""
    device = next(model.parameters()).device
    prompt = tokenizer.line_start()
    tokens = []
    idx = tokenizer.encode(prompt).long()[None].to(device)
    with contextlib.closing(
        generate(
            model,
            idx,
            n_chars,
            generator=torch.Generator(device).manual_seed(seed),
            chunk_tokens=STOP_CHECK_EVERY,
            chunk_seconds=None,
            cache_dtype=cache_dtype,
        )
    ) as new:
        for chunk in new:
            if stop_requested is not None and stop_requested():
                return None
            tokens.append(chunk)
    return prompt + tokenizer.decode(torch.cat(tokens, dim=1)[0].tolist())
