"""AdamW with a weight-decay split, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from mingpt.config import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the weights of Linear layers; none on biases, LayerNorm
    weights and (position) embeddings. Every parameter is in exactly one group."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(p)
    assert len(decay) + len(no_decay) == len(list(model.parameters())), "a parameter is shared or missed"
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def set_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> None:
    """Give the groups of param_groups (decayed, then not) `cfg`'s weight decay, betas and eps."""
    for group, decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):
        group.update(weight_decay=decay, betas=tuple(cfg.betas), eps=cfg.eps)


def create_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW, fused where every parameter sits on a device with the fused kernel
    (CUDA, and CPU in recent torch), otherwise the foreach implementation."""
    device_type = next(model.parameters()).device.type
    fused = device_type in ("cuda", "cpu")
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.learning_rate,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=fused,
    )


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of total_steps:
    linear warmup over warmup_steps, then constant, or cosine decay that
    reaches min_lr_ratio * learning_rate at step total_steps."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.min_lr_ratio * cfg.learning_rate
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - floor)
