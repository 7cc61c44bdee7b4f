"""Decoding: autoregressive sampling from a GPT (temperature, top-k, top-p), with
or without a key/value cache. The command line around it is mingpt/generate.py.

The context policy, the same with and without the cache: the window of tokens
the model sees grows to block_size; when one more token would not fit, it
restarts with the last block_size // 2 tokens and grows again. Positions are
learned and absolute, so a window sliding by one token would change every
cached key; restarting instead means the cache is refilled once every
block_size // 2 tokens, and cached and uncached decoding predict every token
from the same window, so they give the same tokens.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from mingpt.model import GPT, KVCache


MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # the smallest normal float32: logits / it is no nan


def next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
) -> torch.Tensor:
    """Pick the next token from last-position logits (B, vocab) -> (B, 1).

    generator: one random stream for the whole batch, or one per row (then a row
    draws what it would draw alone with its generator).

    temperature 0 is greedy decoding (top_k and top_p do not matter then); a
    temperature below MIN_TEMPERATURE counts as MIN_TEMPERATURE.
    top_k keeps exactly the k most likely tokens; top_p keeps the smallest set
    of most likely tokens whose probability reaches top_p (always at least one).
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # Shifted so that the largest is 0: with any temperature >= MIN_TEMPERATURE the
    # scaled logits are 0 or negative (-inf at worst), never inf or nan.
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, MIN_TEMPERATURE)
    if top_k is not None and top_k < logits.size(-1):
        top = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens before it already reach top_p.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(row[None], 1, generator=g) for row, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator)


# One-row matrix products as inductor reductions on CPU (inductor's pass for
# memory-bound matmuls; on CPU it takes products of one row whose other sides
# are at most 2,048). A decoding step reads every weight once per token; the
# BLAS one-row product streams them at a quarter to a third of the memory's
# speed on the project's CPU, the reduction at close to it (BENCHMARKS.md).
CPU_DECODING_OPTIONS = {"post_grad_fusion_options": {"decompose_mm_pass": {}}}


def compile_for_decoding(fn: Callable, device: torch.device) -> Callable:
    """torch.compile of a fixed-shape decoding function: CUDA graphs on GPUs
    (mode reduce-overhead, which takes the per-kernel launch cost away), one-row
    matrix products as memory-speed reductions on CPU."""
    if device.type == "cuda":
        return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(fn, options=CPU_DECODING_OPTIONS, fullgraph=True, dynamic=False)


def decoding_step(model: GPT, compile: bool = False) -> Callable:
    """model.step, or a torch.compile of it (one graph, as its shapes never
    change). Compiling takes seconds, so it pays only for long generations."""
    if not compile:
        return model.step
    return compile_for_decoding(model.step, next(model.parameters()).device)


@torch.inference_mode()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
    use_cache: bool = True,
    compile: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens new tokens, each (B, 1), continuing idx (B, T), T >= 1.

    Without the cache the whole window is recomputed for every token; with it,
    the window is encoded once after each restart and each new token is one
    fixed-shape `model.step` (compiled with compile=True). The rows of idx are
    decoded as one batch; with one generator per row, each row gets the tokens
    it would get alone. The model is in eval mode until the generator is
    exhausted or closed.
    """
    if idx.size(1) == 0:
        raise ValueError("generate needs at least one token of context")
    block_size = model.config.block_size
    keep = max(1, block_size // 2)  # tokens kept when the window restarts
    window = idx[:, -block_size:]
    cache = step = None
    if use_cache:
        param = next(model.parameters())
        cache = KVCache(model.config, idx.size(0), param.device, param.dtype)
        step = decoding_step(model, compile)
        if compile and param.device.type == "cuda":  # CUDA graphs may update the cache in place
            for t in cache.k + cache.v:
                torch._dynamo.mark_static_address(t)
    was_training = model.training
    model.eval()
    try:
        refill = True  # the cache does not hold the window yet
        for _ in range(max_new_tokens):
            if cache is None:
                logits = model(window)[0][:, -1]
            elif refill:
                logits = model(window, cache=cache)[0][:, -1]
            else:
                pos = torch.tensor([window.size(1) - 1], device=window.device)
                logits = step(token, pos, cache)  # the last token, the newest in the window
            token = next_token(logits, temperature, top_k, top_p, generator)
            yield token
            window = torch.cat([window, token], dim=1)
            refill = window.size(1) > block_size
            if refill:
                window = window[:, -keep:]
    finally:
        model.train(was_training)
