"""Fine-tuning (trainer_config.init_from): a run that starts from another run's weights.

One tiny model is pretrained once for the module (the CLI, so its run directory is
a real one) on corpus A, the first 60,000 characters of tiny shakespeare.
Corpus B is the last 40,000, far from A, kept to A's characters with '!' and '?'
made '.': a vocabulary strictly inside A's, so B's ids are read as the snapshot's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import TINY, on_cpu, read_snapshot, run_dir_of, run_each, run_torchrun
from omegaconf import OmegaConf
from test_snapshot import assert_one_error, make_trainer, same_tensors

from mingpt import stopping
from mingpt.config import ConfigError
from mingpt.score import ScoreConfig, score
from mingpt.snapshot import SnapshotError, manifest, sharded, single_file

# Batch 32 at a constant 0.03: the tiny model gets past the unigram plateau in few steps.
FAST = [
    "trainer_config.batch_size=32",
    "optimizer_config.learning_rate=0.03",
    "optimizer_config.lr_schedule=constant",
    "optimizer_config.warmup_steps=0",
    "trainer_config.eval_tokens=2048",
]
PRETRAIN = [
    *TINY,
    *FAST,
    "data_config.path=a.txt",
    "trainer_config.run_name=pre",
    "trainer_config.max_steps=80",
    "trainer_config.eval_every=20",
    "trainer_config.sample_chars=0",
]


@dataclasses.dataclass
class Pretrained:
    cwd: Path  # where `python main.py PRETRAIN` ran
    run_dir: Path
    a: Path
    b: Path
    commands: dict = dataclasses.field(default_factory=dict)  # see the fixture commands


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus) -> Pretrained:
    cwd = tmp_path_factory.mktemp("finetune")
    text = corpus.read_text(encoding="utf-8")
    a = text[:60_000]
    kept = set(a)
    b = "".join(c for c in text[-40_000:] if c in kept).replace("!", ".").replace("?", ".")
    assert set(b) < kept  # B's own vocabulary is smaller: its ids differ from the snapshot's
    (cwd / "a.txt").write_text(a, encoding="utf-8")
    (cwd / "b.txt").write_text(b, encoding="utf-8")
    pretrained = Pretrained(cwd, run_dir_of(cwd, PRETRAIN), cwd / "a.txt", cwd / "b.txt")
    # The quick commands that start from it run after it in its process (see commands).
    cwds = {name: tmp_path_factory.mktemp(name) for name in ("outside", "shape")}
    (cwds["outside"] / "c.txt").write_text(
        pretrained.b.read_text(encoding="utf-8") + "café ~\n", encoding="utf-8"
    )
    given = {"outside": outside_vocabulary(pretrained), "shape": shape_given(pretrained)}
    results = run_each(
        "mingpt.cli",
        [(cwd, on_cpu(PRETRAIN)), *((cwds[name], on_cpu(given[name])) for name in given)],
    )
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    pretrained.commands = {
        name: (cwds[name], result) for name, result in zip(given, results[1:], strict=True)
    }
    return pretrained


def final_eval(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "eval"][-1]


def weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}


def test_finetuning_lowers_the_heldout_loss_faster_than_training_from_scratch(
    tmp_path, pretrained, caplog, one_thread
):
    """The issue's test: 20 steps on B from A's weights reach a lower held-out loss on
    B's own held-out split than 20 steps from scratch; fresh optimizer, step from 0."""
    caplog.set_level(logging.INFO, logger="mingpt")
    steps = [*FAST, "trainer_config.max_steps=20"]
    finetuned = make_trainer(
        tmp_path / "ft", pretrained.b, *steps, f"trainer_config.init_from={pretrained.run_dir}"
    )
    assert finetuned.state.step == 0 and not finetuned.optimizer.state  # fresh: no moments yet
    assert (
        finetuned.data.tokenizer.chars == read_snapshot(pretrained.run_dir / "snapshots")["vocab"]
    )
    x, _ = finetuned.train_windows.batch([0])  # B's ids, read as the snapshot's: the same text
    assert (
        finetuned.data.tokenizer.decode(x[0].tolist())
        == pretrained.b.read_text(encoding="utf-8")[:16]
    )
    finetuned.train()
    scratch = make_trainer(tmp_path / "scratch", pretrained.b, *steps)
    scratch.train()
    ft_loss, scratch_loss = final_eval(tmp_path / "ft"), final_eval(tmp_path / "scratch")
    assert ft_loss < scratch_loss - 0.1, (ft_loss, scratch_loss)
    assert finetuned.state.step == 20
    saved = read_snapshot(tmp_path / "ft" / "snapshots")
    assert saved["step"] == 20 and saved["trainer_config"]["init_from"] == str(pretrained.run_dir)
    assert saved["corpus"][0]["source"] == str(pretrained.b)  # the held-out split is B's
    # mingpt.score reads B in the snapshot's vocabulary too: the run's own held-out loss.
    scored = score(ScoreConfig(snapshot_path=str(tmp_path / "ft" / "snapshots"), device="cpu"))
    assert scored.loss == pytest.approx(ft_loss, rel=1e-5)


def outside_vocabulary(pretrained: Pretrained) -> list[str]:
    return [
        *TINY,
        "data_config.path=c.txt",
        "trainer_config.max_steps=2",
        f"trainer_config.init_from={pretrained.run_dir / 'snapshots'}",
    ]


def shape_given(pretrained: Pretrained) -> list[str]:
    """data_config.block_size=64 given (the default), to be replaced by the snapshot's 16."""
    return [
        *TINY,
        f"data_config.path={pretrained.b}",
        "trainer_config.max_steps=1",
        "trainer_config.sample_chars=0",
        "data_config.block_size=64",
        f"trainer_config.init_from={pretrained.run_dir / 'snapshots'}",
    ]


@pytest.fixture(scope="module")
def commands(pretrained) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """{case: (the directory main.py ran in, what it gave)}: "outside": a corpus with characters
    outside the snapshot's vocabulary; "shape": a 1-step run given another block size. Run in
    the pretraining's process, after it (each start is mostly importing torch)."""
    return pretrained.commands


def test_a_character_outside_the_snapshots_vocabulary_is_refused_in_one_line(pretrained, commands):
    cwd, result = commands["outside"]
    assert result.returncode == 2
    assert_one_error(
        result,
        "2 characters outside the vocabulary of",
        str(pretrained.run_dir / "snapshots"),
        "'~' 'é'",
    )
    # refused before writing anything: the run directory it made is gone
    assert not run_dir_of(cwd, outside_vocabulary(pretrained)).exists()


def test_the_shape_comes_from_the_snapshot_and_another_is_refused(pretrained, tmp_path, one_thread):
    source = f"trainer_config.init_from={pretrained.run_dir / 'snapshots'}"
    # Left at their defaults (4 layers, 128 dims, windows of 64): the snapshot's shape.
    trainer = make_trainer(
        tmp_path / "a",
        pretrained.b,
        source,
        "gpt_config.n_layer=4",
        "gpt_config.n_embd=128",
        "data_config.block_size=64",
    )
    shape = trainer.config.gpt_config
    assert (shape.n_layer, shape.n_head, shape.n_embd, shape.block_size) == (2, 2, 32, 16)
    assert trainer.train_windows.block_size == 16
    with pytest.raises(
        ConfigError,
        match=r"^gpt_config\.n_embd: 64 given, but the model of .*snapshots "
        r"\(trainer_config\.init_from\) has 32",
    ):
        make_trainer(tmp_path / "b", pretrained.b, source, "gpt_config.n_embd=64")
    with pytest.raises(ConfigError, match=r"^data_config\.block_size: 32 given"):
        make_trainer(tmp_path / "c", pretrained.b, source, "data_config.block_size=32")


def test_weights_of_another_shape_than_recorded_are_refused_naming_what_differs(
    pretrained, tmp_path, one_thread
):
    """A snapshot file whose record says 3 layers over 2 layers' weights: the one line says which
    weights are missing (it ended at load_state_dict's first line, which names only the model)."""
    state = read_snapshot(pretrained.run_dir / "snapshots")
    state.pop("optimizer_state")
    three = tmp_path / "three.pt"
    single_file.save({**state, "gpt_config": {**state["gpt_config"], "n_layer": 3}}, str(three))
    with pytest.raises(SnapshotError) as refused:
        make_trainer(
            tmp_path / "ft",
            pretrained.b,
            "gpt_config.n_layer=3",
            f"trainer_config.init_from={three}",
        )
    line = str(refused.value)
    assert line.startswith(f"trainer_config.init_from: snapshot {three} cannot be loaded: ")
    assert 'Missing key(s) in state_dict: "h.2.ln_1.weight"' in line and "\n" not in line, line


def test_the_log_names_the_keys_from_the_snapshot_and_the_run_records_them(pretrained, commands):
    """data_config.block_size=64 given (the default):
    replaced by the snapshot's 16, said, and recorded."""
    tmp_path, result = commands["shape"]
    args = shape_given(pretrained)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"the model's shape from {pretrained.run_dir / 'snapshots'} (trainer_config.init_from): "
        "gpt_config.n_layer=2, gpt_config.n_head=2, gpt_config.n_embd=32, "
        "data_config.block_size=16 (replacing 64)"
    ) in result.stderr
    recorded = OmegaConf.load(run_dir_of(tmp_path, args) / ".hydra" / "config.yaml")
    assert recorded.data_config.block_size == 16 and recorded.gpt_config.n_layer == 2
    assert recorded.gpt_config.vocab_size is None  # set by the data, as before


def test_a_run_directory_gives_its_best_weights_else_its_snapshot(
    pretrained, tmp_path, caplog, one_thread
):
    caplog.set_level(logging.INFO, logger="mingpt")
    run_dir = tmp_path / "pre"
    shutil.copytree(pretrained.run_dir, run_dir)
    best = read_snapshot(run_dir / "snapshots-best")
    trainer = make_trainer(tmp_path / "ft", pretrained.b, f"trainer_config.init_from={run_dir}")
    assert same_tensors(weights(trainer), best["model_state"])
    assert (
        f"initialised from {run_dir / 'snapshots-best'} (step {best['best_step']}, "
        f"held-out loss {best['best_eval_loss']:.4f})"
    ) in caplog.text
    shutil.rmtree(run_dir / "snapshots-best")  # none written yet: the run's snapshot
    latest = read_snapshot(run_dir / "snapshots")
    trainer = make_trainer(tmp_path / "ft2", pretrained.b, f"trainer_config.init_from={run_dir}")
    assert same_tensors(weights(trainer), latest["model_state"])
    assert f"initialised from {run_dir / 'snapshots'} (step 80" in caplog.text


def test_a_fine_tuned_run_restarted_without_its_source_is_told_to_give_it(
    pretrained, tmp_path, one_thread
):
    """Its shape is the source's: without init_from the config's default shape does not fit, and
    the refusal says which init_from to add (it said only which key differed)."""
    source = pretrained.run_dir / "snapshots"
    tuned = make_trainer(
        tmp_path / "ft",
        pretrained.b,
        f"trainer_config.init_from={source}",
        "trainer_config.max_steps=2",
        "gpt_config.n_layer=4",  # the default: the source's shape replaces it
    )
    tuned.train()
    with pytest.raises(SnapshotError) as refused:
        # the same command without init_from: n_layer at its default, not the source's 2
        make_trainer(
            tmp_path / "ft", pretrained.b, "trainer_config.max_steps=4", "gpt_config.n_layer=4"
        )
    assert str(refused.value).endswith(
        f"that run was fine-tuned from {source}, whose shape it keeps; add "
        f"trainer_config.init_from={source} as it had"
    ), refused.value


def test_a_run_directory_is_found_as_a_file_url_and_by_its_own_snapshot_file(
    pretrained, tmp_path, tiny_file
):
    """file://DIR is the local run directory (it was taken for a snapshot root, and refused); an
    older run's single file where its config's snapshot_path names it is its snapshot (it was
    said to have none)."""
    from mingpt.snapshot import reader

    run_dir = pretrained.run_dir
    assert reader.find(f"file://{run_dir}")[0] == str(run_dir / "snapshots-best")
    old = tmp_path / "old"
    (old / ".hydra").mkdir(parents=True)
    (old / ".hydra" / "config.yaml").write_text("trainer_config:\n  snapshot_path: gpt.pt\n")
    shutil.copy(tiny_file, old / "gpt.pt")
    assert reader.find(str(old))[0] == str(old / "gpt.pt")


def test_a_sharded_snapshot_is_a_source_for_either_parallelism(
    pretrained, tmp_path, caplog, one_thread
):
    caplog.set_level(logging.INFO, logger="mingpt")
    make_trainer(
        tmp_path / "sharded",
        pretrained.a,
        "trainer_config.parallelism=fsdp",
        "trainer_config.max_steps=6",
        f"trainer_config.init_from={pretrained.run_dir}",
    ).train()
    root = tmp_path / "sharded" / "snapshots"
    assert manifest.latest(str(root))
    source = read_snapshot(root)
    # In one process (parallelism=ddp).
    plain = make_trainer(tmp_path / "plain", pretrained.b, f"trainer_config.init_from={root}")
    assert same_tensors(weights(plain), source["model_state"])
    assert f"initialised from {root} (step 6, held-out loss " in caplog.text
    # Sharded over two ranks.
    args = [
        *TINY,
        f"data_config.path={pretrained.b}",
        "trainer_config.parallelism=fsdp",
        "trainer_config.max_steps=2",
        "trainer_config.eval_tokens=512",
        f"trainer_config.init_from={root}",
    ]
    result = run_torchrun(2, args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"initialised from {root} (step 6, held-out loss " in result.stderr
    own = run_dir_of(tmp_path, args) / "snapshots"
    meta = sharded.read_meta(str(own))
    assert meta["step"] == 2 and meta["world_size"] == 2 and meta["vocab"] == source["vocab"]


def test_a_stopped_finetuning_run_resumes_its_own_snapshot(
    pretrained, tmp_path, monkeypatch, caplog, one_thread
):
    """Stopped at step 6 and restarted, the run resumes its own snapshot (its source is
    gone by then, and not needed) and ends with the uninterrupted run's exact weights."""
    caplog.set_level(logging.INFO, logger="mingpt")
    source = tmp_path / "source"
    shutil.copytree(pretrained.run_dir / "snapshots", source)
    # The corpus whole in memory (placement=device): its ids
    # are mapped there, as they are per batch read on the host.
    args = [
        *FAST,
        "trainer_config.max_steps=12",
        "gpt_config.dropout=0.1",
        "data_config.placement=device",
        f"trainer_config.init_from={source}",
    ]
    reference = make_trainer(tmp_path / "ref", pretrained.b, *args)
    reference.train()
    first = make_trainer(tmp_path / "run", pretrained.b, *args)
    monkeypatch.setattr(
        stopping, "stop_requested", lambda: signal.SIGTERM if first.state.step >= 6 else 0
    )
    with pytest.raises(stopping.Stopped):
        first.train()
    monkeypatch.undo()
    shutil.rmtree(source)
    caplog.clear()
    resumed = make_trainer(tmp_path / "run", pretrained.b, *args)
    assert resumed.state.step == 6
    x, _ = resumed.train_windows.batch([1])
    assert (
        resumed.data.tokenizer.decode(x[0].tolist())
        == pretrained.b.read_text(encoding="utf-8")[16:32]
    )
    assert "resumed from" in caplog.text and "initialised from" not in caplog.text
    resumed.train()
    assert resumed.state.step == 12 and same_tensors(weights(resumed), weights(reference))
