"""The trainer's small decisions, as pure functions: the AMP policy, the step plan and the advice
for a complete run; its profiler switch."""

from __future__ import annotations

import json
import logging
import traceback
import types

import pytest
import torch
from conftest import TINY
from omegaconf import OmegaConf

from mingpt.config import Config, ConfigError, GPTConfig, TrainerConfig
from mingpt.distributed import DistInfo
from mingpt.evaluation import Evaluator
from mingpt.run import already_complete, build, summary, train
from mingpt.trainer import StepPlan, TrainState, amp_policy, step_plan


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
        TrainerConfig(batch_size=4, grad_accum_steps=2, max_epochs=3), 100, 2, TrainState()
    )
    assert plan.samples_per_step == 8  # per rank
    assert plan.steps_per_epoch == 7  # ceil(100 / 16)
    assert plan.total_steps == 21


def test_step_plan_of_a_resume_with_another_world_size_finishes_the_epochs():
    # 10 steps done at world size 2 (160 of 100 + 60
    # samples: epoch 1, 60 in); now 1 rank of 8 per step.
    resumed = TrainState(epoch=1, samples_in_epoch=60, step=10)
    plan = step_plan(TrainerConfig(batch_size=4, grad_accum_steps=2, max_epochs=3), 100, 1, resumed)
    assert plan.steps_per_epoch == 13
    assert plan.total_steps == 10 + 5 + 13  # done, the rest of epoch 1 (40 samples), epoch 2
    assert step_plan(TrainerConfig(max_epochs=3, max_steps=12), 100, 1, resumed).total_steps == 12
    # complete
    assert (
        step_plan(TrainerConfig(max_epochs=1), 100, 1, TrainState(epoch=1, step=9)).total_steps == 9
    )


def train_here(dotlist: list[str], run_dir) -> None:
    """A run of these overrides trained in this process, on CPU, into run_dir."""
    config = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    cpu = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    build(OmegaConf.to_object(config), cpu, str(run_dir)).train()


def test_profile_steps_writes_each_ranks_trace_into_the_run_directory(
    tmp_path, small_corpus, one_thread, caplog
):
    """trainer_config.profile_steps=2: the two steps after one of warm-up are recorded, and their
    trace is written into profile/ in the run directory as the Chrome trace JSON that Perfetto
    and TensorBoard's profiler open, with the step's matrix products in it. A run with no step
    left after the warm-up one says so and writes no trace."""
    dotlist = [
        *TINY,
        f"data_config.path={small_corpus}",
        "trainer_config.max_steps=5",
        "trainer_config.profile_steps=2",
        "trainer_config.sample_chars=0",
    ]
    train_here(dotlist, tmp_path)
    (trace,) = (tmp_path / "profile").glob("*.pt.trace.json")
    names = {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {name for name in names if name.startswith("ProfilerStep#")} == {
        "ProfilerStep#1",
        "ProfilerStep#2",
    }
    assert "aten::addmm" in names or "aten::mm" in names
    # Resumed one step before its end: no step after the warm-up one, and no trace of none.
    train_here(
        [*dotlist, "trainer_config.max_steps=6", "trainer_config.allow_config_change=true"],
        tmp_path,
    )
    assert len(list((tmp_path / "profile").iterdir())) == 1
    assert "the run ends at step 6, with no step after the warm-up one" in caplog.text


def test_a_step_seeds_the_generators_of_its_device_alone(tmp_path, small_corpus, monkeypatch):
    """Each step seeds dropout's stream on its own device: torch.manual_seed also queued a seeding
    of each backend not started (CUDA, XPU and MTIA on a CPU-only host), formatting the call's stack
    for each, 2 ms a step under Hydra."""
    dotlist = [*TINY, f"data_config.path={small_corpus}", "trainer_config.max_steps=5"]
    config = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    cpu = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    trainer = build(OmegaConf.to_object(config), cpu, str(tmp_path))
    formatted = []
    real_format_stack = traceback.format_stack

    def format_stack(*args):
        formatted.append(args)
        return real_format_stack(*args)

    monkeypatch.setattr(traceback, "format_stack", format_stack)
    trainer.train()
    assert trainer.state.step == 5 and formatted == []


def test_a_profile_trace_that_cannot_be_written_costs_a_warning(
    tmp_path, small_corpus, small_disk, one_thread, caplog
):
    """A file where profile/ should be, and a full disk (where the profiler said its failure on
    stderr alone and left a partial .tmp file): one warning each, and the run trains to its end."""
    caplog.set_level(logging.WARNING, logger="mingpt")
    dotlist = [
        *TINY,
        f"data_config.path={small_corpus}",
        "trainer_config.max_steps=3",
        "trainer_config.profile_steps=1",
        "trainer_config.sample_chars=0",
    ]
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "profile").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "profile").symlink_to(small_disk)
    for run_dir in (blocked, tmp_path / "full"):
        train_here(dotlist, run_dir)
        assert '"step": 3' in (run_dir / "metrics.jsonl").read_text()
    warnings = [r.getMessage() for r in caplog.records if "profiler's trace" in r.getMessage()]
    assert len(warnings) == 2 and "File exists" in warnings[0], warnings
    assert "training goes on" in warnings[1] and not list(small_disk.iterdir())


def warnings_at_start(tmp_path, corpus, caplog, overrides: list[str], about: str) -> list[str]:
    """The trainer's warnings about `about` as a tiny run with `overrides` is built."""
    dotlist = [*TINY, f"data_config.path={corpus}", *overrides]
    config = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    with caplog.at_level(logging.WARNING, logger="mingpt.trainer"):
        build(OmegaConf.to_object(config), DistInfo(0, 0, 1, 1, torch.device("cpu")), str(tmp_path))
    return [r.getMessage() for r in caplog.records if about in r.getMessage()]


@pytest.mark.parametrize(("warmup", "warned"), [(5, True), (4, True), (3, False), (0, False)])
def test_a_warmup_as_long_as_the_run_is_said_at_start(
    tmp_path, small_corpus, caplog, warmup, warned
):
    """The learning rate of a 4-step run with a warmup of 4 or more steps never decays from its
    peak, nor reaches it before the last step: one warning naming both keys."""
    overrides = [f"optimizer_config.warmup_steps={warmup}", "trainer_config.max_steps=4"]
    said = warnings_at_start(tmp_path, small_corpus, caplog, overrides, "warmup_steps")
    if warned:
        assert said == [
            f"optimizer_config.warmup_steps={warmup} covers the whole run of 4 steps "
            "(trainer_config.max_steps=4, max_epochs=2): the learning rate rises to the end and "
            "reaches optimizer_config.learning_rate at the last step or never"
        ]
    else:
        assert said == []


def test_a_warmup_as_long_as_a_run_without_max_steps_names_it_as_typed(
    tmp_path, small_corpus, caplog
):
    """Unset, max_steps was named `trainer_config.max_steps=None`, which the command line reads as
    the text None; it is `null`, as typed."""
    overrides = ["optimizer_config.warmup_steps=100000"]
    said = warnings_at_start(tmp_path, small_corpus, caplog, overrides, "warmup_steps")
    assert len(said) == 1 and "(trainer_config.max_steps=null, max_epochs=2)" in said[0], said


@pytest.mark.parametrize(
    ("warmup", "learning_rate", "warned"), [(8, 3e-3, True), (3, 3e-3, False), (3, 6e-4, False)]
)
def test_a_warmup_that_runs_into_the_wsd_cooldown_is_said_at_start(
    tmp_path, small_corpus, caplog, warmup, learning_rate, warned
):
    """A 10-step wsd run cools down over its last 60%: a warmup of 8 steps ended in the middle of
    it, and the rate fell from the peak to a quarter of it in one step, without a word. A rate
    whose floor and rest of the peak add up to just under it (6e-4) falls by nothing."""
    overrides = [
        "optimizer_config.lr_schedule=wsd",
        f"optimizer_config.learning_rate={learning_rate}",
        f"optimizer_config.warmup_steps={warmup}",
        "trainer_config.max_steps=10",
    ]
    said = warnings_at_start(tmp_path, small_corpus, caplog, overrides, "wsd cooldown")
    if warned:
        assert said == [
            "optimizer_config.warmup_steps=8 runs into the wsd cooldown (the last "
            "cooldown_fraction=0.6 of the run's 10 steps): the learning rate falls from its peak "
            "to 27% of it at step 9"
        ]
    else:
        assert said == []


def test_a_complete_run_says_no_warmup_warning_and_closes_as_its_end_did(
    tmp_path, small_corpus, caplog, one_thread
):
    """The same command again finds the run complete, with no step to train: no warmup warning
    beside its line, and its closing line is the one the run ended with, held-out loss included."""
    dotlist = [*TINY, f"data_config.path={small_corpus}", "trainer_config.max_steps=2"]
    config = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    dist_info = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    first = build(OmegaConf.to_object(config), dist_info, str(tmp_path))
    closing = summary(first, first.train())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mingpt"):
        again = build(OmegaConf.to_object(config), dist_info, str(tmp_path))
        assert again.finished()
        train(again)
    assert not [r for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert "held-out loss" in closing
    assert caplog.messages[-1] == closing


def test_the_train_log_shows_muons_learning_rate_and_no_missing_value(
    tmp_path, small_corpus, one_thread, caplog
):
    """A Muon run logs the blocks' learning rate beside AdamW's; a model too small for an MFU
    leaves it out of the log line (metrics.jsonl keeps the key, null) instead of `mfu None`."""
    caplog.set_level(logging.INFO, logger="mingpt")
    dotlist = [
        *TINY,
        f"data_config.path={small_corpus}",
        "optimizer_config.algorithm=muon",
        "optimizer_config.warmup_steps=4",
        "trainer_config.max_steps=2",
        "trainer_config.log_every=1",
        "trainer_config.sample_chars=0",
    ]
    train_here(dotlist, tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train step")]
    assert len(lines) == 2 and all("None" not in line and " mfu " not in line for line in lines)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["split"] == "train"]
    # Step 1 of a 4-step warmup: a quarter of each peak (AdamW's 3e-3, Muon's 1e-2).
    assert train[0]["lr"] == pytest.approx(3e-3 / 4) and train[0]["muon_lr"] == pytest.approx(
        1e-2 / 4
    )
    assert "muon_lr 0.0025" in lines[0] and train[0]["mfu"] is None


def advice(run_dir="runs/r", steps_per_epoch=131, **state_and_keys):
    """already_complete's advice for a run that ends at `state_and_keys`'s step and epoch."""
    state = TrainState(step=state_and_keys.pop("step"), epoch=state_and_keys.pop("epoch"))
    cfg = TrainerConfig(run_name="r", **state_and_keys)
    t = types.SimpleNamespace(
        cfg=cfg,
        state=state,
        evaluator=Evaluator(cfg),
        snapshot_path=f"{run_dir}/snapshots",
        run_dir=run_dir,
        plan=StepPlan(8, steps_per_epoch, state.step),
    )
    new, further = already_complete(t).split("For a new run add ")[1].split("; to train this one")
    return new, further.removeprefix(" further add ").removesuffix(
        " trainer_config.allow_config_change=true"
    )


def test_the_advice_for_a_complete_run_raises_every_limit_that_would_stop_it():
    # max_steps ends the run where max_epochs does too: doubling max_steps alone trained nothing
    assert advice(step=131, epoch=1, max_steps=131, max_epochs=1)[1] == (
        "trainer_config.max_steps=262 trainer_config.max_epochs=2"
    )
    assert advice(step=100, epoch=0, max_steps=100, max_epochs=2)[1] == (
        "trainer_config.max_steps=200"
    )
    assert advice(step=262, epoch=2, max_epochs=2)[1] == "trainer_config.max_epochs=3"
    # a command that lowered max_steps below the step reached: twice 10 (20) trained nothing
    assert advice(step=30, epoch=0, max_steps=10, max_epochs=2)[1] == (
        "trainer_config.max_steps=60"
    )


def test_the_advice_for_a_new_run_changes_what_places_it():
    assert advice(step=262, epoch=2)[0].startswith("trainer_config.run_name=NAME")
    # a sweep's job: its run name places the sweep
    assert advice("runs/r-multirun/1", step=262, epoch=2)[0].startswith("trainer_config.run_name")
    assert advice("elsewhere/dir", step=262, epoch=2)[0] == "hydra.run.dir=ANOTHER_DIRECTORY"
    # snapshots outside the run directory are shared by every name
    for path in ("/shared/snaps", "../other/snapshots"):
        shared = advice(step=262, epoch=2, snapshot_path=path)[0]
        assert shared.startswith("trainer_config.snapshot_path=PATH"), path


@pytest.mark.parametrize("lockstep", [False, True], ids=["replicas", "sharded"])
def test_a_stop_request_cuts_an_evaluation_short_also_in_lockstep(lockstep):
    """A sharded model's evaluation (lockstep) ran to its end whatever the signal: the ranks now
    agree on a stop before each chunk, as they do while sampling."""
    from mingpt.data import TokenWindows
    from mingpt.evaluation import evaluate
    from mingpt.model import GPT

    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=5, block_size=4))
    windows = TokenWindows(torch.arange(400) % 5, 4, 4)
    asked = []

    def stop_requested():
        asked.append(True)
        return 15 if len(asked) > 2 else 0  # SIGTERM before the third chunk

    one = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    result = evaluate(model, windows, one, 0, 8, lockstep=lockstep, stop_requested=stop_requested)
    assert result.interrupted and len(asked) == 3
