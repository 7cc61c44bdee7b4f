"""The README's commands in the order a newcomer types them: the Quick start's
`python main.py`, then the scale-out under torchrun. Each is taken from the
README's text, with a tiny model appended, so a README that sends the second
command into the first one's finished run fails here."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import torch
from conftest import REPO, TINY, child_env, run_dir_of, run_main

EXTRA = [*TINY, "trainer_config.max_steps=6", "trainer_config.device=cpu"]


def readme_command(pattern: str) -> list[str]:
    """The first command line of the README that matches `pattern`, as words."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    line = re.search(rf"^.*{pattern}.*$", readme, re.M)
    assert line, f"no README line matches {pattern!r}"
    return shlex.split(line.group(0).split("#")[0])


def main_args(words: list[str]) -> list[str]:
    """The words after main.py."""
    return words[words.index("main.py") + 1:]


def train_steps(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [e["step"] for e in map(json.loads, lines) if e["split"] == "train"]


def test_quick_start_then_scale_out_trains_both(tmp_path, corpus):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "input.txt").write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")

    quick = readme_command(r"&& python main\.py")  # `pip install -e . && python main.py`
    quick = main_args(quick[quick.index("&&") + 1:])
    first = run_main([*quick, *EXTRA], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    # The same command again finds its run complete and says what to type instead.
    again = run_main([*quick, *EXTRA], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    line = next(line for line in again.stderr.splitlines() if "run already complete at step 6" in line)
    assert "nothing to train" in line and "add trainer_config.run_name=NAME" in line
    assert line.endswith("add trainer_config.max_steps=12 trainer_config.allow_config_change=true")

    scale = readme_command(r"torchrun --standalone --nproc_per_node=2 main\.py")
    env = child_env()
    while re.fullmatch(r"[A-Z_]+=\S*", scale[0]):  # OMP_NUM_THREADS=1
        key, _, value = scale.pop(0).partition("=")
        env[key] = value
    assert scale[0] == "torchrun"
    launcher = scale[1:scale.index("main.py")]
    args = [*main_args(scale), *EXTRA]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(REPO / "main.py"), *args]
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "already complete" not in second.stderr
    run_dir = run_dir_of(tmp_path, args)
    assert run_dir != run_dir_of(tmp_path, [*quick, *EXTRA])
    assert train_steps(run_dir) == [5, 6]
    assert torch.load(run_dir / "snapshot.pt", weights_only=True)["world_size"] == 2
