"""The held-out loss: exact, and the same for any world size.

The windows evaluated are the non-overlapping held-out windows, at most
`eval_tokens` tokens of them spread evenly over the split (the same choice for
any world size). Each rank sums the cross-entropy of every W-th of them in
float64 and counts their tokens; the sums are gathered, so the mean is the sum
over all windows divided by their token count, whatever W is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mingpt.data import spread
from mingpt.distributed import DistInfo


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per token over all ranks' windows (nan if interrupted)
    rank_losses: list[float | None]  # each rank's own mean (None: it had no window)
    tokens: int
    interrupted: bool  # some rank saw a stop request and left early: the result is not recorded


def chosen_windows(n_windows: int, block_size: int, eval_tokens: int) -> torch.Tensor:
    """The held-out windows evaluated: all, or at most eval_tokens' worth spread evenly."""
    cap = eval_tokens and max(1, eval_tokens // block_size)
    return spread(n_windows, cap)


@torch.no_grad()
def evaluate(model: nn.Module, windows, dist_info: DistInfo, eval_tokens: int, batch_size: int,
             autocast: Callable[[], ContextManager] = contextlib.nullcontext, lockstep: bool = False,
             stop_requested: Callable[[], int] = lambda: 0) -> EvalResult:
    """Evaluate `model` on `windows` (the held-out TokenWindows or HostBatches)
    in chunks of `batch_size` windows. With `lockstep` (a sharded model: every
    forward is a collective) every rank runs the same number of forwards, and a
    stop request does not cut the evaluation short."""
    chosen = chosen_windows(len(windows), windows.block_size, eval_tokens)
    W, rank = dist_info.world_size, dist_info.rank
    indices = chosen[rank::W].to(windows.tokens.device)
    chunks = list(indices.split(batch_size))
    if lockstep:  # a rank with fewer windows repeats one and does not count it
        most_windows = -(-len(chosen) // W)  # rank 0's share: ceil(windows / W)
        most_chunks = -(-most_windows // batch_size)
        chunks += [chosen[:1].to(windows.tokens.device)] * (most_chunks - len(chunks))
    counted = len(indices.split(batch_size))  # the chunks after these are repeats
    device = dist_info.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count, interrupted = 0, 0
    was_training = model.training
    model.eval()
    try:
        for k, chunk in enumerate(chunks):
            if not lockstep and stop_requested():  # the step boundary right after stops the run
                interrupted = 1
                break
            x, y = windows.batch(chunk)
            with autocast():
                logits, _ = model(x)
            if k >= counted:
                continue
            losses = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="none")
            loss_sum += losses.double().sum()
            count += y.numel()
    finally:
        model.train(was_training)
    stats = torch.tensor([loss_sum.item(), count, interrupted], dtype=torch.float64, device=device)
    if dist_info.is_distributed:
        gathered = [torch.zeros_like(stats) for _ in range(W)]
        dist.all_gather(gathered, stats)
    else:
        gathered = [stats]
    sums = torch.stack(gathered).cpu()
    if sums[:, 2].any():  # the same on every rank: the gathered flags are
        return EvalResult(float("nan"), [], 0, True)
    loss = (sums[:, 0].sum() / sums[:, 1].sum()).item()
    per_rank = [s / c if c > 0 else None for s, c, _ in sums.tolist()]
    return EvalResult(loss, per_rank, int(sums[:, 1].sum()), False)
