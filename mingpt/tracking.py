"""The optional experiment tracker, MLflow: rank 0's config, scalars and samples (docs/tracking.md).
It is never worth the run: MLflow missing, unreachable or failing costs one warning and training
goes on without it."""

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

# MLflow retries a request 7 times and waits 120 s for each by default: minutes in which training
# would stand still. Its calls here run with these (an environment that sets them wins); the first,
# which finds the store, with PROBE_LIMITS over them: no retry.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
PROBE_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
DEFAULT_EXPERIMENT = "mingpt"
INSTALL_HINT = "pip install -e .[mlflow]"
DATABASE_MODULES = ("sqlalchemy", "alembic")  # what MLflow's database stores import


class Tracker:
    """Rank 0's link to the tracker; off rank 0, and once it has failed, every call is a no-op."""

    run_id: str | None = None

    def log(self, split: str, step: int, values: Mapping[str, Any]) -> None:
        pass

    def text(self, tag: str, text: str, step: int) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


OFF = Tracker()


def start(
    config: Any, run_dir: str, run_id: str | None, step: int, enabled: bool, complete: bool = False
) -> Tracker:
    """The tracker `config.trainer_config.tracker` names, continuing the tracker run `run_id` (saved
    in the snapshot; None: a new run) at `step`. OFF where none is asked for, off rank 0, or where
    it cannot start, and for a `complete` run, which trains nothing: it only ends `run_id` where an
    attempt killed after its last snapshot left it RUNNING."""
    cfg = config.trainer_config
    if not enabled or cfg.tracker is None:
        return OFF
    if complete and run_id is None:
        return OFF
    try:
        tracker = MlflowTracker(config)
        if complete:
            tracker.end_left_running(run_id)
            return OFF
        tracker.begin(config, run_dir, run_id, step)
    except TrackerUnavailable as e:
        then = "training goes on without it"
        if complete:
            then = f"MLflow run {run_id} is left as it is (the run is complete: nothing trains)"
        log.warning("trainer_config.tracker=%s: %s; %s", cfg.tracker, e, then)
        return OFF
    return tracker


class TrackerUnavailable(RuntimeError):
    pass


def _first_line(e: BaseException) -> str:
    """MLflow's error in one short line: an HTTP request's OS error (`[Errno 111] ...`), not the
    retry story; a database's own error (`(sqlite3.OperationalError) ...`), not SQLAlchemy's
    preamble."""
    if isinstance(e, OSError) and e.filename:  # a directory store's: the file it names
        return str(e)
    text = str(e).strip()
    if errno := re.search(r"\[Errno -?\d+\][^'\")]*", text):
        return errno.group(0).strip()
    if database := re.search(r"^\([\w.]+\) .+$", text, re.MULTILINE):
        return database.group(0)
    line = text.splitlines()[0] if text else ""
    if len(line) > 200:
        line = line[:200] + "..."
    return f"{type(e).__name__}: {line}"


@contextlib.contextmanager
def _mlflow_calls(values: Mapping[str, str]) -> Iterator[None]:
    """MLflow's calls: `values` that the environment does not set already, set in os.environ, and
    MLflow's own log lines held back (its retries' warnings, a database error's traceback): a
    failure is told by the tracker's one warning."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    mlflow_log = logging.getLogger("mlflow")
    level = mlflow_log.level
    mlflow_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        mlflow_log.setLevel(level)
        for k in added:
            os.environ.pop(k, None)


def _check_database_store(uri: str) -> None:
    """A database store needs what MLflow's database stores import, which mlflow-skinny lacks;
    without it MLflow says only "unsupported model registry URI". A sqlite file is opened here
    first: one MLflow cannot open costs about 100 s of its retries before it gives up."""
    scheme = uri.partition(":")[0].partition("+")[0]
    missing = [m for m in DATABASE_MODULES if importlib.util.find_spec(m) is None]
    if scheme in ("sqlite", "postgresql", "mysql", "mssql") and missing:
        raise TrackerUnavailable(
            f"the MLflow store {uri} is a database, which needs {' and '.join(missing)} "
            f"({INSTALL_HINT})"
        )
    if scheme != "sqlite":
        return
    from sqlalchemy.engine import make_url

    path = make_url(uri).database
    try:
        # its directory made, as MLflow makes it
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("PRAGMA schema_version")  # reads the file's header
    except (OSError, sqlite3.Error) as e:
        raise TrackerUnavailable(f"cannot open the MLflow store {uri} ({path}: {e})") from None


class MlflowTracker(Tracker):
    """The run's record in MLflow, through its client (no global active run)."""

    # (split/loss, step): the loss an earlier attempt logged after the step this one resumed from
    redone: Mapping[tuple[str, int], float] = {}

    def __init__(self, config: Any):
        """A client of the store that config names, its experiment found; no run yet."""
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise TrackerUnavailable(
                f"mlflow is not installed ({INSTALL_HINT}): {_first_line(e)}"
            ) from None
        except Exception as e:  # an installation that is broken
            raise TrackerUnavailable(f"mlflow cannot be imported ({_first_line(e)})") from None
        uri = config.trainer_config.tracker_uri or mlflow.get_tracking_uri()
        self.uri = uri
        _check_database_store(uri)
        # The environment MLflow's calls run with: HTTP_LIMITS, and for a directory store (a path or
        # a file: URI) the consent MLflow 3 asks for before it uses one.
        self._env = dict(HTTP_LIMITS)
        path = "://" not in uri and not uri.startswith(("sqlite:", "databricks", "uc:"))
        if path or uri.startswith("file:"):
            self._env["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        try:
            with _mlflow_calls({**self._env, **PROBE_LIMITS}):
                self.client = MlflowClient(uri)
                self.experiment = self.client.get_experiment_by_name(self.experiment_name)
        except Exception as e:  # MLflow raises many types for a store it cannot use
            raise TrackerUnavailable(
                f"cannot reach the MLflow tracking store {uri} ({_first_line(e)})"
            ) from None

    def begin(self, config: Any, run_dir: str, run_id: str | None, step: int) -> None:
        """Continue the tracker run `run_id` (None: a new run) at `step`, and log the config."""
        try:
            with _mlflow_calls(self._env):
                if self.experiment:
                    experiment_id = self.experiment.experiment_id
                else:
                    experiment_id = self.client.create_experiment(self.experiment_name)
                if run_id:
                    self.run_id = self._continue(run_id, step)
                if self.run_id is None:
                    run = self.client.create_run(
                        experiment_id,
                        run_name=os.path.basename(os.path.normpath(run_dir)),
                        tags={"mingpt.run_dir": os.path.abspath(run_dir)},
                    )
                    self.run_id = run.info.run_id
                self._log_params(config, step)
        except Exception as e:
            if self.run_id is not None:  # left RUNNING otherwise
                with contextlib.suppress(Exception), _mlflow_calls(self._env):
                    self.client.set_terminated(self.run_id, "FAILED")
            raise TrackerUnavailable(f"MLflow at {self.uri} failed ({_first_line(e)})") from None
        self.failed = False
        log.info(
            "tracking in MLflow at %s: experiment %s, run %s%s",
            self.uri,
            self.experiment_name,
            self.run_id,
            f" (continued at step {step})" if run_id == self.run_id else "",
        )

    def _continue(self, run_id: str, step: int) -> str | None:
        """The snapshot's tracker run, running again; None if this store has no such run."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            log.warning(
                "MLflow run %s (saved in the snapshot) is not in %s: starting a new MLflow run",
                run_id,
                self.uri,
            )
            return None
        self.client.update_run(run_id, status="RUNNING")
        self.client.set_tag(run_id, "mingpt.resumed_at_step", str(step))
        # An attempt killed after its snapshot logged steps that this one does again (and the
        # snapshot's own evaluation, where a stop cut it short), and MLflow cannot delete values: an
        # event of the same loss (bitwise resume) is not logged twice; one of another (another
        # config or number of ranks) is, the later value this run's.
        self.redone = {
            (key, m.step): m.value
            for key in run.data.metrics
            if key.endswith("/loss")
            for m in self.client.get_metric_history(run_id, key)
            if m.step >= step
        }
        return run_id

    def end_left_running(self, run_id: str) -> None:
        """The tracker run `run_id` of a run complete, ended FINISHED where it is RUNNING: an
        attempt was killed after its last snapshot, before it ended it."""
        from mlflow.exceptions import MlflowException

        try:
            with _mlflow_calls(self._env):
                try:
                    run = self.client.get_run(run_id)
                except MlflowException:  # not in this store: nothing of it to end
                    return
                if run.info.status != "RUNNING":
                    return
                self.client.set_terminated(run_id, "FINISHED")
        except Exception as e:
            raise TrackerUnavailable(f"MLflow at {self.uri} failed ({_first_line(e)})") from None
        log.info("MLflow run %s, left running by a killed attempt, ended FINISHED", run_id)

    def _log_params(self, config: Any, step: int) -> None:
        """The config as params, one per key. MLflow's params cannot change: a resumed run logs each
        changed value as `key:step<N>`, N the step it resumed from (MLflow's names take no `@`), and
        where a killed attempt from N logged another, as `key:step<N>:2` (`:3`, ...)."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        new = []
        for section, values in dataclasses.asdict(config).items():
            for key, value in values.items():
                name = f"{section}.{key}"
                text = value if isinstance(value, str) else json.dumps(value)
                text = text[:6000]
                resumed = f"{name}:step{step}"
                names = itertools.chain(
                    [name, resumed], (f"{resumed}:{n}" for n in itertools.count(2))
                )
                # the first name that is free, or that holds this value already
                name = next(n for n in names if logged.get(n, text) == text)
                if name not in logged:
                    new.append(Param(name, text))
        # MLflow takes at most 100 params a batch, values of 6000 characters
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i : i + 100])

    def _call(
        self, what: str, call: Any, then: str = "training goes on without the tracker"
    ) -> None:
        """A failure of the tracker costs one warning, which ends saying `then` (what follows);
        tracking is off from there."""
        if self.failed:
            return
        try:
            with _mlflow_calls(self._env):
                call()
        except Exception as e:
            self.failed = True
            log.warning("MLflow at %s failed %s (%s): %s", self.uri, what, _first_line(e), then)

    def log(self, split: str, step: int, values: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        held = self.redone.get((f"{split}/loss", step))
        if held is not None and held == values.get("loss"):
            return
        now = int(time.time() * 1000)
        metrics = [
            Metric(f"{split}/{key}", float(value), now, step)
            for key, value in values.items()
            if isinstance(value, (int, float))
        ]
        if metrics:
            self._call(
                f"logging the {split} metrics at step {step}",
                lambda: self.client.log_batch(self.run_id, metrics=metrics),
            )

    def text(self, tag: str, text: str, step: int) -> None:
        self._call(
            f"logging the {tag} at step {step}",
            lambda: self.client.log_text(self.run_id, text, f"{tag}s/step_{step:07d}.txt"),
        )

    def close(self, status: str = "FINISHED") -> None:
        # at the run's end, or its attempt's: nothing trains after it
        self._call(
            "ending the run",
            lambda: self.client.set_terminated(self.run_id, status),
            f"MLflow run {self.run_id} is left RUNNING",
        )
        self.failed = True  # nothing after the end
