"""Text generation: the CLI on a snapshot from a real tiny training run, the
key/value cache (eager and compiled) against full recomputation, batched
samples, sampling on the device (the noise drawn ahead, the chunks streamed,
the distribution), the sampling filters, bad input."""

from __future__ import annotations

import codecs
import copy
import logging
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import RUN_DEADLINE, TINY, child_env, on_cpu, read_snapshot, run_dir_of, run_each

import mingpt.generate as generate_cli
from mingpt import decoding
from mingpt.command import parse_args
from mingpt.config import ConfigError, GPTConfig
from mingpt.decoding import draw_noise, generate, gumbel_, next_token, noise_rows, pick
from mingpt.generate import COMPILE_PAYS_AFTER, GenerateConfig, should_compile
from mingpt.model import GPT, KVCache
from mingpt.snapshot import SnapshotError, single_file
from mingpt.snapshot.reader import load_model

TRAIN_ARGS = TINY + [
    "data_config.path=small.txt",
    "trainer_config.run_name=gen",
    "trainer_config.max_steps=150",
    "optimizer_config.learning_rate=1e-2",
    "optimizer_config.warmup_steps=10",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """(A scratch directory with a snapshot trained for a few seconds on 20k characters, what
    the command gave on each case of commands_on): the training, then those cases, in one
    process (each start is mostly importing torch)."""
    path = tmp_path_factory.mktemp("generate")
    (path / "small.txt").write_text(corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    cases = commands_on(path, run_dir_of(path, TRAIN_ARGS) / "snapshots")
    results = run_each(
        "mingpt.generate",
        [
            (path, on_cpu(TRAIN_ARGS), "mingpt.cli"),
            # on the CPU, whatever devices the host has (a later device= wins)
            *((path, ["device=cpu", *args]) for args in cases.values()),
        ],
    )
    assert results[0].returncode == 0, results[0].stderr
    return path, dict(zip(cases, results[1:], strict=True))


@pytest.fixture(scope="module")
def workdir(trained) -> Path:
    return trained[0]


@pytest.fixture(scope="module")
def snapshot(workdir) -> Path:
    return run_dir_of(workdir, TRAIN_ARGS) / "snapshots"


def generate_cmd(args: list[str]) -> list[str]:
    """generate on the CPU, whatever devices the host has (a later device= wins)."""
    return [sys.executable, "-m", "mingpt.generate", "device=cpu", *args]


def run_generate(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        generate_cmd(args),
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )


# ------------------------------------------------------------------ the command


def seeded(snapshot: Path) -> list[str]:
    return [
        f"snapshot_path={snapshot}",
        "prompt=ROMEO:",
        "max_new_tokens=60",
        "num_samples=2",
        "seed=7",
    ]


def test_samples_stream_separated_and_repeat_with_the_seed(workdir, snapshot, bad_runs):
    args = seeded(snapshot)
    # The repeat and the one-sample run below ran in the one process of the bad inputs (a start
    # each costs more than the text): the seed alone makes the text, in a fresh process or not.
    second, alone = bad_runs["repeat"], bad_runs["alone"]
    first = run_generate(args, workdir)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout  # same seed, same text
    assert "Traceback" not in first.stderr and "INFO" not in first.stdout  # logs go to stderr
    head, sep, sample2 = first.stdout.partition("\n--- sample 2 of 2 ---\n")
    assert sep and head.startswith("--- sample 1 of 2 ---\n")
    sample1 = head.removeprefix("--- sample 1 of 2 ---\n")
    vocab = set(read_snapshot(snapshot)["vocab"])
    for sample in (sample1, sample2):
        assert sample.startswith("ROMEO:")
        generated, rest = sample[6:66], sample[66:]
        assert set(generated) <= vocab
        assert rest == ("" if generated.endswith("\n") else "\n")  # each sample ends a line
    assert sample1 != sample2  # each sample has its own random stream
    # Sample i is the text of a one-sample run with seed + i - 1: sample 1 is that of seed=7 alone.
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout == sample2.removesuffix("\n") + "\n" and sample2.endswith("\n")


def test_text_streams_while_it_is_generated(workdir, snapshot):
    """The first characters arrive long before the text is complete: stdout is flushed
    as text is generated, not at exit (the whole text fits in the pipe's write buffer)."""
    env = child_env()
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.Popen(
        generate_cmd(
            [f"snapshot_path={snapshot}", "prompt=ROMEO:", "max_new_tokens=6000", "compile=false"]
        ),
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        received = b""
        while len(received) < len("ROMEO:") + 20 and (chunk := proc.stdout.read1(8192)):
            received += chunk
    finally:
        proc.kill()
        proc.wait()
    assert received.startswith(b"ROMEO:") and len("ROMEO:") + 20 <= len(received) < 3000


# -------------------------------------------------------------------- the cache


def tokens(model, idx, n, seed=None, **kwargs) -> list[int]:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.cat(list(generate(model, idx, n, generator=generator, **kwargs)), dim=1)[
        0
    ].tolist()


def test_cache_gives_the_tokens_of_full_recomputation_past_block_size(snapshot, corpus, one_thread):
    model, tokenizer, _ = load_model(str(snapshot), torch.device("cpu"))
    assert model.config.block_size == 16
    long_prompt = corpus.read_text(encoding="utf-8")[1000:1040]  # longer than block_size
    for prompt in ("ROMEO:", long_prompt):
        idx = tokenizer.encode(prompt).long()[None]
        greedy = tokens(model, idx, 100, temperature=0.0, use_cache=True)
        assert greedy == tokens(model, idx, 100, temperature=0.0, use_cache=False)
        # top_k=1 is greedy
        assert greedy == tokens(model, idx, 100, seed=1, top_k=1, use_cache=True)
        sampled = tokens(model, idx, 100, seed=3, use_cache=True)
        assert sampled == tokens(model, idx, 100, seed=3, use_cache=False)
        assert sampled != greedy
    model.train()
    tokens(model, idx, 3)
    assert model.training  # generate restores the mode it found


@pytest.mark.parametrize("n_embd", [8, 16])
def test_a_package_is_built_only_for_weights_it_takes_at_load_time(n_embd, monkeypatch, caplog):
    """Inductor writes a 1-D tensor of at most 8 elements into the code: the package of a model with
    n_embd 8 kept its compile-time weights, and failed to load (a warning, and an eager step).
    Such a model's step is torch.compile'd instead."""
    from torch._inductor.graph import GraphLowering

    config = GPTConfig(n_layer=1, n_head=2, n_embd=n_embd, block_size=8, vocab_size=5)
    model = GPT(config)
    inlined = any(GraphLowering.can_inline_constant(p) for p in model.parameters())
    assert decoding.by_reference(model) == (not inlined)
    assert inlined == (n_embd == 8)
    packaged = []
    monkeypatch.setattr(decoding, "can_package", lambda: True)
    monkeypatch.setattr(decoding, "packaged_step", lambda *a: packaged.append(a) or model.step)
    monkeypatch.setattr(decoding, "compile_for_decoding", lambda step, device, static: step)
    cache = KVCache.empty(config, 1, "cpu")
    with caplog.at_level(logging.WARNING, "mingpt.decoding"):
        _, compiled = decoding.cached_step(model, cache, True, [])
    assert compiled and caplog.text == ""
    assert bool(packaged) == (not inlined)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1"])
def test_a_torch_older_than_mingpt_needs_makes_no_package(version, monkeypatch):
    """torch 2.11's AOTInductor loader ended the process with a segmentation fault loading a kept
    step (2.11.0+cu130, on GPU hosts): below 2.13, the torch mingpt needs, the step is
    torch.compile'd instead."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    assert not decoding.can_package()


@pytest.mark.skipif(not decoding.can_package(), reason="this torch loads no AOTInductor package")
def test_a_compiled_cpu_step_is_kept_and_later_runs_load_it(
    snapshot, corpus, one_thread, monkeypatch, caplog, tmp_path
):
    """compile=true on a CPU compiles the step once for the shape, with the tokens of full
    recomputation (past block_size: refills). Where it cannot be kept, with a warning; else in the
    cache directory, where later runs load it without compiling, a model of the same shape with
    other weights too (it computes with its own). A package that does not load is compiled
    again, with a warning; where none can be compiled, the step runs eagerly, with a warning."""
    model, tokenizer, _ = load_model(str(snapshot), torch.device("cpu"))
    idx = tokenizer.encode(corpus.read_text(encoding="utf-8")[1000:1040]).long()[None]
    uncached = tokens(model, idx, 60, seed=5, use_cache=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert tokens(model, idx, 60, seed=5, compile=True) == uncached
    path = decoding.package_path(model, 1)
    assert path.is_file() and path.is_relative_to(tmp_path / "cache")

    # Where it cannot be kept, the step built runs, with a warning. It is built from the exported
    # program as before, and inductor's compilation of it (seconds) gives the package just kept.
    def compiled_as_before(program, package_path, inductor_configs):
        shutil.copyfile(path, package_path)
        return package_path

    (tmp_path / "a-file").touch()
    with monkeypatch.context() as unkept:
        unkept.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
        unkept.setattr(torch._inductor, "aoti_compile_and_package", compiled_as_before)
        with caplog.at_level(logging.WARNING, "mingpt.decoding"):
            assert tokens(model, idx, 60, seed=5, compile=True) == uncached
    assert "cannot be kept" in caplog.text

    def compiled_again(path, model, cache):
        compiled.append(path)
        return model.step

    compiled = []
    monkeypatch.setattr(decoding, "build_package", compiled_again)
    assert tokens(model, idx, 60, seed=5, compile=True) == uncached
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    assert decoding.package_path(other, 1) == path
    assert tokens(other, idx, 60, seed=5, compile=True) == tokens(
        other, idx, 60, seed=5, use_cache=False
    )
    assert compiled == []
    assert decoding.package_path(model, 2) != path  # one package per batch size
    path.write_bytes(path.read_bytes()[:1000])
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mingpt.decoding"):
        assert tokens(model, idx, 60, seed=5, compile=True) == uncached
    assert compiled == [path] and "does not load" in caplog.text

    def no_compiler(path, model, cache):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\n(the rest)")

    def store(cache, layer, k, v, pos):
        if pos is not None:
            filled.append(cache.filled)
        return real_store(cache, layer, k, v, pos)

    filled = []
    real_store = KVCache.store
    monkeypatch.setattr(KVCache, "store", store)
    monkeypatch.setattr(decoding, "build_package", no_compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mingpt.decoding"):
        assert tokens(model, idx, 60, seed=5, compile=True) == uncached
    assert "cannot be compiled here (InvalidCxxCompiler: No working C++ compiler found)" in (
        caplog.text
    )
    # the eager step it falls back to reads the filled positions alone, not the whole cache
    assert filled and None not in filled


def test_a_damaged_kept_step_is_compiled_again_not_loaded(monkeypatch, tmp_path, caplog):
    """torch's loader runs the shared library of a kept package unchecked: a damaged one crashed
    the process. One whose files do not match their CRC-32 is compiled again, with a warning."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=5, block_size=4))
    cache = KVCache.empty(model.config, 1, torch.device("cpu"), torch.float32)
    path = decoding.package_path(model, 1)
    path.parent.mkdir(parents=True)
    with zipfile.ZipFile(path, "w") as package:  # stored: the bytes as written
        package.writestr("step/model.so", b"\x7fELF" + bytes(100))
    data = path.read_bytes()
    at = data.index(b"\x7fELF") + 50
    path.write_bytes(data[:at] + b"\x01" + data[at + 1 :])
    loaded = []
    built = []
    monkeypatch.setattr(decoding, "load_package", lambda path, model: loaded.append(path))
    monkeypatch.setattr(decoding, "build_package", lambda path, model, cache: built.append(path))
    with caplog.at_level(logging.WARNING, "mingpt.decoding"):
        decoding.packaged_step(model, cache)
    assert loaded == [] and built == [path]
    assert "does not load (step/model.so is damaged)" in caplog.text


def test_where_onednn_multiplies_a_row_faster_an_eager_step_uses_it(
    snapshot, corpus, one_thread, monkeypatch
):
    """An eager cached step on a CPU computes its products with oneDNN where oneDNN multiplies one
    row at least a quarter faster than the BLAS (MKL on an AMD EPYC), with the tokens of full
    recomputation; elsewhere, and for a model that is not of plain float32 parameters, with
    F.linear."""
    model, tokenizer, _ = load_model(str(snapshot), torch.device("cpu"))
    idx = tokenizer.encode(corpus.read_text(encoding="utf-8")[1000:1040]).long()[None]
    measured = decoding.one_row_seconds()  # this CPU's
    assert measured["blas"] > 0 and measured["read"] > 0
    if measured["onednn"] < float("inf"):
        x, weight = torch.randn(3, 384), torch.randn(1536, 384)
        # float32 sums of 384 products of about 1, in another order
        expected = F.linear(x, weight)
        torch.testing.assert_close(decoding.onednn_linear(x, weight), expected, atol=1e-4, rtol=0)
    products = []

    def counted(*args, **kwargs):
        products.append(1)
        return F.linear(*args, **kwargs)

    monkeypatch.setattr(decoding, "onednn_linear", counted)
    monkeypatch.setattr(
        decoding, "one_row_seconds", lambda: {"blas": 2.0, "read": 1.0, "onednn": 1.5}
    )
    assert decoding.step_linear(model) is counted
    assert decoding.step_linear(GPT(model.config).bfloat16()) is F.linear
    with_onednn = tokens(model, idx, 60, seed=5)
    assert len(products) > 0
    assert with_onednn == tokens(model, idx, 60, seed=5, use_cache=False)
    monkeypatch.setattr(
        decoding, "one_row_seconds", lambda: {"blas": 2.0, "read": 1.0, "onednn": 1.7}
    )
    assert decoding.step_linear(model) is F.linear
    # Several rows: by a copy of the weights where one is measured faster (this CPU's answer; the
    # tests below take each), the same products up to rounding
    linear = decoding.batch_copies(model, 16)
    if linear is not None:
        for block in model.h:
            x = torch.randn(16, block.mlp.c_fc.in_features)
            weight, bias = block.mlp.c_fc.weight, block.mlp.c_fc.bias
            torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("fastest", ["weights", "transposed", "packed"])
def test_where_the_blas_multiplies_a_batch_goes_by_the_fastest_copy(snapshot, monkeypatch, fastest):
    """Where the BLAS multiplies one row, several rows go by the faster of two copies of the
    blocks' weights, stored transposed (F.linear's) or packed for the rows (oneDNN's), where it is
    at least a fifth faster than the weights as they are; else by the weights."""
    model, _, _ = load_model(str(snapshot), torch.device("cpu"))
    if decoding.one_row_seconds()["onednn"] == float("inf"):  # measured before timeit is faked
        pytest.skip("this torch has no oneDNN that agrees with F.linear")
    monkeypatch.setattr(
        decoding, "one_row_seconds", lambda: {"blas": 1.0, "read": 1.0, "onednn": 1.0}
    )
    # the seconds of the weights', the transposed copy's and the packed copy's products, in the
    # order batch_copies times them
    seconds = {
        "weights": [1.0, 0.85, 0.9],
        "transposed": [1.0, 0.5, 0.7],
        "packed": [1.0, 0.7, 0.5],
    }[fastest]
    timed = iter(seconds)
    monkeypatch.setattr(decoding.timeit, "repeat", lambda *args, **kwargs: [next(timed)])
    by_onednn = []

    def onednn(x, weight, bias=None):
        by_onednn.append(weight)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    monkeypatch.setattr(decoding, "onednn_linear", onednn)
    linear = decoding.step_linear(model, 16)
    assert next(timed, None) is None  # each way timed once
    if fastest == "weights":
        assert linear is F.linear
        return
    block = model.h[0]
    x = torch.randn(16, block.attn.c_attn.in_features)
    weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias))
    if fastest == "packed":
        assert len(by_onednn) == 1 and by_onednn[0] is not weight
    else:
        assert by_onednn == []


@pytest.mark.parametrize("products", ["blas", "transposed", "onednn"])
def test_batched_samples_are_each_what_they_are_alone(snapshot, one_thread, monkeypatch, products):
    """A batch of samples with one generator each: every row gets the tokens it
    gets alone with that generator (so sample 1 is unchanged by num_samples),
    cached or not, and the same seeds give the same batch. A batch's products may come from a copy
    of the weights stored transposed (the BLAS's) or packed for its rows (oneDNN's): the same
    products up to rounding (oneDNN's AVX2 kernels, on an Intel Xeon or with
    ONEDNN_MAX_CPU_ISA=AVX2, round them differently)."""
    model, tokenizer, _ = load_model(str(snapshot), torch.device("cpu"))
    idx = tokenizer.encode("ROMEO:").long()[None]
    faster = {"blas": 1.0, "read": 1.0, "onednn": 2.0}
    if products == "onednn":
        if decoding.one_row_seconds()["onednn"] == float("inf"):
            pytest.skip("this torch has no oneDNN that agrees with F.linear")
        faster = {"blas": 2.0, "read": 1.0, "onednn": 1.0}
    monkeypatch.setattr(decoding, "one_row_seconds", lambda: faster)
    weights = decoding.block_weights(model)

    def batch_copies(model, rows):
        if products != "transposed":
            return None
        # as the measurement gives them where they are faster
        return decoding.by_copy(
            F.linear, weights, [w.detach().t().contiguous().t() for w in weights]
        )

    monkeypatch.setattr(decoding, "batch_copies", batch_copies)
    multiplied = []  # whether each matrix F.linear is given is stored transposed (a copy's)

    def spy(x, weight, bias=None):
        multiplied.append(weight.stride() == (1, weight.size(0)))
        return torch.addmm(bias, x, weight.t())

    with monkeypatch.context() as patched:
        patched.setattr(F, "linear", spy)
        linear = decoding.step_linear(model, 3)
        plain = {"blas": spy, "transposed": spy, "onednn": decoding.onednn_linear}[products]
        assert (linear is plain) == (products == "blas")  # else by a copy for 3 rows
        for block in model.h:
            x = torch.randn(3, block.attn.c_attn.in_features)
            weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias
            torch.testing.assert_close(linear(x, weight, bias), plain(x, weight, bias))
    # per block: the step's product, then the plain one
    transposed = {"blas": [False, False], "transposed": [True, False], "onednn": []}[products]
    assert multiplied == transposed * len(model.h)
    for use_cache in (True, False):
        generators = [torch.Generator().manual_seed(seed) for seed in (11, 12, 13)]
        batch = torch.cat(
            list(generate(model, idx.expand(3, -1), 40, generator=generators, use_cache=use_cache)),
            1,
        )
        alone = [tokens(model, idx, 40, seed=seed, use_cache=use_cache) for seed in (11, 12, 13)]
        assert batch.tolist() == alone
        assert len({tuple(row) for row in alone}) == 3


# ------------------------------------------------- sampling on the device, chunks


@pytest.fixture(scope="module")
def random_model() -> GPT:
    """An untrained model: near-uniform logits, so sampled texts differ from seed to seed."""
    torch.manual_seed(0)
    return GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16, dropout=0.0)
    ).eval()


def chunks(model, n, seed, idx=None, **kwargs) -> list[torch.Tensor]:
    idx = torch.zeros(1, 1, dtype=torch.long) if idx is None else idx
    return list(generate(model, idx, n, generator=torch.Generator().manual_seed(seed), **kwargs))


def test_a_seed_fixes_the_tokens_whatever_the_path_and_the_chunks(random_model, one_thread):
    """Token i always takes noise row i: the cache, full recomputation and any chunking
    give the same tokens, past block_size and past a block of drawn noise."""
    n = noise_rows(65) + 40  # a second block of noise, several window restarts
    reference = torch.cat(chunks(random_model, n, 5), dim=1)
    assert reference.shape == (1, n)
    for kwargs in (
        {"use_cache": False},
        {"chunk_tokens": 1},
        {"chunk_tokens": 7, "chunk_seconds": None},
        {"chunk_seconds": 0.0},
        {"use_cache": False, "chunk_tokens": 1000, "chunk_seconds": None},
    ):
        assert torch.equal(torch.cat(chunks(random_model, n, 5, **kwargs), dim=1), reference), (
            kwargs
        )
    # A shorter generation is the start of the longer one.
    assert torch.equal(torch.cat(chunks(random_model, 30, 5), dim=1), reference[:, :30])
    others = {
        tuple(torch.cat(chunks(random_model, 40, seed), dim=1)[0].tolist()) for seed in (6, 7, 8)
    }
    # different seeds, different texts
    assert len(others | {tuple(reference[0, :40].tolist())}) == 4


def test_the_first_token_comes_alone_then_chunks(random_model, one_thread):
    """The first token is handed out as soon as it is sampled (one forward pass so far),
    the rest in chunks of chunk_tokens, views of one preallocated tensor."""
    calls = []
    hook = random_model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        tokens = generate(
            random_model,
            torch.zeros(2, 3, dtype=torch.long),
            50,
            generator=torch.Generator().manual_seed(0),
            chunk_tokens=16,
            chunk_seconds=None,
        )
        first = next(tokens)
        assert first.shape == (2, 1) and len(calls) == 1
        rest = list(tokens)
    finally:
        hook.remove()
    assert [c.shape for c in rest] == [(2, 16)] * 3 + [(2, 1)]
    assert len(calls) == 50
    assert all(c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for c in rest)
    assert list(generate(random_model, torch.zeros(1, 1, dtype=torch.long), 0)) == []


@pytest.mark.parametrize("use_cache", [True, False])
def test_tokens_are_computed_without_onednn_which_is_back_between_chunks(random_model, use_cache):
    """oneDNN is off while a token is computed (its GELU's set-up costs a decoding step more than
    the work), and the process's setting is back as it was whenever a chunk is handed out."""
    seen = []
    hook = random_model.lm_head.register_forward_hook(
        lambda *_: seen.append(torch.backends.mkldnn.enabled)
    )
    before = torch.backends.mkldnn.enabled
    try:
        for enabled in (True, False):
            torch.backends.mkldnn.enabled = enabled
            tokens = generate(
                random_model,
                torch.zeros(1, 1, dtype=torch.long),
                20,
                generator=torch.Generator().manual_seed(0),
                use_cache=use_cache,
                chunk_tokens=4,
                chunk_seconds=None,
            )
            for _ in tokens:
                assert torch.backends.mkldnn.enabled == enabled
            assert torch.backends.mkldnn.enabled == enabled
    finally:
        torch.backends.mkldnn.enabled = before
        hook.remove()
    assert len(seen) == 40 and not any(seen)


def test_top_k_holds_at_every_generated_token(random_model, one_thread):
    """Each token is among the top_k most likely after the text before it (within one
    window, so one forward pass of the whole text gives every step's logits)."""
    idx = torch.zeros(1, 1, dtype=torch.long)
    for top_k in (1, 3):
        new = torch.cat(chunks(random_model, 15, 2, idx=idx, top_k=top_k, temperature=3.0), dim=1)
        text = torch.cat([idx, new], dim=1)
        with torch.no_grad():
            logits = random_model(text[:, :-1])[0][0]
        allowed = logits.topk(top_k, dim=-1).indices
        assert all(token in allowed[i] for i, token in enumerate(new[0].tolist())), top_k
    # at temperature 3, top 3 of near-uniform logits: not one token
    assert len(set(new[0].tolist())) > 1


def frequencies(logits: list[float], n: int = 40_000, seed: int = 1, **kwargs) -> torch.Tensor:
    """Token frequencies of n draws from one row of logits (noise from a fixed seed)."""
    noise = draw_noise(torch.empty(n, 1, len(logits)), torch.Generator().manual_seed(seed))[:, 0]
    drawn = pick(torch.tensor([logits]).expand(n, -1), noise, **kwargs)[:, 0]
    return torch.bincount(drawn, minlength=len(logits)).double() / n


def chi_square(freq: torch.Tensor, probs: torch.Tensor, n: int = 40_000) -> float:
    kept = probs > 0
    assert (freq[~kept] == 0).all()  # a token of probability 0 is never drawn
    return float(n * ((freq[kept] - probs[kept]) ** 2 / probs[kept]).sum())


def test_the_exponential_race_samples_the_softmax():
    """The frequencies over 40,000 draws match the tempered, filtered softmax: a
    chi-square far below the 1e-6 tail of its distribution (about 36 for 5 degrees
    of freedom), and 50 times above what a wrong distribution gives."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    logits = probs.log().tolist()
    cases = {  # settings -> the distribution they sample
        (): probs,
        (("temperature", 2.0),): probs.sqrt() / probs.sqrt().sum(),
        (("temperature", 0.5),): probs**2 / (probs**2).sum(),
        (("top_k", 3),): torch.cat([probs[:3], torch.zeros(3, dtype=torch.float64)])
        / probs[:3].sum(),
        (("top_p", 0.7),): torch.cat([probs[:3], torch.zeros(3, dtype=torch.float64)])
        / probs[:3].sum(),
    }
    for settings, expected in cases.items():
        freq = frequencies(logits, **dict(settings))
        assert chi_square(freq, expected) < 36, settings
        if not settings:
            assert chi_square(freq, torch.full_like(probs, 1 / 6)) > 1800  # the test can tell


def test_a_uniform_draw_of_zero_does_not_pick_an_unlikely_token():
    """U = 0, one float32 uniform draw in 2**24, is the next draw up, 2**-24: its noise was 87
    (E clamped to float32's tiny), and a token e**-60 as likely as another won the race against
    the other's least noise. Tokens so unlikely are never drawn; the race is otherwise as before."""
    least_top = gumbel_(torch.tensor([1 - 2.0**-24]))  # the most likely token's least noise
    for u in (0.0, 2.0**-24):
        most = gumbel_(torch.tensor([u]))
        assert most.item() == pytest.approx(-math.log(2.0**-24))
        noise = torch.cat([least_top, most])[None]
        assert pick(torch.tensor([[0.0, -60.0]]), noise).item() == 0, u
        assert pick(torch.tensor([[0.0, -10.0]]), noise).item() == 1, u


def test_where_torch_makes_no_package_the_step_is_torch_compiled(
    snapshot, corpus, one_thread, monkeypatch
):
    """A torch without AOTInductor's package loader compiles the CPU step with torch.compile, as
    on CUDA: the tokens of full recomputation, and nothing kept."""
    model, tokenizer, _ = load_model(str(snapshot), torch.device("cpu"))
    idx = tokenizer.encode(corpus.read_text(encoding="utf-8")[1000:1040]).long()[None]
    monkeypatch.setattr(decoding, "can_package", lambda: False)
    monkeypatch.setattr(decoding, "packaged_step", None)  # never called
    compiled = tokens(model, idx, 60, seed=5, compile=True)
    assert compiled == tokens(model, idx, 60, seed=5, use_cache=False)


def test_a_kept_step_is_named_by_the_cpu_model_and_instruction_sets_not_the_clock(
    monkeypatch, tmp_path
):
    """The package's name holds what the compiled code depends on: the CPU's model and
    instruction sets (inductor compiles with -march=native), not its clock, which moves."""
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=5))
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(decoding, "CPUINFO", cpuinfo)
    names = []
    for mhz, flags in (("2596.134", "fpu avx512f"), ("3012.5", "fpu avx512f"), ("2596.134", "fpu")):
        block = f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu MHz\t\t: {mhz}\nflags\t\t: {flags}"
        cpuinfo.write_text(block + "\n\nprocessor\t: 1\ncpu MHz\t\t: 1.0\n")
        names.append(decoding.package_path(model, 1))
    assert names[0] == names[1] != names[2]
    assert decoding.package_path(model, 2) != names[2]


def test_compile_auto_compiles_where_it_pays(monkeypatch, tmp_path, caplog):
    """compile=auto (the default): the step is compiled for a text long enough for compiling to
    pay on the device type, on a CPU for one sample and from more characters where one-row
    products keep up with the memory, and on a CPU whatever the length where an earlier run kept
    the compiled step (until then, a line says how to compile one); true and false as said."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=5))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def compiles(device, *args):
        return should_compile(parse_args(list(args), GenerateConfig), model, device)

    assert isinstance(generate_cli.one_row_products_lag(), bool)  # this CPU's, measured
    monkeypatch.setattr(generate_cli, "one_row_products_lag", lambda: False)
    keeping_up = COMPILE_PAYS_AFTER["cpu, products keep up"]
    assert compiles(cpu, f"max_new_tokens={keeping_up}")
    assert not compiles(cpu, f"max_new_tokens={keeping_up - 1}")
    assert compiles(cpu, "max_new_tokens=1", "compile=true")
    assert compiles(cuda, "max_new_tokens=100000")
    monkeypatch.setattr(generate_cli, "one_row_products_lag", lambda: True)
    assert parse_args([], GenerateConfig).compile == "auto"
    for device in (cpu, cuda):
        long_enough = f"max_new_tokens={COMPILE_PAYS_AFTER[device.type]}"
        shorter = f"max_new_tokens={COMPILE_PAYS_AFTER[device.type] - 1}"
        assert compiles(device, long_enough) and not compiles(device, shorter)
        assert not compiles(device, long_enough, "use_cache=false")
        assert compiles(device, shorter, "compile=true") and not compiles(
            device, long_enough, "compile=false"
        )
    # a batch on CPU gains too little
    assert not compiles(cpu, "max_new_tokens=100000", "num_samples=2")
    assert compiles(cuda, "max_new_tokens=100000", "num_samples=2")
    assert parse_args(["compile=True"], GenerateConfig).compile == "true"
    if decoding.can_package():  # a step kept by an earlier run: loaded for any length
        with caplog.at_level(logging.INFO, "mingpt.generate"):
            assert not compiles(cpu, "max_new_tokens=1")
        assert "compile=true compiles the decoding step for this model shape once" in caplog.text
        kept = decoding.package_path(model, 1)
        kept.parent.mkdir(parents=True)
        kept.touch()
        assert compiles(cpu, "max_new_tokens=1")
        assert not compiles(cpu, "max_new_tokens=1", "compile=false")
        assert not compiles(cpu, "max_new_tokens=1", "num_samples=2")
        assert not compiles(cpu, "max_new_tokens=1", "use_cache=false")


def test_compile_takes_auto_or_a_boolean_as_use_cache_does():
    """compile=yes and compile=on were taken as true, compile=1 refused, naming true and false
    alone."""
    for value, spellings in (("true", "true yes on 1 Y"), ("false", "False no OFF 0 n")):
        for spelling in spellings.split():
            config = parse_args([f"compile={spelling}", f"use_cache={spelling}"], GenerateConfig)
            assert (config.compile, config.use_cache) == (value, value == "true")
    assert parse_args(["compile=AUTO"], GenerateConfig).compile == "auto"
    with pytest.raises(ConfigError) as refused:
        parse_args(["compile=maybe"], GenerateConfig)
    assert str(refused.value) == (
        "compile: 'maybe' is neither auto nor a boolean (true, yes, on, 1; false, no, off, 0)"
    )


# ---------------------------------------------------------------- the filters


def draws(logits: list[float], n: int = 400, **kwargs) -> set[int]:
    batch = torch.tensor([logits]).repeat(n, 1)
    return set(
        next_token(batch, generator=torch.Generator().manual_seed(0), **kwargs)[:, 0].tolist()
    )


def test_temperature_zero_is_greedy():
    assert next_token(
        torch.tensor([[0.1, 2.0, 1.9], [3.0, 0.0, 2.9]]), temperature=0.0
    ).tolist() == [[1], [0]]


def test_top_k_and_top_p_keep_exactly_their_tokens_ties_by_id():
    """Tokens tied at the cut rank by id, not in the order the sort's algorithm leaves ties in (for
    20 ties among 65 tokens, on a CPU: 16 and 22 to 29, not 10 to 18)."""
    assert draws([1.0, 1.0, 1.0, 0.0], top_k=2) == {0, 1}
    assert draws([0.0, 5.0, 1.0, 4.0], top_k=1) == {1}
    assert draws([0.0, 0.0, 0.0], top_k=3) == {0, 1, 2}
    logits = [-5.0] * 65
    logits[0] = 2.0
    logits[10:30] = [1.0] * 20
    assert draws(logits, n=2000, top_k=5) == {0, 10, 11, 12, 13}
    # 0.12 for token 0, 0.044 for each tie: 9 ties reach 0.5
    assert draws(logits, n=2000, top_p=0.5) == {0, *range(10, 19)}


def test_top_p_keeps_the_smallest_set_reaching_it():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert draws(logits, top_p=0.75) == {0, 1}
    assert draws(logits, top_p=0.85) == {0, 1, 2}
    assert draws(logits, top_p=0.1) == {0}
    assert draws(logits, top_p=1.0) == {0, 1, 2, 3}


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token():
    """top_p=1e-300 is in (0, 1] but 0 in float32: every token was dropped, and the argmax of
    -inf alone was token 0 (a newline) at every step."""
    logits = torch.tensor([0.05, 0.15, 0.3, 0.5]).log().tolist()
    assert draws(logits, top_p=1e-300) == {3}


# ------------------------------------------------------------------- bad input

BAD_SETTINGS = {  # override -> the key the error must name
    "temperature=-0.5": "temperature",
    "top_k=0": "top_k",
    "top_p=0": "top_p",
    "top_p=1.5": "top_p",
    "max_new_tokens=-1": "max_new_tokens",
    "num_samples=0": "num_samples",
    "use_cache=false compile=true": "compile",
    "compile=maybe": "compile",
    "top_k=many": "top_k",  # wrong type
    "temprature=0.5": "temprature",  # unknown key
    "temperature=inf": "temperature",
    # would end in MemoryError: refused before, naming how many fit
    "num_samples=100000000": "num_samples",
    # sample 2 would use seed 2**63, which a one-sample run refuses (it ran with it, before)
    f"seed={2**63 - 1} num_samples=2": "seed",
}
BAD_SNAPSHOTS = {  # kind -> file name in the work directory
    "missing": "missing.pt",
    "truncated": "truncated.pt",
    "text": "small.txt",
    "not_mingpt": "not_mingpt.pt",
    "fifo": "snapshot.fifo",  # a read would wait for a writer forever
    "device": "zero.pt",  # a link to /dev/zero: a read would never end
    "unsorted": "unsorted.pt",  # its vocabulary is not sorted: a KeyError on the prompt, before
    "other_shape": "other_shape.pt",  # 3 layers said, 2 held: the reason was torch's header alone
    "bad_yaml": "broken-run",  # a run directory whose config is not YAML: a traceback, before
    # a run directory whose snapshot is cut in half: the log said which snapshot it took, then the
    # error, before
    "damaged_run": "damaged-run",
}


def commands_on(workdir: Path, snapshot: Path) -> dict[str, list[str]]:
    """{case: the command's arguments} on each bad input in `workdir` (made here), and ("repeat",
    "alone") the seeded samples again and with the next seed alone, once `snapshot` is trained."""
    # the single file that export writes (of a model of the trained one's shape), cut in half
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16))
    whole = workdir / "whole.pt"
    state = {
        "model_state": model.state_dict(),
        "optimizer_state": {},
        "gpt_config": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 65, "block_size": 16},
        "vocab": "".join(chr(32 + i) for i in range(65)),
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 150,
    }
    single_file.save(state, str(whole))
    (workdir / "truncated.pt").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    single_file.save({**state, "vocab": state["vocab"][::-1]}, str(workdir / "unsorted.pt"))
    three = {**state["gpt_config"], "n_layer": 3}
    single_file.save({**state, "gpt_config": three}, str(workdir / "other_shape.pt"))
    (workdir / "broken-run" / ".hydra").mkdir(parents=True)
    (workdir / "broken-run" / ".hydra" / "config.yaml").write_text("trainer_config: [oops\n")
    (workdir / "damaged-run" / ".hydra").mkdir(parents=True)
    (workdir / "damaged-run" / ".hydra" / "config.yaml").write_text(
        "trainer_config:\n  snapshot_path: gpt.pt\n"
    )
    shutil.copy(workdir / "truncated.pt", workdir / "damaged-run" / "gpt.pt")
    torch.save({"weights": torch.zeros(2)}, workdir / "not_mingpt.pt")
    os.mkfifo(workdir / "snapshot.fifo")
    os.symlink("/dev/zero", workdir / "zero.pt")
    cases = {"repeat": seeded(snapshot), "alone": seeded(snapshot)[:3] + ["seed=8"]}
    cases.update(
        {
            kind: [f"snapshot_path={workdir / name}", "prompt=ROMEO:"]
            for kind, name in BAD_SNAPSHOTS.items()
        }
    )
    cases.update(
        {override: [f"snapshot_path={snapshot}", *override.split()] for override in BAD_SETTINGS}
    )
    cases["prompt"] = [f"snapshot_path={snapshot}", "prompt=ROMEO: é€"]
    # The run directory: the log said which of its snapshots it took, then the error, before.
    cases["prompt-run"] = [f"snapshot_path={snapshot.parent}", "prompt=ROMEO: é€"]
    cases["prompt_file-run"] = [
        f"snapshot_path={snapshot.parent}",
        f"prompt_file={workdir / 'missing.txt'}",
    ]
    # a terabyte, sparse: nothing on disk
    with open(workdir / "huge.txt", "wb") as huge:
        huge.truncate(2**40)
    cases["prompt_file-huge"] = [f"snapshot_path={snapshot}", f"prompt_file={workdir / 'huge.txt'}"]
    for kind, name in (("fifo", "snapshot.fifo"), ("device", "zero.pt")):
        cases[f"prompt_file-{kind}"] = [
            f"snapshot_path={snapshot}",
            f"prompt_file={workdir / name}",
        ]
    return cases


@pytest.fixture(scope="module")
def bad_runs(trained) -> dict[str, subprocess.CompletedProcess]:
    """The command on each bad input, and ("repeat", "alone") the seeded samples again and with
    the next seed alone (run after the training, in its process: see trained)."""
    return trained[1]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr and result.stdout == "", (
        result.stderr
    )
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("kind", BAD_SNAPSHOTS)
def test_unusable_snapshot_is_one_line_naming_the_path(bad_runs, workdir, kind):
    line = one_error_line(bad_runs[kind])
    assert str(workdir / BAD_SNAPSHOTS[kind]) in line
    if kind == "other_shape":  # and what does not fit
        assert line.endswith(
            "its record (gpt_config) describes a model of 42,848 parameters, and it holds 30,144"
        ), line


def test_a_record_that_claims_a_million_layers_is_refused_before_the_model_is_built(
    tmp_path, monkeypatch
):
    """The model is built on the host for its record: one of a million layers filled memory before
    its weights were found not to fit, where the meta device had allocated nothing."""
    config = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 65, "block_size": 16}
    state = {
        "model_state": GPT(GPTConfig(**config)).state_dict(),
        "gpt_config": {**config, "n_layer": 1_000_000},
        "vocab": "".join(chr(32 + i) for i in range(65)),
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 1,
    }
    path = tmp_path / "claims.pt"
    single_file.save(state, str(path))

    def build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr("mingpt.snapshot.reader.GPT", build)
    with pytest.raises(SnapshotError, match="describes a model of 12,704,0"):
        load_model(str(path), torch.device("cpu"))


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_prompt_file_not_a_regular_file_is_one_line(bad_runs, workdir, kind):
    what = {"fifo": "a FIFO", "device": "a device or socket"}[kind]
    line = one_error_line(bad_runs[f"prompt_file-{kind}"])
    assert (
        line
        == f"error: prompt_file is not a regular file: {workdir / BAD_SNAPSHOTS[kind]} is {what}"
    ), line


def test_a_prompt_file_larger_than_memory_is_one_line_before_it_is_read(bad_runs, workdir):
    """Refused by its size: read, it ended in a MemoryError's traceback."""
    line = one_error_line(bad_runs["prompt_file-huge"])
    assert line.startswith(
        f"error: prompt_file: {workdir / 'huge.txt'} has 1,024.0 GiB; reading and encoding it "
        "takes about 25,600.0 GiB, more than the "
    ), line


def test_a_directory_that_cannot_be_listed_is_one_line(unlistable):
    """A snapshot_path this user may not list (a traceback of os.listdir's PermissionError,
    before)."""
    locked, prefix = unlistable
    result = subprocess.run(
        [*prefix, *generate_cmd([f"snapshot_path={locked}"])],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one_error_line(result) == f"error: cannot read snapshot {locked}: Permission denied"
    assert result.returncode == 2


def test_text_that_the_encoding_of_stdout_lacks_is_one_line(tmp_path):
    """A character of the text that stdout's encoding cannot write (a traceback of
    UnicodeEncodeError, before)."""
    config = {"n_layer": 1, "n_head": 1, "n_embd": 8, "vocab_size": 3, "block_size": 8}
    state = {
        "model_state": GPT(GPTConfig(**config)).state_dict(),
        "gpt_config": config,
        "vocab": "abé",
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 1,
    }
    single_file.save(state, str(tmp_path / "accented.pt"))
    env = {**child_env(), "PYTHONIOENCODING": "ascii"}
    args = [f"snapshot_path={tmp_path / 'accented.pt'}", "prompt=aé", "max_new_tokens=2"]
    result = subprocess.run(
        generate_cmd(args), env=env, capture_output=True, text=True, timeout=RUN_DEADLINE
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: stdout's encoding, ascii, cannot write '\\xe9'"), line


def test_with_stderr_closed_an_error_stays_out_of_stdout(tmp_path):
    """print(file=None) writes to stdout: the error line went into the text's stream."""
    result = subprocess.run(
        ["sh", "-c", 'exec "$@" 2>&-', "sh", *generate_cmd(["temperature=-1"])],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert result.returncode == 2 and result.stdout == ""


def test_with_stdout_closed_the_refusal_comes_before_the_snapshot_is_read(tmp_path):
    """`>&-`: the snapshot was found (here: not) and loaded before the first write found out."""
    result = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", *generate_cmd([f"snapshot_path={tmp_path / 'none'}"])],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert result.returncode == 2
    assert result.stderr == "error: stdout is closed: nowhere to write the output\n"


def test_a_prompt_file_of_an_unknown_protocol_names_prompt_file():
    """It said "cannot use snapshot path", of a snapshot path that was fine."""
    from mingpt.storage import StorageError

    with pytest.raises(StorageError, match=r"^cannot use prompt_file nosuch://x: Protocol not"):
        generate_cli.read_prompt(GenerateConfig(prompt_file="nosuch://x"))


def test_prompt_outside_the_vocabulary_is_one_line_naming_the_characters(bad_runs):
    line = one_error_line(bad_runs["prompt"])
    assert "'é'" in line and "'€'" in line and "'R'" not in line, line


def test_a_prompt_that_does_not_fit_a_run_directory_is_one_line(bad_runs, workdir):
    assert "'é'" in one_error_line(bad_runs["prompt-run"])
    line = one_error_line(bad_runs["prompt_file-run"])
    assert line == f"error: prompt_file not found: {workdir / 'missing.txt'}", line


@pytest.mark.parametrize("override", BAD_SETTINGS)
def test_bad_setting_is_one_line_naming_the_key(bad_runs, override):
    assert BAD_SETTINGS[override] in one_error_line(bad_runs[override])


def test_a_tiny_temperature_samples_the_most_likely_token():
    """logits / 1e-42 overflow to inf (softmax: nan,
    multinomial fails); shifted by the max they stay numbers. The command takes any temperature
    >= 0: it refused 1e-42, and took 1e-400, which reads as 0 (greedy)."""
    from mingpt.decoding import MIN_TEMPERATURE

    logits = torch.tensor([[3.0, 40.0, 39.5, -7.0], [1.0, 1.0, 0.0, 0.5]])
    for temperature in (MIN_TEMPERATURE, 1e-42, 1e-300):
        assert parse_args([f"temperature={temperature}"], GenerateConfig).temperature == temperature
        for _ in range(20):
            token = next_token(logits, temperature=temperature)
            assert token[0, 0] == 1 and token[1, 0] in (0, 1)
    for bad in ("nan", "-1e-300"):
        with pytest.raises(ConfigError, match="temperature: must be a finite number >= 0, got"):
            parse_args([f"temperature={bad}"], GenerateConfig)


def test_a_large_temperature_keeps_top_k_and_top_p_to_the_most_likely_tokens():
    """Scaled by a large temperature, the logits' differences round to ties (by 1e39, above
    float32's largest number, to 0): top_k=1 then kept token 2 where token 3 is the most likely,
    and top_p kept tokens 0 and 1, the least likely, where the model ranks 3 and 1 first."""
    logits = [0.0, 5.0, 1.0, 9.0]
    for temperature in (1e8, 1e30, 1e39, 1e300):
        assert draws(logits, temperature=temperature, top_k=1) == {3}
        assert draws(logits, temperature=temperature, top_k=2) == {1, 3}
        # near-uniform probabilities: the two most likely reach 0.3
        assert draws(logits, temperature=temperature, top_p=0.3) == {1, 3}
        assert draws(logits, temperature=temperature, top_k=3, top_p=0.5) == {1, 3}


def test_a_generation_too_large_for_memory_names_the_key_to_change(monkeypatch):
    """One sample too long for memory names max_new_tokens (it said num_samples: 1 samples
    need ... at most 0 fit); several samples that fit one by one name num_samples."""
    from mingpt.config import ConfigError, GPTConfig
    from mingpt.generate import available_memory, check_fits
    from mingpt.model import GPT

    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=5, block_size=4))
    cpu = torch.device("cpu")
    too_long = GenerateConfig(max_new_tokens=10**15)
    with pytest.raises(ConfigError, match=r"^max_new_tokens: 1,000,000,000,000,000 characters"):
        check_fits(model, too_long, cpu)
    many = available_memory(cpu) // (2 * 8 * 1000) + 1
    with pytest.raises(ConfigError, match=rf"^num_samples: {many:,} samples need about"):
        check_fits(model, GenerateConfig(max_new_tokens=1000, num_samples=many), cpu)
    check_fits(model, GenerateConfig(max_new_tokens=1000, num_samples=3), cpu)
    # Several samples on a CPU may multiply by a copy of the blocks' weights, which they hold too:
    # two samples that fit but for it ran out of memory.
    wide = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=512, vocab_size=5, block_size=4))
    monkeypatch.setattr(generate_cli, "available_memory", lambda device: 8 * 2**20)
    check_fits(wide, GenerateConfig(max_new_tokens=10), cpu)
    with pytest.raises(ConfigError, match=r"^num_samples: 2 samples need .* at most 1 fit$"):
        check_fits(wide, GenerateConfig(max_new_tokens=10, num_samples=2), cpu)


def test_samples_hold_no_more_than_check_fits_counts(snapshot, monkeypatch, one_thread):
    """check_fits counts two int64 tensors a character of each sample: past them, a sample adds
    no Python objects a character. The samples after the first were decoded from one list of all
    of them, 8 bytes more a character of each (24 against the 16 counted: a num_samples let
    through could run out of memory)."""
    import tracemalloc

    check_fits = generate_cli.check_fits

    def checked(*args):
        check_fits(*args)
        tracemalloc.reset_peak()  # from here on: what check_fits is to count

    monkeypatch.setattr(generate_cli, "check_fits", checked)
    peaks = {}
    with open(os.devnull, "w") as devnull:
        monkeypatch.setattr(sys, "stdout", devnull)
        for n in (1, 1, 65):  # the first imports what decoding needs
            config = GenerateConfig(
                snapshot_path=str(snapshot),
                max_new_tokens=1000,
                num_samples=n,
                device="cpu",
                compile="false",
            )
            tracemalloc.start()
            try:
                generate_cli.run(config)
                peaks[n] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    # The list of all samples added 8 bytes a character of each: 512 kB here. The bound is half of
    # that: the two peaks differ by up to 90 kB either way from run to run (a CI run: 176 kB for
    # one sample, 265 kB for 65; here 235 kB and 200 kB).
    assert peaks[65] - peaks[1] < 64 * 1000 * 4, peaks


def test_the_samples_are_decoded_at_the_end_a_piece_at_a_time(snapshot, monkeypatch):
    """Past check_fits's two int64 a character, a sample holds no Python object a character: sample
    1 (streamed already) was decoded again whole, and each other one whole, its list of ids and its
    text some 20 bytes a character that a max_new_tokens let through might not find. The model is
    not run: the generation is its chunks of id 1, as decoding.generate yields them."""
    import tracemalloc

    new = 300_000

    def generated(model, idx, max_new_tokens, *args):
        out = torch.ones(idx.size(0), max_new_tokens, dtype=torch.long)
        yield out[:, :1]
        for start in range(1, max_new_tokens, decoding.CHUNK_TOKENS):
            yield out[:, start : start + decoding.CHUNK_TOKENS]

    check_fits = generate_cli.check_fits

    def checked(*args):
        check_fits(*args)
        tracemalloc.reset_peak()  # from here on: what check_fits is to count

    monkeypatch.setattr(generate_cli, "generate", generated)
    monkeypatch.setattr(generate_cli, "check_fits", checked)
    with open(os.devnull, "w") as devnull:
        monkeypatch.setattr(sys, "stdout", devnull)
        for max_new_tokens in (1, new):  # the first imports what generating needs
            config = GenerateConfig(
                snapshot_path=str(snapshot),
                max_new_tokens=max_new_tokens,
                num_samples=2,
                device="cpu",
                compile="false",
            )
            tracemalloc.start()
            try:
                generate_cli.run(config)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    assert peak < 6 * new, peak  # a piece's list and text, the chunks' views: about 0.7 MB


def test_the_closing_line_says_one_character_and_compiling(
    tiny_run, capsys, caplog, monkeypatch, tmp_path
):
    """The closing log line said 1 characters in ...; and its rate hid the seconds of compiling
    the step, where the run compiled it."""
    config = GenerateConfig(
        snapshot_path=str(tiny_run[1]), max_new_tokens=1, device="cpu", compile="false"
    )
    with caplog.at_level(logging.INFO, "mingpt.generate"):
        generate_cli.run(config)
    assert caplog.messages[-1].startswith("1 character in "), caplog.messages
    assert "compiling" not in caplog.messages[-1]
    # compiled here (a stand-in for the compiler: the eager step)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(decoding, "build_package", lambda path, model, cache: model.step)
    config.compile = "true"
    caplog.clear()
    with caplog.at_level(logging.INFO, "mingpt.generate"):
        generate_cli.run(config)
    assert caplog.messages[-1].endswith("/s, compiling the step included)"), caplog.messages


# In a fresh process: the generate command (its arguments this code's), then whether it imported
# torch._dynamo.
GENERATE_THEN_DYNAMO = """
import sys

from mingpt import generate

try:
    generate.main(sys.argv[1:])
finally:
    print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_eager_sampling_never_imports_torch_dynamo(tiny_run):
    """Importing torch._dynamo takes a second or two of a sampling command's start on a CPU, and
    eager decoding never needs it. Building the model on the meta device imported it: there the
    embeddings' initialisation (normal_) runs through torch's Python reference, which loads
    dynamo."""
    args = [f"snapshot_path={tiny_run[1]}", "max_new_tokens=5", "device=cpu", "compile=false"]
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE_THEN_DYNAMO, *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.endswith("torch._dynamo imported: False\n"), proc.stdout[-3000:]


def test_a_prompt_file_is_read_as_it_is(tmp_path):
    """Its CRLF line ends and lone CRs stay (universal newlines made them LF: other text than the
    corpus holds); a byte-order mark at its start goes, as the corpus's does (it was refused as a
    character outside the vocabulary)."""
    from mingpt.generate import read_prompt

    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"ROMEO:\r\nO\rJuliet\n")
    assert read_prompt(GenerateConfig(prompt_file=str(prompt))) == "ROMEO:\r\nO\rJuliet\n"
    prompt.write_bytes(codecs.BOM_UTF8 + b"ROMEO:\r\n")
    assert read_prompt(GenerateConfig(prompt_file=str(prompt))) == "ROMEO:\r\n"
