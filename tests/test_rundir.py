"""The run directory end to end: one owner, refusals that leave no trace, another name its own
run; paths in suggested commands that paste back."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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
    run_main,
    run_torchrun,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus) -> Path:
    cwd = tmp_path_factory.mktemp("rundir")
    (cwd / "corpus.txt").write_text(corpus.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return cwd


def args(*extra: str) -> list[str]:
    return [*TINY, "data_config.path=corpus.txt", "trainer_config.sample_chars=0", *extra]


def steps(run_dir: Path, split: str) -> list[int]:
    """The steps of `split` events in metrics.jsonl; a last line still being written is left out."""
    text = (run_dir / "metrics.jsonl").read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [r["step"] for r in map(json.loads, lines) if r["split"] == split]


def wait_for(predicate, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_DEADLINE
    while not predicate():
        assert proc.poll() is None, f"the job ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {RUN_DEADLINE} s"
        time.sleep(0.1)


def contains(path: Path, text: str):
    return lambda: path.exists() and text in path.read_text()


def launch(cwd: Path, argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as stderr:  # a file, not a pipe: a full pipe would stall the job
        return subprocess.Popen(
            [sys.executable, str(REPO / "main.py"), *argv],
            cwd=cwd,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


@contextlib.contextmanager
def paused(job: subprocess.Popen):
    """The job stopped (SIGSTOP), as a job suspended in its terminal: it still holds what it
    locked, and leaves the cores to the commands run meanwhile; continued afterwards."""
    os.kill(job.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(job.pid, signal.SIGCONT)


def test_one_job_per_run_directory_and_a_killed_holder_does_not_block(workdir):
    """Job A trains; the same command again (one process, then two under
    torchrun) is refused with one line naming A, and A goes on undisturbed.
    A is SIGKILLed: the next job takes the directory over and resumes A's snapshot."""
    argv = args("trainer_config.max_epochs=1000")
    run_dir = run_dir_of(workdir, argv)
    first = launch(workdir, argv, workdir / "a.err")
    try:
        # published, not only saved: a background write paused with A, then A killed as soon as
        # it went on, left nothing for the third job to resume
        published = f"published sharded snapshot {run_dir / 'snapshots'}/step-"
        wait_for(contains(run_dir / "train.log", published), "first snapshot", first)
        holder = f"is in use by pid {first.pid} on host {socket.gethostname()} since "
        with paused(first):
            second = run_main(argv, workdir)
            pair = run_torchrun(2, argv, workdir)
        assert second.returncode == 2, second.stderr
        assert second.stderr.splitlines()[-1].startswith(
            f"error: run directory {run_dir} {holder}"
        ), second.stderr
        assert "Traceback" not in second.stderr
        errors = [
            line for line in pair.stderr.splitlines() if re.match(r"(\[rank \d+\] )?error: ", line)
        ]
        # every rank stops, with the line; rank 1's is headed by its rank, as its log lines
        assert pair.returncode != 0 and len(errors) == 2, pair.stderr[-3000:]
        assert sorted(line.startswith("[rank 1] error: ") for line in errors) == [False, True]
        assert all(holder in line for line in errors)
        assert first.poll() is None  # A never noticed
        before = steps(run_dir, "train")[-1]
        wait_for(lambda: steps(run_dir, "train")[-1] > before, "progress after the refusals", first)
    finally:
        first.kill()
        first.wait()
    train, evals = steps(run_dir, "train"), steps(run_dir, "eval")
    # strictly increasing: one writer
    assert train == sorted(set(train)) and evals == sorted(set(evals))

    third = launch(workdir, argv, workdir / "c.err")
    try:
        wait_for(contains(workdir / "c.err", "resumed from"), "resume", third)
        resumed = int(
            (workdir / "c.err")
            .read_text()
            .split("resumed from", 1)[1]
            .split("step ", 1)[1]
            .split()[0]
        )
        assert resumed > 0
        wait_for(lambda: steps(run_dir, "train")[-1] > resumed, "training after the resume", third)
    finally:
        third.kill()
        third.wait()
    train = steps(run_dir, "train")
    assert train == sorted(set(train))


@pytest.fixture(scope="module")
def finished_run(workdir) -> Path:
    argv = args("trainer_config.max_epochs=1", "trainer_config.run_name=done")
    proc = run_main(argv, workdir)
    assert proc.returncode == 0, proc.stderr
    return run_dir_of(workdir, argv)


def contents(run_dir: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file()
    }


# Refused invocations on the finished run: {name: (overrides, what the one error line says)}.
def refusals_of(workdir: Path, finished_run: Path) -> dict[str, tuple[list[str], str]]:
    last_snapshot = sorted((finished_run / "snapshots").glob("step-*"))[-1]
    return {
        "bad value": (
            ["trainer_config.batch_size=0"],
            "error: trainer_config.batch_size: must be >= 1",
        ),
        "bad corpus": (["data_config.path=missing.txt"], "error: data file not found: missing.txt"),
        "changed config": (
            ["trainer_config.max_epochs=2", "optimizer_config.learning_rate=1e-3"],
            "(optimizer_config.learning_rate: 0.003 -> 0.001; trainer_config.max_epochs: 1 -> 2): "
            "start a new run with trainer_config.run_name=NAME (a name not used yet), continue "
            "that run with its own values (optimizer_config.learning_rate=0.003 "
            "trainer_config.max_epochs=1), or with the new ones (add "
            "trainer_config.allow_config_change=true)",
        ),
        "other shape": (["gpt_config.n_layer=3"], "another config (gpt_config.n_layer: 2 -> 3)"),
        "in use": ([], f"error: run directory {finished_run} is in use by another job"),
        # Operational keys that would start another snapshot
        # from step 0 under the finished run's record.
        "other snapshot": (
            [f"trainer_config.snapshot_path={workdir / 'elsewhere.pt'}"],
            f"error: run directory {finished_run} holds the record of a run up to step",
        ),
        # The run started afresh, its step directories among the finished run's files.
        "another run's directory": (
            [
                f"hydra.run.dir={workdir / 'runs' / 'mixed'}",
                f"trainer_config.snapshot_path={finished_run}",
            ],
            f"error: trainer_config.snapshot_path: {finished_run} is another run's directory",
        ),
        # One of its snapshots, named instead of their root: the run started afresh inside it.
        "one snapshot": (
            [
                f"hydra.run.dir={workdir / 'runs' / 'inside'}",
                f"trainer_config.snapshot_path={last_snapshot}",
            ],
            f"error: trainer_config.snapshot_path: {last_snapshot} is one snapshot, not a snapshot "
            f"root: to continue its run, give that run's root ({finished_run / 'snapshots'} holds "
            "this one)",
        ),
    }


# Refused before they take the directory: while another job holds it.
EARLY = ("bad value", "bad corpus", "in use")

# The README's first example of other settings: other values under a name of their own.
OTHER_RUN = (
    "trainer_config.max_epochs=1",
    "trainer_config.run_name=other",
    "optimizer_config.learning_rate=1e-3",
    "trainer_config.max_steps=5",
)

REFUSED_CORPORA = {  # id: (a corpus of this text, else the work directory's; overrides; the line)
    "tiny-corpus": ("x" * 53 + "\n", [], "the held-out split has 6 characters"),
    "truncated": (None, ["data_config.truncate=0.00001"], "the training split has 0 characters"),
    "huge-block": (
        None,
        ["data_config.block_size=100000"],
        "fewer than data_config.block_size + 1",
    ),
    "missing-file": (None, ["data_config.path=missing.txt"], "data file not found: missing.txt"),
    # the sweep's directory goes too, with the multirun.yaml Hydra wrote
    "missing-file-sweep": (
        None,
        ["data_config.path=missing.txt", "trainer_config.seed=1,2", "-m"],
        "data file not found: missing.txt",
    ),
}


@pytest.fixture(scope="module")
def commands(workdir, finished_run, tmp_path_factory) -> dict:
    """What the quick commands of this module gave, in two processes (each run is mostly importing
    torch). While this process holds the finished run's lock, as a job would: the refusals of
    EARLY on it; and, each in a directory of its own, each refused corpus, and (id "snapshot in
    use") a run whose snapshot, outside its run directory, this process holds too. Then, the lock
    let go, the other refusals on the finished run (each letting it go for the next), and
    OTHER_RUN. {"refused": {name: its process}, "corpora": {id: (its directory, its process)},
    "other": its process, "before": the finished run's files before any of them}."""
    before = contents(finished_run)
    same_dir = ["trainer_config.run_name=done", f"hydra.run.dir={finished_run}"]
    refusals = refusals_of(workdir, finished_run)

    def refusal(name: str) -> tuple[Path, list[str]]:
        return workdir, args("trainer_config.max_epochs=1", *same_dir, *refusals[name][0])

    corpora = {}
    # Two run directories, one local snapshot path: this process holds the snapshot's lock as the
    # first job would.
    cwd = tmp_path_factory.mktemp("snapshot-in-use")
    snapshot = cwd / "shared.pt"
    argv = args(
        f"data_config.path={workdir / 'corpus.txt'}",
        f"trainer_config.snapshot_path={snapshot}",
        f"hydra.run.dir={cwd / 'b'}",
    )
    corpora["snapshot in use"] = (cwd, on_cpu(argv))
    for name, (text, extra, _) in REFUSED_CORPORA.items():
        cwd = tmp_path_factory.mktemp(name)
        path = workdir / "corpus.txt"
        if text is not None:
            path = cwd / "tiny.txt"
            path.write_text(text, encoding="utf-8")
        argv = [*args(f"data_config.path={path}", "trainer_config.run_name=refused"), *extra]
        corpora[name] = (cwd, on_cpu(argv))
    locks = [os.open(finished_run / "run.lock", os.O_RDWR)]
    locks.append(os.open(f"{snapshot}.lock", os.O_RDWR | os.O_CREAT))
    try:
        for lock in locks:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        results = run_each("mingpt.cli", [*map(refusal, EARLY), *corpora.values()])
    finally:
        for lock in locks:
            os.close(lock)
    late = [name for name in refusals if name not in EARLY]
    results += run_each("mingpt.cli", [*map(refusal, late), (workdir, args(*OTHER_RUN))])
    names = [*EARLY, *corpora, *late, "other"]
    given = dict(zip(names, results, strict=True))
    return {
        "refused": {name: given[name] for name in refusals},
        "corpora": {name: (corpora[name][0], given[name]) for name in corpora},
        "other": given["other"],
        "before": before,
    }


def test_refused_invocations_leave_every_file_byte_identical(workdir, finished_run, commands):
    before = commands["before"]
    assert {"train.log", "metrics.jsonl", "run.lock", ".hydra/config.yaml"} <= before.keys()
    assert any(name.startswith("snapshots/step-") for name in before)
    for name, (_, says) in refusals_of(workdir, finished_run).items():
        stderr = commands["refused"][name].stderr
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert commands["refused"][name].returncode == 2 and len(errors) == 1, (name, stderr)
        assert says in errors[0], (name, stderr)
    assert contents(finished_run) == before


def test_another_command_starts_its_own_run(workdir, finished_run, commands):
    """The README's first example of other settings: other values under a name
    of their own, its own run from step 0; the first run stays as it was (the
    same name with other values is refused: test above)."""
    proc = commands["other"]
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" not in proc.stderr and "already complete" not in proc.stderr
    assert run_dir_of(workdir, args(*OTHER_RUN)) == workdir / "runs" / "other"
    assert steps(workdir / "runs" / "other", "train") == [5]
    assert contents(finished_run) == commands["before"]


def test_a_snapshot_kept_outside_the_run_directory_is_claimed_too(commands):
    """Two run directories, one local snapshot path: the second job is refused."""
    cwd, proc = commands["corpora"]["snapshot in use"]
    snapshot = cwd / "shared.pt"
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith(f"error: snapshot {snapshot} is in use by"), (
        proc.stderr
    )
    assert not snapshot.exists()
    assert not (cwd / "b").exists()  # the run directory it made, with its lock file


@pytest.mark.parametrize("name", REFUSED_CORPORA)
def test_a_refused_corpus_leaves_no_run_directory(commands, name):
    """Refused once the run directory was made and locked (a missing file: before the lock): the
    lock file and the directory go."""
    cwd, proc = commands["corpora"][name]
    says = REFUSED_CORPORA[name][2]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and says in errors[0], proc.stderr
    # nor the runs/ Hydra made for it
    assert not (cwd / "runs").exists(), list((cwd / "runs").rglob("*"))


@pytest.mark.parametrize("name", ["metrics.jsonl", "train.log", "tb"])
def test_a_record_file_of_the_wrong_kind_is_one_line(tmp_path, name):
    from mingpt.distributed import DistInfo
    from mingpt.rundir import RunDirError, claim

    path = tmp_path / name
    path.mkdir() if name != "tb" else path.write_text("")
    kind = "a directory" if name == "tb" else "a file"
    with (
        pytest.raises(
            RunDirError, match=f"^run directory {tmp_path}: {path} must be {kind}; move it away$"
        ),
        claim(
            str(tmp_path),
            str(tmp_path / "snapshot.pt"),
            0,
            DistInfo(0, 0, 1, 1, torch.device("cpu")),
            None,
        ),
    ):
        pass


def test_a_killed_attempt_of_the_same_run_is_cut_back_and_bad_lines_are_dropped(tmp_path):
    """The record of an attempt killed after the snapshot it resumes from: the
    same snapshot, so its later events go (a non-UTF-8 or cut line with them, and lines a hand
    edit left without an integer step or a split, which stopped the resume with a traceback)."""
    from mingpt.distributed import DistInfo
    from mingpt.metrics import Metrics
    from mingpt.rundir import LOCK_FILE, claim

    (tmp_path / LOCK_FILE).write_text(json.dumps({"snapshot": str(tmp_path / "snapshot.pt")}))
    lines = [
        b'{"step": 5, "epoch": 0, "split": "train"}\n',
        b"\xff\xfe not UTF-8\n",
        b'{"step": "3", "epoch": 0, "split": "train"}\n',
        b'{"step": 4, "epoch": 0}\n',
        b"[4]\n",
        b'{"step": 9, "epoch": 0, "split": "train"}\n',
        b'{"step": 10, "epo',
    ]
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(lines))
    cpu = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    with claim(str(tmp_path), str(tmp_path / "snapshot.pt"), 5, cpu, None):
        pass
    Metrics(str(tmp_path), True, resume_step=5).close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == lines[0]


def python_child(code: str, directory) -> subprocess.CompletedProcess:
    """`code` run by a new Python with the directory as sys.argv[1]: a file-size limit it sets stays
    its own."""
    return subprocess.run(
        [sys.executable, "-c", code, str(directory)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )


def test_the_cut_back_never_writes_the_kept_events_anew(tmp_path):
    """Written anew, the kept events were gone from the file until the write ended: here a
    file-size limit below their size stops it (as a kill, or a full disk, would), and the run's
    record was lost."""
    note = "x" * 200
    lines = [
        json.dumps({"step": i, "epoch": 0, "split": "train", "note": note}) + "\n" for i in range(9)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    code = (
        "import resource, sys; from mingpt.metrics import Metrics; "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512)); "
        "Metrics(sys.argv[1], True, resume_step=5).close()"
    )
    result = python_child(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:6])


def test_a_line_cut_short_by_a_file_size_limit_is_taken_back(tmp_path):
    """The limit falls inside an event's line: the storage takes its head, then refuses the rest.
    The buffered file's truncate flushed first, failed again, and the head stayed, a cut line at
    the end of the record of a run that trained on; the file now ends with the last whole line."""
    code = "\n".join(
        [
            "import resource, sys",
            "from mingpt.metrics import Metrics",
            "metrics = Metrics(sys.argv[1], True)",
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))",
            "for step in range(1, 9):",
            "    metrics.log('train', step, 0, tag='x' * 300)",
            "metrics.close()",
        ]
    )
    result = python_child(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("cannot write the metrics in") == 1, result.stderr
    lines = [
        json.dumps({"step": step, "epoch": 0, "split": "train", "tag": "x" * 300}) + "\n"
        for step in (1, 2)
    ]
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines)


def test_a_copied_run_directory_continues_its_run_where_it_is(tmp_path, workdir, finished_run):
    """A copy of a run directory (or one moved) whose last attempt was killed after its snapshot:
    its own snapshots, so the attempt's later events go, as they would where the run was."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    step = read_snapshot(copy / "snapshots")["step"]
    with open(copy / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step + 1, "epoch": 1, "split": "train", "loss": 1.0}) + "\n")
    argv = args("trainer_config.max_epochs=1", "trainer_config.run_name=done")
    proc = run_main([*argv, f"hydra.run.dir={copy}"], workdir)
    assert proc.returncode == 0 and "run already complete" in proc.stderr, proc.stderr
    assert steps(copy, "train")[-1] == step


def test_a_full_run_directory_costs_a_warning_not_the_run(tmp_path, workdir, small_disk):
    """The run directory's file system fills up mid-run: one warning each for
    the metrics and train.log, no traceback, no cut line; the run trains to the
    end and saves its snapshot, kept on another file system."""
    snapshot = tmp_path / "snapshots"
    argv = args(
        "trainer_config.max_steps=60",
        "trainer_config.log_every=1",
        f"hydra.run.dir={small_disk / 'run'}",
        f"trainer_config.snapshot_path={snapshot}",
    )
    # Leave room for the start (config, the first lines), not for the whole run.
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(
            b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - 24 * 1024)
        )
    proc = run_main(argv, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[
        -3000:
    ]
    assert proc.stderr.count("cannot write the metrics in") == 1, proc.stderr[-3000:]
    assert "train step 60 " in proc.stderr  # the log on stderr went on
    text = (small_disk / "run" / "metrics.jsonl").read_bytes()
    assert text.endswith(b"\n") and all(json.loads(line)["step"] < 60 for line in text.splitlines())
    assert read_snapshot(snapshot)["step"] == 60


def test_a_start_on_a_full_disk_leaves_the_runs_config_whole(tmp_path, small_disk):
    """.hydra/config.yaml tells generate, score and export where a run directory's snapshots are,
    and every start of the run writes it again: it is replaced whole. Written in place, a reader
    during a restart found it empty (and looked for the snapshots in the default place), and a start
    that met a full disk left it cut, an error line for every later reader."""
    import logging.handlers

    from mingpt.distributed import DistInfo
    from mingpt.rundir import LOCK_FILE, RunDirError, claim

    run_dir = small_disk / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    config = run_dir / ".hydra" / "config.yaml"
    before = "trainer_config:\n  snapshot_path: /elsewhere/snapshots\n"
    config.write_text(before)
    # the holder's record of an earlier start: rewritten in the pages it has
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "h", "since": "x" * 200}))
    cpu = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    held = logging.handlers.MemoryHandler(capacity=10)
    with claim(str(run_dir), str(tmp_path / "snapshots"), 0, cpu, held) as owned:
        with contextlib.suppress(OSError), open(small_disk / "filler", "wb") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        with pytest.raises(RunDirError, match="No space left on device$"):
            # a config longer than the one it replaces: more pages than its own
            owned.accept({".hydra/config.yaml": before + "#" * 20000 + "\n"})
    assert config.read_text() == before
    assert os.listdir(config.parent) == ["config.yaml"]


def test_a_holders_record_that_cannot_be_written_keeps_the_earlier_one(tmp_path, monkeypatch):
    """The lock file names the snapshot of the run whose record the directory holds: a start whose
    write of its own fails leaves it, so that a run of another snapshot path is still refused. The
    file was cut to nothing first."""
    import logging.handlers

    from mingpt.distributed import DistInfo
    from mingpt.rundir import LOCK_FILE, RunDirError, claim

    earlier = json.dumps({"pid": 1, "host": "h", "snapshot": "/elsewhere/snapshots"})
    (tmp_path / LOCK_FILE).write_text(earlier)
    cpu = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    held = logging.handlers.MemoryHandler(capacity=10)
    with claim(str(tmp_path), str(tmp_path / "snapshots"), 0, cpu, held) as owned:

        def failing(*_):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "pwrite", failing)
        with pytest.raises(RunDirError, match="Input/output error$"):
            owned.accept({})
    assert (tmp_path / LOCK_FILE).read_text() == earlier


# Paths a user may have: Hydra's syntax (= , : spaces quotes [ ] { } ~ ${), the shell's ($ ! * ' "
# ~ a trailing backslash), words Hydra would type (null, 12), and letters past ASCII.
AWKWARD_PATHS = [
    "runs/default",
    "runs/default-learning_rate=0.001,max_epochs=5-1a2b3c4d",
    "/data/my runs/a b",
    "~/runs/x",
    "runs/it's",
    'runs/say "hi"',
    "$HOME/runs/${oc.env:HOME}",
    "runs/a\\${x}",
    "runs/[x]{y}(z):w",
    "runs/back\\slash\\",
    "runs/!*?|@%+",
    "null",
    "12",
    "runs/été",
    " runs/lead and trail ",
]


def test_a_suggested_override_gives_the_path_back_through_bash_and_hydra():
    """Each suggested `key=value`, pasted into bash, is one word; Hydra's own override parser and
    OmegaConf read it as the path (the training command), or the word is the text itself
    (generate, score and export take their paths verbatim)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from mingpt.rundir import shell_override

    parser = OverridesParser.create()
    keys = ["hydra.run.dir", "trainer_config.snapshot_path", "trainer_config.init_from"]
    suggested = [shell_override(key, path) for path in AWKWARD_PATHS for key in keys]
    verbatim = [shell_override("src", path, verbatim=True) for path in AWKWARD_PATHS]
    script = "printf '%s\\0' " + " ".join(suggested + verbatim)
    typed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    words = typed.stdout.split("\0")[:-1]
    assert len(words) == len(suggested) + len(verbatim), words
    for word, (path, key) in zip(
        words, [(path, key) for path in AWKWARD_PATHS for key in keys], strict=False
    ):
        override = parser.parse_override(word)
        assert override.key_or_group == key
        assert OmegaConf.create({"value": override.value()}).value == path, (word, path)
    assert words[len(suggested) :] == [f"src={path}" for path in AWKWARD_PATHS]


def test_the_composed_config_has_the_suggested_path():
    """Through the whole composition, as main.py does it: the run directory and the snapshot
    path."""
    from hydra import compose, initialize_config_dir

    from mingpt.cli import CONF_DIR
    from mingpt.rundir import shell_override

    for path in AWKWARD_PATHS:
        words = [
            shlex.split(shell_override(key, path))[0]
            for key in ("hydra.run.dir", "trainer_config.snapshot_path")
        ]
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("config", overrides=words, return_hydra_config=True)
        assert cfg.hydra.run.dir == path and cfg.trainer_config.snapshot_path == path


def test_an_older_run_directory_is_continued_as_the_docs_say():
    """docs/run-directory.md's command for a directory named by the older scheme puts the run
    there."""
    from hydra import compose, initialize_config_dir

    from mingpt.cli import CONF_DIR

    doc = (REPO / "docs" / "run-directory.md").read_text(encoding="utf-8")
    (line,) = [
        line for line in doc.splitlines() if line.startswith("python main.py 'hydra.run.dir=")
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=shlex.split(line)[2:], return_hydra_config=True)
    assert cfg.hydra.run.dir == "runs/default-learning_rate=0.001,max_epochs=5-1a2b3c4d"


def test_a_refusal_in_a_directory_hydra_run_dir_names_suggests_another_directory(tmp_path, corpus):
    """A run placed by hydra.run.dir (an older run's directory, a config file's `./`) stays there
    whatever its run_name: a refused change of config or corpus suggests another directory, not a
    run_name that would meet the same snapshot and the same refusal again. A sweep's job placed by
    hydra.sweep.dir is told that key: hydra.run.dir does nothing under -m."""
    (tmp_path / "corpus.txt").write_text(corpus.read_text(encoding="utf-8")[:6000], "utf-8")
    argv = args("trainer_config.max_steps=2", f"hydra.run.dir={tmp_path / 'mine'}")
    assert run_main(argv, tmp_path).returncode == 0
    (tmp_path / "corpus.txt").write_text(corpus.read_text(encoding="utf-8")[:6001], "utf-8")
    # the same directory as a sweep's job
    sweep = [f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=mine"]
    cases = [
        args("trainer_config.max_steps=3", f"hydra.run.dir={tmp_path / 'mine'}"),
        argv,  # the same values on a changed corpus
        ["-m", *args("trainer_config.max_steps=3"), *sweep],
    ]
    procs = run_each("mingpt.cli", [(tmp_path, on_cpu(case)) for case in cases])
    for proc, key in zip(procs, ["hydra.run.dir", "hydra.run.dir", "hydra.sweep.dir"], strict=True):
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert f"start a new run with {key}=ANOTHER_DIRECTORY, " in errors[0], errors[0]
        assert "run_name" not in errors[0]


@pytest.fixture(scope="module")
def claimed(tmp_path_factory, corpus) -> dict:
    """Job A trains with its snapshots in runs/a/snapshots; while it holds them, job B-NAMED names
    that root, each way (see the test), one after another in one process: {named: (B's finished
    run, the root it named, its run directory, A's pid, the directory they ran in)}."""
    cwd = tmp_path_factory.mktemp("claimed")
    (cwd / "corpus.txt").write_text(corpus.read_text(encoding="utf-8")[:6000], "utf-8")
    argv = args("trainer_config.max_epochs=1000", "trainer_config.save_every_steps=5")
    run_a = cwd / "runs" / "a"
    alias = cwd / "alias"
    alias.symlink_to(run_a / "snapshots", target_is_directory=True)
    roots = {"relative": "../a/snapshots", "symlink": str(alias)}
    first = launch(cwd, on_cpu([*argv, "trainer_config.run_name=a"]), cwd / "a.err")
    try:
        wait_for(contains(run_a / "train.log", "saved snapshot"), "first snapshot", first)
        named_root = [
            [*argv, f"trainer_config.run_name=b-{named}", f"trainer_config.snapshot_path={root}"]
            for named, root in roots.items()
        ]
        with paused(first):
            finished = run_each("mingpt.cli", [(cwd, on_cpu(case)) for case in named_root])
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
    return {
        named: (proc, roots[named], cwd / "runs" / f"b-{named}", first.pid, cwd)
        for named, proc in zip(roots, finished, strict=True)
    }


@pytest.mark.parametrize("named", ["relative", "symlink"])
def test_a_snapshot_root_of_another_run_is_claimed_by_its_run_too(claimed, named):
    """Job A trains with its snapshots in runs/a/snapshots; job B, in a run directory of its own,
    names that root: as ../a/snapshots (B held no lock A holds, resumed A's snapshot and wrote the
    same step directories as A), or through a symlink (a root moved to a larger disk and linked
    back: B's lock was beside the link). B is refused in one line naming A, before it resumes or
    writes."""
    second, root, run_b, holder, cwd = claimed[named]
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert f"{root} is in use by pid {holder} on host " in errors[0], errors[0]
    assert "resumed from" not in second.stderr
    assert not run_b.exists() and not (cwd / "alias.lock").exists()


def test_a_directory_in_use_or_of_another_record_under_hydra_run_dir_suggests_another_directory(
    tmp_path, corpus
):
    """Under hydra.run.dir another run_name leaves the job in the same directory: a directory in
    use, or holding another snapshot's record, suggests another directory instead (the refusals
    said 'another name' even to a command that gave one)."""
    (tmp_path / "corpus.txt").write_text(corpus.read_text(encoding="utf-8")[:6000], "utf-8")
    mine = tmp_path / "mine"
    argv = args("trainer_config.max_steps=2", f"hydra.run.dir={mine}")
    elsewhere = [*argv, f"trainer_config.snapshot_path={tmp_path / 'elsewhere'}"]
    # the run, then the refusal, in one process
    run, record = run_each("mingpt.cli", [(tmp_path, on_cpu(argv)), (tmp_path, on_cpu(elsewhere))])
    assert run.returncode == 0, run.stderr[-3000:]
    lock = os.open(mine / "run.lock", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a job that holds the directory
        (in_use,) = run_each(
            "mingpt.cli", [(tmp_path, on_cpu([*argv, "trainer_config.run_name=b"]))]
        )
    finally:
        os.close(lock)
    for proc, says in [
        (record, "or start this run with another directory (hydra.run.dir=ANOTHER_DIRECTORY)"),
        (in_use, "or run this one with another directory (hydra.run.dir=ANOTHER_DIRECTORY)"),
    ]:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert errors[0].endswith(says) and "run_name" not in errors[0], errors[0]


# A run_each case's `python -c` code: mingpt.cli's main on the overrides ARGV[2:], ended at once
# (stopping.exit_at_once, as by Ctrl-C) at ARGV[1]: "load", as a job's corpus loads (before its run
# is accepted), or "launch", as a sweep launches its jobs (after Hydra's sweeper wrote its
# multirun.yaml); with os._exit, which would end the process of every case, raising SystemExit.
STOPPED = """
import os, sys
from hydra.core.plugins import Plugins
from mingpt import cli, run, stopping

def stop(*args, **kwargs):
    stopping.exit_at_once(130)

class Launcher:
    launch = stop

real_exit = os._exit
real_load = run.load_data
real_launcher = Plugins.instantiate_launcher
os._exit = sys.exit
if sys.argv.pop(1) == "load":
    run.load_data = stop
else:
    Plugins.instantiate_launcher = lambda *args, **kwargs: Launcher()
try:
    cli.main()
finally:
    os._exit = real_exit
    run.load_data = real_load
    Plugins.instantiate_launcher = real_launcher
"""
FILE_COPY = "import shutil, sys\nshutil.copy(sys.argv[1], sys.argv[2])\n"


@pytest.fixture(scope="module")
def not_accepted(workdir, tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The commands of the two tests below, one after another in one process (each start is mostly
    importing torch), in one directory with python -c copies between them: (that directory,
    {name: its process})."""
    cwd = tmp_path_factory.mktemp("not-accepted")
    sweep = [*TINY, "trainer_config.max_steps=1", "trainer_config.seed=1"]
    corpus = f"data_config.path={workdir / 'corpus.txt'}"
    sweep_dir = cwd / "runs" / "default-multirun"
    other = on_cpu([*sweep, corpus, "gpt_config.n_embd=48,64", "-m"])
    (cwd / "mine").mkdir()
    (cwd / "my-sweep").mkdir()
    cases = {
        "first": (cwd, on_cpu([*sweep, corpus, "-m"])),
        "copied": (cwd, [COPY, str(sweep_dir), str(cwd / "before")], "-c"),
        "refused": (cwd, on_cpu([*sweep, corpus, "gpt_config.n_embd=48", "-m"])),
        "stopped": (cwd, [STOPPED, "load", *other], "-c"),
        "stopped at launch": (cwd, [STOPPED, "launch", *other], "-c"),
        "kept": (cwd, [FILE_COPY, str(sweep_dir / "multirun.yaml"), str(cwd / "kept.yaml")], "-c"),
        # job 0 is the first sweep's, complete; job 1 is refused
        "ran": (cwd, on_cpu([*sweep, f"{corpus},missing.txt", "-m"])),
        # the same sweep, its values in another order: job 0 would find job 1's run
        "reordered": (
            cwd,
            on_cpu([*sweep, f"data_config.path=missing.txt,{workdir / 'corpus.txt'}", "-m"]),
        ),
        "new stopped at launch": (
            cwd,
            [STOPPED, "launch", *on_cpu([*sweep, corpus, "trainer_config.run_name=new", "-m"])],
            "-c",
        ),
        "refused in mine": (
            cwd,
            on_cpu([*TINY, "data_config.path=missing.txt", "hydra.run.dir=mine"]),
        ),
        "stopped in my sweep": (
            cwd,
            [STOPPED, "load", *on_cpu([*sweep, corpus, "hydra.sweep.dir=my-sweep", "-m"])],
            "-c",
        ),
    }
    return cwd, dict(zip(cases, run_each("mingpt.cli", list(cases.values())), strict=True))


def test_a_sweeps_record_is_of_the_sweep_that_ran(workdir, not_accepted):
    """Hydra's sweeper writes a sweep's multirun.yaml before any job is checked. In the directory
    of an earlier sweep, one refused, or stopped at once before its first job is accepted, leaves
    the earlier sweep's record (a stop left the new one's); one whose job 0 ran keeps its own when
    a later job is refused (the earlier sweep's was put back). A new sweep stopped before its jobs
    leaves no directory (it left the one of its multirun.yaml)."""
    cwd, procs = not_accepted
    for name, status in [("first", 0), ("copied", 0), ("refused", 2), ("kept", 0)]:
        assert procs[name].returncode == status, (name, procs[name].stderr[-3000:])
    for name in ("stopped", "stopped at launch", "new stopped at launch"):
        assert procs[name].returncode == 130, (name, procs[name].stderr[-3000:])
    assert "was written with another config" in procs["refused"].stderr, procs["refused"].stderr
    assert (cwd / "kept.yaml").read_bytes() == (cwd / "before" / "multirun.yaml").read_bytes()
    ran = procs["ran"]
    assert ran.returncode == 2 and "run already complete" in ran.stderr, ran.stderr[-3000:]
    assert ran.stderr.splitlines()[-1] == "error: data file not found: missing.txt", ran.stderr
    sweep_dir = cwd / "runs" / "default-multirun"
    corpus = f"data_config.path={workdir / 'corpus.txt'}"
    # refused before Hydra's sweeper wrote its record, or any job ran
    reordered = procs["reordered"]
    assert reordered.returncode == 2 and "INFO" not in reordered.stderr, reordered.stderr[-3000:]
    assert reordered.stderr == (
        "error: job 0 of the sweep (data_config.path=missing.txt) would go to "
        f"runs/default-multirun/0, which holds the run of its job {corpus}: a sweep numbers its "
        "jobs in the order of its keys and values; give them in the order of the sweep that ran "
        "there, or start a new sweep with trainer_config.run_name=NAME (a name not used yet)\n"
    )
    assert f"- {corpus},missing.txt\n" in (sweep_dir / "multirun.yaml").read_text()
    # the directory Hydra made for job 1 is gone
    assert sorted(path.name for path in sweep_dir.iterdir()) == ["0", "multirun.yaml"]
    assert sorted(path.name for path in (cwd / "runs").iterdir()) == ["default-multirun"]


def test_a_directory_the_user_made_stays(not_accepted):
    """hydra.run.dir (hydra.sweep.dir) naming an empty directory the user made: a command refused,
    or stopped at once, before its run is accepted took it back as if Hydra had made it. Only what
    the command made goes: its lock files, a sweep's multirun.yaml and job directory."""
    cwd, procs = not_accepted
    refused = procs["refused in mine"]
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.splitlines()[-1] == "error: data file not found: missing.txt"
    assert procs["stopped in my sweep"].returncode == 130, procs["stopped in my sweep"].stderr
    assert list((cwd / "mine").iterdir()) == [] and list((cwd / "my-sweep").iterdir()) == []
