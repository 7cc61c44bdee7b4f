"""The MLflow tracker (mingpt/tracking.py), for real: runs of main.py (and of
torchrun with 2 ranks) log into an MLflow store in a local directory, read back
with MLflow's own client; a resumed run continues the same MLflow run; a store
that cannot be reached, or one that fails mid-run, costs one warning.

Tiny model, 20,000-character corpus: 141 steps per epoch in one process.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, child_env, on_cpu, run_each, run_main, run_torchrun

mlflow = pytest.importorskip(
    "mlflow", reason="mlflow is not installed (pip install -e .[mlflow], or .[test])"
)

from mingpt import tracking  # noqa: E402
from mingpt.config import Config, ConfigError, OptimizerConfig, TrainerConfig  # noqa: E402
from mingpt.metrics import events  # noqa: E402
from mingpt.snapshot.sharded import read_meta as read  # noqa: E402

# seconds for one event (a run reaching its stop point,
# a stopped run exiting): generous, for a loaded machine
DEADLINE = 300
ARGS = [
    *TINY,
    "data_config.path=small.txt",
    "trainer_config.tracker=mlflow",
    "trainer_config.eval_every=10",
    "trainer_config.save_every_minutes=null",
    # shorter than the runs (10 steps and more), which say no warning
    "optimizer_config.warmup_steps=5",
]


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    """MLflow's usage telemetry off, in this process and the runs it starts (no network here)."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture
def cwd(tmp_path, corpus) -> Path:
    (tmp_path / "small.txt").write_text(
        corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8"
    )
    return tmp_path


def store_uri(cwd: Path) -> str:
    return (cwd / "mlruns").as_uri()


def args_for(cwd: Path, *extra: str) -> list[str]:
    # Pinned to runs/t: a resume with other values must find the same run directory.
    return [*ARGS, f"trainer_config.tracker_uri={store_uri(cwd)}", "hydra.run.dir=runs/t", *extra]


class Store:
    """What the MLflow store in cwd/mlruns holds, read with MLflow's client (a file
    store needs MLFLOW_ALLOW_FILE_STORE=true, set only while reading)."""

    def __init__(self, cwd: Path, monkeypatch, uri: str | None = None):
        with monkeypatch.context() as env:
            env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
            client = mlflow.tracking.MlflowClient(uri or store_uri(cwd))
            experiment = client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT)
            self.runs = client.search_runs([experiment.experiment_id]) if experiment else []
            self.history = {
                run.info.run_id: {
                    key: [
                        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)
                    ]
                    for key in run.data.metrics
                }
                for run in self.runs
            }
            self.samples = {
                run.info.run_id: sorted(
                    f.path for f in client.list_artifacts(run.info.run_id, "samples")
                )
                for run in self.runs
            }

    def only_run(self):
        assert len(self.runs) == 1, [r.info.run_id for r in self.runs]
        return self.runs[0]


def steps_of(history: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in history]


def same(logged: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """The same steps, and the same values up to MLflow's float64."""
    return steps_of(logged) == steps_of(expected) and [v for _, v in logged] == pytest.approx(
        [v for _, v in expected]
    )


def recorded(run_dir: Path, split: str, key: str = "loss") -> list[tuple[int, float]]:
    return [
        (r["step"], r[key])
        for _, r in events(str(run_dir / "metrics.jsonl"))
        if r["split"] == split
    ]


STORES = ["default", "sqlite"]


def store_args(cwd: Path, store: str) -> list[str]:
    """A 10-step run into MLflow's own default store, or an explicit sqlite URI in `cwd`."""
    given = (
        [] if store == "default" else [f"trainer_config.tracker_uri=sqlite:///{cwd / 'runs.db'}"]
    )
    return [*ARGS, "trainer_config.max_steps=10", "hydra.run.dir=runs/t", *given]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, corpus) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """{case: (the directory main.py ran in, what it gave)}: "file" for a 20-step run into a file
    store in its directory, "untracked" for a 10-step run without a tracker, and each of STORES,
    with MLFLOW_TRACKING_URI unset. One process for the four (each start imports torch and
    MLflow); the default store's first, before anything else in the process could set a tracking
    URI."""
    cases = {}
    for name in [*STORES, "file", "untracked"]:
        cwd = tmp_path_factory.mktemp(name)
        (cwd / "small.txt").write_text(
            corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8"
        )
        argv = {
            "file": args_for(cwd, "trainer_config.max_steps=20"),
            "untracked": [
                *args_for(cwd, "trainer_config.max_steps=10"),
                "trainer_config.tracker=null",
            ],
        }.get(name)
        cases[name] = (cwd, on_cpu(argv or store_args(cwd, name)))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no_telemetry's, for this module's runs
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        results = run_each("mingpt.cli", list(cases.values()))
    return {name: (cases[name][0], result) for name, result in zip(cases, results, strict=True)}


def test_params_metrics_and_samples_reach_mlflow(tracked, monkeypatch):
    cwd, result = tracked["file"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr
    store = Store(cwd, monkeypatch)
    run = store.only_run()
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    params = run.data.params
    assert (
        params["trainer_config.max_steps"] == "20" and params["trainer_config.tracker"] == "mlflow"
    )
    # set from the data
    assert params["gpt_config.n_embd"] == "32" and params["gpt_config.vocab_size"] != "null"
    assert (
        params["data_config.path"] == "small.txt"
        and params["optimizer_config.betas"] == "[0.9, 0.99]"
    )
    # The same events as metrics.jsonl, at the same steps.
    history, run_dir = store.history[run_id], cwd / "runs" / "t"
    assert same(history["train/loss"], recorded(run_dir, "train"))
    assert steps_of(history["train/loss"]) == [5, 10, 15, 20]
    assert same(history["eval/loss"], recorded(run_dir, "eval")) and steps_of(
        history["eval/loss"]
    ) == [10, 20]
    assert {
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "eval/bpc",
        "eval/perplexity",
    } <= set(history)
    assert store.samples[run_id] == ["samples/step_0000010.txt", "samples/step_0000020.txt"]
    assert read(str(run_dir / "snapshots"))["tracker_run_id"] == run_id


def test_resumed_runs_continue_one_mlflow_run(tracked, monkeypatch):
    """A snapshot without a tracker run id (written without a tracker, as before trackers
    existed) starts an MLflow run; a SIGTERM stop and its resume (with another
    max_steps) continue it, each step logged once."""
    cwd, first = tracked["untracked"]
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = cwd / "runs" / "t"
    assert "tracker_run_id" not in read(str(run_dir / "snapshots"))
    assert not (cwd / "mlruns").exists()

    # Steps 11 to 20, stopped by SIGTERM at the start of
    # the evaluation at step 20 (tests/stop_probe.py).
    marker = cwd / "at-eval"
    # the first stopped at 10
    more = ["trainer_config.max_steps=30", "trainer_config.allow_config_change=true"]
    with open(cwd / "stopped.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "stop_probe.py"), *on_cpu(args_for(cwd, *more))],
            cwd=cwd,
            env={**child_env(), "STOP_PROBE": "eval", "STOP_PROBE_FILE": str(marker)},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + DEADLINE
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the probe's marker, not for a fixed time
        assert marker.exists(), (cwd / "stopped.err").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE) == 128 + signal.SIGTERM, (
            cwd / "stopped.err"
        ).read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    store = Store(cwd, monkeypatch)
    run = store.only_run()
    run_id = run.info.run_id
    assert run.info.status == "KILLED"
    assert read(str(run_dir / "snapshots"))["tracker_run_id"] == run_id

    # Resumed with another max_steps: steps 21 to 40.
    resumed = run_main(
        args_for(cwd, "trainer_config.max_steps=40", "trainer_config.allow_config_change=true"), cwd
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"run {run_id} (continued at step 20)" in resumed.stderr
    assert "WARNING" not in resumed.stderr.replace("WARNING continuing", ""), resumed.stderr[-3000:]
    store = Store(cwd, monkeypatch)
    run = store.only_run()
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    history = store.history[run_id]
    # The first run had no tracker: its steps are in metrics.jsonl only.
    assert steps_of(history["train/loss"]) == [15, 20, 25, 30, 35, 40]
    # The evaluation at step 20, which the stop cut short, was done by the resumed run.
    assert same(history["eval/loss"], [e for e in recorded(run_dir, "eval") if e[0] > 10])
    assert steps_of(history["eval/loss"]) == [20, 30, 40]
    assert same(history["train/loss"], recorded(run_dir, "train")[2:])
    # MLflow's params cannot change: the new max_steps is logged beside the first.
    params = run.data.params
    assert (
        params["trainer_config.max_steps"] == "30"
        and params["trainer_config.max_steps:step20"] == "40"
    )
    assert run.data.tags["mingpt.resumed_at_step"] == "20"
    assert store.samples[run_id] == [f"samples/step_{step:07d}.txt" for step in (20, 30, 40)]


@pytest.mark.parametrize("change", [[], ["optimizer_config.learning_rate=1e-4"]])
def test_a_killed_run_resumed_logs_each_step_once(cwd, monkeypatch, change):
    """A run SIGKILLed at step 35 resumes from its snapshot at step 20 and does steps 21 to 35
    again: MLflow cannot delete the values the killed attempt logged for them, so the resumed run
    logs those steps no more (train 25 to 35, eval 30: they were logged twice). Each step is in
    MLflow once, with the values that metrics.jsonl records (bitwise resume: the same). Resumed
    with another learning rate, those steps' values differ: they are logged again (MLflow kept the
    killed attempt's alone, not what metrics.jsonl records), MLflow's later value the new one."""
    args = args_for(cwd, "trainer_config.max_steps=50", "trainer_config.save_every_steps=20")
    killed = subprocess.run(
        [sys.executable, str(REPO / "tests" / "ft_kill.py"), *on_cpu(args)],
        cwd=cwd,
        env={
            **child_env(),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "FT_KILL_RANK": "0",
            "FT_KILL_STEP": "35",
        },
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    if change:
        change = [*change, "trainer_config.allow_config_change=true"]
    resumed = run_main([*args, *change], cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continued at step 20" in resumed.stderr
    store = Store(cwd, monkeypatch)
    history, run_dir = store.history[store.only_run().info.run_id], cwd / "runs" / "t"
    again = {"train": [25, 30, 35], "eval": [30]} if change else {"train": [], "eval": []}
    for split, steps in {"train": range(5, 55, 5), "eval": range(10, 60, 10)}.items():
        for key in ("loss", "grad_norm") if split == "train" else ("loss",):
            logged = history[f"{split}/{key}"]
            assert sorted(steps_of(logged)) == sorted([*steps, *again[split]])
            last = sorted(dict(logged).items())  # each step's later value (in the order logged)
            assert same(last, recorded(run_dir, split, key))


def test_only_rank_0_logs_under_torchrun(cwd, monkeypatch):
    """With FSDP, where every rank generates the samples
    too, and the id goes into the sharded snapshot."""
    result = run_torchrun(
        2, args_for(cwd, "trainer_config.max_steps=20", "trainer_config.parallelism=fsdp"), cwd
    )
    assert result.returncode == 0, result.stderr[-3000:]
    store = Store(cwd, monkeypatch)
    run = store.only_run()
    assert read(str(cwd / "runs" / "t" / "snapshots"))["tracker_run_id"] == run.info.run_id
    history = store.history[run.info.run_id]
    assert steps_of(history["train/loss"]) == [5, 10, 15, 20] and steps_of(
        history["eval/loss"]
    ) == [10, 20]
    assert same(history["eval/loss"], recorded(cwd / "runs" / "t", "eval"))
    assert store.samples[run.info.run_id] == [
        "samples/step_0000010.txt",
        "samples/step_0000020.txt",
    ]


def test_unreachable_tracker_costs_one_warning(cwd):
    """Nothing listens on port 1: one warning at the
    start, and the run trains and records as ever."""
    started = time.monotonic()
    result = run_main(
        [
            *args_for(cwd, "trainer_config.max_steps=10"),
            "trainer_config.tracker_uri=http://127.0.0.1:1",
        ],
        cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert (
        len(warnings) == 1
        and "http://127.0.0.1:1" in warnings[0]
        and "training goes on" in warnings[0]
    ), warnings
    assert steps_of(recorded(cwd / "runs" / "t", "train")) == [5, 10]
    assert "tracker_run_id" not in read(str(cwd / "runs" / "t" / "snapshots"))
    assert time.monotonic() - started < 100  # MLflow's default retries would take minutes


@pytest.mark.parametrize("store", STORES)
def test_the_documented_stores_track_after_the_documented_install(tracked, monkeypatch, store):
    """MLflow's own default store (MLFLOW_TRACKING_URI unset: sqlite:///mlflow.db in the
    working directory, MLflow >= 3.7) and an explicit sqlite URI, with what `.[mlflow]` installs."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cwd, result = tracked[store]
    uri = f"sqlite:///{cwd / 'runs.db'}"
    assert result.returncode == 0 and "WARNING" not in result.stderr, result.stderr[-3000:]
    if store == "default":
        with monkeypatch.context() as env:
            env.chdir(cwd)
            uri = mlflow.get_tracking_uri()  # as the run resolved it, from its working directory
        assert uri.startswith("sqlite:"), uri  # what the documented default is
    held = Store(cwd, monkeypatch, uri)
    run = held.only_run()
    assert run.info.status == "FINISHED" and steps_of(
        held.history[run.info.run_id]["train/loss"]
    ) == [5, 10]


def test_a_database_store_without_its_packages_names_them(tmp_path, caplog, monkeypatch):
    """mlflow-skinny installed alone: the one warning
    names what is missing and the install command."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sqlalchemy" else find_spec(name, *a),
    )
    with caplog.at_level(logging.INFO, logger="mingpt"):
        tracker = tracking.start(
            config(tracker_uri=f"sqlite:///{tmp_path / 'x.db'}"), str(tmp_path), None, 0, True
        )
    assert tracker is tracking.OFF and [r.levelname for r in caplog.records] == ["WARNING"]
    assert (
        "is a database, which needs sqlalchemy (pip install -e .[mlflow])"
        in caplog.records[0].getMessage()
    )


def config(**trainer) -> Config:
    return Config(trainer_config=TrainerConfig(tracker="mlflow", **trainer))


def test_start_without_a_store_or_without_mlflow_is_one_warning(tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="mingpt"):
        tracker = tracking.start(
            config(tracker_uri="http://127.0.0.1:1"), str(tmp_path), None, 0, enabled=True
        )
    assert tracker is tracking.OFF
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "Connection refused" in caplog.records[0].getMessage()
    # A complete run, which only ends its MLflow run where it was left running: nothing trains.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mingpt"):
        tracker = tracking.start(
            config(tracker_uri="http://127.0.0.1:1"),
            str(tmp_path),
            "a1",
            4,
            enabled=True,
            complete=True,
        )
    assert tracker is tracking.OFF
    (said,) = caplog.messages
    assert "Connection refused" in said and said.endswith(
        "; MLflow run a1 is left as it is (the run is complete: nothing trains)"
    )
    # mlflow not importable (a module that refuses to import, first on the path): one warning too.
    (tmp_path / "hidden" / "mlflow").mkdir(parents=True)
    (tmp_path / "hidden" / "mlflow" / "__init__.py").write_text(
        "raise ImportError('no mlflow here')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "hidden"))
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mingpt"):
        assert tracking.start(config(), str(tmp_path), None, 0, enabled=True) is tracking.OFF
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "mlflow is not installed (pip install -e .[mlflow])" in caplog.records[0].getMessage()


def break_file_store(store: Path) -> None:
    shutil.rmtree(store)  # the store goes away


def break_sqlite_store(store: Path) -> None:
    shutil.rmtree(store)  # the database's directory goes away, and a file takes its place
    store.write_text("")


@pytest.mark.parametrize(
    "uri, break_store",
    [("file", break_file_store), ("sqlite", break_sqlite_store)],
    ids=["file", "sqlite"],
)
def test_a_store_failing_mid_run_costs_one_warning(tmp_path, caplog, capfd, uri, break_store):
    """One warning naming the database's own error, and
    none of MLflow's log lines (a traceback, for sqlite)."""
    store = tmp_path / "store"
    if uri == "file":
        uri = store.as_uri()
    else:
        uri = f"sqlite:///{store / 'runs.db'}"
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        tracker = tracking.start(
            config(tracker_uri=uri), str(tmp_path / "run"), None, 0, enabled=True
        )
        assert tracker.run_id and not caplog.records
        tracker.log("train", 1, {"loss": 4.0, "rank_losses": [4.0], "mfu": None})
        break_store(store)
        for step in (2, 3):
            tracker.log("train", step, {"loss": 3.9})
            tracker.text("sample", "text", step)
        tracker.close()
    assert (
        len(caplog.records) == 1
        and "training goes on without the tracker" in caplog.records[0].getMessage()
    )
    if "sqlite" in uri:
        assert "(sqlite3.OperationalError) attempt to write a readonly database" in (
            caplog.records[0].getMessage()
        )
    assert "Traceback" not in capfd.readouterr().err


def test_a_store_failing_at_the_end_says_the_mlflow_run_stays_running(tmp_path, caplog):
    """Ending the MLflow run is the tracker's last call: nothing trains after it."""
    uri = (tmp_path / "store").as_uri()
    tracker = tracking.start(config(tracker_uri=uri), str(tmp_path / "run"), None, 0, enabled=True)
    break_file_store(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        tracker.close()
    (said,) = caplog.messages
    assert said.startswith(f"MLflow at {uri} failed ending the run (") and said.endswith(
        f"): MLflow run {tracker.run_id} is left RUNNING"
    )


@pytest.mark.parametrize("store", ["sqlite", "directory"])
def test_a_store_that_cannot_be_opened_is_one_warning_naming_it(tmp_path, caplog, capfd, store):
    """sqlite: MLflow retries a database it cannot open (here a directory) for about 100 s,
    logging each retry; opened first, it is one warning naming the file, and no retry. A
    directory store that is a file: the warning names the path."""
    (tmp_path / "file").write_text("")
    if store == "sqlite":
        uri = f"sqlite:///{tmp_path}"
        expected = f"cannot open the MLflow store {uri} ({tmp_path}: unable to open database file)"
    else:
        uri = str(tmp_path / "file")
        expected = f"[Errno 20] Not a directory: '{tmp_path / 'file'}"
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mingpt"):
        tracker = tracking.start(config(tracker_uri=uri), str(tmp_path / "run"), None, 0, True)
    assert tracker is tracking.OFF and [r.levelname for r in caplog.records] == ["WARNING"]
    assert expected in caplog.records[0].getMessage()
    assert "retried" not in capfd.readouterr().err
    assert time.monotonic() - started < 60


def test_tracker_keys_are_checked():
    with pytest.raises(
        ConfigError,
        match="trainer_config.tracker: 'wandb' is not one of mlflow, or null",
    ):
        TrainerConfig(tracker="wandb")
    with pytest.raises(ConfigError, match="trainer_config.tracker_uri"):
        TrainerConfig(tracker_uri=" ")
    assert tracking.start(Config(), "run", None, 0, enabled=True) is tracking.OFF
    assert tracking.start(config(), "run", None, 0, enabled=False) is tracking.OFF


def test_a_run_id_the_store_lacks_starts_a_new_run(tmp_path, caplog):
    """The snapshot's MLflow run is in another store
    (tracker_uri changed): one warning, a new run."""
    uri = (tmp_path / "mlruns").as_uri()
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        tracker = tracking.start(
            config(tracker_uri=uri), str(tmp_path / "run"), "0123456789abcdef", 7, enabled=True
        )
    assert tracker.run_id and tracker.run_id != "0123456789abcdef"
    assert len(caplog.records) == 1 and "0123456789abcdef" in caplog.records[0].getMessage()
    tracker.close()


def test_attempts_resumed_from_one_step_with_other_values_keep_the_tracker(
    tmp_path, caplog, monkeypatch
):
    """Attempts resumed from step 7 with other learning rates, each killed before its next
    snapshot: MLflow keeps each value as a param of its own (it refused the second, and the
    tracker was off for the run, its MLflow run FAILED); a value logged already is not again."""
    uri = store_uri(tmp_path)
    run_dir = str(tmp_path / "run")
    first = tracking.start(config(tracker_uri=uri), run_dir, None, 0, enabled=True)
    first.close()
    for lr in (1e-3, 2e-3, 1e-3):
        resumed = Config(
            optimizer_config=OptimizerConfig(learning_rate=lr),
            trainer_config=TrainerConfig(tracker="mlflow", tracker_uri=uri),
        )
        with caplog.at_level(logging.WARNING, logger="mingpt"):
            tracker = tracking.start(resumed, run_dir, first.run_id, 7, enabled=True)
        assert tracker.run_id == first.run_id, caplog.text
        tracker.close()
    assert not caplog.records
    run = Store(tmp_path, monkeypatch).only_run()
    params = {k: v for k, v in run.data.params.items() if k.startswith("optimizer_config.learn")}
    assert params == {
        "optimizer_config.learning_rate": "0.003",
        "optimizer_config.learning_rate:step7": "0.001",
        "optimizer_config.learning_rate:step7:2": "0.002",
    }
    assert run.info.status == "FINISHED"


def test_an_evaluation_a_stop_cut_short_is_logged_once(tmp_path, monkeypatch):
    """A stop cut the evaluation at step 7 short: the attempt resumed from 7 evaluated it and was
    killed before its next snapshot, and the next attempt evaluates it again (bitwise, the same
    loss). MLflow holds it once."""
    uri = store_uri(tmp_path)
    run_dir = str(tmp_path / "run")
    stopped = tracking.start(config(tracker_uri=uri), run_dir, None, 0, enabled=True)
    stopped.close("KILLED")
    for _ in range(2):
        tracker = tracking.start(config(tracker_uri=uri), run_dir, stopped.run_id, 7, enabled=True)
        tracker.log("eval", 7, {"loss": 1.5})
        tracker.close()
    assert Store(tmp_path, monkeypatch).history[stopped.run_id]["eval/loss"] == [(7, 1.5)]


def four_tracked_steps(cwd: Path):
    """A Trainer of 4 steps in cwd/run, tracked by MLflow in cwd's store."""
    from test_snapshot import make_trainer

    args = [
        f"trainer_config.tracker_uri={store_uri(cwd)}",
        "trainer_config.tracker=mlflow",
        "trainer_config.max_steps=4",
        "optimizer_config.warmup_steps=2",
    ]
    return make_trainer(cwd / "run", cwd / "small.txt", *args)


def test_a_run_killed_after_its_last_snapshot_ends_its_mlflow_run_once_found_complete(
    cwd, monkeypatch, caplog, one_thread
):
    """A run killed after its last snapshot, before it ended its MLflow run, left that RUNNING:
    the command again, which finds the run complete and trains nothing, ends it FINISHED."""
    from mingpt.run import train

    killed = four_tracked_steps(cwd)
    with monkeypatch.context() as kill:
        kill.setattr(killed.metrics.tracker, "close", lambda status: None)
        killed.train()
    assert Store(cwd, monkeypatch).only_run().info.status == "RUNNING"
    again = four_tracked_steps(cwd)
    assert again.finished()
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        train(again)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    run = Store(cwd, monkeypatch).only_run()
    assert run.info.status == "FINISHED" and run.info.run_id == killed.metrics.tracker.run_id


def test_a_run_stopped_once_complete_ends_its_mlflow_run_finished(cwd, monkeypatch, one_thread):
    """A stop signal that comes while the last step's snapshot is written stops a complete run:
    its MLflow run ends FINISHED, not KILLED, as nothing is left for a resume to do."""
    from mingpt import stopping

    trainer = four_tracked_steps(cwd)
    evaluate = trainer.evaluate
    evaluated = []

    def evaluate_then_stop(last_step=False):
        loss = evaluate(last_step)
        evaluated.append(last_step)
        return loss

    monkeypatch.setattr(trainer, "evaluate", evaluate_then_stop)
    # asked for once the last step's evaluation is done: while its snapshot is written
    monkeypatch.setattr(
        stopping, "stop_requested", lambda: signal.SIGTERM if True in evaluated else 0
    )
    with pytest.raises(stopping.Stopped, match="at step 4; the run is complete"):
        trainer.train()
    assert Store(cwd, monkeypatch).only_run().info.status == "FINISHED"
