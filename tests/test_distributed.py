"""Distributed training with real processes: torchrun, gloo, CPU, a tiny model.

Each torchrun launch costs seconds (every process imports torch), so a few
module-scoped launches of tests/dist_worker.py run several jobs each, and the
tests below compare what they left behind.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO,
    RUN_DEADLINE,
    TINY,
    child_env,
    free_port,
    read_snapshot,
    run_dir_of,
    run_torchrun,
    torchrun_cmd,
)

from mingpt.snapshot import sharded

WORKER = str(REPO / "tests" / "dist_worker.py")
# 20,010 characters: 1,125 training windows and 125 held-out windows of 16
# tokens. 125 is divisible by neither 2 nor 3, so the eval samplers pad.
CORPUS_CHARS = 20_010
HELDOUT_TOKENS = 125 * 16
# No warmup and a large learning rate: the first steps move the weights a lot,
# so a run that saw other samples ends far from the reference. Adam's eps is
# raised so that parameters whose gradient is only rounding noise (the key
# biases: softmax ignores them) do not turn that noise into lr-sized steps.
FAST = [
    "optimizer_config.warmup_steps=0",
    "optimizer_config.learning_rate=1e-2",
    "optimizer_config.eps=1e-6",
    "trainer_config.sample_chars=0",
    "trainer_config.max_steps=6",
]


# Evaluation capped at 50 of the 125 held-out windows (800 tokens).
CAPPED = "trainer_config.eval_tokens=800"
FSDP = "trainer_config.parallelism=fsdp"


def job(name: str, *overrides: str, train: bool = True, sample_first: bool = False) -> dict:
    return {
        "name": name,
        "overrides": [*TINY, *FAST, *overrides],
        "train": train,
        "sample_first": sample_first,
    }


def run_worker(tmp_path, corpus_file, nproc: int, jobs: list[dict], env=None) -> dict:
    """Run the jobs in `nproc` processes (plain python for 1, else torchrun), with
    `env` (default child_env()); return {job name: [rank 0's result, rank 1's, ...]}."""
    jobs = [{**j, "overrides": [*j["overrides"], f"data_config.path={corpus_file}"]} for j in jobs]
    out = tmp_path / f"world{nproc}"
    launcher = [sys.executable] if nproc == 1 else torchrun_cmd(nproc, "--standalone")
    proc = subprocess.run(
        [*launcher, WORKER, str(out), json.dumps(jobs)],
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        j["name"]: [torch.load(out / j["name"] / f"rank{r}.pt") for r in range(nproc)] for j in jobs
    }


def first_eval(tmp_path, nproc: int, name: str) -> dict:
    lines = (tmp_path / f"world{nproc}" / name / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r["split"] == "eval")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file):
    """World sizes 1, 2 and 3 on the same data from the same initial weights.
    The global batch is 8 samples per step in every training job."""
    tmp = tmp_path_factory.mktemp("runs")
    results = {
        1: run_worker(
            tmp,
            corpus_file,
            1,
            [
                job("batch8", "trainer_config.batch_size=8"),
                job("accum4x2", "trainer_config.batch_size=2", "trainer_config.grad_accum_steps=4"),
                job("capped", CAPPED, train=False),
            ],
        ),
        2: run_worker(
            tmp,
            corpus_file,
            2,
            [
                job("batch4", "trainer_config.batch_size=4"),
                job("accum2x2", "trainer_config.batch_size=2", "trainer_config.grad_accum_steps=2"),
                job("fp16", "trainer_config.batch_size=4", "trainer_config.ddp_comm_hook=fp16"),
                job(
                    "powersgd",
                    "trainer_config.batch_size=4",
                    "trainer_config.ddp_comm_hook=powersgd",
                    "trainer_config.powersgd_start_step=2",
                ),
                job("capped", CAPPED, train=False),
                job("fsdp", "trainer_config.batch_size=4", FSDP),
                job(
                    "fsdp_accum2x2",
                    "trainer_config.batch_size=2",
                    "trainer_config.grad_accum_steps=2",
                    FSDP,
                ),
                job(
                    "fsdp_amp",
                    "trainer_config.batch_size=4",
                    FSDP,
                    "trainer_config.use_amp=true",
                    "trainer_config.amp_on_cpu=true",
                    "trainer_config.sample_chars=8",
                ),
                job(
                    "fsdp_sample_first",
                    "trainer_config.batch_size=4",
                    FSDP,
                    "trainer_config.sample_chars=8",
                    sample_first=True,
                ),
            ],
        ),
        3: run_worker(
            tmp,
            corpus_file,
            3,
            [
                job("eval", train=False),
                job("capped", CAPPED, train=False),
                # 50 windows in chunks of 16: 17, 17 and 16 per rank, so 2, 2 and 1 chunks.
                job("fsdp_capped", CAPPED, "trainer_config.batch_size=4", FSDP, train=False),
            ],
        ),
    }
    return tmp, results


def assert_same_weights(a: dict, b: dict, atol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(
            a[key], b[key], rtol=0, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_ranks_end_with_identical_weights(runs):
    _, results = runs
    for name, per_rank in results[2].items():
        for other in per_rank[1:]:
            for key, tensor in per_rank[0]["state"].items():
                assert torch.equal(tensor, other["state"][key]), (
                    f"{name}: {key} differs between ranks"
                )


def test_two_ranks_match_one_process_with_double_batch(runs):
    _, results = runs
    reference = results[1]["batch8"][0]["state"]
    assert_same_weights(results[2]["batch4"][0]["state"], reference)
    # The check has teeth: six steps move the weights (~3e-2) far beyond the tolerance.
    assert max_diff(results[1]["batch8"][0]["init"], reference) > 1e-2


def test_grad_accumulation_matches_one_big_batch(runs):
    _, results = runs
    reference = results[1]["batch8"][0]["state"]
    # 4 micro-steps of 2 == 1 step of 8
    assert_same_weights(results[1]["accum4x2"][0]["state"], reference)
    # 2 ranks x 2 micro-steps of 2
    assert_same_weights(results[2]["accum2x2"][0]["state"], reference)


def test_eval_loss_is_exact_for_world_sizes_1_2_3(runs):
    tmp, results = runs
    losses = {1: results[1]["batch8"], 2: results[2]["batch4"], 3: results[3]["eval"]}
    reference = losses[1][0]["eval_init"]
    for world_size, per_rank in losses.items():
        for result in per_rank:  # every rank gets the global loss
            assert result["eval_init"] == pytest.approx(reference, rel=1e-6), world_size
    for world_size, name in ((1, "batch8"), (2, "batch4"), (3, "eval")):
        record = first_eval(tmp, world_size, name)
        assert record["tokens"] == HELDOUT_TOKENS  # the padding duplicates are not counted
        assert len(record["rank_losses"]) == world_size
    # Ranks see different windows, so their own means differ from each other.
    assert len(set(first_eval(tmp, 3, "eval")["rank_losses"])) == 3


def test_capped_eval_is_exact_for_world_sizes_1_2_3(runs):
    tmp, results = runs
    reference = results[1]["capped"][0]["eval_init"]
    for world_size in (1, 2, 3):
        for result in results[world_size]["capped"]:
            assert result["eval_init"] == pytest.approx(reference, rel=1e-6), world_size
        record = first_eval(tmp, world_size, "capped")
        assert record["tokens"] == 800 and len(record["rank_losses"]) == world_size
    # The cap has teeth: the full split's loss differs.
    assert abs(reference - results[1]["batch8"][0]["eval_init"]) > 1e-4


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_comm_hook_runs_on_gloo(runs, hook):
    tmp, results = runs
    assert (tmp / "world2" / hook / "snapshots").exists()
    state = results[2][hook][0]["state"]
    assert all(torch.isfinite(t).all() for t in state.values())
    # The hook really compressed the gradients: the weights differ from plain DDP's.
    assert max_diff(state, results[2]["batch4"][0]["state"]) > 0


def test_bf16_hook_is_refused_on_gloo(tmp_path, corpus_file):
    proc = run_torchrun(
        2, [*TINY, f"data_config.path={corpus_file}", "trainer_config.ddp_comm_hook=bf16"], tmp_path
    )
    assert proc.returncode != 0
    # Each rank meets the refusal on its own: the first to say it ends, and torchrun stops a rank
    # that had not reached it yet (under load, rank 0 once), which says that instead.
    said = [line for line in proc.stderr.splitlines() if re.match(r"(\[rank \d+\] )?error: ", line)]
    refused = [
        line for line in said if "trainer_config.ddp_comm_hook: bf16" in line and "NCCL" in line
    ]
    stopped = [line for line in said if line.endswith("error: stopped by SIGTERM, exiting at once")]
    assert refused and len(refused) + len(stopped) == len(said), proc.stderr
    assert f'File "{REPO / "mingpt"}' not in proc.stderr  # no stack trace from our code
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_a_missing_corpus_stops_every_rank_in_one_line(tmp_path):
    """Rank 0 alone reads the corpus (once per node) while rank 1 waits for it: rank 1 stops with
    rank 0's line too, not with a stack trace of the collective it was left waiting in."""
    missing = tmp_path / "missing.txt"
    proc = run_torchrun(2, [*TINY, f"data_config.path={missing}"], tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: data file not found: {missing}"], proc.stderr
    assert "[rank1]: " not in proc.stderr  # a worker's traceback
    assert f'File "{REPO / "mingpt"}' not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_rank_that_fails_alone_stops_the_others_without_a_traceback(tmp_path, corpus_file):
    """Rank 1 meets an error of its own mid-run and says it in one line; rank 0, in a collective
    whose connections rank 1 closed on its way out, waits for torchrun to stop it (one line), where
    it printed gloo's "Connection closed by peer" with a traceback."""
    env = {**child_env(), "FT_KILL_RANK": "1", "FT_KILL_STEP": "3", "FT_KILL_ERROR": "unreadable"}
    args = [*TINY, f"data_config.path={corpus_file}", "trainer_config.max_steps=20"]
    cmd = torchrun_cmd(2, "--standalone") + [str(REPO / "tests" / "ft_kill.py"), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "[rank 1] error: unreadable" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "[rank0]: " not in proc.stderr, proc.stderr[-3000:]
    assert "Error executing job" not in proc.stderr, proc.stderr[-3000:]


def test_a_worker_whose_peer_ended_on_another_node_says_so_in_one_line(tmp_path, corpus_file):
    """A collective fails as a worker on another node ended, and no signal of this node's torchrun,
    which saw nothing, follows: after its wait for one the worker ends in one line, also in
    torchrun's error file, where it printed the collective's traceback (one process, whose
    collective's failure tests/ft_kill.py plays)."""
    error_file = tmp_path / "error.json"
    env = {
        **child_env(),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        "FT_KILL_RANK": "0",
        "FT_KILL_STEP": "3",
        "FT_KILL_ERROR": "peer",
    }
    args = [*TINY, f"data_config.path={corpus_file}", "trainer_config.max_steps=20"]
    cmd = [sys.executable, str(REPO / "tests" / "ft_kill.py"), *args]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE
    )
    line = "error: another worker of this job ended, so this one cannot go on (its output says why)"
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert line in error_file.read_text()


def test_a_sweep_under_torchrun_gives_each_job_a_process_group(tmp_path, corpus_file):
    """The jobs of a sweep run one after another in the same processes: the second joined the
    first's keys in torchrun's store and waited there forever."""
    args = [*TINY, f"data_config.path={corpus_file}", "trainer_config.max_steps=2"]
    proc = run_torchrun(2, [*args, "trainer_config.seed=1,2", "-m"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):
        snapshot = read_snapshot(tmp_path / "runs" / "default-multirun" / job / "snapshots")
        assert snapshot["world_size"] == 2 and snapshot["step"] == 2


def two_nodes(tmp_path, node_args: list[list[str]]) -> tuple[list, list[tuple[str, str]]]:
    """Two torchrun agents ("nodes" 0 and 1, one process each) meeting at 127.0.0.1, node i running
    main.py with node_args[i], to their end: the agents and their (stdout, stderr)."""
    port = free_port()
    agents = [
        subprocess.Popen(
            torchrun_cmd(
                1,
                "--nnodes=2",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
            )
            + [str(REPO / "main.py"), *args],
            cwd=tmp_path,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node, args in enumerate(node_args)
    ]
    try:
        outputs = [agent.communicate(timeout=RUN_DEADLINE) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    return agents, outputs


def test_two_nodes_on_loopback_train_together(tmp_path, corpus_file):
    """Two torchrun agents ("nodes" 0 and 1, one process each) meet at
    127.0.0.1 and train to the end; only rank 0 logs INFO and writes."""
    args = [
        *TINY,
        f"data_config.path={corpus_file}",
        "trainer_config.max_epochs=1",
        "trainer_config.use_amp=true",
    ]  # ignored on CPU, with a warning that is the same on every rank
    agents, outputs = two_nodes(tmp_path, [args, args])
    stderr = "".join(err for _, err in outputs)
    assert [agent.returncode for agent in agents] == [0, 0], stderr[-3000:]
    run_dir = run_dir_of(tmp_path, args)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["split"] == "eval" and records[-1]["epoch"] == 1
    assert records[-1]["tokens"] == HELDOUT_TOKENS and len(records[-1]["rank_losses"]) == 2
    snapshot = read_snapshot(run_dir / "snapshots")
    assert snapshot["world_size"] == 2 and snapshot["epoch"] == 1
    # Rank 0 alone logs a warning that every rank would log alike; rank 1's INFO lines stay quiet.
    assert not [line for line in stderr.splitlines() if line.startswith("[rank 1] ")], stderr
    assert stderr.count("WARNING trainer_config.use_amp ignored on CPU") == 1, stderr
    assert sum("train step" in line for line in stderr.splitlines()) == len(
        [r for r in records if r["split"] == "train"]
    )


def test_a_node_started_with_another_config_is_refused(tmp_path, corpus_file):
    """Each node runs its own command: node 1 with another learning rate trained its replica with
    it, averaged into rank 0's gradients, and the run ended as done; with another save_every_steps
    it met rank 0 in another collective and gloo aborted. Now every rank stops at start with one
    line naming the keys, before the run directory is written."""
    args = [*TINY, f"data_config.path={corpus_file}", "trainer_config.max_steps=2"]
    agents, outputs = two_nodes(
        tmp_path,
        [
            [*args, "optimizer_config.learning_rate=0.001"],
            [*args, "optimizer_config.learning_rate=0.01", "trainer_config.save_every_steps=1"],
        ],
    )
    stderr = "".join(err for _, err in outputs)
    assert all(agent.returncode != 0 for agent in agents), stderr[-3000:]
    line = (
        "error: rank 1 runs with another config than rank 0 (optimizer_config.learning_rate: "
        "0.001 -> 0.01; trainer_config.save_every_steps: null -> 1): start every node with the "
        "same command"
    )
    for _, err in outputs:
        assert line in err, err[-3000:]
    assert not run_dir_of(tmp_path, args).exists()


def test_fsdp_trains_like_ddp_and_one_process(runs):
    """FSDP2 shards parameters, gradients and AdamW state over the 2 ranks; with
    the same global batch it takes the same steps as DDP and one process (up to
    float rounding: its reductions add in another order), also with accumulation."""
    _, results = runs
    reference = results[1]["batch8"][0]["state"]
    assert_same_weights(results[2]["fsdp"][0]["state"], reference)
    assert_same_weights(results[2]["fsdp"][0]["state"], results[2]["batch4"][0]["state"])
    assert_same_weights(results[2]["fsdp_accum2x2"][0]["state"], reference)
    for result in results[2]["fsdp"]:
        assert result["eval_init"] == pytest.approx(results[1]["batch8"][0]["eval_init"], rel=1e-6)


def test_fsdp_under_amp_samples_at_its_evaluations(runs):
    """The sharded model computes in bf16, its keys and values too: a sample's cache in the
    parameters' float32 ended every such run at its first evaluation (index_copy_'s dtypes)."""
    _, results = runs
    for rank in results[2]["fsdp_amp"]:
        assert math.isfinite(rank["eval_init"]) and rank["state"]


def test_fsdp_trains_after_a_sample_before_its_first_step(runs):
    """A resumed run's sample due comes before its first step: FSDP's buffers for the gathered
    parameters, made at the first gather, were then inference tensors, and the first training
    step's gather into them ended the run (inplace update to inference tensor)."""
    _, results = runs
    for rank, result in enumerate(results[2]["fsdp_sample_first"]):
        for key, tensor in results[2]["fsdp"][rank]["state"].items():
            assert torch.equal(result["state"][key], tensor), key


def test_fsdp_eval_is_exact_when_ranks_have_unequal_shares(runs):
    """Every forward of a sharded model is a collective: a rank with fewer
    held-out windows runs a repeat it does not count, and the loss stays exact."""
    _, results = runs
    reference = results[1]["capped"][0]["eval_init"]
    for result in results[3]["fsdp_capped"]:
        assert result["eval_init"] == pytest.approx(reference, rel=1e-6)


def test_fsdp_run_leaves_a_sharded_snapshot_of_its_weights(runs):
    tmp, results = runs
    tensors, meta = sharded.load_full(str(tmp / "world2" / "fsdp" / "snapshots"))
    assert (
        meta["step"] == 6
        and meta["world_size"] == 2
        and meta["trainer_config"]["parallelism"] == "fsdp"
    )
    for key, value in results[2]["fsdp"][0]["state"].items():
        assert torch.equal(tensors["model"][key], value), key
