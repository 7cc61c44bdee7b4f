"""What verifying a single-file snapshot's checksums costs, next to the rest of a
load; and how long the run's own save stalls training, synchronous against in the background.

usage: python benchmarks/bench_snapshot.py [--stall] [--rounds N] [--device cpu|cuda] [preset] [directory]
       (defaults: both parts, 3 rounds, cpu, gpt2, a temporary directory)

Builds the preset's model with a vocabulary of 65 and block 1024 (gpt2: 86M
parameters) with AdamW state, saves it with mingpt.snapshot.single_file.save
(the file that export writes and generate, score and init_from read: 1.03 GB
for gpt2, weights and two moments in fp32), then times, alternating, in N
rounds: reading the file's bytes, single_file.verify (every zip record's
CRC-32), and torch.load of the verified bytes. Prints the medians.

Then (alone with --stall) the stall of a save, the run's own
sharded.ShardedFormat.save (Distributed Checkpoint, one process) with the
trainer's finiteness check, from the call until training can go on, with
async_save false (the write and publication) and true (DCP's copy of the state
to CPU memory: pinned on a GPU; the write goes on in the background), the modes
alternating in each of N rounds in one process, the state changed in place
before each save, as training does. The first background save of a process also
allocates its copy: timed apart. Also the time until the snapshot is published,
and the time of a small training step (batch 1, 64 tokens) while a background
write runs against one without a save.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from _cli import help_or_go_on
from omegaconf import OmegaConf

from mingpt.comm_hooks import CommHook
from mingpt.config import GPTConfig
from mingpt.model import GPT
from mingpt.snapshot import sharded, single_file
from mingpt.snapshot.manager import all_finite


def preset_with_moments(preset: str, vocab_size: int, grad: float = 0.0, device: str = "cpu"):
    """(config, model, AdamW) of a preset's shape, block 1024, on `device`, after one step
    with gradients `grad`: the optimizer holds both moments, as in a real snapshot."""
    conf = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "gpt_config"
    )
    shape = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(GPTConfig), OmegaConf.load(os.path.join(conf, f"{preset}.yaml"))
        )
    )
    config = GPTConfig(**{**vars(shape), "vocab_size": vocab_size, "block_size": 1024})
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return config, model, optimizer


def verify_part(preset: str, directory: str, rounds: int) -> None:
    config, model, optimizer = preset_with_moments(preset, vocab_size=65)
    state = {
        "model_state": model.state_dict(),
        "optimizer_state": optimizer.state_dict(),
        "gpt_config": vars(config),
        "vocab": "x" * 65,
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 1,
    }
    path = os.path.join(directory, "bench-snapshot.pt")
    single_file.save(state, path)
    size = os.path.getsize(path)
    del state, optimizer, model
    print(
        f"{preset}: {config.n_layer}/{config.n_head}/{config.n_embd}, snapshot {size / 1e9:.2f} GB at {path}"
    )

    times: dict[str, list[float]] = {"read": [], "verify": [], "torch.load": []}
    for _ in range(rounds):
        start = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        times["read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        single_file.verify(data, path)
        times["verify"].append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        times["torch.load"].append(time.perf_counter() - start)
        del data
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:>10}: {median:.2f} s median of {len(values)} ({size / 1e9 / median:.2f} GB/s), "
            f"all: {', '.join(f'{v:.2f}' for v in values)}"
        )
    os.remove(path)


def check_finite(tensors) -> None:
    """The trainer's check before every save (Snapshot._check_finite, without its all-reduce)."""
    if not all_finite(list(tensors)):
        raise ValueError("not finite")


def stall_part(preset: str, directory: str, rounds: int, device: str) -> None:
    config, model, optimizer = preset_with_moments(preset, vocab_size=65, device=device)
    scaler = torch.amp.GradScaler(device, enabled=False)
    path = os.path.join(directory, "bench-stall")
    meta = {"gpt_config": vars(config), "vocab": "x" * 65, "epoch": 0, "samples_in_epoch": 0}
    formats = {
        mode: sharded.ShardedFormat(
            path, model, optimizer, scaler, CommHook(), keep=1, async_save=mode == "async"
        )
        for mode in ("sync", "async")
    }
    tokens = torch.zeros(1, 64, dtype=torch.long, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def train_step() -> float:
        start = time.perf_counter()
        _, loss = model(tokens, tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    def changed() -> None:  # the state changes in place between saves, as training changes it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-6)
        sync()

    def save(mode: str, step: int) -> tuple[float, float, list[float]]:
        """(stall, seconds until published, training steps timed while the background write ran)."""
        changed()
        start = time.perf_counter()
        handle = formats[mode].save({**meta, "step": step}, step, check_finite)
        stall = time.perf_counter() - start
        during = []
        while mode == "async" and not handle.done():
            during.append(train_step())
        formats[mode].wait()
        return stall, time.perf_counter() - start, during

    size_gb = (
        sum(
            t.numel() * t.element_size()
            for t in [
                *model.state_dict().values(),
                *(
                    v
                    for s in optimizer.state.values()
                    for v in s.values()
                    if isinstance(v, torch.Tensor)
                ),
            ]
        )
        / 1e9
    )
    print(
        f"{preset}: {config.n_layer}/{config.n_head}/{config.n_embd}, a {size_gb:.2f} GB state on {device}, "
        f"saved to {path}; {rounds} rounds"
    )
    idle = [train_step() for _ in range(3)]
    first = save("async", 1)
    results: dict[str, list[tuple[float, float, list[float]]]] = {"sync": [], "async": []}
    step = 1
    for _ in range(rounds):
        for mode in ("sync", "async"):
            step += 1
            results[mode].append(save(mode, step))
    idle += [train_step() for _ in range(3)]
    start = time.perf_counter()  # a part of every save's stall
    check_finite(model.state_dict().values())
    print(f"the finiteness check, timed once: {time.perf_counter() - start:.2f} s")
    print(
        f"first background save: stall {first[0]:.2f} s (allocates the copy), published after {first[1]:.2f} s"
    )
    medians = {}
    for mode, runs in results.items():
        medians[mode] = statistics.median(r[0] for r in runs)
        print(
            f"{mode:>6}: stall {medians[mode]:.2f} s median (all: {', '.join(f'{r[0]:.2f}' for r in runs)}), "
            f"published after {statistics.median(r[1] for r in runs):.2f} s median"
        )
    during = [t for r in results["async"] for t in r[2]]
    print(
        f"stall of a background save: {100 * medians['async'] / medians['sync']:.1f}% of a synchronous one's"
    )
    print(
        f"training step (batch 1, 64 tokens): {statistics.median(idle):.3f} s median without a save, "
        f"{statistics.median(during) if during else math.nan:.3f} s median of {len(during)} "
        "during background writes"
    )
    shutil.rmtree(path)


def main() -> None:
    help_or_go_on(__doc__)
    args = sys.argv[1:]

    def option(name: str, default: str) -> str:
        if name not in args:
            return default
        i = args.index(name)
        value = args[i + 1]
        del args[i : i + 2]
        return value

    rounds, device = int(option("--rounds", "3")), option("--device", "cpu")
    stall_only = "--stall" in args
    args = [a for a in args if a != "--stall"]
    preset = args[0] if args else "gpt2"
    directory = args[1] if len(args) > 1 else tempfile.mkdtemp()
    if not stall_only:
        verify_part(preset, directory, rounds)
    stall_part(preset, directory, rounds, device)


if __name__ == "__main__":
    main()
