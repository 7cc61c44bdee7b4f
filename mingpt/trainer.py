"""The training loop and step. Exact resume needs no generator state: epoch e's order is seeded by (seed, e), dropout's
stream is reseeded from (seed, rank, step) before each step, and the learning rate is a function of the step."""

import dataclasses
import logging
import math
import time
from typing import NamedTuple

import torch

from mingpt import comm_hooks, evaluation, flops, parallel, stopping, tracking
from mingpt.config import Config, ConfigError, TrainerConfig
from mingpt.data import CharData, ResumableSampler
from mingpt.decoding import sample_line
from mingpt.distributed import DistInfo, all_max, global_mean
from mingpt.evaluation import Evaluator
from mingpt.metrics import Metrics, Pace, SlowNotice
from mingpt.model import GPT
from mingpt.optim import create_optimizer, set_lr
from mingpt.saving import Saver, TrainingError
from mingpt.snapshot.manager import Progress, Snapshot

log = logging.getLogger(__name__)


class AmpPolicy(NamedTuple):
    enabled: bool  # autocast (with FSDP: its mixed-precision policy) in `dtype`
    dtype: torch.dtype  # float32 without AMP: the dtype MFU's peak is measured in
    scaler: bool  # fp16 needs a gradient scaler; bf16 does not


def amp_policy(cfg: TrainerConfig, device_type: str, bf16_supported: bool = True) -> AmpPolicy:
    """AMP on CUDA when use_amp, on a CPU only when amp_on_cpu forces it (warned); bf16 on a GPU lacking it: refused."""
    enabled = cfg.use_amp and (device_type == "cuda" or cfg.amp_on_cpu)
    dtype = (
        {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp_dtype] if enabled else torch.float32
    )
    if dtype == torch.bfloat16 and device_type == "cuda" and not bf16_supported:
        raise ConfigError("trainer_config.amp_dtype: bf16 is not supported on this GPU; use fp16")
    if cfg.use_amp and device_type == "cpu":
        log.warning(
            "trainer_config.use_amp %s on CPU: CPUs without bf16/fp16 units run it far slower than fp32%s",
            *(
                ("forced", "")
                if cfg.amp_on_cpu
                else ("ignored", " (trainer_config.amp_on_cpu=true forces it)")
            ),
        )
    return AmpPolicy(enabled, dtype, dtype == torch.float16)


class StepPlan(NamedTuple):
    samples_per_step: int  # per rank: batch_size windows for each of grad_accum_steps micro-steps
    steps_per_epoch: int  # at this world size
    # steps done plus steps to go, so a resume with another world size still finishes every epoch
    total_steps: int


def step_plan(cfg: TrainerConfig, n_train: int, world_size: int, progress: Progress) -> StepPlan:
    """How many optimizer steps the run takes from `progress` on, capped by max_steps."""
    per_step = cfg.batch_size * cfg.grad_accum_steps
    steps_per_epoch = math.ceil(n_train / (per_step * world_size))
    total = progress.step
    if progress.epoch < cfg.max_epochs:
        total += math.ceil((n_train - progress.samples_in_epoch) / (per_step * world_size))
        total += steps_per_epoch * (cfg.max_epochs - progress.epoch - 1)
    return StepPlan(
        per_step, steps_per_epoch, total if cfg.max_steps is None else min(total, cfg.max_steps)
    )


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
        self.config, self.cfg, self.dist, self.data = config, config.trainer_config, dist_info, data
        self.device, self.run_dir, self.snapshot_path, cfg = (
            dist_info.device,
            run_dir,
            snapshot_path,
            self.cfg,
        )
        self.train_windows, self.eval_windows = data.place(
            self.device, config.data_config.placement
        )
        comm_hooks.check(cfg, dist_info)  # a hook this run cannot use is refused before any work
        self.comm = comm_hooks.create(cfg, dist_info)
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
        self.amp = amp_policy(
            cfg, self.device.type, self.device.type != "cuda" or torch.cuda.is_bf16_supported()
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp.scaler)
        self.fsdp = parallel.uses_fsdp(cfg, dist_info)
        # before the optimizer; sharded on the CPU, so only this rank's shards go to the device
        if self.fsdp:
            parallel.shard(model, dist_info, self.amp.dtype if self.amp.enabled else None)
        model.checkpoint_blocks = cfg.activation_checkpointing
        self.raw_model = model.to(self.device)
        self.optimizer = create_optimizer(self.raw_model, config.optimizer_config)
        # The first step whose loss was not finite (0: none yet), on the device: checking it costs no host sync.
        self.nonfinite_step = torch.zeros((), dtype=torch.long, device=self.device)
        self.eval_notice = SlowNotice()
        self.snapshot = Snapshot(
            config,
            dist_info,
            snapshot_path,
            data.tokenizer.chars,
            self.raw_model,
            self.optimizer,
            self.scaler,
            self.comm,
            data.fingerprint(),
        )
        # restores the snapshot
        self.saver = Saver(cfg, dist_info, self.snapshot, self._check_diverged)
        self.progress = dataclasses.replace(self.saver.saved) if self.saver.saved else Progress()
        self.evaluator = Evaluator(cfg, self.progress, self.saver.save_best)
        ddp = (
            parallel.replicate(self.raw_model, dist_info, self.comm)
            if dist_info.is_distributed and not self.fsdp
            else None
        )
        # In one process too: a hook state saved by several says that it goes unused.
        self.comm.start(
            ddp,
            self.snapshot.comm_state,
            self.progress.step,
            self.raw_model,
            self.optimizer,
            self.scaler,
            lambda: self._warm_up_ddp(ddp),
        )
        # what the step calls
        self.model = parallel.maybe_compile(self.raw_model if ddp is None else ddp, cfg)
        W, block = dist_info.world_size, self.train_windows.block_size
        self.train_sampler = ResumableSampler(
            len(data.train), W, dist_info.rank, shuffle=True, seed=cfg.seed
        )
        self.samples_per_step, _, self.total_steps = self.plan = step_plan(
            cfg, len(data.train), W, self.progress
        )
        tracker = tracking.start(
            config,
            run_dir,
            self.snapshot.tracker_run_id,
            self.progress.step,
            enabled=dist_info.is_main_process and not self.finished(),
        )
        self.snapshot.tracker_run_id = tracker.run_id or self.snapshot.tracker_run_id
        self.metrics = Metrics(run_dir, dist_info.is_main_process, self.progress.step, tracker)
        g, step_tokens = config.gpt_config, self.samples_per_step * block
        self.pace = Pace(
            step_tokens * W,
            flops.flops_per_token(self.raw_model, g.n_layer, g.n_embd, block),
            lambda: flops.peak_for_mfu(
                self.pace.flops_per_token * step_tokens, dist_info, self.amp.dtype
            ),
            self.progress.step,
        )

    def finished(self) -> bool:
        p = self.progress
        return (
            p.epoch >= self.cfg.max_epochs
            or p.step >= self.total_steps
            or self.evaluator.stopped_early()
        )

    def train(self) -> float:
        """Train to the end, save, return the final held-out loss; a stop signal saves and stops at a step boundary."""
        status = "FAILED"  # how the run ended, for the tracker
        try:
            with stopping.graceful():
                while not self.finished():
                    self._train_epoch()
                final = self.evaluator.last if self.evaluator.stopped_early() else self.evaluate()
                self.saver.at_end(self.progress)
            status = "FINISHED"
            return final
        except stopping.Stopped:
            status = "KILLED"  # after a snapshot: a resume continues it
            raise
        except Exception:
            self.saver.finish_in_flight()
            raise
        finally:
            self.metrics.close(status)

    def _train_epoch(self) -> None:
        """Train from the next unseen sample of the current epoch to its end (or to the last step)."""
        p = self.progress
        self.train_sampler.set_epoch(p.epoch)
        self.train_sampler.start_index = p.samples_in_epoch
        # host-gathered: stays on the host
        order = self.train_sampler.indices().to(self.train_windows.tokens.device)
        batches = order.split(self.samples_per_step)
        for k, indices in enumerate(batches):
            loss, grad_norm, lr = self.train_step(indices)
            # host-gathered batches: the next is copied while this step runs
            if k + 1 < len(batches):
                self.train_windows.prefetch(batches[k + 1])
            if self.device.type == "cpu" and not self.dist.is_distributed:
                self._check_diverged(p.step + 1)  # free on a CPU: stop at the step itself
            p.samples_in_epoch = min(
                len(self.data.train), p.samples_in_epoch + len(indices) * self.dist.world_size
            )
            p.step += 1
            self.metrics.show_progress(p.step, self.total_steps)
            if p.step % self.cfg.log_every == 0 or p.step == self.total_steps:
                self._log_train(loss, grad_norm, lr)
            # the last step's evaluation and save come at the end of the run
            if p.step < self.total_steps:
                with self.pace.paused():
                    if self.evaluator.due():
                        self.evaluate()
                    # after the step's evaluation: a resume goes on with the next step
                    self.saver.after_step(p)
            if self.finished():
                break
        if p.samples_in_epoch >= len(self.data.train):
            p.epoch, p.samples_in_epoch = p.epoch + 1, 0
            with self.pace.paused():
                if self.evaluator.due(epoch_end=True) and not self.finished():
                    self.evaluate()
                if not self.finished():
                    self.saver.after_epoch(p)

    def train_step(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over this rank's share of the global batch, in micro-batches of batch_size, each
        loss weighted by its share of the samples: accumulation gives the update of one big batch."""
        cfg, p = self.cfg, self.progress
        lr = set_lr(self.optimizer, p.step, self.config.optimizer_config, self.total_steps)
        # dropout's stream
        torch.manual_seed(hash((cfg.seed, self.dist.rank, p.step)) & 0xFFFF_FFFF)
        micro_batches = indices.split(cfg.batch_size)
        step_loss = torch.zeros((), device=self.device)
        for k, micro in enumerate(micro_batches):
            weight = len(micro) / len(indices)
            with parallel.gradient_sync(
                self.model, self.raw_model, enabled=k == len(micro_batches) - 1
            ):
                with self._autocast():
                    _, loss = self.model(*self.train_windows.batch(micro))
                self.scaler.scale(loss * weight).backward()
            step_loss += loss.detach() * weight
        bad = (self.nonfinite_step == 0) & ~torch.isfinite(step_loss)
        self.nonfinite_step = torch.where(bad, p.step + 1, self.nonfinite_step)
        self.scaler.unscale_(self.optimizer)
        grad_norm = parallel.full_value(
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_norm_clip)
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.comm.after_optimizer_step(self.raw_model)  # LocalSGD: the periodic averaging
        self.optimizer.zero_grad(set_to_none=True)
        return step_loss, grad_norm, lr

    def _log_train(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """The loss is the mean over ranks: every rank takes part, so all stop together on divergence."""
        p = self.progress
        self._check_diverged(p.step)
        loss = global_mean(self.dist, loss)  # finite: every rank's was
        grad_norm = float(grad_norm)  # not finite: an fp16 step the GradScaler skipped
        tokens_per_s, mfu, note = self.pace.event(p.step, self.total_steps)
        self.metrics.log(
            "train",
            p.step,
            p.epoch,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm if math.isfinite(grad_norm) else None,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            peak_mem_mib=round(flops.peak_memory_mib(self.device)),
            note=note,
        )

    def _check_diverged(self, step: int) -> None:
        """Stop if the loss was not finite at any step so far; every rank calls this at the same step."""
        if first := all_max(self.dist, [int(self.nonfinite_step)])[0]:  # the host sync
            found = "" if first == step else f" (found at step {step})"
            raise TrainingError(
                f"training diverged: the loss is not finite at step {first}{found}; "
                f"{self.saver.kept()}"
            )

    def _autocast(self) -> torch.autocast:
        """Autocast for AMP; a sharded model casts by FSDP's own mixed-precision policy instead."""
        return torch.autocast(
            self.device.type, dtype=self.amp.dtype, enabled=self.amp.enabled and not self.fsdp
        )

    def evaluate(self) -> float:
        """The held-out loss of the run's weights (with LocalSGD: the replicas' mean), recorded, logged, sampled."""
        p, cfg, windows, start = self.progress, self.cfg, self.eval_windows, time.monotonic()
        self._check_diverged(p.step)
        if self.eval_notice.slow:
            n = len(evaluation.chosen_windows(len(windows), windows.block_size, cfg.eval_tokens))
            log.info("evaluating at step %d on %d held-out windows", p.step, n)
        with self.comm.mean_weights(self.raw_model):
            result = evaluation.evaluate(
                self.raw_model,
                windows,
                self.dist,
                cfg.eval_tokens,
                cfg.batch_size * 4,
                self._autocast,
                lockstep=self.fsdp,
                stop_requested=stopping.stop_requested,
            )
            if result.interrupted:
                log.info("evaluation at step %d interrupted by a stop signal: not recorded", p.step)
                return math.nan
            # the weights of the last update are not: no log, no sample
            if not math.isfinite(result.loss):
                raise TrainingError(
                    f"training diverged: the held-out loss is {result.loss} at step {p.step}; "
                    f"{self.saver.kept()}"
                )
            # finished: out of steps (not stopped early here)
            self.evaluator.record(result.loss, self.finished())
            self.metrics.log(
                "eval",
                p.step,
                p.epoch,
                loss=result.loss,
                bpc=result.loss / math.log(2),
                perplexity=math.exp(result.loss),
                rank_losses=result.rank_losses,
                tokens=result.tokens,
            )
            if cfg.sample_chars and (self.dist.is_main_process or self.fsdp):
                text = self.sample(stoppable=True)
                if text is None:  # the step boundary right after stops the run
                    log.info("sample at step %d interrupted by a stop signal: not recorded", p.step)
                else:
                    self.metrics.text("sample", text, p.step)
        if self.eval_notice.took(time.monotonic() - start):
            log.info("evaluation at step %d took %.1f s", p.step, time.monotonic() - start)
        return result.loss

    def sample(self, stoppable: bool = False) -> str | None:
        """A line of sample_chars characters from the current weights, seeded by (seed, step); a sharded model's
        ranks all generate, in lockstep. `stoppable`: None once a stop is requested (by any rank, when sharded)."""
        stop = (
            (lambda: all_max(self.dist, [stopping.stop_requested()])[0])
            if self.fsdp
            else stopping.stop_requested
        )
        return sample_line(
            self.raw_model,
            self.data.tokenizer,
            self.cfg.seed + self.progress.step,
            self.cfg.sample_chars,
            stop if stoppable else None,
        )

    def print_sample(self) -> None:
        with self.comm.mean_weights(self.raw_model):  # every rank takes part
            if self.cfg.sample_chars and (self.dist.is_main_process or self.fsdp):
                sample = self.sample()
                if self.dist.is_main_process:
                    print(f"--- sample after step {self.progress.step} ---\n{sample}", flush=True)

    def _warm_up_ddp(self, ddp: torch.nn.Module) -> None:
        """One forward and backward, gradients dropped: DDP rebuilds its buckets in backward's order next step."""
        first = torch.arange(min(self.cfg.batch_size, len(self.data.train)), device=self.device)
        ddp(*self.train_windows.batch(first))[1].backward()
        self.optimizer.zero_grad(set_to_none=True)
