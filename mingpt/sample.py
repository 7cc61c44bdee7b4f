"""Autoregressive sampling from a GPT, with or without a key/value cache."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from mingpt.model import GPT, KVCache


def next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Pick the next token from last-position logits (B, vocab) -> (B, 1).
    temperature 0 is greedy decoding."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)


def window_start(length: int, start: int, block_size: int) -> int:
    """Where the context window begins once the sequence has `length` tokens.

    The window grows to block_size tokens; when it would outgrow it, it
    restarts with the last block_size // 2 tokens. (Positions are learned and
    absolute, so a window sliding by one token would change every cached key.)
    """
    if length - start > block_size:
        return length - max(1, block_size // 2)
    return start


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens new tokens, each (B, 1), continuing idx (B, T).

    Each token is predicted from the context window given by window_start.
    Without the cache, the whole window is recomputed for every token; with it,
    the window is encoded once and each new token costs one position, so the
    two give the same tokens (the cache is refilled when the window restarts).
    """
    block_size = model.config.block_size
    start = max(0, idx.size(1) - block_size)
    was_training = model.training
    model.eval()
    cache = None
    if use_cache:
        param = next(model.parameters())
        cache = KVCache(model.config, idx.size(0), param.device, param.dtype)
    try:
        logits, _ = model(idx[:, start:], cache=cache)
        for i in range(max_new_tokens):
            token = next_token(logits[:, -1], temperature, top_k, top_p, generator)
            idx = torch.cat([idx, token], dim=1)
            yield token
            if i == max_new_tokens - 1:
                break
            new_start = window_start(idx.size(1), start, block_size)
            if cache is not None and new_start == start:
                logits, _ = model(token, cache=cache)
            else:
                start = new_start
                if cache is not None:
                    cache.reset()
                logits, _ = model(idx[:, start:], cache=cache)
    finally:
        model.train(was_training)
