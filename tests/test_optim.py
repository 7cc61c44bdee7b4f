"""The optimizer: weight-decay groups, Muon against torch's, the learning-rate and momentum
schedules."""

from __future__ import annotations

import copy
import math
from itertools import pairwise

import pytest
import torch

from mingpt.config import GPTConfig, OptimizerConfig
from mingpt.model import GPT
from mingpt.optim import (
    Muon,
    create_optimizer,
    lr_at,
    orthogonalisation_dtype,
    orthogonalise_batch,
    param_groups,
    set_lr,
)


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8))


def test_decay_exactly_on_linear_weights(model):
    names = {id(p): name for name, p in model.named_parameters()}
    decay_group, no_decay_group = param_groups(model, [])
    decay = {names[id(p)] for p in decay_group["params"]}
    no_decay = {names[id(p)] for p in no_decay_group["params"]}

    expected = {"lm_head.weight"} | {
        f"h.{i}.{layer}.weight"
        for i in range(2)
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert decay == expected
    assert {
        "wte.weight",
        "wpe.weight",
        "ln_f.weight",
        "ln_f.bias",
        "h.0.ln_1.weight",
        "h.1.ln_2.weight",
        "h.0.attn.c_attn.bias",
        "h.1.mlp.c_proj.bias",
    } <= no_decay
    assert all(
        name.endswith("bias") or "ln_" in name or name in ("wte.weight", "wpe.weight")
        for name in no_decay
    )
    # Every parameter in exactly one group.
    grouped = [id(p) for p in decay_group["params"] + no_decay_group["params"]]
    assert len(grouped) == len(set(grouped)) == len(names)


def test_optimizer_uses_the_groups_and_settings(model):
    cfg = OptimizerConfig(learning_rate=1e-3, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-6)
    opt = create_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert all(
        g["lr"] == 1e-3 and g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in opt.param_groups
    )
    assert opt.param_groups[0]["fused"] or opt.param_groups[0]["foreach"]


def test_cosine_schedule_values():
    cfg = OptimizerConfig(
        learning_rate=1.0, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1
    )
    total = 111  # steps 0 to 110
    assert lr_at(0, cfg, total) == pytest.approx(0.1)  # warmup: (step + 1) / warmup_steps
    assert lr_at(4, cfg, total) == pytest.approx(0.5)
    assert lr_at(9, cfg, total) == pytest.approx(1.0)
    assert lr_at(10, cfg, total) == pytest.approx(1.0)  # the peak, then decay
    assert lr_at(60, cfg, total) == pytest.approx(0.55)  # half way: midpoint of peak and floor
    assert lr_at(35, cfg, total) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, cfg, total) == pytest.approx(0.1)  # the floor at the last step
    assert lr_at(500, cfg, total) == pytest.approx(0.1)
    rates = [lr_at(s, cfg, total) for s in range(10, 111)]
    assert all(a >= b for a, b in pairwise(rates))


def test_constant_schedule_and_no_warmup():
    constant = OptimizerConfig(learning_rate=3e-4, warmup_steps=4, lr_schedule="constant")
    assert [lr_at(s, constant, 100) for s in (0, 1, 3)] == pytest.approx([0.75e-4, 1.5e-4, 3e-4])
    assert all(lr_at(s, constant, 100) == 3e-4 for s in (4, 50, 99, 1000))
    no_warmup = OptimizerConfig(
        learning_rate=2e-3, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.0
    )
    assert lr_at(0, no_warmup, 101) == pytest.approx(2e-3)
    assert lr_at(50, no_warmup, 101) == pytest.approx(1e-3)
    assert lr_at(100, no_warmup, 101) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "schedule, steps, expected",
    [
        ({"lr_schedule": "cosine"}, 3, [1.0, 0.5, 0.0]),
        ({"lr_schedule": "cosine", "warmup_steps": 2}, 4, [0.5, 1.0, 1.0, 0.0]),
        ({"lr_schedule": "wsd", "cooldown_fraction": 1.0}, 3, [1.0, 0.5, 0.0]),
        # a cooldown shorter than a step: only the last step is on the floor
        ({"lr_schedule": "wsd", "cooldown_fraction": 0.1}, 4, [1.0, 1.0, 1.0, 0.0]),
        ({"lr_schedule": "cosine"}, 1, [1.0]),
    ],
)
def test_decay_reaches_the_floor_at_the_last_step(schedule, steps, expected):
    """The run's steps are 0 to steps - 1: the last one it takes is on the floor."""
    cfg = OptimizerConfig(
        **{"learning_rate": 1.0, "warmup_steps": 0, "min_lr_ratio": 0.0, **schedule}
    )
    assert [lr_at(s, cfg, steps) for s in range(steps)] == pytest.approx(expected)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton–Schulz iteration torch.optim.Muon documents, written out in float64."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g.double().T if g.shape[0] > g.shape[1] else g.double()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(16, 16), (20, 16), (16, 20), (48, 16), (16, 64)])
def test_orthogonalise_batch_in_float32_is_newton_schulz_for_every_shape(shape):
    # square and near-square ones iterate on x (tall ones transposed), longer ones on their Gram
    # matrices
    batch = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    got = orthogonalise_batch(batch, 3.4445, -4.775, 2.0315, 5, 1e-7)
    assert got.shape == batch.shape
    for x, want in zip(got, batch, strict=True):
        assert torch.allclose(x.double(), newton_schulz(want), rtol=0, atol=1e-5)


def test_muon_takes_the_blocks_matrices_and_steps_as_written(model):
    cfg = OptimizerConfig(
        algorithm="muon",
        learning_rate=1e-3,
        muon_learning_rate=0.05,
        muon_momentum=0.9,
        weight_decay=0.1,
        warmup_steps=0,
    )
    opt = create_optimizer(model, cfg)
    names = {id(p): name for name, p in model.named_parameters()}
    adamw, muon = opt.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    assert muon.dtype == torch.float32  # on a CPU
    assert {names[id(p)] for p in muon.param_groups[0]["params"]} == {
        f"h.{i}.{layer}.weight"
        for i in range(2)
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert (
        "lm_head.weight" in adamw_names
        and "wte.weight" in adamw_names
        and len(adamw_names) + 8 == len(names)
    )
    assert set_lr(opt, 0, cfg, 100) == 1e-3 and [g["lr"] for g in opt.param_groups] == [
        1e-3,
        1e-3,
        0.05,
    ]

    # Every shape Muon takes: square, tall by 3 and 4 (scaled by sqrt(rows / columns)), and wide;
    # in float32 they are orthogonalised on their Gram matrices, those of one shape together.
    matrices = muon.param_groups[0]["params"]
    expected = [p.detach().double().clone() for p in matrices]
    buffers = [torch.zeros_like(p, dtype=torch.float64) for p in matrices]
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + step))
        grads = [p.grad.double() for p in matrices]
        opt.step()
        for i, (p, grad) in enumerate(zip(matrices, grads, strict=True)):
            # By hand: the momentum buffer as an average, Nesterov's look-ahead, decoupled weight
            # decay.
            buffers[i] = 0.9 * buffers[i] + 0.1 * grad
            update = grad + 0.9 * (buffers[i] - grad)
            scale = 0.05 * math.sqrt(max(1, p.size(0) / p.size(1)))
            expected[i] = expected[i] * (1 - 0.05 * 0.1) - scale * newton_schulz(update)
    assert {p.shape for p in matrices} == {(48, 16), (16, 16), (64, 16), (16, 64)}
    # On a CPU Muon iterates in float32: bfloat16's rounding (2^-8 of an update's entries) would
    # be some 1e-3 off
    for p, want in zip(matrices, expected, strict=True):
        assert torch.allclose(p.double(), want, rtol=0, atol=1e-5)
    weight = matrices[0]

    state = opt.state_dict()  # both optimizers' states, loaded back as they were
    again = create_optimizer(model, cfg)
    again.load_state_dict(state)
    assert torch.equal(
        again.optimizers[1].state[weight]["momentum_buffer"], muon.state[weight]["momentum_buffer"]
    )


def test_muon_is_refused_with_fsdp():
    from mingpt.config import Config, ConfigError, TrainerConfig

    with pytest.raises(
        ConfigError, match="^optimizer_config.algorithm: muon orthogonalises whole matrices"
    ):
        Config(
            optimizer_config=OptimizerConfig(algorithm="muon"),
            trainer_config=TrainerConfig(parallelism="fsdp"),
        )


def test_orthogonalisation_dtype_per_device():
    assert orthogonalisation_dtype(torch.device("cpu")) == torch.float32
    assert orthogonalisation_dtype(torch.device("cuda", 0)) == torch.bfloat16


def steps_alike(a: list[torch.Tensor], b: list[torch.Tensor], step: int) -> None:
    """The same gradients, seeded by `step`, on the parameters `a` and their copies `b`."""
    for p, q in zip(a, b, strict=True):
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + step))
        p.grad = grad.to(p.device)
        q.grad = grad.to(q.device)


def step_to_the_bit(ours: list, mine, theirs: list, torchs, steps: int) -> None:
    """`steps` steps of the optimizers `mine` over `ours` and `torchs` over `theirs`, on the same
    gradients: the parameters are equal after each."""
    for step in range(steps):
        steps_alike(ours, theirs, step)
        mine.step()
        torchs.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True)), step


def twin_matrices(model: GPT, device: str = "cpu") -> tuple[list, list]:
    """The blocks' matrices of `model`, and a copy of them."""
    ours = [p.to(device) for n, p in model.named_parameters() if n.startswith("h.") and p.ndim == 2]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def test_muon_in_bfloat16_is_torch_muon_and_takes_over_its_state(model):
    """In torch's dtype the step is torch's, to the bit, and a state torch's Muon saved (a snapshot
    written before this Muon) resumes bitwise."""
    ours, theirs = twin_matrices(model)
    mine = Muon(ours, lr=0.05, dtype=torch.bfloat16)
    torchs = torch.optim.Muon(theirs, lr=0.05)
    step_to_the_bit(ours, mine, theirs, torchs, steps=3)

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    again = Muon(resumed, lr=0.05, dtype=torch.bfloat16)
    again.load_state_dict(copy.deepcopy(torchs.state_dict()))  # as from a file: no buffer shared
    assert again.state_dict()["param_groups"] == torchs.state_dict()["param_groups"]
    steps_alike(resumed, theirs, 3)
    again.step()
    torchs.step()
    assert all(torch.equal(p, q) for p, q in zip(resumed, theirs, strict=True))


def test_muon_in_float32_without_nesterov_steps_along_the_averaged_buffer(model):
    """torch's nesterov=False, which no config key sets but a loaded state may: the update is the
    momentum buffer itself, not Nesterov's look-ahead of it."""
    ours, _ = twin_matrices(model)
    muon = Muon(ours, lr=0.05, dtype=torch.float32)
    muon.param_groups[0]["nesterov"] = False
    expected = [p.detach().double().clone() for p in ours]
    buffers = [torch.zeros_like(p, dtype=torch.float64) for p in ours]
    for step in range(2):
        steps_alike(ours, [torch.empty_like(p) for p in ours], step)
        grads = [p.grad.double() for p in ours]
        muon.step()
        for i, (p, grad) in enumerate(zip(ours, grads, strict=True)):
            buffers[i] = 0.95 * buffers[i] + 0.05 * grad
            scale = 0.05 * math.sqrt(max(1, p.size(0) / p.size(1)))
            expected[i] = expected[i] * (1 - 0.05 * 0.1) - scale * newton_schulz(buffers[i])
    for p, want in zip(ours, expected, strict=True):
        assert torch.allclose(p.double(), want, rtol=0, atol=1e-5)


@pytest.mark.cuda
def test_muon_on_a_gpu_is_torch_muon(model):
    """On a GPU create_optimizer's Muon iterates in bfloat16, as torch's does, to the bit."""
    model = model.cuda()
    muon = create_optimizer(model, OptimizerConfig(algorithm="muon")).optimizers[1]
    assert muon.dtype == torch.bfloat16
    ours, theirs = twin_matrices(model, "cuda")
    mine = Muon(ours, lr=0.05, dtype=muon.dtype)
    torchs = torch.optim.Muon(theirs, lr=0.05)
    step_to_the_bit(ours, mine, theirs, torchs, steps=3)


def test_wsd_schedule_values():
    cfg = OptimizerConfig(
        learning_rate=1.0,
        warmup_steps=10,
        lr_schedule="wsd",
        cooldown_fraction=0.5,
        min_lr_ratio=0.1,
    )
    total = 101  # steps 0 to 100
    assert lr_at(0, cfg, total) == pytest.approx(0.1)  # warmup as for cosine
    assert lr_at(9, cfg, total) == pytest.approx(1.0)
    assert all(lr_at(s, cfg, total) == 1.0 for s in (10, 30, 50))  # flat to the cooldown
    assert lr_at(51, cfg, total) == pytest.approx(1.0 - 0.9 / 50)  # its first step down
    assert lr_at(75, cfg, total) == pytest.approx(0.55)  # half way down: peak and floor's midpoint
    assert lr_at(100, cfg, total) == pytest.approx(0.1)  # the floor at the last step, then kept
    assert lr_at(500, cfg, total) == pytest.approx(0.1)
    rates = [lr_at(s, cfg, total) for s in range(10, 101)]
    assert all(a >= b for a, b in pairwise(rates))
    # the default cooldown: the last 60% of the run
    default = OptimizerConfig(learning_rate=1.0, warmup_steps=0, lr_schedule="wsd")
    assert lr_at(40, default, 101) == 1.0 and lr_at(41, default, 101) < 1.0
    assert lr_at(70, default, 101) == pytest.approx(0.1 + 0.9 * 30 / 60)


def test_muon_momentum_warmup_reaches_the_groups(model):
    cfg = OptimizerConfig(algorithm="muon", muon_momentum=0.95, muon_momentum_warmup_steps=10)
    opt = create_optimizer(model, cfg)
    adamw, muon = opt.optimizers
    for step, momentum in ((0, 0.85), (5, 0.9), (9, 0.94), (10, 0.95), (1000, 0.95)):
        set_lr(opt, step, cfg, 100)
        assert muon.param_groups[0]["momentum"] == pytest.approx(momentum), step
    assert all("momentum" not in g for g in adamw.param_groups)


def test_defaults_compute_as_before(model):
    """The new keys' defaults change nothing: cosine, and Muon's momentum from the first step."""
    cfg = OptimizerConfig(algorithm="muon")
    assert cfg.lr_schedule == "cosine" and cfg.muon_momentum_warmup_steps == 0
    opt = create_optimizer(model, cfg)
    for step in (0, 1, 50):
        set_lr(opt, step, cfg, 100)
        assert opt.optimizers[1].param_groups[0]["momentum"] == cfg.muon_momentum


@pytest.mark.parametrize(
    "bad",
    [{"cooldown_fraction": 0.0}, {"cooldown_fraction": 1.5}, {"muon_momentum_warmup_steps": -1}],
)
def test_schedule_keys_are_checked(bad):
    from mingpt.config import ConfigError

    (name,) = bad
    with pytest.raises(ConfigError, match=f"^optimizer_config.{name}: must be"):
        OptimizerConfig(**bad)
