"""``MemStoreSaveStrategy``: Megatron-Core's sharded save strategy, writing into a ``MemStore``.

Megatron's async save has three phases; the store's save protocol (stage, plan, write, commit) maps onto
them as follows.

1. ``async_save`` (the trainer; training waits for it): the data of every main-replica ShardedTensor is
   staged, i.e. copied into a tmpfs staging slot by the store's stager (GPU tensors by DMA into the pinned
   mapping), and ShardedObjects are serialised by Megatron's own conversion, as its torch_dist strategy
   does. Then DCP's planning runs (collectives) with Megatron's ``MCoreSavePlanner`` and dcp_memstore's
   ``MemoryStorageWriter``; the coordinator creates the checkpoint directory in the store, and every
   rank's trainer makes it on its own node where no rank of the node did: its owner must live until the
   finalize step, which the worker of phase 2 may not (see ``MemoryStorageWriter.finish_later``). Once
   it returns, training may change its tensors.
2. ``AsyncRequest.async_fn`` (Megatron's async worker: a forked process with ``AsyncCallsQueue``, a
   persistent worker process, or inline with ``execute_sync``): this rank's write. Staged items are only
   checksummed and their files renamed into the checkpoint. The write results go to a small msgpack
   record in the checkpoint's directory in the store, since the worker may be another process. The record
   is named for this attempt at the checkpoint id: on a node other than the coordinator's, the directory
   an earlier, unfinished attempt left (its finalize step never ran) is not discarded, and its records
   must not pass for this attempt's.
3. The finalize function (the trainer, every rank, after every rank's worker is done): the results are
   gathered; the coordinator writes ``metadata.json`` (the config Megatron writes again afterwards) and
   ``dcp_memstore.json`` into ``checkpoint_dir``, then the manifest and the COMMITTED marker (the
   checkpoint becomes visible in the store), and evicts beyond ``keep_in_memory``. So every checkpoint
   the store lists can be loaded through Megatron, even if the job dies before Megatron's own write of
   ``metadata.json``; a directory whose save failed before the commit may hold both files, and a load
   of it says the checkpoint is not in the store.

``checkpoint_dir`` maps to the checkpoint id by its base name (see ``checkpoint_dir.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from dcp_memstore.dcp.save_order import SaveApi
from dcp_memstore.dcp.writer import MemoryStorageWriter
from dcp_memstore.megatron import fork_guard, trainer_watch
from dcp_memstore.megatron.checkpoint_dir import (
    BACKEND,
    COMMON_STATE,
    VERSION,
    checkpoint_id_for,
    common_version,
    write_config,
    write_pointer,
)
from dcp_memstore.memstore import MemStore
from dcp_memstore.store import liveness
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.manifest import ShardLocation
from dcp_memstore.store.records import read_record, write_atomic, write_record

log = logging.getLogger(__name__)
# in the store's checkpoint directory, until finalize: a rank's results of one attempt at the checkpoint
RESULTS_RECORD = "megatron-results-r{rank}-{attempt}.msgpack"
WRITER_SUFFIX = ".writer"  # next to the results record: the liveness token of the process writing this rank
PERSISTENT = "persistent"  # the writer marker's second line where Megatron's persistent worker writes
# Named by a StagingTimeoutError (a save waited too long for earlier ones): a Megatron user's earlier saves
# are AsyncRequests, whose errors surface when they are finalized. The writer goes to another process only
# with Megatron's persistent worker; a request it cannot be sent in is dropped by Megatron's queue, which
# then waits for it forever.
MEGATRON_SAVE = SaveApi(
    call="dist_checkpointing.save",
    check="finalize the AsyncRequests of earlier dist_checkpointing.save calls "
    "(AsyncCallsQueue.maybe_finalize_async_calls, which raises a failed save's error) and check that each "
    "was scheduled (AsyncCallsQueue.schedule_async_request) or run (AsyncRequest.execute_sync), and that "
    "Megatron's async worker lives (a dead persistent worker, AsyncCallsQueue(persistent=True), runs "
    "nothing it is sent; a forked writer can hang in os.fork() under Python < 3.12)",
    other_process="Megatron's persistent worker",
    in_process="use Megatron's forked worker (AsyncCallsQueue() without persistent=True). Megatron's queue "
    "has dropped this save's request and waits for it forever: restart the job",
)


LET_GO_AFTER_S = 1.0  # how long a save waits for earlier writes before it looks for requests let go


class MemStoreSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron ``sharded_strategy`` that saves into ``store`` (tmpfs) instead of files in checkpoint_dir.

    Use it with ``dist_checkpointing.save(sd, checkpoint_dir, sharded_strategy=MemStoreSaveStrategy(store),
    async_sharded_save=True)`` and schedule the returned ``AsyncRequest`` (``AsyncCallsQueue`` or
    ``execute_sync()``); synchronous saves work too. It subclasses Megatron's torch_dist strategy (same
    planner, same DCP layout of keys, ShardedObjects handled) so code that expects one accepts it; the
    backend recorded in metadata.json is ``"dcp_memstore"``. Every AsyncRequest it returns must be run and
    finalized, in order (as Megatron's queue does); the store's next save waits until its write is done.

    ``saves_committed`` counts the saves this process finalized (committed), for monitoring and tests.

    With Megatron's persistent worker (``AsyncCallsQueue(persistent=True)``), a save made after that worker
    died while writing fails on every rank at once, saying so: Megatron neither notices nor restarts it,
    so nothing sent to it would ever be written (see ``_dead_persistent_worker``).
    """

    def __init__(self, store: MemStore) -> None:
        if not isinstance(store, MemStore):
            raise TypeError(f"MemStoreSaveStrategy needs a MemStore, got {type(store).__name__}")
        super().__init__(BACKEND, VERSION, keep_only_main_replica=True)
        self.store = store
        self.saves_committed = 0
        # the saves of this strategy not yet finalized, oldest first, for as long as their request lives
        self._unfinalized: list[weakref.ref[_SaveThread]] = []
        fork_guard.install()  # Megatron forks the trainer for each write; see fork_guard

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike
    ) -> AsyncRequest:
        """Stage and plan the save of ``sharded_state_dict`` (the trainer's part); return the request whose
        ``async_fn`` writes this rank's part and whose finalize function commits the checkpoint."""
        cid = checkpoint_id_for(checkpoint_dir)
        common = common_version(checkpoint_dir)  # Megatron (rank 0) has written this save's common.pt
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True
        )
        writer = MemoryStorageWriter(self.store)
        writer.save_api = MEGATRON_SAVE
        staged = _stage(writer, flat, cid)
        dw = _DistWrapper(None, True, 0)
        attempt = uuid.uuid4().hex[:12]
        record = self.store.layout.checkpoint_dir(cid) / RESULTS_RECORD.format(rank=dw.rank, attempt=attempt)
        self._collect_let_go()
        holder = _SaveThread(writer, cid, record)  # returns once earlier saves are written or dead
        try:
            dead_worker = self._dead_persistent_worker()
            if dead_worker is not None:
                writer.fail_when_planning(dead_worker)
            planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
            plan, metadata = _plan(mcore_to_pyt_state_dict(staged, False), writer, planner, dw)
            data = _ResolvedData({item.index: planner.resolve_data(item) for item in plan.items})
        except BaseException:
            holder.release()
            raise
        writer.finish_later()  # this process, which lives until finalize, owns the directory on this node
        _discard_earlier_attempts(record, dw.rank)  # no earlier attempt writes now: reset waited for it
        holder.watch()
        self._unfinalized.append(weakref.ref(holder))
        finalize = functools.partial(
            self._finalize, writer, metadata, dw, holder, record, checkpoint_dir, cid, common
        )
        # a request let go unfinalized (its queue closed with abort=True and dropped) no longer counts as
        # a save in flight once it is collected, even one its worker never started (see _collect_let_go)
        weakref.finalize(finalize, holder.release)
        return AsyncRequest(_write_rank, (writer, plan, data, str(record), os.getpid()), [finalize])

    def _collect_let_go(self) -> None:
        """Before a save waits for earlier ones still being written: once they have taken
        ``LET_GO_AFTER_S`` without ending, collect the garbage, so that the requests let go meanwhile (a
        queue closed with ``abort=True`` and dropped: Megatron's queue keeps its requests in reference
        cycles) stop counting, and this save does not wait for ever for those their worker never started.
        Not sooner: a collection takes a while in a large process (0.25 s here with torch and Megatron
        imported), and the save waits for a write about to end anyway."""
        deadline = time.monotonic() + LET_GO_AFTER_S
        while any(save is not None and save.writing() for save in (ref() for ref in self._unfinalized)):
            if time.monotonic() >= deadline:
                gc.collect()
                return
            time.sleep(0.005)

    def _dead_persistent_worker(self) -> RuntimeError | None:
        """The error for a save made after Megatron's persistent worker died writing an earlier one, or None.

        A writer names itself (``_mark_writer``) before it writes, and says whether it is Megatron's
        persistent worker. A forked writer writes one save; its death fails that save alone, and Megatron
        forks a new one for the next. The persistent worker is sent every save: an unfinalized save whose
        persistent writer died without leaving results means that nothing sent to it since will be
        written. A worker that died before it started a write (idle between saves, or starting up) is not
        recognised: the saves sent to it then wait as for any unfinished save. Nor is a save whose request
        was let go (a queue closed with ``abort=True`` and dropped, whose worker was killed on purpose);
        Megatron's queue keeps its requests in reference cycles, so such a request lives until the garbage
        collector's next pass, which is run here before a save is refused. Called once earlier saves'
        writes are done or their writers dead, so a worker that died writing the previous save is seen
        dead. A store it cannot read (OSError) is taken for a live worker: this rank must not leave the save
        before its collectives."""
        try:
            if self._dead_writer_of_unfinalized() is None:
                return None
            gc.collect()
            return self._dead_writer_of_unfinalized()
        except OSError as e:
            log.warning("could not check whether Megatron's persistent worker lives: %s", e)
            return None

    def _dead_writer_of_unfinalized(self) -> RuntimeError | None:
        """``_dead_persistent_worker``'s check of the saves whose requests are still referenced."""
        for save in filter(None, (ref() for ref in self._unfinalized)):
            record, cid = save.record, save.checkpoint_id
            writer = _writer_of(record)
            if writer is None or not writer.persistent or record.exists():
                continue
            if not liveness.alive(self.store.layout, writer.token):
                return RuntimeError(
                    "Megatron's persistent checkpoint worker of this rank "
                    f"(AsyncCallsQueue(persistent=True)) died while writing checkpoint {cid!r}; Megatron "
                    "neither notices nor restarts it, so no later save through that queue can be written. "
                    "Restart the job: it resumes from the newest committed checkpoint. Close the queue with "
                    "close(abort=True) before this process exits: Megatron's queue otherwise waits at exit "
                    "for the dead worker to acknowledge its stop, for ever"
                )
        return None

    def _finalize(
        self,
        writer: MemoryStorageWriter,
        metadata: Metadata | None,
        dw: _DistWrapper,
        holder: _SaveThread,
        record: Path,
        checkpoint_dir: str | os.PathLike,
        cid: str,
        common: tuple[int, ...] | None,
    ) -> None:
        """Every rank: hand this rank's write results to the coordinator, which commits the checkpoint and
        writes the pointer into ``checkpoint_dir``. A failure on any rank raises on every rank,
        uncommitted; so does a ``common.pt`` that is not the one this save started with (``common``, as
        the coordinator saw it)."""

        def my_results() -> list[WriteResult]:
            try:
                rec = read_record(record)
            except FileNotFoundError:
                raise RuntimeError(
                    f"rank {dw.rank} has no results of its write of checkpoint {cid!r}: the AsyncRequest's "
                    "async_fn did not run to its end (was it scheduled? did Megatron's async worker die?)"
                ) from None
            record.unlink()
            _writer_marker(record).unlink(missing_ok=True)
            if "error" in rec:
                raise RuntimeError(f"rank {dw.rank}: writing checkpoint {cid!r} failed: {rec['error']}")
            return [_decode_result(r) for r in rec["results"]]

        def commit(results: list[list[WriteResult]]) -> None:
            if common_version(checkpoint_dir) != common:
                raise RuntimeError(
                    f"{Path(checkpoint_dir) / COMMON_STATE} was replaced after this save of checkpoint "
                    f"{cid!r} started (a later dist_checkpointing.save into the same directory writes it "
                    "before the store can refuse that save): this save's common state is gone, so it is not "
                    "committed. Save again, into a directory no other save is using"
                )
            # the directory's files first: a checkpoint the store commits is always loadable by Megatron
            write_config(checkpoint_dir)
            write_pointer(checkpoint_dir, self.store, cid, metadata)
            writer.finish(metadata, results)

        try:
            dw.all_reduce("write", my_results, commit)
        finally:
            self._unfinalized = [ref for ref in self._unfinalized if ref() not in (None, holder)]
            holder.release()
            writer.save_ended()
        self.saves_committed += 1


def _stage(writer: MemoryStorageWriter, flat: dict[str, list[Any]], cid: str) -> dict[str, list[Any]]:
    """``flat`` (sharded key -> ShardedTensors/ShardedObjects) with every ShardedTensor replaced by a copy
    whose data is its staged copy in tmpfs (for checkpoint ``cid``); the caller's ShardedTensors are left
    as they are."""
    shards = [
        sh for shs in flat.values() for sh in shs if isinstance(sh, ShardedTensor) and sh.data is not None
    ]
    staged = writer.stage({"data": [sh.data for sh in shards]}, checkpoint_id=cid).get("data")
    if staged is None:  # staging failed on this rank; the planning (a collective) fails on every rank
        return flat
    copies = {}
    for sh, data in zip(shards, staged, strict=True):
        copies[id(sh)] = c = copy.copy(sh)
        c.data = data
    return {key: [copies.get(id(sh), sh) for sh in shs] for key, shs in flat.items()}


def _plan(
    state_dict: dict[str, Any], writer: MemoryStorageWriter, planner: MCoreSavePlanner, dw: _DistWrapper
) -> tuple[SavePlan, Metadata | None]:
    """DCP's planning of a save (collectives on the default group): this rank's final plan, and on the
    coordinator the checkpoint's metadata (with the save's id in its storage_meta)."""
    metadata: Metadata | None = None

    def local_step() -> SavePlan:
        planner.set_up_planner(
            state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=dw.is_coordinator
        )
        writer.set_up_storage_writer(dw.is_coordinator, rank=dw.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(plans)
        if metadata.storage_meta is None:  # Megatron's planner leaves it out, as DCP's default one does
            # the save's id, which the pointer in checkpoint_dir names (see checkpoint_dir.check_saved_into)
            metadata = dataclasses.replace(metadata, storage_meta=writer.storage_meta())
        return writer.prepare_global_plan(plans)

    return planner.finish_plan(dw.reduce_scatter("plan", local_step, global_step)), metadata


class _ResolvedData:
    """The data of each of a rank's write items, resolved in the trainer; stands in for the planner in the
    async worker. The writer only asks its planner for ``resolve_data``, and this, unlike Megatron's planner
    (which holds tensor wrapper subclasses), pickles: staged tensors travel as the tmpfs files'
    descriptors."""

    def __init__(self, data: dict[MetadataIndex, Any]) -> None:
        self.data = data

    def resolve_data(self, item: WriteItem) -> Any:
        return self.data[item.index]


def _write_rank(
    writer: MemoryStorageWriter, plan: SavePlan, data: _ResolvedData, record: str, trainer_pid: int
) -> None:
    """The request's ``async_fn``: write this rank's part of the checkpoint, then leave its results (or its
    error) in ``record`` for the finalize step, which may run in another process. A process other than the
    trainer (process ``trainer_pid``) first arranges to end with it (see ``trainer_watch``).

    An error is not raised here: the finalize step raises it on every rank. Raised here, it would skip this
    rank's finalize in a synchronous save (``execute_sync``), and the other ranks would wait for it in
    finalize's collective until the process group timed out."""
    trainer_watch.watch(trainer_pid)
    try:
        _mark_writer(writer.store.layout, Path(record))
        outcome = {"results": [_encode_result(r) for r in writer.write_data(plan, data).value()]}
    except Exception as e:
        outcome = {"error": f"{type(e).__name__}: {e}"}
    try:
        write_record(Path(record), outcome)
    except OSError as e:  # finalize finds no record, and says so on every rank
        log.error("could not record the outcome of this rank's write in %s: %s", record, e)


def _writer_marker(record: Path) -> Path:
    """Where ``_write_rank`` names the process writing ``record`` (removed with the record at finalize)."""
    return record.with_suffix(WRITER_SUFFIX)


def _mark_writer(layout: StoreLayout, record: Path) -> None:
    """Name the process that writes this rank's part (by its liveness token, see ``store/liveness.py``), so
    that the trainer learns when that process dies before leaving ``record``: Megatron's forked worker may
    be killed (SIGKILL, the OOM killer), and the trainer's next save must not wait for it. A second line
    says that the process is Megatron's persistent worker, to which the trainer's later saves go too."""
    text = liveness.own_token(layout) + (f"\n{PERSISTENT}" if _in_persistent_worker() else "")
    try:
        write_atomic(_writer_marker(record), text.encode())
    except OSError as e:  # then the trainer waits for the record (or the finalize step) alone
        log.warning("could not record which process writes %s: %s", record, e)


def _in_persistent_worker() -> bool:
    """Whether this call runs in Megatron's persistent worker: under its loop
    (``PersistentAsyncCaller.async_loop``), which runs every request the trainer sends, where a forked
    worker runs the request's function as its process's target."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "async_loop" and frame.f_globals.get("__name__") == AsyncRequest.__module__:
            return True
        frame = frame.f_back
    return False


def _discard_earlier_attempts(record: Path, rank: int) -> None:
    """Delete the results records and writer markers that earlier attempts at this checkpoint id left for
    ``rank`` next to ``record``: attempts whose finalize step never ran (Megatron's queue closed with
    ``abort=True``, say) on a node where nothing discarded their directory (the coordinator discards it on
    its own node only). Left there, they would be committed and replicated with this attempt's files."""
    earlier = RESULTS_RECORD.format(rank=rank, attempt="*")
    for pattern in (earlier, Path(earlier).with_suffix(WRITER_SUFFIX).name):
        for path in record.parent.glob(pattern):
            if path.stem != record.stem:
                path.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class _Writer:
    """The process that ``_mark_writer`` named: its liveness token, and whether it is Megatron's
    persistent worker."""

    token: str
    persistent: bool


def _writer_of(record: Path) -> _Writer | None:
    """The process that ``_mark_writer`` named for ``record``; None until one is."""
    try:
        token, _, kind = _writer_marker(record).read_text().partition("\n")
    except FileNotFoundError:
        return None
    return _Writer(token, kind == PERSISTENT) if liveness.is_token(token) else None


def _writer_died(layout: StoreLayout, record: Path) -> bool:
    """Whether the process that ``_mark_writer`` named for ``record`` has ended (False until one is named)."""
    writer = _writer_of(record)
    return writer is not None and not liveness.alive(layout, writer.token)


def _encode_result(r: WriteResult) -> list:
    idx = r.index
    offset = None if idx.offset is None else list(idx.offset)
    return [idx.fqn, offset, idx.index, r.size_in_bytes, r.storage_data.to_record()]


def _decode_result(rec: list) -> WriteResult:
    fqn, offset, index, size, location = rec
    return WriteResult(
        index=MetadataIndex(fqn, offset, index),
        size_in_bytes=int(size),
        storage_data=ShardLocation.from_record(location),
    )


class _SaveThread:
    """Stands in for the thread of a background save while Megatron runs it.

    dcp_memstore keeps a job's background saves in order by the thread each staged save is bound to (the
    writer's ``reset`` binds it): a later save starts only when the threads of earlier ones have ended, and
    a stager recycles the staging slot of a save whose thread ended without writing it. Megatron plans on
    the trainer's thread and writes in its async worker, so this thread calls ``reset`` (waiting there for
    earlier saves) and then lives until this rank's write has left its results ``record`` or its writing
    process has died without (after the planning: ``watch``), or until ``release`` (finalize, or a failed
    planning). A dead writer ends it before the finalize step: the trainer may start its next save first,
    and that save would otherwise wait for this one forever."""

    def __init__(self, writer: MemoryStorageWriter, checkpoint_id: str, record: Path) -> None:
        self.checkpoint_id, self.record = checkpoint_id, record
        self._layout = writer.store.layout
        self._watching = threading.Event()
        self._released = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(writer, checkpoint_id),
            name=f"dcp_memstore-megatron-{checkpoint_id}",
            daemon=True,
        )
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self, writer: MemoryStorageWriter, checkpoint_id: str) -> None:
        try:
            writer.reset(checkpoint_id)
        except BaseException as e:  # reported to the trainer by __init__
            self._error = e
            return
        finally:
            self._started.set()
        delay = 0.001
        while not self._released.wait(delay):
            if self._watching.is_set() and (self.record.exists() or _writer_died(self._layout, self.record)):
                return
            delay = min(delay * 2, 0.02)

    def writing(self) -> bool:
        """Whether this save still counts as being written (the thread lives)."""
        return self._thread.is_alive()

    def watch(self) -> None:
        """The planning is done: end once this save's record appears or its writer has died."""
        self._watching.set()

    def release(self) -> None:
        self._released.set()
