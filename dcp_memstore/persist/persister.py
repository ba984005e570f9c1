"""The background persister: one thread per process and store that uploads owed checkpoints.

Rule for a backlog: owed checkpoints are uploaded oldest first, one checkpoint at a time per process, and
none is skipped; each stays in memory (a retention hold) until it is published. If uploads fall behind
saves, memory fills and the next save fails with an error that says so (or waits, see
``MemStore(persist_backlog=...)``): nothing owed is ever dropped.

Work is split by file: each rank uploads the files it wrote (with a different number of processes after
a restart, local rank r takes the files of ranks r, r + L, ...), each file on its own thread of the pool. Rank 0 publishes once
every file has a part record. Errors: a missing bucket, refused credentials or a broken manifest stop the
checkpoint's uploads with state "failed" (logged; ``store.persist(id)`` or a restart retries it); anything else (the
server down, timeouts) is retried with exponential backoff, state "retrying".
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch.distributed as dist

from dcp_memstore.persist.export import upload_file
from dcp_memstore.persist.framing import disable_torch_save_crc32
from dcp_memstore.persist.progress import Progress
from dcp_memstore.persist.publish import publish, read_parts, remote_commit, write_part
from dcp_memstore.persist.target import PersistTarget
from dcp_memstore.store import catalog
from dcp_memstore.store.faults import crash_point
from dcp_memstore.store.layout import MANIFEST, StoreLayout, file_rank
from dcp_memstore.store.manifest import Manifest
from dcp_memstore.store.threads import run_parallel

log = logging.getLogger(__name__)

POLL_S = 0.2
PUBLISH_POLL_S = 0.5  # how often rank 0 looks for other nodes' part records
REMOTE_POLL_S = 5.0  # how often other ranks look for the published marker
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
_PERMANENT = (
    PermissionError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    ValueError,
    TypeError,
)


def local_rank_and_size() -> tuple[int, int]:
    """This process's rank among the processes of its node, and their number (torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE; else the process group, taken as one node; else 0 of 1)."""
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_rank() -> int:
    return (
        dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    )


class Persister:
    """Uploads the checkpoints of ``layout`` that are owed to ``target`` (see module docstring)."""

    _registry: dict[tuple[str, str], Persister] = {}
    _registry_lock = threading.Lock()

    @classmethod
    def acquire(cls, layout: StoreLayout, target: PersistTarget, io_threads: int, keep: int) -> Persister:
        """The process's persister for this store and target, started on first use (reference counted)."""
        key = (str(layout.job_dir), target.url)
        with cls._registry_lock:
            p = cls._registry.get(key)
            if p is None:
                p = cls._registry[key] = cls(layout, target, io_threads, keep)
            p._refs += 1
            return p

    def release(self) -> None:
        with self._registry_lock:
            self._refs -= 1
            if self._refs > 0:
                return
            self._registry.pop((str(self.layout.job_dir), self.target.url), None)
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def __init__(self, layout: StoreLayout, target: PersistTarget, io_threads: int, keep: int) -> None:
        self.layout, self.target, self.io_threads, self.keep = layout, target, io_threads, keep
        self._refs = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._retry_at: dict[str, tuple[float, float]] = {}  # checkpoint -> (next attempt, current backoff)
        self._check_at: dict[str, float] = {}  # checkpoint -> next look at the remote side
        self._thread = threading.Thread(target=self._run, name="dcp_memstore_persist", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look for owed checkpoints now instead of at the next poll."""
        self._wake.set()

    def _run(self) -> None:
        disable_torch_save_crc32()
        while not self._stop.is_set():
            for rec in catalog.committed(self.layout):
                if self._stop.is_set():
                    break
                try:
                    self._attempt(rec)
                except Exception:  # noqa: BLE001 - e.g. deleted under us; the thread must go on
                    log.exception("persister: checkpoint %r", rec.checkpoint_id)
            self._wake.wait(POLL_S)
            self._wake.clear()

    def _attempt(self, rec: catalog.CommitRecord) -> None:
        cid = rec.checkpoint_id
        progress = Progress(self.layout, cid)
        rank = global_rank()
        if not progress.owed() or progress.persisted():
            return
        if any(
            s.get("state") == "failed" and s.get("rank") == rank and s.get("pid") == os.getpid()
            for s in progress.states()
        ):
            return  # failed for good in this process: wait for store.persist(id) (or a restart)
        next_at, backoff = self._retry_at.get(cid, (0.0, BACKOFF_START_S))
        if time.monotonic() < next_at:
            return
        try:
            self._advance(rec, progress, rank)
            self._retry_at.pop(cid, None)
        except _PERMANENT as e:
            log.error("persisting checkpoint %r to %s failed: %s", cid, self.target.url, e)
            progress.report(rank, "failed", _describe(e))
        except Exception as e:  # noqa: BLE001 - any other error is retried: the store may come back
            log.warning(
                "persisting checkpoint %r to %s: %s; retrying in %.1f s", cid, self.target.url, e, backoff
            )
            progress.report(rank, "retrying", _describe(e))
            self._retry_at[cid] = (time.monotonic() + backoff, min(backoff * 2, BACKOFF_MAX_S))

    def _advance(self, rec: catalog.CommitRecord, progress: Progress, rank: int) -> None:
        """Upload this process's share of ``rec``'s files; publish when all are there (rank 0)."""
        cid = rec.checkpoint_id
        local_dir = self.layout.checkpoint_dir(cid)
        manifest = Manifest.read(local_dir / MANIFEST)
        by_file: dict[str, list] = {}
        for i, it in enumerate(manifest.items):
            by_file.setdefault(it.location.file, []).append((i, it))
        local_rank, local_size = local_rank_and_size()
        done = progress.done_files()
        todo = [
            f for f in sorted(by_file) if (file_rank(f) or 0) % local_size == local_rank and f not in done
        ]
        if todo:
            progress.report(rank, "uploading")

            def one(file: str) -> None:
                placed = upload_file(self.target, cid, local_dir, file, by_file[file])
                again = catalog.read_commit(self.layout, cid)
                if again is None or again.seq != rec.seq:  # its files may have been reused meanwhile
                    raise ValueError(f"checkpoint {cid!r} was deleted from memory during its upload")
                write_part(self.target, cid, file, placed)
                progress.mark_done(file)
                crash_point("persist-upload", rank)

            run_parallel(one, todo, self.io_threads, pool="persist")
        if not progress.done_files() >= set(by_file):
            return  # other local ranks are still uploading theirs
        now = time.monotonic()
        if now < self._check_at.get(cid, 0.0):
            return
        self._check_at[cid] = now + (PUBLISH_POLL_S if rank == 0 else REMOTE_POLL_S)
        if remote_commit(self.target, cid) is None:
            if rank != 0:
                return  # rank 0 publishes
            parts = read_parts(self.target, cid)
            if not set(by_file) <= set(parts):
                return
            publish(
                self.target, manifest, rec, parts, before_marker=lambda: crash_point("persist-publish", rank)
            )
            log.info("checkpoint %r persisted to %s", cid, self.target.url_of(cid))
        progress.mark_persisted()
        progress.report(rank, "persisted")
        self._check_at.pop(cid, None)
        catalog.evict(self.layout, self.keep)  # it may have been held past its turn


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
