"""What the persister has done for one checkpoint, kept on tmpfs beside the checkpoint.

``<checkpoint>/holds/persist``      the checkpoint is owed to persistent storage (a retention hold)
``<checkpoint>/persist/done/<f>``   local file ``f`` is uploaded (its part record is in the bucket)
``<checkpoint>/persist/state-<r>``  the last state rank ``r``'s persister reported (uploading, retrying, failed)
``<checkpoint>/persist/PERSISTED``  published; the hold is gone
``<checkpoint>/persist/<f>.lock``   flock held while a process uploads ``f`` (or publishes: ``publish``)

These survive the process (not the node): a restarted job finds what it still owes and what is already
uploaded, and every local rank's ``store.status`` sees the same thing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from dcp_memstore.store import catalog
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import read_record, write_record

PERSIST_HOLD = "persist"


class Progress:
    """Upload progress records of checkpoint ``checkpoint_id`` in ``layout``."""

    def __init__(self, layout: StoreLayout, checkpoint_id: str) -> None:
        self.layout, self.checkpoint_id = layout, checkpoint_id
        self.dir = layout.checkpoint_dir(checkpoint_id) / "persist"

    def owed(self) -> bool:
        return PERSIST_HOLD in catalog.holds(self.layout, self.checkpoint_id)

    def prepare(self) -> None:
        """Create the progress directory (never the checkpoint's: a deleted checkpoint stays deleted)."""
        with contextlib.suppress(FileNotFoundError):
            self.dir.mkdir(exist_ok=True)

    def request(self, reason: str) -> None:
        """Owe this checkpoint to persistent storage (idempotent); clears a failure so uploads retry."""
        if self.persisted():
            return
        catalog.hold(self.layout, self.checkpoint_id, PERSIST_HOLD, {"reason": reason, "at": time.time()})
        if self.persisted():  # published meanwhile: the hold would never be released
            catalog.release(self.layout, self.checkpoint_id, PERSIST_HOLD)
        for r in self._state_files():
            with contextlib.suppress(FileNotFoundError):
                if (read_record(r) or {}).get("state") == "failed":
                    r.unlink()

    def done_files(self) -> set[str]:
        try:
            return {e.name for e in os.scandir(self.dir / "done")}
        except FileNotFoundError:
            return set()

    def mark_done(self, file: str) -> None:
        self.prepare()
        (self.dir / "done").mkdir(exist_ok=True)
        write_record(self.dir / "done" / file, {"at": time.time()})

    def report(self, rank: int, state: str, error: str | None = None) -> None:
        self.prepare()
        write_record(
            self.dir / f"state-{rank}",
            {"rank": rank, "pid": os.getpid(), "state": state, "error": error, "at": time.time()},
        )

    def states(self) -> list[dict]:
        """The states reported by processes that are still running (a dead process's state is stale)."""
        out = []
        for r in self._state_files():
            with contextlib.suppress(FileNotFoundError, ValueError):
                rec = read_record(r)
                if isinstance(rec, dict) and psutil.pid_exists(int(rec.get("pid", -1))):
                    out.append(rec)
        return out

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[bool]:
        """Try to become the one process working on ``name`` (a file, or "publish"); yields whether this
        process got it. The lock goes with the process, so a killed uploader frees it."""
        try:
            fd = os.open(self.dir / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # the checkpoint is gone
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def persisted(self) -> bool:
        return (self.dir / "PERSISTED").exists()

    def mark_persisted(self) -> None:
        """Published: record it and drop the retention hold."""
        self.prepare()
        write_record(self.dir / "PERSISTED", {"at": time.time()})
        catalog.release(self.layout, self.checkpoint_id, PERSIST_HOLD)

    def _state_files(self) -> list[Path]:
        try:
            return [Path(e.path) for e in os.scandir(self.dir) if e.name.startswith("state-")]
        except FileNotFoundError:
            return []
