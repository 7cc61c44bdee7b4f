"""The model a user keeps: the best weights beside the snapshot, and early stopping.

Tiny model, 20,000-character corpus, a constant learning rate of 0.03, an
evaluation every 4 steps on 2,048 held-out tokens: the held-out loss goes up
and down, so the best evaluation is not the last one.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal

import pytest
from conftest import (
    TINY,
    on_cpu,
    read_snapshot,
    run_dir_of,
    run_each,
    run_torchrun,
    tree_bytes,
)
from fsspec.implementations.local import LocalFileSystem
from test_snapshot import make_trainer, same_tensors, tensorboard_in_order, tensorboard_losses

from mingpt import stopping
from mingpt.config import ConfigError, TrainerConfig
from mingpt.evaluation import Evaluator
from mingpt.metrics import events
from mingpt.run import summary, train
from mingpt.snapshot import manifest, reader
from mingpt.storage import StorageError
from mingpt.trainer import TrainState

BUMPY = [
    "trainer_config.eval_every=4",
    "trainer_config.eval_tokens=2048",
    "optimizer_config.learning_rate=0.03",
    "optimizer_config.lr_schedule=constant",
    "optimizer_config.warmup_steps=0",
]


def eval_losses(run_dir) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["split"] == "eval"}


def logged(run_dir) -> list[tuple[str, int, float]]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["split"], r["step"], r["loss"]) for r in records]


def test_best_weights_survive_a_stop_and_resume(
    tmp_path, small_corpus, monkeypatch, caplog, one_thread
):
    """The best file holds, bitwise, the weights of the evaluation with the lowest
    loss, written only when an evaluation improves; a run stopped after its best
    and resumed keeps that best (it is not replaced by a later, worse evaluation)."""
    args = [*BUMPY, "trainer_config.max_steps=40"]
    reference = make_trainer(tmp_path / "ref", small_corpus, *args)
    evaluated = {}  # step -> the weights that evaluation saw
    record = reference.evaluator.record

    def recording(state, loss, last_step):
        evaluated[state.step] = {k: v.clone() for k, v in reference.raw_model.state_dict().items()}
        return record(state, loss, last_step)

    monkeypatch.setattr(reference.evaluator, "record", recording)
    reference.train()
    losses = eval_losses(tmp_path / "ref")
    best_step = min(losses, key=losses.get)
    # the test means something: the last evaluation is not the best
    assert best_step != max(losses), losses
    best = read_snapshot(tmp_path / "ref" / "snapshots-best")
    assert (
        best["best_step"] == best["step"] == best_step
        and best["best_eval_loss"] == losses[best_step]
    )
    assert same_tensors(best["model_state"], evaluated[best_step])
    # weights only: resume uses the latest
    assert best["optimizer_state"] == {"state": {}, "param_groups": []}
    latest = read_snapshot(tmp_path / "ref" / "snapshots")
    assert latest["best_step"] == best_step and not same_tensors(
        latest["model_state"], best["model_state"]
    )
    assert f"best {losses[best_step]:.4f} at step {best_step} (" in summary(reference, losses[40])

    # Stopped by a signal after the best evaluation, before
    # the last: the resumed run keeps the same best.
    stop_at = best_step + 2
    first = make_trainer(tmp_path / "resumed", small_corpus, *args)
    monkeypatch.setattr(
        stopping, "stop_requested", lambda: signal.SIGTERM if first.state.step >= stop_at else 0
    )
    with pytest.raises(stopping.Stopped):
        first.train()
    monkeypatch.undo()
    # Made complete there by a lower max_steps, the run ends at a step no evaluation saw: its
    # closing line has no held-out loss (it had step best_step's, as if of this step's weights).
    lower = [f"trainer_config.max_steps={stop_at}", "trainer_config.allow_config_change=true"]
    complete = make_trainer(tmp_path / "resumed", small_corpus, *args, *lower)
    assert complete.finished()
    assert summary(complete, complete.state.last_eval_loss).startswith(
        f"done at step {stop_at}: best {losses[best_step]:.4f} at step {best_step} ("
    )
    kept = tree_bytes(tmp_path / "resumed" / "snapshots-best")
    caplog.set_level(logging.INFO, logger="mingpt")
    resumed = make_trainer(tmp_path / "resumed", small_corpus, *args)
    assert resumed.state.step == stop_at and resumed.state.best_step == best_step
    resumed.train()
    assert (
        resumed.state.best_step == best_step and resumed.state.best_eval_loss == losses[best_step]
    )
    assert not [r for r in caplog.records if r.getMessage().startswith("saved the best weights")]
    assert tree_bytes(tmp_path / "resumed" / "snapshots-best") == kept  # not rewritten
    again = read_snapshot(tmp_path / "resumed" / "snapshots-best")
    assert again["step"] == best_step and same_tensors(again["model_state"], evaluated[best_step])


def test_best_weights_of_an_attempt_that_died_before_its_snapshot_are_set_aside(
    tmp_path, small_corpus, caplog, one_thread
):
    """Best weights that no snapshot accounts for (an attempt killed after its best but before its
    snapshot, or a run whose snapshots were deleted) are not this run's: pruning kept them over its
    own, each new best removed once published. A run that starts afresh moves them aside, kept."""
    run = tmp_path / "run"
    dead = make_trainer(
        run, small_corpus, *BUMPY, "trainer_config.max_steps=8", "trainer_config.eval_every=8"
    )
    dead.train()
    assert manifest.step_of(manifest.latest(str(run / "snapshots-best"))) == 8
    for directory in (run / "snapshots").iterdir():  # killed before its snapshot was written
        (directory / manifest.MANIFEST).unlink()
    with caplog.at_level(logging.INFO):
        again = make_trainer(
            run, small_corpus, *BUMPY, "trainer_config.max_steps=4", "gpt_config.n_embd=16"
        )
    train(again)
    best = read_snapshot(run / "snapshots-best")
    assert best["step"] == best["best_step"] == 4 and best["gpt_config"]["n_embd"] == 16
    assert same_tensors(best["model_state"], again.raw_model.state_dict())
    assert f"best {again.state.best_eval_loss:.4f} at step 4 (" in summary(
        again, again.state.last_eval_loss
    )
    (aside,) = run.glob("snapshots-best-set-aside-*")
    assert f"moved the best weights in {run / 'snapshots-best'} to {aside}" in caplog.text
    kept = read_snapshot(aside)
    assert kept["step"] == 8 and kept["gpt_config"]["n_embd"] == 32
    # The record of the attempt is kept beside the new one, not cut back to nothing.
    (old_record,) = run.glob("metrics-set-aside-*.jsonl")
    assert f"moved {run / 'metrics.jsonl'} to {old_record}" in caplog.text
    assert max(record["step"] for _, record in events(str(old_record))) == 8
    assert max(record["step"] for _, record in events(str(run / "metrics.jsonl"))) == 4


def test_best_weights_that_cannot_be_removed_or_moved_aside_stop_the_run_at_start(
    tmp_path, small_corpus, monkeypatch, one_thread
):
    """Best weights that are not this run's (saved after the snapshot it resumes from, or found by
    a run that starts afresh) and that storage refuses to remove or move aside stop the run with one
    line before it trains. A warning alone let the run go on: its best weights went in among them,
    and the last step's pruning kept the other attempt's newest step alone, its own removed."""
    run = tmp_path / "run"
    args = [
        *BUMPY,
        "trainer_config.max_steps=8",
        "trainer_config.eval_every=2",
        "trainer_config.save_every_steps=2",
        "trainer_config.keep_snapshots=10",
    ]
    make_trainer(run, small_corpus, *args).train()
    best_root = run / "snapshots-best"
    assert manifest.step_of(manifest.latest(str(best_root))) > 2  # the test means something
    # killed after the snapshot at step 2: the best weights after it are not the resumed run's
    for step in (4, 6, 8):
        (run / "snapshots" / f"step-{step:08d}" / manifest.MANIFEST).unlink()
    before = tree_bytes(best_root)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(LocalFileSystem, "rm", refused)
    with pytest.raises(StorageError) as error:
        make_trainer(run, small_corpus, *args)
    assert str(error.value).startswith(f"could not remove sharded snapshots in {best_root}: ")
    assert "Permission denied; this run resumes from step 2, " in str(error.value)
    assert tree_bytes(best_root) == before
    # No snapshot at all: a run starting afresh moves them aside, which storage refuses.
    monkeypatch.undo()
    shutil.rmtree(run / "snapshots")
    monkeypatch.setattr(LocalFileSystem, "mv", refused)
    with pytest.raises(StorageError) as error:
        make_trainer(run, small_corpus, *BUMPY, "trainer_config.max_steps=4")
    assert str(error.value).startswith(f"could not move {best_root} aside to ")
    assert "Permission denied; this run starts afresh (no snapshot to resume), " in str(error.value)
    assert tree_bytes(best_root) == before
    assert not list(run.glob("metrics-set-aside-*"))


def test_a_crash_after_a_later_best_leaves_the_best_that_a_resume_falls_back_to(
    tmp_path, small_corpus, monkeypatch, one_thread
):
    """A new best removed the one before it at once; a resume removes the best weights saved after
    its snapshot. A crash between a snapshot's next best and the next snapshot then left no best
    weights, and a second crash before the replayed evaluation lost them for good. The best at or
    before the latest snapshot is kept beside the newest until the run's last step."""
    run = tmp_path / "run"
    best_root = run / "snapshots-best"
    args = [*BUMPY, "trainer_config.max_steps=40", "trainer_config.save_every_steps=10"]
    first = make_trainer(run, small_corpus, *args)
    save_best = first.checkpointer.save_best

    def crash_after_a_best_past_step_10(state):
        save_best(state)
        if state.step > 10:
            raise RuntimeError("killed")

    monkeypatch.setattr(first.checkpointer, "save_best", crash_after_a_best_past_step_10)
    with pytest.raises(RuntimeError, match="killed"):
        first.train()
    crashed_at = first.state.step
    # the test means something: a best after the snapshot at 10, before the next
    assert 10 < crashed_at < 20 and manifest.step_of(manifest.latest(str(run / "snapshots"))) == 10
    monkeypatch.undo()
    resumed = make_trainer(run, small_corpus, *args)
    assert resumed.state.step == 10 and 0 < resumed.state.best_step <= 10
    kept = manifest.latest(str(best_root))
    assert kept is not None and manifest.step_of(kept) == resumed.state.best_step
    assert read_snapshot(best_root)["best_eval_loss"] == resumed.state.best_eval_loss
    resumed.train()
    # complete: the newest best alone stays
    assert len(manifest.listing(str(best_root))[1]) == 1
    assert manifest.step_of(manifest.latest(str(best_root))) == resumed.state.best_step


def test_an_evaluation_cut_by_a_stop_is_done_by_the_resumed_run(
    tmp_path, small_corpus, monkeypatch, one_thread
):
    """A stop during the evaluation at step 12 writes no best (the evaluation has no loss); the
    resumed run does that evaluation before its next step, so that its losses and best weights are
    the uninterrupted run's (the best was at step 12: it was lost, and step 4's kept), logged once
    when a crash after it leaves it to the next resume (TensorBoard too, beside step 12's train
    event, which no resume logs again)."""
    args = [*BUMPY, "trainer_config.max_steps=16", "trainer_config.log_every=4"]
    reference = make_trainer(tmp_path / "ref", small_corpus, *args)
    reference.train()
    trainer = make_trainer(tmp_path / "run", small_corpus, *args)
    monkeypatch.setattr(
        stopping, "stop_requested", lambda: signal.SIGTERM if trainer.state.step >= 12 else 0
    )
    with pytest.raises(stopping.Stopped):
        trainer.train()
    assert trainer.state.step == 12 and trainer.state.best_step == 4
    monkeypatch.undo()
    # A crash after that evaluation, before the next snapshot: the next resume does it again, and
    # the crashed attempt's event of it goes.
    crashed = make_trainer(tmp_path / "run", small_corpus, *args)
    monkeypatch.setattr(crashed, "train_step", lambda indices: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        crashed.train()
    assert eval_losses(tmp_path / "run")[12] == eval_losses(tmp_path / "ref")[12]
    resumed = make_trainer(tmp_path / "run", small_corpus, *args)
    assert resumed.state.eval_due and not resumed.finished()
    # The crashed attempt's best weights of step 12 went too: the newest, they stood for the run's
    # best, step 4's.
    best_root = str(tmp_path / "run" / "snapshots-best")
    assert manifest.step_of(manifest.latest(best_root)) == resumed.state.best_step == 4
    resumed.train()
    assert logged(tmp_path / "run") == logged(tmp_path / "ref")
    for tag in ("eval/loss", "train/loss"):
        assert tensorboard_losses(tmp_path / "run", tag) == tensorboard_losses(
            tmp_path / "ref", tag
        )
    best = read_snapshot(tmp_path / "run" / "snapshots-best")
    expected = read_snapshot(tmp_path / "ref" / "snapshots-best")
    # the test means something: the evaluation cut short was the best
    assert best["best_step"] == expected["best_step"] == 12
    assert same_tensors(best["model_state"], expected["model_state"])


def test_a_stop_in_the_final_evaluation_leaves_it_to_the_resumed_run(
    tmp_path, small_corpus, monkeypatch, one_thread
):
    """At the last step, the stop's line says the same command resumes the run: the resumed run
    evaluates the last step's weights and ends there, and the command after that finds the run
    complete. The line names the snapshot from the directory the run started in, as the closing
    line does (it named it by its absolute path)."""
    args = [*BUMPY, "trainer_config.max_steps=6"]
    trainer = make_trainer(tmp_path, small_corpus, *args)
    monkeypatch.setattr(
        stopping, "stop_requested", lambda: signal.SIGTERM if trainer.state.step >= 6 else 0
    )
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(stopping.Stopped) as stopped:
        trainer.train()
    assert str(stopped.value) == (
        f"stopped by SIGTERM at step 6; the run is saved in {tmp_path.name}/snapshots and the "
        "same command resumes it (SIGTERM, exit status 143)"
    )
    monkeypatch.undo()
    resumed = make_trainer(tmp_path, small_corpus, *args)
    assert not resumed.finished()
    final = resumed.train()
    assert resumed.state.step == 6 and eval_losses(tmp_path)[6] == final
    again = make_trainer(tmp_path, small_corpus, *args)
    assert again.finished() and not again.state.eval_due and again.state.step == 6


def test_a_sample_cut_by_a_stop_is_done_by_the_resumed_run(
    tmp_path, small_corpus, monkeypatch, one_thread
):
    """A stop during the sample after the last step's evaluation (its loss recorded): the run is
    not complete, and the resumed run samples that step, with the same text, before it ends; again
    after a crash before its snapshot. What TensorBoard shows (its plugins' reader), as
    metrics.jsonl, is the uninterrupted run's record, each step's once, and the closing line has
    the held-out loss of the step's evaluation, which the resumed run did not do again."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    args = [*BUMPY, "trainer_config.max_steps=8", "trainer_config.sample_chars=10"]
    final = make_trainer(tmp_path / "ref", small_corpus, *args).train()
    trainer = make_trainer(tmp_path / "run", small_corpus, *args)
    sample = trainer.sample
    sampling = []

    def sample_at_8(stop):
        if trainer.state.step == 8:
            sampling.append(stop)
        return sample(stop)

    monkeypatch.setattr(trainer, "sample", sample_at_8)
    monkeypatch.setattr(stopping, "stop_requested", lambda: signal.SIGTERM if sampling else 0)
    with pytest.raises(stopping.Stopped, match="at step 8; the run is saved in"):
        trainer.train()
    monkeypatch.undo()
    crashed = make_trainer(tmp_path / "run", small_corpus, *args)
    assert not crashed.finished()
    monkeypatch.setattr(crashed.checkpointer, "save", lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        crashed.train()
    resumed = make_trainer(tmp_path / "run", small_corpus, *args)
    assert f"done at step 8: held-out loss {final:.4f}, best " in summary(resumed, resumed.train())
    assert make_trainer(tmp_path / "run", small_corpus, *args).finished()
    assert logged(tmp_path / "run") == logged(tmp_path / "ref")
    shown = {}
    for name in ("run", "ref"):
        with tensorboard_in_order(tmp_path / name) as ordered:
            events = EventAccumulator(ordered)
            events.Reload()
        tags = ("sample/text_summary", "eval/loss")
        shown[name] = [[(e.step, e.tensor_proto) for e in events.Tensors(tag)] for tag in tags]
    assert [step for step, _ in shown["ref"][0]] == [4, 8]
    assert shown["run"] == shown["ref"]


def test_early_stopping_ends_the_run_as_finished(tmp_path, small_corpus, caplog, one_thread):
    """No evaluation after the first lowers the loss by 10: with a patience of 2
    the run stops at the third evaluation, saves there, and counts as finished."""
    caplog.set_level(logging.INFO, logger="mingpt")
    args = [
        *BUMPY,
        "trainer_config.max_steps=40",
        "trainer_config.early_stop_patience=2",
        "trainer_config.early_stop_min_delta=10",
    ]
    trainer = make_trainer(tmp_path, small_corpus, *args)
    trainer.train()
    assert trainer.state.step == 12 and trainer.state.stopped_early
    # after the line of the evaluation it follows from
    said = caplog.text[caplog.text.index("eval step 12 ") :]
    assert (
        "stopping early at step 12: 2 evaluations in a row without lowering the held-out loss "
        "by at least 10" in said
    )
    saved = read_snapshot(tmp_path / "snapshots")
    assert (
        saved["step"] == 12 and saved["stopped_early"] and saved["evals_without_improvement"] == 2
    )
    assert sorted(eval_losses(tmp_path)) == [4, 8, 12]  # no second evaluation at the end
    # the last step's training loss too, as at a run's last step (log_every=5), before its eval
    assert [(split, step) for split, step, _ in logged(tmp_path)][-2:] == [
        ("train", 12),
        ("eval", 12),
    ]
    caplog.clear()
    again = make_trainer(tmp_path, small_corpus, *args)
    train(again)
    assert again.state.step == 12
    assert "run already complete at step 12, stopped early (best " in caplog.text
    assert (
        "add trainer_config.early_stop_patience=null trainer_config.allow_config_change=true"
        in caplog.text
    )
    # A larger patience trains on from there (and would
    # stop again after 5 evaluations without improvement).
    more = make_trainer(
        tmp_path,
        small_corpus,
        *args,
        "trainer_config.early_stop_patience=5",
        "trainer_config.allow_config_change=true",
    )
    more.train()
    assert more.state.step == 24 and more.state.stopped_early


def test_early_stopping_keys_are_validated():
    assert TrainerConfig(early_stop_patience=3, early_stop_min_delta=0.01).early_stop_patience == 3
    with pytest.raises(
        ConfigError, match="trainer_config.early_stop_patience: must be >= 1 or null, got 0"
    ):
        TrainerConfig(early_stop_patience=0)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(
            ConfigError, match="trainer_config.early_stop_min_delta: must be a finite number >= 0"
        ):
            TrainerConfig(early_stop_min_delta=bad)


def test_early_stopping_counts_small_drops_that_add_up_to_min_delta():
    """A loss falling 0.01 per evaluation falls by min_delta 0.015 every second one: an
    improvement, so a patience of 2 never stops it; each drop is still a new best. A plateau
    after it stops the run; an older snapshot's record, without the reference, counts from its
    best loss."""
    evaluator = Evaluator(TrainerConfig(early_stop_patience=2, early_stop_min_delta=0.015))
    state = TrainState()
    for k, loss in enumerate([3.0, 2.99, 2.98, 2.97, 2.96, 2.95]):
        assert evaluator.record(state, loss, last_step=False)
        assert state.best_eval_loss == loss and not state.stopped_early
        assert state.evals_without_improvement == k % 2
    assert not evaluator.record(state, 2.951, last_step=False)
    assert state.stopped_early and state.evals_without_improvement == 2
    older = {"epoch": 0, "samples_in_epoch": 0, "step": 8, "best_eval_loss": 2.0}
    assert TrainState.restored(older, 100).early_stop_reference == 2.0


def test_best_path_is_beside_the_snapshot():
    assert reader.best_path("runs/a/snapshot.pt") == "runs/a/snapshot-best.pt"
    assert reader.best_path("runs/a/snapshots/") == "runs/a/snapshots-best"
    assert reader.best_path("s3://bucket/x.y/run1.pt") == "s3://bucket/x.y/run1-best.pt"


def test_main_early_stops_with_status_0_and_generate_samples_the_best(tmp_path, small_corpus):
    """Through `python main.py`: exit status 0, the same command again finds the run
    complete; `python -m mingpt.generate` with the run directory samples the best weights."""
    args = [
        *TINY,
        *BUMPY,
        f"data_config.path={small_corpus}",
        "trainer_config.max_steps=40",
        "trainer_config.early_stop_patience=1",
        "trainer_config.early_stop_min_delta=10",
    ]
    run_dir = run_dir_of(tmp_path, args)
    # The run; the same command again; then generate with the run directory, then with its
    # snapshots: one process for the four, one after another (each start is mostly importing
    # torch).
    first, again, sampled, explicit = run_each(
        "mingpt.generate",
        [
            (tmp_path, on_cpu(args), "mingpt.cli"),
            (tmp_path, on_cpu(args), "mingpt.cli"),
            (tmp_path, [f"snapshot_path={run_dir}", "max_new_tokens=5", "device=cpu"]),
            (
                tmp_path,
                [f"snapshot_path={run_dir / 'snapshots'}", "max_new_tokens=5", "device=cpu"],
            ),
        ],
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopping early at step 8" in first.stderr
    closing = first.stderr.rstrip().splitlines()[-1]
    assert "done at step 8 (stopped early): held-out loss" in closing and "best " in closing, (
        closing
    )
    assert closing.endswith(
        f"sample from the best: python -m mingpt.generate snapshot_path="
        f"{(run_dir / 'snapshots-best').relative_to(tmp_path)}"
    ), closing
    assert (
        again.returncode == 0 and "run already complete at step 8, stopped early" in again.stderr
    ), again.stderr
    assert "train step" not in again.stderr

    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr
    assert (
        f"run directory {run_dir}: its best weights, {run_dir / 'snapshots-best'}" in sampled.stderr
    )
    assert f"{run_dir}: step 4," in sampled.stderr  # the first evaluation was the best
    assert explicit.returncode == 0 and f"{run_dir / 'snapshots'}: step 8," in explicit.stderr, (
        explicit.stderr
    )


def test_fsdp_ranks_early_stop_together_and_keep_a_sharded_best(tmp_path, small_corpus):
    args = [
        *TINY,
        *BUMPY,
        f"data_config.path={small_corpus}",
        "trainer_config.parallelism=fsdp",
        "trainer_config.max_steps=40",
        "trainer_config.early_stop_patience=1",
        "trainer_config.early_stop_min_delta=10",
    ]
    result = run_torchrun(2, args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = run_dir_of(tmp_path, args)
    assert manifest.latest(str(run_dir / "snapshots")).endswith("step-00000008")
    best = read_snapshot(run_dir / "snapshots-best")
    assert best["step"] == 4 and best["stopped_early"] is False and best["world_size"] == 2
    assert manifest.latest(str(run_dir / "snapshots-best")).endswith("step-00000004")
