"""The corpus at scale: the token cache (reuse, invalidation, damage), corpora
of several files, wide vocabularies, byte-order marks, files that are not
regular, batches read from the cache file, capped evaluation and exact resume
on that path. Small generated corpora throughout."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import warnings

import pytest
import torch
from conftest import RUN_DEADLINE, TINY, run_main
from omegaconf import OmegaConf

from mingpt.config import Config, DataConfig
from mingpt.data import DataError, HostBatches, TokenWindows, cache_location, load_data, spread
from mingpt.distributed import DistInfo
from mingpt.run import build
from mingpt.snapshot import SnapshotError
from mingpt.trainer import Trainer


def cache_files(cache_dir) -> list:
    return sorted(p for p in cache_dir.iterdir() if p.suffix == ".tokens")


def text_of(data, segment) -> str:
    start, length = segment
    return data.tokenizer.decode(data.train.tokens[start : start + length])


def test_cache_is_reused_and_rebuilt_when_the_corpus_changes(tmp_path, caplog):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 50, encoding="utf-8")
    cfg = DataConfig(path=str(corpus), block_size=8, stride=8, cache_dir=str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="mingpt.token_cache")
    first = load_data(cfg)
    [cache] = cache_files(tmp_path / "cache")
    built = cache.stat().st_mtime_ns, cache.stat().st_ino
    assert first.tokenizer.chars == "abcdefgh" and first.train.tokens.dtype == torch.uint8
    assert len(cache.read_bytes()) == 4096 + 400  # one page of header, one byte per character

    caplog.clear()
    second = load_data(cfg)
    assert (cache.stat().st_mtime_ns, cache.stat().st_ino) == built  # not rewritten
    assert any("is up to date" in r.getMessage() for r in caplog.records)
    assert torch.equal(first.train.tokens, second.train.tokens)

    # Same size, other content (and the same mtime, so only the contents tell).
    stamp = corpus.stat().st_mtime_ns
    corpus.write_text("abcdefgz" * 50, encoding="utf-8")
    os.utime(corpus, ns=(stamp, stamp))
    caplog.clear()
    third = load_data(cfg)
    assert any("the corpus changed" in r.getMessage() for r in caplog.records)
    assert third.tokenizer.chars == "abcdefgz"
    assert third.tokenizer.decode(third.train.tokens) == "abcdefgz" * 50
    assert cache_files(tmp_path / "cache") == [cache]  # replaced, not added


@pytest.mark.parametrize("truncate", [1.0, 0.5])
def test_a_corpus_edited_while_its_cache_is_built_is_refused_never_cached(
    tmp_path, monkeypatch, truncate
):
    """The file is rewritten (same size, a character the scan never saw) right after its scan, so
    the encode reads other bytes than those checksummed: no cache records them, and once the edit is
    undone the next build encodes the text as it is."""
    from mingpt import token_cache

    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 50, encoding="utf-8")
    cfg = DataConfig(
        path=str(corpus),
        block_size=8,
        stride=8,
        cache_dir=str(tmp_path / "cache"),
        truncate=truncate,
    )
    scan = token_cache._scan

    def scan_then_edit(source):
        scanned = scan(source)
        corpus.write_text("zzzzzzzz" * 50, encoding="utf-8")
        return scanned

    monkeypatch.setattr(token_cache, "_scan", scan_then_edit)
    with pytest.raises(DataError, match="c.txt changed while its token cache was built"):
        load_data(cfg)
    assert list(tmp_path.rglob("*.tokens*")) == []  # neither a cache nor its temporary
    assert not (tmp_path / "cache").exists()  # nor the directory the build made
    monkeypatch.undo()
    corpus.write_text("abcdefgh" * 50, encoding="utf-8")
    data = load_data(cfg)
    assert data.tokenizer.decode(data.train.tokens) == ("abcdefgh" * 50)[: len(data.train.tokens)]


@pytest.mark.parametrize(
    "damage", ["flip-token", "cut", "garbage-header", "vocabulary", "not-an-object"]
)
def test_damaged_cache_is_rebuilt_never_used(tmp_path, caplog, damage):
    corpus = tmp_path / "c.txt"
    text = "the quick brown fox jumps over the lazy dog\n" * 20
    corpus.write_text(text, encoding="utf-8")
    cfg = DataConfig(path=str(corpus), block_size=8, stride=8)
    load_data(cfg)
    [cache] = cache_files(tmp_path / ".mingpt-cache")  # the default: beside the corpus
    raw = bytearray(cache.read_bytes())
    if damage == "flip-token":
        raw[4096 + 100] ^= 0x01
    elif damage == "cut":
        raw = raw[:-10]
    elif damage == "vocabulary":  # still valid JSON, one character another: every id misread
        start = raw.index(b'"vocab": "') + len(b'"vocab": "')
        raw[start + raw[start:].index(b"q")] = ord("Q")
    elif damage == "not-an-object":  # the magic, then a header that is JSON but no object
        raw[14:] = (3).to_bytes(8, "little") + b"[1]"
    else:
        raw[20:40] = b"x" * 20
    cache.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="mingpt.token_cache")
    data = load_data(cfg)
    assert any("damaged" in r.getMessage() and str(cache) in r.getMessage() for r in caplog.records)
    assert data.tokenizer.decode(data.train.tokens) == text


def test_several_files_form_one_corpus_split_per_file(tmp_path):
    """Vocabulary = union; the held-out part is the tail of each file; no window
    spans two files or shares a position with a window of the other split."""
    (tmp_path / "d").mkdir()
    texts = {"a.txt": "abc " * 300, "b.txt": "xyz!" * 200, "c.txt": "ab\n" * 150}
    for name, text in texts.items():
        (tmp_path / "d" / name).write_text(text, encoding="utf-8")
    cfg_glob = DataConfig(
        path=str(tmp_path / "d" / "*.txt"), block_size=8, stride=3, train_split=0.8
    )
    data = load_data(cfg_glob)
    assert data.tokenizer.chars == "".join(sorted(set("".join(texts.values()))))
    # glob: sorted
    assert [os.path.basename(s) for s in data.files] == ["a.txt", "b.txt", "c.txt"]
    bounds, offset = [], 0
    for text, train, heldout in zip(
        texts.values(), data.train.segments, data.heldout.segments, strict=True
    ):
        n_train = int(len(text) * 0.8)
        assert text_of(data, train) == text[:n_train] and text_of(data, heldout) == text[n_train:]
        bounds.append((offset, offset + len(text)))
        offset += len(text)
    for windows in (data.train, data.heldout):
        for start in windows.starts(range(len(windows))).tolist():
            end = start + windows.block_size + 1
            # inside one file
            assert any(lo <= start and end <= hi for lo, hi in bounds), (start, end)
    train_pos = {
        p for s in data.train.starts(range(len(data.train))).tolist() for p in range(s, s + 9)
    }
    heldout_pos = {
        p for s in data.heldout.starts(range(len(data.heldout))).tolist() for p in range(s, s + 9)
    }
    assert not train_pos & heldout_pos
    assert len(data.train) == sum((int(len(t) * 0.8) - 9) // 3 + 1 for t in texts.values())
    x, y = data.train.batch(torch.arange(len(data.train)))
    assert torch.equal(x[:, 1:], y[:, :-1])
    # A list of files (a glob among them) gives the same corpus, in the order given.
    listed = load_data(
        DataConfig(
            path=[str(tmp_path / "d" / "b.txt"), str(tmp_path / "d" / "[ac].txt")],
            block_size=8,
            stride=3,
            train_split=0.8,
        )
    )
    assert [os.path.basename(s) for s in listed.files] == ["b.txt", "a.txt", "c.txt"]


def test_wide_vocabulary_and_byte_order_mark(tmp_path):
    text = "".join(chr(0x4E00 + i) for i in range(300)) * 3 + "abc\n" * 20
    path = tmp_path / "wide.txt"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # with a byte-order mark
    data = load_data(DataConfig(path=str(path), block_size=8, stride=8))
    assert "\ufeff" not in data.tokenizer.chars
    assert data.tokenizer.vocab_size == 304 and data.train.tokens.dtype == torch.int16
    assert data.tokenizer.decode(data.train.tokens) == text
    x, _ = data.heldout.batch([0])
    start = data.heldout.segments[0][0]
    assert data.tokenizer.decode(x[0]) == text[start : start + 8]


def test_unusable_corpora_are_refused_in_one_line(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a" * 500, encoding="utf-8")
    with pytest.raises(
        DataError, match=r"one.txt: the corpus has a single distinct character \('a'\)"
    ):
        load_data(DataConfig(path=str(one), block_size=8))
    with pytest.raises(DataError, match=r"^data file is not a regular file: /dev/zero is a device"):
        load_data(DataConfig(path="/dev/zero", block_size=8))
    with pytest.raises(DataError, match=r"^no data file matches .*nothing-\*\.txt$"):
        load_data(DataConfig(path=str(tmp_path / "nothing-*.txt"), block_size=8))
    good = tmp_path / "good.txt"
    good.write_text("abcdefgh" * 50, encoding="utf-8")
    # the same file twice: listed again, matched by a glob beside its name, through a link, or as
    # a URL
    alias = tmp_path / "alias"
    alias.symlink_to(good)
    url = f"file://{good}"
    for again, named in ((good, good), (tmp_path / "*.txt", good), (alias, alias), (url, url)):
        with pytest.raises(DataError) as e:
            load_data(DataConfig(path=[str(good), str(again)], block_size=8))
        assert str(e.value) == (
            f"data_config.path names one file twice, as {good} and {named}: list each file once"
        )
    with pytest.raises(DataError, match=r"^cannot write the token cache /proc/nope/"):
        load_data(DataConfig(path=str(good), block_size=8, cache_dir="/proc/nope"))


def test_a_file_whose_text_another_holds_too_is_said(tmp_path, caplog):
    """A copy or a hard link is another name, not the same file: it is read, and said to train
    and evaluate its text twice."""
    good = tmp_path / "good.txt"
    good.write_text("abcdefgh" * 50, encoding="utf-8")
    (tmp_path / "other.txt").write_text("hgfedcba" * 50, encoding="utf-8")
    caplog.set_level(logging.WARNING, logger="mingpt.data")
    load_data(DataConfig(path=str(tmp_path / "*.txt"), block_size=8))
    assert "the same text" not in caplog.text
    copy = tmp_path / "good (copy).txt"
    copy.write_bytes(good.read_bytes())
    link = tmp_path / "link.txt"
    os.link(good, link)
    data = load_data(DataConfig(path=str(tmp_path / "*.txt"), block_size=8))
    assert len(data.files) == 4
    said = [r.getMessage() for r in caplog.records if "the same text" in r.getMessage()]
    assert said == [
        f"{name} holds the same text as {copy}: it is trained on and evaluated twice"
        for name in (good, link)
    ]


@pytest.mark.parametrize("block_size", [10**12, 10**20])
def test_a_block_longer_than_every_file_of_several_is_refused_in_one_line(tmp_path, block_size):
    """Each file's too short split is a warning; that none is long enough is the refusal (the
    windows were made first: a block of 10**12 asked for 8 TB, one past 64 bits overflowed)."""
    paths = []
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("abcdefgh" * 50, encoding="utf-8")
        paths.append(str(tmp_path / name))
    with pytest.raises(
        DataError, match=r"no file has a training split of data_config.block_size \+ 1 characters"
    ):
        load_data(DataConfig(path=paths, block_size=block_size))


def test_fifo_corpus_exits_promptly_with_one_line(tmp_path):
    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    proc = run_main([*TINY, f"data_config.path={fifo}"], tmp_path)  # a hang fails here
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: data file is not a regular file: {fifo} is a FIFO"], proc.stderr[
        -3000:
    ]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 120


def test_host_batches_match_device_batches_with_and_without_prefetch(tmp_path, corpus):
    path = tmp_path / "c.txt"
    path.write_text(corpus.read_text(encoding="utf-8")[:5000], encoding="utf-8")
    data = load_data(DataConfig(path=str(path), block_size=16, stride=5))
    host, _ = data.place(torch.device("cpu"), "host")
    assert isinstance(host, HostBatches)
    steps = torch.randperm(len(data.train)).split(12)
    host.prefetch(steps[0])
    for k, step in enumerate(steps[:4]):
        for micro in step.split(4):  # micro-batches of a prefetched step
            for a, b in zip(host.batch(micro), data.train.batch(micro), strict=True):
                assert torch.equal(a, b)
        host.prefetch(steps[k + 2])  # the wrong batch prefetched: the next is gathered anew
    for a, b in zip(host.batch(steps[5]), data.train.batch(steps[5]), strict=True):
        assert torch.equal(a, b)


def test_a_ranks_share_of_the_windows_of_several_files_is_gathered_without_a_warning():
    """Evaluation gives a rank every W-th chosen window, a strided view: torch's searchsorted over
    the files' windows warned of copying it, once in every process of a run of several files."""
    windows = TokenWindows(torch.arange(100), 4, 4, [(0, 30), (30, 3), (33, 67)])
    share = spread(len(windows), 0)[1::2]
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # else torch warns once per process
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            x, _ = windows.batch(share)
    finally:
        torch.set_warn_always(warn_always)
    assert x[:, 0].tolist() == [4, 12, 20, 33, 41, 49, 57, 65, 73, 81, 89]


def mapped_rss_kb(path) -> list[int]:
    """The resident size (kB) of each of this process's mappings of `path`."""
    real, sizes, current = os.path.realpath(path), [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's first line: address, ..., path
                current = len(fields) >= 6 and fields[5] == real
            elif current and fields[0] == "Rss:":
                sizes.append(int(fields[1]))
    return sizes


def test_batches_are_read_from_the_cache_file_not_through_its_map(tmp_path, caplog):
    """On a CPU (`auto`) batches are read from the cache file: training and
    held-out batches, windows at the end of each file included, equal the
    corpus's tokens, and none of the cache's memory map becomes resident (a
    window gathered through the map makes about 1 MB of page cache resident
    on this kernel, so RSS grew with every window sampled)."""
    gen = torch.Generator().manual_seed(0)
    texts = [
        "".join(chr(0x4E00 + int(c)) for c in torch.randint(0, 300, (n,), generator=gen))
        for n in (3001, 2203)
    ]
    for k, text in enumerate(texts):
        (tmp_path / f"{k}.txt").write_text(text, encoding="utf-8")
    data = load_data(
        DataConfig(path=str(tmp_path / "*.txt"), block_size=16, stride=3, cache_dir=str(tmp_path))
    )
    assert data.train.tokens.dtype == torch.int16
    expected = torch.cat([data.tokenizer.encode(text) for text in texts])  # not read from the cache
    with caplog.at_level(logging.INFO, "mingpt.data"):
        train, heldout = data.place(torch.device("cpu"))
    assert isinstance(train, HostBatches) and isinstance(heldout, HostBatches)
    # a size a small corpus does not round to 0.0 MB
    assert "from the token cache of 5,204 characters" in caplog.text
    for host, windows in ((train, data.train), (heldout, data.heldout)):
        reference = windows.with_tokens(expected)
        order = torch.randperm(len(windows), generator=gen)
        host.prefetch(order[:64])
        for step in order.split(64):
            for a, b in zip(host.batch(step), reference.batch(step), strict=True):
                assert torch.equal(a, b)
    ends = torch.tensor([len(texts[0]) - 17, len(expected) - 17])  # the last window of each file
    out = torch.empty(2, 17, dtype=torch.int16)
    data.cache.read_windows(ends, out)
    assert torch.equal(out, torch.stack([expected[e : e + 17] for e in ends.tolist()]))
    assert host.batch(torch.tensor([], dtype=torch.long))[0].shape == (0, 16)
    # A rank's share of the held-out windows may be empty (fewer windows than ranks), prefetched.
    none = torch.tensor([], dtype=torch.long)
    host.prefetch(none)
    assert host.batch(none)[0].shape == (0, 16)
    resident, _ = data.place(torch.device("cpu"), "device")  # read whole into memory
    assert isinstance(resident, TokenWindows) and torch.equal(resident.tokens, expected)
    assert mapped_rss_kb(data.cache.path) == [0]


def test_spread_is_even_and_capped():
    assert spread(10, 0).tolist() == list(range(10))
    assert spread(10, 20).tolist() == list(range(10))
    assert spread(10, 4).tolist() == [0, 2, 5, 7]
    assert spread(1_000_000_007, 3).tolist() == [0, 333333335, 666666671]


def make_trainer(run_dir, corpus_paths, *extra: str) -> Trainer:
    dotlist = [*TINY, "trainer_config.device=cpu", "trainer_config.sample_chars=0", *extra]
    config = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    config.data_config.path = corpus_paths
    config = OmegaConf.to_object(config)
    return build(config, DistInfo(0, 0, 1, 1, torch.device("cpu")), str(run_dir))


def test_a_node_whose_copy_of_the_corpus_differs_is_refused(tmp_path, small_corpus, monkeypatch):
    """Each node encodes its own copy of the corpus: rank 0's copy of other content (rank 1 is this
    process) is refused in one line naming the file, not trained on beside rank 1's."""

    def gather(info, fingerprint):
        if isinstance(fingerprint, dict):  # the config, the same on both
            return [fingerprint, fingerprint]
        return [[{**f, "sha256": "0" * 64} for f in fingerprint], fingerprint]

    monkeypatch.setattr("mingpt.run.all_gather", gather)
    size = small_corpus.stat().st_size
    with pytest.raises(DataError) as refused:
        make_trainer(tmp_path / "run", str(small_corpus))
    assert str(refused.value) == (
        f"rank 1 reads another corpus than rank 0 ({small_corpus}: other content (same size, "
        f"{size} bytes)): every node needs the same copy of data_config.path"
    )


def test_a_stride_past_the_block_is_said_at_start(tmp_path, corpus, caplog):
    """A window starts every `stride` characters and predicts block_size of them: a block set
    below the default stride (or taken from a fine-tune's source) left the rest of the training
    text untrained on, silently."""
    part = tmp_path / "part.txt"
    part.write_text(corpus.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    said = (
        "data_config.stride (64) is larger than data_config.block_size (16): the 48 characters "
        "between one training window's targets and the next's are never predicted, about 75% of "
        "the training text (data_config.stride=16 or less trains on all of it)"
    )
    for stride, warned in ((64, True), (16, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mingpt.run"):
            trainer = make_trainer(
                tmp_path / f"run{stride}",
                str(part),
                "data_config.block_size=16",
                f"data_config.stride={stride}",
            )
        trainer.metrics.close()
        if warned:
            assert said in caplog.text
        else:
            assert "data_config.stride" not in caplog.text


def test_a_batch_larger_than_the_corpus_is_said_at_start(tmp_path, corpus, caplog):
    """The start line gives the configured global batch; each step then takes fewer windows."""
    part = tmp_path / "part.txt"
    part.write_text(corpus.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="mingpt.run"):
        trainer = make_trainer(tmp_path / "run", str(part), "trainer_config.batch_size=1000")
    trainer.metrics.close()
    windows = len(trainer.data.train)
    assert windows < 1000
    assert (
        f"the global batch (1000) is larger than the {windows} training windows: each step takes "
        f"the epoch's windows, {windows}" in caplog.text
    )


def test_host_gathered_multi_file_run_resumes_exactly_and_reports_bpc(tmp_path, corpus, one_thread):
    """Two files, batches read from the cache file with prefetch, dropout
    on: a run stopped mid-epoch at step 7 and resumed ends with the
    uninterrupted run's exact weights. Evaluation capped at 160 tokens (10
    windows of 16) reports the loss and bits per character."""
    text = corpus.read_text(encoding="utf-8")
    paths = []
    for k, (lo, hi) in enumerate(((0, 1800), (1800, 3000))):
        paths.append(str(tmp_path / f"part{k}.txt"))
        (tmp_path / f"part{k}.txt").write_text(text[lo:hi], encoding="utf-8")
    common = [
        "data_config.placement=host",
        "gpt_config.dropout=0.1",
        "trainer_config.max_epochs=1",
        "trainer_config.batch_size=4",
        "trainer_config.grad_accum_steps=2",
        "trainer_config.eval_tokens=160",
        "optimizer_config.lr_schedule=constant",
        "optimizer_config.warmup_steps=2",
    ]
    reference = make_trainer(tmp_path / "ref", paths, *common)
    assert isinstance(reference.train_windows, HostBatches)
    reference.train()
    make_trainer(tmp_path / "resumed", paths, *common, "trainer_config.max_steps=7").train()
    resumed = make_trainer(
        tmp_path / "resumed", paths, *common, "trainer_config.allow_config_change=true"
    )
    assert resumed.state.step == 7 and 0 < resumed.state.samples_in_epoch < len(resumed.data.train)
    resumed.train()
    assert resumed.state.step == reference.state.step > 7
    for key, value in reference.raw_model.state_dict().items():
        assert torch.equal(value, resumed.raw_model.state_dict()[key]), key
    records = [
        json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
    ]
    final = [r for r in records if r["split"] == "eval"][-1]
    assert final["tokens"] == 160
    assert final["bpc"] == pytest.approx(final["loss"] / math.log(2), rel=1e-12)


def test_a_resume_past_the_end_of_an_epoch_with_fewer_windows_starts_the_next(
    tmp_path, small_corpus, one_thread, caplog
):
    """A larger stride (allow_config_change) leaves the epoch 9 windows, fewer than the 12 it
    consumed: it is over, and the run trains its next epoch, not spinning without a step."""
    common = ["trainer_config.batch_size=4", "trainer_config.max_epochs=2"]
    make_trainer(
        tmp_path, str(small_corpus), *common, "data_config.stride=1", "trainer_config.max_steps=3"
    ).train()
    with caplog.at_level(logging.WARNING, logger="mingpt.trainer"):
        resumed = make_trainer(
            tmp_path,
            str(small_corpus),
            *common,
            "data_config.stride=2000",
            "trainer_config.allow_config_change=true",
        )
    assert len(resumed.data.train) == 9
    assert "the epoch resumed has 9 training windows, fewer than the 12" in caplog.text
    assert (resumed.state.epoch, resumed.state.samples_in_epoch) == (1, 0)
    assert resumed.total_steps == 3 + 3
    resumed.train()
    assert (resumed.state.step, resumed.state.epoch) == (6, 2)


def test_a_glob_leaves_out_hidden_files_as_the_shell_does(tmp_path, caplog):
    """`*.txt` never reads a dotfile or a file in a dot directory (an editor's backup, .DS_Store,
    a .git directory): it trained on them, silently; `.*` asks for them. The matches are logged."""
    corpus = tmp_path / "d"
    (corpus / ".git").mkdir(parents=True)
    (corpus / "a.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    (corpus / ".secret.txt").write_text("XYZ" * 50, encoding="utf-8")
    (corpus / ".git" / "b.txt").write_text("UVW" * 50, encoding="utf-8")
    caplog.set_level(logging.INFO, logger="mingpt.data")
    for pattern in ("*.txt", "**/*.txt"):
        data = load_data(DataConfig(path=str(corpus / pattern), block_size=8, stride=8))
        assert data.files == [str(corpus / "a.txt")]
        assert data.tokenizer.chars == "abcdefgh"
    assert f"{corpus / '*.txt'} matches 1 file(s): a.txt" in caplog.text
    dotted = load_data(DataConfig(path=str(corpus / ".*.txt"), block_size=8, stride=8))
    assert dotted.files == [str(corpus / ".secret.txt")]


def test_a_file_whose_name_looks_like_a_glob_is_that_file(tmp_path):
    """x[1].txt names itself when it exists: it was read as the glob x[1].txt, which matches
    x1.txt."""
    (tmp_path / "x[1].txt").write_text("abcdefgh" * 50, encoding="utf-8")
    (tmp_path / "x1.txt").write_text("stuvwxyz" * 50, encoding="utf-8")
    data = load_data(DataConfig(path=str(tmp_path / "x[1].txt"), block_size=8, stride=8))
    assert data.tokenizer.chars == "abcdefgh"
    (tmp_path / "x1.txt").unlink()
    data = load_data(DataConfig(path=str(tmp_path / "x[1].txt"), block_size=8, stride=8))
    assert data.tokenizer.chars == "abcdefgh"


def test_a_cache_dir_that_is_a_file_is_named(tmp_path, caplog):
    """So is one below a file, and a directory where the cache file goes, before the corpus is
    announced as encoded and read (they were refused after)."""
    (tmp_path / "c.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    (tmp_path / "afile").write_text("not a directory\n")
    with pytest.raises(DataError, match=rf"{tmp_path / 'afile'} is not a directory \(set data"):
        load_data(DataConfig(path=str(tmp_path / "c.txt"), cache_dir=str(tmp_path / "afile")))
    caplog.set_level(logging.INFO, logger="mingpt")
    cfg = DataConfig(path=str(tmp_path / "c.txt"), cache_dir=str(tmp_path / "afile" / "sub"))
    with pytest.raises(DataError, match=r"^cannot write the token cache .*: Not a directory \("):
        load_data(cfg)
    cfg = DataConfig(path=str(tmp_path / "c.txt"), cache_dir=str(tmp_path / "cache"))
    os.makedirs(cache_location(cfg)[1])
    with pytest.raises(DataError, match=r"^cannot write the token cache .*: it is a directory \("):
        load_data(cfg)
    assert not [r for r in caplog.records if "encoding" in r.getMessage()]


def test_a_corpus_with_a_name_as_long_as_a_file_system_allows_is_cached(tmp_path):
    """The cache's name starts with the file's name: a name near 255 bytes made a cache name past
    them, refused as too long whatever data_config.cache_dir said."""
    name = "é" * 123 + ".txt"  # 250 bytes
    (tmp_path / name).write_text("abcdefgh" * 50, encoding="utf-8")
    data = load_data(DataConfig(path=str(tmp_path / name), block_size=8, stride=8))
    assert data.tokenizer.chars == "abcdefgh"
    [cache] = cache_files(tmp_path / ".mingpt-cache")
    assert cache.name.startswith("éé") and len(cache.name.encode()) < 128


def test_a_glob_never_matches_the_token_caches_own_files(tmp_path):
    """data_config.path=G/* with the cache in G (cache_dir=G, or the default G/.mingpt-cache/):
    the second run reads the same corpus, not its cache file, a temporary of one or the cache
    directory."""
    corpus = tmp_path / "g"
    corpus.mkdir()
    (corpus / "a.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    for cache_dir in (str(corpus), None):
        cfg = DataConfig(path=str(corpus / "*"), block_size=8, stride=8, cache_dir=cache_dir)
        first = load_data(cfg)
        [cache] = cache_files(corpus if cache_dir else corpus / ".mingpt-cache")
        # another node's build
        (cache.parent / f"{cache.name}.tmp-1-otherhost-0123abcd").write_bytes(b"\xff")
        second = load_data(cfg)
        assert second.files == first.files == [str(corpus / "a.txt")]
        assert second.tokenizer.chars == "abcdefgh"
    # a cache_dir of its own in G, which the first run made: the second took it for a data file
    cfg = DataConfig(path=str(corpus / "*"), block_size=8, stride=8, cache_dir=str(corpus / "c"))
    assert load_data(cfg).files == load_data(cfg).files == [str(corpus / "a.txt")]
    assert len(cache_files(corpus / "c")) == 1
    # G/** matches G and G/sub too, which were refused as data files: a glob names files
    (corpus / "sub").mkdir()
    (corpus / "sub" / "b.txt").write_text("abcdefgh", encoding="utf-8")
    sources, _ = cache_location(DataConfig(path=str(corpus / "**"), cache_dir=str(corpus / "c")))
    assert sources == [str(corpus / "a.txt"), str(corpus / "sub" / "b.txt")]


def test_a_glob_that_matches_other_files_replaces_its_cache(tmp_path):
    """One cache per pattern, not one per set of files it ever matched; a process that opened the
    replaced cache reads it still, and one that opens the cache after a build reads the files that
    build encoded, whatever the glob matches by then."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    cfg = DataConfig(path=str(texts / "*.txt"), block_size=8, stride=8)
    first = load_data(cfg)
    (texts / "b.txt").write_text("zyxwvuts" * 50, encoding="utf-8")
    second = load_data(cfg)
    assert second.files == [str(texts / "a.txt"), str(texts / "b.txt")]
    (texts / "b.txt").rename(texts / "c.txt")  # the same bytes under another name
    third = load_data(cfg)
    assert third.files == [str(texts / "a.txt"), str(texts / "c.txt")]
    (texts / "d.txt").write_text("0123" * 50, encoding="utf-8")
    assert load_data(cfg, build=False).files == third.files
    assert [p.name for p in cache_files(texts / ".mingpt-cache")] == [
        os.path.basename(third.cache.path)
    ]
    assert text_of(first, first.train.segments[0]) == ("abcdefgh" * 50)[:360]


def test_a_recursive_glob_that_finds_a_file_in_another_directory_first_replaces_its_cache(
    tmp_path,
):
    """The default cache of `texts/**/*.txt` is in texts/, the directory the glob starts from, not
    beside its first match: a new first match in a new directory built a second cache there and
    left the first."""
    texts = tmp_path / "texts"
    (texts / "b").mkdir(parents=True)
    (texts / "b" / "b.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    cfg = DataConfig(path=str(texts / "**" / "*.txt"), block_size=8, stride=8)
    load_data(cfg)
    (texts / "a").mkdir()
    (texts / "a" / "a.txt").write_text("zyxwvuts" * 50, encoding="utf-8")
    data = load_data(cfg)
    assert data.files == [str(texts / "a" / "a.txt"), str(texts / "b" / "b.txt")]
    assert sorted(tmp_path.rglob("*.tokens")) == [
        texts / ".mingpt-cache" / os.path.basename(data.cache.path)
    ]


def test_a_file_spelled_otherwise_reuses_its_cache(tmp_path, monkeypatch, caplog):
    """The cache of data/c.txt serves ./data/c.txt, and c.txt from data/, as it is: the same file
    however spelled, named as this run spells it."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "c.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    load_data(DataConfig(path="data/c.txt", block_size=8, stride=8))
    [cache] = cache_files(tmp_path / "data" / ".mingpt-cache")
    built = cache.stat().st_ino
    caplog.set_level(logging.INFO, logger="mingpt.token_cache")
    assert load_data(DataConfig(path="./data/c.txt", block_size=8, stride=8)).files == [
        "./data/c.txt"
    ]
    monkeypatch.chdir(tmp_path / "data")
    assert load_data(DataConfig(path="c.txt", block_size=8, stride=8)).files == ["c.txt"]
    assert cache.stat().st_ino == built
    assert [r.getMessage().endswith("is up to date") for r in caplog.records] == [True, True]


def test_a_path_under_the_home_directory_written_with_a_tilde_is_read_and_cached_there(
    tmp_path, monkeypatch, caplog
):
    """`~/c.txt` (quoted, so the shell leaves it) is the file in the home directory, as fsspec opens
    it: the build read it there and then looked for a `~` directory in the current one."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "c.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(path="~/c.txt", block_size=8, stride=8)
    data = load_data(cfg)
    assert data.files == ["~/c.txt"]
    assert data.cache.sources[0]["source"] == str(home / "c.txt")
    assert data.tokenizer.decode(data.cache.tokens) == "abcdefgh" * 50
    assert len(cache_files(home / ".mingpt-cache")) == 1
    caplog.set_level(logging.INFO, logger="mingpt.token_cache")
    load_data(cfg)
    assert [r.getMessage().endswith("is up to date") for r in caplog.records] == [True]
    # data_config.cache_dir alike: the cache went into a directory named ~ in the current one
    load_data(DataConfig(path="~/c.txt", block_size=8, stride=8, cache_dir="~/cache"))
    assert len(cache_files(home / "cache")) == 1
    assert not (tmp_path / "~").exists()


def test_a_cache_build_on_a_full_disk_leaves_no_directory_beside_the_corpus(small_disk):
    """A build that fails leaves the corpus's directory as it was: the default cache directory it
    made there went with the cache's temporary, not stayed behind, empty, among the user's files."""
    corpus = small_disk / "c.txt"
    corpus.write_text("abcdefgh" * 8192, encoding="utf-8")
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * (free - 16 * 1024))
    with pytest.raises(DataError) as error:
        load_data(DataConfig(path=str(corpus), block_size=8))
    assert str(error.value).startswith(f"cannot write the token cache {small_disk}/.mingpt-cache/")
    assert "No space left on device" in str(error.value)
    assert sorted(os.listdir(small_disk)) == ["c.txt", "filler"]


def test_a_stopped_cache_builds_temporary_is_removed_at_the_next_build(tmp_path):
    """Ctrl-C during a build ends the process at once (os._exit, no cleanup): the
    next build removes the temporary of a dead process on this host, never one of
    a live process or of another host (a shared file system: a live writer's, maybe)."""
    import subprocess
    import sys

    from conftest import REPO, child_env

    from mingpt.data import cache_location

    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 50, encoding="utf-8")
    cfg = DataConfig(path=str(corpus), block_size=8, stride=8, cache_dir=str(tmp_path / "cache"))
    _, path = cache_location(cfg)
    os.makedirs(tmp_path / "cache")
    stopped = (
        "import os, sys\nfrom mingpt import storage\n"
        "with storage.atomic_open(sys.argv[1]) as f:\n    f.write(b'half')\n    os._exit(130)\n"
    )
    subprocess.run(
        [sys.executable, "-c", stopped, path],
        cwd=REPO,
        env=child_env(),
        check=False,
        timeout=RUN_DEADLINE,
    )
    [dead] = [p for p in (tmp_path / "cache").iterdir()]
    assert dead.name.startswith(os.path.basename(path) + ".tmp-"), dead.name
    live = f"{path}.tmp-{os.getpid()}-{socket.gethostname()}-0123abcd"
    elsewhere = f"{path}.tmp-{dead.name.split('.tmp-')[1].split('-')[0]}-other.host-0123abcd"
    for name in (live, elsewhere):
        open(name, "wb").close()
    data = load_data(cfg)
    assert data.tokenizer.chars == "abcdefgh"
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(
        os.path.basename(p) for p in (path, live, elsewhere)
    )


def test_a_glob_that_gains_a_character_is_refused_naming_the_corpus_change(
    tmp_path, corpus, one_thread
):
    """A new file with a new character changes the vocabulary: the refusal names the
    corpus change, not only the model's vocabulary size."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(
        corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8"
    )
    pattern = str(tmp_path / "texts" / "*.txt")
    run = ("trainer_config.async_save=false", "trainer_config.max_steps=2")
    make_trainer(tmp_path / "run", pattern, *run).train()
    # a character a.txt lacks
    (tmp_path / "texts" / "b.txt").write_text("\u00a7" * 2_000, encoding="utf-8")
    with pytest.raises(SnapshotError) as refused:
        make_trainer(tmp_path / "run", pattern, *run)
    message = str(refused.value)
    assert "was written for another corpus (" in message and "b.txt added" in message, message
    assert "differs: '\u00a7'" in message and "\n" not in message


def test_a_directory_where_a_file_is_written_is_neither_replaced_nor_written_into(tmp_path):
    from mingpt import storage

    (tmp_path / "x").mkdir()
    with pytest.raises(IsADirectoryError), storage.atomic_open(str(tmp_path / "x")) as f:
        f.write(b"data")
    assert os.listdir(tmp_path / "x") == []
    assert os.listdir(tmp_path) == ["x"]  # the temporary is gone
