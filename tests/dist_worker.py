"""Test-only worker: train through the library API and dump what each rank holds.

    [torchrun ...] python tests/dist_worker.py OUT_DIR JOBS_JSON

JOBS_JSON is a list of {"name": str, "overrides": [dotlist], "train": bool, "sample_first":
bool}: with sample_first, the job samples before anything else (a resumed run's sample due).
All jobs run one after the other in the same process group (one launch, many
checks). Job NAME writes OUT_DIR/NAME/rank<r>.pt with the rank's final weights,
and the held-out loss at the initial weights; rank 0's metrics.jsonl (and the
snapshot, if it trained) land in OUT_DIR/NAME/.

The process ends with os._exit once every result is written. Each DDP wrapper
keeps its gloo process group alive from C++ (a weak reference to the group
survives `del`, destroy_process_group() and gc.collect() once a DDP was built
on it), so after several jobs the interpreter's teardown runs beside several
leaked groups and their threads; once in CI that teardown aborted a rank
("terminate called without an active exception") after all its work was done. A group
destroyed under the GIL can also deadlock with its own threads (pytorch#56297;
test_comm_hooks.powersgd_under_fp16 met it).
A training run builds one DDP per process; this worker builds one per job.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mingpt.config import Config
from mingpt.distributed import distributed, setup_logging
from mingpt.run import build


def full_weights(trainer) -> dict:
    """The model's whole weights on every rank (gathered from the shards with FSDP)."""
    state = get_model_state_dict(trainer.raw_model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def run_job(
    dist_info, out_dir: str, name: str, overrides: list[str], train: bool, sample_first: bool
) -> None:
    config: Config = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(overrides))
    )
    run_dir = os.path.join(out_dir, name)
    trainer = build(config, dist_info, run_dir)
    if sample_first:
        trainer.sample()
    result = {"init": full_weights(trainer), "eval_init": trainer.evaluate()}
    if train:
        trainer.train()  # evaluates at the end and closes the metrics
    else:
        trainer.metrics.close()
    result["state"] = full_weights(trainer)
    os.makedirs(run_dir, exist_ok=True)
    torch.save(result, os.path.join(run_dir, f"rank{dist_info.rank}.pt"))


def main() -> None:
    out_dir, jobs = sys.argv[1], json.loads(sys.argv[2])
    with distributed("cpu") as dist_info:
        setup_logging(dist_info.rank)
        for job in jobs:
            run_job(
                dist_info,
                out_dir,
                job["name"],
                job["overrides"],
                job.get("train", True),
                job.get("sample_first", False),
            )


if __name__ == "__main__":
    main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
