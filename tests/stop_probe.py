"""Test helper: main.py that pauses at one moment of the run until a signal comes.

    STOP_PROBE=MOMENT STOP_PROBE_FILE=PATH [torchrun ...] python tests/stop_probe.py [overrides ...]

MOMENT is one of
    import  after the signal handler is installed, before mingpt.cli is imported
    init    joining the process group (no wait here: a run of WORLD_SIZE=2 without
            a second process waits in torch's C++ code for the peer)
    load    while loading the corpus (start-up)
    eval    at the start of the first evaluation
    save    at the start of the first snapshot write
    sample  before the final sample is printed
On reaching it, the probe creates PATH (so a test knows when to send the signal)
and waits until a stop is requested, for at most 10 minutes; then the run goes
on as main.py would. With MOMENT `save-hang`, the first save then never ends: the
probe creates PATH.stopping and waits on (for a second Ctrl-C). Nothing else changes.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mingpt import stopping  # noqa: E402

MOMENT, _, HANG = os.environ["STOP_PROBE"].partition("-")
MARKER = os.environ["STOP_PROBE_FILE"]
stopping.install()


def pause(moment: str) -> None:
    if moment != MOMENT or os.environ.get("RANK", "0") != "0":
        return
    open(MARKER, "w").close()
    if moment == "init":
        return
    deadline = time.monotonic() + 600
    while not stopping.stop_requested() and time.monotonic() < deadline:
        time.sleep(0.01)  # outside the training loop, the signal ends the process here
    if HANG:
        open(MARKER + ".stopping", "w").close()
        while time.monotonic() < deadline:
            time.sleep(0.01)


def before(owner, name: str, moment: str) -> None:
    """Pause at `moment` each time owner.name is called, then call it."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        pause(moment)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


pause("import")

import torch.distributed  # noqa: E402

from mingpt import cli, train, trainer  # noqa: E402
from mingpt.snapshot import single_file  # noqa: E402

before(torch.distributed, "init_process_group", "init")

before(train, "load_data", "load")
before(trainer.Trainer, "evaluate", "eval")
before(single_file, "save", "save")
before(trainer.Trainer, "_print_sample", "sample")

if __name__ == "__main__":
    cli.main()
