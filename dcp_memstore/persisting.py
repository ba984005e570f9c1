"""The persistence face of ``MemStore``: owing a checkpoint to persistent storage, its upload state,
waiting until it is persisted, and the persisted copy to read from.

A mixin of ``MemStore`` (it uses the store's layout, ``target``, persister and queries), kept apart so that
``memstore.py`` holds the node-local store, and what concerns persistent storage is here; the uploads
themselves run in ``persist/persister.py``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

from dcp_memstore.answer_deadline import (
    answer_by,
    answer_limit,
    optional_timeout,
    poll_pause,
    sooner,
    unanswered_since,
)
from dcp_memstore.errors import NodesUnansweredError, PersistError
from dcp_memstore.persist import target_users
from dcp_memstore.persist.bounded_calls import BoundedCalls
from dcp_memstore.persist.persister import global_rank, node_share
from dcp_memstore.persist.progress import PRESSING, Progress, is_persist_hold, target_key
from dcp_memstore.persist.publish import DamagedMarkerError, read_parts, remote_commit
from dcp_memstore.persist.remote_read import RemoteCheckpoint
from dcp_memstore.persist.target import COMMITTED, describe
from dcp_memstore.replication.cluster_read import ClusterCheckpoint
from dcp_memstore.replication.service import job_node_info
from dcp_memstore.status import CheckpointStatus
from dcp_memstore.store import catalog
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import MANIFEST
from dcp_memstore.store.manifest import Manifest

log = logging.getLogger("dcp_memstore.memstore")
_REMOTE_READS = BoundedCalls()  # looks at a commit marker under a deadline, one at a time per checkpoint
PERSIST_LOOK_S = 5.0  # how long persist() waits for the target to say whether a checkpoint is there
os.register_at_fork(after_in_child=_REMOTE_READS.forget)


def _unread_state(url: str, unread: Exception) -> tuple[str, str]:
    """The upload state, and its error, of a checkpoint recorded as persisted whose commit marker could not
    be read: ``failed`` if it is damaged (nothing retries that: someone must remove it), else
    ``retrying`` (the target unreachable now: a wait waits for it as for an upload that retries)."""
    if isinstance(unread, DamagedMarkerError):
        return "failed", str(unread)
    return "retrying", f"cannot read {url}: {describe(unread)}"


class PersistingStore:
    """Persistence methods of ``MemStore`` (see the module docstring)."""

    def persist(self, checkpoint_id: str) -> None:
        """Upload committed checkpoint ``checkpoint_id`` in the background (returns at once; see
        ``wait_persisted``). Also retries one whose upload failed. Call it on one rank per node or on all.

        It looks at the target for at most ``PERSIST_LOOK_S`` (less within a wait that ends sooner,
        ``close(timeout)``): whether a copy recorded as persisted is
        still there (a target that does not answer by then is taken to hold it), and whether a checkpoint
        this node's memory does not hold is persisted (FileNotFoundError naming the checkpoints that exist
        if it is not; the read's error, a TimeoutError if the target did not answer, if that cannot be
        told)."""
        self.check_open()
        if self.target is None:
            raise ValueError(
                "this MemStore has no persist_to; pass persist_to='s3://bucket/prefix' or a directory"
            )
        cid = validate_name(checkpoint_id)
        start = time.monotonic()
        deadline = sooner(start + PERSIST_LOOK_S)
        with answer_by(deadline):
            self._persist(cid, deadline - start)
        if self._persister is not None:
            self._persister.wake()

    def _persist(self, cid: str, look_s: float) -> None:
        """``persist``'s work, its looks at the target under the deadline of ``answer_by`` (``look_s``
        seconds from its start)."""
        try:
            if catalog.read_commit(self.layout, cid) is not None:
                progress = Progress(self.layout, cid, self.target.url)
                if self._copy_gone(cid):  # deleted from the target: upload it again
                    progress.forget_published()
                progress.request("on demand")
        except FileNotFoundError:  # evicted or deleted before the hold was placed: its holds went with it
            if catalog.read_commit(self.layout, cid) is not None:
                raise
        if catalog.read_commit(self.layout, cid) is None:  # unknown, or evicted or deleted meanwhile
            Progress(self.layout, cid, self.target.url).release()
            published, unread = self._published(cid)
            if isinstance(unread, TimeoutError):
                raise TimeoutError(
                    f"checkpoint {cid!r} is not in this node's memory, and {self.target.url} did not say "
                    f"within {look_s:.3g} s whether it is persisted there ({unread})"
                ) from unread
            if unread is not None:
                raise unread
            if not published:
                self.require_checkpoint(cid)

    def _unpublished(self, cid: str) -> bool:
        """Whether ``cid`` (in memory) is owed to this store's target and not published there yet: what
        its upload wrote there so far would stay behind if it were deleted now (see ``_drop_upload``)."""
        if self.target is None:
            return False
        progress = Progress(self.layout, cid, self.target.url)
        return progress.owed() and not progress.persisted()

    def _drop_upload(self, cid: str) -> None:
        """``cid``, owed and not published (``_unpublished``), was deleted from memory: in a job on one
        node, have the persister remove what its upload left in the target (``persist/dropped.py``).
        On several nodes another node may still upload into that directory: it stays, and a WARNING
        says so."""
        node = job_node_info()
        if self._persister is not None and (node is None or not node.multi_node):
            self._persister.drop(cid)
            return
        log.warning(
            "checkpoint %r was deleted before its upload was published: what was uploaded of it stays in "
            "%s (never listed nor loaded); remove it by hand once no node of the job uploads it",
            cid,
            self.target.url_of(cid),
        )

    def _persist_status(self, cid: str, cluster: Callable[[], ClusterCheckpoint | None]) -> CheckpointStatus:
        """The upload state of ``cid`` (a valid name), with ``in_memory``; ``cluster`` gives the checkpoint
        as the other nodes' memory holds it (asked only if this node's memory does not; see
        ``MemStore.status``). FileNotFoundError naming the checkpoints that exist if no tier holds it."""
        in_memory = catalog.read_commit(self.layout, cid) is not None
        if self.target is None:
            if not in_memory and cluster() is None:
                return self._held_nowhere(cid)
            return CheckpointStatus(cid, in_memory, "off")
        url = self.target.url_of(cid)
        if not in_memory:
            return self._status_elsewhere(cid, url, cluster)
        st = self._local_persist_status(cid, url)
        # Eviction renames the checkpoint's directory away at once: if it is still there, every record read
        # above was this checkpoint's; if not (published and evicted meanwhile), ask again.
        if catalog.read_commit(self.layout, cid) is None:
            return self._persist_status(cid, cluster)
        if st is None:
            raise FileNotFoundError(
                f"checkpoint {cid!r} is committed in {self.layout.checkpoint_dir(cid)} "
                f"but has no {MANIFEST}: "
                "the store is damaged there; remove it with store.delete(id)"
            )
        return st

    def _upload_status(self, cid: str) -> CheckpointStatus:
        """``status`` of ``cid`` (a valid name) without its replication, which asks the replica nodes:
        what a wait for uploads polls (a dead peer would make every poll wait for its timeout)."""
        return self._persist_status(cid, functools.cache(functools.partial(self._cluster_copy, cid)))

    def _local_persist_status(self, cid: str, url: str) -> CheckpointStatus | None:
        """The upload state of ``cid`` from its records in memory; None if it was evicted while reading."""
        progress = Progress(self.layout, cid, self.target.url)
        state, error = progress.upload_state()
        local_dir = self.layout.checkpoint_dir(cid)
        try:
            files = len(node_share(local_dir, Manifest.read(local_dir / MANIFEST).files))
        except FileNotFoundError:
            return None
        counts = {"files_uploaded": min(files, len(progress.done_files())), "files_total": files}
        if state == "persisted":  # as recorded here: is the copy still there?
            published, unread = self._published(cid)
            if unread is not None:
                state, error = _unread_state(url, unread)
            elif not published:
                state, error = "not requested", self._gone(cid)
                counts["files_uploaded"] = 0  # none of them is there now
        published = url if state == "persisted" else None
        return CheckpointStatus(cid, True, state, error=error, persisted_url=published, **counts)

    def _gone(self, cid: str) -> str:
        """What to say of ``cid``, recorded here as persisted, whose persisted copy is gone."""
        return (
            f"checkpoint {cid!r} was persisted to {self.target.url_of(cid)}, but that copy is gone (no "
            f"{COMMITTED} there: deleted since it was published); store.persist(id) uploads it again "
            "while it is in memory"
        )

    def _copy_gone(self, cid: str) -> bool:
        """Whether ``cid`` is recorded here as persisted, but the target surely lacks it: its commit marker
        read as absent (not unreadable)."""
        if self.target is None or not Progress(self.layout, cid, self.target.url).persisted():
            return False
        return self._published(cid) == (False, None)

    def _status_elsewhere(
        self, cid: str, url: str, cluster: Callable[[], ClusterCheckpoint | None]
    ) -> CheckpointStatus:
        """The upload state of ``cid``, which this node's memory does not hold: ``persisted`` if it is
        published; else, if other nodes of the job hold it in memory, the most pressing state their
        records say (each node uploads its own files: the checkpoint is published once all have); else a
        FileNotFoundError naming the checkpoints that exist.

        While the target cannot be read (unreachable), the nodes' states stand, except that ``persisted``
        needs the commit marker seen: a node's claim of it is ``retrying`` with the read error, so that
        ``wait_persisted`` waits for the target as it waits for an upload that retries. With no node
        holding it, the read error is raised: whether it is published cannot be told."""
        published, unread = self._published(cid)
        if published:
            return CheckpointStatus(cid, False, "persisted", persisted_url=url)
        held = cluster()
        if held is None:
            if unread is not None:
                raise unread
            return self._held_nowhere(cid)
        states = dict(held.uploads.values())
        # a node that says persisted: published since the first look, or removed from the target since
        if "persisted" in states:
            published, unread = self._published(cid)
            if published:
                return CheckpointStatus(cid, False, "persisted", persisted_url=url)
            if unread is not None:
                states.setdefault(*_unread_state(url, unread))
        state = next((s for s in PRESSING if s in states), "not requested")
        return CheckpointStatus(cid, False, state, error=states.get(state))

    def _held_nowhere(self, cid: str) -> CheckpointStatus:
        """The status of ``cid``, which neither this node's memory nor the other nodes' held when asked:
        FileNotFoundError naming the checkpoints that exist, unless it appeared meanwhile."""
        self.open_checkpoint(cid)
        return self._persist_status(cid, functools.cache(functools.partial(self._cluster_copy, cid)))

    def _published(self, cid: str) -> tuple[bool, Exception | None]:
        """Whether ``cid`` is published in the target (its commit marker is there), and the error reading
        the marker failed with (the target unreachable, or no answer by the deadline of ``answer_by``),
        if it did."""
        target, limit = self.target, answer_limit()
        try:
            if limit is None:
                return remote_commit(target, cid) is not None, None
            found = _REMOTE_READS.call((target.url, cid), lambda: remote_commit(target, cid), limit)
            return found is not None, None
        except Exception as e:  # noqa: BLE001 - the caller tells what it can without the target
            return False, e

    def wait_persisted(self, checkpoint_id: str, timeout: float | None = None) -> CheckpointStatus:
        """Block until ``checkpoint_id`` is persisted. Raises PersistError if its upload failed for good,
        ValueError if nothing will upload it (not requested: call ``persist(id)``), TimeoutError after
        ``timeout`` seconds (None: no limit), FileNotFoundError if no tier holds it (where some nodes did
        not answer, they are asked again for ``replication_timeout_s``, or until the timeout ends).
        Returns its ``status`` (whose looks at other nodes end by the same deadline)."""
        start = time.monotonic()
        timeout = optional_timeout("timeout", timeout)
        st = self._wait_uploaded(checkpoint_id, timeout)
        with answer_by(None if timeout is None else start + timeout):
            cluster = functools.cache(functools.partial(self._cluster_copy, st.checkpoint_id))
            return self._with_replication(st, cluster)

    def _wait_uploaded(self, checkpoint_id: str, timeout: float | None) -> CheckpointStatus:
        """``wait_persisted`` without the replication of the status it returns: polls the upload state
        alone (no replica node is asked, see ``_upload_status``), as ``close`` waits; the last state."""
        timeout = optional_timeout("timeout", timeout)
        cid = validate_name(checkpoint_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause, silent = 0.05, None  # silent: since when nodes have gone unanswered in a row
        while True:
            self.check_open()
            what = f"checkpoint {cid!r} not persisted after {timeout} s"
            try:
                with answer_by(deadline):
                    st = self._upload_status(cid)
            except NodesUnansweredError as e:  # one of them may hold it: asked again for a while
                silent = unanswered_since(e, silent, self.replication_timeout_s, deadline, what)
                pause = poll_pause(pause, deadline)
                continue
            except TimeoutError as e:  # the target did not say whether one not in memory is published
                raise TimeoutError(
                    f"{what}: {self.target.url} did not answer whether it is there ({e})"
                ) from e
            silent = None
            if st.persisted:
                return st
            if st.persist == "failed":
                raise PersistError(
                    f"persisting checkpoint {st.checkpoint_id!r} to {self.target.url} failed: {st.error}"
                )
            if st.persist == "off":
                raise ValueError(
                    f"checkpoint {st.checkpoint_id!r} is not being persisted (off); use "
                    "MemStore(persist_to=...) and store.persist(id)"
                )
            if st.persist == "not requested":
                elsewhere = "" if st.in_memory else " on the nodes that hold it"
                why = f": {st.error}" if st.error else ""
                raise ValueError(
                    f"checkpoint {st.checkpoint_id!r} is not being persisted (not requested{why}); call "
                    f"store.persist(id){elsewhere}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {st.persist}{' (' + st.error + ')' if st.error else ''}")
            if st.in_memory:  # the state is this node's records: polled often
                time.sleep(0.05)
            else:  # the other nodes are asked: less often the longer it waits
                pause = poll_pause(pause, deadline)

    def _report_unheld(self, cid: str, missing: list[str]) -> None:
        """Owed checkpoint ``cid`` is committed here, but ``missing`` (files of other nodes) are held by no
        node of the job: lost with a node, and no replica of them is left. Those not uploaded yet never
        will be: say so (a WARNING naming them) and mark the upload failed with that reason, so that
        ``status(id)`` and ``wait_persisted`` tell it instead of the checkpoint being held silently."""
        rec = catalog.read_commit(self.layout, cid)
        if rec is None:
            return
        try:
            lost = sorted(set(missing) - set(read_parts(self.target, rec)))
        except Exception as e:  # noqa: BLE001 - what is uploaded is unknown: the persister retries
            log.warning(
                "checkpoint %r owed to %s: files %s are held by no node of the job, and %s is unreachable "
                "(%s) to tell whether they were uploaded",
                cid, self.target.url, missing, self.target.url, e,
            )  # fmt: skip
            return
        if not lost:
            return
        reason = (
            f"files {lost} are held by no node of the job (lost with a node, no replica left) and were "
            "never uploaded: the upload cannot complete; the checkpoint stays held in memory until "
            "store.delete(id)"
        )
        log.warning("checkpoint %r cannot be persisted to %s: %s", cid, self.target.url, reason)
        Progress(self.layout, cid, self.target.url).report(global_rank(), "failed", reason)

    def _binding(self, hold: str) -> bool:
        """Whether upload hold ``hold`` keeps its checkpoint in memory for this store: its own target's, or
        another target's that a live process of the job has open (``target_users``)."""
        own = self.target is not None and hold == target_key(self.target.url)
        return is_persist_hold(hold) and (own or target_users.in_use(self.layout, hold))

    def _owed(self, binding: bool = True) -> list[str]:
        """The committed checkpoints owed to persistent storage: held in memory until uploaded (``binding``,
        see ``_binding``), or else those whose upload holds bind nothing (no process uploads them)."""
        owed = []
        for r in catalog.committed(self.layout):
            held = [h for h in catalog.holds(self.layout, r.checkpoint_id) if is_persist_hold(h)]
            if held and any(self._binding(h) for h in held) == binding:
                owed.append(r.checkpoint_id)
        return owed

    def _held_for_uploads(self) -> tuple[bool, str]:
        """What the checkpoints held in memory until uploaded (``_owed``) wait for, for the error of a full
        store: whether some of their uploads may still end (not all failed for good), and per target
        whose hold keeps them, this store's first, which checkpoints, how their uploads go and what the
        user can do. Another store's target is named by the URL its store registered
        (``target_users``)."""
        by_hold: dict[str, list[str]] = {}
        for cid in self._owed():
            for hold in catalog.holds(self.layout, cid):
                if self._binding(hold):
                    by_hold.setdefault(hold, []).append(cid)
        own = target_key(self.target.url) if self.target is not None else None
        uploading, parts = False, []
        for hold, cids in sorted(by_hold.items(), key=lambda item: (item[0] != own, item[0])):
            url = self.target.url if hold == own else target_users.url_of(self.layout, hold)
            failed = [c for c in cids if url and Progress(self.layout, c, url).upload_state()[0] == "failed"]
            uploading = uploading or len(failed) < len(cids)
            if hold == own:
                parts.append(_held_for_own(url, cids, failed))
            else:
                parts.append(_held_for_other(url, hold, cids, failed))
        return uploading, "; ".join(parts)

    def _remote_of_local(self, cid: str, save: catalog.CommitRecord) -> RemoteCheckpoint | None:
        """``_remote(cid, save)``, for files of ``cid`` that cannot be read from this node's memory; a
        FileNotFoundError naming the URL if it was persisted but the copy there is gone."""
        remote = self._remote(cid, save)
        if remote is None and self._copy_gone(cid):
            raise FileNotFoundError(
                f"{self._gone(cid)}. Files of it that this node cannot read have no copy left to read "
                "instead: load another checkpoint"
            )
        return remote

    def _remote(self, cid: str, save: catalog.CommitRecord | None = None) -> RemoteCheckpoint | None:
        """The persisted copy of ``cid``, or None (not persisted, no target, or the target unreachable).
        With ``save`` (the local copy's commit record), None also if the persisted copy is of another save
        under the same id: its bytes are not this checkpoint's."""
        if self.target is None:
            return None
        try:
            remote = remote_commit(self.target, cid)
            if remote is None:
                return None
            if save is not None and remote != save:
                log.warning(
                    "%s holds another save of checkpoint %r: not read in place of this one's files",
                    self.target.url_of(cid),
                    cid,
                )
                return None
            return RemoteCheckpoint(self.target, cid, self.io_threads)
        except Exception as e:  # noqa: BLE001 - reading falls back to what is local
            log.warning("cannot read persisted checkpoint %r from %s: %s", cid, self.target.url, e)
            return None


def _held_for_own(url: str, cids: list[str], failed: list[str]) -> str:
    """The part of a full store's error on checkpoints ``cids`` held until uploaded to its own target at
    ``url`` (``failed``: those whose upload failed for good)."""
    why = (
        f"uploads failed for {failed} (see store.status(id).error; store.persist(id) retries)"
        if failed
        else "uploads are behind saves (see store.status(id)); persist less often or use "
        "persist_backlog='wait'"
    )
    return f"{len(cids)} checkpoint(s) held in memory until uploaded to {url}: {cids}; {why}"


def _held_for_other(url: str | None, hold: str, cids: list[str], failed: list[str]) -> str:
    """The part of a full store's error on checkpoints ``cids`` held (retention hold ``hold``) until
    another open store of the job uploads them to its target at ``url`` (None: that store registered
    none; ``failed``: those whose upload failed for good): not this store's doing, nor its persist_to's."""
    target = url or f"the persist_to of another store of this job (hold {hold})"
    why = (
        f"their uploads failed for {failed}: store.persist(id) on a store with that persist_to retries them"
        if failed
        else "their uploads are under way: wait for them (store.wait_persisted(id) on a store with that "
        "persist_to)"
    )
    return (
        f"{len(cids)} checkpoint(s) held in memory until uploaded to {target} by another store of this "
        f"job: {cids}; {why}, or free memory with store.delete(id)"
    )
