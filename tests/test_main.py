"""End to end: `python main.py` as a user runs it, with a tiny model on a tiny corpus."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    COPY,
    REPO,
    TINY,
    child_env,
    on_cpu,
    read_snapshot,
    run_dir_of,
    run_each,
    run_main,
    tree_bytes,
)

from mingpt.config import GPTConfig, OptimizerConfig
from mingpt.model import GPT

# Values of a train event that depend on the machine and its load, not on what the run computes.
MACHINE_KEYS = ("tokens_per_s", "mfu", "peak_mem_mib")

# 6,000 characters: 337 training windows of 16, batch 8, so 43 steps per epoch.
STEPS_PER_EPOCH = 43


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus) -> Path:
    cwd = tmp_path_factory.mktemp("main")
    (cwd / "corpus.txt").write_text(corpus.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return cwd


def args(workdir: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        f"data_config.path={workdir / 'corpus.txt'}",
        "trainer_config.max_epochs=2",
        *extra,
    ]


@pytest.fixture(scope="module")
def first_run(workdir, refused):
    """(What `python main.py` gave, its run directory) for a 2-epoch run: it runs first in the
    process of the commands that follow it (see refused)."""
    proc, _ = refused["first"]
    assert proc.returncode == 0, proc.stderr
    return proc, run_dir_of(workdir, args(workdir))


def records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def without_timing(events: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in MACHINE_KEYS} for e in events]


def documented_keys() -> dict[str, set[str]]:
    """The keys that docs/run-directory.md's Metrics give every event and train and eval events,
    outside parentheses (where `muon_lr`, a Muon run's, is)."""
    text = (REPO / "docs" / "run-directory.md").read_text(encoding="utf-8")
    text = text.split("\n## Metrics\n")[1].split(". The eval `loss`")[0]
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    every, rest = text.split("Train events add")
    train, evals = rest.split("Eval events add")
    keys = {part: set(re.findall(r"`(\w+)`", part)) for part in (every, train, evals)}
    return {"train": keys[every] | keys[train], "eval": keys[every] | keys[evals]}


def test_run_writes_metrics(first_run):
    proc, run_dir = first_run
    events = records(run_dir)
    for split, keys in documented_keys().items():
        assert {key for e in events if e["split"] == split for key in e} == keys, split
    assert all({"step", "epoch", "split", "loss"} <= e.keys() for e in events)
    train = [e for e in events if e["split"] == "train"]
    evals = [e for e in events if e["split"] == "eval"]
    assert len(train) + len(evals) == len(events)
    assert [e["step"] for e in train] == [*range(5, 2 * STEPS_PER_EPOCH, 5), 2 * STEPS_PER_EPOCH]
    assert all(e["tokens_per_s"] > 0 and e["lr"] > 0 and e["grad_norm"] > 0 for e in train)
    # The tiny model's steps are too small for MFU to
    # mean anything; its peak memory is the process's.
    assert all(e["mfu"] is None and e["peak_mem_mib"] > 0 for e in train)
    # eval_every=0: at the end of each epoch, and always at the end of the run.
    assert [(e["step"], e["epoch"]) for e in evals] == [
        (STEPS_PER_EPOCH, 1),
        (2 * STEPS_PER_EPOCH, 2),
    ]
    assert all(math.isfinite(e["loss"]) for e in events)
    assert evals[-1]["loss"] < train[0]["loss"]  # it learned something
    assert (run_dir / "train.log").read_text().count("eval step") == 2
    assert (run_dir / ".hydra" / "config.yaml").exists()


def test_run_writes_tensorboard_events(first_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = first_run
    files = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = acc.Tags()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= set(
        tags["scalars"]
    )
    assert [s.step for s in acc.Scalars("eval/loss")] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    # a text sample at each evaluation
    assert any(tag.startswith("sample") for tag in tags["tensors"])


def test_run_writes_a_loadable_snapshot_and_prints_a_sample(first_run, workdir):
    proc, run_dir = first_run
    state = read_snapshot(run_dir / "snapshots")
    assert {
        "model_state",
        "optimizer_state",
        "epoch",
        "gpt_config",
        "optimizer_config",
        "data_config",
        "trainer_config",
        "vocab",
    } <= state.keys()
    assert state["epoch"] == 2
    text = (workdir / "corpus.txt").read_text(encoding="utf-8")
    assert state["vocab"] == "".join(sorted(set(text)))
    g = state["gpt_config"]
    assert (g["n_layer"], g["n_head"], g["n_embd"], g["vocab_size"], g["block_size"]) == (
        2,
        2,
        32,
        len(set(text)),
        16,
    )
    GPT(GPTConfig(**g)).load_state_dict(state["model_state"])  # strict: every weight, right shapes
    assert state["trainer_config"]["max_epochs"] == 2
    assert state["data_config"]["path"] == str(workdir / "corpus.txt")

    assert f"--- sample after step {2 * STEPS_PER_EPOCH} ---" in proc.stdout
    assert len(proc.stdout.split("---\n", 1)[1]) >= 20
    assert "Traceback" not in proc.stderr


def test_identical_invocation_finds_the_finished_run(first_run, refused):
    _, run_dir = first_run
    before, snapshot = refused["first run's record"]
    proc, _ = refused["identical"]
    assert proc.returncode == 0, proc.stderr
    assert f"already complete at step {2 * STEPS_PER_EPOCH}" in proc.stderr
    # the sample of the run's end, computed and printed again, was noise
    assert proc.stdout == "" and "sample from the best: " in proc.stderr.splitlines()[-1]
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert tree_bytes(run_dir / "snapshots") == snapshot


# Copies a directory, between two commands of one run_each process.
def longer(workdir: Path, copy: Path) -> list[str]:
    return args(workdir, "trainer_config.max_epochs=3", f"hydra.run.dir={copy}")


def test_a_longer_run_continues_from_the_snapshot_in_a_given_run_dir(first_run, workdir, refused):
    """The continue-with-changes path of docs/fault-tolerance.md: the run's directory, the new
    values and trainer_config.allow_config_change=true."""
    _, run_dir = first_run
    refused, copy = refused["longer"]  # without the flag: one line naming the change
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: snapshot "
    )
    assert (
        "(trainer_config.max_epochs: 2 -> 3)" in refused.stderr
        and "allow_config_change=true" in refused.stderr
    )
    proc = run_main([*longer(workdir, copy), "trainer_config.allow_config_change=true"], workdir)
    assert proc.returncode == 0, proc.stderr
    assert f"run directory {copy}" in proc.stderr  # hydra.run.dir is respected
    assert "continuing" in proc.stderr and "trainer_config.max_epochs: 2 -> 3" in proc.stderr
    new = records(copy)[len(records(run_dir)) :]
    assert new and new[0]["step"] > 2 * STEPS_PER_EPOCH  # no step of the first two epochs repeated
    assert new[-1] == {**new[-1], "split": "eval", "step": 3 * STEPS_PER_EPOCH, "epoch": 3}
    assert read_snapshot(copy / "snapshots")["epoch"] == 3


def sweep_args(workdir: Path, second_lr: str) -> list[str]:
    """A multirun over the default learning rate and `second_lr`."""
    default_lr = OptimizerConfig().learning_rate
    rates = f"optimizer_config.learning_rate={default_lr},{second_lr}"
    return ["-m", *args(workdir, "trainer_config.run_name=sweep", rates)]


@pytest.fixture(scope="module")
def sweep(workdir) -> subprocess.CompletedProcess:
    """The multirun over the default learning rate and 3e-4."""
    return run_main(sweep_args(workdir, "3e-4"), workdir)


def sweep_jobs(workdir: Path) -> list[Path]:
    return sorted(path for path in (workdir / "runs" / "sweep-multirun").iterdir() if path.is_dir())


def test_multirun_puts_each_job_in_its_own_directory_and_the_same_seed_repeats(
    first_run, workdir, sweep, refused
):
    _, run_dir = first_run
    default_lr = OptimizerConfig().learning_rate
    proc = sweep
    assert proc.returncode == 0, proc.stderr
    jobs = sweep_jobs(workdir)
    assert [job.name for job in jobs] == ["0", "1"], jobs
    for job_dir, lr in zip(jobs, (default_lr, 3e-4), strict=True):
        assert (
            f"optimizer_config.learning_rate={lr:g}"
            in (job_dir / ".hydra" / "overrides.yaml").read_text()
        )
        first = records(job_dir)[0]
        # warmup of 100 steps
        assert first["step"] == 5 and first["lr"] == pytest.approx(lr * 5 / 100)
        assert read_snapshot(job_dir / "snapshots")["optimizer_config"]["learning_rate"] == lr
    # Job 0 has the first run's config (the default rate):
    # another process, the same seed, the same run.
    assert without_timing(records(jobs[0])) == without_timing(records(run_dir))
    assert without_timing(records(jobs[1])) != without_timing(records(run_dir))

    # The sweep again with a new second value: job 0 finds its run complete, job 1 (its
    # directory holds the old value's run) is refused naming the change, and is left as it was.
    # (the sweep again ran in the refusals' process: it ends at start)
    again, old = refused["sweep again"]
    assert again.returncode == 2, again.stderr
    assert again.stderr.count("run already complete") == 1
    assert again.stderr.rstrip().splitlines()[-1].startswith("error: snapshot "), again.stderr
    assert "(optimizer_config.learning_rate: 0.0003 -> 0.001)" in again.stderr
    assert {path: path.read_bytes() for path in jobs[1].rglob("*") if path.is_file()} == old
    assert sorted(path for path in jobs[0].parent.iterdir() if path.is_dir()) == jobs


BAD_OVERRIDES = {  # id: (override, what the one line names)
    "unknown-key": ("trainer_config.epochs=3", "trainer_config.epochs"),
    "bad-value": ("trainer_config.batch_size=0", "trainer_config.batch_size"),
    "key-without-section": (
        "max_epochs=3",
        "unknown key max_epochs (did you mean trainer_config.max_epochs? see --help)",
    ),
    "unknown-preset": ("gpt_config=gpt-huge", "gpt_config/gpt-huge"),
    # Hydra's `+` adds keys past OmegaConf
    "added-key": ("+trainer_config.max_epoch=5", "trainer_config.max_epoch"),
    "powersgd-start": (
        "trainer_config.powersgd_start_step=1",
        "trainer_config.powersgd_start_step",
    ),
    "empty-run-dir": ("hydra.run.dir=", "hydra.run.dir: must not be empty"),
    # an unquoted value with a space: its second word is an override of its own
    "no-equals": ("gpt_config.n_layer", "'gpt_config.n_layer': expected key=value"),
    # Hydra's default for a config file of the user's that names no run directory: never resumed
    "clock-run-dir": (
        "hydra.run.dir=outputs/${now:%H-%M-%S}",
        "hydra.run.dir: outputs/${now:%H-%M-%S} is named by the clock",
    ),
    # relative paths would then mean another directory
    "chdir": ("hydra.job.chdir=true", "hydra.job.chdir: true moves each process"),
    # both end with the process: nothing to resume, nothing tracked
    "memory-snapshots": (
        "trainer_config.snapshot_path=memory://snaps",
        "trainer_config.snapshot_path: memory:// ends with the command",
    ),
    # pruning would delete the snapshots of the run whose path the pattern matches (s3://b/x1/...)
    "glob-in-url": (
        "trainer_config.snapshot_path='s3://bucket/x[1]'",
        "trainer_config.snapshot_path: s3://bucket/x[1]: an object store reads [, * and ? as a",
    ),
    "sqlite-in-memory": (
        "trainer_config.tracker_uri=sqlite:///",
        "trainer_config.tracker_uri: sqlite:/// names no database file",
    ),
    "run-name-dotdot": ("trainer_config.run_name=..", "trainer_config.run_name"),
    "run-dir-not-creatable": (
        "hydra.run.dir=/proc/nope/run",
        "cannot create the run directory: /proc/nope",
    ),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory, workdir, sweep) -> dict[str, tuple]:
    """{id: (what `python main.py OVERRIDE` gave, the directory it ran in)} for each bad override,
    and for a missing corpus; "first": (the first run, the work directory); "identical": (the
    first run's command again, the work directory); "longer": (the longer run's command without
    allow_config_change, the copy of the first run it names); "first run's record": (its
    metrics.jsonl, its snapshots' bytes) before these; "sweep again": (the sweep with a new second
    value, {path: bytes} of its job 1's files before). One process for all, the first run first,
    then python -c copies of its directory (each run is mostly importing torch, and the others
    end at start)."""
    run_dir = run_dir_of(workdir, args(workdir))
    jobs = sweep_jobs(workdir) if sweep.returncode == 0 else []  # else its test fails
    job1 = (
        {path: path.read_bytes() for path in jobs[-1].rglob("*") if path.is_file()} if jobs else {}
    )
    record = tmp_path_factory.mktemp("record") / "run"
    copy = tmp_path_factory.mktemp("continued") / "run"
    copies = {"record": (workdir, [COPY, str(run_dir), str(record)], "-c")}
    copies["copy"] = (workdir, [COPY, str(run_dir), str(copy)], "-c")
    cases = {name: [override] for name, (override, _) in BAD_OVERRIDES.items()}
    cases["missing-data-file"] = ["data_config.path=no/such/corpus.txt"]
    cwds = {name: tmp_path_factory.mktemp(name) for name in cases}
    cases["identical"], cwds["identical"] = args(workdir), workdir
    cases["longer"], cwds["longer"] = longer(workdir, copy), workdir
    cases["sweep again"], cwds["sweep again"] = sweep_args(workdir, "1e-3"), workdir
    commands = [(workdir, on_cpu(args(workdir))), *copies.values()]
    commands += [(cwds[name], on_cpu(argv)) for name, argv in cases.items()]
    first, *results = run_each("mingpt.cli", commands)
    for made in results[: len(copies)]:
        assert made.returncode == 0, made.stderr[-3000:]
    results = results[len(copies) :]
    given = {name: (result, cwds[name]) for name, result in zip(cases, results, strict=True)}
    given["first"] = (first, workdir)
    given["longer"] = (given["longer"][0], copy)
    given["sweep again"] = (given["sweep again"][0], job1)
    before = ((record / "metrics.jsonl").read_text(), tree_bytes(record / "snapshots"))
    return {**given, "first run's record": before}


@pytest.mark.parametrize("name", BAD_OVERRIDES)
def test_bad_override_is_one_line(refused, name):
    proc, cwd = refused[name]
    says = BAD_OVERRIDES[name][1]
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert not list(cwd.rglob("snapshots"))
    # nothing in the current directory
    assert [p.name for p in cwd.iterdir() if p.name != "runs"] == []


def test_missing_data_file_is_one_line(refused):
    proc, _ = refused["missing-data-file"]
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " INFO " not in line]
    assert errors == ["error: data file not found: no/such/corpus.txt"], proc.stderr


def test_ctrl_c_is_one_line_and_status_130(tmp_path, corpus):
    """Ctrl-C while training: a snapshot at the step reached, one line, status 130. The stop was
    asked for: the line is no `error:`, and torchrun's error file gets it too. Deadlines are
    generous (a loaded machine); the waits end on events."""
    (tmp_path / "corpus.txt").write_text(
        corpus.read_text(encoding="utf-8")[:50_000], encoding="utf-8"
    )
    cmd = [sys.executable, str(REPO / "main.py"), *args(tmp_path, "trainer_config.max_epochs=1000")]
    with open(tmp_path / "stderr.txt", "w") as err:  # a file: a full pipe cannot stall the run
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env={**child_env(), "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        run_dir = run_dir_of(tmp_path, cmd[2:])
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.stat().st_size):  # wait until it trains
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "stderr.txt"
            ).read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 130, stderr
    last = stderr.rstrip().splitlines()[-1]
    assert "Traceback" not in stderr and last.startswith("interrupted at step "), stderr
    assert "error:" not in stderr
    step = int(last.split("at step ")[1].split(";")[0])
    assert read_snapshot(run_dir / "snapshots")["step"] == step
    told = json.loads((tmp_path / "error.json").read_text())["message"]
    assert told["message"] == told["extraInfo"]["py_callstack"] == last


def test_python_m_mingpt_cli_is_the_training_command(monkeypatch, capsys):
    """`python -m mingpt.cli` ran nothing and exited 0: it is mingpt-train."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["mingpt.cli", "--no-such-option"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("mingpt.cli", run_name="__main__")
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: unrecognized arguments: --no-such-option")
