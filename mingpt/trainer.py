"""The training loop: DDP, AMP, gradient accumulation, exact evaluation, snapshots.

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
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt import checkpoint, comm_hooks
from mingpt.config import Config, ConfigError
from mingpt.data import CharData, ResumableSampler
from mingpt.distributed import DistInfo
from mingpt.metrics import Metrics
from mingpt.model import GPT
from mingpt.optim import create_optimizer, lr_at
from mingpt.sample import generate

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (for example, the loss diverged)."""


@dataclass
class Progress:
    """Where the run is: restored from a snapshot, advanced by each step."""

    epoch: int = 0  # the epoch in progress (= epochs finished)
    samples_in_epoch: int = 0  # global samples of that epoch consumed by all ranks together
    step: int = 0  # optimizer steps done
    best_eval_loss: float = math.inf


def resolve_snapshot_path(path: str, run_dir: str) -> str:
    """Relative local paths live in the run directory; URLs and absolute paths are kept."""
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.join(run_dir, path)


class Trainer:
    def __init__(self, config: Config, model: GPT, data: CharData, dist_info: DistInfo, run_dir: str):
        self.config = config
        self.cfg = cfg = config.trainer_config
        self.dist = dist_info
        self.device = device = dist_info.device
        self.data = data
        self.train_windows = data.train.to(device)
        self.eval_windows = data.heldout.to(device)
        self.snapshot_path = resolve_snapshot_path(cfg.snapshot_path, run_dir)
        self._check_comm_hook()
        self.comm = comm_hooks.create(cfg, dist_info)
        self._saved_comm_state: dict[str, Any] | None = None  # set by _restore

        if device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
        self.amp_dtype = torch.bfloat16 if cfg.amp_dtype == "bf16" else torch.float16
        self.use_amp = cfg.use_amp and (device.type == "cuda" or cfg.amp_on_cpu)
        if self.use_amp and device.type == "cuda" and cfg.amp_dtype == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError("trainer_config.amp_dtype: bf16 is not supported on this GPU; use fp16")
        if cfg.use_amp and device.type == "cpu":
            log.warning(
                "trainer_config.use_amp %s on CPU: CPUs without bf16/fp16 units run it far slower than fp32%s",
                "forced" if cfg.amp_on_cpu else "ignored",
                "" if cfg.amp_on_cpu else " (trainer_config.amp_on_cpu=true forces it)",
            )
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.use_amp and self.amp_dtype == torch.float16)

        self.raw_model = model.to(device)
        self.optimizer = create_optimizer(self.raw_model, config.optimizer_config)
        self.progress = Progress()
        if checkpoint.exists(self.snapshot_path):
            self._restore(checkpoint.load(self.snapshot_path))
        self._check_same_start()

        self.model = self.raw_model
        if dist_info.is_distributed:
            self.model = DDP(
                self.raw_model,
                device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **self.comm.ddp_options,
            )
            self._register_comm_hook()
        if cfg.compile:
            self.model = torch.compile(self.model)

        W = dist_info.world_size
        self.train_sampler = ResumableSampler(len(data.train), W, dist_info.rank, shuffle=True, seed=cfg.seed)
        self.eval_sampler = ResumableSampler(len(data.heldout), W, dist_info.rank, shuffle=False, seed=cfg.seed)
        self.samples_per_step = cfg.batch_size * cfg.grad_accum_steps  # per rank
        steps_per_epoch = math.ceil(len(data.train) / (self.samples_per_step * W))
        # Steps done plus steps to go, so a resume with another world size still finishes every epoch.
        p = self.progress
        self.total_steps = p.step
        if p.epoch < cfg.max_epochs:
            self.total_steps += math.ceil((len(data.train) - p.samples_in_epoch) / (self.samples_per_step * W))
            self.total_steps += steps_per_epoch * (cfg.max_epochs - p.epoch - 1)
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        # Events after the step we start from (0 when fresh) are from a killed attempt: dropped.
        self.metrics = Metrics(run_dir, dist_info.is_main_process, self.progress.step)
        log.info(
            "model %.2fM parameters | %d training windows, %d held-out | global batch %d (%d per rank x %d accum x %d ranks)"
            " | %d steps per epoch, %d in all | device %s%s",
            self.raw_model.num_params() / 1e6, len(data.train), len(data.heldout),
            self.samples_per_step * W, cfg.batch_size, cfg.grad_accum_steps, W,
            steps_per_epoch, self.total_steps, device, f" amp {cfg.amp_dtype}" if self.use_amp else "",
        )

    # ----------------------------------------------------------------- the loop

    def train(self) -> None:
        p = self.progress
        if self._finished():
            log.info("run already complete at step %d (snapshot %s)", p.step, self.snapshot_path)
            self._print_sample()
            return
        try:
            self._window_start, self._window_steps = time.perf_counter(), 0  # for tokens/s
            while not self._finished():
                self._train_epoch()
            self.evaluate()
            self.save()
            self._print_sample()
        finally:
            self.metrics.close()

    def _train_epoch(self) -> None:
        """Train from the next unseen sample of the current epoch to its end (or to the last step)."""
        cfg, p = self.cfg, self.progress
        self.train_sampler.set_epoch(p.epoch)
        self.train_sampler.start_index = p.samples_in_epoch
        order = torch.tensor(list(self.train_sampler), dtype=torch.long, device=self.device)
        for indices in order.split(self.samples_per_step):
            loss, grad_norm, lr = self.train_step(indices)
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
                if cfg.save_every_steps and p.step % cfg.save_every_steps == 0:
                    self.save()
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
        loss = self._global_mean(loss)
        if not math.isfinite(loss):
            raise TrainingError(
                f"training diverged: loss is {loss} at step {p.step}; "
                f"the last good snapshot is kept at {self.snapshot_path}"
            )
        tokens = self._window_steps * self.samples_per_step * self.dist.world_size * self.train_windows.block_size
        tokens_per_s = tokens / (time.perf_counter() - self._window_start)
        self.metrics.log("train", p.step, p.epoch, loss=loss, lr=lr, grad_norm=float(grad_norm),
                         tokens_per_s=tokens_per_s)
        self._window_start, self._window_steps = time.perf_counter(), 0

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
        return p.epoch >= self.cfg.max_epochs or p.step >= self.total_steps

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
            sync = contextlib.nullcontext() if last or not self.dist.is_distributed else self.model.no_sync()
            with sync:
                with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.use_amp):
                    _, loss = self.model(x, y)
                self.scaler.scale(loss * weight).backward()
            step_loss += loss.detach() * weight
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_norm_clip)
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

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Mean cross-entropy per held-out token. Each rank sums the loss and
        counts the tokens of its share of the non-overlapping held-out windows
        (padding excluded); the sums are gathered, so the global mean is the
        same for any world size."""
        model = self.raw_model
        model.eval()
        indices = torch.tensor(list(self.eval_sampler)[: self.eval_sampler.real_count()], dtype=torch.long,
                               device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for chunk in indices.split(self.cfg.batch_size * 4):
            x, y = self.eval_windows.batch(chunk)
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.use_amp):
                logits, _ = model(x)
            losses = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="none")
            loss_sum += losses.double().sum()
            count += y.numel()
        model.train()
        stats = torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64, device=self.device)])
        if self.dist.is_distributed:
            gathered = [torch.zeros_like(stats) for _ in range(self.dist.world_size)]
            dist.all_gather(gathered, stats)
        else:
            gathered = [stats]
        sums = torch.stack(gathered).cpu()
        loss = (sums[:, 0].sum() / sums[:, 1].sum()).item()
        per_rank = [s / c if c > 0 else None for s, c in sums.tolist()]
        p = self.progress
        p.best_eval_loss = min(p.best_eval_loss, loss)
        self.metrics.log("eval", p.step, p.epoch, loss=loss, rank_losses=per_rank, tokens=int(sums[:, 1].sum()))
        if self.dist.is_main_process and self.cfg.sample_chars:
            self.metrics.text("sample", self.sample(self.cfg.sample_chars), p.step)
        return loss

    def sample(self, n_chars: int, prompt: str = "\n") -> str:
        """Text generated from the current weights, seeded by (seed, step); it
        leaves the training random streams untouched."""
        tok = self.data.tokenizer
        prompt = "".join(c for c in prompt if c in tok.stoi) or tok.chars[0]
        generator = torch.Generator(self.device).manual_seed(self.cfg.seed + self.progress.step)
        idx = tok.encode(prompt).long()[None].to(self.device)
        new = generate(self.raw_model, idx, n_chars, temperature=1.0, top_k=None, generator=generator)
        return prompt + tok.decode(torch.cat(list(new), dim=1)[0].tolist())

    def _print_sample(self) -> None:
        with self.comm.mean_weights(self.raw_model):  # every rank takes part
            if self.dist.is_main_process and self.cfg.sample_chars:
                sample = self.sample(self.cfg.sample_chars)
                print(f"--- sample after step {self.progress.step} ---\n{sample}", flush=True)

    # ----------------------------------------------------------------- snapshots

    def save(self) -> None:
        """Save a snapshot (global main process only), never with non-finite weights.
        Every rank checks its replica (DDP keeps them identical; with LocalSGD, the replicas'
        mean), so all ranks stop together. Every rank calls it: a comm hook's state is gathered."""
        model_state = self.comm.model_state(self.raw_model)
        if not all(torch.isfinite(t).all() for t in model_state.values()):
            raise TrainingError(
                f"weights are not finite at step {self.progress.step}; not saving over the last good snapshot "
                f"{self.snapshot_path}"
            )
        comm_state = self.comm.state_dict(self.raw_model, self.optimizer, self.scaler)
        if not self.dist.is_main_process:
            return
        state: dict[str, Any] = {
            "model_state": model_state,
            "comm_hook": comm_state,
            "optimizer_state": self.optimizer.state_dict(),
            "scaler_state": self.scaler.state_dict(),
            "finished_epoch": self.progress.epoch,
            **dataclasses.asdict(self.progress),
            "world_size": self.dist.world_size,
            "vocab": self.data.tokenizer.chars,
            **{name: dataclasses.asdict(getattr(self.config, name)) for name in
               ("gpt_config", "optimizer_config", "data_config", "trainer_config")},
        }
        checkpoint.save(state, self.snapshot_path)
        log.info("saved snapshot %s at step %d", self.snapshot_path, self.progress.step)

    def _restore(self, state: dict[str, Any]) -> None:
        """Load weights, optimizer, scaler and progress (before the model is wrapped in DDP)."""
        checkpoint.check_compatible(
            state, dataclasses.asdict(self.config.gpt_config), self.data.tokenizer.chars, self.snapshot_path
        )
        try:
            self.raw_model.load_state_dict(state["model_state"])
            self.optimizer.load_state_dict(state["optimizer_state"])
            if self.scaler.is_enabled() and state.get("scaler_state"):
                self.scaler.load_state_dict(state["scaler_state"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise checkpoint.SnapshotError(f"snapshot {self.snapshot_path} cannot be restored: {e}") from None
        # The current config decides the hyperparameters, not the snapshot.
        opt_cfg = self.config.optimizer_config
        for group, decay in zip(self.optimizer.param_groups, (opt_cfg.weight_decay, 0.0)):
            group.update(weight_decay=decay, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
        self._saved_comm_state = state.get("comm_hook")  # per rank: restored once DDP has wrapped the model
        fields = {f.name for f in dataclasses.fields(Progress)}
        self.progress = Progress(**{k: state[k] for k in fields if k in state})
        log.info(
            "resumed from %s: epoch %d, %d samples into it, step %d",
            self.snapshot_path, self.progress.epoch, self.progress.samples_in_epoch, self.progress.step,
        )

    def _check_same_start(self) -> None:
        """All ranks must start from the same step: a snapshot that only some of
        them see (a node-local path in a multi-node job) would split the run."""
        if not self.dist.is_distributed:
            return
        mine = torch.tensor([self.progress.step], device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.dist.world_size)]
        dist.all_gather(gathered, mine)
        steps = [int(t) for t in gathered]
        if len(set(steps)) > 1:
            raise checkpoint.SnapshotError(
                f"the ranks start from different steps {steps} (snapshot {self.snapshot_path}): "
                "keep the snapshot where every node sees it (a shared file system, s3://, gs://)"
            )

    # ---------------------------------------------------------- communication

    def _check_comm_hook(self) -> None:
        comm_hooks.check(self.cfg, self.dist)

    def _register_comm_hook(self) -> None:
        """Register the hook on the DDP model and give it the state the snapshot saved (mingpt/comm_hooks.py)."""
        self.comm.start(self.model, self._saved_comm_state, self.progress.step, self.raw_model, self.optimizer,
                        self.scaler, self._warm_up_ddp)

    def _warm_up_ddp(self) -> None:
        """One DDP forward and backward on a training batch, gradients dropped: DDP
        rebuilds its buckets (in the order backward produces gradients) at the next step."""
        first = torch.arange(min(self.cfg.batch_size, len(self.data.train)), device=self.device)
        x, y = self.train_windows.batch(first)
        _, loss = self.model(x, y)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
