"""Fault tolerance: atomic fsspec snapshots, safe and validated loads, no
non-finite weights on disk, and exact resume after SIGKILL under torchrun
restarts, also with another world size.

Tiny model, 20,000-character corpus: 1,124 training windows of 16 tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import fsspec
import pytest
import torch
from conftest import (
    COPY,
    REPO,
    RUN_DEADLINE,
    TINY,
    child_env,
    on_cpu,
    read_snapshot,
    run_dir_of,
    run_each,
    run_torchrun,
    torchrun_cmd,
)
from omegaconf import OmegaConf

from mingpt import storage
from mingpt.config import Config, DataConfig
from mingpt.data import ResumableSampler
from mingpt.distributed import DistInfo
from mingpt.run import build
from mingpt.snapshot import SnapshotError, compat, manifest, sharded, single_file
from mingpt.trainer import Trainer, TrainingError

N_TRAIN = 1124  # training windows of the small corpus


def overrides(*extra: str) -> list[str]:
    """TINY, on CPU, without samples, then `extra` (a later key replaces an earlier one)."""
    merged = {}
    for item in [*TINY, "trainer_config.device=cpu", "trainer_config.sample_chars=0", *extra]:
        key, value = item.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_one_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Non-zero exit, exactly one `error:` line holding every fragment, no stack trace."""
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------- in-process API


def make_trainer(run_dir, corpus_path, *extra: str) -> Trainer:
    """A single-process Trainer built like main.py builds it, from override strings."""
    dotlist = overrides(f"data_config.path={corpus_path}", *extra)
    config = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    )
    return build(config, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(run_dir))


def memory_url() -> str:
    return f"memory://ft-{uuid.uuid4().hex}/snapshots"


def tree_bytes(url) -> dict[str, bytes]:
    """Every file under a snapshot root (a local path or
    URL) by its path relative to it: compared byte for byte."""
    fs, root = storage.filesystem(str(url))
    root = root.rstrip("/")
    return {path[len(root) :]: fs.cat_file(path) for path in sorted(fs.find(root))}


def train_steps(run_dir) -> list[int]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in records if r["split"] == "train"]


def test_memory_url_saves_on_schedule_and_resumes_exactly(
    tmp_path, small_corpus, caplog, one_thread
):
    """memory:// snapshots through the library: saved every save_every epochs,
    every save_every_steps steps and at the end; a run stopped at step 30 and
    resumed (dropout on) ends with the uninterrupted run's exact weights; a
    diverging run stops and leaves the last good snapshot as it was."""
    # Batch 32: 36 steps per epoch (35 full, then 4 samples), epochs end at steps 36, 72, 108.
    # A constant learning rate after warmup does not depend on the run's length (max_steps).
    common = [
        "trainer_config.batch_size=32",
        "trainer_config.max_epochs=3",
        "trainer_config.save_every=2",
        "trainer_config.save_every_steps=25",
        "gpt_config.dropout=0.1",
        "optimizer_config.lr_schedule=constant",
        "optimizer_config.warmup_steps=10",
    ]
    caplog.set_level(logging.INFO, logger="mingpt")
    reference_url, resumed_url = memory_url(), memory_url()
    # An attempt killed before its first save left an event; the fresh start drops it.
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "metrics.jsonl").write_text(
        '{"step": 7, "epoch": 0, "split": "train", "loss": 9.0}\n'
    )
    make_trainer(
        tmp_path / "ref", small_corpus, *common, f"trainer_config.snapshot_path={reference_url}"
    ).train()
    saved = [r.args[1] for r in caplog.records if r.msg.startswith("saved snapshot")]
    assert saved == [25, 50, 72, 75, 100, 108]
    assert train_steps(tmp_path / "ref") == list(range(5, 106, 5)) + [108]

    resumed = [*common, f"trainer_config.snapshot_path={resumed_url}"]
    make_trainer(
        tmp_path / "resumed", small_corpus, *resumed, "trainer_config.max_steps=30"
    ).train()
    caplog.clear()
    make_trainer(
        tmp_path / "resumed", small_corpus, *resumed, "trainer_config.allow_config_change=true"
    ).train()
    assert any(
        r.getMessage() == f"resumed from {resumed_url}: epoch 0, 960 samples into it, step 30"
        for r in caplog.records
    )
    reference, final = read_snapshot(reference_url), read_snapshot(resumed_url)
    assert final["step"] == reference["step"] == 108 and final["epoch"] == 3
    assert same_tensors(final["model_state"], reference["model_state"])
    assert train_steps(tmp_path / "resumed") == list(range(5, 106, 5)) + [108]  # no event twice

    # A learning rate of 1e6 turns the loss into NaN within three steps: the
    # check after each step (free on a CPU) stops the run before the epoch's save.
    good = tree_bytes(resumed_url)
    diverging = make_trainer(
        tmp_path / "resumed",
        small_corpus,
        *resumed,
        "trainer_config.max_epochs=4",
        "optimizer_config.learning_rate=1e6",
        "trainer_config.save_every_steps=null",
        "trainer_config.log_every=1",
        "trainer_config.allow_config_change=true",
    )
    kept = rf"the last good snapshot is kept at {resumed_url}, step 108$"
    with pytest.raises(
        TrainingError, match=r"training diverged: the loss is not finite at step 1\d\d; " + kept
    ):
        diverging.train()
    assert tree_bytes(resumed_url) == good
    fsspec.filesystem("memory").rm(
        [reference_url.split("://")[1], resumed_url.split("://")[1]], recursive=True
    )


def test_an_fp16_run_on_a_cpu_resumes_its_gradient_scaler(tmp_path, small_corpus, one_thread):
    """fp16 forced on a CPU (amp_on_cpu), ended at step 4 and continued to step 8: the gradient
    scaler's scale and growth tracker go on from the snapshot, and the run ends bitwise where an
    uninterrupted one ends. (test_cuda.py checks this on a GPU; a CPU host runs this one.) Continued
    without a scaler (as an fp16 run from CUDA on a CPU), its snapshots keep the scaler's state:
    they held none, and back on CUDA the scale was searched for again."""
    fp16 = [
        "trainer_config.use_amp=true",
        "trainer_config.amp_on_cpu=true",
        "trainer_config.amp_dtype=fp16",
        "optimizer_config.lr_schedule=constant",
        "optimizer_config.warmup_steps=0",
    ]
    make_trainer(tmp_path / "ref", small_corpus, *fp16, "trainer_config.max_steps=8").train()
    make_trainer(tmp_path / "run", small_corpus, *fp16, "trainer_config.max_steps=4").train()
    make_trainer(
        tmp_path / "run",
        small_corpus,
        *fp16,
        "trainer_config.max_steps=8",
        "trainer_config.allow_config_change=true",
    ).train()
    reference = read_snapshot(tmp_path / "ref" / "snapshots")
    final = read_snapshot(tmp_path / "run" / "snapshots")
    assert final["step"] == reference["step"] == 8
    assert reference["scaler_state"]["_growth_tracker"] > 4  # steps after the resume counted on
    assert final["scaler_state"] == reference["scaler_state"]
    assert same_tensors(final["model_state"], reference["model_state"])
    make_trainer(
        tmp_path / "run",
        small_corpus,
        *fp16,
        "trainer_config.amp_on_cpu=false",
        "trainer_config.max_steps=9",
        "trainer_config.allow_config_change=true",
    ).train()
    assert read_snapshot(tmp_path / "run" / "snapshots")["scaler_state"] == final["scaler_state"]


# ------------------------------------------------------------ loading safely


def test_unreadable_snapshots_are_refused_naming_the_file(tmp_path):
    good = {
        "model_state": {"w": torch.randn(256, 256)},
        "optimizer_state": {},
        "gpt_config": {"n_layer": 2},
        "vocab": "abc",
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 3,
    }
    path = str(tmp_path / "good.pt")
    single_file.save(good, path)
    assert single_file.load(path)["step"] == 3
    whole = (tmp_path / "good.pt").read_bytes()
    cases = {
        "truncated.pt": whole[: len(whole) // 2],
        "garbage.pt": os.urandom(4096),
        "empty.pt": b"",
        "text.pt": b"not a snapshot\n" * 50,
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SnapshotError) as e:
            single_file.load(str(tmp_path / name))
        assert str(tmp_path / name) in str(e.value) and "truncated or not a torch snapshot" in str(
            e.value
        )
        assert "\n" not in str(e.value)
    torch.save({"model_state": {}}, tmp_path / "other.pt")  # a torch file, but not ours
    with pytest.raises(SnapshotError, match="is not a mingpt snapshot .no gpt_config, vocab"):
        single_file.load(str(tmp_path / "other.pt"))
    with pytest.raises(SnapshotError, match="snapshot not found"):
        single_file.load(str(tmp_path / "missing.pt"))
    # Same vocabulary size, other characters: the shapes fit, the vocabulary does not.
    mismatch = r"vocabulary of 3 characters in the snapshot, 3 in the data \(differs: 'cd'\)"
    with pytest.raises(SnapshotError, match=mismatch):
        compat.check_compatible(good, {"n_layer": 2}, "abd", path)


class _CreatesFile:
    """Unpickling this calls open(marker, "w"): it creates the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def pickled_code(directory: Path) -> tuple[Path, Path]:
    """(a snapshot file in `directory` holding pickled code, the file that code would create)."""
    marker = directory / "code-ran"
    snapshot = directory / "evil.pt"
    state = {
        "model_state": {"w": _CreatesFile(str(marker))},
        "optimizer_state": {},
        "gpt_config": {},
        "vocab": "",
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 0,
    }
    torch.save(state, snapshot)
    torch.load(snapshot, weights_only=False)  # the file really would create the marker...
    assert marker.exists()
    marker.unlink()
    return snapshot, marker


def test_pickled_code_is_refused_and_never_runs(refused_at_start):
    """A snapshot file (what export writes, and generate, score, export and init_from read)
    holding pickled code: the reader refuses it and none of it runs. (A run's own snapshots,
    Distributed Checkpoints: tests/test_sharded.py refuses a payload in their index.)"""
    snapshot, marker = refused_at_start[0]["pickled code"][0]
    proc = refused_at_start[0]["pickled code"][1]
    line = assert_one_error(proc, f"refusing to load {snapshot}", "none of it was run")
    assert re.search(r"GLOBAL _?io\.open", line), line  # Python 3.12 names it _io.open
    assert not marker.exists()  # ...but nothing in it ran


@pytest.fixture(scope="module")
def good_snapshot(refused_at_start):
    """A 6-step single-process run through main.py's cli.main: (its work directory, its snapshot
    root). It runs first in the process of the runs refused at start (see refused_at_start)."""
    return refused_at_start[2]


# Copies a directory, between two commands of one run_each process.
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_corpus_that_grew_since_the_snapshot_is_refused_naming_it(
    tmp_path, small_corpus, caplog, one_thread, parallelism
):
    """Text appended (no new characters) moves every file's held-out split: the snapshot
    records the corpus (each file's size and SHA-256) and a resume on another one is
    refused, naming the file and its sizes, unless allow_config_change (a warning)."""
    run = (
        f"trainer_config.parallelism={parallelism}",
        "trainer_config.async_save=false",
        "trainer_config.max_steps=2",
    )
    make_trainer(tmp_path / "run", small_corpus, *run).train()
    before = small_corpus.stat().st_size
    text = small_corpus.read_text(encoding="utf-8")
    small_corpus.write_text(text + text[:3000], encoding="utf-8")
    after = small_corpus.stat().st_size
    with pytest.raises(SnapshotError) as refused:
        make_trainer(tmp_path / "run", small_corpus, *run)
    assert f"was written for another corpus ({small_corpus}: {before} -> {after} bytes)" in str(
        refused.value
    )
    assert "allow_config_change=true" in str(refused.value) and "\n" not in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        resumed = make_trainer(
            tmp_path / "run", small_corpus, *run, "trainer_config.allow_config_change=true"
        )
    assert resumed.state.step == 2
    assert "the held-out split moved" in caplog.text and f"{before} -> {after} bytes" in caplog.text


def test_a_changed_split_warns_that_the_held_out_text_moved(
    tmp_path, small_corpus, caplog, one_thread
):
    """train_split (or truncate) continued with allow_config_change moves held-out text into
    training, as a changed corpus does: the same warning, not only the list of changed keys; it
    says that the best loss compared with is of the old split (that was silent)."""
    make_trainer(tmp_path / "run", small_corpus, "trainer_config.max_steps=2").train()
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        make_trainer(
            tmp_path / "run",
            small_corpus,
            "trainer_config.max_steps=4",
            "data_config.train_split=0.95",
            "trainer_config.allow_config_change=true",
        )
    assert "the held-out split moved" in caplog.text
    assert "(data_config.train_split: 0.9 -> 0.95)" in caplog.text
    # the best loss is of the old split's text, and it stays the one compared with
    assert "compare with the best loss so far, " in caplog.text
    assert " at step 2, of the old split" in caplog.text


def test_a_snapshot_that_records_no_corpus_resumes_as_before(tmp_path, small_corpus, one_thread):
    """Snapshots written before the corpus was recorded resume without the check."""
    make_trainer(
        tmp_path / "run",
        small_corpus,
        "trainer_config.max_steps=2",
        "trainer_config.async_save=false",
    ).train()
    directory = Path(manifest.latest(str(tmp_path / "run" / "snapshots")))
    document = json.loads((directory / manifest.META).read_text())
    assert document["meta"]["corpus"] == [
        {
            "source": str(small_corpus),
            "size": small_corpus.stat().st_size,
            "sha256": hashlib.sha256(small_corpus.read_bytes()).hexdigest(),
        }
    ]
    del document["meta"]["corpus"]  # as written before the corpus was recorded, and published so
    data = json.dumps(document).encode()
    (directory / manifest.META).write_bytes(data)
    listed = json.loads((directory / manifest.MANIFEST).read_text())
    listed["files"][manifest.META] = [len(data), hashlib.sha256(data).hexdigest()]
    (directory / manifest.MANIFEST).write_text(json.dumps(listed))
    small_corpus.write_text(small_corpus.read_text(encoding="utf-8") * 2, encoding="utf-8")
    assert (
        make_trainer(tmp_path / "run", small_corpus, "trainer_config.max_steps=2").state.step == 2
    )


def test_a_stray_snapshot_whose_name_lies_is_neither_resumed_nor_pruned(
    tmp_path, small_corpus, caplog, one_thread, monkeypatch
):
    """A valid older sharded snapshot copied to step-99999999 would be the newest by
    name: it is skipped with one warning naming it, the run resumes from its true
    newest, and keep_snapshots prunes by the true steps, never the stray. The resume lists the
    root three times, not four: on an object store each listing is a round trip."""
    run = (
        "trainer_config.parallelism=fsdp",
        "trainer_config.async_save=false",
        "trainer_config.save_every_steps=1",
        "trainer_config.keep_snapshots=2",
        "trainer_config.allow_config_change=true",
    )
    make_trainer(tmp_path / "run", small_corpus, *run, "trainer_config.max_steps=2").train()
    root = tmp_path / "run" / "snapshots"
    stray = root / "step-99999999"
    shutil.copytree(root / "step-00000001", stray)
    monkeypatch.setattr(manifest, "listing", mock.Mock(wraps=manifest.listing))
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        trainer = make_trainer(tmp_path / "run", small_corpus, *run, "trainer_config.max_steps=4")
        assert trainer.state.step == 2
        # twice to find where the run starts (before its lock: the newest may be rotated away
        # meanwhile), once under its lock to load it
        assert [c.args[0] for c in manifest.listing.call_args_list].count(str(root)) == 3
        trainer.train()
    assert sorted(p.name for p in root.iterdir()) == [
        "step-00000003",
        "step-00000004",
        "step-99999999",
    ]
    warnings = [
        r.getMessage() for r in caplog.records if "ignoring sharded snapshot" in r.getMessage()
    ]
    assert warnings == [
        f"ignoring sharded snapshot {stray}: its name says step 99999999 but it holds step 1 "
        "(a stray copy or a renamed directory?); it is neither resumed nor removed"
    ]


@pytest.fixture(scope="module")
def refused_at_start(
    tmp_path_factory, corpus
) -> tuple[dict[str, tuple[Path, subprocess.CompletedProcess]], dict[str, bytes], tuple]:
    """({case: (the directory main.py ran in, what it said)}, the good snapshot's files before
    them, good_snapshot) for runs refused at start (one process for all, after the good run and
    a copy of its snapshot: each run is mostly importing torch): for each parallelism, a regular
    file where the snapshots' root directory goes; and a model of another shape than the good
    snapshot's, in its run directory. And "pickled code": ((a snapshot file holding pickled code,
    the file it would create), what generate said on it)."""
    tmp = tmp_path_factory.mktemp("good")
    (tmp / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    good = overrides(f"data_config.path={tmp / 'small.txt'}", "trainer_config.max_steps=6")
    snapshot = run_dir_of(tmp, good) / "snapshots"
    copy = tmp_path_factory.mktemp("before") / "snapshots"
    cases = {"good": (tmp, on_cpu(good)), "copy": (tmp, [COPY, str(snapshot), str(copy)], "-c")}
    for parallelism in ("fsdp", "ddp"):
        cwd = tmp_path_factory.mktemp(parallelism)
        (cwd / "small.txt").write_text(
            corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8"
        )
        (cwd / "taken").write_text("not a snapshot")
        args = overrides(
            f"data_config.path={cwd / 'small.txt'}",
            f"trainer_config.parallelism={parallelism}",
            f"trainer_config.snapshot_path={cwd / 'taken'}",
            "trainer_config.max_steps=2",
        )
        cases[parallelism] = (cwd, on_cpu(args))
    args = overrides(
        f"data_config.path={tmp / 'small.txt'}",
        "gpt_config.n_layer=3",
        f"hydra.run.dir={snapshot.parent}",
    )
    cases["other shape"] = (tmp, on_cpu(args))
    # generate on a snapshot file holding pickled code, in the same process
    evil = tmp_path_factory.mktemp("pickled")
    code = pickled_code(evil)
    cases["pickled code"] = (evil, [f"snapshot_path={code[0]}", "device=cpu"], "mingpt.generate")
    results = run_each("mingpt.cli", list(cases.values()))
    given = {name: (cases[name][0], result) for name, result in zip(cases, results, strict=True)}
    assert given["good"][1].returncode == 0, given["good"][1].stderr[-3000:]
    assert given["copy"][1].returncode == 0, given["copy"][1].stderr[-3000:]
    given["pickled code"] = (code, given["pickled code"][1])
    return given, tree_bytes(copy), (tmp, snapshot)


def test_snapshot_of_another_shape_is_refused(good_snapshot, refused_at_start):
    _, snapshot = good_snapshot
    results, before, _ = refused_at_start
    assert_one_error(
        results["other shape"][1],
        f"snapshot {snapshot} was written with another config (gpt_config.n_layer: 2 -> 3;",
        "which gives the model another shape or vocabulary: start a new run with "
        "trainer_config.run_name=NAME",
    )
    assert tree_bytes(snapshot) == before


def test_a_record_field_of_another_type_is_refused_at_resume(good_snapshot, tmp_path):
    """A snapshot whose meta.json holds a field of another type, its manifest made to agree (as
    whoever changed it could): resuming it is refused in one line naming the field, as generate,
    score and export refuse it, not a traceback from where the field is first used."""
    tmp, snapshot = good_snapshot
    good = overrides(f"data_config.path={tmp / 'small.txt'}", "trainer_config.max_steps=6")
    cases = []
    for field, value in (("step", "6"), ("trainer_config", "6")):
        run_dir = tmp_path / field
        shutil.copytree(snapshot.parent, run_dir, ignore=shutil.ignore_patterns("*.lock"))
        directory = Path(manifest.latest(str(run_dir / "snapshots")))
        document = json.loads((directory / manifest.META).read_text())
        document["meta"][field] = value
        data = json.dumps(document).encode()
        (directory / manifest.META).write_bytes(data)
        # What whoever changed it could do too: make the manifest agree.
        listed = json.loads((directory / manifest.MANIFEST).read_text())
        listed["files"][manifest.META] = [len(data), hashlib.sha256(data).hexdigest()]
        (directory / manifest.MANIFEST).write_text(json.dumps(listed))
        cases.append((tmp, on_cpu([*good, f"hydra.run.dir={run_dir}"])))
    score = [f"snapshot_path={run_dir}/snapshots", f"path={tmp / 'small.txt'}", "device=cpu"]
    cases.append((tmp, score, "mingpt.score"))
    step, trainer_config, scored = run_each("mingpt.cli", cases)
    assert_one_error(
        step, f"snapshot {tmp_path}/step/snapshots is not usable: step must be a whole number"
    )
    assert_one_error(
        trainer_config,
        f"snapshot {tmp_path}/trainer_config/snapshots is not usable: trainer_config must be a "
        "mapping, got str",
    )
    # score reads it too (its batch size), where generate and export do not
    assert_one_error(
        scored, f"snapshot {tmp_path}/trainer_config/snapshots is not usable: trainer_config"
    )


@pytest.mark.parametrize("key", ["truncate", "block_size"])
def test_a_changed_data_key_that_changes_the_model_is_named_not_what_follows(key):
    """data_config.truncate changes the vocabulary, data_config.block_size the model's block: the
    refusal names the data key alone, not gpt_config.vocab_size or gpt_config.block_size, which
    the user does not set; allow_config_change, which cannot help, changes nothing."""
    saved = dataclasses.asdict(Config())
    config = Config()
    vocab = "abc"
    if key == "truncate":
        saved["data_config"]["truncate"] = 0.01
        saved["gpt_config"]["vocab_size"] = 3
        config.gpt_config.vocab_size = 4
        vocab = "abcd"
        change = "data_config.truncate: 0.01 -> 1.0"
    else:
        saved["data_config"]["block_size"] = 128
        saved["gpt_config"]["block_size"] = 128
        saved["gpt_config"]["vocab_size"] = 3
        config.gpt_config.vocab_size = 3
        config.gpt_config.block_size = config.data_config.block_size
        change = f"data_config.block_size: 128 -> {config.data_config.block_size}"
    state = {**saved, "vocab": "abc", "corpus": None}
    config.trainer_config.allow_config_change = True
    with pytest.raises(SnapshotError) as e:
        compat.check_fits(state, config, vocab, "runs/x/snapshots", [])
    assert str(e.value) == (
        f"snapshot runs/x/snapshots was written with another config ({change}), which gives the "
        "model another shape or vocabulary: start a new run with trainer_config.run_name=NAME (a "
        "name not used yet), or fine-tune from it (trainer_config.init_from)"
    )


@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_a_snapshot_path_of_the_other_kind_stops_the_run_at_start(refused_at_start, parallelism):
    """A regular file where the snapshots' root directory goes (every parallelism):
    one line at start, before any training, not at the first save."""
    cwd, proc = refused_at_start[0][parallelism]
    assert_one_error(proc, f"cannot write to the snapshot path {cwd / 'taken'}: it is a file")
    assert "train step" not in proc.stderr and not list(cwd.glob("runs/*/metrics.jsonl"))


def test_a_run_keeps_its_optimizer_even_where_config_changes_are_allowed():
    from mingpt.config import OptimizerConfig, TrainerConfig

    saved = Config()
    state = {
        name: dataclasses.asdict(getattr(saved, name))
        for name in ("optimizer_config", "trainer_config")
    }
    muon = Config(
        optimizer_config=OptimizerConfig(algorithm="muon"),
        trainer_config=TrainerConfig(allow_config_change=True, max_epochs=3),
    )
    with pytest.raises(SnapshotError) as e:
        compat.check_same_config(state, muon, "s.pt")
    # a new run is named among the ways on: `optimizer_config=muon` after the Quick start is
    # more likely a run of its own than a fine-tune
    assert str(e.value) == (
        "snapshot s.pt holds another optimizer's state "
        '(optimizer_config.algorithm: "adamw" -> "muon"): keep its optimizer_config.algorithm, '
        "start a new run with trainer_config.run_name=NAME (a name not used yet), or fine-tune "
        "from it in one (trainer_config.init_from)"
    )
    more = Config(trainer_config=TrainerConfig(allow_config_change=True, max_epochs=3))
    assert compat.check_same_config(state, more, "s.pt") == {"trainer_config.max_epochs": (2, 3)}


def test_a_sweeps_job_says_its_own_values_are_that_jobs(monkeypatch):
    """Added to the sweep's command, a job's own values would make the sweep one job, job 0, in
    another job's directory: the refusal says whose they are."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from mingpt.config import TrainerConfig

    state = {"trainer_config": dataclasses.asdict(TrainerConfig())}
    job = OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "job": {"num": 1}}})
    monkeypatch.setattr(HydraConfig.instance(), "cfg", job)
    with pytest.raises(SnapshotError) as e:
        compat.check_same_config(state, Config(trainer_config=TrainerConfig(seed=7)), "s.pt")
    assert "with its own values (trainer_config.seed=1337, as job 1 of the sweep), " in str(e.value)


def test_allowed_config_changes_are_warned_of_the_moved_split_apart(caplog):
    """Continuing with allow_config_change: every change is named in one warning, and a changed
    train_split (which moves the held-out split) in another, before it."""
    saved = dataclasses.asdict(Config())
    saved["data_config"]["train_split"] = 0.8
    saved["trainer_config"]["max_epochs"] = 5
    saved["gpt_config"]["vocab_size"] = 3
    state = {**saved, "vocab": "abc", "corpus": None}
    config = Config()
    config.gpt_config.vocab_size = 3
    config.trainer_config.allow_config_change = True
    with caplog.at_level(logging.WARNING, logger="mingpt.snapshot.compat"):
        compat.check_fits(state, config, "abc", "runs/x/snapshots", [])
    assert [r.getMessage().split(":", 1)[0] for r in caplog.records] == [
        "continuing runs/x/snapshots on a changed corpus or split (data_config.train_split",
        "continuing runs/x/snapshots with a changed config",
    ]
    assert "(data_config.train_split: 0.8 -> 0.9)" in caplog.records[0].getMessage()
    assert (
        caplog.records[1]
        .getMessage()
        .endswith("data_config.train_split: 0.8 -> 0.9; trainer_config.max_epochs: 5 -> 2")
    )


def test_the_same_corpus_under_another_path_is_no_config_change():
    corpus = [{"source": "corpus.txt", "size": 10, "sha256": "x"}]
    saved = dataclasses.asdict(Config(data_config=DataConfig(path="corpus.txt")))
    saved["gpt_config"]["vocab_size"] = 3
    state = {**saved, "vocab": "abc", "corpus": corpus}
    config = Config(data_config=DataConfig(path="./data/corpus.txt"))
    config.gpt_config.vocab_size = 3
    moved = [{**corpus[0], "source": "data/corpus.txt"}]
    compat.check_fits(state, config, "abc", "runs/x/snapshots", moved)
    assert state["data_config"]["path"] == "corpus.txt"  # the caller's record is left as it was


def test_corpus_changes_name_each_file():
    old = [
        {"source": "a.txt", "size": 10, "sha256": "x"},
        {"source": "b.txt", "size": 5, "sha256": "y"},
    ]
    assert compat.corpus_changes(None, old) == []
    assert compat.corpus_changes(old, old) == []
    new = [
        {"source": "a.txt", "size": 10, "sha256": "z"},
        {"source": "b.txt", "size": 7, "sha256": "y"},
        {"source": "c.txt", "size": 1, "sha256": "w"},
    ]
    assert compat.corpus_changes(old, new) == [
        "a.txt: other content (same size, 10 bytes)",
        "b.txt: 5 -> 7 bytes",
        "c.txt added",
    ]
    assert compat.corpus_changes(new, old[:1]) == [
        "a.txt: other content (same size, 10 bytes)",
        "b.txt removed",
        "c.txt removed",
    ]
    # matched by name: a file added before another is not that file changed
    assert compat.corpus_changes(old, [new[2], *old]) == ["c.txt added"]
    assert compat.corpus_changes(old, old[::-1]) == ["the same files in another order"]
    # the same texts in the same order, spelled otherwise: no change
    respelled = [{**f, "source": f"./{f['source']}"} for f in old]
    assert compat.corpus_changes(old, respelled) == []


# ------------------------------------------------------------- saving safely


def test_killed_save_leaves_previous_snapshot_intact(tmp_path):
    """The single file (export's write): a save killed
    part-way leaves the file before it, byte for byte."""
    path = tmp_path / "snapshot.pt"
    previous = {
        "model_state": {"w": torch.arange(10.0)},
        "optimizer_state": {},
        "gpt_config": {},
        "vocab": "ab",
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 1,
    }
    single_file.save(previous, str(path))
    before = path.read_bytes()
    # The writer saves 200 MB over and over; it is killed as soon as a temporary file appears.
    kill_writer(tmp_path, path, lambda: list(tmp_path.glob("snapshot.pt.tmp-*")))
    assert list(tmp_path.glob("snapshot.pt.tmp-*")), "the kill did not land during the save"
    assert path.read_bytes() == before  # the previous snapshot, byte for byte
    assert single_file.load(str(path))["step"] == 1
    # The next save replaces it and clears the killed save's temporary file.
    single_file.save({**previous, "step": 2}, str(path))
    assert single_file.load(str(path))["step"] == 2 and not list(tmp_path.glob("snapshot.pt.tmp-*"))


def test_killed_background_save_leaves_previous_snapshot_published(tmp_path):
    """A run's snapshots: a process killed while its asynchronous save (ShardedFormat, as
    training saves) writes leaves an unpublished directory; the snapshot before stays the
    newest published one, byte for byte, and the next save removes the killed one's directory."""
    root = tmp_path / "snapshots"
    sharded.save({"w": torch.arange(10.0)}, {"step": 1}, str(root), 1, async_save=False)
    before = tree_bytes(root)
    # The writer saves 200 MB over and over; it is killed as soon as its first save's shard appears.
    kill_writer(tmp_path, root, lambda: list(root.glob("step-00000002*/*.distcp")), "snapshots")
    (killed,) = [p for p in root.iterdir() if p.name.startswith("step-00000002")]
    assert not (killed / manifest.MANIFEST).exists(), "the kill did not land during the save"
    assert manifest.latest(str(root)) == str(root / "step-00000001")
    assert {k: v for k, v in tree_bytes(root).items() if k.startswith("/step-00000001/")} == before
    tensors, meta = sharded.load_full(str(root))
    assert meta == {"step": 1} and torch.equal(tensors["w"], torch.arange(10.0))
    sharded.save({"w": torch.ones(3)}, {"step": 3}, str(root), 3, async_save=False)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003"]


def kill_writer(tmp_path, path, started, *mode: str) -> None:
    """Run tests/ft_writer.py on `path`; SIGKILL it
    as soon as `started()` finds its save under way."""
    writer = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "ft_writer.py"), str(path), "200", *mode],
        env=child_env(),
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + RUN_DEADLINE
        while not started():
            assert writer.poll() is None, writer.stderr.read().decode()
            assert time.monotonic() < deadline, "the writer never started a save"
            time.sleep(0.001)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
        writer.stderr.close()
    assert writer.returncode == -signal.SIGKILL


@pytest.mark.parametrize("moment", ["checked", "opened"])
def test_a_file_replaced_while_being_read_is_read_whole(tmp_path, monkeypatch, moment):
    """The single-file format's counterpart of a sharded snapshot rotated away while being
    read: a save replaces the file by a rename, so a reader gets the file it opened, whole,
    or the new one; never a missing or damaged one."""
    path = str(tmp_path / "snapshot.pt")
    state = {
        "model_state": {"w": torch.zeros(3)},
        "optimizer_state": {},
        "gpt_config": {},
        "vocab": "ab",
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 1,
    }
    single_file.save(state, path)
    fs_class = type(storage.filesystem(path)[0])
    original, saves = (storage.check_regular if moment == "checked" else fs_class.open), [2]

    def replace_after(*args, **kwargs):
        result = original(*args, **kwargs)
        if saves:  # once: the save opens files too
            single_file.save({**state, "step": saves.pop()}, path)
        return result

    monkeypatch.setattr(
        *((storage, "check_regular") if moment == "checked" else (fs_class, "open")), replace_after
    )
    assert single_file.load(path)["step"] == (2 if moment == "checked" else 1)


def test_divergence_stops_every_rank_and_keeps_the_good_snapshot(tmp_path, good_snapshot):
    """Two ranks resume the good snapshot (step 6) with a learning rate that
    makes the loss NaN by step 8. The loss is logged only at the end, so the
    divergence flag, read at the save at step 10, must catch it, on both ranks."""
    tmp, good = good_snapshot
    snapshot = tmp_path / "snapshots"
    shutil.copytree(good, snapshot)
    args = overrides(
        f"data_config.path={tmp / 'small.txt'}",
        f"trainer_config.snapshot_path={snapshot}",
        "optimizer_config.learning_rate=1e6",
        "trainer_config.save_every_steps=5",
        "trainer_config.log_every=1000",
        "trainer_config.max_steps=40",
        "trainer_config.allow_config_change=true",
    )
    proc = run_torchrun(2, args, tmp_path)
    assert proc.returncode != 0
    # Each rank stops with the same line (rank 1's headed by its rank): printed, and in
    # torchrun's summary from each rank's error file (torchrun may stop one rank before it
    # prints, once the other exited).
    kept = f"(found at step 10); the last good snapshot is kept at {snapshot}, step 6"
    diverged = r"error: training diverged: the loss is not finite at step [789] "
    line = rf"(?:\[rank 1\] )?({diverged}{re.escape(kept)})"
    printed = re.findall(rf"^{line}$", proc.stderr, re.M)
    reported = re.findall(rf"^  traceback : {line}$", proc.stderr, re.M)
    assert len(set(printed + reported)) == 1 and max(len(printed), len(reported)) == 2, proc.stderr[
        -3000:
    ]
    assert tree_bytes(snapshot) == tree_bytes(good)


def test_ranks_that_see_different_snapshots_stop_and_torchruns_summary_carries_the_line(
    tmp_path, good_snapshot
):
    """A node-local snapshot path: rank 0 finds the snapshot, rank 1 does not. Each worker writes
    its one error line to torchrun's error file (TORCHELASTIC_ERROR_FILE): the failure summary
    shows it, not a pointer to torch's docs."""
    tmp, good = good_snapshot
    shutil.copytree(good, tmp_path / "snapshots-0")
    args = overrides(
        f"data_config.path={tmp / 'small.txt'}",
        f"trainer_config.snapshot_path={tmp_path}/snapshots-${{oc.env:RANK}}",
        # the good snapshot stopped at max_steps=6
        "trainer_config.allow_config_change=true",
    )
    proc = run_torchrun(2, args, tmp_path)
    assert proc.returncode != 0
    # Both ranks stop, each naming its own path.
    blind = "error: ranks [1] cannot see the snapshot path "
    for rank in (0, 1):
        line = (
            f"{blind}{tmp_path}/snapshots-{rank} that rank 0 writes to (a path local to each node)"
        )
        assert line in proc.stderr, proc.stderr[-3000:]
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[1]
    # not "To enable traceback see: ..."
    line = re.escape(f"{blind}{tmp_path}/") + r"snapshots-[01]" + re.escape(" that rank 0 writes")
    assert re.search(rf"^  traceback : {line} ", root_cause, re.M), proc.stderr[-3000:]
    assert manifest.latest(str(tmp_path / "snapshots-1")) is None
    assert tree_bytes(tmp_path / "snapshots-0") == tree_bytes(good)


def test_a_fresh_run_whose_ranks_see_different_snapshot_paths_is_refused_before_training(
    tmp_path, small_corpus
):
    """A node-local snapshot path with no snapshot yet: each rank writes its own files of every
    snapshot under the root it sees, and rank 0 published snapshots listing rank 1's files that
    its root never held. The run ended as done, every snapshot damaged; now it is refused at
    start, before anything is written."""
    args = overrides(
        f"data_config.path={small_corpus}",
        f"trainer_config.snapshot_path={tmp_path}/snapshots-${{oc.env:RANK}}",
        "trainer_config.max_steps=2",
    )
    proc = run_torchrun(2, args, tmp_path)
    assert proc.returncode != 0, proc.stderr[-3000:]
    line = f"error: ranks [1] cannot see the snapshot path {tmp_path}/snapshots-0 that rank 0"
    assert line in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "snapshots-0").exists() and not (tmp_path / "snapshots-1").exists()
    assert not (run_dir_of(tmp_path, args) / "metrics.jsonl").exists()
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


# --------------------------------------------------------------- exactness


def test_sampler_resumes_with_any_world_size():
    """Epoch 3 of 1,124 samples, consumed by 2 ranks up to sample 320, then 1
    up to 808, 2 up to 1,000, and 3 to the end. Every sample is seen once,
    except the 2 that pad the last 124 to a multiple of 3."""
    seen, start = [], 0
    for world, per_rank, stop in ((2, 8, 320), (1, 8, 808), (2, 4, 1000), (3, 8, N_TRAIN)):
        samplers = [ResumableSampler(N_TRAIN, world, r, seed=1337) for r in range(world)]
        orders = []
        for s in samplers:
            s.set_epoch(3)
            s.start_index = start
            orders.append(list(s))
        steps = -(-(stop - start) // (per_rank * world))
        for step in range(steps):
            for order in orders:
                seen.extend(order[step * per_rank : (step + 1) * per_rank])
        start = min(N_TRAIN, start + steps * per_rank * world)
    counts = Counter(seen)
    assert set(counts) == set(range(N_TRAIN))
    assert len(seen) == N_TRAIN + 2 and sum(c - 1 for c in counts.values()) == 2


def read_samples(record_dir) -> Counter:
    counts = Counter()
    for path in record_dir.glob("samples-rank*.txt"):
        for line in path.read_text().splitlines():
            epoch, _step, *indices = map(int, line.split())
            assert epoch == 0
            counts.update(indices)
    return counts


@pytest.fixture(scope="module")
def elastic(tmp_path_factory, corpus) -> tuple[Path, list[str]]:
    """(the record, the parts' logs): one epoch trained through main.py by 2 processes (steps
    1-10), then 1 (to step 70), then 4 (to the end), sharing a file:// snapshot, as a sweep of
    both parallelisms (tests/ft_record.py records each rank's samples and saves apart): a
    launch for both, and each job's snapshot of its own (snapshot_path names the parallelism)."""
    tmp = tmp_path_factory.mktemp("elastic")
    (tmp / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    record = tmp / "record"
    args = overrides(
        f"data_config.path={tmp / 'small.txt'}",
        "trainer_config.max_epochs=1",
        "trainer_config.save_every_steps=7",
        # each part has its own max_steps
        "trainer_config.allow_config_change=true",
        f"trainer_config.snapshot_path={elastic_url(tmp, '${trainer_config.parallelism}')}",
        "trainer_config.parallelism=ddp,fsdp",
    )
    logs = []
    # 10 steps of 16 samples: 160; 60 steps of 8: 640; 484 left: 15 steps of 32 and one of 4
    for nproc, max_steps in ((2, "10"), (1, "70"), (4, "null")):
        launcher = [sys.executable]
        if nproc > 1:
            launcher = torchrun_cmd(nproc, "--standalone")
        proc = subprocess.run(
            [
                *launcher,
                str(REPO / "tests" / "ft_record.py"),
                "-m",
                *args,
                f"trainer_config.max_steps={max_steps}",
            ],
            cwd=tmp,
            env={**child_env(), "FT_RECORD_DIR": str(record)},
            capture_output=True,
            text=True,
            timeout=RUN_DEADLINE,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs.append(proc.stderr)
    return record, logs


def elastic_url(tmp: Path, parallelism: str) -> str:
    return f"file://{tmp / 'shared' / parallelism / 'snapshots'}"


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_elastic_resume_2_to_1_to_4_sees_each_sample_once(elastic, parallelism):
    """The ranks together train on every sample of the epoch exactly once, and every rank takes
    part in each save: every 7 steps and at the end of each part. FSDP2's sharded snapshots are
    resharded by every load."""
    record, logs = elastic
    url = elastic_url(record.parent, parallelism)
    assert f"resumed from {url}: epoch 0, 160 samples into it, step 10" in logs[1]
    assert f"resumed from {url}: epoch 0, 640 samples into it, step 70" in logs[2]
    final = read_snapshot(url)
    assert (final["step"], final["epoch"], final["samples_in_epoch"], final["world_size"]) == (
        86,
        1,
        0,
        4,
    )
    assert final["trainer_config"]["parallelism"] == parallelism
    record = record / parallelism
    assert read_samples(record) == Counter(range(N_TRAIN))
    saves = {
        rank: [int(s) for s in (record / f"saves-rank{rank}.txt").read_text().split()]
        for rank in range(4)
    }
    assert saves[0] == [7, 10, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 86]
    assert saves[1] == [7, 10, 77, 84, 86]  # the parts on 2 and 4 processes
    assert saves[2] == saves[3] == [77, 84, 86]  # the part on 4


# The key test: a worker SIGKILLed mid-epoch, in a save, torchrun restarts, the run ends bitwise
# where it would have. torchrun >= 2.5 keeps one TCPStore across restarts and the restarted workers
# can read the dead ones' addresses from it (pytorch#135712); this opts out, as
# docs/fault-tolerance.md says.
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
KILL_ARGS = [
    "gpt_config.dropout=0.1",
    "trainer_config.log_every=1",
    "trainer_config.save_every_steps=10",
    "optimizer_config.warmup_steps=5",  # shorter than the run, which says no warning
]
STEPS_PER_EPOCH = 71  # with 2 ranks
KILL_STEPS = STEPS_PER_EPOCH + 10  # 10 steps into a second epoch


def kill_args(corpus: Path, *extra: str) -> list[str]:
    return overrides(
        f"data_config.path={corpus}",
        *KILL_ARGS,
        "trainer_config.max_epochs=2",
        f"trainer_config.max_steps={KILL_STEPS}",
        *extra,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> dict[str, Path]:
    """{parallelism: the run directory of a run that nothing stops}: one torchrun launch, a sweep
    of both (saving in the background: how a run saves changes none of its steps)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    (tmp / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    args = kill_args(
        tmp / "small.txt",
        "trainer_config.run_name=reference",
        "trainer_config.parallelism=ddp,fsdp",
    )
    proc = run_torchrun(2, [*args, "-m"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        parallelism: tmp / "runs" / "reference-multirun" / job
        for job, parallelism in (("0", "ddp"), ("1", "fsdp"))
    }


def train_events(run_dir) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


@contextlib.contextmanager
def tensorboard_in_order(run_dir) -> Iterator[str]:
    """A directory of the run's TensorBoard files, named in the order they were written, which a
    restart's purge depends on: a file's name ends in its time in seconds and a counter of the
    process, and by name ...10 comes before ...9 (several attempts in one test's second)."""

    def written(path: Path) -> tuple[int, int]:
        parts = path.name.split(".")
        return int(parts[3]), int(parts[-1])

    with tempfile.TemporaryDirectory() as ordered:
        for i, path in enumerate(sorted((run_dir / "tb").iterdir(), key=written)):
            os.symlink(path, os.path.join(ordered, f"events.out.tfevents.{i:06d}"))
        yield ordered


def tensorboard_losses(run_dir, tag: str = "train/loss") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tensorboard_in_order(run_dir) as ordered:
        events = EventAccumulator(ordered)
        events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def final_state(run_dir) -> tuple[int, dict, dict]:
    """(step, weights, AdamW's state as {"param.key": tensor}) of the run's last snapshot."""
    tensors, meta = sharded.load_full(str(run_dir / "snapshots"))
    moments = {
        f"{p}.{k}": v for p, state in tensors["optim"]["state"].items() for k, v in state.items()
    }
    return meta["step"], tensors["model"], moments


# Each parallelism with one moment of the save at step 20 and one way to save, so that each is
# taken: rank 1 dies before rank 0 publishes it, saving in the step (the restart comes from step
# 10's), or rank 0 once it has published it, in the background (the case that also warned about the
# snapshot rank 0 had published).
@pytest.mark.parametrize(
    ("parallelism", "dies", "in_", "async_save", "resumed"),
    [("ddp", 1, "shard_hashes", False, 10), ("fsdp", 0, "prune", True, 20)],
    ids=["ddp-before-publishing-in-step", "fsdp-after-publishing-background"],
)
def test_a_worker_sigkilled_in_a_save_restarts_and_ends_bitwise_identical(
    tmp_path, small_corpus, uninterrupted, parallelism, dies, in_, async_save, resumed
):
    """Every rank writes its part of each snapshot and a restart resumes from the last published
    one: a save cut before rank 0 publishes it is not, and the restart comes from the one before.
    The survivor's collectives of the save fail as its peer is gone. It said that as a storage
    fault ("cannot save sharded snapshot ...: Connection closed by peer"; in the background, a
    warning, also about the snapshot rank 0 had published); it waits for torchrun to stop it
    instead, with the one line of a worker torchrun stops, headed by its rank (rank 1's read as
    rank 0's)."""
    args = kill_args(
        small_corpus,
        f"trainer_config.parallelism={parallelism}",
        f"trainer_config.async_save={str(async_save).lower()}",
    )
    env = {
        **child_env(),
        **RESTART_ENV,
        "FT_KILL_RANK": str(dies),
        "FT_KILL_STEP": "11",
        "FT_KILL_IN": in_,
    }
    # torchrun looks at its workers every 3 s, not 0.1 s: the survivor meets its failed collective
    # before torchrun stops it (else the signal could come first, and hide what it said).
    cmd = torchrun_cmd(2, "--standalone", "--max-restarts=1", "--monitor-interval=3") + [
        str(REPO / "tests" / "ft_kill.py"),
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = "error: stopped by SIGTERM, exiting at once"
    survivor = line
    dead = f"[rank 1] {line}"
    if dies == 0:
        survivor = dead
        dead = line
    lines = proc.stderr.splitlines()
    assert survivor in lines and dead not in lines, proc.stderr[-3000:]
    assert "cannot save" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path, args)
    log = (run_dir / "train.log").read_text()
    resumed_lines = [line for line in log.splitlines() if "resumed from" in line]
    assert len(resumed_lines) == 1, log[-3000:]  # the restart really resumed, from a mid-epoch save
    assert resumed_lines[0].endswith(f"into it, step {resumed}") and "epoch 0," in resumed_lines[0]

    reference = uninterrupted[parallelism]
    final, expected = final_state(run_dir), final_state(reference)
    assert final[0] == expected[0] == KILL_STEPS
    assert same_tensors(final[1], expected[1])
    assert same_tensors(final[2], expected[2]) and len(final[2]) > len(final[1])
    # The logs hold each step once, as the uninterrupted run logged it.
    reference_events = train_events(reference)
    assert [s for s, _ in reference_events] == list(range(1, KILL_STEPS + 1))
    assert train_events(run_dir) == reference_events
    assert tensorboard_losses(run_dir) == tensorboard_losses(reference)
