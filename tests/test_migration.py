"""A user of the PyTorch DDP minGPT tutorial brings its config file (gpt2_train_cfg.yaml):
`--config-dir DIR --config-name gpt2_train_cfg` runs it, checked against this project's schema.
And a run directory of mingpt's single-file training format from before."""

from __future__ import annotations

import shutil

import pytest
from conftest import TINY, on_cpu, read_snapshot, run_each

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


def make_user_dir(path, corpus):
    """`path` with the tutorial's config file in conf/, on 6,000 characters of the corpus."""
    (path / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    conf = path / "conf"
    conf.mkdir()
    (conf / "gpt2_train_cfg.yaml").write_text(TUTORIAL_CFG.format(path=path / "small.txt"))
    return path


def user_args(user_dir, *overrides: str) -> list[str]:
    return ["--config-dir", str(user_dir / "conf"), "--config-name", "gpt2_train_cfg", *overrides]


def test_tutorial_config_file_trains_with_its_values(commands):
    user_dir, proc = commands["tutorial"]
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


def test_a_config_file_of_ones_own_leaves_no_file_of_hydras_in_the_run_directory(commands):
    """The file leaves Hydra's logging and .hydra/ at Hydra's defaults: its file handler left an
    empty <job>.log beside train.log, and its .hydra/ files were written before any check, so the
    refused command after the run rewrote the run's record of its config and overrides."""
    user_dir, proc = commands["again"]
    assert proc.returncode == 2 and "gpt_config.n_embd: 32 -> 16" in proc.stderr, proc.stderr
    assert [p.name for p in user_dir.glob("*.log")] == ["train.log"]
    assert sorted(p.name for p in (user_dir / ".hydra").iterdir()) == [
        "config.yaml",
        "overrides.yaml",
    ]
    assert "n_embd: 32\n" in (user_dir / ".hydra" / "config.yaml").read_text()
    overrides = (user_dir / ".hydra" / "overrides.yaml").read_text()
    assert "trainer_config.batch_size=4" in overrides and "n_embd" not in overrides


SCHEMA_ERRORS = {  # id: (an edit of the file, what its one line says)
    "not-a-number": (
        ("n_embd: 32", "n_embd: wide"),
        "error: gpt_config.n_embd: Value 'wide' of type 'str' could not be converted",
    ),
    "unknown-key": (
        ("use_amp: True", "use_amp: True\n  epochs: 3"),
        "error: unknown key trainer_config.epochs (did you mean trainer_config.max_epochs?",
    ),
}


@pytest.mark.parametrize("name", SCHEMA_ERRORS)
def test_tutorial_config_file_is_checked_against_the_schema(commands, name):
    user_dir, proc = commands[name]
    says = SCHEMA_ERRORS[name][1]
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(says), proc.stderr  # one line, no traceback
    assert not (user_dir / "gpt_snapshot.pt").exists()


@pytest.fixture(scope="module")
def commands(tmp_path_factory, corpus, tiny_file) -> dict:
    """What this module's commands gave, in one process (each is mostly importing torch), each in
    a directory of its own. "tutorial": (the user's directory, what main.py said) for 3 steps with
    the tutorial's file; "again": the same for that command with another n_embd after it; each id
    of SCHEMA_ERRORS: (the user's directory, what main.py said) for that edit of the file; and a
    run directory of the old single-file format, its snapshot named by trainer_config.snapshot_path
    or not: {named: (the directory, its files before, what main.py said, what generate said)}."""
    user_dir = make_user_dir(tmp_path_factory.mktemp("tutorial"), corpus)
    # Keys the file lacks are added with +, as for any config without this project's defaults list.
    tutorial = user_args(user_dir, "+trainer_config.max_steps=3", "trainer_config.batch_size=4")
    dirs = {name: make_user_dir(tmp_path_factory.mktemp(name), corpus) for name in SCHEMA_ERRORS}
    for name, (edit, _) in SCHEMA_ERRORS.items():
        path = dirs[name] / "conf" / "gpt2_train_cfg.yaml"
        path.write_text(path.read_text().replace(*edit))
    runs = {}
    trains = []
    samples = []
    for named in (False, True):
        run = tmp_path_factory.mktemp(f"named-{named}") / "old"
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("trainer_config: {}\n")
        shutil.copy(tiny_file, run / "snapshot.pt")
        runs[named] = (run, sorted(p.name for p in run.iterdir()))
        named_path = [f"trainer_config.snapshot_path={run / 'snapshot.pt'}"] if named else []
        trains.append((run.parent, on_cpu([*TINY, f"hydra.run.dir={run}", *named_path])))
        sample = [f"snapshot_path={run}", "max_new_tokens=5", "device=cpu"]
        samples.append((run.parent, sample, "mingpt.generate"))
    # mingpt's layout in a file without run_name: what its run directory is
    layout = make_user_dir(tmp_path_factory.mktemp("layout"), corpus)
    path = layout / "conf" / "gpt2_train_cfg.yaml"
    path.write_text(path.read_text().replace("dir: ./", "dir: runs/${trainer_config.run_name}"))
    # then refused there: the model of another shape
    again = [*tutorial, "gpt_config.n_embd=16"]
    cases = [(user_dir, on_cpu(tutorial)), (user_dir, on_cpu(again))]
    cases.append((layout, user_args(layout, "--cfg", "hydra", "--package", "hydra.run.dir")))
    cases += [(d, on_cpu(user_args(d))) for d in dirs.values()]
    results = run_each("mingpt.cli", [*cases, *trains, *samples])
    given = {"tutorial": (user_dir, results.pop(0)), "again": (user_dir, results.pop(0))}
    given["layout"] = (layout, results.pop(0))
    given.update((name, (dirs[name], results.pop(0))) for name in dirs)
    refused, sampled = results[: len(trains)], results[len(trains) :]
    given.update((named, (*runs[named], refused[i], sampled[i])) for i, named in enumerate(runs))
    return given


def test_a_config_file_without_run_name_keeps_mingpts_layout_by_the_default_name(commands):
    """`hydra.run.dir: runs/${trainer_config.run_name}`, which the docs and the refusal of a
    directory named by the clock give, failed in a file without run_name (the tutorial's): the
    interpolation found no key, where the run takes run_name's default."""
    _, proc = commands["layout"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "runs/default\n"


@pytest.mark.parametrize("named", [False, True])
def test_a_run_directory_of_the_old_single_file_format_is_refused_and_still_sampled(
    commands, named
):
    """Its snapshot.pt is not resumed (nor silently ignored by a run that would start afresh
    beside it): one line naming init_from; generate still reads it."""
    run, before, proc, sampled = commands[named]
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        f"error: {run / 'snapshot.pt'} is a single snapshot file (an export, or a run of an older "
        "mingpt): a run resumes only from its snapshot directory"
    )
    assert f"trainer_config.init_from={run / 'snapshot.pt'}" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == before
    assert sampled.returncode == 0 and len(sampled.stdout) >= 5, sampled.stderr
