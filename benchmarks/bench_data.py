"""The data pipeline at scale: time to the first step (cold and warm token cache), max RSS per
process and the data share of a step, on a generated corpus.

    python benchmarks/bench_data.py --size-mb 100 --nproc 1 2
    python benchmarks/bench_data.py --size-mb 1000 --nproc 1
    python benchmarks/bench_data.py --corpus data/input.txt --nproc 1   # a given file (warm only)
    python benchmarks/bench_data.py --size-mb 1000 --gather   # a batch from the file vs the map

The corpus is generated, never downloaded: random "words" over 365 distinct characters (95
printable ASCII, 270 others, rare), so the vocabulary needs int16 ids, as for real multilingual
text. Each case launches fresh processes (plain python for 1, torchrun for more) that do what
`main.py` does: the node's first process builds the token cache (cold: none exists; warm: it
exists and is verified), every process maps it, builds the model and trainer (nano model, CPU),
and trains STEPS steps. Reported per process: seconds from the launch to the end of the first
step, max RSS (ru_maxrss), private memory at the end (Private_Clean + Private_Dirty of
/proc/self/smaps_rollup) and of it anonymous memory, and the time spent reading batches (`batch`
and `prefetch`) per step and as a share of a step.

With --gather it compares, in one process and alternating, the time to read one batch of random
windows from the cache file (HostBatches: one pread per window) and to gather it through the memory
map (indexing the mapped tokens, as batches were read before), for several batch and block sizes,
beside the time of a nano model's training step on such a batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from _common import (
    Plain,
    at_least,
    existing_file,
    fail,
    launch,
    machine,
    parser,
    plain_step,
    positive,
    run_main,
    train_timed,
    trainer,
    training_config,
    writable_dir,
)

from mingpt import token_cache
from mingpt.data import HostBatches, TokenWindows, build_cache, cache_location, load_data
from mingpt.distributed import barrier, distributed, setup_logging
from mingpt.model import GPT

STEPS = 30
NANO = [
    "gpt_config.n_layer=3",
    "gpt_config.n_head=3",
    "gpt_config.n_embd=48",
    "data_config.block_size=64",
    "trainer_config.batch_size=12",
    "trainer_config.sample_chars=0",
    "trainer_config.eval_every=0",
    "trainer_config.log_every=1000",
    f"trainer_config.max_steps={STEPS}",
    "trainer_config.device=cpu",
]
COLUMNS = {  # a worker's key -> the table's column
    "first_step_s": "first step (s)",
    "imports_s": "of which: imports (s)",
    "cache_s": "cache built or verified (s)",
    "max_rss_mib": "max RSS per process (MiB)",
    "private_mib": "private memory (MiB)",
    "anonymous_mib": "of which anonymous (MiB)",
    "data_ms": "data per step (ms)",
    "data_share_pct": "data share of a step (%)",
}

OPTIONS = parser(__doc__)
OPTIONS.add_argument("--size-mb", type=positive, default=100, help="generated corpus size (MB)")
OPTIONS.add_argument("--corpus", type=existing_file, help="use this file instead of generating one")
OPTIONS.add_argument("--nproc", type=positive, nargs="+", default=[1, 2])
OPTIONS.add_argument(
    "--gather", action="store_true", help="only compare reading a batch from the file and the map"
)
OPTIONS.add_argument(
    "--repeats", type=positive, default=300, help="--gather: batches read each way, per batch shape"
)
OPTIONS.add_argument(
    "--steps",
    type=at_least(2),
    default=4,
    help="--gather: training steps timed per batch shape, the first a warm-up (at least 2)",
)
OPTIONS.add_argument(
    "--blocks",
    type=positive,
    nargs="+",
    default=[64, 1024],
    help="--gather: the block sizes timed, each with batches of 12 and 64",
)
OPTIONS.add_argument(
    "--dir",
    type=writable_dir,
    help="where the corpus and cache go (default: a temporary directory, removed)",
)


def generate(path: str, size_bytes: int, seed: int = 0) -> None:
    """About size_bytes of UTF-8 text over 365 characters, written in chunks."""
    rng = np.random.default_rng(seed)
    printable = np.arange(0x20, 0x7F, dtype=np.uint32)  # 95
    others = np.concatenate([np.arange(0xC0, 0x17F), np.arange(0x4E00, 0x4E00 + 79)])  # 270
    chars = np.concatenate([printable, others.astype(np.uint32)])
    weights = np.concatenate([np.full(95, 0.99 / 95), np.full(270, 0.01 / 270)])
    # a code point is at least 1 byte: up to about 4 MB, repeated
    cps = rng.choice(chars, size=max(len(chars), min(4_000_000, size_bytes)), p=weights)
    cps[rng.random(len(cps)) < 0.15] = ord(" ")
    cps[rng.random(len(cps)) < 0.015] = ord("\n")
    cps[:365] = chars  # every character
    block = cps.astype("<u4").tobytes().decode("utf-32-le").encode("utf-8")
    with open(path + ".tmp", "wb") as f:
        for _ in range(size_bytes // len(block)):
            f.write(block)
        f.write(block[: size_bytes % len(block)].decode("utf-8", errors="ignore").encode("utf-8"))
    os.replace(path + ".tmp", path)


def memory_mib() -> dict[str, float]:
    """Private (clean + dirty) and anonymous memory of this process, in MiB: the file's kB are
    KiB."""
    with open("/proc/self/smaps_rollup") as f:
        lines = f.read().splitlines()[1:]
    fields = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in lines)}
    return {
        "private": fields["Private_Clean"] + fields["Private_Dirty"],
        "anonymous": fields["Anonymous"],
    }


def worker(corpus: str, cache_dir: str, t0: float) -> None:
    """One process of a case: its figures as one JSON line on stdout."""
    config = training_config([], [*NANO, f"data_config.cache_dir={cache_dir}"])
    config.data_config.path = corpus
    t_imports = time.time()
    with distributed("cpu") as info:
        setup_logging(info.rank)
        if info.is_local_main_process:
            build_cache(config.data_config)
        barrier(info)
        t_data = time.time()
        data = load_data(config.data_config, build=False)
        with trainer(config, info, data) as t:
            first_end, reads, steps = train_timed(t)
        memory = memory_mib()
        figures = {
            "rank": info.rank,
            "first_step_s": round(first_end - t0, 2),
            "imports_s": round(t_imports - t0, 2),
            "cache_s": round(t_data - t_imports, 2),
            "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "private_mib": round(memory["private"]),
            "anonymous_mib": round(memory["anonymous"]),
            "data_ms": round(1000 * reads / (len(steps) - 1), 3),
            # prefetch is outside the step
            "data_share_pct": round(100 * reads / sum(steps[1:]), 3),
        }
        # One write of the whole line: the ranks share stdout, and a write this short is atomic.
        os.write(sys.stdout.fileno(), (json.dumps(figures) + "\n").encode())


def gather_costs(
    corpus: str, cache_dir: str, repeats: int, n_steps: int, blocks: list[int], heading: str
) -> None:
    """Microseconds to read a batch of random windows from the cache file (pread) and through the
    memory map, alternating, and a nano model's training step on such a batch (the page cache warm:
    the cache was just built or verified, which reads it whole). `heading` is printed once the
    corpus is found to hold a window of every block size."""
    torch.set_num_threads(1)
    config = training_config(
        [], [*NANO, f"data_config.cache_dir={cache_dir}", f"data_config.path={corpus}"]
    )
    build_cache(config.data_config)
    cache = token_cache.open_cache(cache_location(config.data_config)[1])
    # A block of the whole corpus or more has no window to read: torch's sampling of none failed
    # with a traceback after the table's heading.
    longest = max(blocks)
    if len(cache.tokens) < longest + 1:
        fail(
            f"argument --blocks: {corpus} has {len(cache.tokens)} characters, fewer than a block "
            f"of {longest} + 1"
        )
    print(heading)
    print(machine(threads=1))
    print(
        f"{len(cache.tokens) / 1e6:.0f} M tokens, {cache.tokens.dtype}; one process, one thread; "
        f"median of {repeats} batches each, alternating"
    )
    print(
        "| batch x block | pread (us per batch) | through the map (us per batch) "
        "| training step (ms) | pread share of a step |"
    )
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for block, batch_size in itertools.product(blocks, (12, 64)):
        windows = TokenWindows(cache.tokens, block, 1)  # a window at every position
        host = HostBatches(windows, cache, torch.device("cpu"))
        reads = {"pread": host.batch, "map": windows.batch}
        times: dict[str, list[float]] = {name: [] for name in reads}
        for r in range(repeats):
            indices = torch.randint(len(windows), (batch_size,), generator=gen)
            for name in ("pread", "map") if r % 2 else ("map", "pread"):
                start = time.perf_counter()
                reads[name](indices)
                times[name].append(time.perf_counter() - start)
        shape = dataclasses.replace(
            config.gpt_config, vocab_size=len(cache.vocab), block_size=block
        )
        model = GPT(shape)
        p = Plain(model, model, torch.optim.AdamW(model.parameters()))
        steps = []
        for _ in range(n_steps):
            x, y = host.batch(torch.randint(len(windows), (batch_size,), generator=gen))
            start = time.perf_counter()
            plain_step(p, x, y)
            steps.append(time.perf_counter() - start)
        step = statistics.median(steps[1:]) * 1e3
        pread = statistics.median(times["pread"]) * 1e6
        mapped = statistics.median(times["map"]) * 1e6
        print(
            f"| {batch_size} x {block} | {pread:.0f} | {mapped:.0f} | {step:.1f} "
            f"| {pread / step / 10:.2f}% |",
            flush=True,
        )


def check_corpus(corpus: str, cache_dir: str) -> None:
    """Read the corpus as a case's processes read it (a user error ends the script)."""
    config = training_config([], [*NANO, f"data_config.cache_dir={cache_dir}"])
    config.data_config.path = corpus
    load_data(config.data_config)


def run_case(corpus: str, cache_dir: str, nproc: int) -> list[dict]:
    """One case in fresh processes: each rank's figures."""
    argv = [os.path.abspath(__file__), "--worker", corpus, cache_dir, str(time.time())]
    proc = launch(nproc, argv, {"OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"case failed:\n{proc.stderr[-3000:]}")
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return sorted(results, key=lambda r: r["rank"])


def cases(corpus: str, work: str, nprocs: list[int], given: bool) -> None:
    """The table: for each number of processes, a cold and a warm cache (warm alone for a given
    corpus, whose cache is built once first)."""
    print(f"| processes | cache | {' | '.join(COLUMNS.values())} |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for nproc in nprocs:
        cache_dir = os.path.join(work, f"cache-{nproc}")
        states = ["cold", "warm"]
        if given:
            run_case(corpus, cache_dir, nproc)
            states = ["warm"]
        for state in states:
            results = run_case(corpus, cache_dir, nproc)
            cells = [" / ".join(str(r[key]) for r in results) for key in COLUMNS]
            print(f"| {nproc} | {state} | {' | '.join(cells)} |", flush=True)


def corpus_of(args, work: str) -> tuple[str, str]:
    """(path, label) of the given corpus, or of one generated in `work` (once)."""
    if args.corpus:
        return os.path.abspath(args.corpus), os.path.basename(args.corpus)
    corpus = os.path.join(work, f"corpus-{args.size_mb}mb.txt")
    if not os.path.exists(corpus):
        start = time.perf_counter()
        generate(corpus, args.size_mb * 10**6)
        print(f"generated {corpus} in {time.perf_counter() - start:.1f} s", flush=True)
    return corpus, f"{args.size_mb} MB generated"


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    args = OPTIONS.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="bench-data-")
    os.makedirs(work, exist_ok=True)
    try:
        corpus, label = corpus_of(args, work)
        heading = (
            f"corpus: {label}, {os.path.getsize(corpus) / 1e6:.1f} MB; nano model, batch 12 x 64, "
            f"CPU, {STEPS} steps"
        )
        if args.gather:
            gather_costs(
                corpus,
                os.path.join(work, "cache-1"),
                args.repeats,
                args.steps,
                args.blocks,
                heading,
            )
            return
        if args.corpus:
            # A given corpus the runs cannot read (not UTF-8 text, no window of a block) is refused
            # here in one line, not as a failed case in the middle of the table. Its cache, built
            # here, is the one the first case's warm-up run would build.
            check_corpus(corpus, os.path.join(work, f"cache-{args.nproc[0]}"))
        print(heading)
        print(machine(threads=1))
        cases(corpus, work, args.nproc, bool(args.corpus))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    run_main(main)
