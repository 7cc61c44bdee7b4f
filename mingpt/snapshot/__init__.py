"""Snapshots: the state a run resumes from, and what generation reads (docs/layout.md says which
module does what)."""


class SnapshotError(ValueError):
    """A snapshot cannot be read or does not fit this run; the message names the file."""
