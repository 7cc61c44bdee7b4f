"""DDP communication hooks with real gloo processes: batched PowerSGD, LocalSGD
(post_localSGD_hook + PeriodicModelAverager), and their per-rank state across a
snapshot, also after a SIGKILL under torchrun.

One module-scoped launch of tests/dist_worker.py runs the uninterrupted
references, the LocalSGD jobs and a PowerSGD run resumed; the SIGKILL test is one
torchrun job with a restart, on a simulated GPU host.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import test_distributed
import torch
from conftest import (
    REPO,
    RUN_DEADLINE,
    TINY,
    child_env,
    fake_cuda_env,
    read_snapshot,
    run_dir_of,
    torchrun_cmd,
)
from omegaconf import OmegaConf
from test_distributed import FAST, run_worker

from mingpt.config import Config
from mingpt.distributed import DistInfo
from mingpt.run import build

CORPUS_CHARS = test_distributed.CORPUS_CHARS  # the corpus_file fixture reads it
# A constant learning rate: a run cut short (max_steps) takes the same steps as a longer one.
COMMON = [
    *FAST,
    "optimizer_config.lr_schedule=constant",
    "gpt_config.dropout=0.1",
    "trainer_config.batch_size=4",
]
# LocalSGD from step 5 on (4 plain steps), averaging after steps 5, 9, 13, ..., 37 (every 4).
LOCALSGD = [
    "trainer_config.ddp_comm_hook=post_local_sgd",
    "trainer_config.localsgd_start_step=4",
    "trainer_config.localsgd_period=4",
]
POWERSGD_STEPS = 25
POWERSGD = {
    hook: [f"trainer_config.ddp_comm_hook={hook}", "trainer_config.powersgd_start_step=2"]
    for hook in ("powersgd", "batched_powersgd")
}

# Autocast changes the order backward produces the gradients in, and so DDP's rebuilt buckets.
# So does compile.
VARIANTS = {
    "_amp": ["trainer_config.use_amp=true", "trainer_config.amp_on_cpu=true"],
    "_compile": ["trainer_config.compile=true"],
}


def job(name: str, *overrides: str) -> dict:
    return {"name": name, "overrides": [*TINY, *COMMON, *overrides], "train": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file):
    tmp = tmp_path_factory.mktemp("hooks")
    resumed = tmp / "resumed"
    # The interrupted LocalSGD run saves and evaluates often; the reference never in between.
    busy = [
        "trainer_config.save_every_steps=3",
        "trainer_config.eval_every=5",
        f"trainer_config.snapshot_path={resumed}",
    ]
    jobs = [
        job("ddp", "trainer_config.max_steps=40"),
        job("localsgd", *LOCALSGD, "trainer_config.max_steps=40"),
        job("localsgd_at_37", *LOCALSGD, "trainer_config.max_steps=37"),
        job("localsgd_to_38", *LOCALSGD, *busy, "trainer_config.max_steps=38"),  # mid-period
        job(
            "localsgd_from_38",
            *LOCALSGD,
            *busy,
            "trainer_config.max_steps=40",
            "trainer_config.allow_config_change=true",
        ),
        *(
            job(hook, *keys, f"trainer_config.max_steps={POWERSGD_STEPS}")
            for hook, keys in POWERSGD.items()
        ),
        *(
            job(
                f"powersgd{variant}",
                *POWERSGD["powersgd"],
                *keys,
                f"trainer_config.max_steps={POWERSGD_STEPS}",
            )
            for variant, keys in VARIANTS.items()
        ),
        # Saved at step 10, compressing since step 3, and resumed by a new DDP of the same ranks.
        *(
            job(
                f"powersgd{variant}_{part}",
                *POWERSGD["powersgd"],
                *keys,
                f"trainer_config.snapshot_path={tmp / f'powersgd{variant}-resumed'}",
                f"trainer_config.max_steps={steps}",
                "trainer_config.allow_config_change=true",
            )
            for variant, keys in {"": [], **VARIANTS}.items()
            for part, steps in (("to_10", 10), ("from_10", POWERSGD_STEPS))
        ),
    ]
    return tmp, run_worker(tmp, corpus_file, 2, jobs)


def states(per_rank: list[dict]) -> list[dict]:
    return [r["state"] for r in per_rank]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def last_eval(tmp, name: str) -> dict:
    lines = (tmp / "world2" / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "eval"][-1]


def test_localsgd_replicas_are_equal_right_after_averaging_and_differ_between(runs):
    _, results = runs
    at_37, at_38, at_40 = (
        states(results[name]) for name in ("localsgd_at_37", "localsgd_to_38", "localsgd")
    )
    assert same(*at_37)  # step 37 averaged
    assert not same(*at_38) and not same(*at_40)  # one and three local steps later
    assert same(*states(results["ddp"]))


def test_localsgd_resumes_bitwise_and_saving_or_evaluating_changes_nothing(runs):
    tmp, results = runs
    for rank in (0, 1):  # each rank continues its own replica
        assert same(results["localsgd_from_38"][rank]["state"], results["localsgd"][rank]["state"])
    snapshot = read_snapshot(tmp / "resumed")
    hook = snapshot["comm_hook"]
    assert hook["name"] == "post_local_sgd" and hook["world_size"] == 2 and snapshot["step"] == 40
    for rank in (0, 1):
        assert same(hook["ranks"][rank]["model_state"], results["localsgd"][rank]["state"])
    # The snapshot's optimizer state is rank 0's (the replicas' moments differ): what a resume on
    # another number of ranks starts from, as its warning says.
    own = hook["ranks"][0]["optimizer_state"]
    assert snapshot["optimizer_state"]["state"].keys() == own.keys()
    assert all(same(snapshot["optimizer_state"]["state"][k], own[k]) for k in own)
    # they do differ
    assert not all(same(own[k], hook["ranks"][1]["optimizer_state"][k]) for k in own)
    # The snapshot's model is the replicas' mean.
    mean = {
        k: (v + hook["ranks"][1]["model_state"][k]) / 2
        for k, v in hook["ranks"][0]["model_state"].items()
    }
    torch.testing.assert_close(snapshot["model_state"], mean, rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["", *VARIANTS])
def test_powersgd_resumes_bitwise_from_a_save_mid_compression(runs, variant):
    """Saved at step 10 (compressing since step 3), each rank's error feedback, the warm-start P
    and Q and the random state of Q's starts are restored in a new DDP: the resumed run ends
    bitwise where the uninterrupted run ended (after a SIGKILL and a restart: the test below).
    Under AMP and compile too: the step that lays out DDP's buckets before the restore runs in
    autocast, through the compiled model, as training does; without that the restored state went
    to a bucket of another order."""
    tmp, results = runs
    name = f"powersgd{variant}"
    for rank in (0, 1):
        # it resumed the save at step 10, not a fresh start
        assert same(
            results[f"{name}_from_10"][rank]["init"], results[f"{name}_to_10"][rank]["state"]
        )
        assert same(results[f"{name}_from_10"][rank]["state"], results[name][rank]["state"])
    snapshot = read_snapshot(tmp / f"{name}-resumed")
    assert snapshot["step"] == POWERSGD_STEPS and snapshot["comm_hook"]["name"] == "powersgd"
    assert len(snapshot["comm_hook"]["ranks"][1]["error"]) >= 1


def test_localsgd_evaluates_the_mean_and_converges_like_ddp(runs, corpus_file):
    tmp, _ = runs
    snapshot = read_snapshot(tmp / "resumed")
    overrides = [*TINY, *COMMON, f"data_config.path={corpus_file}"]
    config = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(overrides))
    )
    one = build(config, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(tmp / "one"))
    one.raw_model.load_state_dict(snapshot["model_state"])
    logged = last_eval(tmp, "localsgd")
    assert logged["step"] == 40
    # The eval loss is the same for any world size: one process scoring the mean reproduces it.
    assert one.evaluate() == pytest.approx(logged["loss"], rel=1e-6)
    # Within 3% of DDP's eval loss (measured: 3.144 against 3.180; both start at 4.17).
    ddp = last_eval(tmp, "ddp")["loss"]
    assert logged["loss"] == pytest.approx(ddp, rel=0.03), (logged["loss"], ddp)
    assert ddp < 3.5  # it learnt


@pytest.mark.parametrize("name", ["localsgd", "powersgd"])
def test_a_resume_in_one_process_warns_that_the_per_rank_state_starts_afresh(
    runs, corpus_file, tmp_path, caplog, name
):
    """docs/training.md: resumed with another number of ranks, the hook's per-rank state starts
    afresh, with a warning; one process (which has no hook) included."""
    tmp, _ = runs
    snapshot = tmp_path / "snapshots"
    shutil.copytree(tmp / "world2" / name / "snapshots", snapshot)
    keys = LOCALSGD if name == "localsgd" else POWERSGD[name]
    overrides = [
        *TINY,
        *COMMON,
        *keys,
        f"data_config.path={corpus_file}",
        f"trainer_config.snapshot_path={snapshot}",
        "trainer_config.allow_config_change=true",
    ]
    config = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(overrides))
    )
    with caplog.at_level(logging.WARNING, logger="mingpt.comm_hooks"):
        trainer = build(config, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(tmp_path / "run"))
    step = trainer.state.step
    hook = "post_local_sgd" if name == "localsgd" else name
    tail = " (the replicas' mean) and rank 0's optimizer state" if name == "localsgd" else ""
    assert [r.getMessage() for r in caplog.records if r.name == "mingpt.comm_hooks"] == [
        f"trainer_config.ddp_comm_hook={hook} has no effect in one process: it acts on what the "
        "ranks of a run under torchrun communicate",
        f"the snapshot's {hook} state is per rank, for 2 ranks; "
        "this run has 1 process (no comm hook): "
        f"that state starts afresh at step {step}, from the snapshot's weights{tail}",
    ]
    assert step > 0


@pytest.mark.parametrize("name", ["none", "bf16", "powersgd"])
def test_a_comm_hook_in_one_process_is_said_to_have_no_effect(caplog, name):
    """One process has no DDP and no hook: a bf16 run there kept its gradients unrounded, which the
    same command under torchrun rounds, with nothing said."""
    from mingpt.comm_hooks import create
    from mingpt.config import TrainerConfig

    with caplog.at_level(logging.WARNING, logger="mingpt.comm_hooks"):
        hook = create(TrainerConfig(ddp_comm_hook=name), DistInfo(0, 0, 1, 1, torch.device("cpu")))
    assert hook.name == "none"
    said = [
        f"trainer_config.ddp_comm_hook={name} has no effect in one process: it acts on what the "
        "ranks of a run under torchrun communicate"
    ]
    if name == "none":
        said = []
    assert [r.getMessage() for r in caplog.records] == said


# A run's scaler without fp16: every run has one.
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)


def test_a_resume_on_fewer_ranks_warns_on_rank_0_only(caplog):
    """The same with 2 ranks resuming a snapshot of
    4 (their hook's start, given fake world sizes)."""
    from mingpt.comm_hooks import PowerSGD
    from mingpt.config import TrainerConfig

    registered = []

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            registered.append(state)

    saved = {"name": "powersgd", "world_size": 4, "ranks": [{}] * 4}
    with caplog.at_level(logging.INFO, logger="mingpt.comm_hooks"):
        for rank in (0, 1):
            hook = PowerSGD(
                "powersgd", TrainerConfig(), DistInfo(rank, rank, 2, 2, torch.device("cpu"))
            )
            hook.start(FakeDDP(), saved, 7, None, None, NO_SCALER, lambda: None)
            assert registered[-1] is hook.state and hook.state.iter == 0  # compression starts over
    assert [r.getMessage() for r in caplog.records] == [
        "the snapshot's powersgd state is per rank, for 4 ranks; "
        "this run has 2 ranks with ddp_comm_hook=powersgd: "
        "that state starts afresh at step 7, from the snapshot's weights"
    ]


def test_a_resume_with_another_powersgd_rank_starts_its_state_afresh(caplog):
    """P and Q have powersgd_rank columns: restored under another rank, the first compressed step
    failed in a reshape, on every attempt. Nor does it go on across a change of `compile` or of
    AMP (autocast), which lay out the error feedback's bucket in another order: AMP switched on or
    off added each error to another parameter's gradient, with nothing said. A snapshot written
    before the settings (or one of them) were saved keeps its state."""
    from mingpt.comm_hooks import PowerSGD
    from mingpt.config import TrainerConfig

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            pass

    loaded = []
    hook = PowerSGD(
        "powersgd", TrainerConfig(powersgd_rank=4), DistInfo(0, 0, 2, 2, torch.device("cpu"))
    )
    hook.load_own_state = lambda own, warm_up: loaded.append(own)
    saved = {"name": "powersgd", "world_size": 2, "state": {"iter": 9}}
    other_settings = [
        {"powersgd_rank": 2},
        {"powersgd_rank": 4, "compile": True},
        {"powersgd_rank": 4, "autocast": True},
    ]
    for settings in other_settings:
        with caplog.at_level(logging.INFO, logger="mingpt.comm_hooks"):
            hook.start(FakeDDP(), {**saved, "settings": settings}, 9, None, None, NO_SCALER, None)
        assert not loaded and hook.state.iter == 0
    this_run = "{'powersgd_rank': 4, 'compile': False, 'autocast': False}"
    assert [r.getMessage() for r in caplog.records] == [
        f"the snapshot's powersgd state was built with {settings}; this run has {this_run}: that "
        "state starts afresh at step 9, from the snapshot's weights"
        for settings in (
            "{'powersgd_rank': 2}",
            "{'powersgd_rank': 4, 'compile': True}",
            "{'powersgd_rank': 4, 'autocast': True}",
        )
    ]
    hook.start(FakeDDP(), saved, 9, None, None, NO_SCALER, None)
    hook.start(
        FakeDDP(), {**saved, "settings": {"powersgd_rank": 4}}, 9, None, None, NO_SCALER, None
    )
    assert loaded == [{"iter": 9}, {"iter": 9}]


def test_powersgd_error_feedback_resumes_in_the_unit_of_the_new_gradient_scaler():
    """The error feedback is kept in units of fp16's loss scale: resumed with amp_dtype switched
    from fp16 to bf16 (allow_config_change) it went on 65536 times too large, the gradient norm
    jumped from 1 to 3e4 with nothing said; switched to fp16, 65536 times too small."""
    from mingpt.comm_hooks import PowerSGD
    from mingpt.config import TrainerConfig

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            pass

    info = DistInfo(0, 0, 2, 2, torch.device("cpu"))
    cfg = TrainerConfig(powersgd_start_step=2, use_amp=True, amp_on_cpu=True)
    fp16 = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    error = torch.ones(3)
    for before, after, factor in ((fp16, NO_SCALER, 2.0**-16), (NO_SCALER, fp16, 2.0**16)):
        saving = PowerSGD("powersgd", cfg, info)
        saving.start(FakeDDP(), None, 0, None, None, before, None)
        saving.state.iter = 5
        saving.state.error_dict = {0: error.clone()}
        own = saving.own_state()
        saved = {"name": "powersgd", "world_size": 2, "settings": saving.settings, "state": own}
        resumed = PowerSGD("powersgd", cfg, info)
        resumed.start(FakeDDP(), saved, 5, None, None, after, lambda: None)
        assert torch.equal(resumed.state.error_dict[0], error * factor)


def test_localsgd_saves_the_best_weights_it_evaluated(monkeypatch):
    """The best weights are saved while every rank holds the replicas' mean it was evaluated with:
    averaged once more there, the saved weights were off the evaluated ones by an ulp where the
    world size is no power of 2. Here rank 0 of 3, the other two ranks' replicas played."""
    import torch.distributed as dist

    from mingpt import comm_hooks
    from mingpt.config import TrainerConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    differing = [[torch.randn_like(p) for p in model.parameters()] for _ in range(2)]
    others = differing

    def mean_of_3(params, group):  # each rank's share, summed
        for p, *theirs in zip(params, *others, strict=True):
            p.copy_(p / 3 + theirs[0] / 3 + theirs[1] / 3)

    monkeypatch.setattr(comm_hooks.averaging_utils, "average_parameters", mean_of_3)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        hook = comm_hooks.PostLocalSGD(TrainerConfig(), DistInfo(0, 0, 1, 1, torch.device("cpu")))
        hook.model = model
        with hook.mean_weights():
            evaluated = {k: v.clone() for k, v in model.state_dict().items()}
            others = [[p.detach().clone() for p in model.parameters()]] * 2
            saved = hook.model_state(model.state_dict())
        assert same(saved, evaluated)
        # outside it, the same mean computed afresh (the latest snapshot's)
        others = differing
        assert same(hook.model_state(model.state_dict()), evaluated)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["powersgd", "batched_powersgd"])
def test_powersgd_under_fp16_goes_on_after_a_step_the_scaler_skipped(name):
    """A step whose gradients are not finite (an fp16 overflow) is skipped by the gradient scaler,
    but its NaNs went into PowerSGD's error feedback and warm-start Q: every later gradient was
    NaN and every later step skipped, with nothing said. Here a real DDP (one gloo process)
    compresses, then overflows once: the steps after it are finite and taken. A scale that grows
    scales the error feedback with it.

    Each hook in a process of its own, which ends with os._exit while it still holds the DDP
    (powersgd_under_fp16 says why)."""
    code = (
        "import os, traceback, test_comm_hooks as t\n"
        "try:\n"
        f"    kept = t.powersgd_under_fp16({name!r})\n"
        "except BaseException:\n"
        "    traceback.print_exc()\n"
        "    os._exit(1)\n"
        "os._exit(0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO / "tests",
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def powersgd_under_fp16(name: str) -> torch.nn.Module:
    """The test above, for the hook `name`, in the process that calls it. It returns the DDP, for
    the caller to hold until os._exit. The DDP holds the last reference to the gloo group:
    released, it destroys the group under the GIL and waits for the group's lock, which a gloo
    thread may hold while it frees the last all-reduce's tensors, for which it waits for the GIL
    (pytorch#56297, open: this test hung in CI twice, and in 1 run of about 70 under load here,
    where gdb showed both threads)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mingpt.comm_hooks import PowerSGD
    from mingpt.config import TrainerConfig

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        ddp = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        # the scale doubles after each step taken
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        cfg = TrainerConfig(powersgd_rank=1, powersgd_start_step=2)
        hook = PowerSGD(name, cfg, DistInfo(0, 0, 1, 1, torch.device("cpu")))
        hook.start(ddp, None, 0, model, optimizer, scaler, lambda: None)
        x = torch.randn(16, 8)
        taken = []
        for step in range(8):
            loss = ddp(x).square().mean()
            if step == 4:  # compressing since step 2
                loss = loss * torch.inf
            scaler.scale(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(optimizer)
            scaler.update()
            errors = [e.clone() for e in hook.state.error_dict.values()]
            hook.after_optimizer_step()
            optimizer.zero_grad()
            after = list(model.parameters())
            taken.append(not all(torch.equal(b, p) for b, p in zip(before, after, strict=True)))
            if step == 3:  # grown from 2**11 to 2**12
                for old, new in zip(errors, hook.state.error_dict.values(), strict=True):
                    torch.testing.assert_close(new, 2 * old, rtol=0, atol=0)
        assert taken == [True] * 4 + [False] + [True] * 3
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert scaler.get_scale() == 2.0**14  # 2**12 backed off to 2**11, then grown 3 times
    finally:
        dist.destroy_process_group()
    return ddp


# torchrun's store across restarts: its shared one (TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset: on one
# node mingpt keeps each attempt's keys apart). Restarted workers that read the dead ones' addresses
# fail to connect or wait forever (pytorch#135712): the run would not end. A fresh store per attempt
# (the variable set, as docs/fault-tolerance.md says for several nodes) is taken by test_snapshot's
# SIGKILL tests; PowerSGD's (not batched) state across a resume by the test above.
def test_sigkilled_compressed_run_on_a_gpu_host_resumes_bitwise(runs, corpus_file, tmp_path):
    """Rank 1 dies as it starts step 14 (compressing with batched PowerSGD since step 3); torchrun
    restarts both, and they join the process group again; they resume from the save at step 10 (or
    5) with each rank's error feedback and the warm-start P and Q, and end bitwise where the
    uninterrupted run ended on a CPU host.

    The job is a gloo/CPU job on a host where torch.cuda.is_available() (simulated): torch's
    PowerSGD hooks synchronize CUDA whenever it is available, also for CPU gradients ("Expected
    a cuda device, but got: cpu"). The run must go on and end as on a CPU host."""
    hook = "batched_powersgd"
    _, results = runs
    args = [
        *TINY,
        *COMMON,
        *POWERSGD[hook],
        f"data_config.path={corpus_file}",
        "trainer_config.save_every_steps=5",
        f"trainer_config.max_steps={POWERSGD_STEPS}",
    ]
    env = fake_cuda_env(gpus=2, env={**child_env(), "FT_KILL_RANK": "1", "FT_KILL_STEP": "13"})
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmd = torchrun_cmd(2, "--standalone", "--max-restarts=1") + [
        str(REPO / "tests" / "ft_kill.py"),
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path, args)
    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log and log.rstrip().count("resumed from") == 1, log[-3000:]
    # From the save at step 10, or at step 5 when 10's was still being written in the background.
    assert (
        "epoch 0, 80 samples into it, step 10" in log
        or "epoch 0, 40 samples into it, step 5" in log
    )
    snapshot = read_snapshot(run_dir / "snapshots")
    assert snapshot["step"] == POWERSGD_STEPS and snapshot["comm_hook"]["name"] == hook
    assert len(snapshot["comm_hook"]["ranks"][1]["error"]) >= 1  # error feedback was saved...
    # ...and the run ended where it would have
    assert same(snapshot["model_state"], results[hook][0]["state"])


def test_torch_fixes_change_nothing_in_torch(monkeypatch):
    """mingpt's PowerSGD hooks are copies that see fixed globals; torch's own stay as they were."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from mingpt import torch_fixes

    originals = (
        powerSGD_hook._orthogonalize,
        powerSGD_hook.powerSGD_hook,
        powerSGD_hook.batched_powerSGD_hook,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CPU job on a GPU host
    plain, batched = (
        torch_fixes.powersgd_hook(False, on_cuda=False),
        torch_fixes.powersgd_hook(True, on_cuda=False),
    )
    assert (
        powerSGD_hook._orthogonalize,
        powerSGD_hook.powerSGD_hook,
        powerSGD_hook.batched_powerSGD_hook,
    ) == originals
    assert (
        plain.__globals__["torch"].cuda.is_available() is False
        and torch.cuda.is_available() is True
    )
    # nothing to fix on CUDA
    assert torch_fixes.powersgd_hook(False, on_cuda=True) is powerSGD_hook.powerSGD_hook
    matrix = torch.randn(6, 2)
    batched.__globals__["_orthogonalize"](matrix)  # 2-D, as the batched hook passes it: in place
    assert torch.allclose(matrix.T @ matrix, torch.eye(2), atol=1e-5)
    if torch_fixes._orthogonalize_takes_only_batches():
        with pytest.raises(AssertionError):
            powerSGD_hook._orthogonalize(torch.randn(6, 2))  # torch's own still has the bug


@pytest.mark.parametrize("per_rank", [[1, 1, 2, 2], [2, 2, 2]], ids=["nodes-1-1-2", "world-3"])
def test_localsgd_per_node_refuses_nodes_of_unequal_sizes_on_every_rank(monkeypatch, per_rank):
    """localsgd_group=node groups a node's ranks: with nodes of 1, 1 and 2 processes each node's
    own count divides the 4 ranks, but its ranks built other subgroups than the rest and the job
    hung at its first averaging. Every rank sees every node's count (the gathered local world
    sizes, given here) and refuses alike, before any subgroup."""
    from mingpt import comm_hooks
    from mingpt.config import ConfigError, TrainerConfig

    monkeypatch.setattr(comm_hooks, "all_gather", lambda info, value: per_rank)
    cfg = TrainerConfig(ddp_comm_hook="post_local_sgd", localsgd_group="node")
    world = len(per_rank)
    sizes = ", ".join(map(str, sorted(set(per_rank))))
    for rank, local in enumerate(per_rank):
        info = DistInfo(rank, 0, world, local, torch.device("cpu"))
        with pytest.raises(ConfigError) as refused:
            comm_hooks.create(cfg, info)
        assert str(refused.value) == (
            "trainer_config.localsgd_group: node needs the same number of processes on every node "
            f"({world} ranks; processes per node: {sizes})"
        )
