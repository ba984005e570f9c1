"""Exceptions raised by dcp_memstore.

Each one says what went wrong and what to do about it; they subclass the built-in type a caller would
catch anyway (ValueError, FileNotFoundError, OSError, ...) so generic handlers keep working. Each one
pickles: DCP sends a rank's exception to the others by pickling it.
"""

from __future__ import annotations


class InsufficientSpaceError(OSError):
    """The node-local store has too little free memory for a checkpoint; raised before anything is written."""

    def __init__(self, root: str, needed: int, free: int, detail: str = "") -> None:
        self.root, self.needed, self.free, self.detail = root, needed, free, detail
        msg = (
            f"not enough space in {root} for this checkpoint: {needed} bytes needed, {free} bytes free"
            f"{' (' + detail + ')' if detail else ''}. Lower keep_in_memory, give the tmpfs more room "
            "(mount -o remount,size=...), or free memory; the newest keep_in_memory checkpoints are "
            "untouched."
        )
        super().__init__(28, msg)  # 28 == ENOSPC

    def __str__(self) -> str:  # OSError's default prefixes "[Errno 28]", which hides the message's start
        return self.strerror

    def __reduce__(self) -> tuple:
        return type(self), (self.root, self.needed, self.free, self.detail)


class CorruptShardError(RuntimeError):
    """A stored copy of one of a checkpoint's data files is damaged (subclasses say how). The reader reads
    that file from another copy where there is one: another node's memory, the persisted copy."""


class ChecksumMismatchError(CorruptShardError):
    """Stored bytes do not match the checksum recorded when they were written."""

    def __init__(self, path: str, item: str, expected: int, actual: int) -> None:
        self.path, self.item, self.expected, self.actual = path, item, expected, actual
        super().__init__(
            f"checksum mismatch in {path} for item {item}: expected xxh3_64 {expected:#018x}, "
            f"got {actual:#018x}. The stored copy is corrupt; load another checkpoint "
            f"(store.list_checkpoints()) or turn verification off with MemStore(verify_checksums=False) "
            f"only if you accept corrupt data."
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.item, self.expected, self.actual)


class TruncatedShardError(CorruptShardError):
    """A data file is shorter than the checkpoint's manifest says: it was truncated or emptied."""

    def __init__(self, path: str, item: str, size: int, needed: int) -> None:
        self.path, self.item, self.size, self.needed = path, item, size, needed
        super().__init__(
            f"{path} is only {size} bytes long, where item {item} needs {needed}: the stored copy is "
            f"truncated. Load another checkpoint (store.list_checkpoints())."
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.item, self.size, self.needed)


class CheckpointExistsError(FileExistsError):
    """A committed checkpoint with this id already exists in the store."""


class CheckpointInUseError(RuntimeError):
    """A checkpoint cannot be deleted now: a load is reading it."""


class NodesUnansweredError(FileNotFoundError):
    """No node of the job that answered holds the checkpoint in memory, but some did not answer (down, hung
    or cut off), and one of them may. A FileNotFoundError, like the error where every node answered. The
    waits ask again, and raise it once the nodes have not answered for ``replication_timeout_s`` (or
    TimeoutError once their own timeout ends)."""


class StagingTimeoutError(TimeoutError):
    """A new save waited too long for an earlier one to finish its writes."""


class PersistError(RuntimeError):
    """A checkpoint could not be uploaded to persistent storage (bad credentials, missing bucket, ...)."""


class CommitError(RuntimeError):
    """The coordinator could not commit a checkpoint on every node; the save failed and the previous
    checkpoint stays the newest."""
