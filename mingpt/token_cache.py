"""The token cache: a corpus, its files read and decoded here, encoded once per node into a
checksummed file that every process reads its batches from. Layout: MAGIC, the JSON header's
length, the header padded to a page, then the ids, file after file."""

import codecs
import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import fsspec
import numpy as np
import torch

from mingpt import storage

log = logging.getLogger(__name__)

MAGIC = b"MINGPT-TOKENS\n"
VERSION = 1
PAGE = 4096
CHUNK = 4 << 20  # bytes read and decoded at a time (bounds the memory an encode needs)
N_CODE_POINTS = 0x110000
BLANK_DIGEST = "0" * 64  # the header's checksum field while the checksum is computed
DEFAULT_DIR = ".mingpt-cache"  # beside a local corpus
STEM_BYTES = 64  # of the corpus's file name, at the start of its cache's name
OWN_NAME = re.compile(
    rf"{re.escape(DEFAULT_DIR)}|.*-[0-9a-f]{{16}}\.tokens({re.escape(storage.TMP_MARK)}.*)?"
)


class DataError(ValueError):
    """The corpus is missing or unusable, or its cache cannot be written; the message names it."""


class CacheWriteError(DataError):
    """The token cache at `path` cannot be written, for the reason `why`; the message says so and
    how a run moves it (data_config.cache_dir), which score, using the run's setting, cannot."""

    def __init__(self, path: str, why: str):
        super().__init__(f"cannot write the token cache {path}: {why} (set data_config.cache_dir)")
        self.path = path
        self.why = why


@dataclass
class TokenCache:
    path: str
    # every file's ids, file after file (memory-mapped, read-only by convention)
    tokens: torch.Tensor
    vocab: str  # the sorted distinct characters
    counts: list[int]  # each source's number of tokens, in order
    # open for reads (batches are read from it, not through the map); closed with this object
    fd: int
    offset: int  # where the token ids start in the file, in bytes
    sources: list[dict]  # each source's {"source", "size", "sha256"}, from the header

    def read_windows(self, starts: torch.Tensor, out: torch.Tensor) -> None:
        """Row i of `out` (contiguous, on the CPU, in the cache's dtype) := the tokens from
        `starts[i]` on. One pread per row, not a gather through the memory map: a kernel that maps
        large page-cache folios adds about 1 MB to the process's RSS per window sampled through a
        map; a read copies just the window."""
        item = out.element_size()
        rows = out.view(torch.uint8).numpy()  # the bytes of `out`, in place, row by row
        for row, start in zip(rows, starts.tolist(), strict=True):
            if os.preadv(self.fd, [row], self.offset + start * item) != len(row):
                raise DataError(f"token cache {self.path} was truncated while in use")

    # every token id, read into `device`'s memory by chunks
    def load(self, device: torch.device) -> torch.Tensor:
        out = torch.empty_like(self.tokens, device=device)
        for start in range(0, len(out), CHUNK):
            host = torch.empty(1, min(CHUNK, len(out) - start), dtype=out.dtype)
            self.read_windows(torch.tensor([start]), host)
            out[start : start + CHUNK] = host[0]
        return out


def dtype_for(vocab_size: int) -> str:  # the ids' dtype, a name numpy and torch share
    if vocab_size <= 256:
        return "uint8"
    if vocab_size <= 2**15:
        return "int16"
    return "int32"


def code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


# how often each code point occurs (torch's bincount: ~20x numpy's)
def count(cps: np.ndarray) -> torch.Tensor:
    return torch.bincount(torch.from_numpy(cps.astype(np.int32)), minlength=N_CODE_POINTS)


@contextlib.contextmanager
def open_source(path: str, what: str = "data file") -> Iterator[BinaryIO]:
    """A corpus file (fsspec URL or local path) opened for reading; failing to open or read it, or a
    local file that is not regular (a FIFO would block the read forever, /dev/zero never ends), is
    one DataError naming it as `what` (score's: its key)."""
    try:
        storage.check_regular(path, what)
        with fsspec.open(path, "rb") as f:
            yield f
    except (DataError, storage.StorageError) as e:  # the body's own, or check_regular's
        raise DataError(str(e)) from None
    except FileNotFoundError as e:
        # fsspec's HTTP file system says "not found" for a failed connection too, with the
        # connection's error as its cause; for a name with glob characters the cause is the
        # missing file's own error
        if e.__cause__ is not None and not isinstance(e.__cause__, FileNotFoundError):
            raise DataError(f"cannot fetch {what} {path}: {storage.reason(e.__cause__)}") from None
        missing = f"{what} not found: {path}"
        # Here a glob's characters are a name's: data_config.path's globs were expanded before,
        # and score reads the one file it is given.
        if storage.is_glob(path):
            missing += " (one file's name: no glob is expanded here)"
        raise DataError(missing) from None
    # an unreachable object store included
    except (*storage.storage_errors(), ValueError, ImportError) as e:
        raise DataError(f"cannot read {what} {path}: {storage.reason(e)}") from None


def decoded_chunks(source: str, what: str = "data file") -> Iterator[tuple[bytes, str]]:
    """(raw bytes, decoded text) chunk by chunk, ending with an empty chunk. A byte-order mark at
    the start of the file is dropped; bytes that are not UTF-8 end it with a DataError."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    offset = 0  # of `raw` in the file, for the error's byte number
    with open_source(source, what) as f:
        while True:
            raw = f.read(CHUNK)
            # bytes before the error's start: those the decoder held back, or the mark it dropped
            before = offset - len(decoder.getstate()[0])
            if offset == 0 and raw.startswith(codecs.BOM_UTF8):
                before = len(codecs.BOM_UTF8)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{what} is not UTF-8 text: {source} (byte {before + e.start})"
                ) from None
            offset += len(raw)
            yield raw, text
            if not raw:
                return


def hashed_chunks(source: str, key: dict) -> Iterator[str]:
    """decoded_chunks' text; once the source is read to its end, `key` holds its entry in the
    header: {"source", "size", "sha256"}."""
    digest = hashlib.sha256()
    size = 0
    for raw, text in decoded_chunks(source):
        digest.update(raw)
        size += len(raw)
        yield text
    key.update(source=canonical(source), size=size, sha256=digest.hexdigest())


def kept_chunks(scans: list[dict], kept: list[int]) -> Iterator[np.ndarray]:
    """The code points of the first kept[i] characters of each source, chunk by chunk, source after
    source. Each source is read to its end and must still be the bytes its scan ({"source", "size",
    "sha256"}) hashed, else a DataError: a file edited during a build would leave the new text's
    ids under the old text's checksum, trusted by the next run that finds the old text."""
    for scan, keep in zip(scans, kept, strict=True):
        key = {}
        for text in hashed_chunks(scan["source"], key):
            cps = code_points(text[: max(keep, 0)])
            keep -= len(cps)
            yield cps
        if key != scan:
            raise DataError(
                f"data file {scan['source']} changed while its token cache was built; run again"
            )


def read_header(f) -> tuple[dict, int]:
    """The header of an open cache file and where the token ids start; a ValueError (or KeyError)
    when it is not a cache of this version or its size is not what the header says."""
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a token cache")
    length = int.from_bytes(f.read(8), "little")
    if not 0 < length < 1 << 30:
        raise ValueError("bad header length")
    header = json.loads(f.read(length))
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise ValueError("another cache version")
    offset = -(-(len(MAGIC) + 8 + length) // PAGE) * PAGE  # the header's pages
    dtype = dtype_for(len(header["vocab"]))
    if os.fstat(f.fileno()).st_size != offset + sum(header["counts"]) * np.dtype(dtype).itemsize:
        raise ValueError("wrong size")
    return header, offset


def _header_bytes(header: dict) -> bytes:  # padded to a page, so the ids start on one
    body = json.dumps(header, sort_keys=True).encode("utf-8")
    head = MAGIC + len(body).to_bytes(8, "little") + body
    return head.ljust(-(-len(head) // PAGE) * PAGE, b"\0")


def canonical(source: str) -> str:
    """A source's name as a cache records it: a local path made absolute, the same file however a
    run spells it, from whichever directory."""
    if "://" in source:
        return source
    # fsspec, which opens the file, reads a leading `~` as the home directory: the name recorded
    # must be the file it read, which a build opens again
    return os.path.abspath(os.path.expanduser(source))


def source_keys(sources: list[str]) -> list[dict]:
    """Each source's entry in a cache's header, {"source", "size", "sha256"}, from one read of it;
    a DataError when it cannot be read."""
    keys = []
    for source in sources:
        with open_source(source) as f:
            size, digest = storage.sha256(f)
        keys.append({"source": canonical(source), "size": size, "sha256": digest})
    return keys


def _why_rebuild(path: str, sources: list[str], truncate: float) -> str | None:
    """None if the cache at `path` is valid: the sources and the ids have the SHA-256s its header
    records (each read once to compare); else why it is not. A source that cannot be read is a
    DataError here, before a build is announced."""
    if not os.path.exists(path):
        for source in sources:
            with open_source(source):
                pass
        return "missing"
    keys = source_keys(sources)
    try:
        with open(path, "rb") as f:
            header, offset = read_header(f)
            f.seek(offset)
            if keys != header["sources"] or header["truncate"] != truncate:
                return "the corpus changed"
            # The checksum covers the header too (its own field blank): a vocabulary changed in
            # place would misread every id.
            blank = _header_bytes({**header, "digest": BLANK_DIGEST})
            if storage.sha256(f, blank)[1] != header["digest"]:
                return "damaged (its checksum does not match)"
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"damaged ({e})"
    return None


def _scan(source: str) -> tuple[dict, int, torch.Tensor]:
    """A source's entry in the header ({"source", "size", "sha256"}), its length in characters and
    how often each code point occurs in it, from one read."""
    key = {}
    n_chars = 0
    counts = 0
    for text in hashed_chunks(source, key):
        n_chars += len(text)
        counts += count(code_points(text))
    if not n_chars:
        raise DataError(f"data file is empty: {source}")
    return key, n_chars, counts


def ensure(path: str, sources: list[str], truncate: float) -> None:
    """Build the cache at `path` (atomically) unless a valid one is there. A build reads each source
    twice (thrice when truncated: the vocabulary is that of the kept text), whole each time."""
    why = _why_rebuild(path, sources, truncate)
    if why is None:
        log.info("token cache %s is up to date", path)
        return
    # Refused before a build is announced: the refusal is the only line.
    directory = os.path.dirname(path) or "."
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CacheWriteError(path, f"{directory} is not a directory")
    # which no file can replace (it was taken for a damaged cache, encoded, then refused)
    if os.path.isdir(path):
        raise CacheWriteError(path, "it is a directory")
    level = logging.INFO
    if why.startswith("damaged"):
        level = logging.WARNING
    # The directory and the temporary are made before the corpus is read: a cache that cannot be
    # written (a read-only directory, a file above it) was refused only after the corpus was
    # announced and read. A build that fails (a full disk, a source changed while it was read)
    # leaves no cache directory it made: the default one is beside the user's corpus.
    try:
        with storage.directory_for(directory):
            # builds whose process died left their temporaries
            for stale in storage.remove_stale_temporaries(path):
                log.info("removed %s, left by a build that was stopped", stale)
            with storage.atomic_open(path) as f:
                log.log(level, "token cache %s: %s; encoding the corpus", path, why)
                scans = [_scan(source) for source in sources]
                keys = [key for key, _, _ in scans]
                kept = [max(1, int(n_chars * truncate)) for _, n_chars, _ in scans]
                if truncate == 1.0:
                    counts = sum(c for *_, c in scans)
                else:  # the vocabulary of the kept text alone
                    counts = sum(count(cps) for cps in kept_chunks(keys, kept))
                vocab_cps = np.flatnonzero(counts.numpy())
                dtype = dtype_for(len(vocab_cps))
                lookup = np.zeros(N_CODE_POINTS, dtype=dtype)
                lookup[vocab_cps] = np.arange(len(vocab_cps), dtype=dtype)
                header = {
                    "version": VERSION,
                    "sources": keys,
                    "truncate": truncate,
                    "vocab": "".join(map(chr, vocab_cps.tolist())),
                    "dtype": dtype,
                    "counts": kept,
                    "digest": BLANK_DIGEST,
                }
                f.write(_header_bytes(header))
                digest = hashlib.sha256(_header_bytes(header))
                for cps in kept_chunks(keys, kept):
                    ids = lookup[cps].tobytes()
                    digest.update(ids)
                    f.write(ids)
                header["digest"] = digest.hexdigest()  # same length as the placeholder
                f.seek(0)
                f.write(_header_bytes(header))
    except OSError as e:
        raise CacheWriteError(path, str(e.strerror or e)) from None


# memory-mapped; its header and size are checked, not its checksum
def open_cache(path: str) -> TokenCache:
    with open(path, "rb") as f:
        header, offset = read_header(f)
        # private, copy-on-write: nothing writes to it
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        # the file whose header was read, even if the path is replaced since
        fd = os.dup(f.fileno())
    mapped.madvise(mmap.MADV_RANDOM)  # whole-corpus reads only; no readahead for stray touches
    # keeps `mapped` alive
    dtype = getattr(torch, dtype_for(len(header["vocab"])))
    tokens = torch.frombuffer(mapped, dtype=dtype, offset=offset)
    cache = TokenCache(
        path, tokens, header["vocab"], header["counts"], fd, offset, header["sources"]
    )
    weakref.finalize(cache, os.close, fd)
    return cache


def is_own(path: str) -> bool:  # a cache file, a temporary of one, or the default cache directory
    return OWN_NAME.fullmatch(os.path.basename(path.rstrip("/"))) is not None


def default_cache_path(
    sources: list[str], truncate: float, cache_dir: str | None, local_dir: str | None
) -> str:
    """data_config.cache_dir if set, else .mingpt-cache/ beside a local corpus when that directory
    is writable, else the user's cache directory. The name depends on the sources (the patterns of
    data_config.path) and truncate, not the files or their contents: a changed corpus replaces its
    cache instead of adding one."""
    if cache_dir is None:
        cache_dir = storage.user_cache_dir()
        if local_dir is not None and os.access(local_dir, os.W_OK):
            cache_dir = os.path.join(local_dir, DEFAULT_DIR)
    # as in data_config.path (canonical): a leading `~` is the home directory, not a directory
    # named `~` made in the current one
    cache_dir = os.path.expanduser(cache_dir)
    name = hashlib.sha256(json.dumps([sources, truncate, VERSION]).encode()).hexdigest()[:16]
    stem = os.path.basename(sources[0].rstrip("/"))
    # The stem only makes the name readable; whole, a long file name would make it longer than a
    # file name may be (255 bytes), the temporary's suffix (up to about 90 more) included.
    stem = stem.encode("utf-8")[:STEM_BYTES].decode("utf-8", "ignore") or "corpus"
    stem = re.sub(r"[][*?]+", "_", stem)  # a glob's pattern: no wildcard in a file's name
    return os.path.join(cache_dir, f"{stem}-{name}.tokens")
