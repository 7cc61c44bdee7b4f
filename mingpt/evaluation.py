"""The held-out loss, exact and the same for any world size: each rank sums the float64 cross-entropy of every W-th
chosen window and the sums are gathered. When to evaluate, the best loss, early stopping."""

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mingpt.config import TrainerConfig
from mingpt.data import spread
from mingpt.distributed import DistInfo
from mingpt.snapshot.manager import Progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per token over all ranks' windows (nan if interrupted)
    rank_losses: list[float | None]  # each rank's own mean (None: it had no window)
    tokens: int
    interrupted: bool  # some rank saw a stop request and left early: the result is not recorded


def chosen_windows(n_windows: int, block_size: int, eval_tokens: int) -> torch.Tensor:
    """The held-out windows evaluated: all, or at most eval_tokens' worth spread evenly."""
    return spread(n_windows, eval_tokens and max(1, eval_tokens // block_size))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows,
    dist_info: DistInfo,
    eval_tokens: int,
    batch_size: int,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    lockstep: bool = False,
    stop_requested: Callable[[], int] = lambda: 0,
) -> EvalResult:
    """`model` on `windows` (TokenWindows or HostBatches) in chunks of `batch_size` windows. With `lockstep` (a
    sharded model: every forward is a collective) every rank runs as many forwards, and a stop request waits."""
    chosen = chosen_windows(len(windows), windows.block_size, eval_tokens).to(windows.tokens.device)
    W, rank = dist_info.world_size, dist_info.rank
    chunks = list(chosen[rank::W].split(batch_size))
    counted = len(chunks)  # the chunks after these are repeats
    if lockstep:  # a rank with fewer windows than rank 0 repeats one and does not count it
        chunks += [chosen[:1]] * (len(chosen[::W].split(batch_size)) - counted)
    # per rank: loss sum, tokens, interrupted
    sums = torch.zeros(W, 3, dtype=torch.float64, device=dist_info.device)
    was_training = model.training
    model.eval()
    for k, chunk in enumerate(chunks):
        if not lockstep and stop_requested():  # the step boundary right after stops the run
            sums[rank, 2] = 1
            break
        x, y = windows.batch(chunk)
        with autocast():
            logits, _ = model(x)
        if k < counted:
            sums[rank, 0] += (
                F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
                .double()
                .sum()
            )
            sums[rank, 1] += y.numel()
    model.train(was_training)  # an error on the way ends the process
    if dist_info.is_distributed:
        # each row was filled by its own rank alone: the sum gathers them exactly
        dist.all_reduce(sums)
    if sums[:, 2].any():  # the same on every rank: the gathered flags are
        return EvalResult(float("nan"), [], 0, True)
    loss = (sums[:, 0].sum() / sums[:, 1].sum()).item()
    per_rank = [s / c if c > 0 else None for s, c, _ in sums.tolist()]
    return EvalResult(loss, per_rank, int(sums[:, 1].sum()), False)


class Evaluator:
    """When the run evaluates, its best held-out loss, and early stopping. Its losses are the same on every rank,
    so every rank decides alike; a new best writes the best weights (`save_best`, every rank taking part)."""

    def __init__(
        self, cfg: TrainerConfig, progress: Progress, save_best: Callable[[Progress], None]
    ):
        self.cfg, self.progress, self.save_best = cfg, progress, save_best
        self.last = math.nan  # the held-out loss of the last evaluation recorded

    def due(self, epoch_end: bool = False) -> bool:
        """Whether to evaluate after the current step, or (`epoch_end`) at an epoch's end: where eval_every is 0."""
        every = self.cfg.eval_every
        return every == 0 if epoch_end else bool(every) and self.progress.step % every == 0

    def stopped_early(self) -> bool:
        """Early stopping ended the run (as the snapshot records it), and this config still would: a larger
        early_stop_patience, or null, trains on."""
        p, patience = self.progress, self.cfg.early_stop_patience
        return p.stopped_early and patience is not None and p.evals_without_improvement >= patience

    def record(self, loss: float, finished: bool) -> None:
        """A completed evaluation's loss: a new best is saved; early stopping counts the evaluations in a row that
        did not lower the best by early_stop_min_delta."""
        cfg, p = self.cfg, self.progress
        # evaluating: not stopped (a larger patience trains on)
        self.last, p.stopped_early = loss, False
        improved = loss < p.best_eval_loss
        enough = improved and p.best_eval_loss - loss >= cfg.early_stop_min_delta
        p.evals_without_improvement = 0 if enough else p.evals_without_improvement + 1
        if improved:
            p.best_eval_loss, p.best_step = loss, p.step
            self.save_best(p)
        patience = cfg.early_stop_patience
        if patience is not None and p.evals_without_improvement >= patience and not finished:
            p.stopped_early = True
            log.info(
                "stopping early at step %d: %d evaluations in a row without lowering the held-out loss by at "
                "least %g (trainer_config.early_stop_patience=%d, early_stop_min_delta); best %.4f at step %d",
                p.step,
                p.evals_without_improvement,
                cfg.early_stop_min_delta,
                patience,
                p.best_eval_loss,
                p.best_step,
            )
