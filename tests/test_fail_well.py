"""Failing well: damaged snapshots, storage faults, divergence, and bad input
that once ended in a traceback. Each ends with one `error:` line and exit
status 2 (in-process: the one exception that becomes that line), and nothing
good is lost.

One tiny snapshot is trained in-process once (a Distributed Checkpoint under the
run's `snapshots`); the single file that export writes from it (what generate,
score, export and init_from read) gives the damaged variants of that format, and
the command-line runs go two at a time.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import logging.handlers
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import REPO, RUN_DEADLINE, TINY, child_env, free_port, on_cpu, run_each, run_main
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from mingpt import cli, storage
from mingpt.cli import CONF_DIR
from mingpt.command import parse_args
from mingpt.config import Config, ConfigError, GPTConfig
from mingpt.decoding import generate
from mingpt.distributed import DistInfo
from mingpt.export import ExportConfig, export
from mingpt.generate import GenerateConfig
from mingpt.run import build, build_model
from mingpt.snapshot import SnapshotError, manifest, single_file
from mingpt.snapshot.reader import load_model
from mingpt.trainer import Trainer, TrainingError


def overrides(corpus: Path, *extra: str) -> list[str]:
    """TINY on CPU without samples on `corpus`, then
    `extra` (a later key replaces an earlier one)."""
    merged = {}
    for item in [
        *TINY,
        "trainer_config.device=cpu",
        "trainer_config.sample_chars=0",
        f"data_config.path={corpus}",
        *extra,
    ]:
        key, value = item.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def make_trainer(run_dir: Path, corpus: Path, *extra: str) -> Trainer:
    """A single-process Trainer built as main.py builds it."""
    dotlist = overrides(corpus, *extra)
    config = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    )
    return build(config, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(run_dir))


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, and stderr ends in exactly one
    `error:` line holding every fragment, no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and proc.stderr.rstrip().endswith(lines[0]), proc.stderr[-3000:]
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def flip_byte(data: bytes, record: str, offset: int = 5) -> bytes:
    """`data` (a torch.save zip) with one bit flipped inside the bytes of `record`."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record))
    name_len, extra_len = (
        int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    start = info.header_offset + 30 + name_len + extra_len
    damaged = bytearray(data)
    damaged[start + offset] ^= 0x01
    return bytes(damaged)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by its path relative
    to it: a snapshot root compared byte for byte."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def flip_shard_byte(root: Path) -> Path:
    """Flip one bit in the middle of the newest snapshot's shard under `root`; the shard's path."""
    (shard,) = Path(manifest.latest(str(root))).glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def strict_json(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"non-finite {constant} in {line}")

    return json.loads(line, parse_constant=refuse)


@pytest.fixture(scope="module")
def snap(tmp_path_factory, corpus):
    """A 3-step run of the tiny model (in-process,
    one thread): (work directory, its snapshot root)."""
    work = tmp_path_factory.mktemp("fail-well")
    (work / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        make_trainer(work / "run", work / "small.txt", "trainer_config.max_steps=3").train()
    finally:
        torch.set_num_threads(threads)
    return work, work / "run" / "snapshots"


@pytest.fixture(scope="module")
def snap_file(snap) -> Path:
    """The snapshot exported as one file (export --format snapshot), the format the readers take."""
    work, root = snap
    export(ExportConfig(str(root), str(work / "snapshot.pt"), "snapshot"))
    return work / "snapshot.pt"


def save_variant(snap_file, name: str, change) -> Path:
    """A valid torch file (checksums right) holding the
    exported snapshot's state after `change(state)`."""
    state = torch.load(snap_file, weights_only=True)
    change(state)
    target = snap_file.parent / name
    torch.save(state, target)
    return target


# ------------------------------------------------------- command-line runs


def generate_cmd(*args: str) -> list[str]:
    """generate on the CPU, whatever devices the host has (a later device= wins)."""
    return [sys.executable, "-m", "mingpt.generate", "device=cpu", *args]


def limit_file_size(limit: int):
    """For preexec_fn: writes past `limit` bytes fail
    with EFBIG (instead of SIGXFSZ killing the process)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.fixture(scope="module")
def runs(snap, tmp_path_factory) -> dict:
    """Each bad case through the real command, two processes at a time; {case: finished process},
    with each argv of refused_invocations ("refused invocations": (the directory they ran in, the
    argvs and their lines))."""
    work, good = snap
    small = work / "small.txt"
    shutil.copytree(good, work / "resume" / "snapshots")
    flip_shard_byte(work / "resume" / "snapshots")
    (work / "afile").write_text("a file where a directory should be\n")
    # A run that resumes the good snapshot at step 3 and saves at step 6 into a
    # file-size limit of half its shard: the write fails part-way through.
    shutil.copytree(good, work / "full" / "snapshots")
    (shard,) = Path(manifest.latest(str(good))).glob("*.distcp")
    env = child_env()

    def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("stdout", subprocess.PIPE)
        return subprocess.run(
            args,
            cwd=work,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            timeout=RUN_DEADLINE,
            **kwargs,
        )

    # refused at start: one process for the three and refused_invocations' (each run is mostly
    # importing torch)
    refusals = {
        "resume_damaged": overrides(
            small,
            "trainer_config.max_steps=3",
            f"trainer_config.snapshot_path={work / 'resume' / 'snapshots'}",
        ),
        "interpolation": overrides(small, "data_config.path=${nope}"),
        "unwritable": overrides(
            small,
            "trainer_config.run_name=unwritable",
            f"trainer_config.snapshot_path={work / 'afile' / 'snapshots'}",
        ),
    }
    invocations = tmp_path_factory.mktemp("refused-invocations")
    invoked = refused_invocations(invocations)
    cases = {
        "refusals": lambda: run_each(
            "mingpt.cli",
            [(work, on_cpu(args)) for args in refusals.values()]
            + [(invocations / "work", list(argv)) for argv in invoked],
        ),
        "save_fails": lambda: run(
            [
                sys.executable,
                str(REPO / "main.py"),
                *overrides(
                    small,
                    "trainer_config.max_steps=6",
                    "trainer_config.allow_config_change=true",
                    f"hydra.run.dir={work / 'full'}",
                ),
            ],
            preexec_fn=limit_file_size(shard.stat().st_size // 2),
        ),
        "stdout_closed": lambda: run(
            generate_cmd(f"snapshot_path={good}", "max_new_tokens=5"),
            stdout=subprocess.DEVNULL,
            preexec_fn=lambda: os.close(1),
        ),
    }
    with open("/dev/full", "w") as full:
        cases["dev_full"] = lambda: run(
            generate_cmd(f"snapshot_path={good}", "max_new_tokens=5"), stdout=full
        )
        with ThreadPoolExecutor(2) as pool:
            results = dict(zip(cases, pool.map(lambda case: case(), cases.values()), strict=True))
    results.update(zip([*refusals, *invoked], results.pop("refusals"), strict=True))
    results["refused invocations"] = (invocations, invoked)
    return results


# ---------------------------------------------------------------- integrity


def test_torch_records_carry_real_checksums(snap_file):
    """The zip's CRC-32s are real (torch computes them): a flipped bit is found in any record."""
    data = snap_file.read_bytes()
    single_file.verify(data, "good")
    for record in ("data.pkl", "data/0", "data/3"):
        with pytest.raises(
            SnapshotError,
            match=rf"snapshot x is damaged: the checksum of its record "
            rf"\S*{record} does not match",
        ):
            single_file.verify(flip_byte(data, record), "x")


def test_resume_from_a_damaged_snapshot_stops_and_keeps_it(snap, runs, tmp_path):
    """One flipped bit in a shard: resume stops (it used to say 'run already complete', exit 0)."""
    work, good = snap
    root = work / "resume" / "snapshots"
    directory = manifest.latest(str(root))
    one_error_line(
        runs["resume_damaged"],
        f"snapshot {directory} is damaged: __0_0.distcp does not match its size "
        "and sha256 in manifest.json",
    )
    shutil.copytree(good, tmp_path / "damaged")  # the same damage to a copy of the good snapshot...
    flip_shard_byte(tmp_path / "damaged")
    # ...is all there is: left for inspection
    assert tree_bytes(root) == tree_bytes(tmp_path / "damaged")


def test_generate_refuses_a_damaged_snapshot(snap_file, tmp_path):
    """(test_generate checks that a SnapshotError is one line of the command.)"""
    (tmp_path / "damaged.pt").write_bytes(flip_byte(snap_file.read_bytes(), "data/0"))
    with pytest.raises(
        SnapshotError, match=f"snapshot {tmp_path / 'damaged.pt'} is damaged: the checksum"
    ):
        load_model(str(tmp_path / "damaged.pt"), torch.device("cpu"))


def test_damaged_pickle_is_reported_as_damage(snap_file, tmp_path):
    """Damage in data.pkl is damage, not 'pickled objects other than tensors ... ()'."""
    data = snap_file.read_bytes()
    (tmp_path / "flipped.pt").write_bytes(flip_byte(data, "data.pkl", offset=0))
    with pytest.raises(SnapshotError, match=r"is damaged: the checksum of its record \S*data.pkl"):
        single_file.load(str(tmp_path / "flipped.pt"))
    # The same damage with the checksums rewritten to match: the pickle itself cannot be read.
    rewritten = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(rewritten, "w") as dst:
        for info in src.infolist():
            content = src.read(info)
            if info.filename.endswith("data.pkl"):
                content = bytes([content[0] ^ 0xFF]) + content[1:]
            dst.writestr(info.filename, content)
    (tmp_path / "rewritten.pt").write_bytes(rewritten.getvalue())
    with pytest.raises(SnapshotError) as e:
        single_file.load(str(tmp_path / "rewritten.pt"))
    assert "is damaged (its pickle cannot be read" in str(e.value) and "()" not in str(e.value), (
        str(e.value)
    )


WRONG_FIELDS = {
    "gpt_config": ([1, 2], "gpt_config must be a mapping, got list"),
    "vocab": (65, "vocab must be a string, got int"),
    "model_state": (
        [torch.zeros(2)],
        "model_state must be a mapping of names to tensors, got list",
    ),
    "epoch": ("0", "epoch must be a whole number >= 0, got str"),
    "step": (-1, "step must be a whole number >= 0, got -1"),
    "best_step": (True, "best_step must be a whole number >= 0, got bool"),
    "last_eval_loss": ("1.5", "last_eval_loss must be a number or null, got str"),
    "stopped_early": (1, "stopped_early must be true or false, got int"),
    "eval_due": ("false", "eval_due must be true or false, got str"),
}


@pytest.mark.parametrize("field", WRONG_FIELDS)
def test_snapshot_fields_of_the_wrong_type_are_refused(snap_file, field):
    value, message = WRONG_FIELDS[field]
    path = save_variant(snap_file, f"wrong-{field}.pt", lambda s: s.update({field: value}))
    with pytest.raises(SnapshotError, match=f"snapshot {path} is not usable: {message}"):
        single_file.load(str(path))


def test_snapshot_weights_that_are_not_floats_are_refused(snap_file):
    path = save_variant(
        snap_file,
        "int-weights.pt",
        lambda s: s["model_state"].update({"wte.weight": torch.zeros(2, dtype=torch.long)}),
    )
    not_float = r"model_state\['wte.weight'\] is torch.int64, not a float tensor"
    with pytest.raises(SnapshotError, match=not_float):
        single_file.load(str(path))


def test_generate_samples_from_float64_weights(snap_file, one_thread):
    """Weights saved in float64 are used as float32 (a 'mixed dtype' traceback before)."""
    path = save_variant(
        snap_file,
        "float64.pt",
        lambda s: s.update(model_state={k: v.double() for k, v in s["model_state"].items()}),
    )
    model, tokenizer, _ = load_model(str(path), torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (
        sum(chunk.size(1) for chunk in generate(model, tokenizer.encode("\n").long()[None], 5)) == 5
    )


def test_generate_refuses_non_finite_weights(snap_file):
    path = save_variant(
        snap_file,
        "nonfinite.pt",
        lambda s: s["model_state"]["h.0.attn.c_attn.weight"][0].fill_(math.nan),
    )
    with pytest.raises(
        SnapshotError,
        match=f"snapshot {path} has non-finite weights .nan or inf in h.0.attn.c_attn.weight.",
    ):
        load_model(str(path), torch.device("cpu"))


# --------------------------------------------------------------- divergence


def test_divergence_with_evaluation_before_logging(tmp_path, small_corpus, one_thread):
    """eval_every < log_every, no snapshot yet: the run stops with a truthful
    line (it used to crash in sampling), and the logs hold only finite numbers."""
    trainer = make_trainer(
        tmp_path,
        small_corpus,
        "optimizer_config.learning_rate=1e6",
        "trainer_config.eval_every=1",
        "trainer_config.log_every=1000",
        "trainer_config.sample_chars=20",
        "trainer_config.max_steps=50",
        "optimizer_config.warmup_steps=0",
    )
    with pytest.raises(
        TrainingError, match=r"^training diverged: .* at step \d; no snapshot was written yet "
    ):
        trainer.train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    # finite, or not written at all
    assert all(strict_json(line)["split"] == "eval" for line in lines)
    assert not (tmp_path / "snapshots").exists()


# ----------------------------------------------------------------- storage


def test_unwritable_snapshot_location_stops_before_training(snap, runs):
    """A file where the snapshot's directory should be:
    refused at start, not after training to the first save."""
    work, _ = snap
    proc = runs["unwritable"]
    one_error_line(proc, f"cannot write to the snapshot path {work / 'afile' / 'snapshots'}")
    assert "train step" not in proc.stderr and not list(work.glob("runs/unwritable*/metrics.jsonl"))


def test_a_file_where_the_default_corpus_directory_should_be_is_one_line(tmp_path):
    """The default corpus is missing and `data` is a file, so it cannot be downloaded there: one
    line (the directory's creation was outside the download's error handling: a traceback)."""
    (tmp_path / "data").write_text("not a directory\n")
    proc = run_main(["trainer_config.max_steps=1"], tmp_path)
    one_error_line(proc, "data/input.txt is missing and could not be downloaded", "'data'")
    assert (tmp_path / "data").read_text() == "not a directory\n"


@pytest.mark.parametrize("path", [None, "./data/input.txt"])
def test_a_failed_download_of_the_default_corpus_leaves_nothing_behind(tmp_path, path):
    """No network (a proxy that refuses): one line, and no directory of the run's; an empty data/
    and runs/ were left for the next attempt to find. The default spelled as the PyTorch DDP
    tutorial's config file has it is downloaded too (it was only 'data file not found')."""
    proxy = {"https_proxy": f"http://127.0.0.1:{free_port()}", "no_proxy": ""}
    overrides = ["trainer_config.max_steps=1"]
    if path is not None:
        overrides.append(f"data_config.path={path}")
    proc = run_main(overrides, tmp_path, env=proxy)
    one_error_line(proc, f"{path or 'data/input.txt'} is missing and could not be downloaded")
    assert not list(tmp_path.iterdir())


def test_storage_that_cannot_be_written_is_one_error(tmp_path):
    for snapshot in ("/proc/nope/snapshot.pt", "/sys/snapshot.pt"):
        with pytest.raises(
            storage.StorageError, match=f"cannot write to the snapshot path {snapshot}: "
        ):
            storage.check_writable(str(tmp_path), snapshot)
    # the path given, not the name of the probe beside it (it named that)
    with pytest.raises(
        storage.StorageError, match="^cannot write to the snapshot path /sys/x: Permission denied$"
    ):
        storage.check_writable(str(tmp_path), "/sys/x")
    with pytest.raises(storage.StorageError, match="^cannot use snapshot path nosuch://x: "):
        storage.check_writable(str(tmp_path), "nosuch://x")
    # not a regular file either: a pipe was taken, and the run trained to its first save
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(storage.StorageError) as refused:
        storage.check_writable(str(tmp_path), str(tmp_path / "pipe"))
    assert str(refused.value) == (
        f"cannot write to the snapshot path {tmp_path / 'pipe'}: it is a device, pipe or socket, "
        "and snapshots are kept in a directory there"
    )
    # no file there before: none is said to be unchanged; the temporary file the save writes
    # first is not what the user named
    for snapshot in ("/sys/snapshot.pt", "/proc/x"):
        with pytest.raises(storage.StorageError) as error:
            single_file.save({"step": 1}, snapshot)
        assert str(error.value).startswith(f"cannot save snapshot {snapshot}: ")
        assert "before" not in str(error.value) and storage.TMP_MARK not in str(error.value)


def test_a_snapshot_file_that_cannot_be_replaced_is_kept_and_said_so(small_disk):
    """A full disk: the file there before is kept as it was, and the line says so."""
    path = small_disk / "snapshot.pt"
    single_file.save({"step": 1}, str(path))
    before = path.read_bytes()
    with pytest.raises(
        storage.StorageError,
        match=r"No space left on device.*; the file there before is unchanged$",
    ):
        single_file.save({"step": 2, "weights": torch.zeros(100_000)}, str(path))
    assert path.read_bytes() == before


def test_a_save_that_fails_part_way_keeps_the_snapshot_and_the_logs(snap, runs):
    """The file-size limit stops the shard's write part-way (EFBIG), as a full disk would."""
    work, good = snap
    root = work / "full" / "snapshots"
    one_error_line(
        runs["save_fails"],
        f"cannot save sharded snapshot {root / 'step-00000006'}: [Errno 27] File too "
        "large (rank 0); the previous snapshots are unchanged",
    )
    # The snapshot of step 3 is still the one published,
    # byte for byte; step 6's directory is not published.
    assert manifest.latest(str(root)) == str(root / "step-00000003")
    assert {
        k: v for k, v in tree_bytes(root).items() if k.startswith("step-00000003/")
    } == tree_bytes(good)
    assert not (root / "step-00000006" / "manifest.json").exists()
    events = [
        strict_json(line) for line in (root.parent / "metrics.jsonl").read_text().splitlines()
    ]
    # Resumed at step 3: logged at 5 and at the last step, evaluated, then the save failed.
    assert [(e["split"], e["step"]) for e in events] == [("train", 5), ("train", 6), ("eval", 6)]


def test_a_full_disk_at_the_start_is_one_error_and_leaves_no_probe(small_disk, tmp_path):
    """The start's probe of the run directory was made, its write failed, and it stayed: a hidden
    file in the run directory, which was then not taken back as empty."""
    run_dir = small_disk / "run"
    run_dir.mkdir()
    fill(small_disk)
    with pytest.raises(
        storage.StorageError,
        match=rf"^cannot write to the run directory {run_dir}: \[Errno 28\] No space left on",
    ):
        storage.check_writable(str(run_dir), str(tmp_path / "snapshots"))
    assert list(run_dir.iterdir()) == []


def fill(disk: Path) -> None:
    """Fill the file system of `disk` to its last byte."""
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:
        while True:
            filler.write(b"\0" * 4096)
            filler.flush()


def test_a_disk_full_when_the_run_is_accepted_is_one_error(small_disk, tmp_path):
    """The run directory's file system fills between the start's probe and the run's first writes
    (its lock file's record of the holder, .hydra/): one error naming the run directory (an
    OSError's traceback, before), and the lock file it made is taken back."""
    from mingpt.rundir import LOCK_FILE, RunDirError, claim

    run_dir = small_disk / "run"
    run_dir.mkdir()
    cpu = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    held = logging.handlers.MemoryHandler(capacity=10)
    with claim(str(run_dir), str(tmp_path / "snapshots"), 0, cpu, held) as owned:
        fill(small_disk)
        with pytest.raises(
            RunDirError,
            match=f"^cannot write to the run directory {run_dir}: No space left on device$",
        ):
            owned.accept({".hydra/config.yaml": "trainer_config: {}\n"})
    assert not (run_dir / LOCK_FILE).exists()


def test_a_train_log_that_cannot_be_written_from_its_first_line_costs_one_warning(
    tmp_path, small_corpus
):
    """train.log on a full device from the run's start (as a disk that fills as the run starts):
    one warning, and the run trains to the end. The lines held until the run was accepted were
    flushed into the file with the warning held behind them, which failed and warned again: over
    a million warnings, then a RecursionError's traceback."""
    run_dir = tmp_path / "runs" / "full-log"
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").symlink_to("/dev/full")
    args = overrides(small_corpus, "trainer_config.run_name=full-log", "trainer_config.max_steps=2")
    proc = run_main(args, tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "cannot write" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert warnings[0].endswith(
        f"cannot write {run_dir / 'train.log'} ([Errno 28] No space left on device): "
        "the log goes on on stderr only"
    )
    assert " INFO done at step 2: " in proc.stderr.splitlines()[-1]


# ------------------------------------------------- tracebacks, now one line


def composed(*items: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(items))


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer_config.seed=99999999999999999999999", "trainer_config.seed"),
        (
            "trainer_config.grad_accum_steps=100000000000000000000",
            "trainer_config.grad_accum_steps",
        ),
        ("optimizer_config.eps=inf", "optimizer_config.eps"),
        ("optimizer_config.weight_decay=inf", "optimizer_config.weight_decay"),
        # the run trained, then its first sample ended in a traceback
        ("trainer_config.sample_chars=99999999999999999999", "trainer_config.sample_chars"),
        ("trainer_config.sample_chars=10000000000", "trainer_config.sample_chars"),
    ],
)
def test_values_torch_cannot_take_are_refused(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        OmegaConf.to_object(composed(override))


def test_generate_refuses_a_seed_beyond_64_bits():
    with pytest.raises(ConfigError, match=r"^seed: must be in \[0, 2\*\*63\)"):
        parse_args(["seed=99999999999999999999999"], GenerateConfig)


# In a child whose address space is capped at what it maps once torch is imported, plus
# 2 GiB: the 432 TB model is refused there whatever the host's memory and overcommit
# policy (in the test process, a 128 GB host's kernel OOM-killed pytest instead).
TOO_LARGE = """
import resource, sys
from mingpt import run
from mingpt.config import ConfigError, GPTConfig
mapped = next(
    int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:")
)
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**28, resource.getrlimit(resource.RLIMIT_AS)[1]))
n_embd, n_layer = (int(arg) for arg in sys.argv[1:])
shape = GPTConfig(n_layer=n_layer, n_head=1, n_embd=n_embd, vocab_size=1, block_size=1)
try:
    run.build_model(shape)
except ConfigError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="needs Linux's /proc to cap the address space"
)
@pytest.mark.parametrize(
    "n_embd, n_layer, ends",
    [
        # More than the host has: refused before any allocation, which the kernel may grant and
        # then end in its OOM killer, with no message (it did at 24 GB for n_embd=99,999,999).
        (3_000_000, 1, r"108,000,0\d\d,000,00\d parameters .*; [\d,.]+ GB available"),
        # A million blocks: counted from one, not built (even on the meta device a million
        # modules would take the process's 256 MB and more).
        (3000, 1_000_000, r"108,039,000,015,000 parameters .*; [\d,.]+ GB available"),
        # 1 GB of weights, within what the host has; the allocation fails (256 MB left to the
        # process's address space).
        (4600, 1, r"254,002,800 parameters .*; allocating \d+ bytes failed"),
    ],
    ids=["more-than-available", "a-million-layers", "allocation-fails"],
)
def test_a_model_too_large_for_memory_is_one_line(n_embd, n_layer, ends):
    proc = subprocess.run(
        [sys.executable, "-c", TOO_LARGE, str(n_embd), str(n_layer)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert re.match(rf"gpt_config: the model does not fit in memory: {ends}\n$", proc.stdout), (
        proc.stdout
    )
    assert proc.stdout.count("\n") == 1 and not proc.stderr


def test_a_model_whose_weights_torch_cannot_count_is_one_line():
    """A weight of 2**63 bytes or more: counting the model on the meta device ended in a traceback
    (torch's size overflowed; past 64 bits, a TypeError). Nothing is allocated."""
    for n_embd in (2**31, 10**23):
        shape = GPTConfig(n_layer=1, n_head=1, n_embd=n_embd, vocab_size=65, block_size=16)
        with pytest.raises(ConfigError) as refused:
            build_model(shape)
        assert str(refused.value) == (
            f"gpt_config: the model does not fit in memory: gpt_config.n_embd={n_embd} makes a "
            "weight of 2**63 bytes or more"
        )


def test_generate_writing_to_closed_or_full_stdout_is_one_line(runs):
    one_error_line(runs["stdout_closed"], "stdout is closed")
    one_error_line(runs["dev_full"], "cannot write to stdout: No space left on device")


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "data_config.path=~/x.txt",
            """quote the value, as in 'data_config.path="~/x.txt"' (~ is not expanded""",
        ),
        ("data_config.path=a=b", """quote the value, as in 'data_config.path="a=b"'"""),
        ("trainer_config.ké=1", "a key is ASCII letters, digits, '_' and '.'"),
    ],
)
def test_unparseable_override_names_it_and_how_to_quote(override, expected):
    with pytest.raises(HydraException) as e:
        composed(override)
    assert cli.config_error_line(e.value).startswith(
        f"cannot parse the override {override!r}: {expected}"
    )
    if "quote" in expected:  # the advice works
        quoted = expected.split("'")[1]
        assert composed(quoted).data_config.path == override.split("=", 1)[1]


def test_composition_error_in_a_file_keeps_its_reason(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text(
        "# @package _global_\ntrainer_config:\n  nope: 1\n"
    )
    with pytest.raises(HydraException) as e:
        composed(f"hydra.searchpath=[file://{tmp_path}]", "experiment=typo")
    line = cli.config_error_line(e.value)
    assert line == "in experiment/typo: unknown key trainer_config.nope (see --help)"


@pytest.mark.parametrize(
    "group, text, key",
    [
        ("experiment", "trainer_config:\n  max_steps: 5\n", "experiment"),
        ("gpt_config", "gpt_config:\n  n_layer: 2\n", "gpt_config.gpt_config"),
    ],
)
def test_a_preset_without_its_package_header_is_told_to_add_it(tmp_path, group, text, key):
    """A file of a group without `# @package _global_` puts its sections under the group's name:
    the line suggested a key whose name came closest (data_config.placement for experiment)."""
    (tmp_path / group).mkdir()
    (tmp_path / group / "mine.yaml").write_text(text)
    with pytest.raises(HydraException) as e:
        composed(f"hydra.searchpath=[file://{tmp_path}]", f"{group}=mine")
    assert cli.config_error_line(e.value) == (
        f"in {group}/mine: unknown key {key}: the keys of a file in {group} go under {group}; to "
        "set keys of every section, start the file with the line '# @package _global_'"
    )
    # a key misspelt inside a model preset keeps its suggestion
    (tmp_path / "gpt_config").mkdir(exist_ok=True)
    (tmp_path / "gpt_config" / "typo.yaml").write_text("n_layerr: 2\n")
    with pytest.raises(HydraException) as e:
        composed(f"hydra.searchpath=[file://{tmp_path}]", "gpt_config=typo")
    assert cli.config_error_line(e.value) == (
        "in gpt_config/typo: unknown key gpt_config.n_layerr (did you mean gpt_config.n_layer? see "
        "--help)"
    )


def test_a_key_missing_from_a_config_file_of_ones_own_is_told_how_to_add(tmp_path):
    """Hydra's own advice (add it with +) was dropped from the line; a key no dataclass has gets
    none: adding it is refused next."""
    (tmp_path / "mine.yaml").write_text("trainer_config:\n  max_steps: 5\n")

    def refused_in_mine(override: str) -> str:
        with (
            initialize_config_dir(config_dir=str(tmp_path), version_base=None),
            pytest.raises(HydraException) as e,
        ):
            compose("mine", overrides=[override])
        return cli.config_error_line(e.value)

    assert refused_in_mine("trainer_config.batch_size=4") == (
        "trainer_config.batch_size: Key 'batch_size' is not in struct (this config has no such key "
        "yet: add it with +trainer_config.batch_size=4)"
    )
    # a section the file has none of was named as an unknown key, its own correction suggested
    assert refused_in_mine("optimizer_config.learning_rate=1e-3") == (
        "optimizer_config.learning_rate: this config has no optimizer_config section yet: add the "
        "key with +optimizer_config.learning_rate=1e-3"
    )
    with pytest.raises(HydraException) as e:
        composed("trainer_config.epochs=3")
    assert cli.config_error_line(e.value) == (
        "unknown key trainer_config.epochs (did you mean trainer_config.max_epochs? see --help)"
    )


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "trainer_config.max_step",
            "trainer_config.max_step (did you mean trainer_config.max_steps? see --help)",
        ),
        # without its section, in another
        ("max_step", "max_step (did you mean trainer_config.max_steps? see --help)"),
        (
            "gpt_config.max_steps",
            "gpt_config.max_steps (did you mean trainer_config.max_steps? see --help)",
        ),
        ("trainer_confg.max_steps", "trainer_confg (did you mean trainer_config? see --help)"),
        (
            "block_size",
            "block_size (did you mean gpt_config.block_size or data_config.block_size? see --help)",
        ),
        # a name two sections have: the one of the section given
        (
            "data_config.block_sze",
            "data_config.block_sze (did you mean data_config.block_size? see --help)",
        ),
        # Hydra's + adds it past OmegaConf
        (
            "+trainer_config.max_step",
            "trainer_config.max_step (did you mean trainer_config.max_steps? see --help)",
        ),
        ("hydra.run.dirr", "hydra.run.dirr (see --help)"),
    ],
)
def test_an_unknown_key_is_named_with_the_closest_keys(override, line):
    """The line named a dataclass (Key 'max_step' not in 'Config') and suggested no key."""
    with pytest.raises((HydraException, ConfigError)) as e:
        cli.check_known_keys(composed(f"{override}=3"))
    assert cli.config_error_line(e.value) == f"unknown key {line}"


def test_an_unknown_key_of_generate_is_named_with_the_closest_key():
    with pytest.raises(ConfigError) as e:
        parse_args(["max_new_token=5"], GenerateConfig)
    assert str(e.value) == "unknown key max_new_token (did you mean max_new_tokens? see --help)"
    with pytest.raises(ConfigError, match=r"^=3: expected key=value$"):
        parse_args(["=3"], GenerateConfig)


def test_interpolation_error_is_one_line(runs):
    assert (
        one_error_line(runs["interpolation"])
        == "error: data_config.path: Interpolation key 'nope' not found"
    )
    assert runs["interpolation"].stderr.count("\n") == 1


def test_dropping_a_group_and_choosing_from_it_is_refused():
    with pytest.raises(
        ConfigError, match=r"^gpt_config=gpt2: ~gpt_config drops the gpt_config group"
    ):
        cli.check_group_overrides(["trainer_config.seed=1", "~gpt_config", "gpt_config=gpt2"])
    cli.check_group_overrides(["~gpt_config", "gpt_config.n_layer=2"])
    cli.check_group_overrides(["gpt_config=gpt2"])


def test_a_name_or_path_read_as_a_number_is_refused_with_the_quoting_that_keeps_it():
    """OmegaConf makes the number of a text key text again, not as typed: run_name=3e-4 named the
    run directory runs/0.0003, true named it runs/True; a sweep's jobs took their values so too."""
    cases = {
        "trainer_config.run_name=3e-4": "3e-4 is read as a number, so the value would be "
        "'0.0003'; to keep it as typed, quote it: 'trainer_config.run_name=\"3e-4\"'",
        "trainer_config.run_name=true": "true is read as a boolean, so the value would be 'True'",
        "+trainer_config.snapshot_path=1.50": "so the value would be '1.5'",
        "trainer_config.init_from=1_000": "so the value would be '1000'",
        # a sweep's, a list's, and a function's values: each job's was written anew
        "trainer_config.snapshot_path=1e3,true,x,2024": "1e3 is read as a number, so the value "
        "would be '1000.0'; true is read as a boolean, so the value would be 'True'; to keep it "
        'as typed, quote it: \'trainer_config.snapshot_path="1e3","true",x,2024\'',
        "data_config.path=[a.txt,1e3]": "quote it: 'data_config.path=[a.txt,\"1e3\"]'",
        "+trainer_config.snapshot_path=choice(1e3,2)": "quote it: "
        "'+trainer_config.snapshot_path=choice(\"1e3\",2)'",
    }
    for override, says in cases.items():
        with pytest.raises(ConfigError) as e:
            cli.check_text_overrides(["trainer_config.seed=1", override])
        assert str(e.value).startswith(f"{override}: ") and says in str(e.value), e.value
    # what comes back as typed, quoted values, and keys that are no text
    cli.check_text_overrides(
        [
            "trainer_config.run_name=2024",
            "trainer_config.run_name=inf",
            'trainer_config.snapshot_path="1e3",x,2024',
            'trainer_config.run_name="3e-4"',
            "trainer_config.max_steps=1_000",
            "~trainer_config.init_from",
        ]
    )


def refused_invocations(tmp_path: Path) -> dict[tuple[str, ...], str]:
    """Invocations refused at start, each in tmp_path/work beside config files in tmp_path/conf
    that are not valid YAML: {argv: what its one line says}."""
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "broken.yaml").write_text(
        "# @package _global_\ntrainer_config: [\n  bad\n"
    )
    (conf / "experiment" / "tabs.yaml").write_text(
        "# @package _global_\ntrainer_config:\n\tmax_epochs: 1\n"
    )
    (conf / "mine.yaml").write_text("trainer_config:\n  max_epochs: [\n")
    # a sweep of its own: Hydra's sweeper takes these values beside the command line's
    (conf / "experiment" / "sweep.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n"
        "      trainer_config.batch_size: 1,0\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    return {  # argv: what its one line says
        (
            "--config-dir",
            str(conf),
            "experiment=broken",
        ): f"{conf}/experiment/broken.yaml: line 4, column 1: not valid YAML: expected ',' or ']', "
        "but got '<stream end>' (while parsing a flow sequence from line 2, column 17)",
        (
            "--config-dir",
            str(conf),
            "experiment=tabs",
        ): f"{conf}/experiment/tabs.yaml: line 3, column 1: not valid YAML: found character '\\t' "
        "that cannot start any token (while scanning for the next token)",
        (
            "--config-dir",
            str(conf),
            "--config-name",
            "mine",
        ): f"{conf}/mine.yaml: line 3, column 1: not valid YAML",
        (
            "trainer_config.run_name=../escape",
        ): "trainer_config.run_name: must be one directory name",
        ("trainer_config.run_name=a/b",): "trainer_config.run_name: must be one directory name",
        # the run directory was runs/0.0003; in a sweep each job's, as the sweeper writes it
        ("trainer_config.run_name=3e-4",): "trainer_config.run_name=3e-4: 3e-4 is read as a number",
        (
            "-m",
            "trainer_config.run_name=1e3",
            "trainer_config.seed=1,2",
        ): "trainer_config.run_name=1e3: 1e3 is read as a number",
        ("trainer_config.run_name=''",): "trainer_config.run_name: must be one directory name",
        (
            'trainer_config.run_name="a\nb"',
        ): r"trainer_config.run_name: must be one directory name (not empty, "
        r"'.' or '..', without '/' or control characters such as a newline), got 'a\nb'",
        (
            "trainer_config.run_name=a\nb",
        ): "cannot parse the override 'trainer_config.run_name=a\\nb': "
        "it holds a control character",
        (
            "trainer_config.batch_size=0",
            "hydra.run.dir=elsewhere",
        ): "trainer_config.batch_size: must be >= 1, got 0",
        (
            "trainer_config.batch_size=0",
            "--cfg",
            "job",
        ): "trainer_config.batch_size: must be >= 1, got 0",
        # before job 0 runs
        ("-m", "trainer_config.batch_size=1,0"): "trainer_config.batch_size: must be >= 1, got 0",
        # the sweep's directory and record would go under the default name, each job elsewhere
        ("-m", "trainer_config.run_name=a,b"): "trainer_config.run_name=a,b: a sweep's jobs share "
        "its run name",
        # the same through presets that name their runs: each job went to its experiment's
        # runs/<run_name>-multirun, the sweep's record to runs/default-multirun
        ("-m", "experiment=ddp-tutorial,gpu-quick"): "experiment=ddp-tutorial: job 0 of the sweep "
        "would go to runs/ddp-tutorial-multirun/0, outside the sweep's directory "
        "runs/default-multirun: a sweep's jobs share its run name",
        # before job 0 runs
        (
            "--config-dir",
            str(conf),
            "-m",
            "experiment=sweep",
        ): "trainer_config.batch_size: must be >= 1, got 0",
        # one directory for every job: each would resume or refuse the job's before it
        (
            "-m",
            "hydra.sweep.subdir=same",
            "trainer_config.log_every=5,10",
        ): "hydra.sweep.subdir: 'same' puts jobs 0 and 1 of the sweep in one run directory, "
        "runs/default-multirun/same",
        # a mix of the two recipes: one's model and run name, the other's steps
        ("experiment=[gpu-quick,ddp-tutorial]",): "experiment=[gpu-quick,ddp-tutorial]: one "
        "experiment at a time",
        # Hydra made ./s3:/b/x
        ("hydra.run.dir=s3://b/x",): "hydra.run.dir: s3://b/x is a URL, and a run directory is "
        "local",
        # a re-run of the sweep would find none of its jobs
        ("-m", "hydra.sweep.subdir=${now:%H%M%S}"): "hydra.sweep.subdir: ${now:%H%M%S} is named by "
        "the clock",
        # the same through the run's name, or its snapshots' root: each command (each rank of a
        # job) made a run of its own
        ("trainer_config.run_name=${now:%H%M%S}",): "trainer_config.run_name: ${now:%H%M%S} is "
        "named by the clock, so the same command would start over instead of resuming",
        ("trainer_config.snapshot_path=s-${now:%H%M%S}",): "trainer_config.snapshot_path: "
        "s-${now:%H%M%S} is named by the clock",
        (
            "trainer_config.seed=1",
            "--config-dir",
            str(conf),
            "trainer_config.max_epochs=1",
        ): (
            "trainer_config.max_epochs=1: the key=value overrides go together, "
            "all before or all after the options"
        ),
        ("--cfg",): "argument --cfg/-c: expected one argument",
        # without --cfg, Hydra ignored it and the command trained
        ("-p", "data_config"): "--package data_config: it picks the part of the config that "
        "--cfg prints: add --cfg job",
        # Hydra's advice was on lines of their own, and went
        ("data_config.path=a,b",): "data_config.path=a,b: a comma makes several values; for one, "
        "quote it ('data_config.path=\"a,b\"'), or add -m to sweep over them",
        ("experiment=null",): "experiment=null: a config group takes a preset's name; "
        "~experiment drops the preset",
        ("--cfg", "job", "-p", "nope"): "--package nope: no such key in the config that --cfg job "
        "prints",
        # Hydra's own line, without `error:`: the key is in the config, not in the part printed
        ("--cfg", "job", "-p", "hydra.run.dir"): "--package hydra.run.dir: no such key in the "
        "config that --cfg job prints",
        ("--cfg", "job", "-m", "trainer_config.seed=1,2"): "Only one of --run, --multirun, --cfg",
        ("-m", "--info"): "Only one of --run, --multirun, --cfg",
    }


def test_refused_invocations_say_one_line_and_write_nothing(runs):
    tmp_path, cases = runs["refused invocations"]
    work = tmp_path / "work"
    # through cli.main, one after another in one process (the runs' refusals')
    for argv, says in cases.items():
        result = runs[argv]
        stderr = result.stderr
        assert result.returncode == 2, (argv, stderr)
        assert stderr.startswith(f"error: {says}") and stderr.count("\n") == 1, (argv, stderr)
        assert not result.stdout  # --cfg job printed nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf", "work"]
    assert list(work.iterdir()) == []  # no runs/, no run directory, nothing outside either


@pytest.fixture(scope="module")
def not_snapshots(snap, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Directories given where a snapshot is read that hold none, and a file of one:
    {case: (path, what the line says)}."""
    work = tmp_path_factory.mktemp("not-snapshots")
    (work / "empty").mkdir()
    cases = {"empty": (work / "empty", "is an empty directory; expected a snapshot directory")}
    for fmt in ("safetensors", "hf"):
        export(ExportConfig(str(snap[1]), str(work / fmt), fmt))
        cases[fmt] = (
            work / fmt,
            "is an export in safetensors/transformers format, not a snapshot; expected",
        )
    for parallelism in ("ddp", "fsdp"):  # both save under `snapshots`
        run_dir = work / f"run-{parallelism}"
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "config.yaml").write_text(
            f"trainer_config:\n  parallelism: {parallelism}\n"
        )
        cases[f"run-{parallelism}"] = (
            run_dir,
            f"is a run directory with no snapshot yet (it saves to {run_dir / 'snapshots'})",
        )
    # one file of a snapshot directory: a .distcp file is a torch file, which was called damaged
    step = next(snap[1].glob("step-*"))
    cases["distcp"] = (
        next(step.glob("*.distcp")),
        f"is one file of the snapshot {step}: give that directory",
    )
    return cases


@pytest.mark.parametrize("tool", ["generate", "score", "export", "init_from"])
@pytest.mark.parametrize("case", ["empty", "safetensors", "hf", "run-ddp", "run-fsdp", "distcp"])
def test_a_directory_without_a_snapshot_says_what_it_is(
    not_snapshots, tool, case, capsys, monkeypatch, tmp_path
):
    """Not `no published sharded snapshot in ...` for each of them alike."""
    path, says = not_snapshots[case]
    if tool == "init_from":
        from mingpt.finetune import prepare

        config = Config()
        config.trainer_config.init_from = str(path)
        with pytest.raises(SnapshotError) as refused:
            prepare(config, str(tmp_path / "run"), str(tmp_path / "snapshot.pt"), None)
        assert str(refused.value).startswith(f"trainer_config.init_from: {path} {says}"), str(
            refused.value
        )
        return
    # the commands set up logging to the captured stderr: put it back after
    root_logger = logging.getLogger()
    monkeypatch.setattr(root_logger, "handlers", root_logger.handlers[:])
    monkeypatch.setattr(root_logger, "level", root_logger.level)
    main = {"generate": "mingpt.generate", "score": "mingpt.score", "export": "mingpt.export"}[tool]
    argv = [str(path), str(tmp_path / "out")] if tool == "export" else [f"snapshot_path={path}"]
    with pytest.raises(SystemExit) as exit_status:
        __import__(main, fromlist=["main"]).main(argv)
    err = capsys.readouterr().err
    assert (
        exit_status.value.code == 2
        and err.startswith(f"error: {path} {says}")
        and err.count("\n") == 1
    ), err
    assert not (tmp_path / "out").exists()


def test_a_path_holding_a_newline_keeps_its_error_one_line(tmp_path, capsys, monkeypatch):
    """The path in the error line is escaped as Python writes a string: it broke the one line in
    two (train, generate, score and export alike)."""
    from mingpt import generate

    root_logger = logging.getLogger()
    monkeypatch.setattr(root_logger, "handlers", root_logger.handlers[:])
    monkeypatch.setattr(root_logger, "level", root_logger.level)
    path = f"{tmp_path}/a\nb\x01"
    with pytest.raises(SystemExit) as exit_status:
        generate.main([f"snapshot_path={path}"])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err == f"error: snapshot not found: {tmp_path}/a\\nb\\x01\n"
    with pytest.raises(SystemExit) as exit_status:
        cli.fail(f"data file not found: {path}")
    assert exit_status.value.code == 2
    assert capsys.readouterr().err == f"error: data file not found: {tmp_path}/a\\nb\\x01\n"


def test_init_from_naming_the_runs_own_place_says_so(tmp_path):
    """trainer_config.init_from naming the new run's own directory (or snapshot path) said "... is
    an empty directory": the one the command had just made."""
    from mingpt.finetune import prepare

    run_dir = tmp_path / "runs" / "x"
    run_dir.mkdir(parents=True)
    for given in (run_dir, run_dir / "snapshots"):
        config = Config()
        config.trainer_config.init_from = str(given)
        with pytest.raises(SnapshotError) as refused:
            prepare(config, str(run_dir), str(run_dir / "snapshots"), None)
        assert str(refused.value) == (
            f"trainer_config.init_from: {given} is this run itself, which has no snapshot yet: "
            "give another run or snapshot to start from"
        )


def test_a_snapshot_file_named_like_a_file_of_a_snapshot_directory_is_read(tiny_file, tmp_path):
    """Export's dst may be any name: one away from a snapshot's own files is a snapshot file."""
    from mingpt.snapshot import reader

    for name in ("meta.json", "model.distcp"):
        path = str(tmp_path / name)
        shutil.copy(tiny_file, path)
        assert reader.read(path)[1]["step"] == 60


def printed_to(stdout: str, *argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python ARGV` in `cwd` with stdout on a full device ("full") or on a pipe whose reader is
    gone ("closed", as `| head` leaves it once it has its lines)."""
    if stdout == "full":
        target = os.open("/dev/full", os.O_WRONLY)
    else:
        read, target = os.pipe()
        os.close(read)
    try:
        return subprocess.run(
            [sys.executable, *argv],
            cwd=cwd,
            env=child_env(),
            stdout=target,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(target)


PRINTING = {
    "train --help": ["main.py", "--help"],
    "train --cfg job": ["main.py", "--cfg", "job"],
    "generate --help": ["-m", "mingpt.generate", "--help"],
}


def test_printing_to_a_full_or_closed_stdout_is_one_line_or_quiet():
    """What main.py and the commands only print: on a full device one line (main.py said `cannot
    create the run directory: : No space left on device`, a command's --help ended in a
    traceback); on a pipe its reader closed (`--help | head`), exit status 1 and nothing said
    (main.py said `cannot create the run directory: : Broken pipe`)."""
    cases = [(stdout, argv) for stdout in ("full", "closed") for argv in PRINTING.values()]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: printed_to(case[0], *case[1]), cases))
    for (stdout, argv), proc in zip(cases, results, strict=True):
        if stdout == "full":
            assert proc.stderr == "error: cannot write to stdout: No space left on device\n", argv
            assert proc.returncode == 2, argv
        else:
            assert (proc.returncode, proc.stderr) == (1, ""), (argv, proc.stderr[-3000:])


def test_a_run_whose_sample_cannot_be_printed_ends_well(tmp_path, small_corpus):
    """The sample at the end goes to stdout: on a full device one warning, and the run ends as
    it would (it ended in a traceback, after its snapshot)."""
    args = on_cpu(
        [
            *overrides(small_corpus, "trainer_config.sample_chars=20"),
            "trainer_config.max_steps=3",
            "optimizer_config.warmup_steps=2",  # shorter than the run: its one warning is stdout's
        ]
    )
    proc = printed_to("full", str(REPO / "main.py"), *args, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert warnings[0].endswith(
        "cannot write to stdout: No space left on device: the sample is not shown"
    )
    assert " INFO done at step 3: " in proc.stderr.splitlines()[-1]
