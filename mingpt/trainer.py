"""The training loop and step.

Exact resume needs no generator state: epoch e's order is seeded by (seed, e), dropout's stream is
reseeded from (seed, rank, step) before each step, and the learning rate is a function of the step.
So a run's position, its TrainState, is all that a snapshot keeps beside the weights and the
optimizer's state."""

import contextlib
import dataclasses
import functools
import logging
import math
import os
import socket
import time
import types
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from mingpt import comm_hooks, evaluation, flops, parallel, stopping, tracking
from mingpt.checkpointer import Checkpointer, NotFinite
from mingpt.config import Config, ConfigError, TrainerConfig, value_text
from mingpt.data import CharData, ResumableSampler
from mingpt.decoding import sample_line
from mingpt.distributed import SAME_ON_EVERY_RANK, DistInfo, all_max, global_mean
from mingpt.metrics import Metrics, Pace, SlowNotice
from mingpt.model import GPT
from mingpt.optim import create_optimizer, lr_at, set_lr

log = logging.getLogger(__name__)


# What a pace far below the run's best points to (metrics.PaceEvent.slowed_from), by device type.
BUSY_HINT = {
    "cpu": "this machine's CPU cores: stopped with Ctrl-C, the run continues from its snapshot "
    "when the same command runs again with OMP_NUM_THREADS set to the cores left idle",
    "cuda": "this machine's GPU",
}


class TrainingError(RuntimeError):
    """Training cannot go on (the loss diverged, say); the message says what is kept."""


@dataclasses.dataclass
class TrainState:
    """Where the run is: advanced by each step, saved in every snapshot, restored on resume."""

    epoch: int = 0  # the epoch in progress (= epochs finished)
    samples_in_epoch: int = 0  # global samples of that epoch consumed by all ranks together
    step: int = 0  # optimizer steps done
    best_eval_loss: float = math.inf
    best_step: int = 0  # the step of the evaluation that gave best_eval_loss
    # The held-out loss of this step's weights (None: not evaluated), for the closing line of a run
    # found complete (a lowered max_steps can end it at a step that was not evaluated) or resumed
    # only to redo that evaluation's sample.
    last_eval_loss: float | None = None
    evals_without_improvement: int = 0  # in a row, by early_stop_min_delta: early stopping's count
    # The best loss when that count last restarted: a loss below it by early_stop_min_delta is an
    # improvement, however many smaller drops of the best loss came between.
    early_stop_reference: float = math.inf
    stopped_early: bool = False  # early stopping ended the run here
    # A stop signal cut short the evaluation of this step's weights: the resumed run does it first,
    # so that its loss, best weights and early stopping are the uninterrupted run's.
    eval_due: bool = False
    sample_due: bool = False  # the same for the sample after it, once its loss is recorded

    @classmethod
    def restored(cls, saved: dict | None, epoch_samples: int) -> "TrainState":
        """The position a snapshot's record holds (a fresh one without a snapshot), in epochs of
        `epoch_samples` samples."""
        if saved is None:
            return cls()
        state = cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})
        # A snapshot of an older mingpt counted from its best loss.
        if "early_stop_reference" not in saved:
            state.early_stop_reference = state.best_eval_loss
        # A corpus or stride changed since (allow_config_change) may leave the epoch fewer samples
        # than it consumed: it is over. Its rest, none, was no step, and the run never ended.
        if state.samples_in_epoch >= epoch_samples:
            log.warning(
                "the epoch resumed has %d training windows, fewer than the %d it consumed: "
                "it is over",
                epoch_samples,
                state.samples_in_epoch,
                extra=SAME_ON_EVERY_RANK,
            )
            state.epoch += 1
            state.samples_in_epoch = 0
        return state

    def advance(self, samples: int, epoch_samples: int) -> bool:
        """Count one step over `samples` global samples; returns whether it ended the epoch."""
        self.step += 1
        self.last_eval_loss = None
        self.samples_in_epoch += samples
        if self.samples_in_epoch < epoch_samples:
            return False
        self.epoch += 1
        self.samples_in_epoch = 0
        return True


class AmpPolicy(NamedTuple):
    enabled: bool  # autocast (with FSDP: its mixed-precision policy) in `dtype`
    dtype: torch.dtype  # float32 without AMP: the dtype MFU's peak is measured in
    scaler: bool  # fp16 needs a gradient scaler; bf16 does not


def amp_policy(cfg: TrainerConfig, device_type: str, bf16_supported: bool = True) -> AmpPolicy:
    """AMP on CUDA when use_amp; on a CPU only when amp_on_cpu forces it, with a warning. bf16 on a
    GPU that lacks it is refused."""
    enabled = cfg.amp_on(device_type)
    dtype = torch.float32
    if enabled:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp_dtype]
    if dtype == torch.bfloat16 and device_type == "cuda" and not bf16_supported:
        raise ConfigError("trainer_config.amp_dtype: bf16 is not supported on this GPU; use fp16")
    if cfg.use_amp and device_type == "cpu":
        how = "forced"
        hint = ""
        if not cfg.amp_on_cpu:
            how = "ignored"
            hint = " (trainer_config.amp_on_cpu=true forces it)"
        log.warning(
            "trainer_config.use_amp %s on CPU: CPUs without bf16/fp16 units run it far slower than "
            "fp32%s",
            how,
            hint,
            extra=SAME_ON_EVERY_RANK,
        )
    return AmpPolicy(enabled, dtype, dtype == torch.float16)


class StepPlan(NamedTuple):
    samples_per_step: int  # per rank: batch_size windows for each of grad_accum_steps micro-steps
    steps_per_epoch: int  # at this world size
    # Steps done plus steps to go: a resume with another world size still finishes every epoch.
    total_steps: int


def step_plan(cfg: TrainerConfig, n_train: int, world_size: int, state: TrainState) -> StepPlan:
    """How many optimizer steps the run takes from `state` on, capped by max_steps."""
    per_step = cfg.batch_size * cfg.grad_accum_steps
    global_batch = per_step * world_size
    steps_per_epoch = math.ceil(n_train / global_batch)
    total = state.step
    if state.epoch < cfg.max_epochs:
        total += math.ceil((n_train - state.samples_in_epoch) / global_batch)
        total += steps_per_epoch * (cfg.max_epochs - state.epoch - 1)
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return StepPlan(per_step, steps_per_epoch, total)


class Trainer:
    def __init__(
        self,
        config: Config,
        model: GPT,
        data: CharData,
        dist_info: DistInfo,
        run_dir: str,
        snapshot_path: str,
    ):
        cfg = config.trainer_config
        device = dist_info.device
        self.config = config
        self.cfg = cfg
        self.dist = dist_info
        self.data = data
        self.device = device
        self.run_dir = run_dir
        self.snapshot_path = snapshot_path
        self.train_windows, self.eval_windows = data.place(device, config.data_config.placement)
        self.comm = comm_hooks.create(cfg, dist_info)
        on_cuda = device.type == "cuda"
        if on_cuda:
            torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
        self.amp = amp_policy(cfg, device.type, not on_cuda or torch.cuda.is_bf16_supported())
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp.scaler)
        # A single process never shards.
        self.fsdp = cfg.parallelism == "fsdp" and dist_info.is_distributed
        # Sharded before the optimizer is built, and on the CPU: only this rank's shards go to the
        # device.
        if self.fsdp:
            parallel.shard(model, dist_info, self.amp.dtype if self.amp.enabled else None)
        model.checkpoint_blocks = cfg.activation_checkpointing
        # Moved in place: `model` is the raw model from here on.
        self.raw_model = model.to(device)
        self.optimizer = create_optimizer(model, config.optimizer_config)
        # The first step whose loss was not finite (0: none yet), kept on the device: no host sync
        # per step.
        self.nonfinite_step = torch.zeros((), dtype=torch.long, device=device)
        self.eval_notice = SlowNotice()
        self.evaluator = evaluation.Evaluator(cfg)

        # Resume: the newest snapshot's weights, optimizer state and position, where the run has
        # one. With ddp before DDP wraps the model (DDP copies rank 0's weights), with fsdp once the
        # model is sharded.
        checkpointer = Checkpointer(
            config,
            dist_info,
            snapshot_path,
            model,
            self.optimizer,
            self.scaler,
            self.comm,
            data.tokenizer.chars,
            data.fingerprint(),
            run_dir,
        )
        self.checkpointer = checkpointer
        n_train = len(data.train)
        state = TrainState.restored(checkpointer.load(), n_train)
        self.state = state

        ddp = None
        self.model = model  # what the step calls
        if dist_info.is_distributed and not self.fsdp:
            ddp = parallel.replicate(model, dist_info, self.comm)
            self.model = ddp
        if cfg.compile:
            self.model = torch.compile(self.model)
        # In one process too: there a hook's state saved by several ranks is said to go unused.
        # The warm-up step goes through the model that trains (compiled or not): the compiled
        # backward produces the gradients in another order, which the restored state is laid out in.
        self.comm.start(
            ddp,
            checkpointer.comm_state,
            state.step,
            model,
            self.optimizer,
            self.scaler,
            functools.partial(self._warm_up_ddp, self.model),
        )
        W = dist_info.world_size
        self.train_sampler = ResumableSampler(n_train, W, dist_info.rank, seed=cfg.seed)
        self.plan = step_plan(cfg, n_train, W, state)
        self.samples_per_step = self.plan.samples_per_step
        self.total_steps = self.plan.total_steps
        warmup = config.optimizer_config.warmup_steps
        # A run complete already (its command again) trains no step: no warmup to speak of.
        if state.step < self.total_steps <= warmup:
            log.warning(
                "optimizer_config.warmup_steps=%d covers the whole run of %d steps "
                "(trainer_config.max_steps=%s, max_epochs=%d): the learning rate rises to the "
                "end and reaches optimizer_config.learning_rate at the last step or never",
                warmup,
                self.total_steps,
                value_text(cfg.max_steps),  # `null` where unset, as it is typed
                cfg.max_epochs,
                extra=SAME_ON_EVERY_RANK,
            )
        # wsd's cooldown, the run's last cooldown_fraction, may begin before the warmup ends: the
        # rate falls at once from its peak, which no step held.
        elif (
            state.step < warmup < self.total_steps and config.optimizer_config.lr_schedule == "wsd"
        ):
            opt = config.optimizer_config
            after = lr_at(warmup, opt, self.total_steps) / opt.learning_rate
            # Not a fall of rounding: the floor plus the rest of the peak can come to just under 1.
            if after < 0.99:
                log.warning(
                    "optimizer_config.warmup_steps=%d runs into the wsd cooldown (the last "
                    "cooldown_fraction=%g of the run's %d steps): the learning rate falls from its "
                    "peak to %.0f%% of it at step %d",
                    warmup,
                    opt.cooldown_fraction,
                    self.total_steps,
                    100 * after,
                    warmup + 1,
                    extra=SAME_ON_EVERY_RANK,
                )
        tracker = tracking.start(
            config,
            run_dir,
            checkpointer.tracker_run_id,
            state.step,
            dist_info.is_main_process,
            self.finished(),
        )
        if tracker.run_id:
            checkpointer.tracker_run_id = tracker.run_id
        self.metrics = Metrics(
            run_dir,
            dist_info.is_main_process,
            state.step,
            tracker,
            state.eval_due,
            state.sample_due,
        )
        step_tokens = self.samples_per_step * self.train_windows.block_size
        flops_per_token = flops.flops_per_token(model)
        peak = functools.partial(
            flops.peak_for_mfu, flops_per_token * step_tokens, dist_info, self.amp.dtype
        )
        self.pace = Pace(step_tokens * W, flops_per_token, peak, state.step)

    def finished(self) -> bool:
        """Out of steps (or epochs), or stopped early, with no evaluation (or sample) left to do."""
        if self.state.eval_due or self.state.sample_due:
            return False
        return self.state.step >= self.total_steps or self.evaluator.stopped_early(self.state)

    def train(self) -> float | None:
        """Train from the run's position to its last step; returns the final held-out loss. A stop
        signal saves and stops the run at the next step boundary (stopping.Stopped)."""
        state = self.state
        batches = self._batches()
        status = "FAILED"  # how the run ended, for the experiment tracker
        try:
            with stopping.graceful(), self._profiler() as profiler:
                last_step = state.step >= self.total_steps
                # The evaluation (or its sample) of the step resumed from, which a stop cut short,
                # comes first.
                if state.eval_due or state.sample_due:
                    last_step = self._after_step(state.eval_due, last_step, epoch_ended=False)
                while not last_step:
                    # One optimizer step over this rank's share of the next global batch.
                    indices = next(batches)
                    loss, grad_norm, lr = self.train_step(indices)
                    samples = len(indices) * self.dist.world_size
                    # An epoch's last step (or every step, where the global batch exceeds the
                    # epoch) trains fewer windows: the pace counts those.
                    if len(indices) < self.samples_per_step:
                        self.pace.short_step(samples * self.train_windows.block_size)
                    epoch_ended = state.advance(samples, len(self.data.train))
                    last_step = state.step >= self.total_steps
                    self.metrics.show_progress(state.step, self.total_steps)
                    evaluate = last_step or self.evaluator.due(state.step, epoch_ended)
                    # Under early stopping any evaluation can end the run: its last step has a train
                    # event, as the last of max_steps has.
                    may_end = last_step or (evaluate and self.cfg.early_stop_patience is not None)
                    if may_end or state.step % self.cfg.log_every == 0:
                        self._log_train(loss, grad_norm, lr)
                    last_step = self._after_step(evaluate, last_step, epoch_ended)
                    profiler.step()
            status = "FINISHED"
            return state.last_eval_loss
        except stopping.Stopped:
            # After a snapshot: a resume continues the run, unless the stop came once it was done.
            status = "KILLED"
            if self.finished():
                status = "FINISHED"
            raise
        except Exception:
            self.checkpointer.finish_in_flight()
            raise
        finally:
            self.metrics.close(status)

    def _after_step(self, evaluate: bool, last_step: bool, epoch_ended: bool) -> bool:
        """Evaluate (where due) and save (where the checkpointer finds it due, and on a stop
        signal, which stops the run); returns whether the run ends at this step: an early stop
        ends it too. They are not training: the pace leaves them out."""
        state = self.state
        with self.pace.paused():
            if evaluate:
                self.evaluate(last_step)
            elif state.sample_due:
                with self.comm.mean_weights():
                    self._record_sample()
            last_step = last_step or self.evaluator.stopped_early(state)
            # An evaluation or sample that a stop cut short leaves the run to do: its end is not
            # reached.
            cut_short = state.eval_due or state.sample_due
            with self._weights_finite():
                self.checkpointer.save(state, last_step and not cut_short, epoch_ended)
        return last_step

    def _profiler(self) -> contextlib.AbstractContextManager:
        """With profile_steps, torch.profiler over that many steps (at most those left) after one of
        warm-up, each rank's trace written into profile/ in the run directory; else a profiler that
        records nothing."""
        steps = self.cfg.profile_steps
        first = self.state.step + 2
        # The run's end cuts the window short.
        last = min(first + steps - 1, self.total_steps)
        if last < first:
            if steps:
                log.warning(
                    "trainer_config.profile_steps: the run ends at step %d, with no step after the "
                    "warm-up one: nothing is profiled",
                    self.total_steps,
                    extra=SAME_ON_EVERY_RANK,
                )
            return contextlib.nullcontext(types.SimpleNamespace(step=lambda: None))
        trace_dir = os.path.join(self.run_dir, "profile")
        log.info("profiling steps %d to %d into %s", first, last, trace_dir)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=functools.partial(self._write_trace, trace_dir),
            record_shapes=True,
            profile_memory=True,
        )

    @staticmethod
    def _write_trace(trace_dir: str, profiler: torch.profiler.profile) -> None:
        """This rank's trace in trace_dir, named as TensorBoard's profiler plugin names it. Not
        worth the run, as the metrics are not: a trace that cannot be written (a full disk, a file
        where trace_dir should be) costs a warning, and its partial file goes."""
        name = f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"
        path = os.path.join(trace_dir, name)
        try:
            os.makedirs(trace_dir, exist_ok=True)
            profiler.export_chrome_trace(path)
        except OSError as e:
            why = str(e)
        else:
            if os.path.exists(path):
                return
            # The profiler says a failed write on stderr alone, and leaves PATH.tmp.
            why = "the profiler could not write it"
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        log.warning("cannot write the profiler's trace %s (%s): training goes on", path, why)

    def _batches(self) -> Iterator[torch.Tensor]:
        """This rank's samples for each step, from the run's position on, epoch after epoch."""
        while True:
            self.train_sampler.set_epoch(self.state.epoch)
            self.train_sampler.start_index = self.state.samples_in_epoch
            # Indices of host-gathered batches stay on the host.
            order = self.train_sampler.indices().to(self.train_windows.tokens.device)
            # Sliced step by step: a view for every step of the epoch at once costs a large corpus's
            # process tens of megabytes.
            per_step = self.samples_per_step
            for start in range(0, len(order), per_step):
                yield order[start : start + per_step]
                # Host-gathered batches: the next is read while the step just queued runs.
                if start + per_step < len(order):
                    self.train_windows.prefetch(order[start + per_step : start + 2 * per_step])

    def train_step(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over this rank's share of the global batch, in micro-batches of
        batch_size, each loss weighted by its share of the samples: accumulation gives the update of
        one big batch."""
        cfg = self.cfg
        step = self.state.step
        lr = set_lr(self.optimizer, step, self.config.optimizer_config, self.total_steps)
        # Dropout's random stream, a function of the position alone: the generators of the step's
        # device. torch.manual_seed would seed every backend's too, and for each one not started
        # (all on a CPU-only host) it formats the call's stack, to replay the seeding if one starts:
        # 2 ms a step under Hydra's deep stack.
        seed = hash((cfg.seed, self.dist.rank, step)) & 0xFFFF_FFFF
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        micro_batches = indices.split(cfg.batch_size)
        step_loss = torch.zeros((), device=self.device)
        for k, micro in enumerate(micro_batches):
            weight = len(micro) / len(indices)
            last_micro = k == len(micro_batches) - 1
            with parallel.gradient_sync(self.model, self.raw_model, enabled=last_micro):
                with self._autocast():
                    _, loss = self.model(*self.train_windows.batch(micro))
                self.scaler.scale(loss * weight).backward()
            step_loss += loss.detach() * weight
        first_bad = (self.nonfinite_step == 0) & ~torch.isfinite(step_loss)
        self.nonfinite_step = torch.where(first_bad, step + 1, self.nonfinite_step)
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_norm_clip)
        grad_norm = parallel.full_value(norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.comm.after_optimizer_step()  # LocalSGD: the periodic averaging
        self.optimizer.zero_grad()
        # Free on a CPU: the run stops at the very step whose loss was not finite.
        if self.device.type == "cpu" and not self.dist.is_distributed:
            self._check_diverged(step + 1)
        return step_loss, grad_norm, lr

    def _log_train(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """A train event. The loss is the mean over the ranks: every rank takes part, so that all
        stop together on a divergence."""
        state = self.state
        self._check_diverged(state.step)
        lrs = {"lr": lr}
        # The blocks' matrices under Muon follow a schedule of their own
        # (optimizer_config.muon_learning_rate).
        if self.config.optimizer_config.algorithm == "muon":
            lrs["muon_lr"] = self.optimizer.param_groups[-1]["lr"]
        grad_norm = float(grad_norm)
        # Not finite: an fp16 step that the GradScaler skipped.
        if not math.isfinite(grad_norm):
            grad_norm = None
        pace = self.pace.event(state.step, self.total_steps)
        if pace.slowed_from is not None:
            log.warning(
                "training slowed to %.0f tokens/s by step %d, under a third of the %.0f it ran at "
                "before: other work may be holding %s",
                pace.tokens_per_s,
                state.step,
                pace.slowed_from,
                BUSY_HINT[self.device.type],
                extra=SAME_ON_EVERY_RANK,
            )
        self.metrics.log(
            "train",
            state.step,
            state.epoch,
            note=pace.note,
            loss=global_mean(self.dist, loss),
            **lrs,
            grad_norm=grad_norm,
            tokens_per_s=pace.tokens_per_s,
            mfu=pace.mfu,
            peak_mem_mib=round(flops.peak_memory_mib(self.device)),
        )

    def _check_diverged(self, step: int) -> None:
        """Stop if the loss was not finite at any step so far. Every rank calls this at the same
        step."""
        # The host sync.
        first = all_max(self.dist, [int(self.nonfinite_step)])[0]
        if not first:
            return
        found = ""
        if first != step:
            found = f" (found at step {step})"
        raise TrainingError(
            f"training diverged: the loss is not finite at step {first}{found}; "
            f"{self.checkpointer.kept()}"
        )

    @contextlib.contextmanager
    def _weights_finite(self) -> Iterator[None]:
        """A save that finds the weights not finite stops the run, saying where the loss diverged
        when it did."""
        try:
            yield
        except NotFinite as e:
            self._check_diverged(self.state.step)
            raise TrainingError(str(e)) from None

    def _autocast(self) -> torch.autocast:
        """Autocast for AMP; a sharded model casts by FSDP's own mixed-precision policy instead."""
        return torch.autocast(
            self.device.type, dtype=self.amp.dtype, enabled=self.amp.enabled and not self.fsdp
        )

    def evaluate(self, last_step: bool = False) -> float:
        """The held-out loss of the run's weights (with LocalSGD, the replicas' mean): recorded,
        logged and sampled; a new best is saved. nan when a stop signal interrupted it."""
        state = self.state
        cfg = self.cfg
        windows = self.eval_windows
        start = time.monotonic()
        self._check_diverged(state.step)
        if self.eval_notice.slow:
            n = len(evaluation.chosen_windows(windows, cfg.eval_tokens))
            log.info("evaluating at step %d on %d held-out windows", state.step, n)
        with self.comm.mean_weights():
            result = evaluation.evaluate(
                self.raw_model,
                windows,
                self.dist,
                cfg.eval_tokens,
                cfg.batch_size * 4,
                self._autocast,
                lockstep=self.fsdp,
                stop_requested=self._stop_check(),
            )
            state.eval_due = result.interrupted
            if result.interrupted:
                log.info(
                    "evaluation at step %d interrupted by a stop signal: the resumed run does it",
                    state.step,
                )
                return math.nan
            # The weights of the last update are not finite: no log, no sample.
            if not math.isfinite(result.loss):
                raise TrainingError(
                    f"training diverged: the held-out loss is {result.loss} at step {state.step}; "
                    f"{self.checkpointer.kept()}"
                )
            if self.evaluator.record(state, result.loss, last_step):
                with self._weights_finite():
                    self.checkpointer.save_best(state)
            self.metrics.log(
                "eval",
                state.step,
                state.epoch,
                loss=result.loss,
                bpc=result.bpc,
                perplexity=result.perplexity,
                rank_losses=result.rank_losses,
                tokens=result.tokens,
            )
            # after the evaluation's own line, which it follows from
            if state.stopped_early:
                log.info(
                    "stopping early at step %d: %d evaluations in a row without lowering the "
                    "held-out loss by at least %g (trainer_config.early_stop_patience=%d, "
                    "early_stop_min_delta); best %.4f at step %d",
                    state.step,
                    state.evals_without_improvement,
                    self.cfg.early_stop_min_delta,
                    self.cfg.early_stop_patience,
                    state.best_eval_loss,
                    state.best_step,
                )
            self._record_sample()
        seconds = time.monotonic() - start
        if self.eval_notice.took(seconds):
            log.info("evaluation at step %d took %.1f s", state.step, seconds)
        return result.loss

    def _record_sample(self) -> None:
        """The evaluation's sample, recorded. One that a stop cuts short (the step boundary right
        after stops the run) is left to the resumed run, as an evaluation is (sample_due)."""
        state = self.state
        state.sample_due = False
        if not self.cfg.sample_chars:
            return
        text = ""
        if self.dist.is_main_process or self.fsdp:
            text = self.sample(self._stop_check())
        # Rank 0's outcome on every rank: each saves the same position.
        state.sample_due = bool(all_max(self.dist, [int(text is None)])[0])
        if state.sample_due:
            log.info(
                "sample at step %d interrupted by a stop signal: the resumed run does it",
                state.step,
            )
        elif text:
            self.metrics.text("sample", text, state.step)

    def _stop_check(self) -> Callable[[], int]:
        """What evaluation and sampling ask for a stop request: this rank's; with a sharded model,
        whose ranks run in lockstep, any rank's (a collective, asked by every rank alike)."""
        if self.fsdp:
            return lambda: all_max(self.dist, [stopping.stop_requested()])[0]
        return stopping.stop_requested

    def sample(self, stop: Callable[[], int] | None = None) -> str | None:
        """A line of sample_chars characters from the current weights, seeded by (seed, step). A
        sharded model's ranks all generate, in lockstep. None once `stop()` says a stop was
        requested (by any rank, when sharded: every rank asks alike)."""
        seed = self.cfg.seed + self.state.step
        # A sharded model computes in its mixed-precision policy's dtype, its keys and values too.
        cache_dtype = None
        if self.fsdp:
            parallel.gather_outside_inference(self.raw_model)
            if self.amp.enabled:
                cache_dtype = self.amp.dtype
        return sample_line(
            self.raw_model, self.data.tokenizer, seed, self.cfg.sample_chars, stop, cache_dtype
        )

    def sample_for_all(self) -> str | None:
        """The closing sample: every rank takes part (LocalSGD averages the replicas, a sharded
        model generates in lockstep); rank 0 gets the text, the others None, as does a run with
        sample_chars 0."""
        text = None
        if self.cfg.sample_chars:
            with self.comm.mean_weights():
                if self.dist.is_main_process or self.fsdp:
                    text = self.sample()
        if self.dist.is_main_process:
            return text
        return None

    def _warm_up_ddp(self, model: torch.nn.Module) -> None:
        """One forward and backward of `model` (the DDP model, compiled or not), gradients dropped:
        DDP rebuilds its buckets in backward's order on the next step."""
        first = torch.arange(min(self.cfg.batch_size, len(self.data.train)), device=self.device)
        # In the training step's autocast: AMP's casts change the order backward produces the
        # gradients in, and the restored state is laid out in the training step's order.
        with self._autocast():
            _, loss = model(*self.train_windows.batch(first))
        loss.backward()
        self.optimizer.zero_grad()
