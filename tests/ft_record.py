"""Test helper: main.py, recording what each rank trains on and what it saves.

    FT_RECORD_DIR=DIR [torchrun ...] python tests/ft_record.py [overrides ...]

Runs the real training CLI (mingpt.cli.main). Each rank appends one line per
optimizer step to DIR/PARALLELISM/samples-rank<r>.txt ("epoch step i i i ...": the
training samples of its share of the step) and one line per snapshot save it takes
part in to DIR/PARALLELISM/saves-rank<r>.txt (the step saved; best-saves-rank<r>.txt
for the best weights): a sweep over trainer_config.parallelism records each job apart.
Nothing else changes.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mingpt import trainer  # noqa: E402
from mingpt.cli import main  # noqa: E402
from mingpt.snapshot import sharded  # noqa: E402

RECORD_DIR = os.environ["FT_RECORD_DIR"]
RANK = int(os.environ.get("RANK", 0))


def _append(parallelism: str, name: str, line: str) -> None:
    directory = os.path.join(RECORD_DIR, parallelism)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{name}-rank{RANK}.txt"), "a", encoding="utf-8") as f:
        f.write(line + "\n")


_train_step = trainer.Trainer.train_step
_save = sharded.save


def recording_train_step(self, indices):
    _append(
        self.cfg.parallelism,
        "samples",
        f"{self.state.epoch} {self.state.step} " + " ".join(map(str, indices.tolist())),
    )
    return _train_step(self, indices)


def recording_save(tensors, meta, root, step, *args, **kwargs):
    # the best weights apart
    name = "saves"
    if root.rstrip("/").endswith("-best"):
        name = "best-saves"
    _append(meta["trainer_config"]["parallelism"], name, str(step))
    return _save(tensors, meta, root, step, *args, **kwargs)


trainer.Trainer.train_step = recording_train_step
# ShardedFormat's saves (the run's snapshots and its best weights) call it
sharded.save = recording_save

if __name__ == "__main__":
    main()
