"""The CUDA paths, on a host with a GPU (skipped elsewhere, saying why: conftest's
`cuda` marker): NCCL DDP through torchrun on every visible GPU, bf16 autocast,
fp16 with its GradScaler saved and restored, compile, FSDP2 with its mixed
precision, both data placements, KV-cache generation (eager and CUDA graphs),
and a resume after SIGKILL. Tiny models, a few steps each.

Not run on the CPU-only machines these were written on: each mirrors a CPU test
(test_distributed, test_snapshot, test_corpus, test_generate, test_comm_hooks)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO,
    TINY,
    child_env,
    read_snapshot,
    run_dir_of,
    run_main,
    run_torchrun,
    torchrun_cmd,
)

from mingpt.config import DataConfig, GPTConfig
from mingpt.data import HostBatches, TokenWindows, load_data
from mingpt.decoding import generate
from mingpt.model import GPT
from mingpt.snapshot import sharded
from mingpt.snapshot.reader import load_model

pytestmark = pytest.mark.cuda

CUDA = "trainer_config.device=cuda"  # after TINY's device=cpu: the later override wins

# NCCL and FSDP2 need processes on GPUs of their own: one process would train unsharded, without a
# collective.
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs, one for each of two processes"
)


def gpus() -> int:
    return torch.cuda.device_count()


def args(data, *extra: str) -> list[str]:
    return [*TINY, CUDA, f"data_config.path={data}", "trainer_config.sample_chars=0", *extra]


def train_losses(run_dir) -> list[float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if r["split"] == "train"]


def trained(tmp_path, data, *extra: str, nproc: int = 0) -> tuple[dict, list]:
    """Run main.py on CUDA (torchrun with `nproc` processes, or plain python for 0);
    return its snapshot.pt and its logged training losses."""
    given = args(data, *extra)
    proc = run_torchrun(nproc, given, tmp_path) if nproc else run_main(given, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path, given)
    losses = train_losses(run_dir)
    assert losses and all(math.isfinite(x) for x in losses), losses
    return read_snapshot(run_dir / "snapshots"), losses


@two_gpus
def test_nccl_ddp_trains_on_every_visible_gpu(tmp_path, small_corpus):
    snapshot, _ = trained(tmp_path, small_corpus, "trainer_config.max_steps=4", nproc=gpus())
    assert snapshot["world_size"] == gpus() and snapshot["step"] == 4
    # loadable anywhere
    assert all(t.device.type == "cpu" for t in snapshot["model_state"].values())


def test_bf16_autocast_trains_and_learns(tmp_path, small_corpus):
    snapshot, losses = trained(
        tmp_path,
        small_corpus,
        "trainer_config.use_amp=true",
        "trainer_config.amp_dtype=bf16",
        "trainer_config.max_steps=30",
        "optimizer_config.learning_rate=1e-2",
    )
    assert snapshot["step"] == 30 and losses[-1] < losses[0]
    # fp32 master weights
    assert all(t.dtype == torch.float32 for t in snapshot["model_state"].values())


def test_fp16_grad_scaler_state_is_saved_and_restored(tmp_path, small_corpus):
    """fp16 with the GradScaler, SIGKILLed as step 5 starts and resumed from the save
    at step 3: the scaler's scale and growth tracker go on from the snapshot, so
    the run ends with the scaler state of the uninterrupted run."""
    given = args(
        small_corpus,
        "trainer_config.use_amp=true",
        "trainer_config.amp_dtype=fp16",
        "trainer_config.save_every_steps=3",
        "trainer_config.max_steps=8",
    )
    (killed, log), (reference, _) = killed_and_reference(tmp_path, given, kill_step=4)
    assert log.count("resumed from") == 1 and "samples into it, step 3" in log, log[-3000:]
    assert (
        reference["scaler_state"]["scale"] > 0 and reference["scaler_state"]["_growth_tracker"] >= 0
    )
    assert killed["step"] == 8
    for key in ("scale", "_growth_tracker", "growth_interval"):
        assert killed["scaler_state"][key] == reference["scaler_state"][key], key


def test_compiled_training_saves_plain_weights(tmp_path, small_corpus):
    snapshot, _ = trained(
        tmp_path, small_corpus, "trainer_config.compile=true", "trainer_config.max_steps=3"
    )
    assert snapshot["step"] == 3 and not any("_orig_mod" in k for k in snapshot["model_state"])
    model, _, _ = load_model(
        str(
            run_dir_of(
                tmp_path,
                args(small_corpus, "trainer_config.compile=true", "trainer_config.max_steps=3"),
            )
            / "snapshots"
        ),
        torch.device("cuda"),
    )
    assert next(model.parameters()).is_cuda


@two_gpus
def test_fsdp2_with_bf16_mixed_precision_publishes_a_sharded_snapshot(tmp_path, small_corpus):
    given = args(
        small_corpus,
        "trainer_config.parallelism=fsdp",
        "trainer_config.use_amp=true",
        "trainer_config.amp_dtype=bf16",
        "trainer_config.max_steps=3",
    )
    proc = run_torchrun(gpus(), given, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path, given)
    assert all(math.isfinite(x) for x in train_losses(run_dir))
    tensors, meta = sharded.load_full(str(run_dir / "snapshots"))
    assert meta["step"] == 3 and meta["world_size"] == gpus()
    # the sharded fp32 master weights
    assert all(t.dtype == torch.float32 for t in tensors["model"].values())


def test_device_and_pinned_host_placements_train_alike(tmp_path, small_corpus):
    states = {}
    for placement in ("device", "host"):
        (tmp_path / placement).mkdir()
        states[placement], _ = trained(
            tmp_path / placement,
            small_corpus,
            f"data_config.placement={placement}",
            "trainer_config.max_steps=5",
        )
    # The same samples in the same order; kernels may reduce in another order.
    torch.testing.assert_close(
        states["host"]["model_state"], states["device"]["model_state"], rtol=1e-4, atol=1e-5
    )


def test_host_batches_match_the_corpus(small_corpus):
    data = load_data(DataConfig(path=str(small_corpus), block_size=16, stride=5))
    host, _ = data.place(torch.device("cuda"), "host")
    assert isinstance(host, HostBatches)
    resident, _ = data.place(torch.device("cuda"), "device")
    assert isinstance(resident, TokenWindows) and resident.tokens.is_cuda
    steps = torch.randperm(len(data.train)).split(8)
    host.prefetch(steps[0])  # an asynchronous copy from a pinned buffer
    for step in steps[:3]:
        x, y = host.batch(step)
        assert x.is_cuda and y.is_cuda
        for a, b in zip((x, y), data.train.batch(step), strict=True):
            assert torch.equal(a.cpu(), b)
        host.prefetch(step)


@pytest.fixture(scope="module")
def cuda_model():
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16, dropout=0.0)
    )
    return model.to("cuda").eval()


def cuda_tokens(model, idx, n, seed=None, **kwargs) -> list[int]:
    generator = None if seed is None else torch.Generator("cuda").manual_seed(seed)
    return torch.cat(list(generate(model, idx, n, generator=generator, **kwargs)), dim=1)[
        0
    ].tolist()


def test_cached_generation_on_cuda_gives_the_tokens_of_full_recomputation(cuda_model):
    idx = torch.randint(65, (1, 40), device="cuda")  # longer than block_size: the cache refills
    greedy = cuda_tokens(cuda_model, idx, 60, temperature=0.0, use_cache=True)
    assert greedy == cuda_tokens(cuda_model, idx, 60, temperature=0.0, use_cache=False)
    sampled = cuda_tokens(cuda_model, idx, 60, seed=3, use_cache=True)
    assert sampled == cuda_tokens(cuda_model, idx, 60, seed=3, use_cache=False)


def test_cuda_graph_decoding_gives_the_tokens_of_full_recomputation(cuda_model):
    idx = torch.randint(65, (1, 40), device="cuda")
    # reduce-overhead: CUDA graphs
    compiled = cuda_tokens(cuda_model, idx, 60, seed=5, use_cache=True, compile=True)
    assert compiled == cuda_tokens(cuda_model, idx, 60, seed=5, use_cache=False)
    assert cuda_tokens(cuda_model, idx, 40, temperature=0.0, compile=True) == cuda_tokens(
        cuda_model, idx, 40, temperature=0.0, use_cache=False
    )


def test_generate_cli_on_cuda(tmp_path, small_corpus):
    trained(tmp_path, small_corpus, "trainer_config.max_steps=3")
    snapshot = run_dir_of(tmp_path, args(small_corpus, "trainer_config.max_steps=3")) / "snapshots"
    cmd = [
        sys.executable,  # this interpreter: `python` on PATH may be another, without torch
        "-m",
        "mingpt.generate",
        f"snapshot_path={snapshot}",
        "device=cuda",
        "max_new_tokens=20",
        "temperature=0",
        "prompt=AB",
    ]
    first, second = (
        subprocess.run(
            cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300
        )
        for _ in range(2)
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert (
        first.stdout == second.stdout and first.stdout.startswith("AB") and len(first.stdout) >= 22
    )


# Loss tolerance after a resume on CUDA: the backward of the embedding (index_add)
# and cuBLAS may reduce in another order from run to run; over a few steps of this
# model that moves weights by ~1e-6 and the loss far less than 1e-3.
RESUME_RTOL = 1e-3


def killed_and_reference(
    tmp_path, given: list[str], kill_step: int
) -> tuple[tuple[dict, str], tuple[dict, str]]:
    """tests/ft_kill.py under `torchrun --max-restarts=1` on one GPU, twice: SIGKILLed as
    step kill_step + 1 starts (then restarted), and uninterrupted. ((snapshot, train.log) of
    each)."""
    results = []
    for name, step in (("killed", kill_step), ("reference", -1)):
        cwd = tmp_path / name
        cwd.mkdir()
        env = {
            **child_env(),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "FT_KILL_RANK": "0",
            "FT_KILL_STEP": str(step),
        }
        cmd = torchrun_cmd(1, "--standalone", "--max-restarts=1") + [
            str(REPO / "tests" / "ft_kill.py"),
            *given,
        ]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run_dir = run_dir_of(cwd, given)
        results.append((read_snapshot(run_dir / "snapshots"), (run_dir / "train.log").read_text()))
    return results[0], results[1]


def test_sigkilled_cuda_run_resumes_at_the_saved_step_and_data_position(tmp_path, small_corpus):
    """The one process dies as it starts step 7; torchrun restarts it; it resumes from
    the save at step 5 and ends at step 12 where the uninterrupted run ends: bitwise
    where the kernels were deterministic, else within RESUME_RTOL."""
    given = args(
        small_corpus,
        "trainer_config.save_every_steps=5",
        "trainer_config.max_steps=12",
        "optimizer_config.lr_schedule=constant",
    )
    (killed, log), (reference, _) = killed_and_reference(tmp_path, given, kill_step=6)
    assert log.count("resumed from") == 1 and "samples into it, step 5" in log, log[-3000:]
    assert killed["step"] == reference["step"] == 12
    assert (killed["epoch"], killed["samples_in_epoch"]) == (
        reference["epoch"],
        reference["samples_in_epoch"],
    )
    torch.testing.assert_close(
        killed["model_state"], reference["model_state"], rtol=RESUME_RTOL, atol=1e-5
    )
