"""``MemoryStorageWriter``: DCP's StorageWriter (and AsyncStager) over a ``MemStore``.

It drives one save through the commit protocol: it stages (``dcp.async_save``), orders background saves,
checks ids and space while planning, has each rank write its files (``rank_write.py``), and on the
coordinator writes the manifest (item locations, checksums, DCP metadata, all msgpack) and the COMMITTED
marker, then evicts checkpoints beyond ``keep_in_memory``. A failed step gives its staging slot back.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future
from torch.multiprocessing import get_sharing_strategy

from dcp_memstore.dcp.metadata_codec import encode_metadata, with_stored_dtypes
from dcp_memstore.dcp.rank_write import RankWrite
from dcp_memstore.dcp.save_order import DCP_ASYNC_SAVE, SaveApi, SaveOrder
from dcp_memstore.dcp.stager import Stager, current_rank
from dcp_memstore.dcp.storable import check_plan
from dcp_memstore.errors import CheckpointExistsError, InsufficientSpaceError, StagingTimeoutError
from dcp_memstore.memstore import MemStore
from dcp_memstore.store import catalog, events
from dcp_memstore.store.catalog import CommitRecord
from dcp_memstore.store.collective import other_ranks_wait
from dcp_memstore.store.faults import crash_point
from dcp_memstore.store.ids import is_valid_name, validate_name
from dcp_memstore.store.layout import MANIFEST, StoreLayout, parse_slot
from dcp_memstore.store.manifest import Manifest, ManifestItem, manifest_bytes_estimate
from dcp_memstore.store.mapping import MAPPINGS
from dcp_memstore.store.packing import pack
from dcp_memstore.store.pool import FILE_ALIGN, round_up
from dcp_memstore.store.records import write_atomic
from dcp_memstore.store.space import space_errors
from dcp_memstore.store.threads import runs_code_of

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)
# The checkpoint directories that saves of this process began and have not finished, by (job dir, id), to
# tell a save running now from an earlier failed attempt; an entry goes with its writer.
_begun: weakref.WeakValueDictionary[tuple[str, str], MemoryStorageWriter] = weakref.WeakValueDictionary()
_begun_lock = threading.Lock()
_DCP_SAVE_FILE = state_dict_saver.__file__  # dcp.save and async_save's background save run in there
# thread -> the writer whose save the thread works for now (staging, or DCP's save): _saving_elsewhere. By
# the thread object, held weakly: an entry goes with its thread (a process runs a thread per async save)
_thread_writer: weakref.WeakKeyDictionary[threading.Thread, weakref.ref[MemoryStorageWriter]] = (
    weakref.WeakKeyDictionary()
)


def _releases_slot_on_error(method: F) -> F:
    """If a save step fails, give this save's staging slot back so later saves do not wait for it."""

    @functools.wraps(method)
    def wrapper(self: MemoryStorageWriter, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self._release_slot()
            raise

    return wrapper  # type: ignore[return-value]


def _nbytes(item: WriteItem) -> int:
    """The bytes this rank writes of ``item``: its chunk of the tensor (a shard of a DTensor or
    ShardedTensor), not the whole tensor."""
    td = item.tensor_data
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize if td else 0


class MemoryStorageWriter(StorageWriter, AsyncStager):
    """Writes DCP checkpoints into a ``MemStore``; pass it as ``storage_writer`` to ``dcp.save`` or
    ``dcp.async_save`` together with ``checkpoint_id="step-100"`` (a name in the store, not a path).

    ``save_api`` names how the user makes saves, for the advice of a StagingTimeoutError (a save that
    waited too long for earlier ones) and of a sharing strategy that cannot send the writer to another
    process; an integration that drives the writer for another API, such as Megatron's save strategy, sets
    its own."""

    save_api: SaveApi = DCP_ASYNC_SAVE

    def __init__(self, store: MemStore) -> None:
        if not isinstance(store, MemStore):
            raise TypeError(f"MemoryStorageWriter needs a MemStore, got {type(store).__name__}")
        super().__init__()
        self.store = store
        self.checkpoint_id: str | None = None
        self.is_coordinator = False
        self.rank = 0
        # (ticket seq, slot, (pid, thread) that staged it) of saves staged by this writer, oldest first
        self._pending: deque = deque()
        # ticket seq -> (rank, seconds, bytes, time) of a staging not yet reported: DCP names the
        # checkpoint of an ``async_save`` only when its save starts (``reset``), which reports it then
        self._staged: dict[int, tuple[int, float, int, float]] = {}
        self._current: tuple[int, str | None] | None = None  # this save's (ticket seq, staging slot)
        self._armed = False  # reset() ran for the save in progress
        self._save_started = 0.0
        self._reserve_ahead = True  # False in DCP's checkpoint process, where no save would claim them
        # (error, (pid, thread) that staged) of a save whose staging failed here while other ranks staged, or,
        # in DCP's checkpoint process, of one that waited too long to be sent there: it fails when it plans
        self._stage_error: tuple[BaseException, tuple[int, int]] | None = None
        self._deferred_error: BaseException | None = None  # fails the save in progress when it plans
        self._begun_by: threading.Thread | None = None  # the thread that began this writer's checkpoint
        self._finishes_later = False  # finish_later(): running until save_ended(), outside DCP's save
        # A staged save that never runs (its async_save failed after staging) must not block later ones.
        self._abandon = weakref.finalize(self, _abandon_later, str(store.layout.job_dir), self._pending)

    # -- pickling (DCP's PROCESS executor sends the writer to its checkpoint process) -------------------

    def __getstate__(self) -> dict[str, Any]:
        """The receiving process takes over the saves staged so far and runs them in the order it gets them,
        so this waits until every earlier staged save of the job has been written there. A save that waited
        too long is still sent, with the error, where other ranks wait for it (see ``_defer_timeout``)."""
        if get_sharing_strategy() != "file_descriptor":
            _abandon_pending(self.store.layout, self._pending)  # these saves will never run
            api = self.save_api
            raise RuntimeError(
                f"dcp_memstore's staged tensors reach {api.other_process} as file descriptors; "
                f"torch.multiprocessing's sharing strategy is {get_sharing_strategy()!r}. Call "
                f"torch.multiprocessing.set_sharing_strategy('file_descriptor') or {api.in_process}."
            )
        timed_out = None
        try:
            for seq, _, _ in self._pending:
                timed_out = self._defer_timeout(
                    functools.partial(self._order.wait_sent_in_order, seq, api=self.save_api), timed_out
                )
                self._order.bind(seq, sent=True)  # bound to DCP's executor thread that sends this save
        except BaseException:
            _abandon_pending(self.store.layout, self._pending)  # these saves will never run
            raise
        for seq in list(self._staged):  # reported here, where training waited for them (see ``stage``)
            self._report_staging(seq, None)
        state = dict(self.__dict__)
        if timed_out is not None and self._stage_error is None:  # its reset there fails it when it plans
            state["_stage_error"] = (timed_out, self._pending[0][2])
        state["_pending"] = deque(self._pending)
        state.pop("_abandon", None)
        state["_begun_by"] = None  # a thread of this process
        self._pending.clear()
        self._stage_error = None  # taken over too
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reserve_ahead = False
        self._abandon = weakref.finalize(self, _abandon_later, str(self.store.layout.job_dir), self._pending)

    # -- AsyncStager -----------------------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any], checkpoint_id: str | None = None) -> dict[str, Any]:
        """Copy ``state_dict``'s tensors into tmpfs shard files; training may go on once this returns.
        The ``stage`` event (the time training waited, from this call) is reported with ``checkpoint_id``
        where the caller knows it (Megatron's strategy), else when DCP starts the save (``reset``), which
        names it; a save sent to DCP's checkpoint process reports it without an id as it is sent, in the
        process where training waited."""
        here = (os.getpid(), threading.get_ident())
        self._works_in_this_thread()
        try:
            self.store.check_open()
            started = time.time()  # saves of this process that began before have ended or are running
            clock = time.perf_counter()
            staged, ticket, nbytes = Stager.of(self.store).stage(
                state_dict,
                lambda needed, rank, files: check_space_reclaiming(
                    self.store, needed, rank, started, files=files
                ),
                self.save_api,
            )
        except Exception as e:
            if not other_ranks_wait() or self._pending or self._stage_error is not None:
                raise
            # This rank's background save still has to take part in DCP's collectives, or the other ranks'
            # saves would wait for it until the process group times out: it fails when planning, on every
            # rank at once (and this rank's future says why).
            log.warning("staging failed on this rank; the save will fail on every rank: %s", e)
            ticket = Stager.of(self.store).hold_place()  # later saves wait for it, as on the other ranks
            self._pending.append((ticket.seq, ticket.slot, here))
            self._stage_error = (e, here)
            return {}
        if self._pending or self._stage_error is not None:  # an earlier save staged here has not started
            _abandon_pending(self.store.layout, deque([(ticket.seq, ticket.slot, None)]))
            raise ValueError(
                "this MemoryStorageWriter already has a staged save that has not started; give each "
                "overlapping dcp.async_save its own MemoryStorageWriter(store), "
                "or wait for the previous future"
            )
        self._pending.append((ticket.seq, ticket.slot, here))
        self._staged[ticket.seq] = (current_rank(), time.perf_counter() - clock, nbytes, time.time())
        if checkpoint_id is not None:
            self._report_staging(ticket.seq, checkpoint_id)
        return staged

    def _report_staging(self, seq: int, checkpoint_id: str | None) -> None:
        """Emit the ``stage`` event of the save staged under ticket ``seq`` (once), as ``checkpoint_id``."""
        staged = self._staged.pop(seq, None)
        if staged is not None:
            rank, seconds, nbytes, at = staged
            events.emit(self.store.layout, "stage", checkpoint_id, rank, seconds, nbytes=nbytes, at=at)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns only once every copy has landed."""

    def close(self) -> None:
        """Nothing to release: staging files belong to the store and are recycled by it."""

    # -- StorageWriter ---------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """First step of every save DCP runs with this writer (``checkpoint_id`` given)."""
        # A save staged by this very thread is run by another one (DCP's executor); a synchronous save on
        # the staging thread leaves it to that thread.
        here = (os.getpid(), threading.get_ident())
        failed = None
        if self._stage_error is not None and self._stage_error[1] != here:
            failed, self._stage_error = self._stage_error[0], None
        pending = self._pending.popleft() if self._pending and self._pending[0][2] != here else None
        ticket = pending[:2] if pending else None
        try:
            try:
                self.store.check_open()
                cid = None if checkpoint_id is None else validate_name(checkpoint_id)
            except Exception as e:
                if not other_ranks_wait():
                    raise
                # DCP calls this before its collectives: fail the save when it plans, on every rank at once
                # (see stage), once it is its turn (never in collectives while an earlier save is in its)
                failed, cid = failed or e, None
            # Wait for earlier saves of this job in this process before touching any per-save state.
            seq = ticket[0] if ticket else None
            begin = functools.partial(self._order.begin, seq, api=self.save_api, checkpoint_id=cid)
            failed = self._defer_timeout(begin, failed)
        except BaseException:
            self._current = ticket
            self._release_slot()
            raise
        self._forget_begun()  # its previous save, if it failed before committing
        self._current, self.checkpoint_id, self._armed = ticket, cid, True
        if ticket is not None and cid is not None:
            self._report_staging(ticket[0], cid)
        elif ticket is not None:
            self._staged.pop(ticket[0], None)  # a save that fails before it starts: nothing to report
        self._deferred_error = failed
        self._save_started = time.time()
        if ticket is not None and ticket[1] is not None:
            _recycle_unwritten_before(self.store.layout, Path(ticket[1]))

    def fail_when_planning(self, error: BaseException) -> None:
        """Make the save this writer was reset for fail with ``error`` when it plans, on every rank at once
        (DCP's first collective gathers it), unless it already fails with an earlier error: for an
        integration that drives the writer and finds a save it cannot complete."""
        if self._deferred_error is None:
            self._deferred_error = error

    def _defer_timeout(
        self, wait: Callable[[float], None], failed: BaseException | None
    ) -> BaseException | None:
        """Run ``wait(timeout_s)`` (a wait for earlier saves of the job); return the error this save is to
        fail with. Waiting longer than ``stage_timeout_s`` is a StagingTimeoutError, raised at once where
        this process saves alone. With several ranks, another rank may have waited less and be in this
        save's collectives already: leaving it there would pair its save with this rank's next one. So this
        rank waits on until it is its turn and fails the save when it plans, on every rank at once."""
        try:
            wait(self.store.stage_timeout_s)
        except StagingTimeoutError as e:
            if not other_ranks_wait():
                raise
            log.warning("%s. It fails on every rank once the earlier saves have ended", e)
            wait(math.inf)
            return failed or e
        return failed

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_valid_name(checkpoint_id)

    @_releases_slot_on_error
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._works_in_this_thread()
        if not self._armed:  # DCP skips reset() when checkpoint_id is None: take this save's staged state now
            self.reset(None)
        self._armed = False
        if self._deferred_error is not None:  # DCP runs this on every rank before its first collective
            error, self._deferred_error = self._deferred_error, None
            raise error
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "MemoryStorageWriter needs use_collectives=True (the coordinator commits each checkpoint)"
            )
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", current_rank())
        self.store.replication()  # a multi-node job: peers must be serving before anything commits
        if self.checkpoint_id is None:
            raise ValueError(
                "dcp.save/async_save with MemoryStorageWriter needs checkpoint_id='NAME', e.g. 'step-100'"
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=uuid.uuid4().hex)

    @_releases_slot_on_error
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        assert self.checkpoint_id is not None
        check_plan(plan)  # every rank fails here, before any of them copies
        if catalog.read_commit(self.store.layout, self.checkpoint_id) is not None:
            raise CheckpointExistsError(
                f"checkpoint {self.checkpoint_id!r} already exists in store {self.store.layout.job_dir}; "
                "save under a new id or remove it first with store.delete(id)"
            )
        needed = manifest_bytes_estimate(it.index.fqn for it in plan.items)
        files = None
        if self._current is None:  # not staged: this save copies every tensor into new shard files
            # Files allocated ahead for it count once they are in the pool; those still being allocated
            # would count nowhere, so the reservation stops first (the save allocates the rest itself).
            Stager.of(self.store).wait_reserved(stop=True)
            files = pack([_nbytes(it) for it in plan.items if it.tensor_data], self.store.io_threads)[1]
            needed += sum(round_up(size) for size in files)
        check_space_reclaiming(self.store, needed, self.rank, self._save_started, self, files)
        return plan

    @_releases_slot_on_error
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.checkpoint_id is not None
        layout, cid = self.store.layout, self.checkpoint_id
        # the coordinator writes the manifest of every rank's items (each rank counted only its own)
        self.store.check_space(
            manifest_bytes_estimate(it.index.fqn for p in plans for it in p.items), self.rank
        )
        key = (str(layout.job_dir), cid)
        if _finished_later_elsewhere(key, self):
            # a Megatron request let go unfinalized (its queue closed with abort=True) may live on in a
            # reference cycle until the garbage collector's next pass; it no longer counts once collected
            gc.collect()
        with _begun_lock:
            directory = layout.checkpoint_dir(cid)
            if directory.exists() and catalog.read_commit(layout, cid) is None:
                self._refuse_if_being_saved()
                catalog.discard(layout, directory)  # an earlier failed attempt at this id
            try:
                with space_errors(layout.root, FILE_ALIGN, "for the checkpoint's in-progress marker"):
                    catalog.begin(layout, cid)
            except OSError as e:
                if directory.exists():  # another process began it between the check and here
                    raise CheckpointExistsError(self._being_saved("another process")) from e
                raise
            _begun[key] = self
            self._begun_by = threading.current_thread()
        return plans

    def _refuse_if_being_saved(self) -> None:
        """CheckpointExistsError if another save, running now, began this checkpoint id's directory: one
        that another thread is inside DCP's save for, or one that is finished later (a Megatron save not
        yet finalized, whose planning ran on the thread that makes this save)."""
        layout, cid = self.store.layout, self.checkpoint_id
        other = _begun.get((str(layout.job_dir), cid))
        if other is not None and other is not self and other._running():
            raise CheckpointExistsError(self._being_saved("another save in this process"))
        owner = catalog.saving_process(layout, cid)
        if owner is not None:
            since = time.strftime("%H:%M:%S", time.localtime(owner.get("started", 0)))
            host = owner.get("host")
            where = "" if host == socket.gethostname() else f" on host {host}"
            raise CheckpointExistsError(
                self._being_saved(f"process {owner.get('pid')}{where} (since {since})")
                + ". Two runs with the same root and job id share one store: give each run its own job_id "
                "(MemStore(job_id=...) or DCP_MEMSTORE_JOB_ID)"
            )

    def _running(self) -> bool:
        """Whether the save this writer began is still running: finished later (``finish_later``), or
        being saved by another thread."""
        return self._finishes_later or self._saving_elsewhere()

    def _saving_elsewhere(self) -> bool:
        """Whether the save this writer began is still running on another thread: that thread is inside
        DCP's save now. A save that failed on another rank never tells the coordinator's writer, but its
        thread has left DCP's save since (or ended, or is the one starting the new save)."""
        thread = self._begun_by
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            return False
        # no lock: the caller may hold _begun_lock, and one dict lookup is atomic
        works_for = _thread_writer.get(thread)
        if works_for is None or works_for() is not self:
            return False  # that thread has gone on to another save (still inside DCP: its frames cannot tell)
        return runs_code_of(thread, _DCP_SAVE_FILE)

    def finish_later(self) -> None:
        """Say that this save, planned, is written and finished outside DCP's save, by steps that may run
        in other processes: Megatron's async worker (a forked process, say) writes it, and the finalize
        step, later in this process, commits it. Until ``save_ended`` (or until this writer is dropped:
        nothing will finish the save then) it counts as running here (``running_saves``): the space check
        of this process's next save, and the clearing after a commit, keep its directory, which holds what
        was written and waits for the commit.

        The checkpoint's directory on this node is made now, by this process, where no rank of the node
        made it yet (the coordinator makes it on its own node only). Made by the writing process, it would
        be owned by one that may exit before the commit, and any process opening the store on this node
        would clear it as a dead save's. Owned by this process, it is cleared once this process dies
        without committing it. If it cannot be made now, the writing process makes it, or reports why
        not through the finalize step on every rank."""
        layout, cid = self.store.layout, self.checkpoint_id
        assert cid is not None
        try:
            catalog.join(layout, cid)
        except OSError as e:
            log.warning("could not make the directory of checkpoint %r on this node now: %s", cid, e)
        with _begun_lock:
            _begun[(str(layout.job_dir), cid)] = self
        self._finishes_later = True

    def save_ended(self) -> None:
        """The save announced by ``finish_later`` has ended, committed or failed: it no longer counts as
        running, and a directory it left uncommitted is a failed save's, to be cleared as one."""
        self._finishes_later = False
        self._forget_begun()

    def _works_in_this_thread(self) -> None:
        """Note that this thread works for this writer's save now (staging it, or running DCP's save)."""
        _thread_writer[threading.current_thread()] = weakref.ref(self)  # one dict store: atomic

    def _being_saved(self, by: str) -> str:
        return (
            f"checkpoint {self.checkpoint_id!r} is being saved right now by {by} in store "
            f"{self.store.layout.job_dir}; save under another id, or wait until that save has finished"
        )

    @_releases_slot_on_error
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        MAPPINGS.prune()
        catalog.join(self.store.layout, self.checkpoint_id)  # begun on the coordinator's node only
        catalog.drop_copies(self.store.layout, self.checkpoint_id)  # of an older save under this id
        slot = self._current[1] if self._current else None
        results = RankWrite(
            self.store,
            self.rank,
            self.checkpoint_id,
            slot,
            plan,
            planner,
            lambda needed, rank, files: check_space_reclaiming(
                self.store, needed, rank, self._save_started, self, files
            ),
            reserve_ahead=self._reserve_ahead,
        ).run()
        self._current = None
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.checkpoint_id is not None
        started = time.perf_counter()
        layout = self.store.layout
        items = [
            ManifestItem(
                wr.index.fqn, None if wr.index.offset is None else tuple(wr.index.offset), wr.storage_data
            )
            for rank_results in results
            for wr in rank_results
        ]
        directory = layout.checkpoint_dir(self.checkpoint_id)
        try:
            dcp_metadata = encode_metadata(with_stored_dtypes(metadata, items))
            manifest = Manifest(self.checkpoint_id, len(results), items, dcp_metadata)
            encoded = manifest.encode()
        except BaseException:
            self._discard_failed(directory)
            raise
        with catalog.commit_lock(layout):  # no other save of the job takes the same sequence number
            try:
                with space_errors(layout.root, len(encoded), "for the manifest"):
                    write_atomic(directory / MANIFEST, encoded)
                crash_point("before-commit", self.rank)
                seq, at = catalog.next_commit(layout, self.store.newest_commit_seen)
                self.store.newest_commit_seen = at  # a save deleted since does not lend its time to the next
                record = CommitRecord(self.checkpoint_id, seq, at, manifest.nbytes)
                # other nodes: prepared (invisible) first, committed only after this node commits
                record = self.store.prepare_everywhere(record, encoded)
            except BaseException:
                self._discard_failed(directory)
                raise
            self.store.prepare_commit(self.checkpoint_id, record.seq)
            catalog.commit(
                layout, self.checkpoint_id, manifest.nbytes, seq=record.seq, committed_at=record.committed_at
            )
        crash_point("after-commit", self.rank)
        self._forget_begun()
        self.store.commit_everywhere(record)
        elapsed = time.perf_counter() - started
        events.emit(layout, "commit", self.checkpoint_id, self.rank, elapsed, nbytes=manifest.nbytes)
        self.store.after_commit()
        catalog.clear_abandoned(layout, before=self._save_started, running=self._running_elsewhere())

    def _running_elsewhere(self) -> set[str]:
        """The checkpoint ids of this job that other saves of this process began and are still writing (two
        ``dcp.save`` calls in threads, or a save next to a background one): not leftovers to clear."""
        return running_saves(self.store.layout, self)

    def _forget_begun(self) -> None:
        """This writer's save is over (committed, or it starts another): another may take its id."""
        with _begun_lock:
            for key in [k for k, w in _begun.items() if w is self]:
                del _begun[key]

    def _discard_failed(self, directory: Path) -> None:
        """This save failed in its commit: discard its directory (its files serve the next save) and
        release its slot."""
        catalog.discard(self.store.layout, directory)
        self._release_slot()

    def _release_slot(self) -> None:
        """This save failed: recycle its staging slot, drop its ticket if it never started, let another save
        take its id, and, where no other rank writes into it, discard the directory it began."""
        layout = self.store.layout
        if self._current is not None:
            _give_back(layout, *self._current)
        self._current = None
        self._armed = False
        with _begun_lock:
            began = [cid for (_, cid), w in _begun.items() if w is self]
        if not other_ranks_wait():
            for cid in began:
                if catalog.read_commit(layout, cid) is None:
                    catalog.discard(layout, layout.checkpoint_dir(cid))
        self._forget_begun()

    @property
    def _order(self) -> SaveOrder:
        return SaveOrder.of(str(self.store.layout.job_dir))


def _finished_later_elsewhere(key: tuple[str, str], writer: MemoryStorageWriter) -> bool:
    """Whether a writer other than ``writer`` began checkpoint ``key`` and finishes it later."""
    other = _begun.get(key)
    return other is not None and other is not writer and other._finishes_later


def running_saves(layout: StoreLayout, exclude: MemoryStorageWriter | None = None) -> set[str]:
    """The checkpoint ids of ``layout``'s job that saves of this process (other than ``exclude``'s) began
    and are still writing, or that are written and finished later (``finish_later``)."""
    job = str(layout.job_dir)
    with _begun_lock:
        begun = [(cid, w) for (j, cid), w in _begun.items() if j == job and w is not exclude]
    return {cid for cid, w in begun if w._running()}


def check_space_reclaiming(
    store: MemStore,
    needed: int,
    rank: int,
    started: float,
    exclude: MemoryStorageWriter | None = None,
    files: list[int] | None = None,
) -> None:
    """``store.check_space`` (of ``needed`` bytes, shard files of ``files`` bytes among them); where it fails,
    first discard what earlier failed saves of this process left (their files go to the pools), evict the
    checkpoints beyond ``keep_in_memory``, and check again. In a job of several ranks a failed save leaves the
    directory its coordinator began, with the files other ranks wrote into it, and that was cleared only after
    the next commit: if those files left too little room, no later save could commit. Checkpoints beyond
    ``keep_in_memory`` were likewise evicted only after a commit: a job killed between a commit and its
    eviction, or reopened with a lower ``keep_in_memory`` (as the space error advises), could not save again.
    Saves of this process that began before ``started`` have ended (saves run in order); those of ``exclude``
    and of other threads still writing are kept. Saves sent to DCP's checkpoint process (PROCESS executor) ran
    there, and that process, a child of this one that lives on, began their directories: those begun before
    ``started`` are discarded too once it has answered every save sent to it (it runs one at a time)."""
    try:
        store.check_space(needed, rank, files)
    except InsufficientSpaceError:
        layout = store.layout
        children = SaveOrder.of(str(layout.job_dir)).sent_saves_answered()
        cleared = catalog.clear_abandoned(
            layout, before=started, running=running_saves(layout, exclude), children=children
        )
        if not (store.evict_beyond_keep() or cleared):
            raise
        store.check_space(needed, rank, files)


def _give_back(layout: StoreLayout, seq: int, slot: str | None) -> None:
    """Recycle a save's staging slot and drop its ticket if no thread ever started the save."""
    if slot is not None:
        catalog.recycle(layout, Path(slot))
    SaveOrder.of(str(layout.job_dir)).cancel(seq)


def _abandon_pending(layout: StoreLayout, pending: deque) -> None:
    """Give back the slots and tickets of staged saves that will never run."""
    while pending:
        seq, slot, _ = pending.popleft()
        _give_back(layout, seq, slot)


def _abandon_later(job: str, pending: deque) -> None:
    """Finalizer of a writer: its staged saves that never started will never run. It may run inside any
    allocation (garbage collection), so it only leaves a note; the stager recycles at its next use."""
    for seq, slot, _ in list(pending):
        SaveOrder.abandon_later(job, seq, slot)


def _recycle_unwritten_before(layout: StoreLayout, slot: Path) -> None:
    """Recycle the slots that the same stager made before ``slot`` and that are still unwritten: their saves
    ended (this one started only after them) without writing them, because they failed somewhere."""
    mine = parse_slot(slot.name)
    if mine is None:
        return
    rank, owner, seq = mine
    for entry in list(os.scandir(layout.staging_dir)):
        other = parse_slot(entry.name)
        if other is not None and other[:2] == (rank, owner) and other[2] < seq:
            catalog.recycle(layout, Path(entry.path))
