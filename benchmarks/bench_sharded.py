"""Training stall and peak extra RAM of one snapshot save, per format.

usage: python benchmarks/bench_sharded.py [--vocab N] [preset] [rounds] [directory]
       (defaults: 50257, gpt2, 2, a temporary directory)
       torchrun --standalone --nproc_per_node=2 benchmarks/bench_sharded.py [--vocab N] --fsdp PRESET ROUNDS DIRECTORY

Builds the preset's model with GPT-2's vocabulary of 50,257 tokens (--vocab: another; gpt2:
163M parameters, as the output layer is not tied to the embedding) and AdamW
after one step (both moments populated: a 1.96 GB state), then saves it twice
per mode (a first save, and a later one after the state changed in place),
each mode in a fresh process, the modes alternating over the rounds:

  file-buffered   the single-file save as it was before issue 11: torch.save into
                  a BytesIO, then the bytes written to a temporary file, fsynced, renamed
  file-streamed   mingpt.snapshot.single_file.save: torch.save straight into the temporary file
  sharded-sync    mingpt.snapshot.sharded.save(async_save=False): DCP writes, then publication
  sharded-async   mingpt.snapshot.sharded.save(async_save=True): returns once the state is
                  copied; DCP writes and publishes in the background

For each it prints the stall of each save (from the call until training could
go on: the whole save, or for sharded-async until save returns; then also the
time until the snapshot was published) and the peak extra RAM of the process
over both saves (its VmHWM, reset just before the first, minus its VmRSS then),
with the medians over the rounds. One process, no process group: a world size of 1.
With --fsdp under torchrun, the sharded saves of the model sharded with FSDP2
over the ranks (each rank writes its shards), sync and async alternating.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from _cli import help_or_go_on

MODES = ("file-buffered", "file-streamed", "sharded-sync", "sharded-async")


def memory(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def buffered_save(state: dict, path: str) -> None:
    """The single-file save before issue 11 (for comparison): the whole file built in memory first."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


VOCAB = 50257  # GPT-2's; --vocab sets another (the tests' smoke run: a tiny one)


def one(mode: str, preset: str, directory: str) -> dict:
    """Build the state, save it once with `mode`; the figures as a dict."""
    import torch
    from bench_snapshot import preset_with_moments
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from mingpt.snapshot import sharded, single_file

    config, model, optimizer = preset_with_moments(preset, vocab_size=VOCAB, grad=1e-3)
    meta = {
        "gpt_config": vars(config),
        "vocab": "x" * 65,
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 1,
    }
    if mode.startswith("file"):
        state = {
            "model_state": model.state_dict(),
            "optimizer_state": optimizer.state_dict(),
            **meta,
        }
    else:
        msd, osd = get_state_dict(model, optimizer)
        tensors = {"model": msd, "optim": osd}
    params = sum(p.numel() for p in model.parameters())
    rss = memory("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    figures: dict = {"mode": mode, "params": params, "rss": rss, "stall": [], "published": []}
    # the first save, and a later one (a step apart: the state changed in place)
    for step in (1, 2):
        if step == 2:
            with torch.no_grad():
                for tensor in [
                    *model.parameters(),
                    *(v for s in optimizer.state.values() for v in s.values()),
                ]:
                    tensor.add_(1e-3)
        start = time.perf_counter()
        if mode == "file-buffered":
            buffered_save(state, os.path.join(directory, "snapshot.pt"))
        elif mode == "file-streamed":
            single_file.save(state, os.path.join(directory, "snapshot.pt"))
        else:
            handle = sharded.save(
                tensors,
                {**meta, "step": step},
                os.path.join(directory, "sharded"),
                step,
                keep=1,
                async_save=mode == "sharded-async",
            )
        figures["stall"].append(time.perf_counter() - start)
        if mode == "sharded-async":
            handle.wait()
            figures["published"].append(time.perf_counter() - start)
    figures["extra_ram"] = memory("VmHWM") - rss
    figures["bytes"] = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files
    )
    return figures


def fsdp(preset: str, rounds: int, directory: str) -> None:
    """Under torchrun: the model sharded with FSDP2 over the ranks, sharded-sync and
    sharded-async saves alternating; rank 0 prints each save's stall (the slowest
    rank's: training goes on when all can) and each rank's peak extra RAM."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mingpt.config import GPTConfig
    from mingpt.model import GPT
    from mingpt.snapshot import sharded

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    conf = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "gpt_config"
    )
    shape = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(GPTConfig), OmegaConf.load(os.path.join(conf, f"{preset}.yaml"))
        )
    )
    config = GPTConfig(**{**vars(shape), "vocab_size": VOCAB, "block_size": 1024})
    model = GPT(config)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, optimizer)
    tensors = {"model": msd, "optim": osd}
    results: dict[str, list] = {"sync": [], "async": []}
    step = 0
    for r in range(rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            step += 1
            dist.barrier()
            rss = memory("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            start = time.perf_counter()
            handle = sharded.save(
                tensors, {"step": step}, directory, step, keep=1, async_save=mode == "async"
            )
            stall = time.perf_counter() - start
            handle.wait()
            published = time.perf_counter() - start
            figures = [None] * world
            dist.all_gather_object(figures, (stall, published, memory("VmHWM") - rss))
            results[mode].append(figures)
            if rank == 0:
                print(
                    f"round {r + 1} {mode:>5}: stall {max(f[0] for f in figures):6.2f} s (slowest rank), "
                    f"published after {max(f[1] for f in figures):6.2f} s, extra RAM per rank "
                    + " ".join(f"{f[2] / 1e9:.2f}" for f in figures)
                    + " GB",
                    flush=True,
                )
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"\n{preset}: {params / 1e6:.0f}M parameters over {world} FSDP2 ranks; medians of {rounds}:"
        )
        for mode, rows in results.items():
            stalls = [max(f[0] for f in row) for row in rows]
            print(
                f"{mode:>5}: stall first {stalls[0]:.2f} s, later median {statistics.median(stalls[1:] or stalls):.2f} s, "
                f"published after median {statistics.median(max(f[1] for f in row) for row in rows):.2f} s"
            )
    dist.destroy_process_group()


def main() -> None:
    global VOCAB
    help_or_go_on(__doc__)
    if "--vocab" in sys.argv:
        at = sys.argv.index("--vocab")
        VOCAB = int(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(*sys.argv[2:5])))
        return
    if sys.argv[1:2] == ["--fsdp"]:  # under torchrun
        fsdp(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    preset = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    base = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        # alternate the order: drifting load hits all alike
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            directory = os.path.join(base, f"{mode}-{r}")
            os.makedirs(directory)
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--vocab",
                    str(VOCAB),
                    "--one",
                    mode,
                    preset,
                    directory,
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(result)
            shutil.rmtree(directory)
            stalls = " then ".join(f"{t:5.2f}" for t in result["stall"])
            published = " then ".join(f"{t:5.2f}" for t in result["published"])
            print(
                f"round {r + 1} {mode:>14}: stall {stalls} s"
                + (f", published after {published} s" if published else "")
                + f", extra RAM {result['extra_ram'] / 1e9:5.2f} GB, {result['bytes'] / 1e9:.2f} GB on disk",
                flush=True,
            )
    first = results[MODES[0]][0]
    print(
        f"\n{preset}: {first['params'] / 1e6:.0f}M parameters, model + AdamW state in RAM before the save "
        f"{first['rss'] / 1e9:.2f} GB (process RSS); medians of {rounds}, first save / later save:"
    )

    def median(mode: str, key: str, i: int) -> float:
        return statistics.median(r[key][i] for r in results[mode])

    for mode in MODES:
        extra = statistics.median(r["extra_ram"] for r in results[mode])
        line = (
            f"{mode:>14}: stall {median(mode, 'stall', 0):6.2f} / {median(mode, 'stall', 1):6.2f} s, "
            f"extra RAM {extra / 1e9:5.2f} GB"
        )
        if mode == "sharded-async":
            line += (
                f", published after {median(mode, 'published', 0):.2f} / {median(mode, 'published', 1):.2f} s; "
                f"stall {median(mode, 'stall', 0) / median('sharded-sync', 'stall', 0):.1%} / "
                f"{median(mode, 'stall', 1) / median('sharded-sync', 'stall', 1):.1%} of sharded-sync's"
            )
        print(line)
    if len(sys.argv) <= 3:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
