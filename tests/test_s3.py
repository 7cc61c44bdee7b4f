"""s3:// storage against a real S3 protocol server on localhost (moto), through
s3fs: a run reads its corpus from and saves its snapshot to a bucket; a
missing bucket and an unreachable endpoint are one line each.

Needs the `test` and `s3` extras (pip install -e ".[test,s3]"), as CI installs them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import fsspec
import pytest
import torch

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from conftest import RUN_DEADLINE, TINY, free_port, run_main  # noqa: E402

from mingpt import storage, token_cache  # noqa: E402
from mingpt.data import DataError  # noqa: E402
from mingpt.generate import GenerateConfig, PromptError, read_prompt  # noqa: E402
from mingpt.snapshot import manifest, reader, single_file  # noqa: E402

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server on a free local port."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(endpoint, monkeypatch):
    """fsspec's s3:// in this process pointed at
    `endpoint`, with a bucket `runs`: the S3 filesystem."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    if not fs.exists("runs"):
        fs.mkdir("runs")
    return fs


@pytest.fixture
def stoppable():
    """(the endpoint, the process id) of an S3 server of this test's own with a bucket `runs`:
    stopped (SIGSTOP), it accepts connections and answers none."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + RUN_DEADLINE
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            break
        except OSError:
            # a server that ended (its port taken meanwhile) is not waited for
            assert server.poll() is None, f"moto ended with status {server.returncode}"
            assert time.monotonic() < deadline, "moto did not start"
            time.sleep(0.1)
    fs = fsspec.filesystem(
        "s3", endpoint_url=endpoint, key="test", secret="test", skip_instance_cache=True
    )
    fs.mkdir("runs")
    yield endpoint, server.pid
    os.kill(server.pid, signal.SIGCONT)
    server.terminate()
    server.wait()


def test_a_store_that_stops_answering_fails_the_run_at_start(stoppable, tmp_path):
    """One line within botocore's timeout and tries (shortened here through fsspec's config, as a
    user would lengthen them), not s3fs's retries of botocore's retries (over 10 minutes by
    default)."""
    endpoint, pid = stoppable
    os.kill(pid, signal.SIGSTOP)
    env = {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": endpoint,
        # one try of botocore's in each of s3fs's: its back-offs were most of the test's 15 s
        "FSSPEC_S3": '{"config_kwargs": {"read_timeout": 0.2, "retries": {"max_attempts": 1}}}',
    }
    args = [*TINY, "trainer_config.max_steps=1", "trainer_config.snapshot_path=s3://runs/r1"]
    proc = run_main(args, tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: cannot write to the snapshot path s3://runs/r1: Read ")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_a_run_reads_and_saves_through_s3(s3, endpoint, tmp_path, corpus):
    s3.pipe("runs/small.txt", corpus.read_bytes()[:20_000])
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}  # as docs/training.md says
    args = [
        *TINY,
        "trainer_config.device=cpu",
        "trainer_config.sample_chars=0",
        "trainer_config.max_steps=2",
        "data_config.path=s3://runs/small.txt",
        "trainer_config.snapshot_path=s3://runs/run1/snapshots",
    ]
    proc = run_main(args, tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert reader.read("s3://runs/run1/snapshots")[1]["step"] == 2
    # The best weights beside the snapshots (through s3:// too); no probe or temporary file left.
    assert sorted(s3.ls("runs/run1")) == ["runs/run1/snapshots", "runs/run1/snapshots-best"]
    assert reader.read("s3://runs/run1/snapshots-best")[1]["step"] == 2
    # botocore's INFO `Found credentials in environment variables` is not ours to log.
    assert "Found credentials" not in proc.stderr
    assert not [
        p for p in tmp_path.glob("runs/*/train.log") if "Found credentials" in p.read_text()
    ]


def test_a_snapshot_in_a_missing_bucket_is_refused_not_created(s3, tmp_path):
    url = "s3://no-such-bucket/run1/snapshot.pt"
    refused = (
        rf"^cannot use snapshot path {url}: "
        r"bucket 'no-such-bucket' does not exist \(create it first\)$"
    )
    with pytest.raises(storage.StorageError, match=refused):  # at start
        storage.check_writable(str(tmp_path), url)
    with pytest.raises(storage.StorageError, match=refused):  # and at every save
        single_file.save({"step": 1, "w": torch.zeros(2)}, url)
    s3.invalidate_cache()
    assert not s3.exists("no-such-bucket")


def test_an_unreachable_endpoint_is_one_line(monkeypatch, tmp_path):
    """Nothing listens on the port: botocore's
    EndpointConnectionError (not an OSError) becomes one line."""
    for key, value in {**CREDENTIALS, "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(
        fsspec.config.conf,
        "s3",
        {"endpoint_url": f"http://127.0.0.1:{free_port()}", "skip_instance_cache": True},
    )
    cant_connect = "Could not connect to the endpoint URL"
    with pytest.raises(
        DataError, match=f"^cannot read data file s3://runs/small.txt: {cant_connect}"
    ):
        next(token_cache.decoded_chunks("s3://runs/small.txt"))
    with pytest.raises(
        storage.StorageError, match=f"^cannot reach snapshot path s3://runs/s.pt: {cant_connect}"
    ):
        storage.exists("s3://runs/s.pt")
    with pytest.raises(
        storage.StorageError,
        match=f"^cannot write to the snapshot path s3://runs/s.pt: {cant_connect}",
    ):
        storage.check_writable(str(tmp_path), "s3://runs/s.pt")
    with pytest.raises(
        PromptError, match=f"^prompt_file s3://runs/prompt.txt cannot be read: {cant_connect}"
    ):
        read_prompt(GenerateConfig(prompt_file="s3://runs/prompt.txt"))


def test_sharded_snapshots_publish_and_load_through_s3(s3):
    """mingpt.snapshot.sharded on an object store (no rename of directories): one process saves
    synchronously and asynchronously, keeps the newest, and reads the published one."""
    from mingpt.snapshot import sharded

    model = torch.nn.Linear(4, 3)
    tensors = {"model": model.state_dict(), "extra": {"lr": 0.5, "betas": (0.9, 0.99)}}
    for step, asynchronous in ((1, False), (2, True), (3, True)):
        sharded.save(
            tensors, {"step": step}, "s3://runs/sharded", step, keep=2, async_save=asynchronous
        )
    assert sharded.wait_pending() == "s3://runs/sharded/step-00000003"
    s3.invalidate_cache()
    assert s3.ls("runs/sharded") == ["runs/sharded/step-00000002", "runs/sharded/step-00000003"]
    assert manifest.latest("s3://runs/sharded") == "s3://runs/sharded/step-00000003"
    loaded, meta = sharded.load_full("s3://runs/sharded")
    assert meta == {"step": 3} and loaded["extra"] == {"lr": 0.5, "betas": (0.9, 0.99)}
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_to_a_store_that_stops_answering_says_so(stoppable, monkeypatch, asynchronous):
    """A store stops answering once the snapshot's name is chosen: its upload has no timeout, so a
    line names the snapshot waited for; the store answers again on that line, and the save
    completes."""
    from mingpt.snapshot import sharded

    endpoint, pid = stoppable
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})
    monkeypatch.setattr(storage, "NOTICE_EVERY", 0.1)
    new_name = manifest.new_name

    def then_stop(root, step):
        name = new_name(root, step)
        os.kill(pid, signal.SIGSTOP)
        return name

    monkeypatch.setattr(manifest, "new_name", then_stop)
    said = []

    class Resume(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
            os.kill(pid, signal.SIGCONT)

    handler = Resume()
    logging.getLogger("mingpt.storage").addHandler(handler)
    # Without a line, the store answers again after a while: the test fails rather than hangs.
    fallback = threading.Timer(30, os.kill, (pid, signal.SIGCONT))
    fallback.start()
    try:
        sharded.save({"w": torch.zeros(4)}, {}, "s3://runs/hung", 1, async_save=asynchronous)
        assert sharded.wait_pending() in (None, "s3://runs/hung/step-00000001")
    finally:
        fallback.cancel()
        logging.getLogger("mingpt.storage").removeHandler(handler)
    assert said[0].startswith("still waiting for snapshot s3://runs/hung/step-00000001 after ")
    assert manifest.latest("s3://runs/hung") == "s3://runs/hung/step-00000001"
