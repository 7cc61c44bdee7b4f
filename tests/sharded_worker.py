"""Test-only worker for mingpt.snapshot.sharded: a tiny GPT sharded with FSDP2 on gloo.

    torchrun ... tests/sharded_worker.py save OUT ROOT
    torchrun ... tests/sharded_worker.py load OUT ROOT

`save` (2 ranks): trains a few steps and saves, synchronously and
asynchronously, into ROOT (keep=2), with an unpublished directory left by a
"crashed" save on each side of them; then saves into a location that cannot be
written; then loads ROOT as `load` does. Rank 0 writes OUT/save.json (what
happened) and OUT/reference.pt (the full state of the last published save).

`load` (any number of ranks): a fresh model and optimizer load ROOT's newest
snapshot the way the trainer does, and rank 0 writes OUT/load-<world size>.pt
with the full state they hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mingpt.config import GPTConfig
from mingpt.model import GPT
from mingpt.snapshot import manifest, sharded
from mingpt.storage import StorageError

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16)
VOCAB = "\n" + "".join(chr(c) for c in range(32, 96))  # 65 characters


def meta_at(step: int) -> dict:
    """What the trainer keeps beside the tensors (the single-file format's other fields)."""
    return {
        "gpt_config": dataclasses.asdict(CONFIG),
        "vocab": VOCAB,
        "epoch": 0,
        "samples_in_epoch": 8 * step,
        "step": step,
        "world_size": dist.get_world_size(),
    }


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    idx = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size), generator=g)
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model, optimizer) -> dict:
    """Every rank takes part; rank 0 gets the whole
    model and optimizer state as plain CPU tensors."""
    msd, osd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": msd, "optim": osd}


def save(out: str, root: str) -> None:
    rank = dist.get_rank()
    model, optimizer = build(seed=1)
    report: dict = {"published": []}
    if rank == 0:  # left by a save that crashed: one older than what follows, one newer
        for name in ("step-00000001-7", "step-00000099"):
            os.makedirs(os.path.join(root, name))
            with open(os.path.join(root, name, "__0_0.distcp"), "wb") as f:
                f.write(b"half a shard")
    dist.barrier()
    for step in range(1, 5):
        train_step(model, optimizer, step)
        if step == 4:
            reference = full_state(model, optimizer)
        msd, osd = get_state_dict(model, optimizer)
        handle = sharded.save(
            {"model": msd, "optim": osd}, meta_at(step), root, step, keep=2, async_save=step > 1
        )
        if step > 1:
            report.setdefault("done_at_return", []).append(handle.done())
            if step == 4:  # training goes on while the write runs: the save holds its own copy
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
            published = sharded.wait_pending()
        else:
            published = handle.result()
        report["published"].append(os.path.basename(published))
        report.setdefault("latest", []).append(os.path.basename(manifest.latest(root)))
    report["listing"] = sorted(os.listdir(root))
    save_blocked(model, optimizer, out, report)
    if rank == 0:
        torch.save(reference, os.path.join(out, "reference.pt"))
        with open(os.path.join(out, "save.json"), "w") as f:
            json.dump(report, f)
    load(out, root)  # and back into 2 ranks


def save_blocked(model, optimizer, out: str, report: dict) -> None:
    """A location that cannot be written (a file where the directory should be): the
    asynchronous save returns, and its error comes at the wait, on every rank."""
    rank = dist.get_rank()
    blocked = os.path.join(out, "blocked")
    if rank == 0:
        with open(blocked, "w") as f:
            f.write("not a directory")
    dist.barrier()
    msd, osd = get_state_dict(model, optimizer)
    sharded.save({"model": msd, "optim": osd}, meta_at(5), blocked, 5, keep=2, async_save=True)
    try:
        sharded.wait_pending()
        report[f"error{rank}"] = None
    except StorageError as e:
        report[f"error{rank}"] = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, report[f"error{rank}"])
    report["errors"] = errors
    report["pending_after"] = sharded.wait_pending()


def load(out: str, root: str) -> None:
    model, optimizer = build(seed=2)  # other initial weights, no optimizer state yet
    msd, osd = get_state_dict(model, optimizer)
    tensors = {"model": msd, "optim": osd}
    meta, _ = sharded.load(tensors, root)
    set_state_dict(
        model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"]
    )
    state = full_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(
            {"state": state, "meta": meta}, os.path.join(out, f"load-{dist.get_world_size()}.pt")
        )


def main() -> None:
    mode, out, root = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        {"save": save, "load": load}[mode](out, root)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
