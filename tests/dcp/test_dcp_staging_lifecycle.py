"""Staged saves that are misused or never run: clear errors, and later saves are never held up by them."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.dcp import writer as writer_module


def _state(v: float) -> dict:
    return {"w": torch.full((1000,), v), "b": torch.arange(100.0) * v}


def _staging(store: MemStore) -> list[str]:
    return os.listdir(store.layout.staging_dir)


def _load(store: MemStore, cid: str) -> dict:
    out = {"w": torch.zeros(1000), "b": torch.zeros(100)}
    dcp.load(out, checkpoint_id=cid, storage_reader=MemoryStorageReader(store), no_dist=True)
    return out


def test_second_stage_on_a_writer_whose_first_save_has_not_started_is_refused(store):
    store.max_in_flight, store.stage_timeout_s = (
        2,
        5.0,
    )  # two saves may overlap, so the writer must tell them apart
    writer = MemoryStorageWriter(store)
    writer.stage(_state(1.0))  # staged, but no save has run it yet
    with pytest.raises(ValueError, match="its own MemoryStorageWriter"):
        writer.stage(_state(2.0))
    assert len(_staging(store)) == 1  # the refused stage left nothing behind


def test_a_staged_save_that_never_runs_does_not_block_later_saves(store):
    store.stage_timeout_s = 5.0
    writer = MemoryStorageWriter(store)
    writer.stage(_state(1.0))  # e.g. async_save failed after staging: the writer is dropped
    del writer
    gc.collect()  # the writer's finalizer notes the save that will never run
    dcp.async_save(
        _state(2.0), checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True
    ).result(timeout=30)
    dcp.save(_state(3.0), checkpoint_id="b", storage_writer=MemoryStorageWriter(store), no_dist=True)
    assert torch.equal(_load(store, "a")["w"], torch.full((1000,), 2.0))
    assert torch.equal(_load(store, "b")["w"], torch.full((1000,), 3.0))
    assert _staging(store) == []  # the abandoned slot went back to the pool


def test_one_writer_reused_for_sequential_async_saves(store):
    writer = MemoryStorageWriter(store)
    for i in range(4):
        dcp.async_save(_state(float(i)), checkpoint_id=f"s{i}", storage_writer=writer, no_dist=True).result()
    assert store.list_checkpoints() == ["s2", "s3"]
    assert torch.equal(_load(store, "s3")["b"], torch.arange(100.0) * 3)
    assert _staging(store) == []


@pytest.mark.parametrize("lazy", ["conj", "neg"])
@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_conjugate_and_negative_views_are_stored_by_value(store, lazy, mode):
    base = torch.complex(torch.arange(8.0), torch.arange(8.0) + 100)
    t = base.conj() if lazy == "conj" else torch._neg_view(base)
    expected = t.resolve_conj().resolve_neg().clone()
    save = getattr(dcp, mode)
    result = save({"z": t}, checkpoint_id="z", storage_writer=MemoryStorageWriter(store), no_dist=True)
    if mode == "async_save":
        result.result()
    out = {"z": torch.zeros(8, dtype=torch.complex64)}
    dcp.load(out, checkpoint_id="z", storage_reader=MemoryStorageReader(store), no_dist=True)
    assert torch.equal(out["z"], expected)


def test_sync_save_right_after_async_save_on_the_same_writer_waits_for_it(store):
    writer = MemoryStorageWriter(store)
    fut = dcp.async_save(_state(1.0), checkpoint_id="a", storage_writer=writer, no_dist=True)
    dcp.save(
        _state(2.0), checkpoint_id="b", storage_writer=writer, no_dist=True
    )  # must not take a's staged data
    fut.result(timeout=30)
    assert store.list_checkpoints() == ["a", "b"]
    assert torch.equal(_load(store, "a")["w"], torch.full((1000,), 1.0))
    assert torch.equal(_load(store, "b")["w"], torch.full((1000,), 2.0))
    dcp.async_save(_state(3.0), checkpoint_id="c", storage_writer=writer, no_dist=True).result(timeout=30)
    assert torch.equal(_load(store, "c")["w"], torch.full((1000,), 3.0))


class _FailingPlanner(DefaultSavePlanner):
    """Fails the background save after staging, as any error in DCP's planning would."""

    def create_local_plan(self):
        raise RuntimeError("planning failed")


def test_close_gives_back_the_staged_files_of_a_failed_async_save(store):
    """A failed save at the end of a job must not leave a checkpoint's worth of staged files behind, also
    when the store is closed right after ``fut.result()`` raised, while DCP's save thread still runs (here
    held in a callback of the save's future, which runs in that thread after the future is set)."""
    planned, closed = threading.Event(), threading.Event()

    class _Planner(_FailingPlanner):
        def create_local_plan(self):
            planned.wait(10)  # until the callback below is registered on the pending future
            return super().create_local_plan()

    fut = dcp.async_save(
        _state(1.0), checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True,
        planner=_Planner(),
    )  # fmt: skip
    fut.add_done_callback(lambda _: closed.wait(10))
    planned.set()
    with pytest.raises(BaseException, match="planning failed"):  # noqa: B017 - CheckpointException
        fut.result(timeout=30)
    try:
        assert len(_staging(store)) == 1
        store.close()
        assert _staging(store) == []
        assert list(store.layout.checkpoints_dir.iterdir()) == []
    finally:
        closed.set()


def _async_save(store: MemStore, cid: str, v: float) -> None:
    writer = MemoryStorageWriter(store)
    dcp.async_save(_state(v), checkpoint_id=cid, storage_writer=writer, no_dist=True).result(timeout=30)


def test_a_closed_store_and_what_its_saves_staged_with_are_released(shm_dir):
    """A process that opens and closes many stores (a notebook, an evaluation loop over jobs) must not
    keep each closed store, with what staging its async saves held (GPU bounce buffers), for its life.
    A store of the same job opened later saves as before."""
    closed = []
    for job in ("job-a", "job-b", "job-a"):
        s = MemStore(root=shm_dir, job_id=job, io_threads=1)
        _async_save(s, f"{job}-{len(closed)}", 1.0)
        s.close()
        closed.append(weakref.ref(s))
        del s
    deadline = time.monotonic() + 10  # DCP's save threads drop their references as they wind down
    while gc.collect() is not None and any(ref() is not None for ref in closed):
        assert time.monotonic() < deadline, "closed stores are still kept alive"
        time.sleep(0.01)
    with MemStore(root=shm_dir, job_id="job-a", io_threads=1) as s:
        assert s.list_checkpoints() == ["job-a-0", "job-a-2"]
        assert torch.equal(_load(s, "job-a-2")["w"], torch.full((1000,), 1.0))


def test_closing_one_store_of_a_job_leaves_another_open_one_saving(shm_dir):
    """Two stores of one job open in a process share its staging: closing one must not break the other's
    async saves, nor their order."""
    first = MemStore(root=shm_dir, job_id="job", io_threads=1)
    second = MemStore(root=shm_dir, job_id="job", io_threads=1)
    _async_save(first, "a", 1.0)
    _async_save(second, "b", 2.0)
    first.close()
    _async_save(second, "c", 3.0)
    assert second.list_checkpoints() == ["b", "c"]
    assert torch.equal(_load(second, "c")["w"], torch.full((1000,), 3.0))
    assert _staging(second) == []
    second.close()


def test_what_a_save_notes_of_its_thread_goes_with_the_thread(store):
    """The writer notes which save each thread works for (to tell a save running now from an earlier
    failed one). A process runs a thread per async save, so a note must go with its thread, not stay for
    the life of the process. The threads here live at once: an ended thread's id is reused by the next."""
    saved, leave = threading.Barrier(7), threading.Event()
    turn = threading.Lock()

    def save(i: int) -> None:
        with turn:
            writer = MemoryStorageWriter(store)
            dcp.save(_state(float(i)), checkpoint_id=f"s{i}", storage_writer=writer, no_dist=True)
        saved.wait(60)
        leave.wait(60)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    saved.wait(60)
    names = {t.name for t in threads}
    assert names <= {t.name for t in writer_module._thread_writer}  # each saving thread is noted
    leave.set()
    for t in threads:
        t.join()
    del threads, t
    gc.collect()
    noted = {t.name for t in writer_module._thread_writer}
    assert not names & noted, "ended threads are still noted"
