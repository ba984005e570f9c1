"""The background persister: one thread per process and store that uploads owed checkpoints.

Rule for a backlog: owed checkpoints are uploaded oldest first, one checkpoint at a time per process, and
none is skipped; each stays in memory (a retention hold) until it is published. If uploads fall behind
saves, memory fills and the next save fails with an error that says so (or waits, see
``MemStore(persist_backlog=...)``): nothing owed is ever dropped.

Work is split by file: each node uploads the files its ranks wrote (the only ones in its tmpfs), each rank
the files it wrote (with a different number of processes after a restart, local rank r takes the files of
ranks r, r + L, ...), at most ``io_threads`` files at a time. A per-file lock on tmpfs keeps two processes
from uploading the same file. Once every file of every node has its part record, whichever local process
takes the publish lock publishes (publication is idempotent).

Errors: a missing bucket, refused or missing credentials, an id already published by another save or a
broken manifest stop the checkpoint's uploads with state "failed" (logged; ``store.persist(id)`` or a
restart retries it); anything else (the server down, timeouts) is retried with exponential backoff,
state "retrying" until an attempt succeeds, which reports "uploading" again (also one that only finds
other nodes' files not uploaded yet).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist

from dcp_memstore.persist.dropped import forget_lock, remove_partial, writing_into
from dcp_memstore.persist.export import upload_file
from dcp_memstore.persist.open_uploads import OpenUploads
from dcp_memstore.persist.progress import Progress, is_owed
from dcp_memstore.persist.publish import publish, read_parts, remote_commit, write_part
from dcp_memstore.persist.target import PersistTarget, describe, is_permanent
from dcp_memstore.store import catalog, events
from dcp_memstore.store.collective import dist_active
from dcp_memstore.store.environment import LOCAL_RANK_MEANING, LOCAL_WORLD_SIZE_MEANING, env_int
from dcp_memstore.store.faults import crash_point
from dcp_memstore.store.layout import MANIFEST, StoreLayout, file_rank
from dcp_memstore.store.manifest import Manifest
from dcp_memstore.store.threads import run_parallel, yield_cpu_to_training

log = logging.getLogger(__name__)

POLL_S = 0.2
PUBLISH_POLL_S = 0.5  # how often a node whose files are all uploaded looks for other nodes' part records
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0


def local_rank_and_size() -> tuple[int, int]:
    """This process's rank among the processes of its node, and their number (torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE; else the process group, taken as one node; else 0 of 1)."""
    local_rank = env_int("LOCAL_RANK", None, LOCAL_RANK_MEANING)
    local_size = env_int("LOCAL_WORLD_SIZE", None, LOCAL_WORLD_SIZE_MEANING)
    if local_rank is not None and local_size is not None:
        return local_rank, local_size
    if dist_active():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def node_share(local_dir: Path, files: Iterable[str]) -> set[str]:
    """The files of a checkpoint (``files``, those its manifest lists) that this node uploads: those of the
    ranks that have a file in ``local_dir``. In a job of several nodes each node holds only the files its
    own ranks wrote; a missing file of such a rank stays in the share, so that its upload fails saying so."""
    here = catalog.ranks_with_files(local_dir)
    return {f for f in files if file_rank(f) in here}


def global_rank() -> int:
    """This process's rank (the process group's, else torchrun's RANK, else 0): labels its reports."""
    return dist.get_rank() if dist_active() else int(os.environ.get("RANK", 0))


class Persister:
    """Uploads the checkpoints of ``layout`` that are owed to ``target`` (see module docstring)."""

    _registry: dict[tuple[int, str, str], Persister] = {}  # (pid, job directory, target URL)
    _registry_lock = threading.Lock()

    @classmethod
    def acquire(cls, layout: StoreLayout, target: PersistTarget, io_threads: int, keep: int) -> Persister:
        """The process's persister for this store and target, started on first use (reference counted)."""
        key = (os.getpid(), str(layout.job_dir), target.url)  # a forked child starts its own
        with cls._registry_lock:
            p = cls._registry.get(key)
            if p is None:
                p = cls._registry[key] = cls(layout, target, io_threads, keep)
            p._refs += 1
            return p

    def release(self, timeout: float | None = None) -> None:
        """Drop one reference; the last stops the thread, waiting up to ``timeout`` seconds for the file
        it is uploading (an unfinished upload is redone when the job starts again)."""
        with self._registry_lock:
            self._refs -= 1
            if self._refs > 0:
                return
            self._registry.pop((os.getpid(), str(self.layout.job_dir), self.target.url), None)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "persister still uploading to %s at close; it stops with the process", self.target.url
            )
        if self._dropped:
            log.warning(
                "closing before what the uploads of deleted checkpoints %s left in %s was removed: it "
                "stays there (never listed nor loaded); remove those directories by hand",
                sorted(self._dropped),
                self.target.url,
            )

    def __init__(self, layout: StoreLayout, target: PersistTarget, io_threads: int, keep: int) -> None:
        self.layout, self.target, self.io_threads, self.keep = layout, target, io_threads, keep
        self._refs = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._retry_at: dict[str, tuple[float, float]] = {}  # checkpoint -> (next attempt, current backoff)
        self._check_at: dict[str, float] = {}  # checkpoint -> next look at the remote side
        self._checked: set[tuple] = set()  # saves whose id was checked against the remote side
        self._manifests: dict[tuple, Manifest] = {}  # manifests of saves being uploaded
        self._uploads = OpenUploads(layout, target)
        self._dropped: dict[str, tuple[float, float]] = {}  # deleted unpublished -> (next try, backoff)
        self._dropped_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dcp_memstore_persist", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look for owed checkpoints now instead of at the next poll."""
        self._wake.set()

    def drop(self, checkpoint_id: str) -> None:
        """``checkpoint_id`` was deleted from memory before it was published, in a job on one node: remove
        what its upload left in the target, in the background, once no process of this node writes into
        it (``dropped.remove_partial``)."""
        with self._dropped_lock:
            self._dropped.setdefault(checkpoint_id, (0.0, BACKOFF_START_S))
        self.wake()

    def _remove_dropped(self) -> None:
        """Remove the partial directories of the checkpoints ``drop`` was told of, as far as they are free
        of writers now; one the target does not let remove is tried again later, with backoff."""
        now = time.monotonic()
        with self._dropped_lock:
            due = [cid for cid, (at, _) in self._dropped.items() if at <= now]
        for cid in due:
            try:
                removed = remove_partial(self.layout, self.target, cid)
            except Exception as e:  # noqa: BLE001 - e.g. the target unreachable: tried again
                with self._dropped_lock:
                    backoff = self._dropped[cid][1]
                    self._dropped[cid] = (now + backoff, min(backoff * 2, BACKOFF_MAX_S))
                log.warning(
                    "checkpoint %r, deleted before it was published: cannot remove what its upload left "
                    "in %s (%s); retrying in %.1f s",
                    cid, self.target.url_of(cid), describe(e), backoff,
                )  # fmt: skip
                continue
            if removed is None:
                continue  # a process of this node is still writing into it
            with self._dropped_lock:
                self._dropped.pop(cid, None)
            if removed:
                log.info(
                    "checkpoint %r was deleted before it was published: removed what its upload left in %s",
                    cid,
                    self.target.url_of(cid),
                )
                self._abort_orphans()  # those of processes of this node killed while uploading it

    def _run(self) -> None:
        yield_cpu_to_training()
        self._abort_orphans()  # those of this node's processes that were killed (a restarted job)
        while not self._stop.is_set():
            self._remove_dropped()
            pending: set[tuple] = set()
            for rec in catalog.committed(self.layout):
                if self._stop.is_set():
                    break
                try:
                    if self._attempt(rec):
                        pending.add(_save_key(rec))
                except Exception:  # noqa: BLE001 - e.g. deleted under us; the thread must go on
                    pending.add(_save_key(rec))
                    log.exception("persister: checkpoint %r", rec.checkpoint_id)
            else:
                self._forget_all_but(pending)
            self._wake.wait(POLL_S)
            self._wake.clear()
        self._remove_dropped()  # a checkpoint deleted right before the store was closed

    def _forget_all_but(self, pending: set[tuple]) -> None:
        """Keep what this process remembers (manifests, checks, retry times) only for saves it still has to
        upload: a save published by another local process, failed for good, evicted or deleted is forgotten,
        so a long job's persister holds no more than its backlog."""
        ids = {save[0] for save in pending}
        self._manifests = {save: m for save, m in self._manifests.items() if save in pending}
        self._checked &= pending
        self._retry_at = {cid: v for cid, v in self._retry_at.items() if cid in ids}
        self._check_at = {cid: v for cid, v in self._check_at.items() if cid in ids}

    def _attempt(self, rec: catalog.CommitRecord) -> bool:
        """Advance ``rec``'s upload if it is owed;
        whether it is still owed and this process may go on with it."""
        cid = rec.checkpoint_id
        progress = Progress(self.layout, cid, self.target.url)
        if not progress.owed():
            return False
        if progress.persisted():  # a hold placed while it was being published
            progress.mark_persisted()
            return False
        rank = global_rank()
        if any(s.get("state") == "failed" and progress.mine(s) for s in progress.states()):
            return False  # failed for good in this process: wait for store.persist(id) (or a restart)
        next_at, backoff = self._retry_at.get(cid, (0.0, BACKOFF_START_S))
        if time.monotonic() < next_at:
            return True
        started = time.time()  # a failure of this attempt is stale if failures are cleared meanwhile
        try:
            self._advance(rec, progress, rank)
            if self._retry_at.pop(cid, None) is not None and not progress.persisted():
                progress.report(rank, "uploading")  # the error is gone (it may only wait for other nodes)
        except Exception as e:  # noqa: BLE001 - classified: permanent errors stop, others are retried
            if not self._current(rec):  # the records under its id are another save's now, or gone
                log.info("persisting checkpoint %r stopped: %s", cid, e)
                return False
            failed = functools.partial(
                events.emit, self.layout, "persist", cid, rank, time.time() - started,
                target=self.target.url_of(cid), ok=False, error=describe(e),
            )  # fmt: skip
            # the event first: a wait_persisted that the reported state ends has seen it
            if is_permanent(e):
                log.error("persisting checkpoint %r to %s failed: %s", cid, self.target.url, e)
                failed(retry_s=None)
                progress.report(rank, "failed", describe(e), since=started)
                return False
            log.warning(
                "persisting checkpoint %r to %s: %s; retrying in %.1f s", cid, self.target.url, e, backoff
            )
            failed(retry_s=backoff)
            progress.report(rank, "retrying", describe(e))
            self._retry_at[cid] = (time.monotonic() + backoff, min(backoff * 2, BACKOFF_MAX_S))
        return progress.owed() and not progress.persisted()

    def _advance(self, rec: catalog.CommitRecord, progress: Progress, rank: int) -> None:
        """Upload this process's share of ``rec``'s files; publish once every file is uploaded."""
        cid = rec.checkpoint_id
        progress.prepare()
        save = _save_key(rec)
        if save not in self._checked:  # once per process and save: is the id already taken remotely?
            self._settle_if_published(rec, progress)
            self._checked.add(save)
            if progress.persisted():
                return
        local_dir = self.layout.checkpoint_dir(cid)
        manifest = self._manifests.get(save)
        if manifest is None:  # read once per save, not at every poll while other processes upload
            manifest = Manifest.read(local_dir / MANIFEST)
            self._require_current(rec)  # it is this save's manifest, not one of a save since
            self._manifests[save] = manifest
        by_file: dict[str, list] = {}
        for i, it in enumerate(manifest.items):
            by_file.setdefault(it.location.file, []).append((i, it))
        share = node_share(local_dir, by_file)
        local_rank, local_size = local_rank_and_size()
        done = progress.done_files()
        todo = [f for f in sorted(share) if (file_rank(f) or 0) % local_size == local_rank and f not in done]
        missing = [f for f in todo if not (local_dir / f).exists()]
        if missing:  # before any upload: a restart taking them over clears the failure
            raise FileNotFoundError(
                f"checkpoint {cid!r}: files {missing} of this node's ranks are not in {local_dir}"
            )
        if todo:
            progress.report(rank, "uploading")
            start = time.perf_counter()
            uploaded = run_parallel(
                lambda f: self._upload(rec, progress, local_dir, f, by_file[f], rank),
                todo,
                self.io_threads,
                pool="persist",
            )
            if sum(uploaded):
                events.emit(
                    self.layout, "upload", cid, rank, time.perf_counter() - start,
                    nbytes=sum(uploaded), target=self.target.url_of(cid),
                )  # fmt: skip
        if not progress.done_files() >= share:
            return  # other local processes are still uploading theirs
        now = time.monotonic()
        if now < self._check_at.get(cid, 0.0):
            return
        self._check_at[cid] = now + PUBLISH_POLL_S
        with progress.exclusive("publish") as mine, writing_into(self.layout, self.target, cid):
            if not mine or progress.persisted():
                return  # another local process is publishing
            if remote_commit(self.target, cid) is None:
                if not self._publish(rec, progress, manifest, share, rank):
                    return
            else:
                self._settle_if_published(rec, progress)
            self._require_current(rec)
            self._clear_leftovers(cid)
            # the event before the mark, as for failures: a wait_persisted that the mark ends has seen it
            events.emit(
                self.layout, "persist", cid, rank, time.time() - rec.committed_at,
                nbytes=rec.nbytes, target=self.target.url_of(cid), owed=self._still_owed(but=cid),
            )  # fmt: skip
            progress.mark_persisted()
        progress.report(rank, "persisted")
        forget_lock(self.layout, self.target, cid)
        catalog.evict(self.layout, self.keep)  # it may have been held past its turn

    def _publish(
        self, rec: catalog.CommitRecord, progress: Progress, manifest: Manifest, share: set[str], rank: int
    ) -> bool:
        """Publish ``rec`` once every file of every node has its part record; whether it did. Files of
        this node (``share``) recorded as uploaded whose part records are gone from the target (removed
        there since) are forgotten, so the next round uploads them again instead of waiting for good."""
        cid = rec.checkpoint_id
        parts = read_parts(self.target, rec)
        self._require_current(rec)  # the records below and publication are this save's
        lost = share - set(parts)
        if lost:
            log.warning(
                "checkpoint %r: %s no longer in %s; uploading again", cid, sorted(lost), self.target.url
            )
            progress.forget(lost)
        if not set(manifest.files) <= set(parts):
            return False  # files of other nodes are not uploaded yet
        publish(self.target, manifest, rec, parts, before_marker=lambda: crash_point("persist-publish", rank))
        return True

    def _clear_leftovers(self, cid: str) -> None:
        """``cid`` is published: every file of it is in place, so the temporary files of uploads killed
        while writing into its directory are leftovers (``PersistTarget.clear_leftovers``); removed, and
        logged. A failure is logged: it leaves them, and the checkpoint is persisted all the same. Also
        aborts the multipart uploads of this node's processes killed meanwhile (``_abort_orphans``)."""
        self._abort_orphans()
        try:
            removed = self.target.clear_leftovers(cid)
        except OSError as e:
            log.warning(
                "checkpoint %r: cannot remove what killed uploads left in %s: %s", cid, self.target.url, e
            )
            return
        if removed:
            log.info("checkpoint %r: removed what killed uploads left in the target: %s", cid, removed)

    def _abort_orphans(self) -> None:
        """Abort the multipart uploads that this node's killed processes left open (and those whose abort
        failed), and log them (``OpenUploads.abort_orphans``: never a live process's upload). Never
        raises: uploads go on whatever this clean-up meets (tmpfs records it cannot read)."""
        try:
            aborted = self._uploads.abort_orphans()
        except Exception:  # noqa: BLE001 - a clean-up; the next start or publication tries again
            log.exception("cannot abort the multipart uploads that killed uploads left open")
            return
        if aborted:
            log.info("aborted the multipart uploads that killed uploads left open in the target: %s", aborted)

    def _upload(
        self, rec: catalog.CommitRecord, progress: Progress, local_dir, file: str, items, rank: int
    ) -> int:
        """Upload one file, unless another process is uploading it or already has; the bytes uploaded."""
        yield_cpu_to_training()
        with progress.exclusive(file) as mine:
            if not mine or file in progress.done_files():
                return 0
            written = functools.partial(crash_point, "persist-write", rank)
            with writing_into(self.layout, self.target, rec.checkpoint_id):
                self._require_current(rec)  # not deleted (its directory removed) while this waited
                self._published_save(rec)  # not published meanwhile by another save: its files stay its own
                placed = upload_file(
                    self.target, rec.checkpoint_id, local_dir, file, items, written, self._uploads
                )
                self._require_current(rec)  # its files may have been reused meanwhile
                write_part(self.target, rec, file, placed)
            progress.mark_done(file)
        crash_point("persist-upload", rank)
        return os.path.getsize(local_dir / file)

    def _still_owed(self, but: str) -> tuple[str, ...]:
        """The checkpoints in this node's memory other than ``but`` (just published) that are still owed
        to the target (for events)."""
        ids = (r.checkpoint_id for r in catalog.committed(self.layout) if r.checkpoint_id != but)
        return tuple(cid for cid in ids if is_owed(self.layout, cid, self.target.url))

    def _settle_if_published(self, rec: catalog.CommitRecord, progress: Progress) -> None:
        """If ``rec``'s id is already published by this save, mark it persisted (``_published_save``)."""
        if self._published_save(rec):
            self._require_current(rec)
            progress.mark_persisted()

    def _published_save(self, rec: catalog.CommitRecord) -> bool:
        """Whether ``rec``'s id is published in the target by this save. Published by another save under
        the same id (another job sharing the prefix): ValueError, permanent, since uploading on would
        overwrite that checkpoint's files. Asked before the upload and before each file: the other save
        may publish while this one uploads (the files of one that publishes during a file's upload can
        still be overwritten by that file)."""
        remote = remote_commit(self.target, rec.checkpoint_id)
        if remote is not None and remote != rec:
            raise ValueError(
                f"{self.target.url_of(rec.checkpoint_id)} already holds another checkpoint "
                "saved under the id "
                f"{rec.checkpoint_id!r}; delete it there, or save under a new id"
            )
        return remote is not None

    def _current(self, rec: catalog.CommitRecord) -> bool:
        """``catalog.same_save``, with a corrupt commit marker counted as another save's."""
        try:
            return catalog.same_save(self.layout, rec)
        except ValueError:  # a corrupt commit marker: not this save's
            return False

    def _require_current(self, rec: catalog.CommitRecord) -> None:
        """Raise unless ``rec`` is still its checkpoint's save (``_current``): the upload records, which
        are kept by checkpoint id, and what is read from its directory would be another save's. Checked
        after every step that can wait (on the target) and before each record is written."""
        if not self._current(rec):
            raise ValueError(
                f"checkpoint {rec.checkpoint_id!r} was deleted from memory or saved again during its upload"
            )


def _save_key(rec: catalog.CommitRecord) -> tuple:
    """One save of a checkpoint id (an id saved again after a deletion is another save)."""
    return (rec.checkpoint_id, rec.seq, rec.committed_at)
