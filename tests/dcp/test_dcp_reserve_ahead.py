"""Files allocated ahead of the next save (async or not), in the background, while a job has fewer
checkpoints than it keeps: the next save claims them, the job never holds more files than in steady
state, a reservation that does not fit is skipped, one waits until its save is ready and stops promptly,
and one killed half-way leaves nothing that a restart does not clear."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.dcp.stager import Stager
from dcp_memstore.store import reserve
from dcp_memstore.store.layout import OWNER, SHARD_SUFFIX
from dcp_memstore.store.pool import FilePool
from dcp_memstore.store.reserve import Reservation


def _state(v: float, n: int = 1 << 18) -> dict:
    return {"w": torch.full((n,), v), "b": torch.arange(1000.0) * v}


def _async_save(store: MemStore, state: dict, cid: str) -> None:
    writer = MemoryStorageWriter(store)
    dcp.async_save(state, checkpoint_id=cid, storage_writer=writer, no_dist=True).result(timeout=60)
    Stager.of(store).wait_reserved()


def _sync_save(store: MemStore, state: dict, cid: str) -> None:
    dcp.save(state, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True)
    Stager.of(store).wait_reserved()


SAVES = pytest.mark.parametrize("save", [_async_save, _sync_save], ids=["async_save", "save"])


def _load(store: MemStore, cid: str, n: int = 1 << 18) -> dict:
    out = {"w": torch.zeros(n), "b": torch.zeros(1000)}
    dcp.load(out, checkpoint_id=cid, storage_reader=MemoryStorageReader(store), no_dist=True)
    return out


def _inodes(directory: Path) -> set[int]:
    return {e.inode() for e in os.scandir(directory) if e.name.endswith(SHARD_SUFFIX)}


def _shard_files(store: MemStore) -> list[Path]:
    return [p for p in store.layout.job_dir.rglob(f"*{SHARD_SUFFIX}") if p.is_file()]


@SAVES
def test_the_second_save_claims_the_files_allocated_ahead_for_it(shm_dir, save):
    store = MemStore(root=shm_dir, job_id="job", io_threads=2, keep_in_memory=2)
    try:
        save(store, _state(1.0), "s0")
        reserved = _inodes(FilePool(store.layout, 0).dir)
        assert len(reserved) == 2  # one per I/O thread, like the save's own files
        save(store, _state(2.0), "s1")
        assert _inodes(store.layout.checkpoint_dir("s1")) == reserved
        for cid, v in (("s0", 1.0), ("s1", 2.0)):
            out = _load(store, cid)
            assert torch.equal(out["w"], torch.full((1 << 18,), v))
            assert torch.equal(out["b"], torch.arange(1000.0) * v)
    finally:
        store.close()


@SAVES
def test_a_job_never_holds_more_files_than_in_steady_state(shm_dir, save):
    keep, threads = 2, 2
    store = MemStore(root=shm_dir, job_id="job", io_threads=threads, keep_in_memory=keep)
    try:
        counts = []
        for i in range(6):
            save(store, _state(float(i)), f"s{i}")
            counts.append(len(_shard_files(store)))
        # keep_in_memory checkpoints and one more save's files, never more: from the third save on the
        # next save reuses an evicted checkpoint's files instead of a reservation
        assert max(counts) <= (keep + 1) * threads, counts
        assert counts[:2] == [2 * threads, 3 * threads], counts  # saves 1 and 2 each reserved the next
        assert store.list_checkpoints() == ["s4", "s5"]
        assert torch.equal(_load(store, "s5")["w"], torch.full((1 << 18,), 5.0))
    finally:
        store.close()


@pytest.fixture
def allocated(monkeypatch) -> list[int]:
    """Sizes of the files reservations allocate (the real allocation still happens)."""
    sizes: list[int] = []
    real = reserve.allocate_file
    monkeypatch.setattr(reserve, "allocate_file", lambda path, size: sizes.append(size) or real(path, size))
    return sizes


def test_a_reservation_that_does_not_fit_in_free_memory_is_skipped(small_tmpfs, allocated):
    store = MemStore(root=small_tmpfs, job_id="job", io_threads=1, keep_in_memory=1)
    n = 5 << 18  # 5 MiB of an 8 MiB tmpfs: the next save's 5 MiB cannot be allocated ahead
    try:
        _async_save(store, _state(3.0, n), "s0")
        assert allocated == []  # skipped before allocating anything, not stopped by ENOSPC half-way
        # no files, no reservation area; only the record of the process that stages rank 0's saves
        assert [p.name for p in FilePool(store.layout, 0).dir.iterdir()] == [OWNER]
        assert torch.equal(_load(store, "s0", n)["w"], torch.full((n,), 3.0))
    finally:
        store.close()


def test_a_reservation_that_fits_allocates_through_the_same_call(shm_dir, allocated):
    store = MemStore(root=shm_dir, job_id="job", io_threads=1, keep_in_memory=1)
    try:
        _async_save(store, _state(3.0), "s0")
        assert len(allocated) == 1  # the check above watches the call that allocates
    finally:
        store.close()


def test_a_save_while_its_files_are_still_being_allocated_ahead_has_room(small_tmpfs, monkeypatch):
    """3 MiB checkpoints in an 8 MiB tmpfs: while the reservation after s0 still holds its file in its area
    (each allocation patched to take 1 s more: a timing no real run hits on demand), free space is 2 MiB.
    The next dcp.save stops the reservation before checking space, so the reserved file counts (it is in
    the pool) and the save claims it, instead of failing for lack of space."""
    real = reserve.allocate_file

    def slow(path, size):
        fd = real(path, size)
        time.sleep(1.0)
        return fd

    monkeypatch.setattr(reserve, "allocate_file", slow)
    store = MemStore(root=small_tmpfs, job_id="job", io_threads=1, keep_in_memory=2)
    n = 3 << 18
    try:
        dcp.save(_state(1.0, n), checkpoint_id="s0", storage_writer=MemoryStorageWriter(store), no_dist=True)
        _wait_for_a_reserved_file(FilePool(store.layout, 0).dir)
        dcp.save(_state(2.0, n), checkpoint_id="s1", storage_writer=MemoryStorageWriter(store), no_dist=True)
        for cid, v in (("s0", 1.0), ("s1", 2.0)):
            assert torch.equal(_load(store, cid, n)["w"], torch.full((n,), v))
    finally:
        store.close()


_RESERVE_FOREVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from dcp_memstore.store.layout import StoreLayout
    from dcp_memstore.store.reserve import Reservation

    layout = StoreLayout(Path(sys.argv[1]), "job")
    layout.ensure()
    Reservation(layout, 0, [64 << 20] * 64, cuda_device=None).wait()  # 4 GiB: killed long before the end
    """
)


def test_a_reservation_killed_half_way_is_cleared_at_the_next_start(shm_dir):
    child = subprocess.Popen([sys.executable, "-c", _RESERVE_FOREVER, str(shm_dir)])
    pool = shm_dir / "job" / "pool" / "rank0"
    try:
        _wait_for_a_reserved_file(pool, child)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert [p.name.startswith("reserve-") for p in pool.iterdir()] == [True]
    store = MemStore(root=shm_dir, job_id="job", io_threads=1)  # start-up clears what dead processes left
    try:
        assert not [p for p in pool.iterdir() if p.is_dir()]  # its files went into the pool
        dcp.save(_state(4.0), checkpoint_id="after", storage_writer=MemoryStorageWriter(store), no_dist=True)
        assert torch.equal(_load(store, "after")["w"], torch.full((1 << 18,), 4.0))
    finally:
        store.close()


def test_closing_the_store_stops_its_reservation_and_closing_another_store_does_not(shm_dir):
    store = MemStore(root=shm_dir, job_id="job", io_threads=1)
    other = MemStore(root=shm_dir, job_id="job", io_threads=1)  # e.g. an evaluation loop's store
    pool = FilePool(store.layout, 0).dir
    # 4 GiB: far from done at close
    reservation = Reservation(store.layout, 0, [64 << 20] * 64, cuda_device=None, owner=store)
    _wait_for_a_reserved_file(pool)
    other.close()
    assert reservation._thread.is_alive()
    store.close()
    pooled = sorted(pool.glob(f"*{SHARD_SUFFIX}"))
    assert 0 < len(pooled) < 64  # it had started, and it stopped
    assert not [p for p in pool.iterdir() if p.is_dir()]  # what it allocated went into the pool
    time.sleep(0.5)
    assert sorted(pool.glob(f"*{SHARD_SUFFIX}")) == pooled  # and nothing is allocated after close


def test_stopping_a_reservation_returns_within_one_step_of_faulting_in(shm_dir):
    """A 3 GiB file (faulting it in takes 1.7 s or more on the development VM): once it is allocated and
    being faulted in, close() returns within a fraction of that, and the file, allocated in full, is in
    the pool for the next save."""
    store = MemStore(root=shm_dir, job_id="job", io_threads=1)
    pool = FilePool(store.layout, 0).dir
    size = 3 << 30
    Reservation(store.layout, 0, [size], cuda_device=None, owner=store)
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size == size for p in pool.glob(f"reserve-*/*{SHARD_SUFFIX}")):
        assert time.monotonic() < deadline, "the file was never allocated"
        time.sleep(0.005)
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 0.8
    assert [p.stat().st_size for p in pool.glob(f"*{SHARD_SUFFIX}")] == [size]


def test_a_reservation_allocates_nothing_until_its_save_is_ready(shm_dir):
    """Other ranks may still be allocating the save's own files: nothing is allocated before ``ready``."""
    store = MemStore(root=shm_dir, job_id="job", io_threads=1)
    ready = threading.Event()
    try:
        reservation = Reservation(
            store.layout, 0, [8 << 20], cuda_device=None, owner=store, ready=ready.is_set
        )
        time.sleep(0.3)
        assert _shard_files(store) == []
        ready.set()
        reservation.wait()
        assert [p.stat().st_size for p in _shard_files(store)] == [8 << 20]
    finally:
        store.close()


def test_a_new_reservation_of_a_job_stops_the_one_before(shm_dir):
    """One reservation per job and process: two saves' reservations never allocate side by side."""
    store = MemStore(root=shm_dir, job_id="job", io_threads=1, keep_in_memory=4)
    stager = Stager.of(store)
    try:
        stager.reserve_next(0, [64 << 20] * 64, None, ready=lambda: True, unstaged=True)  # 4 GiB
        first = stager._reservation
        _wait_for_a_reserved_file(FilePool(store.layout, 0).dir)
        stager.reserve_next(0, [1 << 20], None, ready=lambda: True, unstaged=True)
        assert first is not None and not first._thread.is_alive()
        assert stager._reservation is not first
    finally:
        store.close()


def _wait_for_a_reserved_file(pool: Path, child: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + 60
    while not (pool.exists() and any(any(p.glob(f"*{SHARD_SUFFIX}")) for p in pool.iterdir() if p.is_dir())):
        assert child is None or child.poll() is None, "the reserving process ended"
        assert time.monotonic() < deadline, "the reservation never started"
        time.sleep(0.01)
