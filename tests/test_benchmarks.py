"""Every script under benchmarks/ runs at a tiny size, in each of its modes, prints where it was
measured and answers --help, so none of them rots; and a script's default overrides never beat the
user's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    "data_config.path=DATA",
]

# How each script runs at a tiny size, one case per mode: (processes, arguments, a line of its
# output). DATA is the corpus, TMP a scratch directory, NANOGPT a stand-in for a nanoGPT checkout.
SMOKE = {
    "bench_comm.py": [(2, [*MODEL, "trainer_config.snapshot_path=TMP/s.pt"], "| post_local_sgd |")],
    "bench_data.py": [
        (1, ["--size-mb", "1", "--nproc", "1", "--dir", "TMP"], "| 1 | warm |"),
        (
            1,
            ["--size-mb", "1", "--gather", "--repeats", "4", "--steps", "2", "--dir", "TMP"],
            "| 64 x 1024 |",
        ),
    ],
    "bench_generate.py": [
        (
            1,
            ["--max-new-tokens", "3", "--rounds", "1", "--threads", "1", "--no-compile"],
            "cached eager vs uncached restarting window",
        ),
        (
            1,
            [
                *("--max-new-tokens", "3", "--rounds", "1", "--threads", "1", "--no-compile"),
                *("--no-uncached", "--baseline", "HEAD"),
            ],
            "against the baseline: one sample in",
        ),
    ],
    # needs a nanoGPT checkout, and trains 2,616 steps: a benchmark, not a smoke test
    "bench_quality.py": None,
    "bench_parallel.py": [
        (
            1,
            ["--world", "1", "--steps", "2", "--checkpointing", "false", "true", *MODEL],
            "activation checkpointing, world 1, ddp: step time",
        ),
    ],
    # Each mode once, a process (or torchrun's) each: the single file and DCP's synchronous save
    # in one process, DCP's background save under torchrun (the sharded path of every mode).
    "bench_snapshot.py": [
        (
            1,
            [
                *("--rounds", "1", "--saves", "2", "--mode", "file", "--mode", "sync"),
                *("--dir", "TMP", "gpt-nano"),
            ],
            "the single file: read",
        ),
        (
            1,
            [
                *("--rounds", "1", "--saves", "2", "--nproc", "2", "--mode", "async"),
                *("--dir", "TMP", "gpt-nano"),
            ],
            "| DCP, in the background |",
        ),
    ],
    "bench_train.py": [
        (2, ["--rounds", "2", *MODEL], "data pipeline "),
        (
            1,
            ["--rounds", "1", "--nanogpt", "NANOGPT", "--compare-only", *MODEL],
            "trainer vs nanoGPT",
        ),
        (
            1,
            ["--profile", "--rounds", "1", "--threads", "1", "--no-compile", *MODEL],
            "profile of the eager step",
        ),
    ],
}

# nanoGPT's interface around mingpt's model, for bench_train --nanogpt; its loss views the targets,
# as nanoGPT's does, so it fails on targets that are not made contiguous.
NANOGPT_STANDIN = """
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mingpt.config import GPTConfig as Shape
from mingpt.model import GPT as Model


@dataclass
class GPTConfig:
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    bias: bool


class GPT(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        print("number of parameters: printed, as nanoGPT's")
        shape = {k: v for k, v in vars(config).items() if k != "bias"}
        self.model = Model(Shape(**shape))

    def forward(self, idx, targets=None):
        logits, _ = self.model(idx)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.parameters(), learning_rate, betas, weight_decay=weight_decay)
"""


def cases() -> list:
    return [
        pytest.param(script, case, id=f"{script}-{k}")
        for script in SCRIPTS
        for k, case in enumerate(SMOKE.get(script) or [None])
    ]


# Each script's `--help`, then each smoke case of one process, all in one process (each script
# imports torch: once, not once a script). A `--help` is captured as Python writes it, a case's
# run at its file descriptors, as `python benchmarks/x.py > out 2> err` would (what its own
# children write there too). On stdout as JSON: {"helps": {script: [exit status, stdout, stderr]},
# "runs": [exit status of each case]}.
ONE_PROCESS = """
import contextlib, io, json, os, runpy, sys, traceback
given = json.loads(sys.argv[1])
answers = {}


def main(path, args):
    # what `python path args` exits with
    sys.argv = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code or 0
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


# as for `python benchmarks/x.py`: its directory first
sys.path.insert(0, os.path.dirname(given["helps"][0]))
for path in given["helps"]:
    out = io.StringIO()
    err = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(path, ["--help"])
    answers[os.path.basename(path)] = [status, out.getvalue(), err.getvalue()]
statuses = []
real = os.dup(1), os.dup(2)
for path, cwd, args, out, err in given["runs"]:
    os.chdir(cwd)
    with open(out, "w") as out_file, open(err, "w") as err_file:
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        statuses.append(main(path, args))
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(real[0], 1)
        os.dup2(real[1], 2)
print(json.dumps({"helps": answers, "runs": statuses}))
"""


def prepared(args: list[str], cwd: Path, data: Path) -> list[str]:
    """A case's arguments with DATA, TMP and NANOGPT made paths in `cwd`."""
    nanogpt = cwd / "nanogpt"
    nanogpt.mkdir()
    (nanogpt / "model.py").write_text(NANOGPT_STANDIN)
    places = {"DATA": data, "TMP": cwd / "scratch", "NANOGPT": nanogpt}
    for name, path in places.items():
        args = [a.replace(name, str(path)) for a in args]
    return args


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus) -> dict:
    """{"helps": {script: [exit status, stdout, stderr]} of its --help, "runs": {(script, k):
    the finished run}} for every smoke case k of one process, each in a directory of its own:
    one child for all (see ONE_PROCESS)."""
    data = tmp_path_factory.mktemp("data") / "small.txt"
    data.write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    runs = {}
    for script in SCRIPTS:
        for k, (nproc, args, _) in enumerate(SMOKE.get(script) or []):
            if nproc == 1:
                cwd = tmp_path_factory.mktemp(f"{script}-{k}")
                runs[script, k] = (cwd, [str(BENCHMARKS / script), *prepared(args, cwd, data)])
    given = {
        "helps": [str(BENCHMARKS / s) for s in SCRIPTS],
        "runs": [
            [argv[0], str(cwd), argv[1:], str(cwd / "stdout.txt"), str(cwd / "stderr.txt")]
            for cwd, argv in runs.values()
        ],
    }
    proc = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, json.dumps(given)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.splitlines()[-1])
    finished = {
        key: subprocess.CompletedProcess(
            argv, status, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text()
        )
        for (key, (cwd, argv)), status in zip(runs.items(), answers["runs"], strict=True)
    }
    return {"helps": answers["helps"], "runs": finished}


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_answers_help(script, one_process):
    status, out, err = one_process["helps"][script]
    assert status in (0, None), err[-3000:]
    assert out.strip() and not err, err[-3000:]


@pytest.mark.parametrize(("script", "case"), cases())
def test_benchmark_runs_at_a_tiny_size(script, case, small_corpus, tmp_path, one_process):
    assert script in SMOKE, f"benchmarks/{script}: say in SMOKE how it runs at a tiny size"
    if case is None:
        pytest.skip(f"benchmarks/{script} cannot run at a tiny size (see SMOKE)")
    nproc, args, expected = case
    if nproc == 1:  # ran in the one process of the module (see ONE_PROCESS)
        proc = one_process["runs"][script, SMOKE[script].index(case)]
    else:
        proc = subprocess.run(
            [*torchrun_cmd(nproc, "--standalone"), str(BENCHMARKS / script)]
            + prepared(args, tmp_path, small_corpus),
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    # where and when it was measured: the CPU, its cores, torch's threads, torch, the date
    assert proc.stdout.count("machine: ") == 1, proc.stdout[-3000:]
    assert " cores, torch " in proc.stdout and " threads | " in proc.stdout


def test_the_users_preset_beats_a_scripts_defaults(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from _common import with_defaults
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
