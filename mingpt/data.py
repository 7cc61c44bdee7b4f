"""Character-level data: corpus files, vocabulary, a contiguous train/held-out split of each file,
windows over the token cache (mingpt/token_cache.py), batches read from it or gathered on the
device, a resumable sampler."""

import dataclasses
import glob
import logging
import os
import urllib.request
from collections.abc import Iterator

import fsspec
import numpy as np
import torch
from torch.utils.data import DistributedSampler

from mingpt import storage, token_cache
from mingpt.config import DataConfig
from mingpt.distributed import SAME_ON_EVERY_RANK
from mingpt.token_cache import DataError

log = logging.getLogger(__name__)

CORPUS_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)


def download_corpus(path: str) -> None:
    """Download the tiny-shakespeare corpus to `path`, atomically."""
    log.info("downloading %s to %s", CORPUS_URL, path)
    try:
        # inside the try: a file where its directory should be (`data`) is the user's to fix
        with (
            storage.directory_for(os.path.dirname(path) or "."),
            urllib.request.urlopen(CORPUS_URL, timeout=30) as response,
            storage.atomic_open(path) as f,
        ):
            f.write(response.read())
    except OSError as e:
        raise DataError(
            f"{path} is missing and could not be downloaded from {CORPUS_URL} ({e}); "
            f"put the tiny-shakespeare text at {path} or set data_config.path"
        ) from None


def cache_location(cfg: DataConfig) -> tuple[list[str], str]:
    """The corpus files named by data_config.path (globs expanded), in order, and the path of their
    token cache."""
    named = {}  # {each file, by its name in its file system: the name given it}
    local_dir = None  # the first pattern's directory, if it is local: the cache's default place
    for i, pattern in enumerate(cfg.paths):
        fs, stripped, matches = _expand(pattern)
        local = storage.is_local(fs)
        if i == 0 and local:
            local_dir = _pattern_directory(stripped, matches)
        for m in matches:
            source = fs.unstrip_protocol(m)
            if m == stripped:
                source = pattern  # a file named without a glob, spelled as given
            elif local:
                source = m
            # Listed again, matched by a glob beside its own name, or named by a link to it or a
            # URL (file://), a file would be trained on twice.
            file = os.path.realpath(m) if local else fs.unstrip_protocol(m)
            if file in named:
                raise DataError(
                    f"data_config.path names one file twice, as {named[file]} and {source}: "
                    "list each file once"
                )
            named[file] = source
    sources = list(named.values())
    # named by the patterns, not their matches: a glob that matches other files replaces its cache
    keys = [token_cache.canonical(p) for p in cfg.paths]
    return sources, token_cache.default_cache_path(keys, cfg.truncate, cfg.cache_dir, local_dir)


def _expand(pattern: str) -> tuple[fsspec.AbstractFileSystem, str, list[str]]:
    """The file system of `pattern`, the pattern within it, and the files it names: itself, or a
    glob's matches in order, the token cache's own files left out."""
    try:
        fs, stripped = fsspec.core.url_to_fs(pattern)
        # A file named x[1].txt is that file, not a glob for x1.txt.
        if not storage.is_glob(pattern) or fs.isfile(stripped):
            return fs, stripped, [stripped]
        found = fs.glob(stripped, detail=True)
        # A glob names files: the directories it matches (G itself for G/**, a cache_dir in G)
        # were refused as data files.
        matches = [
            m
            for m in sorted(found)
            if found[m]["type"] != "directory"
            and not token_cache.is_own(m)
            and not _hidden(m, stripped)
        ]
    except (OSError, ValueError, ImportError) as e:
        raise DataError(f"cannot read data file {pattern}: {e}") from None
    if not matches:
        raise DataError(f"no data file matches {pattern}")
    return fs, stripped, matches


def _pattern_directory(stripped: str, matches: list[str]) -> str:
    """The directory of a local file, or of a glob the deepest one before its first wildcard: not
    the directory of a glob's first match, which can become another (`**/*.txt` finding a file in
    a new directory first), and with it the cache's default place, leaving the old cache behind."""
    if matches == [stripped]:
        return os.path.dirname(os.path.abspath(stripped))
    fixed = []
    for part in os.path.dirname(stripped).split("/"):
        if glob.has_magic(part):
            break
        fixed.append(part)
    return os.path.abspath("/".join(fixed) or "/")


def _hidden(match: str, pattern: str) -> bool:
    """What the shell's glob leaves out: a name starting with '.' matched by a wildcard (a dotfile,
    or a file in a dot directory), unless the pattern asks for such names (`.*`)."""
    written = pattern.split("/")
    if any(part.startswith(".") and glob.has_magic(part) for part in written):
        return False
    return any(part.startswith(".") and part not in written for part in match.split("/"))


class CharTokenizer:
    """Vocabulary: the sorted distinct characters of a text."""

    def __init__(self, chars: str):
        self.chars = chars
        self._code_points = token_cache.code_points(chars)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    # what starts the model at the beginning of a line (an empty prompt)
    def line_start(self) -> str:
        return "\n" if "\n" in self.chars else self.chars[0]

    # the distinct characters of `text` outside the vocabulary, sorted
    def unknown(self, text: str) -> str:
        return "".join(sorted(set(text) - set(self.chars)))

    def encode(self, text: str) -> torch.Tensor:
        """Token ids, a binary search per code point; a character outside the vocabulary raises
        KeyError, naming it."""
        cps = token_cache.code_points(text)
        ids = np.searchsorted(self._code_points, cps)
        wrong = self._code_points[ids.clip(max=self.vocab_size - 1)] != cps
        if wrong.any():
            raise KeyError(chr(int(cps[wrong.argmax()])))
        return torch.from_numpy(ids.astype(token_cache.dtype_for(self.vocab_size)))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class TokenWindows:
    """Windows of block_size + 1 tokens starting every `stride` tokens inside each segment (start,
    length) of `tokens` (a file's split): input the first block_size, target the last; a window
    never crosses a segment's end. `ids`, if given, maps the stored ids to the model's
    (CharData.in_vocabulary)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        stride: int,
        segments: list[tuple[int, int]] | None = None,
        ids: torch.Tensor | None = None,
    ):
        if segments is None:
            segments = [(0, len(tokens))]
        self.tokens = tokens
        self.block_size = block_size
        # A stride past the tokens' end gives each segment its first window alone, as their length
        # does; torch takes none past 64 bits.
        self.stride = min(stride, max(1, len(tokens)))
        self.segments = segments
        self.ids = None if ids is None else ids.to(tokens.device)
        counts = torch.tensor(
            [max(0, (n - block_size - 1) // stride + 1) for _, n in self.segments]
        )
        self._len = int(counts.sum())
        # each segment's first window index
        self._first = (counts.cumsum(0) - counts).to(tokens.device)
        self._seg_start = torch.tensor([s for s, _ in self.segments], device=tokens.device)
        self._offsets = torch.arange(block_size + 1, device=tokens.device)

    def __len__(self) -> int:
        return self._len

    def with_tokens(self, tokens: torch.Tensor, ids: torch.Tensor | None = None) -> "TokenWindows":
        """The same windows over `tokens` (the same, on a device), their stored id i read as ids[i]
        if given."""
        if ids is None:
            ids = self.ids
        return TokenWindows(tokens, self.block_size, self.stride, self.segments, ids)

    # where windows `indices` start in `tokens`
    def starts(self, indices: list[int] | torch.Tensor) -> torch.Tensor:
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.tokens.device)
        if len(self.segments) == 1:  # without a search: a batch's cost, for the common case
            return idx * self.stride + self.segments[0][0]
        # contiguous: a rank's share of the held-out windows is a strided view, which searchsorted
        # copies with a warning
        seg = torch.searchsorted(self._first, idx.contiguous(), right=True) - 1
        return self._seg_start[seg] + (idx - self._first[seg]) * self.stride

    # the windows, as stored, on the device
    def _gather(self, indices: list[int] | torch.Tensor) -> torch.Tensor:
        return self.tokens[self.starts(indices)[:, None] + self._offsets]

    def batch(self, indices: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self._gather(indices).long()
        if self.ids is not None:
            chunk = self.ids[chunk]
        return chunk[:, :-1], chunk[:, 1:]

    def prefetch(self, indices: torch.Tensor) -> None:
        """Nothing to do: the tokens are where the batches are used."""


class HostBatches(TokenWindows):
    """Windows read from the cache file, one pread each; on a GPU into pinned memory, copied
    asynchronously (torch's caching host allocator reuses a pinned buffer once its copy is done).
    `prefetch(indices)` reads the next step while the current one runs; `batch` then hands out
    slices of it."""

    def __init__(self, windows: TokenWindows, cache: token_cache.TokenCache, device: torch.device):
        # The tokens stay on the host, where the reads' offsets are computed.
        super().__init__(windows.tokens, windows.block_size, windows.stride, windows.segments)
        self.cache = cache
        self.device = device
        if windows.ids is not None:
            self.ids = windows.ids.to(device)
        # indices prefetched, their windows
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _read(self, indices: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(
            len(indices),
            self.block_size + 1,
            dtype=self.tokens.dtype,
            pin_memory=self.device.type == "cuda",
        )
        self.cache.read_windows(self.starts(indices), buffer)
        return buffer.to(self.device, non_blocking=True)

    def prefetch(self, indices: torch.Tensor) -> None:
        self._pending = (indices.to("cpu", torch.long), self._read(indices))

    def _gather(self, indices: list[int] | torch.Tensor) -> torch.Tensor:
        indices = torch.as_tensor(indices, dtype=torch.long).cpu()
        n = len(indices)
        # not the next prefetched
        if self._pending is None or not torch.equal(self._pending[0][:n], indices):
            self._pending = (indices, self._read(indices))
        pending, windows = self._pending
        self._pending = (pending[n:], windows[n:])
        return windows[:n]


@dataclasses.dataclass
class CharData:
    tokenizer: CharTokenizer
    train: TokenWindows
    heldout: TokenWindows
    cache: token_cache.TokenCache  # the file the tokens are read from
    files: list[str]  # the sources as data_config.path spells them, in corpus order

    def fingerprint(self) -> list[dict]:
        """The corpus's identity, as snapshots record it: each file's name, size in bytes and
        SHA-256, in order."""
        return [
            {**key, "source": source}
            for source, key in zip(self.files, self.cache.sources, strict=True)
        ]

    def in_vocabulary(self, chars: str) -> "CharData":
        """The same corpus with the vocabulary `chars` (a snapshot's), which the caller checked
        holds every character of the corpus's own: ids then mean the snapshot's characters."""
        if chars == self.tokenizer.chars:
            return self
        tokenizer = CharTokenizer(chars)
        ids = tokenizer.encode(self.tokenizer.chars).long()
        return dataclasses.replace(
            self,
            tokenizer=tokenizer,
            train=self.train.with_tokens(self.train.tokens, ids),
            heldout=self.heldout.with_tokens(self.heldout.tokens, ids),
        )

    def place(
        self, device: torch.device, placement: str = "auto"
    ) -> tuple[TokenWindows | HostBatches, ...]:
        """Training and held-out windows for `device`, per data_config.placement (on a CPU `auto` is
        `host`: a copy in memory would cost every process the corpus)."""
        nbytes = self.train.tokens.nbytes
        fits = (
            device.type == "cuda"
            and nbytes <= torch.cuda.get_device_properties(device).total_memory // 8
        )
        if placement == "host" or (placement == "auto" and not fits):
            # in characters: a tiny corpus's megabytes would read 0.0
            log.info(
                "batches are read on the host from the token cache of %s characters",
                f"{len(self.train.tokens):,}",
            )
            return (
                HostBatches(self.train, self.cache, device),
                HostBatches(self.heldout, self.cache, device),
            )
        tokens = self.cache.load(device)  # once for both
        return self.train.with_tokens(tokens), self.heldout.with_tokens(tokens)


def build_cache(cfg: DataConfig) -> tuple[list[str], str]:
    """Build the token cache unless a valid one exists (one process per node does this);
    cache_location's result."""
    sources, path = cache_location(cfg)
    # What a glob matched, once per node (the processes that wait expand it again, silently).
    if any(storage.is_glob(pattern) for pattern in cfg.paths):
        names = ", ".join(os.path.basename(source) for source in sources[:5])
        if len(sources) > 5:
            names += ", ..."
        log.info("%s matches %d file(s): %s", cfg.path, len(sources), names)
    token_cache.ensure(path, sources, cfg.truncate)
    return sources, path


def _encoded(sources: list[str], cache: token_cache.TokenCache) -> list[str]:
    """The files `cache` encoded, as data_config.path spells them (`sources`) unless a glob expanded
    again matches others since."""
    encoded = [s["source"] for s in cache.sources]
    if [token_cache.canonical(s) for s in sources] == encoded:
        return sources
    return encoded


def _say_copies(sources: list[str], cache: token_cache.TokenCache) -> None:
    """Warn of each file whose text an earlier one holds: a copy of a file (a backup beside it
    that a glob matches, a hard link) is no name of the same file, which cache_location refuses,
    but its text is trained on and evaluated twice."""
    first = {}  # {a text's digest: the first file that holds it}
    for source, entry in zip(sources, cache.sources, strict=True):
        if entry["sha256"] in first:
            log.warning(
                "%s holds the same text as %s: it is trained on and evaluated twice",
                source,
                first[entry["sha256"]],
                extra=SAME_ON_EVERY_RANK,
            )
        else:
            first[entry["sha256"]] = source


def load_data(cfg: DataConfig, build: bool = True) -> CharData:
    """Open the corpus's token cache (building it first unless `build` is False: another process of
    the node did) and split it: the first train_split of each file trains, the rest of it is held
    out."""
    sources, path = build_cache(cfg) if build else cache_location(cfg)
    try:
        cache = token_cache.open_cache(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if not build:
            return load_data(cfg, build=True)
        raise DataError(f"token cache {path} is unusable right after it was built: {e}") from None
    sources = _encoded(sources, cache)
    _say_copies(sources, cache)
    train = []
    heldout = []
    offset = 0  # of the file in the cache's tokens
    # splits with a window, by name: without one, the windows' tensors are not made (a block of
    # 10**12 did not fit in memory)
    usable = set()
    for source, n in zip(sources, cache.counts, strict=True):
        n_train = int(n * cfg.train_split)
        for name, part in (("training", n_train), ("held-out", n - n_train)):
            if part >= cfg.block_size + 1:
                usable.add(name)
            else:
                plural = "" if part == 1 else "s"
                message = (
                    f"{source}: the {name} split has {part} character{plural}, fewer than "
                    f"data_config.block_size + 1 = {cfg.block_size + 1} "
                    "(check data_config.truncate and train_split)"
                )
                if len(sources) == 1:
                    raise DataError(message)
                log.warning(
                    "%s; the file adds no %s windows", message, name, extra=SAME_ON_EVERY_RANK
                )
        train.append((offset, n_train))
        heldout.append((offset + n_train, n - n_train))
        offset += n
    for name in ("training", "held-out"):
        if name not in usable:
            raise DataError(
                f"{cfg.path}: no file has a {name} split of data_config.block_size + 1 characters"
            )
    if len(cache.vocab) < 2:
        raise DataError(
            f"{sources[0]}: the corpus has a single distinct character ({cache.vocab!r}): "
            "there is nothing to learn"
        )
    return CharData(
        CharTokenizer(cache.vocab),
        TokenWindows(cache.tokens, cfg.block_size, cfg.stride, train),
        TokenWindows(cache.tokens, cfg.block_size, cfg.block_size, heldout),
        cache,
        sources,
    )


# min(n, k) indices spread evenly over range(n) (k <= 0: all of them)
def spread(n: int, k: int) -> torch.Tensor:
    if k <= 0 or k >= n:
        return torch.arange(n)
    return torch.arange(k) * n // k


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way through an epoch. For epoch e the global order is
    a permutation seeded by seed + e, padded like DistributedSampler with its own first entries to a
    multiple of the world size W, and dealt out round-robin: rank r takes entries r, r+W, ... After
    s steps of per-rank batch b the ranks have consumed exactly the first s*b*W entries, so
    `start_index` (global samples consumed) resumes at the next unseen sample, whatever the world
    size now is."""

    def __init__(self, dataset_len: int, num_replicas: int, rank: int, seed: int):
        super().__init__(range(dataset_len), num_replicas=num_replicas, rank=rank, seed=seed)
        self.start_index = 0

    def indices(self) -> torch.Tensor:
        """This rank's share of the rest of the epoch, as one tensor (no Python object per
        sample)."""
        # int32 halves a large epoch's memory; randperm draws the same permutation for either dtype.
        n = len(self.dataset)
        dtype = torch.int32 if n < 2**31 else torch.int64
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=g, dtype=dtype)
        rest = order[self.start_index :]
        mine = rest[self.rank :: self.num_replicas]  # a view: no copy of the epoch's order
        pad = (-len(rest)) % self.num_replicas
        # the order's first entries, cycled, at positions len(rest) + j: this rank's of them
        if pad:
            j = torch.arange(pad)
            mine = torch.cat([mine, order[j % n][(len(rest) + j) % self.num_replicas == self.rank]])
        return mine

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        rest = max(0, len(self.dataset) - self.start_index)
        return -(-rest // self.num_replicas)
