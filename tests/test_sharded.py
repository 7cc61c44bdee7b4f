"""Sharded snapshots (mingpt.snapshot.sharded): FSDP2 on real gloo processes saves, resharded loads,
publication and pruning, asynchronous saves and their errors, integrity, refused pickles,
one-process reads, export and generation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, RUN_DEADLINE, child_env, fake_cuda_env, torchrun_cmd
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mingpt.config import ConfigError, TrainerConfig
from mingpt.snapshot import SnapshotError, manifest, sharded

WORKER = str(REPO / "tests" / "sharded_worker.py")


def launch(nproc: int, mode: str, out: Path, root: Path) -> None:
    cmd = torchrun_cmd(nproc, "--standalone") + [WORKER, mode, str(out), str(root)]
    result = subprocess.run(
        cmd, env=child_env(), capture_output=True, text=True, timeout=RUN_DEADLINE
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-rank FSDP2 run that saves (sync, then async)
    and loads back; its report and reference state."""
    out = tmp_path_factory.mktemp("sharded")
    root = out / "root"
    launch(2, "save", out, root)
    report = json.loads((out / "save.json").read_text())
    return out, root, report, torch.load(out / "reference.pt", weights_only=True)


def assert_same_state(got: dict, reference: dict) -> None:
    assert set(got["model"]) == set(reference["model"])
    for name, tensor in reference["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert set(got["optim"]["state"]) == set(reference["optim"]["state"])
    for fqn, moments in reference["optim"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(torch.as_tensor(got["optim"]["state"][fqn][key]), tensor), (fqn, key)
    assert got["optim"]["param_groups"] == reference["optim"]["param_groups"]


def test_publication_pruning_and_async_saves(saved):
    out, root, report, _ = saved
    # Each save is published under its step (the crashed step-1 directory's number is not reused).
    assert report["published"] == [
        "step-00000001-8",
        "step-00000002",
        "step-00000003",
        "step-00000004",
    ]
    # latest() follows publication, never the unpublished step 99
    assert report["latest"] == report["published"]
    # keep=2: the two newest remain; the crashed directory
    # older than them is gone, the newer one is left alone.
    assert report["listing"] == ["step-00000003", "step-00000004", "step-00000099"]
    assert manifest.latest(str(root)) == f"{root}/step-00000004"
    files = sorted(os.listdir(root / "step-00000004"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "meta.json"]
    listed = json.loads((root / "step-00000004" / "manifest.json").read_text())["files"]
    assert sorted(listed) == files[:3] + ["meta.json"]


def test_a_root_whose_path_has_glob_characters_is_published_listed_and_pruned(tmp_path):
    """A run named x[1]: its path is a name, not a pattern. Taken as one, no snapshot of it was
    published (its shards missing from the manifest), so a restart began afresh and pruning removed
    the snapshot it should have resumed."""
    run = tmp_path / "run[1]*?"
    root = str(run / "snapshots")
    model = torch.nn.Linear(4, 4)
    meta = {"gpt_config": {}, "vocab": "ab", "epoch": 0, "samples_in_epoch": 0}
    for step in (1, 2):
        tensors = {"model": model.state_dict()}
        sharded.save(tensors, {**meta, "step": step}, root, step, keep=1, async_save=False)
    assert manifest.latest(root) == f"{root}/step-00000002"
    assert os.listdir(root) == ["step-00000002"]
    listed = json.loads((run / "snapshots" / "step-00000002" / "manifest.json").read_text())
    assert sorted(listed["files"]) == [".metadata", "__0_0.distcp", "meta.json"]


def test_a_step_saved_again_keeps_the_snapshots_of_as_many_steps(tmp_path):
    """A resumed run redoes the evaluation a stop cut short and saves its step again: that save
    replaces the step's first one. Both were kept, and keep_snapshots=2 left one step to go back
    to."""
    root = str(tmp_path / "snapshots")
    model = torch.nn.Linear(2, 2)
    meta = {"gpt_config": {}, "vocab": "ab", "epoch": 0, "samples_in_epoch": 0}
    for step in (1, 2, 2):
        tensors = {"model": model.state_dict()}
        sharded.save(tensors, {**meta, "step": step}, root, step, keep=2, async_save=False)
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002-1"]


def test_a_root_under_the_home_directory_written_with_a_tilde_is_there(monkeypatch, tmp_path):
    """`~/snaps` was a directory named ~ in the run directory, where init_from, generate and the
    corpus's keys read a leading ~ as the home directory."""
    from mingpt.snapshot.reader import resolve_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_path("~/snaps", "runs/x") == str(tmp_path / "snaps")
    assert resolve_path("snaps", "runs/x") == "runs/x/snaps"
    assert resolve_path(None, "runs/x") == "runs/x/snapshots"


def test_background_write_failure_surfaces_on_every_rank(saved):
    _, _, report, _ = saved
    first, second = report["errors"]
    assert first == second and "\n" not in first
    assert first.startswith("cannot save sharded snapshot") and "Not a directory" in first
    assert report["pending_after"] is None  # reported once, then nothing is in flight


def test_reshards_to_two_ranks_and_one_process(saved, tmp_path):
    """(Loads into other numbers of FSDP ranks:
    tests/test_snapshot.py resumes a run on 2, 1 and 4.)"""
    out, root, _, reference = saved
    two = torch.load(out / "load-2.pt", weights_only=True)
    assert two["meta"]["step"] == 4 and two["meta"]["world_size"] == 2
    # also: the write kept the state of the call, not the zeroed one
    assert_same_state(two["state"], reference)

    # One process, no process group: a plain model and optimizer, loaded as the trainer would.
    sys.path.insert(0, str(REPO / "tests"))
    from sharded_worker import CONFIG

    from mingpt.model import GPT

    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optimizer)
    tensors = {"model": msd, "optim": osd}
    meta, _ = sharded.load(tensors, str(root))
    set_state_dict(
        model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"]
    )
    assert meta["step"] == 4
    msd, osd = get_state_dict(model, optimizer)
    assert_same_state({"model": msd, "optim": osd}, reference)

    # load_full gives the same, and a one-process save (async) round-trips through it.
    full, meta = sharded.load_full(str(root / "step-00000004"))
    assert_same_state(full, reference) and meta["samples_in_epoch"] == 32
    sharded.save(tensors, meta, str(tmp_path / "one"), 7, keep=1, async_save=True)
    assert sharded.wait_pending() == f"{tmp_path / 'one'}/step-00000007"
    again, _ = sharded.load_full(str(tmp_path / "one"))
    assert_same_state(again, reference)


def copy_snapshot(root: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy" / "step-00000004"
    shutil.copytree(root / "step-00000004", target)
    return target


def rewrite_manifest(directory: Path, name: str) -> None:
    """What whoever changed a file could do too: make the manifest agree with it."""
    path = directory / "manifest.json"
    listed = json.loads(path.read_text())
    data = (directory / name).read_bytes()
    listed["files"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    path.write_text(json.dumps(listed))


def load_one_process(path: str) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from sharded_worker import CONFIG

    from mingpt.model import GPT

    model = GPT(CONFIG)
    msd, osd = get_state_dict(model, torch.optim.AdamW(model.parameters()))
    sharded.load({"model": msd, "optim": osd}, path)


def test_damaged_shard_is_refused_naming_it(saved, tmp_path):
    _, root, _, _ = saved
    directory = copy_snapshot(root, tmp_path)
    shard = directory / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    for load in (sharded.load_full, load_one_process):
        with pytest.raises(SnapshotError) as refused:
            load(str(directory.parent))
        assert str(refused.value) == (
            f"snapshot {directory} is damaged: __1_0.distcp does not match its size and "
            "sha256 in manifest.json (changed after it was written)"
        )
    shard.unlink()
    with pytest.raises(SnapshotError, match=r"__1_0.distcp is missing$"):
        sharded.load_full(str(directory))
    (directory / "manifest.json").unlink()  # unpublished: nothing to read under the root
    with pytest.raises(SnapshotError, match="no published sharded snapshot in"):
        sharded.load_full(str(directory.parent))
    assert manifest.latest(str(directory.parent)) is None


class Payload:
    """Unpickling this creates a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_payload_in_dcp_metadata_is_refused_and_not_run(saved, tmp_path):
    _, root, _, _ = saved
    directory = copy_snapshot(root, tmp_path)
    marker = tmp_path / "ran"
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    metadata.planner_data = Payload(marker)  # a real index, with a payload inside
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(directory, ".metadata")
    for load in (sharded.load_full, load_one_process):
        with pytest.raises(SnapshotError) as refused:
            load(str(directory))
        line = str(refused.value)
        assert (
            line.startswith(
                f"refusing to load {directory}/.metadata: "
                "it holds pickled objects other than DCP's metadata, and none of it was run"
            )
            and "posix.system" in line
            and "\n" not in line
        )
        assert not marker.exists()
    # the payload is live: plain unpickling runs it
    pickle.loads((directory / ".metadata").read_bytes())
    assert marker.exists()


def test_export_and_generate_from_a_sharded_snapshot(saved, tmp_path, capsys, monkeypatch):
    _, root, _, reference = saved
    exported = tmp_path / "exported.pt"
    # the CLIs set up logging to the captured stderr: put it back after
    root_logger = logging.getLogger()
    monkeypatch.setattr(root_logger, "handlers", root_logger.handlers[:])
    monkeypatch.setattr(root_logger, "level", root_logger.level)
    from mingpt.export import main as export_main

    export_main([str(root), str(exported), "--format", "snapshot"])
    assert capsys.readouterr().out == f"exported {root} (step 4) as snapshot to {exported}\n"
    (tmp_path / "nothing").mkdir()
    with pytest.raises(SystemExit) as exit_status:
        export_main([str(tmp_path / "nothing"), str(tmp_path / "other.pt"), "--format=snapshot"])
    assert exit_status.value.code == 2 and not (tmp_path / "other.pt").exists()
    assert capsys.readouterr().err.startswith(
        f"error: {tmp_path / 'nothing'} is an empty directory; expected"
    )

    from mingpt.generate import main as generate_main
    from mingpt.snapshot import single_file
    from mingpt.snapshot.reader import load_model

    state = single_file.load(str(exported))
    assert state["step"] == 4 and state["samples_in_epoch"] == 32
    for name, tensor in reference["model"].items():
        assert torch.equal(state["model_state"][name], tensor), name
    # The weights and the run's record: what init_from, generate and score read.
    assert "optimizer_state" not in state
    from_file, _, _ = load_model(str(exported), torch.device("cpu"))
    from_dir, _, _ = load_model(str(root), torch.device("cpu"))
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            from_file.state_dict().values(), from_dir.state_dict().values(), strict=True
        )
    )
    generate_main(
        [f"snapshot_path={root}", "max_new_tokens=30", "temperature=0", "device=cpu", "prompt=AB"]
    )
    text = capsys.readouterr()
    assert text.out.startswith("AB") and len(text.out) >= 32
    assert f"INFO {root}: step 4, " in text.err  # the newest published snapshot of the root


def test_keep_snapshots_config():
    assert TrainerConfig().keep_snapshots == 2 and TrainerConfig().async_save is True
    with pytest.raises(ConfigError, match=r"^trainer_config.keep_snapshots: must be >= 1, got 0$"):
        TrainerConfig(keep_snapshots=0)


def test_a_model_of_another_shape_is_refused_in_one_line(saved):
    _, root, _, _ = saved
    sys.path.insert(0, str(REPO / "tests"))
    from sharded_worker import CONFIG

    from mingpt.model import GPT

    for change, expected in (
        ({"n_layer": 1}, "does not fit: it holds a tensor model/h.1."),
        ({"n_layer": 3}, "does not fit: it holds no tensor model/h.2."),
        ({"n_embd": 64}, "cannot be loaded: "),
    ):
        model = GPT(dataclasses.replace(CONFIG, **change))
        msd, osd = get_state_dict(model, torch.optim.AdamW(model.parameters()))
        with pytest.raises(SnapshotError) as refused:
            sharded.load({"model": msd, "optim": osd}, str(root))
        assert expected in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


ONE_ASYNC_SAVE = """
import sys, torch
from mingpt.snapshot import sharded
state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}}
sharded.save(state, {"note": 1}, sys.argv[1], 3, keep=1, async_save=True)
print(sharded.wait_pending())
"""


def test_async_save_of_a_cpu_state_on_a_gpu_host(tmp_path):
    """A CPU job's asynchronous save on a host where torch.cuda.is_available() (simulated):
    the stager pinned its copy because the host had CUDA, and the save failed there."""
    root = tmp_path / "root"
    proc = subprocess.run(
        [sys.executable, "-c", ONE_ASYNC_SAVE, str(root)],
        env=fake_cuda_env(gpus=1),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(root / "step-00000003")
    loaded, _ = sharded.load_full(str(root))
    assert torch.equal(loaded["model"]["w"], torch.arange(12.0).reshape(3, 4))


def test_asynchronous_saves_in_a_row(tmp_path):
    """Each asynchronous save after the first failed with `KeyError: <class 'type'>` on a
    torch whose DCP stager closes itself after one stage (2.11): the saves of one process
    reused one stager."""
    root = str(tmp_path / "root")
    for step in (1, 2, 3):
        state = {"model": {"w": torch.full((3, 4), float(step))}}
        sharded.save(state, {"note": step}, root, step, keep=2, async_save=True)
        sharded.wait_pending()
    loaded, meta = sharded.load_full(root)
    assert meta == {"note": 3} and torch.equal(loaded["model"]["w"], torch.full((3, 4), 3.0))


def test_an_error_outside_dcp_is_reported_with_its_type():
    assert sharded._dcp_reason(KeyError(type)) == "KeyError: <class 'type'>"
    assert sharded._dcp_reason(OSError("disk full")) == "disk full"


def test_a_rank_failure_is_reported_with_its_type_and_place():
    """DCP keeps each rank's failure as (exception, stack summary); the message gives the
    exception's type, its text and where it was raised: a KeyError's text alone is its key
    (a GPU host reported `cannot save sharded snapshot ...: <class 'type'>`)."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def stage(copiers: dict) -> None:
        # Fails as a stager did: KeyError(<class 'type'>).
        copiers[type]

    try:
        stage({})
    except KeyError as e:
        failure = _wrap_exception(e)
    line = sharded._dcp_reason(CheckpointException("async_save", {1: failure}))
    assert line.startswith("KeyError: <class 'type'>") and "(rank 1)" in line, line
    assert "test_sharded.py:" in line and "in stage" in line and "\n" not in line, line
    assert (
        sharded._dcp_reason(CheckpointException("save", {0: _wrap_exception(OSError("disk full"))}))
        == "disk full (rank 0)"
    )

    # A storage error is the storage's own line, without where DCP met it.
    def write() -> None:
        raise OSError(28, "No space left on device")

    try:
        write()
    except OSError as e:
        disk_full = _wrap_exception(e)
    assert disk_full[1]
    assert (
        sharded._dcp_reason(CheckpointException("save", {0: disk_full}))
        == "[Errno 28] No space left on device (rank 0)"
    )
    # An object store's, which is no OSError: the line named botocore's httpsession.py:364.
    botocore = pytest.importorskip("botocore.exceptions")

    def connect() -> None:
        raise botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    try:
        connect()
    except botocore.EndpointConnectionError as e:
        unreachable = _wrap_exception(e)
    assert (
        sharded._dcp_reason(CheckpointException("save", {0: unreachable}))
        == 'Could not connect to the endpoint URL: "http://127.0.0.1:9" (rank 0)'
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_says_so(small_disk, async_save):
    """DCP writes each tensor with torch.save, which reports a failed write as `unexpected
    pos 704 vs 598`: the message is the storage's own error, on a real full file system
    (a 256 KB tmpfs), and the published snapshot before it is kept."""
    root = str(small_disk / "snapshots")
    sharded.save({"w": torch.ones(1000)}, {"step": 1}, root, 1, async_save=async_save)
    sharded.wait_pending()
    with pytest.raises(sharded.StorageError) as failed:
        sharded.save({"w": torch.ones(100_000)}, {"step": 2}, root, 2, async_save=async_save)
        sharded.wait_pending()
    assert str(failed.value) == (
        f"cannot save sharded snapshot {root}/step-00000002: [Errno 28] No space left on "
        "device (rank 0); the previous snapshots are unchanged"
    )
    assert manifest.latest(root) == f"{root}/step-00000001"


def test_a_first_save_that_fails_says_no_snapshot_is_published(small_disk):
    """With no snapshot before it, the failed save does not claim that earlier ones are kept."""
    root = str(small_disk / "snapshots")
    with pytest.raises(sharded.StorageError) as failed:
        sharded.save({"w": torch.ones(100_000)}, {"step": 1}, root, 1)
        sharded.wait_pending()
    assert str(failed.value) == (
        f"cannot save sharded snapshot {root}/step-00000001: [Errno 28] No space left on "
        f"device (rank 0); no snapshot is published in {root} yet"
    )


def test_a_failed_save_keeps_its_cause_when_the_root_cannot_be_listed(tmp_path, monkeypatch):
    """What is left of the run's saves is looked up after a failed publish; when that listing
    fails too, the save's line still names the first failure, not the listing's."""
    root = str(tmp_path / "snapshots")

    def full(*args):
        raise OSError(28, "No space left on device")

    def unlisted(root):
        raise sharded.StorageError(f"cannot list the sharded snapshots in {root}: gone")

    monkeypatch.setattr(manifest, "publish", full)
    monkeypatch.setattr(manifest, "latest", unlisted)
    with pytest.raises(sharded.StorageError) as failed:
        sharded.save({"w": torch.ones(10)}, {"step": 1}, root, 1)
        sharded.wait_pending()
    assert str(failed.value) == (
        f"cannot save sharded snapshot {root}/step-00000001: [Errno 28] No space left on "
        "device; the previous snapshots are unchanged"
    )


@pytest.mark.parametrize("moment", ["_read", "verify", "_dcp_load"])
def test_a_snapshot_rotated_away_while_being_read_gives_way_to_the_newest(
    tmp_path, monkeypatch, moment
):
    """A run saving with keep_snapshots=1 removes the snapshot a reader (generate, export,
    score, init_from) chose, at any moment of its read: the manifest, the shards' checksums
    or DCP's read. The reader takes the newest; a snapshot named directly says it was replaced."""
    root = str(tmp_path / "snapshots")
    sharded.save({"w": torch.zeros(4)}, {"step": 1}, root, 1, keep=1, async_save=False)
    chosen = manifest.latest(root)
    # The shards' checksums are checked in manifest.py, the rest of a read in sharded.py.
    owner = manifest if moment == "verify" else sharded
    original, saves = getattr(owner, moment), iter([2, 3])

    def rotate_then(*args, **kwargs):
        # the run publishes a newer one, keep=1
        if chosen in args and manifest.latest(root) == chosen:
            step = next(saves)
            sharded.save(
                {"w": torch.full((4,), float(step))},
                {"step": step},
                root,
                step,
                keep=1,
                async_save=False,
            )
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, moment, rotate_then)
    tensors, meta = sharded.load_full(root)
    assert meta == {"step": 2} and torch.equal(tensors["w"], torch.full((4,), 2.0))
    assert not os.path.exists(chosen)

    chosen = manifest.latest(root)  # named directly: no newer one to take its place
    with pytest.raises(SnapshotError) as replaced:
        sharded.load_full(chosen)
    assert str(replaced.value).startswith(
        f"snapshot {chosen} was removed while being read (its run replaced it"
    )
    if moment == "_read":
        monkeypatch.setattr(sharded, "_read", original)
        assert sharded.read_meta(root) == {"step": 3}
