"""The training loop: steps, gradient accumulation, AMP, when to evaluate, log, save and stop.

Its parts live beside it: how the model is spread over the ranks in
mingpt/parallel.py, the held-out loss in mingpt/evaluation.py, what a
snapshot holds and how it is written and restored in mingpt/snapshot/.

Exact resume rests on three facts, so a snapshot needs no generator states:
- the order of epoch e's samples is a permutation seeded by (seed, e), and the
  snapshot records how many of them the ranks have consumed together;
- dropout's random stream is reseeded from (seed, rank, step) before each step;
- the learning rate is a function of the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shlex
import time
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt import comm_hooks, evaluation, flops, parallel, stopping, tracking
from mingpt.config import Config, ConfigError, TrainerConfig
from mingpt.data import CharData, ResumableSampler
from mingpt.decoding import generate
from mingpt.distributed import DistInfo, all_max, barrier
from mingpt.metrics import Metrics, SlowNotice
from mingpt.model import GPT
from mingpt.optim import create_optimizer, lr_at
from mingpt.rundir import check_record
from mingpt.snapshot.manager import NotFinite, Progress, Snapshot, find_best, resolve_path
from mingpt.stopping import StepFlags
from mingpt.storage import StorageError

log = logging.getLogger(__name__)

STOP_CHECK_EVERY = 16  # tokens of an evaluation's sample between two looks for a stop request


class TrainingError(RuntimeError):
    """Training cannot go on (for example, the loss diverged)."""


def _duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class AmpPolicy(NamedTuple):
    enabled: bool  # autocast (with FSDP: its mixed-precision policy) in `dtype`
    dtype: torch.dtype
    scaler: bool  # fp16 needs a gradient scaler; bf16 does not


def amp_policy(cfg: TrainerConfig, device_type: str, bf16_supported: bool = True) -> AmpPolicy:
    """AMP on CUDA when use_amp; on a CPU only when amp_on_cpu forces it (warned:
    CPUs without bf16 units run it far slower). bf16 on a GPU without it: ConfigError."""
    enabled = cfg.use_amp and (device_type == "cuda" or cfg.amp_on_cpu)
    dtype = torch.bfloat16 if cfg.amp_dtype == "bf16" else torch.float16
    if enabled and device_type == "cuda" and cfg.amp_dtype == "bf16" and not bf16_supported:
        raise ConfigError("trainer_config.amp_dtype: bf16 is not supported on this GPU; use fp16")
    if cfg.use_amp and device_type == "cpu":
        log.warning("trainer_config.use_amp %s on CPU: CPUs without bf16/fp16 units run it far slower than fp32%s",
                    "forced" if cfg.amp_on_cpu else "ignored",
                    "" if cfg.amp_on_cpu else " (trainer_config.amp_on_cpu=true forces it)")
    return AmpPolicy(enabled, dtype, enabled and dtype == torch.float16)


class StepPlan(NamedTuple):
    samples_per_step: int  # per rank: batch_size windows for each of grad_accum_steps micro-steps
    steps_per_epoch: int  # at this world size
    total_steps: int  # steps done plus steps to go, so a resume with another world size still finishes every epoch


def step_plan(cfg: TrainerConfig, n_train: int, world_size: int, progress: Progress) -> StepPlan:
    """How many optimizer steps the run takes from `progress` on, capped by max_steps."""
    per_step = cfg.batch_size * cfg.grad_accum_steps
    steps_per_epoch = math.ceil(n_train / (per_step * world_size))
    total = progress.step
    if progress.epoch < cfg.max_epochs:
        total += math.ceil((n_train - progress.samples_in_epoch) / (per_step * world_size))
        total += steps_per_epoch * (cfg.max_epochs - progress.epoch - 1)
    return StepPlan(per_step, steps_per_epoch, total if cfg.max_steps is None else min(total, cfg.max_steps))


class Trainer:
    def __init__(self, config: Config, model: GPT, data: CharData, dist_info: DistInfo, run_dir: str):
        self.config = config
        self.cfg = cfg = config.trainer_config
        self.dist = dist_info
        self.device = device = dist_info.device
        self.data = data
        self.train_windows, self.eval_windows = data.place(device, config.data_config.placement)
        self.run_dir = run_dir
        self.snapshot_path = resolve_path(cfg, run_dir)
        comm_hooks.check(cfg, dist_info)  # a hook this run cannot use is refused before any work
        self.comm = comm_hooks.create(cfg, dist_info)
        if device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
        self.amp = amp_policy(cfg, device.type, device.type != "cuda" or torch.cuda.is_bf16_supported())
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp.scaler)
        self.fsdp = parallel.uses_fsdp(cfg, dist_info)  # the parameters are FSDP2 shards over the ranks
        if self.fsdp:  # before the optimizer: the parameters become shards
            # Sharded where it was built (the CPU), so only this rank's shards go to the device.
            parallel.shard(model, dist_info, self.amp.dtype if self.amp.enabled else None)
        self.raw_model = model.to(device)
        model.checkpoint_blocks = cfg.activation_checkpointing
        self.optimizer = create_optimizer(self.raw_model, config.optimizer_config)
        # The first step whose loss was not finite (0: none yet), kept on the device so that
        # checking every step costs no host sync; read where the loop syncs anyway.
        self.nonfinite_step = torch.zeros((), dtype=torch.long, device=device)
        self._last_save = time.monotonic()
        self.eval_notice = SlowNotice()
        self._flops_per_token: float | None = None  # for MFU, at the first log line (_mfu)
        self._peak_flops = 0.0
        self.snapshot = Snapshot(config, dist_info, self.snapshot_path, data.tokenizer.chars, self.raw_model,
                                 self.optimizer, self.scaler, self.comm, data.fingerprint())
        self.saved = self.snapshot.restore()  # the position of the snapshot at snapshot_path (None: none yet)
        self._last_eval = math.nan  # the held-out loss of the last evaluation recorded
        self.progress = dataclasses.replace(self.saved) if self.saved else Progress()
        check_record(run_dir, self.snapshot_path, self.progress.step, dist_info)  # before the record is touched

        self.model = self.raw_model  # what the training step calls
        if dist_info.is_distributed and not self.fsdp:
            ddp = parallel.replicate(self.raw_model, dist_info, self.comm)
            # The comm hook on the DDP model, with the state the snapshot saved (mingpt/comm_hooks.py).
            self.comm.start(ddp, self.snapshot.comm_state, self.progress.step, self.raw_model, self.optimizer,
                            self.scaler, lambda: self._warm_up_ddp(ddp))
            self.model = ddp
        self.model = parallel.maybe_compile(self.model, cfg)

        W = dist_info.world_size
        self.train_sampler = ResumableSampler(len(data.train), W, dist_info.rank, shuffle=True, seed=cfg.seed)
        plan = step_plan(cfg, len(data.train), W, self.progress)
        self.samples_per_step, self.total_steps = plan.samples_per_step, plan.total_steps
        # Events after the step we start from (0 when fresh) are from a killed attempt: dropped.
        # The tracker continues the run the snapshot names (mingpt/tracking.py); a complete run starts none.
        tracker = tracking.start(config, run_dir, self.snapshot.tracker_run_id, self.progress.step,
                                 enabled=dist_info.is_main_process and not self._finished())
        self.snapshot.tracker_run_id = tracker.run_id or self.snapshot.tracker_run_id
        self.metrics = Metrics(run_dir, dist_info.is_main_process, self.progress.step, tracker)
        log.info(
            "model %.2fM parameters | %d training windows, %d held-out | global batch %d (%d per rank x %d accum x %d ranks)"
            " | %d steps per epoch, %d in all | device %s%s%s",
            self.raw_model.num_params() / 1e6, len(data.train), len(data.heldout),
            self.samples_per_step * W, cfg.batch_size, cfg.grad_accum_steps, W,
            plan.steps_per_epoch, self.total_steps, device, f" amp {cfg.amp_dtype}" if self.amp.enabled else "",
            f" | fsdp: 1/{W} of the model on each rank" if self.fsdp else "",
        )
        self._warn_if_slow_on_cpu()

    def _warn_if_slow_on_cpu(self) -> None:
        """A recipe sized for a GPU says, on a CPU, how long its steps will take (mingpt/flops.py)."""
        if self.device.type != "cpu" or not self.dist.is_main_process or self._finished():
            return
        g, tokens = self.config.gpt_config, self.samples_per_step * self.train_windows.block_size
        step_flops = flops.flops_per_token(self.raw_model, g.n_layer, g.n_embd, self.train_windows.block_size) * tokens
        warning = flops.slow_on_cpu(step_flops, self.total_steps - self.progress.step)
        if warning:
            log.warning(warning)

    # ----------------------------------------------------------------- the loop

    def train(self) -> None:
        if self._finished():
            log.info("%s", self._already_complete())
            self._print_sample()
            log.info("%s", self._summary(None))
            return
        status = "FAILED"  # how the run ended, for the tracker
        try:
            # Inside, a stop signal is acted on at the next step boundary (mingpt/stopping.py).
            with stopping.graceful():
                self._window_start, self._window_steps = time.perf_counter(), 0  # for tokens/s
                self._started = time.monotonic()  # for the elapsed time
                self._pace_from: tuple[float, int] | None = None  # for the ETA: (time, step) of the first log
                self._last_save = time.monotonic()  # for save_every_minutes
                while not self._finished():
                    self._train_epoch()
                final = self._last_eval if self._stopped_early() else self.evaluate()  # evaluated at this step
                self.save()
                self.snapshot.wait()  # an asynchronous save is written before the run ends
                self._stop_if_requested(self._agree())
            self.metrics.end_progress()  # the bar's line is cleared before the sample is printed
            self._print_sample()
            log.info("%s", self._summary(final))
            status = "FINISHED"
        except stopping.Stopped:
            status = "KILLED"  # stopped by a signal, after a snapshot: a resume continues it
            raise
        except Exception:
            self._finish_save_in_flight()
            raise
        finally:
            self.metrics.close(status)

    def _finish_save_in_flight(self) -> None:
        """On the way out with an error: a save still being written in the background
        is completed (its atomic publication included) before the process leaves; its
        own failure is logged, and the error on the way out is the one given."""
        try:
            self.snapshot.wait()
        except StorageError as e:
            log.warning("%s", e)

    def _shown_snapshot_path(self) -> str:
        """The snapshot's path as typed from the directory the run started in, where it is inside."""
        return self._shown(self.snapshot_path)

    @staticmethod
    def _shown(path: str) -> str:
        """`path` as typed from the directory the run started in, where it is inside."""
        return path if "://" in path or os.path.relpath(path).startswith("..") else os.path.relpath(path)

    def _summary(self, final: float | None) -> str:
        """The closing line: the held-out losses, the best weights, the snapshot and the
        command that samples from the best weights (from the snapshot while there are none)."""
        p = self.progress
        losses = [f"held-out loss {final:.4f}"] if final is not None and math.isfinite(final) else []
        best = find_best(self.snapshot_path) if math.isfinite(p.best_eval_loss) else None
        if math.isfinite(p.best_eval_loss):
            where = f" ({self._shown(best)})" if best else ""
            losses.append(f"best {p.best_eval_loss:.4f} at step {p.best_step}{where}")
        stopped = " (stopped early)" if self._stopped_early() else ""
        return (f"done at step {p.step}{stopped}: {', '.join(losses) or 'no held-out loss'} | snapshot "
                f"{self._shown_snapshot_path()} | sample from {'the best' if best else 'it'}: "
                f"python -m mingpt.generate snapshot_path={shlex.quote(self._shown(best or self.snapshot_path))}")

    def _train_epoch(self) -> None:
        """Train from the next unseen sample of the current epoch to its end (or to the last step)."""
        cfg, p = self.cfg, self.progress
        self.train_sampler.set_epoch(p.epoch)
        self.train_sampler.start_index = p.samples_in_epoch
        order = self.train_sampler.indices().to(self.train_windows.tokens.device)  # host-gathered: stays on the host
        per_step = self.samples_per_step
        for start in range(0, len(order), per_step):
            indices = order[start : start + per_step]
            loss, grad_norm, lr = self.train_step(indices)
            if start + per_step < len(order):  # host-gathered batches: the next is copied while this step runs
                self.train_windows.prefetch(order[start + per_step : start + 2 * per_step])
            if self.device.type == "cpu" and not self.dist.is_distributed:
                self._check_diverged(p.step + 1)  # free on a CPU: stop at the step itself
            p.samples_in_epoch = min(len(self.data.train), p.samples_in_epoch + len(indices) * self.dist.world_size)
            p.step += 1
            self._window_steps += 1
            self.metrics.show_progress(p.step, self.total_steps)
            if p.step % cfg.log_every == 0 or p.step == self.total_steps:
                self._log_train(loss, grad_norm, lr)
            if p.step >= self.total_steps:
                break
            with self._paused():
                if cfg.eval_every and p.step % cfg.eval_every == 0:
                    self.evaluate()
                # After the step's evaluation: a resume goes on with the next step.
                flags = self._agree()
                self._stop_if_requested(flags)
                if (cfg.save_every_steps and p.step % cfg.save_every_steps == 0) or flags[StepFlags.SAVE_DUE]:
                    self.save()
            if self._stopped_early():
                break
        if p.samples_in_epoch >= len(self.data.train):
            p.epoch, p.samples_in_epoch = p.epoch + 1, 0
            with self._paused():
                if cfg.eval_every == 0 and not self._finished():
                    self.evaluate()
                if p.epoch % cfg.save_every == 0 and not self._finished():
                    self.save()

    def _log_train(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """Log the last step's loss (mean over ranks) and the tokens/s since the last log.
        Every rank takes part (the mean is an all-reduce), so all stop together on divergence."""
        p = self.progress
        self._check_diverged(p.step)
        loss = self._global_mean(loss)
        if not math.isfinite(loss):
            raise TrainingError(f"training diverged: the loss is {loss} at step {p.step}; {self._kept()}")
        grad_norm = float(grad_norm)
        grad_norm = grad_norm if math.isfinite(grad_norm) else None  # an fp16 step the GradScaler skipped
        tokens = self._window_steps * self.samples_per_step * self.dist.world_size * self.train_windows.block_size
        tokens_per_s = tokens / (time.perf_counter() - self._window_start)
        # Elapsed and ETA go to the log line only: metrics.jsonl holds the same records for any
        # machine. The ETA is at this session's pace since its first log line, evaluations and
        # saves included: the first window holds the start-up and compile, so it has none.
        now = time.monotonic()
        note = f"elapsed {_duration(now - self._started)}"
        if self._pace_from is None:
            self._pace_from = (now, p.step)
        else:
            since, step = self._pace_from
            note += f" eta {_duration((now - since) / max(1, p.step - step) * (self.total_steps - p.step))}"
        self.metrics.log("train", p.step, p.epoch, loss=loss, lr=lr, grad_norm=grad_norm,
                         tokens_per_s=tokens_per_s, mfu=self._mfu(tokens_per_s),
                         peak_mem_mib=round(flops.peak_memory_mib(self.device)), note=note)
        self._window_start, self._window_steps = time.perf_counter(), 0

    def _mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation: the model's FLOP/s (flops.flops_per_token, as
        bench_train counts them) over a large matmul's in the step's precision,
        measured once by rank 0 (flops.peak_rate) and counted once per process.
        None for steps too small for it to mean anything (the tests' models)."""
        if self._flops_per_token is None:
            g = self.config.gpt_config
            self._flops_per_token = flops.flops_per_token(self.raw_model, g.n_layer, g.n_embd,
                                                          self.train_windows.block_size)
            step_flops = self._flops_per_token * self.samples_per_step * self.train_windows.block_size
            if self.dist.is_main_process and step_flops >= flops.MFU_ABOVE_FLOPS:
                dtype = self.amp.dtype if self.amp.enabled else torch.float32
                self._peak_flops = flops.peak_rate(self.device, dtype) * self.dist.world_size
        if not self._peak_flops:
            return None
        return tokens_per_s * self._flops_per_token / self._peak_flops

    def _already_complete(self) -> str:
        """What to type instead, when a command finds its run complete. The number of
        processes is not part of a run (an elastic restart with fewer or more resumes
        the same one), so the same command under torchrun finds it complete too."""
        cfg, p = self.cfg, self.progress
        if self._stopped_early():
            further = "trainer_config.early_stop_patience=null"
        elif cfg.max_steps is not None and p.step >= cfg.max_steps:
            further = f"trainer_config.max_steps={2 * cfg.max_steps}"
        else:
            further = f"trainer_config.max_epochs={p.epoch + 1}"
        # hydra.run.dir=PATH names the directory itself: there a new run needs another path.
        named = os.path.basename(os.path.normpath(self.run_dir)).startswith(cfg.run_name)
        new = "trainer_config.run_name=NAME (a name not used yet)" if named else "hydra.run.dir=ANOTHER_DIRECTORY"
        early = f", stopped early (best held-out loss {p.best_eval_loss:.4f} at step {p.best_step})" \
            if self._stopped_early() else ""
        return (f"run already complete at step {p.step}{early} (snapshot {self._shown_snapshot_path()}), whatever the "
                f"number of processes: nothing to train. For a new run add {new}; "
                f"to train this one further add {further} trainer_config.allow_config_change=true")

    def _agree(self) -> list[int]:
        """The per-step decisions (StepFlags), the same on every rank: one tiny
        all-reduce (MAX) of this rank's flags."""
        flags = [0] * len(StepFlags)
        flags[StepFlags.STOP] = stopping.stop_requested()
        minutes = self.cfg.save_every_minutes
        if self.dist.is_main_process and minutes:  # rank 0's clock decides for all
            flags[StepFlags.SAVE_DUE] = int(time.monotonic() - self._last_save >= 60 * minutes)
        return all_max(self.dist, flags)

    def _stop_if_requested(self, flags: list[int]) -> None:
        """Some rank received a stop signal: every rank saves (rank 0 writes) and stops."""
        signum = flags[StepFlags.STOP]
        if not signum:
            return
        self.save()
        self.snapshot.wait()
        barrier(self.dist)  # rank 0's save is complete before any rank leaves
        raise stopping.Stopped(
            signum, f"{stopping.describe(signum)} at step {self.progress.step}; the snapshot {self.snapshot_path} "
            f"resumes the run ({stopping.signal_name(signum)}, exit status {stopping.exit_status(signum)})",
        )

    def _check_diverged(self, step: int) -> None:
        """Stop if the loss was not finite at any step so far (all ranks agree:
        the flag is all-reduced, so every rank must call this at the same step)."""
        flag = self.nonfinite_step
        if self.dist.is_distributed:
            flag = flag.clone()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        first = int(flag)  # the host sync
        if first:
            found = "" if first == step else f" (found at step {step})"
            raise TrainingError(f"training diverged: the loss is not finite at step {first}{found}; {self._kept()}")

    def _kept(self) -> str:
        """What is left to resume from, truthfully."""
        if self.saved is None:
            return f"no snapshot was written yet ({self.snapshot_path})"
        return f"the last good snapshot is kept at {self.snapshot_path}, step {self.saved.step}"

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """Time spent in the body (evaluating, saving) does not count as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._window_start += time.perf_counter() - start

    def _finished(self) -> bool:
        p = self.progress
        return p.epoch >= self.cfg.max_epochs or p.step >= self.total_steps or self._stopped_early()

    def _stopped_early(self) -> bool:
        """Early stopping ended the run (as the snapshot records it), and this config
        still would: a larger early_stop_patience, or null, trains on."""
        p, patience = self.progress, self.cfg.early_stop_patience
        return p.stopped_early and patience is not None and p.evals_without_improvement >= patience

    def train_step(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over this rank's share of the global batch, in
        micro-batches of batch_size. Each micro-batch's loss is weighted by its
        share of the samples, so accumulation gives the same update as one big batch."""
        cfg, p = self.cfg, self.progress
        lr = lr_at(p.step, self.config.optimizer_config, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(hash((cfg.seed, self.dist.rank, p.step)) & 0xFFFF_FFFF)  # dropout's stream
        micro_batches = indices.split(cfg.batch_size)
        step_loss = torch.zeros((), device=self.device)
        for k, micro in enumerate(micro_batches):
            x, y = self.train_windows.batch(micro)
            weight = len(micro) / len(indices)
            last = k == len(micro_batches) - 1
            with parallel.gradient_sync(self.model, self.raw_model, enabled=last):
                with self._autocast():
                    _, loss = self.model(x, y)
                self.scaler.scale(loss * weight).backward()
            step_loss += loss.detach() * weight
        bad = (self.nonfinite_step == 0) & ~torch.isfinite(step_loss)
        self.nonfinite_step = torch.where(bad, p.step + 1, self.nonfinite_step)
        self.scaler.unscale_(self.optimizer)
        # The global norm: over the shards too, with FSDP.
        grad_norm = parallel.full_value(torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_norm_clip))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.comm.after_optimizer_step(self.raw_model)  # LocalSGD: the periodic averaging
        self.optimizer.zero_grad(set_to_none=True)
        return step_loss, grad_norm, lr

    def _global_mean(self, value: torch.Tensor) -> float:
        if self.dist.is_distributed:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.AVG if self.dist.backend == "nccl" else dist.ReduceOp.SUM)
            if self.dist.backend != "nccl":
                value /= self.dist.world_size
        return value.item()

    # ---------------------------------------------------------------- evaluation

    def evaluate(self) -> float:
        """The held-out loss of the run's weights (with LocalSGD: of the replicas' mean)."""
        with self.comm.mean_weights(self.raw_model):
            return self._evaluate()

    def _evaluate(self) -> float:
        """Evaluate (mingpt/evaluation.py), log the result and a sample."""
        self._check_diverged(self.progress.step)
        p = self.progress
        start = time.monotonic()
        if self.eval_notice.slow:
            n = len(evaluation.chosen_windows(len(self.eval_windows), self.eval_windows.block_size,
                                              self.cfg.eval_tokens))
            log.info("evaluating at step %d on %d held-out windows", p.step, n)
        result = evaluation.evaluate(self.raw_model, self.eval_windows, self.dist, self.cfg.eval_tokens,
                                     self.cfg.batch_size * 4, self._autocast, lockstep=self.fsdp,
                                     stop_requested=stopping.stop_requested)
        if result.interrupted:
            log.info("evaluation at step %d interrupted by a stop signal: not recorded", p.step)
            return math.nan
        if not math.isfinite(result.loss):  # the weights of the last update are not: no log, no sample
            raise TrainingError(
                f"training diverged: the held-out loss is {result.loss} at step {p.step}; {self._kept()}")
        self._record_eval(result.loss)
        self.metrics.log("eval", p.step, p.epoch, loss=result.loss, bpc=result.loss / math.log(2),
                         perplexity=math.exp(result.loss),
                         rank_losses=result.rank_losses, tokens=result.tokens)
        if self.cfg.sample_chars and (self.dist.is_main_process or self.fsdp):
            text = self.sample(self.cfg.sample_chars, stoppable=True)
            if text is None:  # the step boundary right after stops the run
                log.info("sample at step %d interrupted by a stop signal: not recorded", p.step)
            else:
                self.metrics.text("sample", text, p.step)
        seconds = time.monotonic() - start
        if self.eval_notice.took(seconds):
            log.info("evaluation at step %d took %.1f s", p.step, seconds)
        return result.loss

    def _record_eval(self, loss: float) -> None:
        """A completed evaluation's loss (all-reduced: the same on every rank, so every
        rank decides alike): a new best writes the best weights (every rank takes part);
        early stopping counts the evaluations without an improvement of at least
        early_stop_min_delta, and stops the run once early_stop_patience of them follow."""
        cfg, p = self.cfg, self.progress
        self._last_eval, p.stopped_early = loss, False  # evaluating: not stopped (a larger patience trains on)
        improved = loss < p.best_eval_loss
        p.evals_without_improvement = 0 if improved and p.best_eval_loss - loss >= cfg.early_stop_min_delta \
            else p.evals_without_improvement + 1
        if improved:
            p.best_eval_loss, p.best_step = loss, p.step
            try:
                self.snapshot.save_best(p)
            except NotFinite:
                raise TrainingError(f"weights are not finite at step {p.step}, not saving; {self._kept()}") from None
        patience = cfg.early_stop_patience
        if patience is not None and p.evals_without_improvement >= patience and not self._finished():
            p.stopped_early = True
            log.info("stopping early at step %d: %d evaluations in a row without lowering the held-out loss by at "
                     "least %g (trainer_config.early_stop_patience=%d, early_stop_min_delta); best %.4f at step %d",
                     p.step, p.evals_without_improvement, cfg.early_stop_min_delta, patience,
                     p.best_eval_loss, p.best_step)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for AMP; a sharded model casts by FSDP's own mixed-precision policy instead."""
        return torch.autocast(self.device.type, dtype=self.amp.dtype, enabled=self.amp.enabled and not self.fsdp)

    def sample(self, n_chars: int, stoppable: bool = False) -> str | None:
        """Text generated from the current weights at the start of a line, seeded
        by (seed, step); it leaves the training random streams untouched. A sharded
        model's ranks all generate, in lockstep (each forward gathers the parameters).
        `stoppable`: a stop request ends it early (every STOP_CHECK_EVERY tokens; with
        a sharded model all ranks decide together), and it returns None."""
        tok = self.data.tokenizer
        prompt = tok.line_start()
        generator = torch.Generator(self.device).manual_seed(self.cfg.seed + self.progress.step)
        idx = tok.encode(prompt).long()[None].to(self.device)
        tokens = []
        # Chunks by count alone (no time limit), so that a sharded model's ranks look
        # for a stop request at the same tokens.
        with contextlib.closing(generate(self.raw_model, idx, n_chars, temperature=1.0, top_k=None,
                                         generator=generator, chunk_tokens=STOP_CHECK_EVERY,
                                         chunk_seconds=None)) as new:
            for chunk in new:
                if stoppable and self._stop_requested_in_sample():
                    return None
                tokens.append(chunk)
        return prompt + tok.decode(torch.cat(tokens, dim=1)[0].tolist()) if tokens else prompt

    def _stop_requested_in_sample(self) -> bool:
        """This rank's stop request, or with a sharded model any rank's (one tiny all-reduce)."""
        if self.fsdp:
            return bool(all_max(self.dist, [stopping.stop_requested()])[0])
        return bool(stopping.stop_requested())

    def _print_sample(self) -> None:
        with self.comm.mean_weights(self.raw_model):  # every rank takes part
            if self.cfg.sample_chars and (self.dist.is_main_process or self.fsdp):
                sample = self.sample(self.cfg.sample_chars)
                if self.dist.is_main_process:
                    print(f"--- sample after step {self.progress.step} ---\n{sample}", flush=True)

    # ----------------------------------------------------------------- snapshots

    def save(self) -> None:
        """Save a snapshot (mingpt/snapshot/manager.py), never with non-finite weights
        (all ranks agree, so all stop together). Every rank calls it. Saving
        changes nothing in the training state (time-based saves come at any
        step); a second call at the same position does nothing."""
        if self.saved == self.progress:
            return
        self._check_diverged(self.progress.step)
        try:
            self.snapshot.save(self.progress)
        except NotFinite:
            raise TrainingError(f"weights are not finite at step {self.progress.step}, not saving; "
                                f"{self._kept()}") from None
        self.saved = dataclasses.replace(self.progress)
        self._last_save = time.monotonic()

    # ---------------------------------------------------------- communication

    def _warm_up_ddp(self, ddp: DDP) -> None:
        """One DDP forward and backward on a training batch, gradients dropped: DDP
        rebuilds its buckets (in the order backward produces gradients) at the next step."""
        first = torch.arange(min(self.cfg.batch_size, len(self.data.train)), device=self.device)
        x, y = self.train_windows.batch(first)
        _, loss = ddp(x, y)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
