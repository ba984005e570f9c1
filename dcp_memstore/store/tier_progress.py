"""Records of background work on one checkpoint (uploads, replicas), kept on tmpfs beside the checkpoint.

``<checkpoint>/<tier>/<group>/<f>``   file ``f`` is done for ``group`` (e.g. uploaded; sent to one node)
``<checkpoint>/<tier>/state-<key>``   the last state one process reported (working, retrying, failed)
``<checkpoint>/<tier>/<name>.lock``   flock held while one process works on ``name``

They survive the process (not the node): a restarted job finds what is already done, and every local
rank's ``store.status`` sees the same thing. The persister and the replicator each keep one tier.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

from dcp_memstore.store import liveness
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import read_record, write_record


class TierProgress:
    """Progress records of tier ``tier`` (a directory name) for checkpoint ``checkpoint_id``."""

    def __init__(self, layout: StoreLayout, checkpoint_id: str, tier: str) -> None:
        self.layout, self.checkpoint_id = layout, checkpoint_id
        self.dir = layout.checkpoint_dir(checkpoint_id) / tier

    def prepare(self) -> None:
        """Create the records directory (never the checkpoint's: a deleted checkpoint stays deleted)."""
        with contextlib.suppress(FileNotFoundError):
            self.dir.mkdir(exist_ok=True)

    def done_files(self, group: str = "done") -> set[str]:
        try:
            return {e.name for e in os.scandir(self.dir / group)}
        except FileNotFoundError:
            return set()

    def mark_done(self, file: str, group: str = "done") -> None:
        self.prepare()
        (self.dir / group).mkdir(exist_ok=True)
        write_record(self.dir / group / file, {"at": time.time()})

    def forget(self, files: Iterable[str], group: str = "done") -> None:
        """Record ``files`` as not done for ``group`` (their copy there was lost)."""
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / group / f).unlink()

    def report(self, key: str, state: str, error: str | None = None, **extra: object) -> None:
        """Record the state of this process's work (``key``: which process and, if needed, which peer),
        with the process's liveness token (``lock``), by which ``states`` and ``mine`` know it."""
        self.prepare()
        record = {"pid": os.getpid(), "lock": liveness.own_token(self.layout), "state": state}
        write_record(self.dir / f"state-{key}", {**record, "error": error, "at": time.time(), **extra})

    def states(self) -> list[dict]:
        """The states reported by processes that are still running (a dead process's state is stale),
        judged by their liveness lock: a pid is another process's after a restart in a new PID namespace
        (a container's processes get the same pids again). A record without a lock (an earlier
        version's) by its pid."""
        out = []
        for r in self.state_files():
            with contextlib.suppress(FileNotFoundError, ValueError):
                rec = read_record(r)
                if not isinstance(rec, dict):
                    continue
                lock = rec.get("lock")
                if liveness.alive(self.layout, lock) if liveness.is_token(lock) else _pid_alive(rec):
                    out.append(rec)
        return out

    def mine(self, state: dict) -> bool:
        """Whether ``state`` (one of ``states``) was reported by this process."""
        return state.get("lock") == liveness.own_token(self.layout)

    def state_files(self) -> list[Path]:
        try:
            return [Path(e.path) for e in os.scandir(self.dir) if e.name.startswith("state-")]
        except FileNotFoundError:
            return []

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[bool]:
        """Try to become the one process working on ``name``; yields whether this process got it. The lock
        goes with the process, so a killed worker frees it."""
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


def _pid_alive(record: dict) -> bool:
    try:
        return psutil.pid_exists(int(record.get("pid", -1)))
    except (TypeError, ValueError):
        return False
