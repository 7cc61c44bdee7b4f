"""A run's snapshots written in the background (trainer_config.async_save, as the
checkpointer saves with ddp): the snapshot holds the state at the call,
whatever training does after it; a failed write is raised at the next wait, on every
rank, as one line. (sharded.save's own async path, on FSDP ranks: tests/test_sharded.py.)"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from conftest import TINY, run_torchrun
from test_snapshot import make_trainer
from torch.distributed.checkpoint.state_dict import get_state_dict

from mingpt.checkpointer import all_finite
from mingpt.snapshot import manifest, sharded
from mingpt.storage import StorageError
from mingpt.trainer import TrainingError


def trained(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A linear layer and its AdamW after one step: both moments exist."""
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


class RunSaves:
    """What the checkpointer writes for a run: the model's and the optimizer's state, through
    DCP, in the background."""

    def __init__(self, root: str, width: int):
        self.root = root
        self.model, self.optimizer = trained(width)

    def save(self, step: int) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        tensors = {"model": model_state, "optim": optim_state}
        sharded.save(tensors, {**META, "step": step}, self.root, step, keep=2, async_save=True)

    def wait(self) -> None:
        sharded.wait_pending()


META = {"gpt_config": {}, "vocab": "ab", "epoch": 0, "samples_in_epoch": 0}


def test_the_snapshot_holds_the_state_at_the_call_not_what_training_did_next(tmp_path):
    root = str(tmp_path / "snapshots")
    fmt = RunSaves(root, 64)
    weight = fmt.model.weight.detach().clone()
    moment = fmt.optimizer.state[fmt.model.weight]["exp_avg"].clone()
    fmt.save(1)
    with torch.no_grad():  # training goes on in place while the snapshot is written
        fmt.model.weight.add_(1.0)
        fmt.optimizer.state[fmt.model.weight]["exp_avg"].mul_(0.0)
    assert sharded.wait_pending() == f"{root}/step-00000001"
    tensors, meta = sharded.load_full(root)
    assert torch.equal(tensors["model"]["weight"], weight) and meta["step"] == 1
    assert torch.equal(tensors["optim"]["state"]["weight"]["exp_avg"], moment)


def test_a_full_disk_in_the_background_is_raised_at_the_next_wait(small_disk):
    """A 256 KB tmpfs: the first snapshot fits; the second (a 300x300 layer and its
    moments, 1 MB) does not. Its error comes at the wait, once, and the snapshot before is kept."""
    root = str(small_disk / "snapshots")
    small, big = RunSaves(root, 8), RunSaves(root, 300)
    small.save(1)
    small.wait()
    # returns: the write goes on in the background
    big.save(2)
    with pytest.raises(StorageError) as failed:
        big.wait()
    assert str(failed.value) == (
        f"cannot save sharded snapshot {root}/step-00000002: [Errno 28] No space left on "
        "device (rank 0); the previous snapshots are unchanged"
    )
    assert manifest.latest(root) == f"{root}/step-00000001" and sharded.read_meta(root)["step"] == 1
    assert sharded.wait_pending() is None  # given once
    small.save(3)  # the next save goes on
    small.wait()
    assert sharded.read_meta(root)["step"] == 3
    assert sorted(p.name for p in (small_disk / "snapshots").iterdir()) == [
        "step-00000001",
        "step-00000003",
    ]


def test_a_failed_background_save_stops_every_rank_with_one_line(
    tmp_path, small_corpus, small_disk
):
    """Two DDP ranks save at step 5 to a 256 KB tmpfs, too small for the tiny model's
    snapshot: the write fails in the background, and the next wait (the end of
    the run) stops both ranks with the same line and a non-zero exit."""
    root = small_disk / "snapshots"
    args = [
        *TINY,
        "trainer_config.sample_chars=0",
        f"data_config.path={small_corpus}",
        f"trainer_config.snapshot_path={root}",
        "trainer_config.save_every_steps=5",
        "trainer_config.max_steps=8",
        "trainer_config.log_every=100",
    ]
    proc = run_torchrun(2, args, tmp_path)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert re.search(
        r"saved snapshot \S+ at step 5 in [\d.]+ s \(writing on in the background\)", proc.stderr
    )
    # The storage's own error, not where in DCP it was met; the run's first save: none before it.
    line = (
        r"(?:\[rank 1\] )?"
        rf"(error: cannot save sharded snapshot {re.escape(str(root))}/step-00000005: "
        r"\[Errno 28\] No space left on device \(rank [01]\); "
        rf"no snapshot is published in {re.escape(str(root))} yet)"
    )
    # Printed by each rank (rank 1's headed by its rank), or (torchrun may stop a rank once the
    # other exited) in its summary.
    printed = re.findall(rf"^{line}$", proc.stderr, re.M)
    reported = re.findall(rf"^  traceback : {line}$", proc.stderr, re.M)
    assert len(set(printed + reported)) == 1 and max(len(printed), len(reported)) == 2, proc.stderr[
        -3000:
    ]
    assert manifest.latest(str(root)) is None


def test_a_divergence_after_a_failed_background_save_does_not_name_it_as_kept(
    small_corpus, small_disk, caplog, one_thread
):
    """The step after a snapshot whose write fails in the background diverges: the error's line
    said what is left to resume from by the snapshot in flight ('the last good snapshot is kept
    at ..., step 1'), which was never published. The write is waited for, its failure said, and
    the line says what is truly there."""
    root = small_disk / "snapshots"
    trainer = make_trainer(
        small_disk / "run",
        small_corpus,
        f"trainer_config.snapshot_path={root}",
        "trainer_config.save_every_steps=1",
        "trainer_config.max_steps=4",
        "trainer_config.sample_chars=0",
    )
    train_step = trainer.train_step

    def diverging_at_step_2(indices):
        if trainer.state.step == 1:
            with torch.no_grad():
                next(trainer.raw_model.parameters()).fill_(math.inf)
        return train_step(indices)

    trainer.train_step = diverging_at_step_2
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingError) as error:
        trainer.train()
    assert str(error.value) == (
        f"training diverged: the loss is not finite at step 2; no snapshot was written yet ({root})"
    )
    assert f"cannot save sharded snapshot {root}/step-00000001: [Errno 28]" in caplog.text
    assert manifest.latest(str(root)) is None


def test_the_finiteness_check_before_a_save_is_exact():
    """A sum that overflows is not taken for a non-finite
    weight; a nan or an inf anywhere is found."""
    big = torch.full((4,), 3e38)  # finite, but its sum overflows float32
    assert all_finite(
        [
            torch.ones(3, dtype=torch.float16),
            big,
            torch.arange(3),
            torch.ones(0),
            torch.ones(2).double(),
        ]
    )
    for bad in (math.nan, math.inf, -math.inf):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            weights = torch.ones(1000, dtype=dtype)
            weights[517] = bad
            assert not all_finite([torch.ones(3), weights])
