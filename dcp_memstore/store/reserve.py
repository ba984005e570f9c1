"""Allocating the next save's shard files ahead of time, in the background.

Until a job holds ``keep_in_memory`` checkpoints, every save needs new tmpfs files, and allocating,
zeroing and faulting in their pages is most of what such a save costs: on the development VM, where the
host reclaims memory the guest freed, 0.6 to 3.4 s per GiB, while training waits. Once a save has been
staged (``dcp.async_save``) or written (``dcp.save``), and when its commit will not evict a checkpoint
whose files the next save could reuse, the stager reserves files of the same sizes here: a background
thread at low CPU priority waits until the save is past the point where other ranks allocate its files,
allocates them in an area of its own inside the rank's pool directory, maps and faults them in
(page-locked for CUDA where the save staged GPU tensors) and moves them into the rank's pool, where the
next save claims them as it would claim the files of an evicted checkpoint.

The job never holds more files this way than it does in steady state (``keep_in_memory`` checkpoints plus
the saves in flight), a reservation that does not fit in free memory is skipped, and one that fails is
logged and dropped: the next save then allocates its files itself, as without a reservation. The next
save stops a reservation still running (within one ``FAULT_STEP`` of faulting in pages; the file being
faulted in is kept, and the save faults in the rest as it copies) and allocates what it had not started;
closing the store whose save started it, or the interpreter, stops it too, so a closed store allocates
nothing more.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import torch

from dcp_memstore.store import liveness
from dcp_memstore.store.catalog import claim_owner, recycle
from dcp_memstore.store.environment import LOCAL_WORLD_SIZE_MEANING, env_int
from dcp_memstore.store.layout import StoreLayout, reserve_name, shard_name
from dcp_memstore.store.mapping import MAPPINGS, MappedFile
from dcp_memstore.store.pool import FilePool
from dcp_memstore.store.space import allocate_file, free_bytes
from dcp_memstore.store.threads import yield_cpu_to_training

log = logging.getLogger(__name__)
FAULT_STEP = 64 << 20  # a stopped reservation returns within one step (about 0.03 to 0.2 s here)
READY_POLL_S = 0.01
_lock = threading.Lock()
_running: set[Reservation] = set()


def stop_reservations(owner: object | None = None) -> None:
    """Stop this process's reservations (those started for ``owner``, a store, or all) and wait until they
    have stopped. Closing one store of a job leaves the reservations of its other stores running."""
    with _lock:
        mine = [r for r in _running if owner is None or r.owner is owner]
    for r in mine:
        r.stop()


def _forget_in_child() -> None:
    """A forked child has none of the parent's threads (Megatron forks the trainer)."""
    global _lock
    _lock = threading.Lock()
    _running.clear()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(stop_reservations)  # not inside cudaHostRegister while CUDA shuts down


class Reservation:
    """Pool files for the next save of one rank, being allocated on a background thread."""

    def __init__(
        self,
        layout: StoreLayout,
        rank: int,
        sizes: list[int],
        cuda_device: int | None,
        owner: object | None = None,
        ready: Callable[[], bool] | None = None,
        ready_timeout_s: float = 600.0,
    ) -> None:
        """Start allocating files of ``sizes`` bytes for ``rank``; with ``cuda_device``, also page-lock
        them for CUDA (from that device, the caller's: a new thread would start a context on device 0).
        ``owner``: the store whose ``close()`` stops it. ``ready``: allocation waits until it returns True
        (given up after ``ready_timeout_s``)."""
        self.layout, self.rank, self.sizes, self.cuda_device = layout, rank, sizes, cuda_device
        self.owner, self.ready, self.ready_timeout_s = owner, ready, ready_timeout_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcp_memstore_reserve", daemon=True)
        with _lock:
            _running.add(self)
        self._thread.start()

    def wait(self) -> None:
        """Return once the files are in the pool (or the reservation gave up)."""
        self._thread.join()

    def stop(self) -> None:
        """Fault in no further step, allocate no further file, and return once the files allocated so far
        are in the pool."""
        self._stopping.set()
        self.wait()

    def _fault_in(self, mf: MappedFile) -> bool:
        """Fault ``mf``'s pages in, ``FAULT_STEP`` bytes at a time so that ``stop`` is heard within one step
        (faulting in new pages is most of a reservation's time: zeroing them, and on a VM the host's faults).
        Returns whether it got to the end. A file left part-way still serves the next save, which faults in
        the rest as it copies."""
        for offset in range(0, mf.size, FAULT_STEP):
            if self._stopping.is_set():
                return False
            mf.populate(offset, FAULT_STEP)
        return True

    def _run(self) -> None:
        try:
            self._reserve()
        finally:
            with _lock:
                _running.discard(self)

    def _wait_ready(self) -> bool:
        """Whether ``ready`` came true before a stop or the timeout."""
        deadline = time.monotonic() + self.ready_timeout_s
        while self.ready is not None and not self.ready():
            if self._stopping.wait(READY_POLL_S) or time.monotonic() > deadline:
                return False
        return True

    def _reserve(self) -> None:
        yield_cpu_to_training()
        pool = FilePool(self.layout, self.rank)
        try:
            if not self._wait_ready():
                return
            missing = pool.unmatched(self.sizes)  # page-rounded, as allocated
            if not missing:
                return
            needed = sum(missing)
            free = free_bytes(self.layout.job_dir)
            ranks_here = env_int(
                "LOCAL_WORLD_SIZE", 1, LOCAL_WORLD_SIZE_MEANING
            )  # they may reserve as much now
            if needed * ranks_here > free:
                log.debug("no reservation of %d bytes (x %d ranks): %d bytes free", needed, ranks_here, free)
                return
            pool.dir.mkdir(exist_ok=True)  # not parents: a store deleted meanwhile stays deleted
            area = pool.dir / reserve_name(self.rank, liveness.own_token(self.layout), uuid.uuid4().hex[:8])
            area.mkdir()
            try:
                # a process killed from here on leaves the area to clear_abandoned
                claim_owner(self.layout, area)
                if self.cuda_device is not None:
                    torch.cuda.set_device(self.cuda_device)
                for b, size in enumerate(missing):
                    if self._stopping.is_set():
                        break
                    # new files only: a claim from the pool would delete the pooled files it has no use for
                    mf = MAPPINGS.map_fd(allocate_file(area / shard_name(self.rank, b), size), populate=False)
                    if self._fault_in(mf) and self.cuda_device is not None:
                        mf.pin_for_cuda(self.cuda_device)
            finally:
                recycle(self.layout, area)  # into the pool: what was allocated, also after an error
        except Exception as e:  # noqa: BLE001 - only an optimisation: the next save allocates its files
            log.info(
                "allocating the next save's files ahead of time failed (%s); it allocates them itself", e
            )
