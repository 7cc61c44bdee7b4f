"""Every script under benchmarks/ runs at a tiny size, in each of its modes, prints where it was
measured and answers --help, so none of them rots; bad input ends a script in one line before any
work; and a script's default overrides never beat the user's."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
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
            [
                *("--size-mb", "1", "--gather", "--repeats", "4", "--steps", "2", "--blocks", "64"),
                *("--dir", "TMP"),
            ],
            "| 64 x 64 |",
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
            # Muon: the bare loop steps the pair of optimizers as torch.optim's
            [
                *("--rounds", "1", "--nanogpt", "NANOGPT", "--compare-only", *MODEL),
                "optimizer_config=muon",
            ],
            "Muon vs AdamW",
        ),
        (
            1,
            ["--profile", "--rounds", "1", "--threads", "1", "--no-compile", *MODEL],
            "profile of the eager step",
        ),
    ],
}

# Bad input that each script refuses in one line, before any work: (arguments, a part of the line).
# DATA, TMP and NANOGPT as in SMOKE, EMPTY an empty directory, SHORT a file of 12 characters.
REFUSED = {
    "bench_comm.py": [
        (["--world", "2"], "unrecognized arguments: --world 2"),
        (
            [*MODEL, "gpt_config.n_layr=1"],
            "unknown key gpt_config.n_layr (did you mean gpt_config.n_layer?",
        ),
        (MODEL, "run it under torchrun with 2 or more processes"),
    ],
    "bench_data.py": [
        (["--size-mb", "1", "--nproc", "0"], "argument --nproc: expected a number >= 1, got 0"),
        (["--size-mb", "-1"], "argument --size-mb: expected a number >= 1, got -1"),
        (["--gather", "--blocks", "0"], "argument --blocks: expected a number >= 1, got 0"),
        (["--gather", "--steps", "1"], "argument --steps: expected a number >= 2, got 1"),
        (["--corpus", "TMP/none.txt"], "argument --corpus: TMP/none.txt: no such file"),
        (["--dir", "DATA"], "argument --dir: DATA: not a directory"),
        # a corpus the cases cannot read: refused before the table, not as a failed case in it
        (
            ["--corpus", "SHORT", "--nproc", "1", "--dir", "TMP"],
            "SHORT: the training split has 10 characters, fewer than",
        ),
        (
            ["--corpus", "DATA", "--gather", "--blocks", "64", "30000", "--dir", "TMP"],
            "argument --blocks: DATA has 20000 characters, fewer than a block of 30000 + 1",
        ),
    ],
    "bench_generate.py": [
        (["--shape", "6/6"], "argument --shape: expected layers/heads/dims"),
        (["--shape", "a/b/c"], "argument --shape: expected layers/heads/dims"),
        (["--shape", "1/3/8"], "the heads (3) must divide the dims (8)"),
        (["--shape", "0/1/8"], "layers, heads and dims are each >= 1"),
        (["--rounds", "0"], "argument --rounds: expected a number >= 1, got 0"),
        (["--threads", "-1"], "argument --threads: expected a number >= 1, got -1"),
        (["--max-new-tokens", "x"], "argument --max-new-tokens: expected a whole number, got 'x'"),
        # no CUDA, or fewer GPUs than 100: refused either way
        (["--device", "cuda:99"], "argument --device: cuda:99, but "),
        (["--device", "gpu"], "argument --device: 'gpu' is not a device"),
        (
            ["--shape", "1/1/8", "--no-compile", "--baseline", "no-such-revision"],
            "'no-such-revision' is not a revision",
        ),
    ],
    "bench_parallel.py": [
        (["--world", "0", "2"], "argument --world: expected a number >= 1, got 0"),
        (["--steps", "1"], "argument --steps: expected a number >= 2, got 1"),
        (["--parallelism", "tp"], "argument --parallelism: invalid choice: 'tp'"),
        (["gpt_config.n_layer=0"], "gpt_config.n_layer: must be >= 1, got 0"),
        (["data_config.path=TMP/none.txt"], "data file not found: TMP/none.txt"),
        (["data_config.path=SHORT"], "SHORT: the training split has 10 characters, fewer than"),
    ],
    "bench_quality.py": [
        ([], "the following arguments are required: --nanogpt"),
        (["--nanogpt", "TMP"], "argument --nanogpt: TMP: no such directory"),
        (["--nanogpt", "EMPTY"], "argument --nanogpt: EMPTY: no model.py in it"),
        (["--nanogpt", "NANOGPT", "--seeds", "0"], "argument --seeds: expected a number >= 1"),
        (["--nanogpt", "NANOGPT", "--out", "DATA"], "argument --out: DATA: not a directory"),
        (
            ["--nanogpt", "NANOGPT", "x=gpt_config.n_layr=1"],
            "unknown key gpt_config.n_layr (did you mean gpt_config.n_layer?",
        ),
        (["--nanogpt", "NANOGPT", "lr"], "'lr': a variant is NAME=key=value,key=value"),
        # a row's name keys its runs and step time: none replaces another
        (
            ["--nanogpt", "NANOGPT", "nanogpt=optimizer_config=muon"],
            "nanogpt is a run of every table (nanogpt, adamw, muon)",
        ),
        (["--nanogpt", "NANOGPT", "adamw="], "adamw is a run of every table"),
        (
            ["--nanogpt", "NANOGPT", "lr=", "lr=optimizer_config.learning_rate=1e-2"],
            "'lr=optimizer_config.learning_rate=1e-2': a variant named lr is given twice",
        ),
    ],
    "bench_snapshot.py": [
        (["--saves", "0"], "argument --saves: expected a number >= 1, got 0"),
        (["--nproc", "0"], "argument --nproc: expected a number >= 1, got 0"),
        (["--device", "gpu"], "argument --device: 'gpu' is not a device"),
        (["--dir", "DATA"], "argument --dir: DATA: not a directory"),
        (["--nproc", "2", "--mode", "file"], "--mode file: the single file is one process's"),
        (["--mode", "file", "gpt-none"], "Could not find 'gpt_config/gpt-none'"),
    ],
    "bench_train.py": [
        (["--rounds", "0"], "argument --rounds: expected a number >= 1, got 0"),
        (["--threads", "0"], "argument --threads: expected a number >= 1, got 0"),
        (["--nanogpt", "TMP"], "argument --nanogpt: TMP: no such directory"),
        (["--nanogpt", "EMPTY"], "argument --nanogpt: EMPTY: no model.py in it"),
        (["stray"], "unrecognized arguments: stray"),
        (
            [*MODEL, "gpt_config.n_layr=2"],
            "unknown key gpt_config.n_layr (did you mean gpt_config.n_layer?",
        ),
        ([*MODEL, "gpt_config.n_layer=abc"], "gpt_config.n_layer: Value 'abc' of type 'str'"),
        ([*MODEL, "gpt_config=none"], "Could not find 'gpt_config/none'"),
        ([*MODEL, "gpt_config.n_head=3"], "gpt_config.n_embd: 16 is not divisible by"),
        ([*MODEL, "gpt_config.n_layer=[1"], "cannot parse the override 'gpt_config.n_layer=[1'"),
        ([*MODEL, "data_config.path=TMP/none.txt"], "data file not found: TMP/none.txt"),
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


def refusals() -> list:
    return [
        pytest.param(script, k, id=f"{script}-{k}")
        for script in SCRIPTS
        for k in range(len(REFUSED.get(script, [])))
    ]


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
sys.path.insert(0, given["benchmarks"])
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
    """A case's arguments with DATA, TMP, NANOGPT, EMPTY and SHORT made paths in `cwd`."""
    nanogpt = cwd / "nanogpt"
    nanogpt.mkdir(exist_ok=True)
    (nanogpt / "model.py").write_text(NANOGPT_STANDIN)
    (cwd / "empty").mkdir(exist_ok=True)
    (cwd / "short.txt").write_text("hello world\n", encoding="utf-8")
    places = {
        "DATA": data,
        "TMP": cwd / "scratch",
        "NANOGPT": nanogpt,
        "EMPTY": cwd / "empty",
        "SHORT": cwd / "short.txt",
    }
    for name, path in places.items():
        args = [a.replace(name, str(path)) for a in args]
    return args


def in_one_process(helps: list[str], runs: dict) -> dict:
    """{"helps": {script: [exit status, stdout, stderr]} of each script in `helps` asked for
    --help, "runs": {key: the finished run}} of `runs` ({key: (its directory, [script, arguments
    ...])}): one child for all (see ONE_PROCESS)."""
    given = {
        "benchmarks": str(BENCHMARKS),
        "helps": [str(BENCHMARKS / s) for s in helps],
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


def small_data(tmp_path_factory, corpus) -> Path:
    data = tmp_path_factory.mktemp("data") / "small.txt"
    data.write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus) -> dict:
    """Every script's --help, and every smoke case k of one process as runs[script, k], each in a
    directory of its own, in one child (see in_one_process)."""
    data = small_data(tmp_path_factory, corpus)
    runs = {}
    for script in SCRIPTS:
        for k, (nproc, args, _) in enumerate(SMOKE.get(script) or []):
            if nproc == 1:
                cwd = tmp_path_factory.mktemp(f"{script}-{k}")
                runs[script, k] = (cwd, [str(BENCHMARKS / script), *prepared(args, cwd, data)])
    return in_one_process(SCRIPTS, runs)


@pytest.fixture(scope="module")
def refused(tmp_path_factory, corpus) -> dict:
    """{(script, k): the finished run, and the part of its line expected} of every case of
    REFUSED, in one child (see in_one_process)."""
    data = small_data(tmp_path_factory, corpus)
    runs = {}
    expected = {}
    for script in SCRIPTS:
        for k, (args, part) in enumerate(REFUSED.get(script, [])):
            cwd = tmp_path_factory.mktemp(f"refused-{script}-{k}")
            runs[script, k] = (cwd, [str(BENCHMARKS / script), *prepared(args, cwd, data)])
            expected[script, k] = prepared([part], cwd, data)[0]
    finished = in_one_process([], runs)["runs"]
    return {key: (proc, expected[key]) for key, proc in finished.items()}


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


@pytest.mark.parametrize(("script", "k"), refusals())
def test_bad_input_is_refused_in_one_line(script, k, refused):
    proc, part = refused[script, k]
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output, output[-3000:]
    assert proc.returncode == 2, output[-3000:]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("error: ") and part in lines[0], lines[0]


def test_every_script_has_refused_inputs():
    assert sorted(REFUSED) == SCRIPTS


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


def test_the_step_comparison_accumulates_as_the_trainer_does(monkeypatch):
    """With grad_accum_steps, Trainer.train_step takes that many micro-batches: the bare loop takes
    as many (DDP's all-reduce in the last alone), and the rows count an optimizer step's tokens."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_train
    from _common import Plain, training_config

    from mingpt import flops
    from mingpt.distributed import DistInfo

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    held_back = []

    @contextlib.contextmanager
    def no_sync():
        held_back.append(1)
        yield

    def forward(x, y):
        return None, F.mse_loss(model(x), y)

    drawn = []

    def batches():
        drawn.append(1)
        return torch.ones(4, 2), torch.zeros(4, 1)

    p = Plain(model, forward, optimizer, 1.0, no_sync)
    bench_train.plain_steps(p, batches, None, steps=2, accumulate=3)
    assert (len(drawn), len(steps), len(held_back)) == (6, 2, 4)

    config = training_config(
        [],
        [
            "data_config.block_size=8",
            "trainer_config.batch_size=2",
            "trainer_config.grad_accum_steps=4",
            CPU,
        ],
    )
    config.gpt_config.vocab_size = 5
    config.gpt_config.block_size = 8
    monkeypatch.setattr(flops, "peak_rate", lambda device, dtype: 1e9)
    one = DistInfo(
        rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu")
    )
    rows = dict(bench_train.step_rows(config, one, {"bare loop": 0.5, "trainer": 0.5}, rounds=1))
    # 2 windows x 4 micro-batches x 8 tokens a step, a step in 0.5 s
    assert rows["trainer"].startswith("128 tokens/s, 500.00 ms/step"), rows["trainer"]
    assert rows["trainer overhead"].startswith("+0.0% per step"), rows["trainer overhead"]


def test_the_step_breakdown_times_a_whole_step(monkeypatch):
    """With grad_accum_steps, a step's phases are its micro-batches' reads, forwards and backwards,
    one all-reduce after the last backward, and one optimizer step."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import itertools
    from types import SimpleNamespace

    import bench_train
    from _common import Plain, training_config

    from mingpt.distributed import DistInfo

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def forward(x, y):
        return None, F.mse_loss(model(x), y)

    p = Plain(model, forward, optimizer, 1.0, contextlib.nullcontext)
    ddp = SimpleNamespace(no_sync=contextlib.nullcontext)
    reduced = []
    monkeypatch.setattr(bench_train, "bare", lambda config, info: (p, ddp))
    monkeypatch.setattr(
        bench_train, "Batches", lambda *a, **k: lambda: (torch.ones(4, 2), torch.zeros(4, 1))
    )
    monkeypatch.setattr(bench_train, "all_reduce_gradients", lambda *a: reduced.append(1))
    # Each reading of the clock a second later: a phase's time counts its marks.
    monkeypatch.setattr(bench_train.time, "perf_counter", itertools.count().__next__)
    config = training_config([], ["trainer_config.grad_accum_steps=3", CPU])
    two = DistInfo(
        rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu")
    )
    per_step = bench_train.phases(config, None, two, steps=2)
    assert per_step == {"data": 3, "forward": 3, "backward": 3, "allreduce": 1, "optimizer": 1}
    assert len(reduced) == 2


def test_bench_comm_counts_an_optimizer_step(monkeypatch):
    """With grad_accum_steps, each counted step is Trainer.train_step over all of a step's windows
    (its micro-batches), not over one micro-batch's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from types import SimpleNamespace

    import bench_comm

    given = []

    @contextlib.contextmanager
    def trainer(config, info, data):
        yield SimpleNamespace(samples_per_step=2 * 3)

    monkeypatch.setattr(bench_comm, "trainer", trainer)
    monkeypatch.setattr(bench_comm, "step", lambda t, indices: given.append(len(indices)))
    monkeypatch.setattr(bench_comm.dist, "barrier", lambda: None)
    config = SimpleNamespace(trainer_config=SimpleNamespace(batch_size=2, grad_accum_steps=3))
    data = SimpleNamespace(train=range(100))
    bench_comm.measure(config, data, SimpleNamespace(rank=0), "fp16")
    assert given == [6] * (bench_comm.START + bench_comm.STEPS)


def test_bench_data_labels_its_memory_in_the_unit_it_counts(monkeypatch):
    """ru_maxrss and smaps_rollup count KiB: divided by 1024 they are MiB, and so labeled."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_data

    with open("/proc/self/smaps_rollup") as f:
        kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f.readlines()[1:])}
    memory = bench_data.memory_mib()
    assert abs(memory["anonymous"] - kib["Anonymous"] / 1024) < 64  # the process grows between
    memory_columns = [c for k, c in bench_data.COLUMNS.items() if k.endswith("_mib")]
    assert len(memory_columns) == 3
    assert all(c.endswith("(MiB)") for c in memory_columns), memory_columns
