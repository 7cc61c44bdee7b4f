"""The optimizer: AdamW with a weight-decay split, Muon for the blocks' matrices beside it; the
schedules of the learning rate and of Muon's momentum."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from mingpt.config import OptimizerConfig


def param_groups(model: nn.Module, muon: list[nn.Parameter]) -> list[dict]:
    """AdamW's groups of the parameters not in `muon`: the weights of Linear layers, which weight
    decay applies to; then biases, LayerNorm weights and embeddings, which it does not
    (set_hyperparameters gives each group its weight decay)."""
    decay = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    # by identity: `in` would compare tensors elementwise
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    return [
        {"params": [p for p in params if all(p is not m for m in muon)]}
        for params in (decay, no_decay)
    ]


def set_hyperparameters(optimizer: torch.optim.Optimizer | Combined, cfg: OptimizerConfig) -> None:
    """Give the optimizer's groups (AdamW's decayed and not, Muon's) `cfg`'s settings (on resume:
    the current config's, not the snapshot's); `peak_lr` is the group's learning rate at the
    schedule's peak."""
    adamw = {"betas": tuple(cfg.betas), "eps": cfg.eps, "peak_lr": cfg.learning_rate}
    groups = [{**adamw, "weight_decay": cfg.weight_decay}, {**adamw, "weight_decay": 0.0}]
    if cfg.algorithm == "muon":
        groups.append(
            {
                "weight_decay": cfg.weight_decay,
                "momentum": cfg.muon_momentum,
                "peak_lr": cfg.muon_learning_rate,
            }
        )
    for group, values in zip(optimizer.param_groups, groups, strict=True):
        group.update(values)


class Combined:
    """AdamW and Muon stepped as one optimizer: the groups of both (AdamW's first), one state_dict
    holding both states. GradScaler unscales and steps it as it does one."""

    def __init__(self, adamw: torch.optim.AdamW, muon: Muon):
        self.optimizers = (adamw, muon)

    @property
    def param_groups(self) -> list[dict]:
        return [group for o in self.optimizers for group in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        states = [o.state_dict() for o in self.optimizers]
        return {
            "state": [s["state"] for s in states],
            "param_groups": [s["param_groups"] for s in states],
        }

    def load_state_dict(self, state: dict) -> None:
        for o, own, groups in zip(
            self.optimizers, state["state"], state["param_groups"], strict=True
        ):
            o.load_state_dict({"state": own, "param_groups": groups})


def orthogonalisation_dtype(device: torch.device) -> torch.dtype:
    """Muon's orthogonalisation dtype: bfloat16 where the device multiplies it fast (a GPU; what
    torch.optim.Muon always uses); float32 on a CPU, where bfloat16 matrix products without
    bfloat16 units made Muon's step 2-3x AdamW's."""
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16


def orthogonalise_batch(
    x: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton–Schulz iteration in float32, for a batch of matrices x
    (B, rows, columns), wide or tall: near U V^T of x = U S V^T (singular values land around
    0.5-1.5 rather than at 1, which trains as well). The result has x's shape and, in the Gram
    form, its memory layout (tall matrices stay tall in memory).

    Each step multiplies x by P = a I + b G + c G^2, a polynomial in G = x x^T (for a tall x,
    G = x^T x, and P multiplies it from the right). When the long side n is over 1.5 times the short
    side m, the iteration is carried on the m x m Gram matrices: x_k = Q x_0 with Q the product of
    the P's, and the next G is P G P, so only the first and last products touch n. That is
    2 m^2 n + 17 m^3 multiply-adds for 5 steps against 10 m^2 n + 5 m^3: about 40% fewer for the
    blocks' (C, 4C) matrices, and more below n = 1.5 m, where x itself is iterated. Equal to float
    tolerance, and not for bfloat16: G squares x's condition number."""
    tall = x.size(-2) > x.size(-1)
    if max(x.shape[-2:]) <= 1.5 * min(x.shape[-2:]):
        if tall:
            return orthogonalise_batch(x.mT, a, b, c, steps, eps).mT
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x
    if tall:
        gram = x.mT @ x
    else:
        gram = x @ x.mT
    # x's norm is the square root of G's trace: G is scaled now, x once at the end
    scale = 1 / gram.diagonal(dim1=-2, dim2=-1).sum(-1).sqrt().clamp(min=eps)[:, None, None]
    gram = gram * scale.square()
    q = None
    for step in range(steps):
        p = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2,
        p.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
        if q is None:
            q = p
        else:
            q = p @ q
        if step < steps - 1:  # the last G is never used
            gram = p @ gram @ p
    if tall:
        return x @ (q * scale).mT
    return (q * scale) @ x


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, groups and momentum_buffer state, so its snapshots load)
    orthogonalising in `dtype`. In bfloat16 the step is torch's own. In float32, where torch's
    would still iterate in bfloat16, it is torch's step written out."""

    def __init__(self, params: list[nn.Parameter], lr: float, dtype: torch.dtype):
        super().__init__(params, lr=lr)
        self.dtype = dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One step. `closure` is Optimizer.step's, and none is ever given (DCP's get_state_dict
        passes None).

        In float32: torch's step (Nesterov momentum, decoupled weight decay, the learning rate
        scaled by sqrt(max(1, rows / columns)), torch's default adjust_lr_fn and the only one this
        takes), with the matrices of one shape orthogonalised as one batch: on a CPU, a few batched
        products keep both cores busy where many small ones do not. The elementwise work goes
        through torch's _foreach ops, one call for all the matrices."""
        if self.dtype != torch.float32:
            super().step()
            return
        for group in self.param_groups:
            params = []
            grads = []
            buffers = []
            self._init_group(group, params, grads, buffers)
            lr = group["lr"]
            momentum = group["momentum"]
            # the buffer moves to its average with the gradient; Nesterov's update looks ahead
            # of it
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            if group["nesterov"]:
                updates = torch._foreach_lerp(grads, buffers, momentum)
            else:
                updates = buffers
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            by_shape: dict[torch.Size, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault(p.shape, []).append(i)
            for (rows, columns), indices in by_shape.items():
                batch = torch.stack([updates[i] for i in indices])
                batch = orthogonalise_batch(
                    batch, *group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                torch._foreach_add_(
                    [params[i] for i in indices],
                    batch.unbind(),
                    alpha=-lr * math.sqrt(max(1, rows / columns)),
                )


def create_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW | Combined:
    """AdamW over param_groups, fused (a run's devices, CUDA and CPU, both have the kernel); with
    `muon`, the blocks' 2-D weights (not the embeddings or the head) go to Muon instead,
    orthogonalising in the dtype the device computes fast."""
    muon = []
    if cfg.algorithm == "muon":
        muon = [p for name, p in model.named_parameters() if name.startswith("h.") and p.ndim == 2]
    # set_hyperparameters gives every group its betas, eps and weight decay.
    optimizer = torch.optim.AdamW(param_groups(model, muon), lr=cfg.learning_rate, fused=True)
    if muon:
        dtype = orthogonalisation_dtype(next(model.parameters()).device)
        optimizer = Combined(optimizer, Muon(muon, cfg.muon_learning_rate, dtype))
    set_hyperparameters(optimizer, cfg)
    return optimizer


def set_lr(
    optimizer: torch.optim.Optimizer | Combined, step: int, cfg: OptimizerConfig, total_steps: int
) -> float:
    """Each group's learning rate for optimizer step `step`, lr_at's schedule to its peak_lr, and
    Muon's momentum; returns AdamW's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg, total_steps, group["peak_lr"])
        if "momentum" in group:  # Muon's; AdamW's groups have betas
            group["momentum"] = muon_momentum_at(step, cfg)
    return lr_at(step, cfg, total_steps)


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int, peak: float | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of total_steps: linear warmup over
    warmup_steps to `peak` (learning_rate unless given), then constant; or cosine decay to
    min_lr_ratio * peak at the last step, total_steps - 1; or (wsd) constant, then over the run's
    last cooldown_fraction a linear decay to that floor at the last step."""
    peak = cfg.learning_rate if peak is None else peak
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    floor = cfg.min_lr_ratio * peak
    # The decay ends at the last step the run takes: ending at total_steps, it never reached the
    # floor, and a wsd cooldown shorter than one step never started.
    last = total_steps - 1
    if cfg.lr_schedule == "wsd":
        left = max(0.0, 1.0 - step / max(1, last))  # of the run
        return floor + min(1.0, left / cfg.cooldown_fraction) * (peak - floor)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, last - cfg.warmup_steps))
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def muon_momentum_at(step: int, cfg: OptimizerConfig) -> float:
    """Muon's momentum for optimizer step `step`: from 0.85 linearly to muon_momentum over
    muon_momentum_warmup_steps, a short memory while the early gradients change fast."""
    if step >= cfg.muon_momentum_warmup_steps:
        return cfg.muon_momentum
    progress = step / cfg.muon_momentum_warmup_steps
    return 0.85 + progress * (cfg.muon_momentum - 0.85)
