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
    generating  at the start of each sample (the first: the evaluation's at step 5);
            no wait here: the sample goes on, and the signal comes during it
With MOMENT `race`, loading the corpus creates PATH, waits for the signal's
exit_now to begin (it is held until the main thread parks or ends), then raises,
as a collective does when torchrun stops the workers beside a dead one.
On reaching it, the probe creates PATH (so a test knows when to send the signal)
and waits until a stop is requested, for at most 10 minutes; then the run goes
on as main.py would. With MOMENT `save-hang`, the first save then never ends: the
probe creates PATH.stopping and waits on (for a second Ctrl-C). Nothing else changes.
"""

from __future__ import annotations

import os
import sys
import threading
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
    if moment in ("init", "generating"):
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

from mingpt import checkpointer, cli, run, trainer  # noqa: E402

before(torch.distributed, "init_process_group", "init")

before(run, "load_data", "load")
before(trainer.Trainer, "evaluate", "eval")
before(checkpointer.Checkpointer, "_save", "save")  # the run's snapshot, not the best weights
before(trainer.Trainer, "sample_for_all", "sample")
before(trainer.Trainer, "sample", "generating")

if MOMENT == "race":
    exit_begun, parked = threading.Event(), threading.Event()
    real_exit, real_park = os._exit, stopping.park_if_exiting

    def held_exit(status: int) -> None:
        exit_begun.set()
        deadline = time.monotonic() + 600
        while (
            not parked.is_set()
            and threading.main_thread().is_alive()
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        real_exit(status)

    def park() -> None:
        parked.set()
        real_park()

    def failing_load(*args, **kwargs):
        open(MARKER, "w").close()
        exit_begun.wait(600)
        raise RuntimeError("Connection closed by peer")

    os._exit = held_exit
    stopping.park_if_exiting = park
    run.load_data = failing_load

if __name__ == "__main__":
    cli.main()
