"""Stop signals, with real processes and real signals: a graceful stop saves at
the step reached and exits 128 + signum, the resumed run ends bitwise where an
uninterrupted one ends (one process and 2 under torchrun); Ctrl-C at any moment
exits promptly with 130 and one line, never hanging, never going on.

Tiny model, 20,000-character corpus: 1,124 training windows of 16 tokens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, RUN_DEADLINE, child_env, free_port, read_snapshot, torchrun_cmd
from test_snapshot import overrides, same_tensors, train_events

# 141 steps per epoch in one process (batch 8), 71 with two; the runs end 10 steps into
# epoch 1 (max_steps, per launch). The uninterrupted references never save by time.
RUN_ARGS = [
    "gpt_config.dropout=0.1",
    "trainer_config.max_epochs=2",
    "trainer_config.log_every=1",
    "trainer_config.save_every_minutes=null",
]
STEPS_PER_EPOCH = {1: 141, 2: 71}
PAST_THE_EPOCH = 10
TORCHRUN_SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1"
DEADLINE = 600  # seconds for all the runs together: generous, for a loaded machine


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus):
    path = tmp_path_factory.mktemp("signals") / "small.txt"
    path.write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def launch(
    cwd, nproc: int, name: str, data, *extra: str, env=None, script=REPO / "main.py"
) -> subprocess.Popen:
    """The run `name` in the background, its stderr
    to cwd/<name>-<n>.err (n: 1, 2, ... per launch)."""
    launcher = (
        [sys.executable] if nproc == 1 else torchrun_cmd(nproc, "--standalone", TORCHRUN_SIGNALS)
    )
    # Pinned to runs/<name>: a resume must find the stopped run whatever its overrides hash to.
    args = overrides(
        f"data_config.path={data}",
        *RUN_ARGS,
        f"trainer_config.run_name={name}",
        f"hydra.run.dir=runs/{name}",
        *extra,
    )
    err = next(
        cwd / f"{name}-{n}.err" for n in range(1, 100) if not (cwd / f"{name}-{n}.err").exists()
    )
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [*launcher, str(script), *args],
            cwd=cwd,
            env={**child_env(), **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    proc.stderr_path = err
    return proc


def train_lines(proc_dir) -> int:
    path = proc_dir / "metrics.jsonl"
    return path.read_text().count('"split": "train"') if path.exists() else 0


PROBE_ARGS = [
    "trainer_config.eval_every=5",
    "trainer_config.save_every_steps=5",
    "trainer_config.max_steps=8",
    "trainer_config.sample_chars=10",
]


class Job:
    """A process and what to do to it, in order: (condition, action) pairs.
    An action may return a new Job (the run resumed)."""

    def __init__(self, proc: subprocess.Popen, steps=()):
        self.proc, self.steps, self.stderr = proc, list(steps), None


def sigterm_jobs(cwd, data, jobs: dict[str, Job]) -> None:
    """SIGTERM mid-epoch to one process and to torchrun with 2 workers, each resumed
    once it has exited, beside their uninterrupted references."""
    sigterm = lambda job: os.kill(job.proc.pid, signal.SIGTERM)  # noqa: E731
    # every 0.12 s: at machine-dependent steps
    time_saves = "trainer_config.save_every_minutes=0.002"
    for nproc, optimizer in ((1, "adamw"), (2, "muon")):  # Muon's state too resumes bitwise
        # into epoch 1: its sampler order and the evaluation at the epoch's end are resumed too
        common = (
            f"optimizer_config.algorithm={optimizer}",
            f"trainer_config.max_steps={STEPS_PER_EPOCH[nproc] + PAST_THE_EPOCH}",
        )
        jobs[f"reference-{nproc}"] = Job(launch(cwd, nproc, f"reference-{nproc}", data, *common))
        run_dir = cwd / "runs" / f"stopped-{nproc}"
        # without the time saves (an operational key): the stopped attempt had them
        resume = lambda job, nproc=nproc, common=common: Job(  # noqa: E731
            launch(cwd, nproc, f"stopped-{nproc}", data, *common)
        )
        jobs[f"stopped-{nproc}"] = Job(
            launch(cwd, nproc, f"stopped-{nproc}", data, time_saves, *common),
            [
                (lambda run_dir=run_dir: train_lines(run_dir) >= 10, sigterm),
                (
                    None,
                    lambda job, nproc=nproc, resume=resume: jobs.setdefault(
                        f"resumed-{nproc}", resume(job)
                    ),
                ),
            ],
        )


def probe_jobs(cwd, data, jobs: dict[str, Job]) -> None:
    """Ctrl-C at each moment of tests/stop_probe.py, and a SIGHUP during an evaluation."""
    sigint = lambda job: os.kill(job.proc.pid, signal.SIGINT)  # noqa: E731
    for moment in ("import", "init", "load", "eval", "save", "sample", "save-hang", "generating"):
        marker = cwd / f"at-{moment}"
        env = {"STOP_PROBE": moment, "STOP_PROBE_FILE": str(marker)}
        if moment == "init":  # rank 0 of 2, alone: it waits for rank 1 in C++ code
            env.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        args = PROBE_ARGS
        # a sample that takes a minute or more: the signal comes during it
        if moment == "generating":
            args = [a for a in PROBE_ARGS if "sample_chars" not in a] + [
                "trainer_config.sample_chars=300000"
            ]
        proc = launch(cwd, 1, moment, data, *args, env=env, script=REPO / "tests" / "stop_probe.py")
        steps = [(marker.exists, sigint)]
        if moment == "save-hang":
            steps.append((Path(f"{marker}.stopping").exists, sigint))
        jobs[moment] = Job(proc, steps)
    # An ssh session that goes away sends SIGHUP: a stop like SIGTERM's, at the evaluation
    # of step 5.
    marker = cwd / "at-hangup"
    proc = launch(
        cwd,
        1,
        "hangup",
        data,
        *PROBE_ARGS,
        env={"STOP_PROBE": "eval", "STOP_PROBE_FILE": str(marker)},
        script=REPO / "tests" / "stop_probe.py",
    )
    jobs["hangup"] = Job(proc, [(marker.exists, lambda job: os.kill(job.proc.pid, signal.SIGHUP))])


def advance(name: str, job: Job) -> None:
    """Keeps the job's stderr once it has exited, and takes its next step once the step's
    condition holds (None: once the process has exited)."""
    if job.stderr is None and job.proc.poll() is not None:
        job.stderr = job.proc.stderr_path.read_text()
    if job.steps:
        condition, action = job.steps[0]
        if condition is None and job.stderr is not None or condition is not None and condition():
            job.steps.pop(0)
            action(job)
        elif job.stderr is not None and condition is not None:
            pytest.fail(f"{name} ended before it was signalled: {job.stderr[-3000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """Every run of this module at once, on a loaded machine: SIGTERM mid-epoch to
    one process and to torchrun with 2 workers, each resumed afterwards, beside
    their uninterrupted references; Ctrl-C at each moment of tests/stop_probe.py, and a
    SIGHUP during an evaluation.
    {name: (status, stderr, run directory)}."""
    cwd = tmp_path_factory.mktemp("runs")
    jobs: dict[str, Job] = {}
    sigterm_jobs(cwd, data, jobs)
    probe_jobs(cwd, data, jobs)
    deadline = time.monotonic() + DEADLINE
    try:
        while any(job.steps or job.stderr is None for job in list(jobs.values())):
            assert time.monotonic() < deadline, {name: job.steps for name, job in jobs.items()}
            for name, job in list(jobs.items()):
                advance(name, job)
            time.sleep(0.02)
    finally:
        for job in jobs.values():
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
    return {
        name: (job.proc.returncode, job.stderr, cwd / "runs" / name.replace("resumed", "stopped"))
        for name, job in jobs.items()
    }


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "torchrun-2"])
def test_sigterm_saves_at_the_step_reached_and_the_resumed_run_is_bitwise_identical(runs, nproc):
    steps_per_epoch = STEPS_PER_EPOCH[nproc]
    status, stderr, run_dir = runs[f"stopped-{nproc}"]
    # One process exits 143; torchrun forwards the signal to its workers, which save and exit 143
    # each, then ends with its own SignalException traceback and status 1, or, once under load,
    # aborted by a thread of torch's own in its exit (SIGABRT, after the workers had saved).
    expected = {1, -signal.SIGABRT}
    if nproc == 1:
        expected = {143}
    assert status in expected, stderr[-3000:]
    assert stderr.count("Traceback") == nproc - 1, stderr[-3000:]
    stop_line = next(line for line in stderr.splitlines() if line.startswith("stopped by "))
    step = int(stop_line.split("at step ")[1].split(";")[0])
    # said once, by rank 0: every rank stops with the same line
    assert (
        stderr.count(
            f"stopped by SIGTERM at step {step}; the run is saved in runs/{run_dir.name}/snapshots "
            "and the same command resumes it (SIGTERM, exit status 143)\n"
        )
        == 1
    ), stderr[-3000:]
    # Saved at the step reached, in the middle of epoch 0: the last step trained and logged.
    assert f"saved snapshot {run_dir / 'snapshots'} at step {step} " in stderr
    assert (
        10 <= step < steps_per_epoch
        and f"train step {step} " in stderr
        and f"train step {step + 1} " not in stderr
    )
    # also by time, at machine-dependent steps
    assert stderr.count("saved snapshot") >= 2, stderr[-3000:]

    status, resumed_err, _ = runs[f"resumed-{nproc}"]
    assert status == 0, resumed_err[-3000:]
    assert (
        f"resumed from {run_dir / 'snapshots'}: epoch 0, " in resumed_err
        and f"step {step}\n" in resumed_err
    )
    final = read_snapshot(run_dir / "snapshots")
    reference_dir = runs[f"reference-{nproc}"][2]
    expected = read_snapshot(reference_dir / "snapshots")
    assert final["step"] == expected["step"] == steps_per_epoch + PAST_THE_EPOCH
    assert final["epoch"] == expected["epoch"] == 1
    assert same_tensors(final["model_state"], expected["model_state"])
    states = [final["optimizer_state"]["state"], expected["optimizer_state"]["state"]]
    if nproc == 2:  # Muon beside AdamW: both states, Muon's for 4 matrices a block
        assert len([s for s in states[1].values() if "momentum_buffer" in s]) == 4 * 2
    assert states[0].keys() == states[1].keys()
    assert all(same_tensors(states[0][k], states[1][k]) for k in states[1])
    assert train_events(run_dir) == train_events(reference_dir)


@pytest.mark.parametrize("moment", ["import", "init", "load", "sample"])
def test_ctrl_c_outside_training_exits_at_once(runs, moment):
    """Before training (nothing to save) and after the last save (nothing to lose). Before the run
    is accepted (joining the group, loading the corpus), no run directory is left: os._exit left
    runs/init empty, and runs/load with the two lock files the run had made."""
    status, stderr, run_dir = runs[moment]
    assert status == 130, stderr[-3000:]
    assert stderr.splitlines()[-1] == "error: interrupted, exiting at once", stderr[-3000:]
    assert "Traceback" not in stderr
    if moment == "sample":
        assert read_snapshot(run_dir / "snapshots")["step"] == 8
    else:
        assert not run_dir.exists()


@pytest.mark.parametrize("moment", ["eval", "save"])
def test_ctrl_c_during_training_saves_and_stops(runs, moment):
    """During the evaluation at step 5 (left to the resumed run) the run stops at
    step 5; during the save at step 5, after step 6 (the next step boundary)."""
    status, stderr, run_dir = runs[moment]
    step = 5 if moment == "eval" else 6
    assert status == 130, stderr[-3000:]
    assert stderr.splitlines()[-1].startswith(f"interrupted at step {step}; the run is saved in"), (
        stderr[-3000:]
    )
    assert "Traceback" not in stderr and f"train step {step + 1} " not in stderr  # it did not go on
    assert read_snapshot(run_dir / "snapshots")["step"] == step
    if moment == "eval":
        assert (
            "evaluation at step 5 interrupted by a stop signal: the resumed run does it" in stderr
        )
        assert "eval step" not in stderr


def test_ctrl_c_during_an_evaluations_sample_stops_at_once(runs):
    """The sample after the evaluation at step 5 is cut short, like the evaluation
    (the resumed run does it): the run saves at step 5 and stops without sampling on."""
    status, stderr, run_dir = runs["generating"]
    assert status == 130, stderr[-3000:]
    assert stderr.splitlines()[-1].startswith("interrupted at step 5; the run is saved in"), stderr[
        -3000:
    ]
    assert "sample at step 5 interrupted by a stop signal: the resumed run does it" in stderr, (
        stderr[-3000:]
    )
    assert "Traceback" not in stderr and "train step 6 " not in stderr
    assert read_snapshot(run_dir / "snapshots")["step"] == 5


def test_sighup_saves_and_stops_like_sigterm(runs):
    """A hang-up (the terminal or ssh session closed)
    is a stop signal by default, not a silent death."""
    status, stderr, run_dir = runs["hangup"]
    assert status == 129, stderr[-3000:]
    assert stderr.splitlines()[-1] == (
        f"stopped by SIGHUP at step 5; the run is saved in runs/{run_dir.name}/snapshots "
        "and the same command resumes it (SIGHUP, exit status 129)"
    ), stderr[-3000:]
    assert read_snapshot(run_dir / "snapshots")["step"] == 5


def test_second_ctrl_c_exits_at_once(runs):
    """The first Ctrl-C comes during a save that never ends; the second ends the process."""
    status, stderr, run_dir = runs["save-hang"]
    assert status == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == "error: interrupted again, exiting at once", stderr[-3000:]
    assert (
        "SIGINT received: stopping at the end of this step, after saving a snapshot (Ctrl-C again"
        in stderr
    )
    assert not (run_dir / "snapshots").exists()


@pytest.mark.parametrize(
    "command",
    [["-m", "mingpt.generate"], ["-m", "mingpt.score"], ["-m", "mingpt.export"], ["mingpt-score"]],
)
def test_ctrl_c_while_a_command_imports_torch_exits_at_once(tmp_path, command):
    """Ctrl-C as torch imports numpy: a KeyboardInterrupt there printed a traceback, or was caught
    by torch's import and the command went on to its end."""
    if command[0] != "-m":
        command = [str(Path(sys.executable).parent / command[0])]
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", *command, f"snapshot_path={tmp_path}"],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # -X importtime: a line as each module's import ends; torch's imports numpy
        ended = []
        for line in proc.stderr:
            ended.append(line.rsplit("|", 1)[-1].strip())
            if ended[-1].startswith("numpy"):
                break
        os.kill(proc.pid, signal.SIGINT)
        stderr = proc.communicate(timeout=RUN_DEADLINE)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert ended[-1].startswith("numpy") and "torch" not in ended, ended
    assert proc.returncode == 130, stderr[-3000:]
    said = [line for line in stderr.splitlines() if not line.startswith("import time:")]
    assert said == ["error: interrupted, exiting at once"], stderr[-3000:]


# ------------------------------------------------- torchrun's failure summary


def test_a_signal_while_an_error_rises_gives_its_one_line_only(tmp_path, data):
    """torchrun stops the workers beside a dead one with SIGTERM while their
    collectives fail: the main thread's error must not add Hydra's "Error
    executing job with overrides" (or a traceback) to the signal's one line."""
    marker = tmp_path / "at-race"
    proc = launch(
        tmp_path,
        1,
        "race",
        data,
        env={"STOP_PROBE": "race", "STOP_PROBE_FILE": str(marker)},
        script=REPO / "tests" / "stop_probe.py",
    )
    deadline = time.monotonic() + DEADLINE / 2
    try:
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr_path.read_text()[-3000:]
            )
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = proc.stderr_path.read_text()
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.endswith("\nerror: stopped by SIGTERM, exiting at once\n"), stderr[-3000:]
    assert "Error executing job" not in stderr and "Traceback" not in stderr, stderr[-3000:]


def test_the_launchers_error_file_is_never_left_empty(tmp_path, monkeypatch):
    """A worker stopped by torchrun as it says its own error wrote the file twice, from two threads;
    the process could end between one's truncation and its write, and torchrun, reading an empty
    file, crashed instead of restarting the workers."""
    from mingpt import stopping

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    stopping.tell_launcher("error: the first")

    def ended(*args, **kwargs):
        raise SystemExit(143)

    monkeypatch.setattr(stopping.json, "dump", ended)
    with pytest.raises(SystemExit):
        stopping.tell_launcher("error: stopped by SIGTERM, exiting at once")
    assert "error: the first" in error_file.read_text()


# ----------------------------------------------------------- config, display


def test_stop_signals_and_save_every_minutes_are_checked():
    from mingpt.config import ConfigError, TrainerConfig

    assert TrainerConfig().stop_signals == ["SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1"]
    assert (
        TrainerConfig(stop_signals=["TERM", "SIGUSR2"], save_every_minutes=None).save_every_minutes
        is None
    )
    for kwargs, says in [
        ({"stop_signals": ["SIGKILL"]}, "'SIGKILL' is not a signal that can be handled"),
        ({"stop_signals": ["SIGNOPE"]}, "'SIGNOPE' is not a signal"),
        ({"stop_signals": ["SIGCHLD"]}, "'SIGCHLD' comes without a request to stop"),
        ({"stop_signals": ["WINCH"]}, "'WINCH' comes without a request to stop"),
        ({"stop_signals": ["SIGTERM", "TERM"]}, "lists a signal twice"),
        ({"save_every_minutes": 0.0}, "save_every_minutes: must be a finite number > 0 or null"),
    ]:
        with pytest.raises(ConfigError, match=says):
            TrainerConfig(**kwargs)


def test_progress_bar_on_a_terminal_shows_rate_and_eta(tmp_path, capsys):
    """The bar (tqdm) appears only when stderr is a terminal; log lines pass above it."""
    import logging

    from mingpt.metrics import Metrics

    metrics = Metrics(str(tmp_path), enabled=True)
    assert metrics.progress is False  # pytest's stderr is no terminal: no bar
    metrics.show_progress(1, 10)
    assert capsys.readouterr().err == ""
    metrics.progress = True  # as on a terminal
    for step in range(1, 6):
        metrics.show_progress(step, 10)
    logging.getLogger("mingpt.test").warning("a line above the bar")
    metrics.close()
    err = capsys.readouterr().err
    assert "5/10" in err and "step/s" in err and "<" in err  # position, rate, remaining time


def test_a_stop_that_only_another_rank_received_is_in_rank_0s_log(
    tmp_path, small_corpus, monkeypatch, caplog, one_thread
):
    """A signal sent to one worker, or to another node's torchrun, reaches rank 0 only through the
    step's all-reduce (here: that rank's SIGTERM in it from step 3 on). Rank 0's log, train.log,
    says which signal stops the run, as the signalled rank says it on its own stderr."""
    import logging

    from test_snapshot import make_trainer

    from mingpt import stopping
    from mingpt.checkpointer import Checkpointer

    run_dir = tmp_path / "run"
    trainer = make_trainer(
        run_dir, small_corpus, "trainer_config.max_steps=10", "optimizer_config.warmup_steps=0"
    )
    agree = Checkpointer._agree

    def another_rank_signalled(self):
        stop, on_time = agree(self)
        if trainer.state.step >= 3:
            stop = signal.SIGTERM
        return [stop, on_time]

    monkeypatch.setattr(Checkpointer, "_agree", another_rank_signalled)
    with caplog.at_level(logging.WARNING, logger="mingpt"), pytest.raises(stopping.Stopped):
        trainer.train()
    assert stopping.stop_requested() == 0  # this process received none
    assert caplog.messages == [
        "SIGTERM received by another rank: stopping at step 3, after saving a snapshot"
    ]
    assert read_snapshot(run_dir / "snapshots")["step"] == 3
