"""The legacy launcher, `python -m torch.distributed.launch`,
which passes `--local-rank=N` to the script."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import CPU, REPO, RUN_DEADLINE, TINY, child_env, free_port, read_snapshot, run_dir_of

from mingpt import stopping, torch_fixes
from mingpt.cli import take_local_rank_argument
from mingpt.config import ConfigError
from mingpt.distributed import distributed


@pytest.mark.parametrize(
    "argv",
    [
        ["--local-rank=1", "a=1"],
        ["a=1", "--local_rank=1"],
        ["--local_rank", "1", "a=1"],
        ["--local-rank", "1", "a=1"],
    ],
)
def test_local_rank_argument_is_taken_out_of_the_overrides(argv, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert take_local_rank_argument(argv) == ["a=1"]


def test_local_rank_argument_fills_in_a_missing_environment(monkeypatch):
    # setenv first: monkeypatch then undoes whatever take_local_rank_argument sets (a bare
    # delenv of a missing variable records nothing, and LOCAL_RANK=3 outlived the test)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")
    assert take_local_rank_argument(["--local-rank=3"]) == []
    assert os.environ["LOCAL_RANK"] == "3"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--local-rank=1"], "contradicts LOCAL_RANK=0"),
        (["--local_rank"], "--local_rank: expects a local rank"),
        (["--local-rank=x"], "--local-rank: expects a local rank"),
    ],
)
def test_bad_local_rank_argument_is_one_line(argv, says, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as e:
        take_local_rank_argument(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "env, says",
    [
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE=x in the environment is not a number"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR=(unset) MASTER_PORT=(unset)"),
        ({"WORLD_SIZE": "0"}, "RANK=0 of WORLD_SIZE=0,"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "p"}, "MASTER_PORT=p in the"),
    ],
)
def test_launcher_variables_set_by_hand_are_refused_in_one_line(env, says, monkeypatch):
    """Without torchrun, these were tracebacks of int() or torch's rendezvous."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(says)), distributed("cpu"):
        pass
    monkeypatch.setenv("RANK", "x")
    assert stopping.headed("error: e") == "[rank x] error: e"


def test_a_rank_started_by_hand_that_cannot_join_says_so_in_one_line(tmp_path):
    """Without torchrun, a MASTER_PORT where no rank 0 listens waited 30 minutes in silence. The
    run was not accepted: it leaves no run directory (the timer's os._exit left runs/default)."""
    port = free_port()
    env = {**child_env(), "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
    env.pop("TORCHELASTIC_RUN_ID", None)
    code = (
        "from mingpt import cli, torch_fixes\n"
        "torch_fixes.INIT_AFTER_RESTART_SECONDS = 1\n"
        "cli.main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, CPU],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert proc.returncode == 2
    assert os.listdir(tmp_path) == []
    assert proc.stderr == (
        "error: rank 1 of 2 could not join the process group in 1 s: is every rank started, with "
        f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}? (torchrun sets them)\n"
    )


def test_rank_0_started_by_hand_without_rank_that_cannot_join_says_so(monkeypatch, capfd):
    """RANK defaults to 0: its timer ended in a KeyError, and rank 0 waited 30 minutes."""
    monkeypatch.delenv("RANK", raising=False)
    for name, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    torch_fixes._give_up(0, True)
    assert exits == [2]
    assert capfd.readouterr().err.startswith("error: rank 0 of 2 could not join")


def test_legacy_launcher_trains_with_two_processes(tmp_path, corpus):
    data = tmp_path / "small.txt"
    data.write_text(corpus.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    args = [*TINY, f"data_config.path={data}", "trainer_config.max_steps=4"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        "--nproc_per_node",
        "2",
        "--standalone",
        str(REPO / "main.py"),
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=RUN_DEADLINE
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unrecognized arguments" not in proc.stderr
    snapshot = read_snapshot(run_dir_of(tmp_path, args) / "snapshots")
    assert snapshot["world_size"] == 2 and snapshot["step"] == 4
