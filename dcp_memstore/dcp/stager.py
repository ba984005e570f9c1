"""Staging for ``dcp.async_save``: copy the state dict's tensors straight into shard files on tmpfs.

The tensors are copied once, into a staging slot's shard files (GPU tensors by DMA into the pinned file
mapping on a side stream, CPU tensors by memcpy in parallel threads), and the state dict handed to DCP
views those files. The background save then only checksums them and renames the files into the
checkpoint: no second copy. Training resumes as soon as ``stage`` returns.

At most ``max_in_flight`` saves per job and process are in flight; ``stage`` waits for the oldest to be
over (``Stager._active_slots``: committed where DCP's executor runs it, else written).
While the job holds fewer checkpoints than it keeps, each save also has the next one's files allocated
in the background (``store/reserve.py``), so that only the first save pays for new tmpfs pages.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dcp_memstore.dcp import state_tree, storable
from dcp_memstore.dcp.save_order import SaveApi, SaveOrder, Ticket, timeout_advice, wait_while
from dcp_memstore.errors import StagingTimeoutError
from dcp_memstore.memstore import MemStore
from dcp_memstore.store import liveness
from dcp_memstore.store.catalog import claim_owner, committed, recycle, use_pool
from dcp_memstore.store.device_copy import DeviceToHost
from dcp_memstore.store.faults import crash_point
from dcp_memstore.store.layout import shard_name, slot_name
from dcp_memstore.store.mapping import MAPPINGS, MappedFile, cuda_index
from dcp_memstore.store.packing import pack
from dcp_memstore.store.pool import FILE_ALIGN, FilePool, round_up
from dcp_memstore.store.reserve import Reservation
from dcp_memstore.store.space import space_errors
from dcp_memstore.store.threads import run_parallel

log = logging.getLogger(__name__)


def current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Stager:
    """Stages state dicts of one job in this process (shared by every writer of the job).

    It lives while a store of the job that used it is open: ``close()`` of the last one releases it (the
    store, and the GPU side streams and bounce buffers it holds), and the job's next store gets a new one.
    A process that opens and closes many stores (a notebook, an evaluation loop over jobs) keeps none."""

    _instances: dict[str, Stager] = {}
    _instances_lock = threading.Lock()

    @classmethod
    def of(cls, store: MemStore) -> Stager:
        """The job's stager in this process, using ``store``'s current settings. For a closed store (a
        background save still running after ``close()``) a stager of its own, kept by nothing."""
        key = str(store.layout.job_dir)
        with cls._instances_lock:
            if store.closed:
                return cls(store)
            st = cls._instances.get(key)
            if st is None:
                st = cls._instances[key] = cls(store)
            st.store = store
            if store not in st._users:
                st._users.add(store)
                store.on_close(functools.partial(st._store_closed, store))
            return st

    def __init__(self, store: MemStore) -> None:
        self.store = store
        self.order = SaveOrder.of(str(store.layout.job_dir))
        self._users: weakref.WeakSet[MemStore] = weakref.WeakSet()  # the open stores that used it
        self._lock = threading.Lock()
        self._d2h: DeviceToHost | None = None
        self._reservation: Reservation | None = None
        self._reserve_lock = threading.Lock()  # not _lock: stage() holds that while it swaps reservations

    def _store_closed(self, store: MemStore) -> None:
        """``store`` is closing: recycle the slots of failed saves, and once no open store of the job uses
        this stager, release it (the reservations of ``store`` were stopped by its ``close()``)."""
        self.reclaim_slots()
        key = str(store.layout.job_dir)
        with Stager._instances_lock:
            self._users.discard(store)
            if self._users:
                return
            if Stager._instances.get(key) is self:
                del Stager._instances[key]
        with self._reserve_lock:
            self._reservation = None
        self._d2h = None

    def stage(
        self,
        state_dict: dict[str, Any],
        check_space: Callable[[int, int, list[int]], None],
        api: SaveApi,
    ) -> tuple[dict[str, Any], Ticket, int]:
        """Copy ``state_dict``'s tensors into a new staging slot; return the staged state dict, its ticket
        and the bytes copied.
        ``check_space(needed, rank, files)`` raises InsufficientSpaceError, before anything is allocated, if
        the slot's ``needed`` bytes (shard files of ``files`` bytes among them) do not fit (the writer's
        check, which may first reclaim failed saves' files).
        ``api`` (how the user makes saves) is named in the StagingTimeoutError's advice.

        Tensors whose bytes are not their value (``storable.problem``) are cloned instead, and the write
        refuses them by DCP's name for them. Values that DCP pickles whole are copied by ``rebuild``."""
        with self._lock:
            rank = current_rank()
            self._wait_for_room(api)
            self.wait_reserved(stop=True)  # after the wait: it had that time too
            MAPPINGS.prune()
            originals = [t for t in state_tree.tensors(state_dict) if storable.problem(t) is None]
            sizes = [t.numel() * t.element_size() for t in originals]
            placements, file_sizes = pack(sizes, self.store.io_threads)
            pool = FilePool(self.store.layout, rank)
            # the files as allocated (whole pages), and the page of the slot's owner record
            needed = sum(round_up(size) for size in file_sizes) + FILE_ALIGN
            check_space(needed, rank, file_sizes)
            ticket = self.order.issue()
            slot = self._slot_for(rank, ticket)
            try:
                with space_errors(self.store.layout.root, needed, "while staging"):
                    slot.mkdir(parents=True)  # a tmpfs full before the files were allocated
                    crash_point("stage-slot", rank)
                    claim_owner(self.store.layout, slot)
                    use_pool(self.store.layout, rank)  # its pool serves this process's next save
                claims = pool.claims(file_sizes)
                claimed = run_parallel(  # a new file's page faults are taken in parallel
                    lambda b: claims.acquire(b, slot / shard_name(rank, b)),
                    range(len(file_sizes)),
                    self.store.io_threads,
                    pool="stage",
                )
                files = [mf for mf, _ in claimed]
                views = [
                    files[p.bin].tensor(p.offset, t.dtype, t.shape)
                    for t, p in zip(originals, placements, strict=True)
                ]
                self._copy(originals, views, placements, files)
                reused = sum(r for _, r in claimed)
                log.debug(
                    "rank %d staged %d tensors for async_save; shard files: %d reused, %d new",
                    rank, len(originals), reused, len(claimed) - reused,
                )  # fmt: skip
                gpu = next((t.device for t in originals if t.device.type == "cuda"), None)
                # every rank has staged once this save's slot is written or given back (after planning)
                self.reserve_next(rank, file_sizes, gpu, ready=lambda: not slot.exists())
                by_id = {id(t): v for t, v in zip(originals, views, strict=True)}

                def replace(t: torch.Tensor) -> torch.Tensor:
                    v = by_id.get(id(t))
                    if v is None:
                        return t.detach().cpu() if t.device.type == "cuda" else t.detach().clone()
                    return v.requires_grad_(True) if t.requires_grad and v.is_floating_point() else v

                return state_tree.rebuild(state_dict, replace), ticket, sum(sizes)
            except BaseException:
                self.order.cancel(ticket.seq)
                recycle(self.store.layout, slot)
                raise

    def hold_place(self) -> Ticket:
        """A ticket with an empty staging slot, for a save whose staging failed here but whose background
        save still runs (to fail on every rank, see the writer): later saves wait for it as for any other.
        Without room even for the slot, the ticket alone keeps its place in the order."""
        ticket = self.order.issue()
        slot = self._slot_for(current_rank(), ticket)
        try:
            slot.mkdir(parents=True)
            claim_owner(self.store.layout, slot)
        except OSError:
            recycle(self.store.layout, slot)
            ticket.slot = None
        return ticket

    def _slot_for(self, rank: int, ticket: Ticket) -> Path:
        """The staging slot of ``ticket`` (not made yet), named for ``clear_abandoned``; set on the ticket."""
        layout = self.store.layout
        slot = layout.staging_dir / slot_name(
            rank, liveness.own_token(layout), ticket.seq, uuid.uuid4().hex[:8]
        )
        ticket.slot = str(slot)
        return slot

    def _copy(
        self, src: list[torch.Tensor], dst: list[torch.Tensor], placements: list, files: list[MappedFile]
    ) -> None:
        """GPU tensors by DMA (side stream), the others (CPU, or any other device) by ``copy_`` with one
        thread per file; returns when done."""
        gpu = [
            (src[i], dst[i], files[placements[i].bin]) for i, t in enumerate(src) if t.device.type == "cuda"
        ]
        if gpu:
            d2h = self._d2h = self._d2h or DeviceToHost()  # one read: close() may drop it meanwhile
            d2h.copy(gpu)
        by_bin: dict[int, list[int]] = {}
        for i, t in enumerate(src):
            if t.device.type != "cuda":
                by_bin.setdefault(placements[i].bin, []).append(i)

        def copy_bin(idx: list[int]) -> None:
            for n, i in enumerate(idx):
                dst[i].copy_(src[i].detach())
                if n == 0:
                    crash_point("stage-copy", current_rank())

        run_parallel(copy_bin, by_bin.values(), self.store.io_threads, pool="stage")

    def wait_reserved(self, stop: bool = False) -> None:
        """Return once the files being allocated ahead of the next save, if any, are in the pool. With
        ``stop``, once those it finished are: the save about to stage allocates the rest itself (at the
        trainer's priority, not the reservation's)."""
        with self._reserve_lock:
            reservation, self._reservation = self._reservation, None
        if reservation is not None and stop:
            reservation.stop()
        elif reservation is not None:
            reservation.wait()

    def reserve_next(
        self,
        rank: int,
        file_sizes: list[int],
        gpu: torch.device | None,
        ready: Callable[[], bool],
        unstaged: bool = False,
    ) -> None:
        """Have the next save's files allocated in the background if it could not reuse an evicted
        checkpoint's: when the checkpoints committed plus the saves in flight (this one included: a staged
        save by its slot, an ``unstaged`` one, ``dcp.save``, counted here) do not exceed keep_in_memory,
        this save's commit evicts nothing. The job then never holds more files than in steady state.

        Allocation begins once ``ready()`` (this save is past the point where other ranks allocate its
        files: a reservation must not take the memory a slower rank still needs for this save). One
        reservation per job in this process: a new one stops the one before. With ``gpu`` (the GPU of the
        save's tensors), the files are also page-locked for that GPU. None for a closed store: its
        ``close()`` stopped its reservations already, and would not stop this one."""
        if self.store.closed:
            return
        try:
            held = len(committed(self.store.layout)) + len(self._active_slots()) + int(unstaged)
            if held > self.store.keep_in_memory:
                return
            device = None if gpu is None else cuda_index(gpu)
            with self._reserve_lock:
                if self._reservation is not None:
                    self._reservation.stop()
                self._reservation = Reservation(
                    self.store.layout,
                    rank,
                    file_sizes,
                    cuda_device=device,
                    owner=self.store,
                    ready=ready,
                    ready_timeout_s=self.store.stage_timeout_s,
                )
        except Exception as e:  # noqa: BLE001 - only an optimisation: this save is staged already
            log.info("could not start allocating the next save's files ahead of time: %s", e)

    def _wait_for_room(self, api: SaveApi) -> None:
        """Block until fewer than max_in_flight of this job's saves staged in this process are in flight."""
        limit = self.store.max_in_flight
        active = wait_while(
            lambda: a if len(a := self._active_slots()) >= limit else [], self.store.stage_timeout_s
        )
        if active:
            raise StagingTimeoutError(
                f"async save waited {self.store.stage_timeout_s:.0f}s for earlier saves to commit "
                f"(still in flight: {', '.join(map(_in_flight, active))}); {timeout_advice(active, api)}"
            )

    def reclaim_slots(self) -> None:
        """Recycle the slots of saves that ended without writing them (they failed), and of saves that never
        started; the slots of saves still in flight stay theirs."""
        self._active_slots()

    def _active_slots(self) -> list[Ticket]:
        """The tickets of saves in flight: staged and not written yet, or, run by DCP's executor (THREAD or
        PROCESS), written and not over there (committed, the checkpoint beyond ``keep_in_memory`` evicted,
        or failed). A save counted only until it was written let the next one stage while its own files
        and the checkpoint it evicts still held their memory: S x (keep_in_memory + max_in_flight + 1) at
        once. Saves run by other threads count until written: such a thread may live on after its save
        (a pool of the caller's), and Megatron's saves commit on the trainer's thread, at finalize."""
        for slot in self.order.take_abandoned():
            recycle(self.store.layout, Path(slot))
        active = []
        for t in self.order.tickets():
            if t.slot_left() and t.finished():  # its save ended without writing it: an error elsewhere
                recycle(self.store.layout, Path(t.slot))
                continue
            if t.slot_left() or (t.executor_file is not None and not t.over()):
                active.append(t)
        return active


def _in_flight(ticket: Ticket) -> str:
    """A save in flight, for messages: its checkpoint (or place in the order) and its staging slot, if any
    (``hold_place`` gives a ticket none)."""
    slot = f"staged in {Path(ticket.slot).name}" if ticket.slot is not None else "no staging slot"
    return f"{ticket.describe()}, {slot}"
