"""A recipe sized for a GPU says so on a CPU, with the expected time per step (mingpt/flops.py)."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mingpt import flops, metrics
from mingpt.cli import CONF_DIR
from mingpt.data import load_data
from mingpt.distributed import DistInfo
from mingpt.model import GPT
from mingpt.run import build, fit_to_data

QUIET_2_CORES = 170e9  # FLOP/s of fp32 matmuls on the 2-core machine of BENCHMARKS.md

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def config(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(
            compose("config", overrides=["trainer_config.device=cpu", *overrides])
        )


def step_flops(cfg) -> float:
    """The FLOPs of one step of `cfg`'s model (a vocabulary of 65 characters)."""
    g, block = cfg.gpt_config, cfg.data_config.block_size
    with torch.device("meta"):  # shapes only
        model = GPT(fit_to_data(g, 65, block))
    tokens = cfg.trainer_config.batch_size * cfg.trainer_config.grad_accum_steps * block
    return flops.flops_per_token(model) * tokens


def test_the_default_run_is_not_measured_and_every_experiment_warns(monkeypatch):
    measured = []
    monkeypatch.setattr(flops, "matmul_rate", lambda: measured.append(1) or QUIET_2_CORES)
    # 4 GFLOP: no measurement
    assert flops.slow_on_cpu(step_flops(config()), 2616) is None and not measured
    assert EXPERIMENTS  # derived from conf/experiment/, not a list kept here
    for name in EXPERIMENTS:
        warning = flops.slow_on_cpu(step_flops(config(f"experiment={name}")), 1000)
        seconds = re.search(r"expect about ([\d,]+) s per step on this CPU", warning or "")
        assert seconds and int(seconds.group(1).replace(",", "")) > flops.SLOW_STEP_SECONDS, (
            name,
            warning,
        )
        assert "\n" not in warning and "170 GFLOP/s" in warning


def test_the_rule_is_the_expected_seconds_per_step():
    rate = 100e9
    assert flops.slow_on_cpu(90e9, 10, rate) is None  # 0.9 s
    warning = flops.slow_on_cpu(120e9, 7200, rate)  # 1.2 s
    assert warning.startswith(
        "this run is sized for a GPU: expect about 1 s per step on this CPU, 2h24m for 7,200 steps"
    )


def test_a_gpu_preset_on_a_cpu_warns_before_training(small_corpus, monkeypatch, caplog):
    monkeypatch.setattr(flops, "matmul_rate", lambda: QUIET_2_CORES)
    cfg = config(
        "experiment=gpu-quick", f"data_config.path={small_corpus}", "trainer_config.compile=false"
    )
    data = load_data(cfg.data_config)
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        trainer = build(
            cfg, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(small_corpus.parent / "run"), data
        )
    warnings = [r.getMessage() for r in caplog.records if "sized for a GPU" in r.getMessage()]
    assert len(warnings) == 1 and f"for {trainer.total_steps:,} steps" in warnings[0]
    # The same model on the GPU it is meant for: no warning (only CPUs are checked).
    assert flops.slow_on_cpu(1e9, 10, QUIET_2_CORES) is None


def test_the_estimate_counts_the_windows_a_step_really_takes(small_corpus, monkeypatch, caplog):
    """A batch larger than the training windows takes them all, once: no warning for a
    small model's huge batch_size (it once said days for two steps that took 40 s)."""
    monkeypatch.setattr(flops, "matmul_rate", lambda: QUIET_2_CORES)
    cfg = config(f"data_config.path={small_corpus}", "trainer_config.batch_size=1073741824")
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        build(cfg, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(small_corpus.parent / "huge"))
    assert not [r for r in caplog.records if "sized for a GPU" in r.getMessage()]


@pytest.mark.parametrize("preset", ["gpt-nano", "gpt-micro"])
def test_small_presets_do_not_warn_on_a_quiet_cpu(preset):
    assert flops.slow_on_cpu(step_flops(config(f"gpt_config={preset}")), 100, QUIET_2_CORES) is None


def test_train_events_carry_mfu_and_peak_memory(small_corpus, monkeypatch, one_thread, caplog):
    """The default model's steps (4 GFLOP) get an MFU against the measured peak,
    computed as bench_train computes it; the tests' tiny models get none. A pace that fell far
    (metrics.Pace, as the test below) is told in one warning naming the fix."""
    peaks = []
    monkeypatch.setattr(
        flops, "peak_rate", lambda device, dtype: peaks.append(dtype) or QUIET_2_CORES
    )
    cfg = config(
        f"data_config.path={small_corpus}",
        "trainer_config.max_steps=2",
        "trainer_config.log_every=1",
        "trainer_config.eval_every=0",
        "trainer_config.sample_chars=0",
    )
    run_dir = small_corpus.parent / "mfu"
    trainer = build(cfg, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(run_dir))
    monkeypatch.setattr(metrics.Pace, "_slowed", lambda self, seconds, tokens_per_s: True)
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        trainer.train()
    slowed = [r.getMessage() for r in caplog.records if "slowed" in r.getMessage()]
    assert len(slowed) == 1  # the first event, whose window holds the start-up, is no pace
    assert slowed[0].startswith("training slowed to ")
    assert " tokens/s by step 2, under a third of the 0 it ran at before: other work" in slowed[0]
    assert "OMP_NUM_THREADS set to the cores left idle" in slowed[0]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["split"] == "train"]
    per_token = flops.flops_per_token(trainer.raw_model)
    assert peaks == [torch.float32]  # measured once, in the step's precision
    assert [e["step"] for e in train] == [1, 2]
    for e in train:
        assert e["mfu"] == pytest.approx(e["tokens_per_s"] * per_token / QUIET_2_CORES, rel=1e-3)
        assert 0 < e["mfu"] < 1 and e["peak_mem_mib"] > 100  # torch alone takes more


def test_an_epochs_short_last_step_counts_the_tokens_it_trained(
    small_corpus, monkeypatch, one_thread
):
    """An epoch's last step takes the windows left, fewer than a global batch: its tokens/s (and
    MFU) count those, not a whole batch's (it read up to a batch over one window too fast, every
    step where the batch exceeds the epoch)."""
    cfg = config(
        f"data_config.path={small_corpus}",
        "trainer_config.batch_size=100",
        "trainer_config.max_steps=4",
        "trainer_config.log_every=1",
        "trainer_config.eval_every=0",
        "trainer_config.sample_chars=0",
    )
    run_dir = small_corpus.parent / "short"
    # A clock that moves 1 s per optimizer step alone: tokens/s is each step's tokens.
    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    trainer = build(cfg, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(run_dir))
    n_train = len(trainer.data.train)
    assert 200 < n_train < 300  # 3 steps an epoch, the last short
    train_step = trainer.train_step

    def timed_step(indices):
        now[0] += 1.0
        return train_step(indices)

    monkeypatch.setattr(trainer, "train_step", timed_step)
    trainer.train()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [e["tokens_per_s"] for e in events if e["split"] == "train"]
    block = cfg.data_config.block_size
    assert rates == [100 * block, 100 * block, (n_train - 200) * block, 100 * block]


def test_a_peak_measured_under_load_is_measured_again_once_the_pace_exceeds_it(monkeypatch):
    """A CPU's peak measured while other work held its cores is below the pace its steps reach
    later, and MFU came out above 1: the peak is then measured again, and the higher kept."""
    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    peaks = [500.0, 2000.0, 4000.0]
    measured = []

    def peak() -> float:
        measured.append(peaks[len(measured)])
        return measured[-1]

    # 100 tokens a step, 10 FLOPs a token: a step a second is 1,000 FLOP/s
    pace = metrics.Pace(100, 10, peak, step=0)
    now[0] = 1.0
    assert pace.event(1, 10).mfu == 0.5  # 1,000 over 500 was 2: measured again, 2,000
    now[0] = 2.0
    assert pace.event(2, 10).mfu == 0.5
    # Above the peak again (it overestimates: a causal attention's FLOPs, say): not measured again,
    # each measuring costs the run 0.2 s.
    now[0] = 2.25
    assert pace.event(3, 10).mfu == 2.0
    assert measured == [500.0, 2000.0]


def test_a_pace_that_falls_far_below_the_best_for_two_long_events_says_so_once(monkeypatch):
    """Cores taken by other work slow a CPU run several-fold and nothing said so: two events in a
    row of 5 s+ at under a third of the best pace say so (the trainer warns); a short or lone slow
    event (a recompile) does not."""
    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    pace = metrics.Pace(100, 10, lambda: 1e6, step=0)
    # (time, step) of each event, 100 tokens a step; the first (start-up) is no reference
    events = [
        (9.0, 1),
        (10.0, 2),
        (20.0, 3),
        (21.0, 13),
        (21.5, 14),
        (31.5, 15),
        (41.5, 16),
        (51.5, 17),
    ]
    slowed = []
    for t, step in events:
        now[0] = t
        slowed.append(pace.event(step, 100).slowed_from)
    # 100 tokens/s at step 2; a lone slow event (10/s), then 1,000/s; a short slow event (0.5 s);
    # then three long ones in a row: said at the second
    assert slowed == [None, None, None, None, None, None, 1000.0, None]
