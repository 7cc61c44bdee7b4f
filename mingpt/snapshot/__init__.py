"""Snapshots: the state a run resumes from, and what generation reads.

manager.py is the run's snapshot (the format chosen once), single_file.py the
`ddp` format, sharded.py the `fsdp` one, fit.py whether a snapshot fits this
run. Storage itself (fsspec, atomic writes, hashing) is mingpt/storage.py.
"""


class SnapshotError(ValueError):
    """A snapshot cannot be read or does not fit this run; the message names the file."""
