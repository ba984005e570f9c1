"""Retention and reuse through DCP: keep_in_memory, shard file reuse, list/latest order, delete,
max_in_flight, loads that run while saves evict or a delete is asked for."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
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
from dcp_state import assert_tree_equal, async_save, load, load_fresh, save, snapshot
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

import dcp_memstore.dcp.reader as reader_module
from dcp_memstore import CheckpointInUseError, MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.dcp.stager import Stager
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import SHARD_SUFFIX


def _state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {
        "w": torch.randn(64 << 10, generator=g),
        "b": torch.randn(1000, generator=g).half(),
        "step": i,
        "tag": f"step-{i}",
    }


def _shard_inodes(store: MemStore, cid: str) -> set[int]:
    d = store.require_checkpoint(cid)
    inodes = {os.stat(p).st_ino for p in d.iterdir() if p.name.endswith(".shard")}
    assert inodes
    return inodes


def _do_save(mode: str, store: MemStore, sd: dict, cid: str, **kw) -> None:
    if mode == "save":
        save(store, sd, cid, **kw)
    else:
        async_save(store, sd, cid, **kw).result()


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_keep_in_memory_keeps_only_the_newest_checkpoints(shm_dir, mode):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=2, io_threads=2)
    for i in range(5):
        _do_save(mode, store, _state(i), f"step-{i}")
        assert store.list_checkpoints() == [f"step-{j}" for j in range(max(0, i - 1), i + 1)]
    assert sorted(os.listdir(store.layout.checkpoints_dir)) == ["step-3", "step-4"]
    assert os.listdir(store.layout.staging_dir) == []
    assert os.listdir(store.layout.trash_dir) == []
    for i in (3, 4):
        assert_tree_equal(_state(i), load_fresh(store, _state(i), f"step-{i}"))
    with pytest.raises(FileNotFoundError, match="'step-0' not found"):
        load_fresh(store, _state(0), "step-0")


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_steady_state_saves_reuse_the_shard_files_of_evicted_checkpoints(shm_dir, mode):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1, io_threads=2)
    seen: dict[str, set[int]] = {}
    evicted: set[int] = set()
    for i in range(6):
        cid = f"step-{i}"
        _do_save(mode, store, _state(i), cid)
        seen[cid] = _shard_inodes(store, cid)
        if i >= 2:  # by now an evicted checkpoint's files are in the pool
            assert seen[cid] <= evicted, f"{cid} used new shard files instead of pooled ones"
        if i >= 1:
            evicted |= seen[f"step-{i - 1}"]
    all_inodes = set().union(*seen.values())
    assert len(all_inodes) <= 2 * store.io_threads  # (keep_in_memory + 1) checkpoints' worth, ever
    assert_tree_equal(_state(5), load_fresh(store, _state(5), "step-5"))


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_the_debug_log_says_where_each_saves_bytes_went(shm_dir, mode, caplog):
    """DEBUG lines per rank and save, to tell a slow save that allocated new tmpfs pages from one that
    reused files: the write's line, and for async_save also the staging's (where the copy happens). The
    bytes and seconds of each are its event's."""
    caplog.set_level(logging.INFO, logger="dcp_memstore.events")
    caplog.set_level(logging.DEBUG, logger="dcp_memstore.dcp")  # the last one sets the handler's level
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1, io_threads=2)
    for i in range(4):
        _do_save(mode, store, _state(i), f"step-{i}")
    writes = [r.getMessage() for r in caplog.records if r.name == "dcp_memstore.dcp.rank_write"]
    stagings = [r.getMessage() for r in caplog.records if r.name == "dcp_memstore.dcp.stager"]
    reported = [r.getMessage() for r in caplog.records if r.name == "dcp_memstore.events"]
    assert len(writes) == 4
    nbytes = (64 << 10) * 4 + 1000 * 2
    assert reported[0].startswith(
        f"stage 'step-0' rank 0: {nbytes} bytes in " if mode == "async_save" else "write"
    )
    assert len([line for line in reported if line.startswith("stage ")]) == (4 if mode == "async_save" else 0)
    assert writes[0].startswith("rank 0, checkpoint 'step-0': shard files: ")
    if mode == "save":
        assert stagings == []
        assert writes[0].endswith("0 staged by async_save, 0 reused, 2 new")
        assert writes[3].endswith("0 staged by async_save, 2 reused, 0 new")  # an evicted checkpoint's
    else:
        assert all(line.endswith("2 staged by async_save, 0 reused, 0 new") for line in writes)
        assert len(stagings) == 4
        assert stagings[0] == "rank 0 staged 2 tensors for async_save; shard files: 0 reused, 2 new"
        assert stagings[3].endswith("2 reused, 0 new")


def test_a_reused_larger_file_holds_a_smaller_checkpoint_correctly(shm_dir):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1, io_threads=1)
    save(store, {"w": torch.randn(100_000)}, "a")
    (a_file,) = store.require_checkpoint("a").glob("*.shard")
    a_stat = os.stat(a_file)
    save(store, {"w": torch.randn(100_000)}, "b")  # evicts "a" into the pool
    small = {"w": torch.randn(90_000)}  # fits a's file within its slack: reused as it is
    save(store, small, "c")
    (c_file,) = store.require_checkpoint("c").glob("*.shard")
    c_stat = os.stat(c_file)
    assert (c_stat.st_ino, c_stat.st_size) == (a_stat.st_ino, a_stat.st_size)
    assert c_stat.st_size > 90_000 * 4
    assert_tree_equal(small, load_fresh(store, small, "c"))


def _four_sizes(i: int, a_mib: int = 1) -> dict:
    """Four tensors that go to four shard files of four sizes (io_threads=4): "a" (``a_mib`` MiB), "b"
    (256 KiB), "c" (128 KiB) and "d" (64 KiB)."""
    g = torch.Generator().manual_seed(i)
    kib = {"a": a_mib << 10, "b": 256, "c": 128, "d": 64}
    return {k: torch.randn(n << 8, generator=g) for k, n in kib.items()} | {"step": i}


def _pooled_inodes(store: MemStore) -> set[int]:
    Stager.of(store).wait_reserved()  # files still being allocated ahead are in the pool once it returns
    return {os.stat(p).st_ino for p in store.layout.pool_dir(0).glob("*.shard")}


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_a_save_whose_one_file_grew_still_reuses_its_other_files(shm_dir, mode):
    """One file of a save outgrows every pooled file (one tensor grew); the pooled files that fit the save's
    other files must serve them, not be deleted with the misfits to make room for the new one. Three saves
    in a row grow "a" (each save's files are claimed by parallel threads, in no fixed order)."""
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=2, io_threads=4)
    for i in range(3):  # steady state: s2's commit pools s0's files
        _do_save(mode, store, _four_sizes(i), f"s{i}")
    for i, a_mib in ((3, 2), (4, 3), (5, 4)):  # each save's pool holds the files of the save two before
        pooled = _pooled_inodes(store)
        _do_save(mode, store, _four_sizes(i, a_mib), f"s{i}")
        files = sorted(store.require_checkpoint(f"s{i}").glob("*.shard"), key=lambda f: os.stat(f).st_size)
        assert [os.stat(f).st_size >= a_mib << 20 for f in files] == [False, False, False, True]
        *others, grown = (os.stat(f).st_ino for f in files)
        assert set(others) <= pooled, f"s{i}: files of unchanged size were allocated anew"
        assert grown not in pooled
    assert store.list_checkpoints() == ["s4", "s5"]
    for i, a_mib in ((4, 3), (5, 4)):
        assert_tree_equal(_four_sizes(i, a_mib), load_fresh(store, _four_sizes(i, a_mib), f"s{i}"))


def test_list_and_latest_follow_commit_order_not_names(shm_dir):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=10)
    order = ["step-10", "step-9", "step-100", "alpha", "step-2"]
    for i, cid in enumerate(order):
        save(store, _state(i), cid)
        assert store.latest_checkpoint() == cid
    assert store.list_checkpoints() == order
    store.delete("step-2")
    assert store.latest_checkpoint() == "alpha"
    store.delete("step-9")
    assert store.list_checkpoints() == ["step-10", "step-100", "alpha"]


def test_latest_is_the_newest_save_after_the_wall_clock_stepped_back(shm_dir, monkeypatch):
    """Commit times order checkpoints across tiers (latest_checkpoint); a clock stepped back by 10 minutes
    (NTP, a VM restored) between two saves must not make the newer one look older. ``time.time`` is
    replaced (fault injection: the machine's clock cannot be set from a test)."""
    store = MemStore(root=shm_dir, job_id="job")
    save(store, _state(1), "step-1")
    wall_clock = time.time
    monkeypatch.setattr(time, "time", lambda: wall_clock() - 600)
    save(store, _state(2), "step-2")
    first = catalog.read_commit(store.layout, "step-2").committed_at
    store.delete("step-2")  # saved again under its id: a save of its own, told apart by its commit time
    save(store, _state(2), "step-2")
    assert catalog.read_commit(store.layout, "step-2").committed_at > first
    assert store.list_checkpoints() == ["step-1", "step-2"]
    assert store.latest_checkpoint() == "step-2"
    assert_tree_equal(load_fresh(store, _state(2), store.latest_checkpoint()), _state(2))


def test_an_eviction_working_from_a_stale_listing_keeps_a_newer_save_of_the_id(shm_dir, monkeypatch):
    """Eviction lists the checkpoints before it takes the retention lock. Another process may evict or
    delete one of them meanwhile, and the id be saved again: that new save is kept. The interleaving
    cannot be timed from outside, so eviction is handed the listing from before (fault injection)."""
    with MemStore(root=shm_dir, job_id="job", keep_in_memory=2) as store:
        save(store, _state(0), "a")
        stale = catalog.committed(store.layout)
        store.delete("a")
        save(store, _state(1), "a")
        monkeypatch.setattr(catalog, "committed", lambda layout: stale)
        assert catalog.evict(store.layout, keep=0) == []
        monkeypatch.undo()
        assert store.list_checkpoints() == ["a"]
        assert_tree_equal(_state(1), load_fresh(store, _state(1), "a"))


def test_delete_removes_a_checkpoint_and_others_still_load(store):
    save(store, _state(0), "a")
    save(store, _state(1), "b")
    store.delete("a")
    assert store.list_checkpoints() == ["b"]
    assert not store.layout.checkpoint_dir("a").exists()
    with pytest.raises(FileNotFoundError) as ei:
        load_fresh(store, _state(0), "a")
    assert "'a' not found" in str(ei.value) and "['b']" in str(ei.value)
    assert_tree_equal(_state(1), load_fresh(store, _state(1), "b"))
    save(store, _state(2), "a")  # the id is free again
    assert_tree_equal(_state(2), load_fresh(store, _state(2), "a"))


class _SlowPlanner(DefaultSavePlanner):
    """A background save that takes a while to write (finish_plan runs in the save thread)."""

    def finish_plan(self, new_plan):
        time.sleep(0.2)
        return super().finish_plan(new_plan)


def test_back_to_back_async_saves_all_commit_and_staging_is_bounded(shm_dir):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=6, max_in_flight=2, io_threads=2)
    sd = _state(0)
    expected, futures, staging = {}, [], []
    for i in range(6):
        sd["w"].add_(1.0)  # training moves on between saves
        sd["step"] = i
        expected[f"s{i}"] = snapshot(sd)
        futures.append(async_save(store, sd, f"s{i}", planner=_SlowPlanner()))
        staging.append(len(os.listdir(store.layout.staging_dir)))
        if i == 2:  # the third save could only stage once the first had written its files
            assert list(store.layout.checkpoint_dir("s0").glob("*.shard"))
    assert max(staging) == store.max_in_flight  # reached, never exceeded
    for f in futures:
        f.result()
    assert store.list_checkpoints() == [f"s{i}" for i in range(6)]
    for cid, exp in expected.items():
        assert_tree_equal(exp, load_fresh(store, exp, cid))
    assert os.listdir(store.layout.staging_dir) == []


def test_back_to_back_async_saves_fit_in_keep_plus_in_flight_checkpoints(small_tmpfs, monkeypatch):
    """A node is sized for keep_in_memory + max_in_flight checkpoints (docs/operations.md): the next async
    save stages once the one in flight is over (committed, and the checkpoint beyond keep_in_memory
    evicted). It staged as soon as that save had written its files, so a third checkpoint's memory was
    needed while the save committed, and back-to-back saves failed for want of space. The commit is slowed
    down (fault injection: how long a commit takes on a busy node is not up to a test)."""
    commit = catalog.commit
    monkeypatch.setattr(catalog, "commit", lambda *a, **k: (time.sleep(0.3), commit(*a, **k))[1])
    store = MemStore(root=small_tmpfs / "s", job_id="job", keep_in_memory=1, max_in_flight=1, io_threads=1)
    sd = {"w": torch.zeros((3 << 20) // 4)}  # 3 MiB: two checkpoints fit in the 8 MiB tmpfs, three do not
    futures = []
    for i in range(4):
        sd["w"].fill_(i)
        futures.append(async_save(store, sd, f"s{i}"))
    for f in futures:
        f.result()
    assert store.list_checkpoints() == ["s3"]
    assert_tree_equal(snapshot(sd), load_fresh(store, sd, "s3"))
    store.close()


def test_saves_staged_by_hand_and_run_by_a_long_lived_thread_go_on(shm_dir):
    """The AsyncStager protocol driven by the caller: ``writer.stage`` on the training thread, ``dcp.save``
    of the staged state dict in a pool thread that lives on after it (as Lightning's AsyncCheckpointIO
    does). Such a save counts as in flight until written, not until its thread ends."""
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=2, max_in_flight=1, stage_timeout_s=5)
    sd = _state(0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for i in range(3):
            sd["w"].add_(1.0)
            writer = MemoryStorageWriter(store)
            staged = writer.stage(sd)
            expected = snapshot(sd)
            cid = f"s{i}"
            pool.submit(dcp.save, staged, checkpoint_id=cid, storage_writer=writer, no_dist=True).result()
    assert store.list_checkpoints() == ["s1", "s2"]
    assert_tree_equal(expected, load_fresh(store, expected, "s2"))


def test_store_holds_at_most_keep_plus_in_flight_while_saving(shm_dir):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=2, max_in_flight=2, io_threads=2)
    lay = store.layout
    peak = {"staging": 0, "committed": 0, "checkpoint_dirs": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                counts = {
                    "staging": len(os.listdir(lay.staging_dir)),
                    "committed": len(store.list_checkpoints()),
                    "checkpoint_dirs": len(os.listdir(lay.checkpoints_dir)),
                }
            except FileNotFoundError:
                continue
            for k, v in counts.items():
                peak[k] = max(peak[k], v)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        sd = _state(0)
        futures = []
        for i in range(8):
            sd["w"].add_(1.0)
            futures.append(async_save(store, sd, f"s{i}", planner=_SlowPlanner() if i % 2 else None))
            assert len(os.listdir(lay.staging_dir)) <= store.max_in_flight
        last = snapshot(sd)
        for f in futures:
            f.result()
    finally:
        stop.set()
        watcher.join()
    assert peak["staging"] <= store.max_in_flight
    # A new checkpoint commits before the oldest is evicted, so keep_in_memory + 1 may exist for an instant,
    # plus at most the one checkpoint being written (saves of one job are written one at a time).
    assert peak["committed"] <= store.keep_in_memory + 1
    assert peak["checkpoint_dirs"] <= store.keep_in_memory + 1
    assert store.list_checkpoints() == ["s6", "s7"]
    assert sorted(os.listdir(lay.checkpoints_dir)) == ["s6", "s7"]
    assert os.listdir(lay.staging_dir) == []
    pooled = [n for n in os.listdir(lay.pool_dir(0)) if n.endswith(SHARD_SUFFIX)]
    assert len(pooled) <= store.max_in_flight * store.io_threads
    assert_tree_equal(last, load_fresh(store, last, "s7"))


def test_load_by_latest_checkpoint(store):
    for i in range(3):
        save(store, _state(i), f"step-{i}")
    out = load(store, _state(99), store.latest_checkpoint())
    assert_tree_equal(_state(2), out)


@pytest.mark.parametrize("same_store", [True, False])
def test_two_synchronous_saves_in_threads_both_commit(shm_dir, same_store):
    """A save committing while another thread's save of this process is still writing leaves it alone."""
    store_a = MemStore(root=shm_dir, job_id="job", io_threads=1)
    store_b = store_a if same_store else MemStore(root=shm_dir, job_id="job", io_threads=1)
    big = {"w": torch.arange(40 << 20, dtype=torch.int32)}
    errors: list[BaseException] = []

    def save_a() -> None:
        try:
            save(store_a, big, "a-1")
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    a = threading.Thread(target=save_a)
    a.start()
    deadline = time.monotonic() + 30
    while not store_a.layout.checkpoint_dir("a-1").exists():
        assert time.monotonic() < deadline and a.is_alive(), "save a-1 never began its directory"
        time.sleep(0.001)
    save(store_b, {"x": torch.ones(4)}, "b-1")
    a.join()
    assert errors == []
    assert sorted(store_a.list_checkpoints()) == ["a-1", "b-1"]
    assert_tree_equal(big, load_fresh(store_a, big, "a-1"))


def test_two_saves_committing_at_once_get_distinct_numbers_and_retention_evicts_the_older(
    shm_dir, monkeypatch
):
    """Commit numbers order the checkpoints (list_checkpoints, and keep_in_memory evicts the lowest). Two
    saves in threads that commit at the same moment must not take the same number: retention could then
    evict the newer one. Fault injection: each save waits, once it has taken its number, for the other
    to take its own (up to 2 s, for a commit that holds the other back), so the two commits overlap every
    time instead of now and then."""
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=2, io_threads=1)
    both_numbered = threading.Barrier(2, timeout=2)
    original = MemStore.prepare_everywhere

    def after_numbering(self, record, manifest):
        # broken: the other commit did not take its number meanwhile (it waits for this one)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_numbered.wait()
        return original(self, record, manifest)

    monkeypatch.setattr(MemStore, "prepare_everywhere", after_numbering)
    errors: list[BaseException] = []

    def save_in_thread(cid: str) -> None:
        try:
            save(store, _filled(1.0), cid)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=save_in_thread, args=(cid,)) for cid in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    assert errors == []
    records = catalog.committed(store.layout)
    assert len({r.seq for r in records}) == 2, records
    older, newer = sorted(records, key=lambda r: r.committed_at)
    assert store.list_checkpoints() == [older.checkpoint_id, newer.checkpoint_id]
    save(store, _filled(2.0), "c")  # keeps two: evicts the older of the two
    assert store.list_checkpoints() == [newer.checkpoint_id, "c"]


def _filled(v: float) -> dict:
    return {"w": torch.full((64 << 10,), v)}


def _pause_load_at(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[threading.Event, threading.Event]:
    """Fault injection: the next load stops in ``reader.<name>`` and sets ``paused`` until ``go`` is set.
    ``run_parallel``: after planning, before any file is read; ``_region``: within a converting read,
    after the stored item's checksum was verified, before the copy from the mapping."""
    paused, go = threading.Event(), threading.Event()
    original = getattr(reader_module, name)

    def pausing(*args, **kwargs):
        paused.set()
        assert go.wait(60), "the test never let the load go on"
        return original(*args, **kwargs)

    monkeypatch.setattr(reader_module, name, pausing)
    return paused, go


@pytest.mark.parametrize(
    "dtype, pause_at",
    [(torch.float64, "_region"), (torch.float32, "run_parallel")],
    ids=["converting-read-mid-copy", "whole-read-before-files"],
)
def test_a_load_that_saves_would_evict_meanwhile_reads_its_own_checkpoint(
    shm_dir, monkeypatch, dtype, pause_at
):
    """Saves committing while a load runs (another thread here) would evict the checkpoint being read and
    reuse its files for their own data: the load copied another checkpoint's values without an error
    (converting read) or failed on a vanished shard file (whole read). The load holds it instead."""
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1, io_threads=1)
    save(store, _filled(1.0), "s1")
    save(store, _filled(2.0), "s2")  # s1's file goes to the pool
    paused, go = _pause_load_at(monkeypatch, pause_at)
    dest = {"w": torch.zeros(64 << 10, dtype=dtype)}
    errors: list[BaseException] = []

    def load_s2() -> None:
        try:
            load(store, dest, "s2")
        except BaseException as e:  # noqa: BLE001 - re-raised by the test thread
            errors.append(e)

    loader = threading.Thread(target=load_s2)
    loader.start()
    try:
        assert paused.wait(60)
        with pytest.raises(CheckpointInUseError, match=rf"'s2' .* is being loaded \(pid {os.getpid()} on"):
            store.delete("s2")  # would pool its file just the same
        save(store, _filled(3.0), "s3")  # would evict s2 and pool its file...
        save(store, _filled(4.0), "s4")  # ...which this save would reuse and overwrite
        kept = store.list_checkpoints()
    finally:
        go.set()
        loader.join()
    if errors:
        raise errors[0]
    assert torch.equal(dest["w"], torch.full((64 << 10,), 2.0, dtype=dtype)), dest["w"].unique()
    assert kept == ["s2", "s4"]  # s2 was held while it was read
    save(store, _filled(5.0), "s5")  # the load is over: s2 is evicted at the next commit
    assert store.list_checkpoints() == ["s5"]
    assert not list(store.layout.checkpoints_dir.glob("*/holds/load-*"))


@pytest.mark.parametrize("then", ["reader-loads-again", "reader-is-dropped", "reader-is-kept"])
@pytest.mark.parametrize("fault", ["Size mismatch", "Missing key"])
def test_a_load_that_fails_in_planning_does_not_pin_its_checkpoint(shm_dir, then, fault):
    """DCP tells a reader nothing when a load fails between read_metadata and read_data (the planner
    raises: a tensor of another size, a key the checkpoint lacks): the hold goes with that load's metadata
    once DCP drops it, also while training goes on with the same reader."""
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1, io_threads=1)
    save(store, _filled(1.0), "s1")
    reader = MemoryStorageReader(store)
    wrong = {"w": torch.zeros(3)} if fault == "Size mismatch" else {**_filled(0.0), "extra": torch.zeros(1)}
    with pytest.raises(CheckpointException, match=fault):
        dcp.load(wrong, checkpoint_id="s1", storage_reader=reader, no_dist=True)
    gc.collect()  # DCP's error refers to its frames, which refer to it: a cycle, freed by the collector
    save(store, _filled(2.0), "s2")
    if then == "reader-is-kept":
        assert store.list_checkpoints() == ["s2"]  # s1 is not pinned by the failed load
    elif then == "reader-loads-again":
        dest = _filled(0.0)
        dcp.load(dest, checkpoint_id="s2", storage_reader=reader, no_dist=True)
        assert torch.equal(dest["w"], _filled(2.0)["w"])
    else:
        del reader
        gc.collect()
    save(store, _filled(3.0), "s3")
    assert store.list_checkpoints() == ["s3"]


def test_a_load_of_a_checkpoint_evicted_before_it_reads_says_which_one_is_missing(store):
    save(store, _filled(1.0), "a")
    save(store, _filled(2.0), "b")
    reader = MemoryStorageReader(store)
    reader.reset("a")  # what dcp.load calls first; the checkpoint is there
    store.delete("a")  # and is gone before the load reads anything
    with pytest.raises(FileNotFoundError, match=r"checkpoint 'a' not found in store .*\['b'\]"):
        reader.read_metadata()


# Another process (an evaluation job, say) loads checkpoint s2 of the store and stops after planning until
# the file <root>/go exists; <root>/paused says it got there. Writes what it loaded to <root>/loaded.pt.
_LOAD_IN_ANOTHER_PROCESS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch, torch.distributed.checkpoint as dcp
    import dcp_memstore.dcp.reader as reader_module
    from dcp_memstore import MemoryStorageReader, MemStore

    root = Path(sys.argv[1])
    original = reader_module.run_parallel

    def pausing(*args, **kwargs):  # fault injection: wait between planning and reading
        (root / "paused").touch()
        while not (root / "go").exists():
            time.sleep(0.01)
        return original(*args, **kwargs)

    reader_module.run_parallel = pausing
    store = MemStore(root=root, job_id="job", io_threads=1)
    dest = {"w": torch.zeros(64 << 10)}
    dcp.load(dest, checkpoint_id="s2", storage_reader=MemoryStorageReader(store), no_dist=True)
    torch.save(dest["w"], root / "loaded.pt")
    """
)


@pytest.mark.parametrize("ending", ["finishes", "is-killed"])
def test_a_load_in_another_process_holds_its_checkpoint_until_it_ends_or_dies(shm_dir, ending):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1, io_threads=1)
    save(store, _filled(1.0), "s1")
    save(store, _filled(2.0), "s2")
    child = subprocess.Popen([sys.executable, "-c", _LOAD_IN_ANOTHER_PROCESS, str(shm_dir)])
    try:
        deadline = time.monotonic() + 120
        while not (shm_dir / "paused").exists():
            assert child.poll() is None, "the loading process failed before it read"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(CheckpointInUseError, match=rf"'s2' .* is being loaded \(pid {child.pid} on"):
            store.delete("s2")  # would pool s2's file for the next save to overwrite
        save(store, _filled(3.0), "s3")
        save(store, _filled(4.0), "s4")  # would overwrite s2's pooled file if s3 had evicted s2
        kept = store.list_checkpoints()
        if ending == "finishes":
            Path(shm_dir / "go").touch()
            assert child.wait(120) == 0
        else:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if ending == "finishes":
        assert torch.equal(torch.load(shm_dir / "loaded.pt"), _filled(2.0)["w"])
    assert kept == ["s2", "s4"]  # s2 was held while the other process read it
    store.delete("s2")  # the hold ended with the load, or with the process
    assert store.list_checkpoints() == ["s4"]


# An evaluation job: loads each checkpoint id it reads on stdin into a float64 tensor (a converting read,
# which copies from the shard file's mapping, as loads into GPU tensors and resharded loads do) and
# answers with the first value loaded.
_LOAD_ON_REQUEST = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed.checkpoint as dcp
    from dcp_memstore import MemoryStorageReader, MemStore

    store = MemStore(root=sys.argv[1], job_id="job", io_threads=1)
    for line in sys.stdin:
        dest = {"w": torch.zeros(64 << 10, dtype=torch.float64)}
        dcp.load(dest, checkpoint_id=line.strip(), storage_reader=MemoryStorageReader(store), no_dist=True)
        print(float(dest["w"][0]), flush=True)
    """
)


def _deleted_files_mapped(pid: int, root: Path) -> set[str]:
    """The files under ``root`` that process ``pid`` maps although they were deleted (their memory stays
    taken while they are mapped)."""
    with open(f"/proc/{pid}/maps") as f:
        return {
            line.split(maxsplit=5)[5].strip()
            for line in f
            if str(root) in line and line.rstrip().endswith("(deleted)")
        }


def test_a_process_that_loads_again_lets_go_of_the_files_deleted_since_it_mapped_them(shm_dir):
    """A deleted tmpfs file keeps its memory while any process maps it. An evaluation job that keeps
    loading a training job's checkpoints must not keep, for its whole life, the memory of the files the
    trainer deleted since it read them (store.delete, pools trimmed after commits)."""
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=3, io_threads=1)
    for i in (1, 2, 3):
        save(store, _filled(float(i)), f"s{i}")
    child = subprocess.Popen(
        [sys.executable, "-c", _LOAD_ON_REQUEST, str(shm_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def load_there(cid: str) -> float:
        child.stdin.write(cid + "\n")
        child.stdin.flush()
        answer = child.stdout.readline()
        assert answer, f"the loading process failed loading {cid}"
        return float(answer)

    try:
        assert (load_there("s1"), load_there("s2")) == (1.0, 2.0)
        store.delete("s1")
        store.delete("s2")  # the pool keeps one shard file for the next save: the other one is deleted
        assert _deleted_files_mapped(child.pid, shm_dir)  # still in memory: the other process maps it
        assert load_there("s3") == 3.0
        assert _deleted_files_mapped(child.pid, shm_dir) == set()
    finally:
        child.stdin.close()
        if child.wait(120) != 0:
            pytest.fail(f"the loading process exited with {child.returncode}")
