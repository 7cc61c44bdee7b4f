"""Shared test helpers: the corpus, tiny configs, and running the real CLI and torchrun."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

# A model and run small enough to train in seconds on one CPU core.
TINY = [
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
    """The first CORPUS_CHARS characters of the corpus (a constant of the test module), as a file."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(corpus.read_text(encoding="utf-8")[: request.module.CORPUS_CHARS], encoding="utf-8")
    return path


@pytest.fixture
def one_thread():
    """In-process work on one thread, like the subprocesses (child_env): the
    cores are shared, and extra threads of tiny models only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def run_main(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python main.py ARGS` in `cwd` (a scratch directory: runs/ lands there)."""
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout,
    )


def run_dir_of(cwd: Path, args: list[str]) -> Path:
    """The run directory `python main.py ARGS` started in `cwd` uses: Hydra's
    hydra.run.dir composed from ARGS (runs/<run_name>, plus a hash of the
    result-affecting values when they are not the defaults)."""
    from hydra import compose, initialize_config_dir

    from mingpt.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return cwd / compose("config", overrides=list(args), return_hydra_config=True).hydra.run.dir


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra]


def run_torchrun(nproc: int, args: list[str], cwd: Path, torchrun_args=(), timeout: float = 180):
    """`torchrun --standalone --nproc_per_node=N main.py ARGS` in `cwd`."""
    cmd = torchrun_cmd(nproc, "--standalone", *torchrun_args) + [str(REPO / "main.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout)


__all__ = ["REPO", "TINY", "free_port", "run_dir_of", "run_main", "run_torchrun", "torchrun_cmd", "child_env", "shutil"]
