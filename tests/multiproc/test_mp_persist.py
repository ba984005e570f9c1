"""Persistence with 2 gloo ranks against the real S3 server: each rank uploads its own files, rank 0
publishes, and a job with empty tmpfs restores from the bucket (our reader and stock FsspecReader)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_harness import MultiProc, assert_bit_equal, blank_like, make_tensor

try:
    from torch.distributed.checkpoint import FsspecReader  # torch 2.15 and later, as docs/usage.md says
except ImportError:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.persist.progress import Progress

pytestmark = pytest.mark.slow


def state(step: int, rank: int) -> dict:
    return {
        f"rank{rank}": {"w": make_tensor(step * 100 + rank, (256, 129), torch.float32)},
        "shared": make_tensor(step * 100 + 50, (77,), torch.bfloat16),
        "step": step,
    }


def save_async_and_persist(rank: int, world: int, root: str, url: str, opts: dict) -> dict:
    store = MemStore(root, "job", io_threads=2, persist_to=url, storage_options=opts, persist_every=2)
    fut = None
    for step in range(1, 5):
        if fut is not None:
            fut.result()
        fut = dcp.async_save(
            state(step, rank), checkpoint_id=f"step-{step}", storage_writer=MemoryStorageWriter(store)
        )
    fut.result()
    for cid in ("step-2", "step-4"):
        store.wait_persisted(cid, timeout=180)
    statuses = {cid: store.status(cid).persist for cid in ("step-3", "step-4")}
    # Nothing is owed any more: neither the publishing rank's persister nor the other's keeps manifests,
    # checks or retry times of these saves (a long job's persister would otherwise grow with every save).
    persister, deadline = store._persister, time.monotonic() + 30
    while persister._manifests or persister._checked or persister._retry_at or persister._check_at:
        assert time.monotonic() < deadline, (rank, persister._manifests.keys(), persister._checked)
        persister.wake()
        time.sleep(0.05)
    mine = [p.name for p in Progress(store.layout, "step-4", store.target.url).dir.iterdir()]
    latest = store.latest_checkpoint()
    store.close(timeout=120)
    return {"statuses": statuses, "records": mine, "latest": latest}


def restore_from_bucket(rank: int, world: int, root: str, url: str, opts: dict) -> dict:
    store = MemStore(root, "job", persist_to=url, storage_options=opts, persist_on_close=False)
    assert store.list_checkpoints() == []
    latest = store.latest_checkpoint()
    expected = state(4, rank)
    target = blank_like(expected)
    dcp.load(target, checkpoint_id=latest, storage_reader=MemoryStorageReader(store))
    assert_bit_equal(target, expected, f"our reader, rank {rank}")
    target = blank_like(expected)
    dcp.load(target, storage_reader=FsspecReader(f"{url}/{latest}", **opts))
    assert_bit_equal(target, expected, f"stock FsspecReader, rank {rank}")
    store.close()
    return {"latest": latest}


def test_two_ranks_persist_to_s3_and_restore_with_empty_tmpfs(mp: MultiProc, s3_bucket) -> None:
    server, url = s3_bucket
    opts = server.storage_options()
    results = mp.run(save_async_and_persist, 2, str(mp.root), url, opts)
    assert all(r["latest"] == "step-4" for r in results), results
    assert all(r["statuses"] == {"step-3": "not requested", "step-4": "persisted"} for r in results), results
    assert "state-1" in results[1]["records"], results  # rank 1 uploaded its own files
    fs = server.filesystem()
    bucket = url.removeprefix("s3://")
    assert fs.exists(f"{bucket}/step-4/__1_0.distcp") and fs.exists(f"{bucket}/step-2/.metadata")
    assert not fs.exists(f"{bucket}/step-3")
    fresh = MultiProc()  # a new "cluster": empty tmpfs
    try:
        assert [r["latest"] for r in fresh.run(restore_from_bucket, 2, str(fresh.root), url, opts)] == [
            "step-4"
        ] * 2
    finally:
        fresh.close()


def save_without_persisting(rank: int, world: int, root: str, url: str, opts: dict) -> None:
    store = MemStore(root, "job", io_threads=2, persist_to=url, storage_options=opts, persist_on_close=False)
    dcp.save(state(7, rank), checkpoint_id="step-7", storage_writer=MemoryStorageWriter(store))
    store.close()


def test_one_process_persists_what_two_ranks_saved(mp: MultiProc, s3_bucket) -> None:
    """A restart with fewer processes: local rank 0 of 1 takes every rank's files."""
    server, url = s3_bucket
    opts = server.storage_options()
    mp.run(save_without_persisting, 2, str(mp.root), url, opts)
    with MemStore(mp.root, "job", persist_to=url, storage_options=opts, persist_on_close=False) as store:
        store.persist("step-7")
        st = store.wait_persisted("step-7", timeout=180)
        assert st.files_uploaded == st.files_total >= 4  # both ranks' shard files (2 each) and more
    target = {**blank_like(state(7, 0)), **blank_like(state(7, 1))}
    dcp.load(target, storage_reader=FsspecReader(f"{url}/step-7", **opts), no_dist=True)
    assert_bit_equal(target, {**state(7, 0), **state(7, 1)}, "stock load of the 2-rank checkpoint")
