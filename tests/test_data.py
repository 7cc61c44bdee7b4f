"""Data: vocabulary, encoding, the contiguous split, bad corpora, the resumable sampler."""

from __future__ import annotations

import http.server
import logging
import socket
import threading

import pytest
import torch

from mingpt import data, token_cache
from mingpt.config import DataConfig
from mingpt.data import CharTokenizer, DataError, ResumableSampler, TokenWindows, load_data


def tokenizer_of(text: str) -> CharTokenizer:
    """The vocabulary a corpus of `text` gets: its sorted distinct characters."""
    return CharTokenizer("".join(sorted(set(text))))


def test_encode_decode_round_trip_and_sorted_vocabulary(corpus):
    text = corpus.read_text(encoding="utf-8")[:5000]
    tok = tokenizer_of(text)
    assert tok.chars == "".join(sorted(set(text)))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids.dtype == torch.uint8  # compact: 65 characters fit a byte
    assert ids.tolist() == [tok.chars.index(c) for c in text]
    assert tok.decode(ids) == text
    # an empty prompt's start: a newline, else the first character
    assert tok.line_start() == "\n" and tokenizer_of("GATTACA").line_start() == "A"


def test_wide_vocabulary_round_trips():
    text = "".join(chr(0x4E00 + i) for i in range(300)) + "abc"
    tok = tokenizer_of(text)
    assert tok.vocab_size == 303
    assert tok.decode(tok.encode(text)) == text


def window_positions(windows: TokenWindows) -> set[int]:
    """Positions in the corpus covered by every window."""
    positions = set()
    for start in windows.starts(range(len(windows))).tolist():
        positions.update(range(start, start + windows.block_size + 1))
    return positions


def test_split_is_contiguous_and_disjoint(small_corpus):
    cfg = DataConfig(path=str(small_corpus), block_size=16, train_split=0.9, stride=1)
    data = load_data(cfg)
    text = small_corpus.read_text(encoding="utf-8")
    tokens = data.tokenizer.encode(text)
    n_train = int(len(text) * 0.9)
    # Contiguous: the first 90% trains, the rest is held out, in order.
    assert torch.equal(data.train.tokens, tokens) and data.heldout.tokens is data.train.tokens
    assert data.train.segments == [(0, n_train)]
    assert data.heldout.segments == [(n_train, len(text) - n_train)]
    # Training windows start at every character; held-out windows do not overlap.
    assert len(data.train) == n_train - 16
    assert data.heldout.stride == 16 and len(data.heldout) == (len(text) - n_train - 1) // 16
    train_pos = window_positions(data.train)
    heldout_pos = window_positions(data.heldout)
    assert max(train_pos) == n_train - 1
    assert min(heldout_pos) == n_train
    assert max(heldout_pos) < len(text)
    assert not train_pos & heldout_pos
    # What batch() returns is the text at those positions.
    x, y = data.heldout.batch([0, len(data.heldout) - 1])
    last = n_train + (len(data.heldout) - 1) * 16
    assert data.tokenizer.decode(x[0]) == text[n_train : n_train + 16]
    assert data.tokenizer.decode(y[1]) == text[last + 1 : last + 17]


def test_truncate_keeps_the_leading_fraction(small_corpus):
    text = small_corpus.read_text(encoding="utf-8")
    data = load_data(
        DataConfig(path=str(small_corpus), block_size=8, train_split=0.5, truncate=0.25, stride=8)
    )
    kept = text[: int(len(text) * 0.25)]
    assert len(data.train.tokens) == len(kept)
    assert data.tokenizer.chars == "".join(sorted(set(kept)))
    start, length = data.heldout.segments[0]
    assert (
        data.tokenizer.decode(data.heldout.tokens[start : start + length]) == kept[len(kept) // 2 :]
    )


def test_batch_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(100, dtype=torch.uint8)
    windows = TokenWindows(tokens, block_size=10, stride=3)
    assert len(windows) == (100 - 11) // 3 + 1
    x, y = windows.batch([0, 5, len(windows) - 1])
    assert x.shape == y.shape == (3, 10) and x.dtype == torch.long
    assert x[1].tolist() == list(range(15, 25))
    assert y[1].tolist() == list(range(16, 26))
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert y[2, -1].item() <= 99


@pytest.mark.parametrize("stride", [10**6, 2**63, 10**20])
def test_a_stride_past_the_corpus_takes_each_splits_first_window(tmp_path, stride):
    """Any stride past the corpus's length gives the same windows (one past 64 bits ended the
    run's first step in an OverflowError)."""
    path = tmp_path / "c.txt"
    path.write_text("abcdefgh" * 50, encoding="utf-8")
    data = load_data(DataConfig(path=str(path), block_size=8, stride=stride))
    assert len(data.train) == 1
    x, y = data.train.batch([0])
    assert data.tokenizer.decode(x[0]) == "abcdefgh" and data.tokenizer.decode(y[0]) == "bcdefgha"


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "not found"),
        (b"", "empty"),
        (b"caf\xe9 latin-1, not UTF-8", "not UTF-8 text: {path} (byte 3)"),
        (
            b"\xef\xbb\xbfcaf\xe9 latin-1",
            "not UTF-8 text: {path} (byte 6)",
        ),  # counted with the mark
        (b"x" * 40, "held-out split has 4 characters"),  # 36 train, 4 held out < 9
        (b"x" * 9 + b"y" * 70, "training split has 7 characters"),  # train_split 0.1 of 79
        (b"x" * 10, "held-out split has 1 character, fewer"),  # it said 1 characters
    ],
    ids=[
        "missing",
        "empty",
        "not-utf8",
        "not-utf8-after-bom",
        "short-heldout",
        "short-train",
        "one-held-out",
    ],
)
def test_bad_data_names_the_file(tmp_path, content, problem):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    split = 0.1 if problem.startswith("training") else 0.9
    with pytest.raises(DataError) as e:
        load_data(DataConfig(path=str(path), block_size=8, train_split=split))
    message = str(e.value)
    assert str(path) in message and problem.format(path=path) in message
    assert "\n" not in message


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_a_corpus_that_cannot_be_read_is_not_announced_as_encoded(tmp_path, kind, caplog):
    """The refusal is the only line: no `token cache ...: missing; encoding the corpus` before it
    (a missing corpus was announced as being encoded, then refused)."""
    path = tmp_path / "corpus.txt"
    if kind == "directory":
        path.mkdir()
    caplog.set_level(logging.INFO, logger="mingpt")
    with pytest.raises(DataError, match=f"^data file .*{path}"):
        load_data(DataConfig(path=str(path), block_size=8, cache_dir=str(tmp_path / "cache")))
    assert not [r.getMessage() for r in caplog.records if "token cache" in r.getMessage()]


def test_an_unreachable_url_says_why(tmp_path):
    """A refused connection is not a missing file
    (fsspec's HTTP file system calls both not found)."""
    with socket.socket() as s:  # a loopback port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.txt"
    with pytest.raises(
        DataError, match=rf"^cannot fetch data file {url}: Cannot connect to host 127.0.0.1:{port}"
    ):
        load_data(DataConfig(path=url, block_size=8, cache_dir=str(tmp_path)))


class NotFound(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):
        self.send_error(404)

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


def test_a_missing_url_with_a_query_is_not_called_a_glob():
    """A `?` in an HTTP URL starts its query: a missing file there is not found, with no hint that
    the name may be a glob; and data_config.path names that one file (it was a glob that matched
    nothing)."""
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound) as server:
        threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}/x.txt?version=2"
        try:
            with pytest.raises(DataError) as e, token_cache.open_source(url):
                pass
            assert data._expand(url)[2] == [url]
        finally:
            server.shutdown()
    assert str(e.value) == f"data file not found: {url}"


def consumed_and_rest(
    n: int, world: int, start: int, epoch: int = 3
) -> tuple[list[int], list[list[int]]]:
    """The epoch's global order from index 0, and each rank's share after `start`."""
    full = ResumableSampler(n, 1, 0, seed=7)
    full.set_epoch(epoch)
    order = list(full)
    shares = []
    for rank in range(world):
        s = ResumableSampler(n, world, rank, seed=7)
        s.set_epoch(epoch)
        s.start_index = start
        shares.append(list(s))
    return order, shares


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_shards_cover_every_index(world):
    n = 23
    _, shares = consumed_and_rest(n, world, start=0)
    assert sorted(set(i for share in shares for i in share)) == list(range(n))
    assert all(len(share) == -(-n // world) for share in shares)  # equal lengths, padded
    assert sum(len(share) for share in shares) - n == (-n) % world


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("start", [0, 6, 12, 22, 23])
def test_sampler_resumes_exactly(world, start):
    """After `start` samples consumed (by any world size), the ranks together
    take exactly the rest of the epoch, in order, plus padding to a multiple of the world size."""
    n = 23
    order, shares = consumed_and_rest(n, world, start)
    # rank r takes r, r+W, ...
    merged = [shares[r][k] for k in range(len(shares[0])) for r in range(world)]
    rest = n - start
    assert merged[:rest] == order[start:]
    assert sorted(order[:start] + merged[:rest]) == list(range(n))  # no duplicate, none missing
    assert len(merged) - rest == (-rest) % world  # the remainder is padding only
    # the epoch's first entries, as DistributedSampler pads
    assert merged[rest:] == order[: len(merged) - rest]
    assert all(len(share) == -(-rest // world) for share in shares)


def test_sampler_order_depends_on_epoch_and_seed():
    def order(epoch, seed):
        s = ResumableSampler(50, 1, 0, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(0, 1) == order(0, 1)
    assert order(0, 1) != order(1, 1)
    assert order(0, 1) != order(0, 2)
