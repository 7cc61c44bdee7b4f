"""Shared test helpers: the corpus, tiny configs, and running the real CLI and torchrun."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

# Tests say which device they mean: on a GPU host `device=auto` would give every
# rank CUDA (and refuse a second rank on a 1-GPU host). First, so a later override wins.
CPU = "trainer_config.device=cpu"

# Seconds a real process (one that imports torch and runs) may take before a test calls it hung:
# many times a tiny run's seconds. A 60-step run that takes 8 s alone once ran past 120 s on a
# machine loaded several times over; shorter deadlines failed healthy runs there.
RUN_DEADLINE = 300

# A model and run small enough to train in seconds on one CPU core.
TINY = [
    CPU,
    "gpt_config.n_layer=2",
    "gpt_config.n_head=2",
    "gpt_config.n_embd=32",
    "data_config.block_size=16",
    "data_config.stride=16",
    "trainer_config.batch_size=8",
    "trainer_config.log_every=5",
    "trainer_config.eval_every=0",
    "trainer_config.sample_chars=20",
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The tiny-shakespeare text: data/input.txt, else the shared copy, else
    downloaded to data/input.txt (as `python main.py` would)."""
    for candidate in (REPO / "data" / "input.txt", SHARED_CORPUS):
        if candidate.exists():
            return candidate
    from mingpt.data import DataError, download_corpus

    try:
        download_corpus(str(REPO / "data" / "input.txt"))
    except DataError as e:
        pytest.fail(f"no corpus: {e}")
    return REPO / "data" / "input.txt"


@pytest.fixture
def small_corpus(tmp_path, corpus) -> Path:
    """The first 20,000 characters of the corpus, as a file of its own."""
    path = tmp_path / "small.txt"
    path.write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory, corpus, request) -> Path:
    """The first CORPUS_CHARS characters of the corpus
    (a constant of the test module), as a file."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(
        corpus.read_text(encoding="utf-8")[: request.module.CORPUS_CHARS], encoding="utf-8"
    )
    return path


# A tiny run that evaluates (every 20 steps, and at
# its end): the snapshot and metrics of a real run.
TINY_RUN = TINY + [
    "data_config.path=small.txt",
    "trainer_config.run_name=tiny",
    "trainer_config.max_steps=60",
    "trainer_config.eval_every=20",
    "optimizer_config.learning_rate=1e-2",
    "optimizer_config.warmup_steps=10",
]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpus) -> tuple[Path, Path]:
    """(the directory `python main.py TINY_RUN` ran in, its run directory), trained on
    the first 20,000 characters of the corpus (small.txt there) in a few seconds."""
    cwd = tmp_path_factory.mktemp("tiny-run")
    (cwd / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    result = run_main(TINY_RUN, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, run_dir_of(cwd, TINY_RUN)


@pytest.fixture(scope="session")
def tiny_file(tiny_run) -> Path:
    """The tiny run's snapshot as the single file that `mingpt.export format=snapshot` writes."""
    from mingpt.snapshot import single_file

    path = tiny_run[1].parent / "tiny-snapshot.pt"
    single_file.save(read_snapshot(tiny_run[1] / "snapshots"), str(path))
    return path


@pytest.fixture
def one_thread():
    """In-process work on one thread, like the subprocesses (child_env): the
    cores are shared, and extra threads of tiny models only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A real 256 KB file system (tmpfs) to fill up, unmounted afterwards; the test
    is skipped where it cannot be mounted (not root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def unlistable(tmp_path) -> tuple[Path, list[str]]:
    """(A directory its user may not list, the command prefix under which that holds): for root,
    setpriv drops the capabilities that bypass file permissions. The test is skipped where they
    cannot be dropped."""
    locked = tmp_path / "locked"
    locked.mkdir()
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop the override of file permissions")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    locked.chmod(0)
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])", str(locked)],
        capture_output=True,
    )
    if probe.returncode == 0:
        locked.chmod(0o755)
        pytest.skip("file permissions do not hold here")
    yield locked, prefix
    locked.chmod(0o755)  # so that pytest can remove it


def read_snapshot(path) -> dict:
    """A snapshot (a root: its newest; or one step directory) read whole in this process, in the
    single file's layout: its record, `model_state`, and `optimizer_state` keyed by parameter
    index as torch.optim keeps it; the comm hook's per-rank states as {name, world_size, ranks}."""
    from mingpt.snapshot import manifest, sharded

    tensors, meta = sharded.load_full(str(path))
    optim = tensors.get("optim") or {"state": {}, "param_groups": []}
    names = [name for group in optim["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [index[name] for name in g["params"]]} for g in optim["param_groups"]]
    by_index = {index[name]: value for name, value in optim["state"].items() if name in index}
    state = {
        **meta,
        "model_state": dict(tensors.get("model", {})),
        "optimizer_state": {"state": by_index, "param_groups": groups},
    }
    directory = manifest.resolve(str(path))
    snapshot = sharded._read(directory)
    document = snapshot.document
    metadata = snapshot.metadata
    own = []
    for rank, structure in enumerate(document.get("ranks") or []):
        flat = sharded._empty(directory, sharded._tensor_keys(structure), metadata)
        if flat:
            sharded._dcp_load(flat, directory, metadata, no_dist=True)
        own.append(sharded._unflatten(structure, flat)[f"{sharded.OWN}{rank}"])
    if own:
        state["comm_hook"] = {**document["meta"]["comm_hook"], "ranks": own}
    return state


def tree_bytes(path) -> dict[str, bytes]:
    """Every file under `path` (a directory or a file): {path relative to it: its bytes}."""
    path = Path(path)
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


# Hydra's options that take a value: main.py's overrides must stay together around them.
VALUE_OPTIONS = {
    "--config-dir",
    "-cd",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--experimental-rerun",
}


def on_cpu(args: list[str]) -> list[str]:
    """ARGS with CPU as the first override (a later one naming another device wins), placed
    among the other overrides: argparse refuses overrides on both sides of an option."""
    cpu = f"++{CPU}"  # ++: also into a user's own config file that lacks the key
    for i, arg in enumerate(args):
        if not arg.startswith("-") and not (i and args[i - 1] in VALUE_OPTIONS):
            return [*args[:i], cpu, *args[i:]]
    return [*args, cpu]


def run_main(
    args: list[str], cwd: Path, timeout: float = RUN_DEADLINE, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python main.py ARGS` in `cwd` (a scratch directory: runs/ lands there), on
    the CPU unless ARGS name another device, with `env` added to its environment."""
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *on_cpu(args)],
        cwd=cwd,
        env={**child_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Each case through its module's main in one child process, one after another: a start (mostly
# importing torch) for all. After each, its exit status behind a NUL on stdout and on stderr:
# the streams are the real ones, so that what torch writes to them directly is seen too.
EACH_CASE = """
import importlib, json, os, sys, traceback
cases = json.loads(sys.argv[1])


def code(text):
    # as `python -c TEXT` runs it
    return lambda: exec(compile(text, "<string>", "exec"), {"__name__": "__main__"})


for cwd, argv, module in cases:
    main = code(argv[0]) if module == "-c" else importlib.import_module(module).main
    os.chdir(cwd)
    sys.argv = ["-c", *argv[1:]] if module == "-c" else [module, *argv]
    try:
        main()
        status = 0
    except SystemExit as e:
        status = e.code or 0
    except Exception:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"\\0exit status {status}\\n")
        stream.flush()
"""


def run_each(
    module: str,
    cases: list[tuple[Path, list[str]] | tuple[Path, list[str], str]],
    timeout=RUN_DEADLINE,
) -> list[subprocess.CompletedProcess]:
    """What `python -m MODULE ARGV` in CWD gives for each (CWD, ARGV) of `cases`, or (CWD, ARGV,
    ITS MODULE) for another command (module "-c": `python -c ARGV[0] ARGV[1:]`): its exit status,
    stdout and stderr. For commands that end quickly (refusals, a finished run, a sample): one
    start for all."""
    given = [[str(case[0]), case[1], case[2] if len(case) > 2 else module] for case in cases]
    proc = subprocess.run(
        [sys.executable, "-c", EACH_CASE, json.dumps(given)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = re.split(r"\0exit status (\S+)\n", proc.stdout)
    errs = re.split(r"\0exit status (\S+)\n", proc.stderr)
    assert len(outs) == len(errs) == 2 * len(cases) + 1, proc.stderr[-3000:]
    assert outs[-1] == errs[-1] == "" and outs[1::2] == errs[1::2], proc.stderr[-3000:]
    return [
        subprocess.CompletedProcess(argv, int(status), out, err)
        for (_, argv, _), status, out, err in zip(
            given, errs[1::2], outs[:-1:2], errs[:-1:2], strict=True
        )
    ]


# A run_each case's `python -c` code: a copy of directory ARGV[1] at ARGV[2].
COPY = "import shutil, sys\nshutil.copytree(sys.argv[1], sys.argv[2])\n"


def run_dir_of(cwd: Path, args: list[str]) -> Path:
    """The run directory `python main.py ARGS` started in `cwd` uses: Hydra's
    hydra.run.dir composed from ARGS (runs/<run_name>, whatever the other values)."""
    from hydra import compose, initialize_config_dir

    from mingpt.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return cwd / compose("config", overrides=list(args), return_hydra_config=True).hydra.run.dir


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra]


def run_torchrun(
    nproc: int, args: list[str], cwd: Path, torchrun_args=(), timeout: float = RUN_DEADLINE
):
    """`torchrun --standalone --nproc_per_node=N main.py ARGS` in `cwd`, on the CPU
    (gloo) unless ARGS name another device."""
    cmd = torchrun_cmd(nproc, "--standalone", *torchrun_args) + [
        str(REPO / "main.py"),
        *on_cpu(args),
    ]
    return subprocess.run(
        cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout
    )


FAKE_CUDA_DIR = REPO / "tests" / "fake_cuda"


def fake_cuda_env(gpus: int = 1, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: child_env()) for a child process that sees a host with `gpus`
    GPUs: torch.cuda.is_available() is True there (tests/fake_cuda/sitecustomize.py),
    though no CUDA work can run. A CPU job must not notice."""
    env = dict(child_env() if env is None else env)
    env["PYTHONPATH"] = str(FAKE_CUDA_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env["MINGPT_TEST_FAKE_CUDA"] = str(gpus)
    return env


def real_cuda() -> bool:
    """A GPU this process can use (not one simulated by tests/fake_cuda)."""
    return (
        not os.environ.get("MINGPT_TEST_FAKE_CUDA")
        and torch.cuda.is_available()
        and torch.cuda.device_count() > 0
    )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it installed, never called
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one test worker per core this process may use, at most 8 (a
    worker's test can start four training processes of a few hundred MB each)."""
    return max(
        1,
        min(
            8,
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1,
        ),
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run only where a GPU is; elsewhere they are skipped, saying so."""
    if real_cuda():
        return
    why = (
        "CUDA is simulated (MINGPT_TEST_FAKE_CUDA)"
        if os.environ.get("MINGPT_TEST_FAKE_CUDA")
        else f"needs a CUDA GPU; this host has none (torch {torch.__version__}, "
        f"built {'with' if torch.backends.cuda.is_built() else 'without'} CUDA)"
    )
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def own_cache_directory(tmp_path_factory):
    """The tests' compiled decoding steps are kept in a directory of their own, for the session and
    the commands it starts, never in the user's cache (XDG_CACHE_HOME, put back after)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


# Set by pytest itself (per phase), by torch for the rest of the process at its first compile
# (inductor's and triton's settings and cache directories), and by Intel's OpenMP settings that a
# library imported with transformers sets at its first import on some hosts (KMP_*, seen on the
# GPU image).
NOT_A_TESTS_CHANGE = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_", "KMP_")


@pytest.fixture(autouse=True)
def environment_unchanged(request):
    """No test may leave the process environment changed: a later test in the same
    process would inherit it (LOCAL_RANK, say, makes a single-process run look like
    a torchrun rank). monkeypatch.setenv/delenv is undone before this check."""
    before = {k: v for k, v in os.environ.items() if not k.startswith(NOT_A_TESTS_CHANGE)}
    yield
    after = {k: v for k, v in os.environ.items() if not k.startswith(NOT_A_TESTS_CHANGE)}
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        for k in changed:  # the next tests start clean
            if k in before:
                os.environ[k] = before[k]
            else:
                del os.environ[k]
        pytest.fail(f"the test left os.environ changed: {', '.join(changed)}", pytrace=False)


__all__ = [
    "COPY",
    "CPU",
    "REPO",
    "TINY",
    "TINY_RUN",
    "RUN_DEADLINE",
    "fake_cuda_env",
    "real_cuda",
    "free_port",
    "run_dir_of",
    "run_each",
    "run_main",
    "run_torchrun",
    "torchrun_cmd",
    "child_env",
    "shutil",
]
