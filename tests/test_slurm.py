"""scripts/slurm.sbatch under a real SLURM: a one-node cluster on localhost
(munged, slurmctld and slurmd of Debian's packages, the test's own processes,
own config, key and ports in a temporary directory), the script submitted as a
user would, on CPU with a tiny model. Two paths, each end to end:

- SIGUSR1 to the batch shell (what `--signal=B:USR1@300` sends near the time
  limit; here `scancel --signal=USR1 --batch`): the workers save, the script
  requeues the job, and the job, started again with the same id, resumes;
- a partition-priority preemption with a grace time (PreemptMode=REQUEUE,
  GraceTime=60): a job of the high-priority partition needs the node, the
  low-priority job's workers get SIGTERM and save, the script requeues the job,
  and it resumes.

Each run must end COMPLETED with every step trained exactly once (metrics.jsonl),
and the output of both attempts kept in the job's .out file. Without SLURM (srun and scontrol
stubbed), the torchrun command the script starts, as the variables its header names set it.

Skips, with the reason, where the daemons are not installed (`.ci/run` installs
them on Debian) or cannot start (they run as root here).

SLURM holds a requeued batch job for about two minutes (Reason=BeginTime); the
test lets it start sooner with `scontrol update StartTime=now`, as an operator can,
once the node has ended the first attempt and the clock has passed that second.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU, REPO, RUN_DEADLINE, TINY, child_env, free_port

SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
CORPUS_CHARS = 20_000  # 1,124 windows of 16 tokens: 141 steps per epoch (batch 8, one process)
EPOCHS = 3
TOTAL_STEPS = EPOCHS * 141
# seconds for any one event (a job starting, stopping, completing): generous, for a loaded machine
DEADLINE = 300
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}

SLURM_CONF = """\
ClusterName=mingpttest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=low Nodes={host} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=60 State=UP
PartitionName=high Nodes={host} PriorityTier=10 State=UP
"""


def which(name: str) -> str | None:
    return shutil.which(name, path=SBIN)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path.name} missing)"


class Cluster:
    """The daemons (Popen objects, stopped by PID at teardown) and the way to talk to them."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of the SLURM commands and of the jobs (sbatch passes it on)."""
        env = child_env()
        # torchrun of this venv
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), SBIN])
        env["SLURM_CONF"] = str(self.conf)
        for key in [
            k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"
        ]:
            del env[key]
        return {**env, **extra}

    def cmd(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(
            list(args), env=self.env(), capture_output=True, text=True, timeout=300
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def daemon(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.root / f"{name}.out", "w") as log:
            proc = subprocess.Popen(
                [which(name), *args],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc.name = name
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        (self.root / "state").mkdir()
        (self.root / "spool").mkdir()
        munge_dir = self.root / "munge"
        munge_dir.mkdir(mode=0o700)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        socket_path = munge_dir / "munge.socket"
        self.conf.write_text(
            SLURM_CONF.format(
                host=self.host,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                munge_socket=socket_path,
                dir=self.root,
            )
        )
        # -f: munged wants a socket directory everyone can enter; this one is private to the test.
        self.daemon(
            "munged",
            "-F",
            "-f",
            f"--key-file={key}",
            f"--socket={socket_path}",
            f"--pid-file={munge_dir}/munged.pid",
            f"--log-file={munge_dir}/munged.log",
            f"--seed-file={munge_dir}/munged.seed",
        )
        self.wait("munged to listen", lambda: socket_path.exists())
        self.daemon("slurmctld", "-D", "-i")
        self.wait(
            "slurmctld to answer",
            lambda: "is UP" in self.cmd("scontrol", "ping", check=False),
        )
        self.daemon("slurmd", "-D", "-N", self.host)
        self.wait("the node to be idle", self.idle)

    def idle(self) -> bool:
        return self.cmd("sinfo", "-h", "-N", "-o", "%T", check=False).split()[:1] == ["idle"]

    def wait(self, what: str, ready, deadline: float = DEADLINE) -> None:
        """Until ready(); a daemon that exits meanwhile,
        or the deadline, skips (at start) or fails."""
        end = time.monotonic() + deadline
        while not ready():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > end:
                proc = dead[0] if dead else self.procs[-1]
                why = (
                    f"{proc.name} exited with {proc.returncode}"
                    if dead
                    else f"no {what} in {deadline} s"
                )
                raise DaemonError(f"{why}: {tail(self.root / f'{proc.name}.out', 1500)}")
            time.sleep(0.2)

    def jobs(self) -> list[str]:
        return self.cmd("squeue", "-h", "-o", "%i", check=False).split()

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons, newest first, by PID."""
        try:
            if self.jobs():
                self.cmd("scancel", *self.jobs(), check=False)
                end = time.monotonic() + 120
                while (
                    self.jobs()
                    and time.monotonic() < end
                    and all(p.poll() is None for p in self.procs)
                ):
                    time.sleep(0.2)
        finally:
            for proc in reversed(self.procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()


class DaemonError(Exception):
    pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [name for name in DAEMONS + CLIENTS if not which(name)]
    if missing:
        pytest.skip(
            f"SLURM is not installed ({', '.join(missing)} missing: "
            "apt-get install slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        pytest.skip(
            "the SLURM daemons of this test must run as root (slurmd starts jobs as their user)"
        )
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        try:
            cluster.start()
        except DaemonError as e:
            pytest.skip(f"a one-node SLURM cluster cannot start here: {e}")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory, corpus) -> Path:
    path = tmp_path_factory.mktemp("slurm-data") / "small.txt"
    path.write_text(corpus.read_text(encoding="utf-8")[:CORPUS_CHARS], encoding="utf-8")
    return path


class Job:
    def __init__(self, cluster: Cluster, job_id: str, out: Path, run_dir: Path):
        self.cluster, self.id, self.out, self.run_dir = cluster, job_id, out, run_dir

    def show(self) -> dict[str, str]:
        text = self.cluster.cmd("scontrol", "-o", "show", "job", self.id)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def until(self, what: str, ready) -> dict[str, str]:
        """Wait until ready(info) for `scontrol show job`'s
        fields; a job that ends otherwise fails at once."""
        end = time.monotonic() + DEADLINE
        while True:
            info = self.show()
            if ready(info):
                return info
            state = info["JobState"]
            if state in TERMINAL or time.monotonic() > end:
                pytest.fail(
                    f"job {self.id}: {state} (exit {info.get('ExitCode')}) "
                    f"while waiting for {what}\n"
                    f"{tail(self.out)}"
                )
            time.sleep(0.2)

    def trained_steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return [r["step"] for r in records if r["split"] == "train"]

    def until_training(self) -> None:
        self.until("training to start", lambda info: len(self.trained_steps()) >= 5)

    def resume_requeued(self) -> dict[str, str]:
        """The job requeued (same id, pending again): let it
        start now rather than in two minutes, until done."""
        self.until(
            "the requeue", lambda info: info["Restarts"] == "1" and info["JobState"] == "PENDING"
        )
        # slurmd revokes the first attempt's credential when it ends that attempt, and refuses any
        # credential of the same job issued in the same second ("Job credential revoked": the job
        # FAILS). SLURM's two-minute hold avoids this; the test waits for the node to have ended
        # the attempt (idle again), then for the clock's next second, and only then lets it start.
        self.cluster.wait("the node to be idle after the first attempt", self.cluster.idle)
        ended = time.time()
        self.cluster.wait(
            "the second after the first attempt ended", lambda: time.time() >= int(ended) + 1.1
        )
        self.cluster.cmd("scontrol", "update", f"JobId={self.id}", "StartTime=now")
        return self.until(
            "the resumed job to complete", lambda info: info["JobState"] == "COMPLETED"
        )


def submit(cluster: Cluster, corpus_path: Path, name: str) -> Job:
    """scripts/slurm.sbatch as a CPU user submits it: one node, one worker, no GPU."""
    root = cluster.root / name
    run_dir, out = root / "run", root / "mingpt.out"
    root.mkdir()  # for the .out file: slurmstepd creates no directory
    overrides = {
        **dict(item.split("=", 1) for item in TINY),
        "trainer_config.device": "cpu",
        "trainer_config.sample_chars": "0",
        "trainer_config.log_every": "1",
        "trainer_config.max_epochs": str(EPOCHS),
        "trainer_config.save_every_minutes": "null",
        "data_config.path": str(corpus_path),
        "hydra.run.dir": str(run_dir),
    }
    env = cluster.env(
        NPROC_PER_NODE="1", RUN_NAME=name, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1"
    )
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--partition=low",
            "--nodes=1",
            "--gres=none",
            "--cpus-per-task=2",
            f"--output={out}",
            str(REPO / "scripts" / "slurm.sbatch"),
            *(f"{k}={v}" for k, v in overrides.items()),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return Job(cluster, proc.stdout.strip().split(";")[0], out, run_dir)


def check_resumed_once(job: Job, signal_name: str, info: dict[str, str]) -> None:
    """Completed on its second start, every step trained once, both attempts in the .out file."""
    assert info["Restarts"] == "1" and info["ExitCode"] == "0:0", info
    out = job.out.read_text(errors="replace")
    stopped = re.findall(rf"stopped by {signal_name} at step (\d+);", out)
    assert len(stopped) == 1, out[-3000:]
    step = int(stopped[0])
    assert 0 < step < TOTAL_STEPS, step
    assert out.count("INFO run directory ") == 2, out[-3000:]  # the first attempt's lines are kept
    log = (job.run_dir / "train.log").read_text()
    assert re.findall(r"resumed from .*, step (\d+)$", log, re.M) == [str(step)], log[-3000:]
    # nothing skipped, nothing trained twice
    assert job.trained_steps() == list(range(1, TOTAL_STEPS + 1))


def test_sigusr1_requeues_and_resumes(cluster, corpus_path):
    job = submit(cluster, corpus_path, "usr1")
    job.until_training()
    cluster.cmd("scancel", "--signal=USR1", "--batch", job.id)
    info = job.resume_requeued()
    check_resumed_once(job, "SIGUSR1", info)
    assert "time limit near: stopping job" in job.out.read_text()


def test_preemption_with_grace_time_requeues_and_resumes(cluster, corpus_path):
    job = submit(cluster, corpus_path, "preempted")
    job.until_training()
    # A one-CPU job in the high-priority partition: the node has two, all the low job's.
    urgent_out = cluster.root / "urgent.out"
    urgent = (
        cluster.cmd(
            "sbatch",
            "--parsable",
            "--partition=high",
            "--ntasks=1",
            "--cpus-per-task=1",
            f"--output={urgent_out}",
            "--wrap=true",
        )
        .strip()
        .split(";")[0]
    )
    info = job.resume_requeued()
    check_resumed_once(job, "SIGTERM", info)
    assert f"job {job.id} was preempted: requeueing it" in job.out.read_text()
    urgent_state = Job(cluster, urgent, urgent_out, cluster.root).show()["JobState"]
    assert urgent_state == "COMPLETED", urgent_state


def test_the_script_reads_the_variables_its_header_names():
    script = (REPO / "scripts" / "slurm.sbatch").read_text(encoding="utf-8")
    named = re.search(r"the environment sets the launch: (.+?)\.\n", script, re.S).group(1)
    read = {name for name in re.findall(r"\$\{(\w+):-", script) if not name.startswith("SLURM_")}
    assert read == set(re.findall(r"[A-Z_]{4,}", named))


@pytest.mark.parametrize(
    "env, launch",
    [
        ({}, ["--nproc_per_node=gpu", "--rdzv-endpoint=node0:20042", "--numa-binding=node"]),
        (
            {"NPROC_PER_NODE": "4", "RUN_NAME": "big", "MASTER_PORT": "29500"},
            ["--nproc_per_node=4", "--rdzv-endpoint=node0:29500"],
        ),
        ({"NUMA_BINDING": "socket"}, ["--nproc_per_node=gpu", "--numa-binding=socket"]),
    ],
)
def test_the_script_starts_torchrun_on_main_py(tmp_path, env, launch):
    """Without SLURM (srun and scontrol stubbed): the torchrun command the script starts, as its
    variables set it, and main.py's arguments, which compose."""
    (tmp_path / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    # show hostnames: more than a pipe holds, which the script must read to the end (taking the
    # first line through head, it died of SIGPIPE under pipefail)
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho node0; seq -f node%g 1 50000\n")
    for stub in tmp_path.iterdir():
        stub.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_NUM_NODES": "2"}
    out = subprocess.run(
        ["bash", "scripts/slurm.sbatch", CPU],
        cwd=REPO,
        env={**child_env(), **slurm, **env, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
        check=True,
    ).stdout.splitlines()
    assert out[:2] == ["--kill-on-bad-exit=1", "torchrun"] and "--nnodes=2" in out
    assert set(launch) <= set(out)
    numa = [arg for arg in out if arg.startswith("--numa-binding")]
    assert numa == [arg for arg in launch if arg.startswith("--numa-binding")]
    run_name = env.get("RUN_NAME", "slurm-42")
    main = out[out.index("main.py") + 1 :]
    assert main == [f"trainer_config.run_name={run_name}", CPU]
    composed = subprocess.run(
        [sys.executable, "main.py", *main, "--cfg", "job"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
        check=True,
    ).stdout
    assert f"run_name: {run_name}" in composed
