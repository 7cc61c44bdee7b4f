"""Character-level data: corpus, vocabulary, a contiguous train/held-out split,
windows over the encoded text, and a resumable distributed sampler.

The text is encoded once into a compact integer tensor; a sample is a slice of
it and a batch is gathered with one indexing operation.
"""

from __future__ import annotations

import logging
import os
import urllib.request
from dataclasses import dataclass
from typing import Iterator

import fsspec
import torch
from torch.utils.data import DistributedSampler

from mingpt.checkpoint import reason, storage_errors
from mingpt.config import DEFAULT_DATA_PATH, DataConfig

log = logging.getLogger(__name__)

CORPUS_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


class DataError(ValueError):
    """The corpus is missing or unusable; the message names the file."""


def download_corpus(path: str = DEFAULT_DATA_PATH, url: str = CORPUS_URL) -> None:
    """Download the tiny-shakespeare corpus to `path`, atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.download-{os.getpid()}"
    log.info("downloading %s to %s", url, path)
    try:
        with urllib.request.urlopen(url, timeout=30) as response, open(tmp, "wb") as f:
            f.write(response.read())
        os.replace(tmp, path)
    except OSError as e:
        raise DataError(
            f"{path} is missing and could not be downloaded from {url} ({e}); "
            f"put the tiny-shakespeare text at {path} or set data_config.path"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_text(path: str) -> str:
    """Read a UTF-8 text file from any fsspec URL or local path."""
    try:
        with fsspec.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except (*storage_errors(), ValueError, ImportError) as e:  # an unreachable object store included
        raise DataError(f"cannot read data file {path}: {reason(e)}") from None
    if not raw:
        raise DataError(f"data file is empty: {path}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file is not UTF-8 text: {path} (byte {e.start})") from None


class CharTokenizer:
    """Vocabulary: the sorted distinct characters of a text."""

    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def unknown(self, text: str) -> str:
        """The distinct characters of `text` outside the vocabulary, sorted."""
        return "".join(sorted(set(text) - set(self.stoi)))

    def encode(self, text: str) -> torch.Tensor:
        dtype = torch.uint8 if self.vocab_size <= 256 else torch.int32
        return torch.tensor([self.stoi[c] for c in text], dtype=dtype)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class TokenWindows:
    """Windows of block_size + 1 tokens starting every `stride` tokens:
    input is the first block_size, target the last block_size."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int):
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride
        self._offsets = torch.arange(block_size + 1, device=tokens.device)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - self.block_size - 1) // self.stride + 1)

    def to(self, device: torch.device) -> TokenWindows:
        """The same windows with the tokens on `device`, so batches are gathered there."""
        return TokenWindows(self.tokens.to(device), self.block_size, self.stride)

    def batch(self, indices: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.as_tensor(indices, dtype=torch.long, device=self.tokens.device) * self.stride
        chunk = self.tokens[starts[:, None] + self._offsets].long()
        return chunk[:, :-1], chunk[:, 1:]


@dataclass
class CharData:
    tokenizer: CharTokenizer
    train: TokenWindows
    heldout: TokenWindows


def load_data(cfg: DataConfig) -> CharData:
    """Read, truncate, encode and split the corpus. The first train_split of the
    text trains; the rest is held out, so no held-out window shares a character
    position with a training window."""
    text = read_text(cfg.path)
    text = text[: max(1, int(len(text) * cfg.truncate))]
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)
    n_train = int(len(tokens) * cfg.train_split)
    for name, part in (("training", tokens[:n_train]), ("held-out", tokens[n_train:])):
        if len(part) < cfg.block_size + 1:
            raise DataError(
                f"{cfg.path}: the {name} split has {len(part)} characters, fewer than "
                f"data_config.block_size + 1 = {cfg.block_size + 1} (check data_config.truncate and train_split)"
            )
    return CharData(
        tokenizer=tokenizer,
        train=TokenWindows(tokens[:n_train], cfg.block_size, cfg.stride),
        heldout=TokenWindows(tokens[n_train:], cfg.block_size, cfg.block_size),
    )


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way through an epoch.

    For epoch e the global order is a permutation seeded by (seed, e), padded
    like DistributedSampler with its own first entries to a multiple of the
    world size, and dealt out round-robin: rank r takes entries r, r+W, ...
    After s steps of per-rank batch b the ranks together have consumed exactly
    the first s*b*W entries, so `start_index` (global samples consumed) resumes
    at the next unseen sample, whatever the world size now is.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(range(dataset_len), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.dataset_len = dataset_len
        self.start_index = 0

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        rest = order[self.start_index:]
        pad = (-len(rest)) % self.num_replicas
        return rest + (order * (pad // max(1, len(order)) + 1))[:pad]

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        rest = max(0, self.dataset_len - self.start_index)
        return -(-rest // self.num_replicas)

    def real_count(self) -> int:
        """How many of this rank's samples are not padding (start_index 0)."""
        return len(range(self.rank, self.dataset_len, self.num_replicas))
