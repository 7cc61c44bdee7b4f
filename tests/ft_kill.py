"""Test helper: main.py, except that in the first attempt of a torchrun job
(TORCHELASTIC_RESTART_COUNT=0) rank FT_KILL_RANK SIGKILLs itself as it starts
optimizer step FT_KILL_STEP + 1: a sudden death at a known step, after the last save is published
(on a GPU a step can be shorter than a background save's write).
With FT_KILL_ERROR=TEXT it raises a DataError of that text instead: an error of that rank alone;
with FT_KILL_ERROR=peer, gloo's error of a collective whose peer's process ended (on another node:
no signal of this node's torchrun follows, and the wait for one is cut to 0.1 s).
With FT_KILL_IN=NAME it dies instead in the next save, once the one in flight is published, as it
calls mingpt.snapshot.manifest's NAME: `shard_hashes` (every rank, its shards written, before rank
0 publishes) or `prune` (rank 0, once it has published).

    FT_KILL_RANK=1 FT_KILL_STEP=13 torchrun --max-restarts=1 ... tests/ft_kill.py [overrides ...]
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mingpt import stopping, trainer  # noqa: E402
from mingpt.cli import main  # noqa: E402
from mingpt.data import DataError  # noqa: E402
from mingpt.snapshot import manifest, sharded  # noqa: E402

_train_step = trainer.Trainer.train_step
_armed = False  # FT_KILL_IN: the step was reached; the next call of that function dies


def train_step_or_die(self, indices):
    global _armed
    if (
        os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        and self.dist.rank == int(os.environ["FT_KILL_RANK"])
        and self.state.step == int(os.environ["FT_KILL_STEP"])
    ):
        if os.environ.get("FT_KILL_ERROR") == "peer":
            stopping.PEER_ENDED_WAIT_S = 0.1
            raise RuntimeError("Read error [127.0.0.1]:1: Connection reset by peer")
        if "FT_KILL_ERROR" in os.environ:
            raise DataError(os.environ["FT_KILL_ERROR"])
        sharded.wait_pending()
        if "FT_KILL_IN" in os.environ:
            _armed = True
            return _train_step(self, indices)
        os.kill(os.getpid(), signal.SIGKILL)
    return _train_step(self, indices)


def dies_when_armed(function):
    def wrapper(*args, **kwargs):
        if _armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return function(*args, **kwargs)

    return wrapper


trainer.Trainer.train_step = train_step_or_die
if "FT_KILL_IN" in os.environ:
    name = os.environ["FT_KILL_IN"]
    setattr(manifest, name, dies_when_armed(getattr(manifest, name)))

if __name__ == "__main__":
    main()
