"""The data pipeline at scale: time to the first step (cold and warm token
cache), max RSS per process and the data share of a step, on a generated corpus.

    python benchmarks/bench_data.py --size-mb 100 --nproc 1 2
    python benchmarks/bench_data.py --size-mb 1000 --nproc 1
    python benchmarks/bench_data.py --corpus data/input.txt --nproc 1   # a given file (warm cache only)
    python benchmarks/bench_data.py --size-mb 1000 --gather   # a batch read from the file vs through the map

The corpus is generated, never downloaded: random "words" over 365 distinct
characters (95 printable ASCII, 270 others, rare), so the vocabulary needs
int16 ids, as for real multilingual text. Each case launches fresh processes
(plain python for 1, torchrun for more) that do what `main.py` does: the node's
first process builds the token cache (cold: none exists; warm: it exists and
is verified), every process maps it, builds the model and trainer (nano
model, CPU), and trains STEPS steps. Reported per process: seconds from the
launch to the end of the first step, max RSS (ru_maxrss), private memory at
the end (Private_Clean + Private_Dirty of /proc/self/smaps_rollup) and of it
anonymous memory, and the time spent reading batches (`batch` and
`prefetch`) per step and as a share of a step.

With --gather it compares, in one process and alternating, the time to read
one batch of random windows from the cache file (HostBatches: one pread per
window) and to gather it through the memory map (indexing the mapped tokens,
as batches were read before), for several batch and block sizes, beside the
time of a nano model's training step on such a batch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def generate(path: str, size_bytes: int, seed: int = 0) -> None:
    """About size_bytes of UTF-8 text over 365 characters, written in chunks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ascii_chars = np.arange(0x20, 0x7F, dtype=np.uint32)  # 95 printable
    # 270
    others = np.concatenate([np.arange(0xC0, 0x17F), np.arange(0x4E00, 0x4E00 + 79)]).astype(
        np.uint32
    )
    chars = np.concatenate([ascii_chars, others])
    weights = np.concatenate([np.full(95, 0.99 / 95), np.full(270, 0.01 / 270)])
    # a code point is >= 1 byte
    cps = rng.choice(chars, size=max(len(chars), min(4_000_000, size_bytes)), p=weights)
    cps[rng.random(len(cps)) < 0.15] = ord(" ")
    cps[rng.random(len(cps)) < 0.015] = ord("\n")
    cps[:365] = chars  # every character
    block = cps.astype("<u4").tobytes().decode("utf-32-le").encode("utf-8")  # up to ~4 MB, repeated
    with open(path + ".tmp", "wb") as f:
        for _ in range(size_bytes // len(block)):
            f.write(block)
        f.write(block[: size_bytes % len(block)].decode("utf-8", errors="ignore").encode("utf-8"))
    os.replace(path + ".tmp", path)


def memory_mb() -> dict[str, float]:
    """Private (clean + dirty) and anonymous memory of this process, in MB."""
    with open("/proc/self/smaps_rollup") as f:
        fields = {
            k: int(v.split()[0]) / 1024
            for k, v in (line.split(":", 1) for line in f.read().splitlines()[1:])
        }
    return {
        "private": fields["Private_Clean"] + fields["Private_Dirty"],
        "anonymous": fields["Anonymous"],
    }


def worker(corpus: str, cache_dir: str, run_dir: str, t0: float) -> None:
    import torch
    from omegaconf import OmegaConf

    from mingpt.config import Config
    from mingpt.data import build_cache, load_data
    from mingpt.distributed import barrier, distributed, setup_logging
    from mingpt.model import GPT
    from mingpt.train import fit_to_data
    from mingpt.trainer import Trainer

    dotlist = [*NANO, f"data_config.cache_dir={cache_dir}"]
    config = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    config.data_config.path = corpus
    config = OmegaConf.to_object(config)
    t_imports = time.time()
    with distributed("cpu") as info:
        setup_logging(info.rank)
        if info.is_local_main_process:
            build_cache(config.data_config)
        barrier(info)
        t_data = time.time()
        data = load_data(config.data_config, build=False)
        config.gpt_config = fit_to_data(
            config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size
        )
        torch.manual_seed(0)
        trainer = Trainer(
            config, GPT(config.gpt_config), data, info, run_dir, os.path.join(run_dir, "snapshots")
        )
        gather_s, step_s, first_step = [0.0], [], []
        windows, train_step = trainer.train_windows, trainer.train_step

        def timed(read):
            def call(indices):
                start = time.perf_counter()
                out = read(indices)
                gather_s[0] += time.perf_counter() - start
                return out

            return call

        def timed_step(indices):
            start = time.perf_counter()
            out = train_step(indices)
            step_s.append(time.perf_counter() - start)
            if not first_step:
                first_step.append(time.time())
                gather_s[0] = 0.0  # the share is measured over the later steps
            return out

        # Instance attributes shadow the methods.
        windows.batch, windows.prefetch, trainer.train_step = (
            timed(windows.batch),
            timed(windows.prefetch),
            timed_step,
        )
        trainer.train()
        memory = memory_mb()
        # One write of the whole line: the ranks share stdout, and a write this short is atomic.
        os.write(
            sys.stdout.fileno(),
            (
                json.dumps(
                    {
                        "rank": info.rank,
                        "first_step_s": round(first_step[0] - t0, 2),
                        "imports_s": round(t_imports - t0, 2),
                        "cache_s": round(t_data - t_imports, 2),
                        "max_rss_mb": round(
                            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                        ),
                        "private_mb": round(memory["private"]),
                        "anonymous_mb": round(memory["anonymous"]),
                        "data_ms": round(1000 * gather_s[0] / (len(step_s) - 1), 3),
                        # prefetch is outside the step
                        "data_share_pct": round(100 * gather_s[0] / sum(step_s[1:]), 3),
                        "tokens": len(data.train.tokens),
                    }
                )
                + "\n"
            ).encode(),
        )


def gather_costs(corpus: str, cache_dir: str, repeats: int = 300) -> None:
    """Microseconds to read a batch of random windows from the cache file
    (pread) and through the memory map, alternating, and a nano model's
    training step on such a batch (the page cache warm: the cache was just
    built or verified, which reads it whole)."""
    import torch
    from omegaconf import OmegaConf

    from mingpt import token_cache
    from mingpt.config import Config
    from mingpt.data import HostBatches, TokenWindows, build_cache, cache_location
    from mingpt.model import GPT
    from mingpt.train import fit_to_data

    torch.set_num_threads(1)
    config = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(Config),
            OmegaConf.from_dotlist(
                [*NANO, f"data_config.cache_dir={cache_dir}", f"data_config.path={corpus}"]
            ),
        )
    )
    build_cache(config.data_config)
    cache = token_cache.open_cache(cache_location(config.data_config)[1])
    print(
        f"{len(cache.tokens) / 1e6:.0f} M tokens, {cache.tokens.dtype}; one process, one thread; "
        f"median of {repeats} batches each, alternating"
    )
    print(
        "| batch x block | pread (us per batch) | through the map (us per batch) | training step (ms) "
        "| pread share of a step |"
    )
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for batch_size, block in ((12, 64), (64, 64), (12, 1024), (64, 1024)):
        windows = TokenWindows(cache.tokens, block, 1)  # a window at every position
        host = HostBatches(windows, cache, torch.device("cpu"))
        times: dict[str, list[float]] = {"pread": [], "map": []}
        for r in range(repeats):
            indices = torch.randint(len(windows), (batch_size,), generator=gen)
            for name in ("pread", "map") if r % 2 else ("map", "pread"):
                start = time.perf_counter()
                (host.batch if name == "pread" else windows.batch)(indices)
                times[name].append(time.perf_counter() - start)
        model = GPT(fit_to_data(config.gpt_config, len(cache.vocab), block))
        optimizer = torch.optim.AdamW(model.parameters())
        steps = []
        for _ in range(4):
            x, y = host.batch(torch.randint(len(windows), (batch_size,), generator=gen))
            start = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append(time.perf_counter() - start)
        pread, mapped = (sorted(times[k])[repeats // 2] * 1e6 for k in ("pread", "map"))
        step = sorted(steps[1:])[1] * 1e3
        print(
            f"| {batch_size} x {block} | {pread:.0f} | {mapped:.0f} | {step:.1f} | {pread / step / 10:.2f}% |",
            flush=True,
        )


def run_case(corpus: str, cache_dir: str, nproc: int, work: str) -> list[dict]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [repo, *filter(None, [os.environ.get("PYTHONPATH")])]  # the caller's own paths stay
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
    )
    run_dir = tempfile.mkdtemp(dir=work)
    t0 = time.time()
    proc = subprocess.run(
        [*launcher, os.path.abspath(__file__), "--worker", corpus, cache_dir, run_dir, str(t0)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"case failed:\n{proc.stderr[-3000:]}")
    return sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=100, help="generated corpus size (MB)")
    parser.add_argument("--corpus", help="use this file instead of generating one")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--gather",
        action="store_true",
        help="only compare reading a batch from the file and the map",
    )
    parser.add_argument(
        "--dir", help="where the corpus and cache go (default: a temporary directory, removed)"
    )
    args = parser.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="bench-data-")
    os.makedirs(work, exist_ok=True)
    try:
        if args.corpus:
            corpus, label = os.path.abspath(args.corpus), os.path.basename(args.corpus)
        else:
            corpus, label = (
                os.path.join(work, f"corpus-{args.size_mb}mb.txt"),
                f"{args.size_mb} MB generated",
            )
            if not os.path.exists(corpus):
                start = time.perf_counter()
                generate(corpus, args.size_mb * 10**6)
                print(f"generated {corpus} in {time.perf_counter() - start:.1f} s", flush=True)
        print(
            f"corpus: {label}, {os.path.getsize(corpus) / 1e6:.1f} MB; nano model, batch 12 x 64, CPU, {STEPS} steps"
        )
        if args.gather:
            gather_costs(corpus, os.path.join(work, "cache-1"))
            return
        print(
            "| processes | cache | first step (s) | of which: imports (s) | cache built or verified (s) "
            "| max RSS per process (MB) | private memory (MB) | of which anonymous (MB) "
            "| data per step (ms) | data share of a step |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for nproc in args.nproc:
            cache_dir = os.path.join(work, f"cache-{nproc}")
            states = ["warm"] if args.corpus else ["cold", "warm"]
            if args.corpus:
                run_case(corpus, cache_dir, nproc, work)  # build it once
            for state in states:
                results = run_case(corpus, cache_dir, nproc, work)

                def col(key, fmt="{}"):
                    return " / ".join(fmt.format(r[key]) for r in results)

                print(
                    f"| {nproc} | {state} | {col('first_step_s')} | {col('imports_s')} | {col('cache_s')} "
                    f"| {col('max_rss_mb')} "
                    f"| {col('private_mb')} | {col('anonymous_mb')} | {col('data_ms')} "
                    f"| {col('data_share_pct', '{}%')} |",
                    flush=True,
                )
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
