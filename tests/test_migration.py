"""A user of the PyTorch DDP minGPT tutorial brings its config file (gpt2_train_cfg.yaml):
`--config-dir DIR --config-name gpt2_train_cfg` runs it, checked against this project's schema.
And a run directory of mingpt's single-file training format from before."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import TINY, child_env, read_snapshot, run_main

# The tutorial's keys, one for one, with values small enough for a test.
TUTORIAL_CFG = """\
data_config:
  path: {path}
  block_size: 16
  train_split: 0.9
  truncate: 1.0
gpt_config:
  n_layer: 2
  n_head: 2
  n_embd: 32
trainer_config:
  max_epochs: 1
  batch_size: 8
  data_loader_workers: 4
  grad_norm_clip: 1.0
  snapshot_path: gpt_snapshot.pt
  save_every: 3
  use_amp: True
optimizer_config:
  weight_decay: 0.1
  learning_rate: 0.0003

hydra:
  run:
    dir: ./
"""


@pytest.fixture
def user_dir(tmp_path, corpus):
    (tmp_path / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "gpt2_train_cfg.yaml").write_text(TUTORIAL_CFG.format(path=tmp_path / "small.txt"))
    return tmp_path


def user_run(user_dir, *overrides: str):
    return run_main(
        ["--config-dir", str(user_dir / "conf"), "--config-name", "gpt2_train_cfg", *overrides],
        user_dir,
    )


def test_tutorial_config_file_trains_with_its_values(user_dir):
    # Keys the file lacks are added with +, as for any config without this project's defaults list.
    proc = user_run(user_dir, "+trainer_config.max_steps=3", "trainer_config.batch_size=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notices = [line for line in proc.stderr.splitlines() if "data_loader_workers" in line]
    assert (
        len(notices) == 1 and "WARNING trainer_config.data_loader_workers ignored: " in notices[0]
    )
    # hydra.run.dir ./ is the run directory; gpt_snapshot.pt is the snapshots' root directory
    snapshot = read_snapshot(user_dir / "gpt_snapshot.pt")
    assert snapshot["step"] == 3
    assert (snapshot["gpt_config"]["n_layer"], snapshot["gpt_config"]["n_embd"]) == (2, 32)
    t, o = snapshot["trainer_config"], snapshot["optimizer_config"]
    # the file's values and the override's
    assert (t["batch_size"], t["save_every"], o["learning_rate"]) == (4, 3, 3e-4)
    # the rest: this project's defaults
    assert o["betas"] == [0.9, 0.99] and t["amp_dtype"] == "bf16"


@pytest.mark.parametrize(
    "edit, says",
    [
        (
            ("n_embd: 32", "n_embd: wide"),
            "error: gpt_config.n_embd: Value 'wide' of type 'str' could not be converted",
        ),
        (
            ("use_amp: True", "use_amp: True\n  epochs: 3"),
            "error: trainer_config.epochs: unknown key",
        ),
    ],
)
def test_tutorial_config_file_is_checked_against_the_schema(user_dir, edit, says):
    path = user_dir / "conf" / "gpt2_train_cfg.yaml"
    path.write_text(path.read_text().replace(*edit))
    proc = user_run(user_dir)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(says), proc.stderr  # one line, no traceback
    assert not (user_dir / "gpt_snapshot.pt").exists()


@pytest.mark.parametrize("named", [False, True])
def test_a_run_directory_of_the_old_single_file_format_is_refused_and_still_sampled(
    tmp_path, tiny_file, named
):
    """Its snapshot.pt is not resumed (nor silently ignored by a run that would start afresh
    beside it): one line naming init_from; generate still reads it."""
    run = tmp_path / "old"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("trainer_config: {}\n")
    shutil.copy(tiny_file, run / "snapshot.pt")
    before = sorted(p.name for p in run.iterdir())
    named_path = [f"trainer_config.snapshot_path={run / 'snapshot.pt'}"] if named else []
    proc = run_main([*TINY, f"hydra.run.dir={run}", *named_path], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        f"error: {run / 'snapshot.pt'} is a single snapshot file (an export, or a run of an older "
        "mingpt): a run resumes only from its snapshot directory"
    )
    assert f"trainer_config.init_from={run / 'snapshot.pt'}" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == before
    sampled = subprocess.run(
        [
            sys.executable,
            "-m",
            "mingpt.generate",
            f"snapshot_path={run}",
            "max_new_tokens=5",
            "device=cpu",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sampled.returncode == 0 and len(sampled.stdout) >= 5, sampled.stderr
