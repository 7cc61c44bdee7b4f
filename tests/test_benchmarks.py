"""Every script under benchmarks/ runs once at a tiny size and answers --help, so
none of them rots; and a script's default overrides never beat the user's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CPU, REPO, child_env, torchrun_cmd

BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
MODEL = [
    "gpt_config.n_layer=1",
    "gpt_config.n_head=2",
    "gpt_config.n_embd=16",
    "data_config.block_size=16",
    "trainer_config.batch_size=4",
    "trainer_config.sample_chars=0",
    CPU,
]

# How each script runs at a tiny size: (processes, arguments; DATA is the corpus, TMP a scratch directory).
SMOKE = {
    "bench_comm.py": (
        2,
        [*MODEL, "data_config.path=DATA", "trainer_config.snapshot_path=TMP/s.pt"],
    ),
    "bench_data.py": (1, ["--size-mb", "1", "--nproc", "1", "--dir", "TMP"]),
    "bench_memory.py": (1, ["--steps", "1", *MODEL, "data_config.path=DATA"]),
    "bench_decode_overhead.py": (1, ["--tokens", "3", "--rounds", "1", "--no-compile"]),
    "bench_generate.py": (
        1,
        [
            "--max-new-tokens",
            "3",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--no-compile",
            "--no-uncached",
        ],
    ),
    # needs a nanoGPT checkout, and trains 2,616 steps: a benchmark, not a smoke test
    "bench_quality.py": None,
    "bench_parallel.py": (1, ["--world", "1", "--steps", "1", *MODEL, "data_config.path=DATA"]),
    "bench_sharded.py": (1, ["--vocab", "65", "gpt-nano", "1", "TMP"]),
    "bench_snapshot.py": (1, ["gpt-nano", "TMP"]),
    "bench_train.py": (1, [*MODEL, "data_config.path=DATA"]),
    "profile_train_step.py": (1, ["--rounds", "1", "--threads", "1", "--no-compile"]),
}


# Each script's `--help`, all in one process (each script imports torch: once, not once a script):
# {script: [exit status, stdout, stderr]} on stdout as JSON.
HELP_ALL = """
import contextlib, io, json, os, runpy, sys, traceback
answers = {}
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as for `python benchmarks/x.py`: its directory first
for path in sys.argv[1:]:
    sys.argv, out, err, status = [path, "--help"], io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            status = e.code
        except BaseException:
            status, _ = 1, traceback.print_exc()
    answers[os.path.basename(path)] = [status, out.getvalue(), err.getvalue()]
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    proc = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *(str(BENCHMARKS / s) for s in SCRIPTS)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_answers_help(script, helps):
    status, out, err = helps[script]
    assert status in (0, None), err[-3000:]
    assert out.strip() and not err, err[-3000:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_at_a_tiny_size(script, small_corpus, tmp_path):
    assert script in SMOKE, f"benchmarks/{script}: say in SMOKE how it runs at a tiny size"
    if SMOKE[script] is None:
        pytest.skip(f"benchmarks/{script} cannot run at a tiny size (see SMOKE)")
    nproc, args = SMOKE[script]
    args = [a.replace("DATA", str(small_corpus)).replace("TMP", str(tmp_path)) for a in args]
    launcher = [sys.executable] if nproc == 1 else torchrun_cmd(nproc, "--standalone")
    proc = subprocess.run(
        [*launcher, str(BENCHMARKS / script), *args],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]


def test_the_users_preset_beats_a_scripts_defaults(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from _cli import with_defaults
    from hydra import compose, initialize_config_dir

    from mingpt.cli import CONF_DIR

    defaults = [
        "gpt_config.n_layer=4",
        "gpt_config.n_embd=128",
        "data_config.block_size=64",
        "trainer_config.batch_size=12",
    ]

    def composed(*given):
        overrides = with_defaults(defaults, list(given))
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("config", overrides=overrides)

    gpt2 = composed("gpt_config=gpt2", "trainer_config.batch_size=16")
    assert (gpt2.gpt_config.n_layer, gpt2.gpt_config.n_embd) == (12, 768)
    assert gpt2.data_config.block_size == 64 and gpt2.trainer_config.batch_size == 16
    quick = composed("experiment=gpu-quick")  # an experiment's keys are the user's too
    assert quick.gpt_config.n_layer == 6 and quick.data_config.block_size == 256
    plain = composed("gpt_config.n_layer=2")
    assert (plain.gpt_config.n_layer, plain.gpt_config.n_embd, plain.trainer_config.batch_size) == (
        2,
        128,
        12,
    )
