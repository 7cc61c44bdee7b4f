"""The model: causality, loss at initialisation, the KV cache, GPT-2 initialisation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mingpt.config import GPTConfig
from mingpt.model import GPT, KVCache, parameter_count


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    shape = dict(n_layer=2, n_head=4, n_embd=32, dropout=0.0, vocab_size=50, block_size=24)
    return GPT(GPTConfig(**{**shape, **overrides}))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_changing_a_token_changes_no_earlier_logit(mode):
    model = tiny_gpt()
    # Larger weights than the 0.02 init, so that any leak of the future would show.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.train(mode == "train")
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50, (3, 24), generator=g)
    base, _ = model(idx)
    for t in (0, 5, 23):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1 + torch.arange(3)) % 50
        logits, _ = model(changed)
        assert torch.allclose(logits[:, :t], base[:, :t], rtol=0, atol=1e-5), (
            f"position {t} leaked backwards"
        )
        assert (logits[:, t:] - base[:, t:]).abs().amax() > 1e-2  # and it does change position t on


def test_loss_at_initialisation_is_near_uniform():
    vocab = 65
    model = tiny_gpt(vocab_size=vocab, n_embd=64, n_layer=3)
    idx = torch.randint(0, vocab, (8, 24), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, vocab, (8, 24), generator=torch.Generator().manual_seed(3))
    logits, loss = model(idx, targets)
    assert logits.shape == (8, 24, vocab)
    assert abs(loss.item() - math.log(vocab)) < 0.05
    assert model(idx)[1] is None


def test_a_model_computing_in_bf16_gives_a_float32_loss():
    """FSDP's bf16 policy runs the model in bf16 without autocast: the cross-entropy of its bf16
    logits is taken in float32 (as autocast takes it), where it was a bf16 number: a sharded run's
    logged train loss read 4.03125 where the same run under DDP logged 4.0639."""
    vocab = 65
    model = tiny_gpt(vocab_size=vocab).to(torch.bfloat16)
    idx = torch.randint(0, vocab, (8, 24), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, vocab, (8, 24), generator=torch.Generator().manual_seed(3))
    logits, loss = model(idx, targets)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    assert loss.item() == expected.item()


def test_kv_cache_gives_the_logits_of_a_full_forward():
    model = tiny_gpt().eval()
    idx = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(4))
    full, _ = model(idx)
    cache = KVCache.empty(model.config, batch_size=2, device="cpu")
    prefill, _ = model(idx[:, :7], cache=cache)
    steps = [prefill]  # the prompt's last position alone
    for t in range(7, 20):  # one token at a time, over the fixed-shape cache
        steps.append(model.step(idx[:, t : t + 1], torch.tensor([t]), cache)[:, None])
    assert torch.allclose(torch.cat(steps, dim=1), full[:, 6:], rtol=0, atol=1e-5)
    # A later prompt refills the cache from position 0: what it held is masked out, not mixed in.
    model(idx[:, 10:13], cache=cache)
    logits = model.step(idx[:, 13:14], torch.tensor([3]), cache)
    assert torch.allclose(logits, model(idx[:, 10:14])[0][:, -1], rtol=0, atol=1e-5)


def test_a_step_uses_the_weights_the_model_holds_now():
    """A block's step reads its modules' parameters where they live (FSDP swaps tensors there):
    a copy steps with its own weights, and so does a model whose weights were assigned anew."""
    model = tiny_gpt().eval()
    other = tiny_gpt(seed=1).eval()
    copied = copy.deepcopy(model)
    copied.load_state_dict(other.state_dict(), assign=True)
    idx = torch.tensor([[7]])
    for stepped, reference in ((model, model), (copied, other)):
        cache = KVCache.empty(stepped.config, batch_size=1, device="cpu")
        logits = stepped.step(idx, torch.tensor([0]), cache)
        assert torch.allclose(logits, reference(idx)[0][:, -1], rtol=0, atol=1e-5)


def test_sequence_longer_than_block_size_is_refused():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_gpt2_initialisation_scales_residual_projections():
    n_layer = 8
    model = tiny_gpt(n_layer=n_layer, n_embd=128, n_head=4)
    params = dict(model.named_parameters())
    scaled = 0.02 / math.sqrt(2 * n_layer)
    for name, p in params.items():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(scaled, rel=0.1), name
        elif name.endswith(("c_attn.weight", "c_fc.weight")) or name in (
            "wte.weight",
            "wpe.weight",
            "lm_head.weight",
        ):
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name
        elif name.endswith("bias") or ".ln_" in name or name.startswith("ln_f"):
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(p == expected), name
    # attention and MLP
    assert sum(name.endswith("c_proj.weight") for name in params) == 2 * n_layer


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    """Blocks recomputed in backward (dropout's random stream replayed): the same
    loss and the same gradients, bitwise, as keeping the activations."""
    idx = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(2))
    results, kept = [], []
    for checkpointed in (False, True):
        model = tiny_gpt(dropout=0.1)
        model.checkpoint_blocks = checkpointed
        torch.manual_seed(3)  # dropout's stream
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(t.numel()) or t, lambda t: t
        ):
            _, loss = model(idx, idx)
        kept.append(sum(saved))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (loss_ac, grads_ac) = results
    assert kept[1] < kept[0] / 2  # the blocks' activations were not kept
    assert torch.equal(loss, loss_ac)
    assert grads.keys() == grads_ac.keys() and all(
        torch.equal(grads[n], grads_ac[n]) for n in grads
    )


@pytest.mark.parametrize("shape", [(1, 1, 8, 3, 8), (3, 2, 32, 65, 16), (6, 6, 384, 65, 256)])
def test_parameter_count_is_the_built_models(shape):
    """What start-up and a snapshot's reader count without allocating is what the model holds:
    a block, embedding or head that changes shape changes both."""
    n_layer, n_head, n_embd, vocab_size, block_size = shape
    config = GPTConfig(
        n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=block_size
    )
    assert parameter_count(config) == sum(p.numel() for p in GPT(config).parameters())
