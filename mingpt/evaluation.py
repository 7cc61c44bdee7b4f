"""The held-out loss, exact and the same for any number of processes: each rank sums the float64
cross-entropy of every W-th chosen window, and the sums are gathered. When the run evaluates, its
best loss, and early stopping."""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mingpt.config import TrainerConfig
from mingpt.data import spread
from mingpt.distributed import DistInfo


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per token over all ranks' windows (nan if interrupted)
    rank_losses: list[float | None]  # each rank's own mean (None: it had no window)
    tokens: int
    interrupted: bool  # some rank saw a stop request and left early: the result is not recorded

    @property
    def bpc(self) -> float:  # bits per character
        return self.loss / math.log(2)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def chosen_windows(windows, eval_tokens: int) -> torch.Tensor:
    """The indices of the held-out `windows` evaluated: all (eval_tokens 0), or at most
    eval_tokens' worth spread evenly."""
    count = 0  # all
    if eval_tokens:
        count = max(1, eval_tokens // windows.block_size)
    return spread(len(windows), count)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows,
    dist_info: DistInfo,
    eval_tokens: int,
    batch_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    lockstep: bool = False,
    stop_requested: Callable[[], int] = lambda: 0,
) -> EvalResult:
    """`model` on `windows` (TokenWindows or HostBatches) in chunks of `batch_size` windows. With
    `lockstep` (a sharded model: every forward is a collective) every rank runs as many forwards,
    and `stop_requested` must give every rank the same answer (it is asked before each chunk)."""
    chosen = chosen_windows(windows, eval_tokens).to(windows.tokens.device)
    W = dist_info.world_size
    rank = dist_info.rank
    chunks = list(chosen[rank::W].split(batch_size))
    # The chunks after these are repeats: with `lockstep`, a rank with fewer windows than rank 0
    # repeats one window as often as it has fewer chunks, and does not count it.
    counted = len(chunks)
    if lockstep:
        chunks += [chosen[:1]] * (len(chosen[::W].split(batch_size)) - counted)
    # Per rank: loss sum, tokens, interrupted.
    sums = torch.zeros(W, 3, dtype=torch.float64, device=dist_info.device)
    was_training = model.training
    model.eval()
    for k, chunk in enumerate(chunks):
        # The step boundary right after stops the run.
        if stop_requested():
            sums[rank, 2] = 1
            break
        x, y = windows.batch(chunk)
        with autocast():
            logits, _ = model(x)
        if k < counted:
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            sums[rank, 0] += losses.double().sum()
            sums[rank, 1] += y.numel()
    # An error on the way ends the process: no need to restore the mode then.
    model.train(was_training)
    if dist_info.is_distributed:
        # Each row was filled by its own rank alone: the sum gathers them exactly.
        dist.all_reduce(sums)
    # The gathered flags are the same on every rank.
    if sums[:, 2].any():
        return EvalResult(math.nan, [], 0, True)
    loss_sum, tokens = sums[:, :2].sum(0)  # over all ranks
    per_rank = [s / c if c > 0 else None for s, c, _ in sums.tolist()]
    return EvalResult((loss_sum / tokens).item(), per_rank, int(tokens), False)


class Evaluator:
    """When the run evaluates, and what a held-out loss means for it: a new best, an early stop. The
    losses are the same on every rank, so every rank decides alike. Its counts live in the trainer's
    state, which snapshots save."""

    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg

    def due(self, step: int, epoch_ended: bool) -> bool:
        """Whether to evaluate after `step`: every eval_every steps, or with eval_every 0 at each
        epoch's end."""
        every = self.cfg.eval_every
        if every == 0:
            return epoch_ended
        return step % every == 0

    def stopped_early(self, state: Any) -> bool:
        """Early stopping ended the run (as its snapshot records), and this config still would: with
        a larger early_stop_patience, or null, the run trains on."""
        patience = self.cfg.early_stop_patience
        if not state.stopped_early or patience is None:
            return False
        return state.evals_without_improvement >= patience

    def record(self, state: Any, loss: float, last_step: bool) -> bool:
        """A completed evaluation's loss, into `state`: the best loss, and for early stopping the
        evaluations in a row that did not lower it by early_stop_min_delta. Returns whether the loss
        is a new best."""
        cfg = self.cfg
        state.last_eval_loss = loss
        # Evaluating: not stopped (a larger patience trains on).
        state.stopped_early = False
        improved = loss < state.best_eval_loss
        # Measured from the best loss at the count's last restart, not from the latest best: drops
        # each smaller than min_delta that add up to it are an improvement too.
        reference = state.early_stop_reference
        if loss < reference and reference - loss >= cfg.early_stop_min_delta:
            state.evals_without_improvement = 0
            state.early_stop_reference = loss
        else:
            state.evals_without_improvement += 1
        if improved:
            state.best_eval_loss = loss
            state.best_step = state.step
        patience = cfg.early_stop_patience
        # At the last step the run ends anyway: it is not stopped early.
        if patience is None or state.evals_without_improvement < patience or last_step:
            return improved
        state.stopped_early = True
        return improved
