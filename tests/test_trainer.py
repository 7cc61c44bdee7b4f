"""The trainer's small decisions, as pure functions: the AMP policy and the step plan."""

from __future__ import annotations

import pytest
import torch

from mingpt.config import ConfigError, TrainerConfig
from mingpt.snapshot.manager import Progress
from mingpt.trainer import amp_policy, step_plan


def test_amp_is_on_cuda_only_unless_forced_on_a_cpu(caplog):
    assert not amp_policy(TrainerConfig(), "cuda").enabled
    on_gpu = amp_policy(TrainerConfig(use_amp=True), "cuda")
    assert on_gpu.enabled and on_gpu.dtype == torch.bfloat16 and not on_gpu.scaler
    assert not amp_policy(TrainerConfig(use_amp=True), "cpu").enabled
    assert "ignored" in caplog.text and "amp_on_cpu=true forces it" in caplog.text
    assert amp_policy(TrainerConfig(use_amp=True, amp_on_cpu=True), "cpu").enabled


def test_fp16_takes_a_gradient_scaler_and_bf16_needs_a_gpu_that_has_it():
    fp16 = amp_policy(TrainerConfig(use_amp=True, amp_dtype="fp16"), "cuda", bf16_supported=False)
    assert fp16.enabled and fp16.dtype == torch.float16 and fp16.scaler
    assert not amp_policy(TrainerConfig(use_amp=False, amp_dtype="fp16"), "cuda").scaler
    with pytest.raises(ConfigError, match="bf16 is not supported on this GPU; use fp16"):
        amp_policy(TrainerConfig(use_amp=True), "cuda", bf16_supported=False)


def test_step_plan_of_a_fresh_run():
    plan = step_plan(
        TrainerConfig(batch_size=4, grad_accum_steps=2, max_epochs=3), 100, 2, Progress()
    )
    assert plan.samples_per_step == 8  # per rank
    assert plan.steps_per_epoch == 7  # ceil(100 / 16)
    assert plan.total_steps == 21


def test_step_plan_of_a_resume_with_another_world_size_finishes_the_epochs():
    # 10 steps done at world size 2 (160 of 100 + 60
    # samples: epoch 1, 60 in); now 1 rank of 8 per step.
    resumed = Progress(epoch=1, samples_in_epoch=60, step=10)
    plan = step_plan(TrainerConfig(batch_size=4, grad_accum_steps=2, max_epochs=3), 100, 1, resumed)
    assert plan.steps_per_epoch == 13
    assert plan.total_steps == 10 + 5 + 13  # done, the rest of epoch 1 (40 samples), epoch 2
    assert step_plan(TrainerConfig(max_epochs=3, max_steps=12), 100, 1, resumed).total_steps == 12
    # complete
    assert (
        step_plan(TrainerConfig(max_epochs=1), 100, 1, Progress(epoch=1, step=9)).total_steps == 9
    )
