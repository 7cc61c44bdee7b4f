"""A GPT language model, after Radford et al. 2018/2019 and Karpathy's minGPT.

Token and learned position embeddings, a stack of pre-LayerNorm transformer
blocks (causal self-attention, then a GELU MLP), a final LayerNorm and a linear
head. Attention goes through scaled_dot_product_attention with is_causal=True,
so GPUs use flash kernels. For generation, a KVCache of fixed shape keeps the
keys and values of a prompt, and `step` adds one token at a time to it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mingpt.config import GPTConfig


class KVCache:
    """Keys and values of every layer for block_size positions, preallocated, so
    that a decoding step has the same shapes every time (what torch.compile and
    CUDA graphs need)."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype=torch.float32):
        head_size = config.n_embd // config.n_head
        shape = (batch_size, config.n_head, config.block_size, head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.positions = torch.arange(config.block_size, device=device)[None]  # (1, block): a mask row

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Optional[torch.Tensor]):
        """Keep the new keys and values (B, nh, T, hs) of `layer`; return the keys,
        values and mask that the new queries attend to. pos None: a prompt at
        positions 0..T-1, which attends causally to itself. pos a one-element
        tensor: one token at that position, which attends to the whole cache
        masked to the positions up to its own."""
        if pos is None:
            self.k[layer][:, :, : k.size(2)] = k
            self.v[layer][:, :, : v.size(2)] = v
            return k, v, None
        self.k[layer].index_copy_(2, pos, k)
        self.v[layer].index_copy_(2, pos, v)
        return self.k[layer], self.v[layer], self.positions <= pos


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value projections
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)  # output projection
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, cache: Optional[KVCache] = None, layer: int = 0, pos: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        mask = None
        if cache is not None:
            k, v, mask = cache.store(layer, k, v, pos)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None and T > 1
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cache: Optional[KVCache] = None, layer: int = 0, pos: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.vocab_size is None or config.block_size is None:
            raise ValueError("GPTConfig.vocab_size and block_size must be set from the data")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Training only: each block's activations are recomputed in backward instead of kept
        # (trainer_config.activation_checkpointing); dropout's random stream is replayed.
        self.checkpoint_blocks = False

        # GPT-2 initialisation: N(0, 0.02), zero biases, and the projections
        # that write into the residual stream scaled by 1/sqrt(2 * n_layer).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; non_embedding leaves out the token and position embeddings
        (lookups, no compute: the head is not tied to the token embedding)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() - self.wpe.weight.numel() if non_embedding else n

    def forward(
        self,
        idx: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """idx: (B, T) token ids. Returns logits (B, T, vocab) and, with targets,
        the mean cross-entropy. With a cache, idx is a prompt: its keys and values
        fill the cache from position 0, and `step` continues from there."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.h):
            if self.checkpoint_blocks and cache is None and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache, i)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def step(self, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decoding step: the logits (B, vocab) that follow the tokens idx (B, 1)
        at position pos (a one-element tensor, below block_size), whose keys and
        values go into the cache, after the cached positions before it. Its shapes
        do not depend on pos, so it compiles once."""
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.h):
            x = block(x, cache, i, pos)
        return self.lm_head(self.ln_f(x[:, -1]))
