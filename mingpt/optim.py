"""The optimizer: AdamW with a weight-decay split, Muon for the blocks' matrices beside it; the
schedules of the learning rate and of Muon's momentum."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from mingpt.config import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the weights of Linear layers; none on biases, LayerNorm weights and
    embeddings."""
    decay = []
    no_decay = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(p)
    assert len(decay) + len(no_decay) == len(list(model.parameters())), (
        "a parameter is shared or missed"
    )
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
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


def orthogonalise(
    m: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton–Schulz iteration, op for op, in `dtype`: near U V^T of
    m = U S V^T (singular values land around 0.5-1.5 rather than at 1, which trains as well)."""
    a, b, c = coefficients
    tall = m.size(0) > m.size(1)
    x = m.to(dtype)
    if tall:  # the Gram matrix of the short side is the smaller one
        x = x.T
    # out of place: in float32 x may be m itself, the momentum buffer
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        return x.T
    return x


def orthogonalise_on_gram(
    x: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float
) -> torch.Tensor:
    """The same iteration for a batch of wide float32 matrices x (B, m, n), m <= n, carried on
    their m x m Gram matrices. Each step multiplies x by P = a I + b G + c G^2, a polynomial in
    G = x x^T; so x_k = Q x_0 with Q the product of the P's, and the next G is P G P. Only the
    first and last products touch n: for the blocks' (C, 4C) matrices that is about 40% fewer
    flops, and equal to float tolerance. Not in bfloat16: G squares x's condition number."""
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    gram = x @ x.mT
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
    return q @ x


def orthogonalise_float32(
    updates: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int, eps: float
) -> list[torch.Tensor]:
    """orthogonalise's result for each float32 matrix of `updates`, computed on the Gram matrix
    for all matrices of one shape at once (tall ones transposed): on a CPU, a few batched products
    keep both cores busy where many small ones do not."""
    wide = [u.T if u.size(0) > u.size(1) else u for u in updates]
    by_shape: dict[torch.Size, list[int]] = {}
    for i, x in enumerate(wide):
        by_shape.setdefault(x.shape, []).append(i)
    results: list[torch.Tensor] = [None] * len(updates)
    for indices in by_shape.values():
        batch = orthogonalise_on_gram(
            torch.stack([wide[i] for i in indices]).float(), *coefficients, steps, eps
        )
        for i, x in zip(indices, batch, strict=True):
            if updates[i].size(0) > updates[i].size(1):
                x = x.T
            results[i] = x
    return results


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, groups and momentum_buffer state, so its snapshots load)
    orthogonalising in `dtype`, where torch's always uses bfloat16. The step is torch's, written
    out: Nesterov momentum, decoupled weight decay, the learning rate scaled by
    sqrt(max(1, rows / columns)) (torch's default adjust_lr_fn, the only one this takes). In
    bfloat16 it is torch's to the bit; in float32 the iteration runs on the Gram matrices
    (orthogonalise_float32)."""

    def __init__(self, params: list[nn.Parameter], lr: float, dtype: torch.dtype):
        super().__init__(params, lr=lr)
        self.dtype = dtype

    @staticmethod
    def momentum_update(
        grad: torch.Tensor, buffer: torch.Tensor, momentum: float, nesterov: bool
    ) -> torch.Tensor:
        """The buffer moves to its average with grad; Nesterov's update looks ahead of it."""
        buffer.lerp_(grad, 1 - momentum)
        if nesterov:
            return grad.lerp(buffer, momentum)
        return buffer

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One step. `closure` is Optimizer.step's, and none is ever given (DCP's get_state_dict
        passes None)."""
        for group in self.param_groups:
            params = []
            grads = []
            buffers = []
            self._init_group(group, params, grads, buffers)
            momentum = group["momentum"]
            lr = group["lr"]
            ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
            # A generator: in bfloat16 each matrix is orthogonalised and stepped before the next
            # one's update exists, so only one update is held at a time, as in torch's loop.
            updates = (
                self.momentum_update(grad, buffer, momentum, group["nesterov"])
                for grad, buffer in zip(grads, buffers, strict=True)
            )
            if self.dtype == torch.float32:
                updates = orthogonalise_float32(list(updates), *ns)
            else:
                updates = (orthogonalise(u, *ns, self.dtype) for u in updates)
            for p, update in zip(params, updates, strict=True):
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * math.sqrt(max(1, p.size(0) / p.size(1))))


def create_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW | Combined:
    """AdamW over param_groups, fused (CUDA and CPU have the kernel), else foreach; with `muon`, the
    blocks' 2-D weights (not the embeddings or the head) go to Muon instead, orthogonalising in the
    dtype the device computes fast."""
    device = next(model.parameters()).device
    fused = device.type in ("cuda", "cpu")
    blocks = [p for name, p in model.named_parameters() if name.startswith("h.") and p.ndim == 2]
    muon = {id(p): p for p in blocks} if cfg.algorithm == "muon" else {}
    groups = param_groups(model, cfg.weight_decay)
    for group in groups:
        group["params"] = [p for p in group["params"] if id(p) not in muon]
    # set_hyperparameters gives every group its betas, eps and weight decay.
    adamw = torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=fused)
    optimizer = adamw
    if muon:
        dtype = orthogonalisation_dtype(device)
        optimizer = Combined(adamw, Muon(list(muon.values()), cfg.muon_learning_rate, dtype))
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
    min_lr_ratio * peak at total_steps; or (wsd) constant, then over the run's last
    cooldown_fraction a linear decay to that floor at total_steps."""
    peak = cfg.learning_rate if peak is None else peak
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    floor = cfg.min_lr_ratio * peak
    if cfg.lr_schedule == "wsd":
        left = max(0.0, 1.0 - step / total_steps)  # of the run
        return floor + min(1.0, left / cfg.cooldown_fraction) * (peak - floor)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def muon_momentum_at(step: int, cfg: OptimizerConfig) -> float:
    """Muon's momentum for optimizer step `step`: from 0.85 linearly to muon_momentum over
    muon_momentum_warmup_steps, a short memory while the early gradients change fast."""
    if step >= cfg.muon_momentum_warmup_steps:
        return cfg.muon_momentum
    progress = step / cfg.muon_momentum_warmup_steps
    return 0.85 + progress * (cfg.muon_momentum - 0.85)
