"""Snapshots: the state a run resumes from, and what generation reads.

manager.py is the run's snapshot, sharded.py its format (Distributed Checkpoint,
for every parallelism), background.py the save in flight, single_file.py the one
file that export writes and the readers take, fit.py whether a snapshot fits this
run. Storage itself (fsspec, atomic writes, hashing) is mingpt/storage.py.
"""


class SnapshotError(ValueError):
    """A snapshot cannot be read or does not fit this run; the message names the file."""
