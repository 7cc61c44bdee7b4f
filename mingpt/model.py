"""The GPT language model (Radford et al. 2018/2019, after Karpathy's minGPT): pre-LayerNorm blocks
of causal self-attention (scaled_dot_product_attention) and a GELU MLP, and the KV cache that
decoding steps through."""

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mingpt.config import GPTConfig


class KVCache:
    """Every layer's keys and values for block_size positions, preallocated: a decoding step has the
    same shapes every time, as torch.compile and CUDA graphs need."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        """Over the given tensors, a layer's keys and values each (B, nh, block_size, hs)."""
        self.k = k
        self.v = v
        self.positions = torch.arange(k[0].size(2), device=k[0].device)[None]
        # Positions in use, where the host knows it (eager decoding): a step then attends to those
        # alone. None (a compiled step, whose shapes must not change): the whole cache, masked.
        self.filled: int | None = None

    @classmethod
    def empty(cls, config: GPTConfig, batch_size: int, device, dtype=torch.float32) -> "KVCache":
        shape = (batch_size, config.n_head, config.block_size, config.n_embd // config.n_head)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        v = [torch.zeros_like(layer) for layer in k]
        return cls(k, v)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None):
        """Keep `layer`'s new keys and values (B, nh, T, hs); return the keys and values the new
        queries attend to. pos None: a prompt at positions 0..T-1, its own. pos a one-element
        tensor: one token there, and the first `filled` positions, or else the whole cache
        (`visible` says which positions count)."""
        if pos is None:
            T = k.size(2)
            self.k[layer][:, :, :T] = k
            self.v[layer][:, :, :T] = v
            return k, v
        self.k[layer].index_copy_(2, pos, k)
        self.v[layer].index_copy_(2, pos, v)
        if self.filled is not None:
            return self.k[layer][:, :, : self.filled], self.v[layer][:, :, : self.filled]
        return self.k[layer], self.v[layer]

    def visible(self, pos: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of a token at pos: the cache up to its own position. None where only
        the filled positions are read."""
        if self.filled is not None:
            return None
        return self.positions <= pos


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None, layer: int, last: bool
    ) -> torch.Tensor:
        """x (B, T, C); with a cache, x is a prompt from position 0, whose keys and values fill it
        (Block.step goes on from there). last: the output of the last position alone (B, 1, C)."""
        B, T, C = x.shape
        hs = C // self.n_head  # head size
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if cache is not None:
            k, v = cache.store(layer, k, v, None)
        if last:
            q = q[:, :, -1:]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=q.size(2) > 1
        )
        y = y.transpose(1, 2).contiguous().view(B, q.size(2), C)
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
        # step's parameters by module ("ln_1", "attn.c_attn", ...): the dicts in which the modules
        # hold them, looked up once. Through nn.Module each lookup takes about 1.5 us, and a step
        # needs 12 per block. FSDP swaps its sharded and whole tensors inside these same dicts.
        self.step_parameters = {
            name: module._parameters for name, module in self.named_modules() if module._parameters
        }

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, last: bool = False
    ) -> torch.Tensor:
        y = self.attn(self.ln_1(x), cache, layer, last)
        if last:  # the last position alone goes on
            x = x[:, -1:]
        x = x + y
        return x + self.mlp(self.ln_2(x))

    def step(
        self,
        x: torch.Tensor,
        cache: KVCache,
        layer: int,
        pos: torch.Tensor,
        linear: Callable,
    ) -> torch.Tensor:
        """forward for one position per row, x (B, C), at pos: the same arithmetic on the same
        weights, written on the tensors, with `linear` for F.linear. A decoding step is a few
        matrix-vector products, and forward's module calls and reshapes cost it about a fifth of
        its time on a CPU."""
        p = self.step_parameters
        B, C = x.shape
        h = F.layer_norm(x, (C,), **p["ln_1"])
        # (B, nh, 1, hs) each: with one position, the heads need no transpose
        qkv = linear(h, **p["attn.c_attn"])
        q, k, v = qkv.view(B, 3, self.attn.n_head, 1, -1).unbind(1)
        k, v = cache.store(layer, k, v, pos)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.visible(pos))
        x = x + linear(y.view(B, C), **p["attn.c_proj"])
        h = linear(F.layer_norm(x, (C,), **p["ln_2"]), **p["mlp.c_fc"])
        h = F.gelu(h, approximate=self.mlp.gelu.approximate)
        return x + linear(h, **p["mlp.c_proj"])


def parameter_count(config: GPTConfig) -> int:
    """The parameters of the model that `config` describes, counted without allocating them. One
    block on the meta device stands for all: building n_layer of them, even there, takes memory and
    time in proportion (a typo's million layers filled the host). Not the whole model there either:
    its embeddings' initialisation on the meta device imports torch._dynamo. A weight of 2**63
    bytes or more overflows torch's count: RuntimeError, or TypeError past 64 bits."""
    with torch.device("meta"):
        per_block = sum(p.numel() for p in Block(config).parameters())
    C = config.n_embd
    embeddings = (config.vocab_size + config.block_size) * C
    head = config.vocab_size * C
    ln_f = 2 * C
    return config.n_layer * per_block + embeddings + head + ln_f


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, init_weights: bool = True):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.checkpoint_blocks = False  # training: recompute each block's activations in backward
        # GPT-2's initialisation: N(0, 0.02), zero biases, and the projections that write into the
        # residual stream scaled by 1/sqrt(2 * n_layer), so its variance does not grow with depth.
        # Not for weights about to be replaced (init_weights False): it takes a third of the build.
        if not init_weights:
            return
        for name, p in self.named_parameters():
            if p.dim() == 2:  # Linear and Embedding weights
                std = 0.02
                if name.endswith("c_proj.weight"):
                    std = 0.02 / math.sqrt(2 * config.n_layer)
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def num_params(self) -> int:
        """Less the token and position embeddings: they are lookups, not matmuls (the head is not
        tied to wte, so it counts)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() - self.wpe.weight.numel()

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) -> logits (B, T, vocab) and, with targets, the mean cross-entropy. With a
        cache, idx is a prompt whose keys and values fill it from position 0 for `step` to go on,
        and the logits are its last position's alone (B, 1, vocab), the one decoding reads: the last
        block computes only keys and values for the others (an eighth of a 6-layer forward)."""
        T = idx.size(1)
        if self.config.block_size < T:
            raise ValueError(
                f"sequence of {T} tokens is longer than block_size {self.config.block_size}"
            )
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        checkpointing = self.checkpoint_blocks and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.h):
            if checkpointing:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache, i, cache is not None and i == len(self.h) - 1)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            # In float32 whatever the logits' dtype: under FSDP's bf16 policy (no autocast, which
            # would cast it so) a bf16 loss was rounded to a few digits, and biased by its sum.
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
        return logits, loss

    def step(
        self,
        idx: torch.Tensor,
        pos: torch.Tensor,
        cache: KVCache,
        linear: Callable = F.linear,
    ) -> torch.Tensor:
        """The logits (B, vocab) after tokens idx (B, 1) at position pos (a one-element tensor),
        whose keys and values join the cache; `linear` computes the blocks' products. No shape
        depends on pos: it compiles once."""
        x = self.wte(idx[:, 0]) + self.wpe(pos)  # (B, C)
        for i, block in enumerate(self.h):
            x = block.step(x, cache, i, pos, linear)
        # the head keeps nn.Linear: over a character vocabulary its product is small
        return self.lm_head(self.ln_f(x))
