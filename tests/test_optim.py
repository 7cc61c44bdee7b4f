"""The optimizer: weight-decay groups and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from mingpt.config import GPTConfig, OptimizerConfig
from mingpt.model import GPT
from mingpt.optim import create_optimizer, lr_at, param_groups, set_lr


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8))


def test_decay_exactly_on_linear_weights(model):
    names = {id(p): name for name, p in model.named_parameters()}
    decay_group, no_decay_group = param_groups(model, weight_decay=0.1)
    assert decay_group["weight_decay"] == 0.1 and no_decay_group["weight_decay"] == 0.0
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
    total = 110
    assert lr_at(0, cfg, total) == pytest.approx(0.1)  # warmup: (step + 1) / warmup_steps
    assert lr_at(4, cfg, total) == pytest.approx(0.5)
    assert lr_at(9, cfg, total) == pytest.approx(1.0)
    assert lr_at(10, cfg, total) == pytest.approx(1.0)  # the peak, then decay
    assert lr_at(60, cfg, total) == pytest.approx(0.55)  # half way: midpoint of peak and floor
    assert lr_at(35, cfg, total) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, cfg, total) == pytest.approx(0.1)  # the floor, and it stays there
    assert lr_at(500, cfg, total) == pytest.approx(0.1)
    rates = [lr_at(s, cfg, total) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))


def test_constant_schedule_and_no_warmup():
    constant = OptimizerConfig(learning_rate=3e-4, warmup_steps=4, lr_schedule="constant")
    assert [lr_at(s, constant, 100) for s in (0, 1, 3)] == pytest.approx([0.75e-4, 1.5e-4, 3e-4])
    assert all(lr_at(s, constant, 100) == 3e-4 for s in (4, 50, 99, 1000))
    no_warmup = OptimizerConfig(
        learning_rate=2e-3, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.0
    )
    assert lr_at(0, no_warmup, 100) == pytest.approx(2e-3)
    assert lr_at(50, no_warmup, 100) == pytest.approx(1e-3)
    assert lr_at(100, no_warmup, 100) == pytest.approx(0.0)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton–Schulz iteration torch.optim.Muon documents, written out in float64."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g.double().T if g.shape[0] > g.shape[1] else g.double()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


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

    weight = model.h[0].mlp.c_fc.weight  # (64, 16): tall, so Muon scales its step by sqrt(64 / 16)
    expected, buffer = (
        weight.detach().double().clone(),
        torch.zeros_like(weight, dtype=torch.float64),
    )
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + step))
        grad = weight.grad.double()
        opt.step()
        # By hand: the momentum buffer as an average, Nesterov's look-ahead, decoupled weight decay.
        buffer = 0.9 * buffer + 0.1 * grad
        update = grad + 0.9 * (buffer - grad)
        expected = expected * (1 - 0.05 * 0.1) - 0.05 * math.sqrt(64 / 16) * newton_schulz(update)
    # Muon iterates in bfloat16
    assert torch.allclose(weight.double(), expected, atol=0.05 * 2 * 0.02)

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
