"""Errors across gloo ranks: DCP pickles a failing rank's exception and raises it on every rank, so each
of our exceptions has to survive pickling with its message."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mp_harness import SlowPlanner, SlowWriteOnRank1, assert_bit_equal, make_tensor
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore

pytestmark = pytest.mark.slow


def outcome(call) -> str:
    """``ok``, or the exception ``call`` raised as "Type: message" (DCP's CheckpointException included)."""
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        return f"{type(e).__name__}: {e}"
    return "ok"


def load_corrupt(rank: int, world: int, root: str) -> str:
    """Save on every rank, flip the first byte of rank 1's shard files, load: what every rank raises."""
    store = MemStore(root, "job")
    state = {f"rank{rank}": make_tensor(rank + 1, (64, 64), torch.float32)}
    dcp.save(state, checkpoint_id="c", storage_writer=MemoryStorageWriter(store))
    dist.barrier()
    if rank == 0:
        for shard in store.layout.checkpoint_dir("c").glob("__1_*.shard"):
            with open(shard, "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 0xFF]))
    dist.barrier()
    dest = {f"rank{rank}": torch.zeros(64, 64)}
    return outcome(lambda: dcp.load(dest, checkpoint_id="c", storage_reader=MemoryStorageReader(store)))


def test_a_checksum_mismatch_on_one_rank_reaches_every_rank_with_its_message(mp) -> None:
    for rank, error in enumerate(mp.run(load_corrupt, 2, str(mp.root))):
        assert "checksum mismatch in" in error and "__1_" in error and "rank1" in error, (rank, error)
        assert "TypeError" not in error, (rank, error)


def stage_fails_on_rank_1(rank: int, world: int, root: str) -> dict:
    """async_save where only rank 1's staging fails (no room for its 16 MiB on an 8 MiB tmpfs): every
    rank's future must fail with rank 1's reason, at once, and the next save must work."""
    store = MemStore(root, "job", io_threads=2, stage_timeout_s=30)
    big = {f"rank{rank}": make_tensor(rank, ((1 if rank == 0 else 4) << 20,), torch.float32)}
    t0 = time.monotonic()
    fut = dcp.async_save(big, checkpoint_id="too-big", storage_writer=MemoryStorageWriter(store))
    error = outcome(lambda: fut.result(timeout=60))
    waited = time.monotonic() - t0
    small = {f"rank{rank}": make_tensor(10 + rank, (1000,), torch.float32)}
    dcp.async_save(small, checkpoint_id="ok", storage_writer=MemoryStorageWriter(store)).result(timeout=60)
    out = {f"rank{rank}": torch.zeros(1000)}
    dcp.load(out, checkpoint_id="ok", storage_reader=MemoryStorageReader(store))
    assert_bit_equal(out, small, f"rank {rank} after the failed save")
    store.close()
    return {"error": error, "waited": waited}


def test_a_staging_failure_on_one_rank_fails_the_save_on_every_rank_at_once(mp, small_tmpfs) -> None:
    for rank, r in enumerate(mp.run(stage_fails_on_rank_1, 2, str(small_tmpfs))):
        assert "not enough space" in r["error"] and "bytes needed" in r["error"], (rank, r)
        assert r["waited"] < 30, (rank, r)  # not a collective timing out


class _SlowOnRank1(DefaultSavePlanner):
    """Holds rank 1's save for a while inside DCP's collectives (between planning and writing)."""

    def finish_plan(self, new_plan):
        if dist.get_rank() == 1:
            time.sleep(6)
        return super().finish_plan(new_plan)


def save_waiting_too_long(rank: int, world: int, root: str) -> dict:
    """Two async saves in flight; the second gives up waiting for the first (stage_timeout_s=2). It must
    fail, on every rank, without entering DCP's collectives while the first is still in them."""
    store = MemStore(root, "job", max_in_flight=2, stage_timeout_s=2)
    first = {f"rank{rank}": make_tensor(20 + rank, (1000,), torch.float32)}
    f0 = dcp.async_save(
        first, checkpoint_id="a0", storage_writer=MemoryStorageWriter(store), planner=_SlowOnRank1()
    )
    time.sleep(0.5)
    f1 = dcp.async_save(first, checkpoint_id="a1", storage_writer=MemoryStorageWriter(store))
    second = outcome(lambda: f1.result(timeout=60))
    f0.result(timeout=60)
    out = {f"rank{rank}": torch.zeros(1000)}
    dcp.load(out, checkpoint_id="a0", storage_reader=MemoryStorageReader(store))
    assert_bit_equal(out, first, f"rank {rank}")
    dist.barrier()  # the process group still works
    listed = store.list_checkpoints()
    store.close()
    return {"second": second, "listed": listed}


def test_a_save_that_waits_too_long_for_the_one_before_fails(mp) -> None:
    for rank, r in enumerate(mp.run(save_waiting_too_long, 2, str(mp.root))):
        assert "waited" in r["second"] and "StagingTimeoutError" in r["second"], (rank, r)
        assert "'a0'" in r["second"], (rank, r)  # the save it waited for, by its checkpoint
        assert r["listed"] == ["a0"], (rank, r)


def save_timing_out_on_rank_0_only(rank: int, world: int, root: str, executor: str) -> dict:
    """Saves b0 (slow) and b1 in flight. Rank 0 starts b1 at once and gives up waiting for b0 after 2 s;
    rank 1 trains slower and starts b1 only once b0 is done, so it does not wait at all. Rank 1's b1 must
    not commit or report success without rank 0, and the ranks must stay in step: the next save, c, commits
    and loads bit-exact on both. With the PROCESS executor rank 0 times out sending b1 to DCP's checkpoint
    process (the planner is pickled there, so it comes from an importable module). A first save, a, waited
    on by every rank, starts that process: until it runs, async_save starts it with a collective."""
    store = MemStore(root, "job", max_in_flight=2, stage_timeout_s=2, keep_in_memory=4)
    kind = AsyncCheckpointerType(executor)

    def save(state: dict, cid: str, planner: SavePlanner | None = None) -> Future:
        """An async save on the executor under test, with a writer of its own (two are in flight)."""
        writer = MemoryStorageWriter(store)
        return dcp.async_save(
            state, checkpoint_id=cid, storage_writer=writer, planner=planner, async_checkpointer_type=kind
        )

    state = {f"rank{rank}": make_tensor(50 + rank, (1000,), torch.float32)}
    save(state, "a").result(timeout=60)
    f0 = save(state, "b0", planner=SlowPlanner())
    if rank == 1:
        f0.result(timeout=60)
    f1 = save(state, "b1")
    b1 = outcome(lambda: f1.result(timeout=60))
    f0.result(timeout=60)
    later = {f"rank{rank}": make_tensor(60 + rank, (1000,), torch.float32)}
    c = outcome(lambda: save(later, "c").result(timeout=60))
    loaded = outcome(lambda: _load_bit_exact(store, "c", later, rank))
    listed = store.list_checkpoints()
    store.close()
    return {"b1": b1, "c": c, "loaded": loaded, "listed": listed}


def _load_bit_exact(store: MemStore, cid: str, expected: dict, rank: int) -> None:
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, checkpoint_id=cid, storage_reader=MemoryStorageReader(store))
    assert_bit_equal(out, expected, f"{cid} on rank {rank}")


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_save_that_times_out_waiting_on_one_rank_only_fails_on_every_rank(mp, executor: str) -> None:
    for rank, r in enumerate(mp.run(save_timing_out_on_rank_0_only, 2, str(mp.root), executor)):
        assert "StagingTimeoutError" in r["b1"] and "waited 2s" in r["b1"], (rank, r)
        assert r["c"] == "ok" and r["loaded"] == "ok", (rank, r)
        assert r["listed"] == ["a", "b0", "c"], (rank, r)


def load_missing_on_rank_1(rank: int, world: int, root: str) -> dict:
    """Rank 1 asks for a checkpoint that does not exist (rank 0 for one that does): both must fail at once
    with rank 1's reason, and the group must still work."""
    store = MemStore(root, "job")
    state = {f"rank{rank}": make_tensor(30 + rank, (100,), torch.float32)}
    dcp.save(state, checkpoint_id="c", storage_writer=MemoryStorageWriter(store))
    t0 = time.monotonic()
    cid = "c" if rank == 0 else "nope"
    error = outcome(
        lambda: dcp.load(
            {f"rank{rank}": torch.zeros(100)}, checkpoint_id=cid, storage_reader=MemoryStorageReader(store)
        )
    )
    waited = time.monotonic() - t0
    dist.barrier()
    store.close()
    return {"error": error, "waited": waited}


def test_a_load_that_fails_on_one_rank_before_dcp_plans_fails_on_every_rank_at_once(mp) -> None:
    for rank, r in enumerate(mp.run(load_missing_on_rank_1, 2, str(mp.root))):
        assert "checkpoint 'nope' not found" in r["error"] and "committed checkpoints: ['c']" in r["error"], r
        assert r["waited"] < 30, (rank, r)


def save_sparse_on_rank_1(rank: int, world: int, root: str) -> dict:
    """dcp.save where only rank 1 holds a sparse tensor: every rank must fail with its name, and no rank may
    have written anything (the refusal comes at planning, before any rank copies)."""
    store = MemStore(root, "job")
    state = {f"rank{rank}": make_tensor(40 + rank, (1 << 16,), torch.float32)}
    if rank == 1:
        state["emb"] = torch.eye(8).to_sparse()
    error = outcome(lambda: dcp.save(state, checkpoint_id="bad", storage_writer=MemoryStorageWriter(store)))
    dist.barrier()
    written = sorted(p.name for p in store.layout.checkpoints_dir.iterdir())
    pooled = sorted(p.name for p in store.layout.pools_dir.rglob("*.shard"))
    store.close()
    return {"error": error, "written": written, "pooled": pooled}


def test_a_sparse_tensor_on_one_rank_fails_dcp_save_on_every_rank_before_any_rank_writes(mp) -> None:
    for rank, r in enumerate(mp.run(save_sparse_on_rank_1, 2, str(mp.root))):
        assert "state_dict entry 'emb' is a torch.sparse_coo tensor" in r["error"], (rank, r)
        assert r["written"] == [] and r["pooled"] == [], (rank, r)


def _sized_state(rank: int, seed: int, mib: tuple[float, ...]) -> dict:
    """One float32 tensor of each size in ``mib`` (MiB) for rank ``rank``."""
    return {
        f"rank{rank}.{i}": make_tensor(seed + i, (int(m * (1 << 18)),), torch.float32)
        for i, m in enumerate(mib)
    }


def _process_save(store: MemStore, state: dict, cid: str, planner: SavePlanner | None = None) -> Future:
    """An async save on DCP's PROCESS executor, with a writer of its own."""
    return dcp.async_save(
        state,
        checkpoint_id=cid,
        storage_writer=MemoryStorageWriter(store),
        planner=planner,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )


def failed_process_save_then_one_needing_its_memory(rank: int, world: int, root: str) -> dict:
    """PROCESS-executor async saves on an 8 MiB tmpfs. In save "a" rank 0 stages 3 MiB; rank 1 stages a
    little and has a 6 MiB value that DCP pickles whole, for which its write finds no room: "a" fails on
    every rank after rank 0 wrote its 3 MiB file into the directory its checkpoint process began. In save
    "b" rank 0 stages the same 3 MiB tensor and 2.5 MiB more: that fits only with the failed save's file."""
    store = MemStore(root, "job", io_threads=2, stage_timeout_s=30)
    first = _sized_state(rank, rank, (3,) if rank == 0 else (0.01,))
    if rank == 1:
        first["blob"] = bytes(6 << 20)
    failed = outcome(lambda: _process_save(store, first, "a").result(timeout=60))
    left = sorted(os.listdir(store.layout.checkpoints_dir))
    second = _sized_state(rank, 10 + rank, (3, 2.5) if rank == 0 else (0.01,))
    saved = outcome(lambda: _process_save(store, second, "b").result(timeout=60))
    loaded = outcome(lambda: _load_bit_exact(store, "b", second, rank)) if saved == "ok" else "not saved"
    return {
        "failed": failed,
        "left": left,
        "saved": saved,
        "loaded": loaded,
        "listed": store.list_checkpoints(),
    }


def test_the_memory_of_a_save_that_failed_in_dcps_checkpoint_process_serves_the_next_save(
    mp, small_tmpfs
) -> None:
    """With the PROCESS executor a failed save's directory belongs to DCP's checkpoint process, which lives
    on: the trainer's space check must still reclaim its files, or no later save that needs that memory
    can ever be staged."""
    for rank, r in enumerate(mp.run(failed_process_save_then_one_needing_its_memory, 2, str(small_tmpfs))):
        assert "not enough space" in r["failed"], (rank, r)
        assert r["left"] == ["a"], (rank, r)  # the scenario: the failed save's directory is still there
        assert r["saved"] == "ok" and r["loaded"] == "ok", (rank, r)
        assert r["listed"] == ["b"], (rank, r)
    assert sorted(os.listdir(small_tmpfs / "job" / "checkpoints")) == ["b"]


def save_without_room_while_one_is_written(rank: int, world: int, root: str) -> dict:
    """PROCESS-executor async saves on an 8 MiB tmpfs, two in flight. Save "x" (3 MiB on rank 0) is being
    written: rank 0's file is in the directory its checkpoint process began, rank 1 is slow. Then rank 0
    stages "y" (5.5 MiB), which does not fit while "x" holds its memory. A first save, "w", waited on by
    every rank, starts DCP's checkpoint process (until it runs, async_save starts it with a collective)."""
    store = MemStore(root, "job", io_threads=2, max_in_flight=2, stage_timeout_s=30)
    _process_save(store, _sized_state(rank, 20 + rank, (0.01,)), "w").result(timeout=60)
    first = _sized_state(rank, rank, (3,) if rank == 0 else (0.01,))
    fx = _process_save(store, first, "x", planner=SlowWriteOnRank1())
    if rank == 0:
        deadline = time.monotonic() + 60
        while not list(store.layout.checkpoint_dir("x").glob("*.shard")) and time.monotonic() < deadline:
            time.sleep(0.01)
    written = sorted(p.name for p in store.layout.checkpoint_dir("x").glob("*.shard"))
    fy = _process_save(store, _sized_state(rank, 10 + rank, (5.5,) if rank == 0 else (0.01,)), "y")
    x = outcome(lambda: fx.result(timeout=60))
    y = outcome(lambda: fy.result(timeout=60))
    loaded = outcome(lambda: _load_bit_exact(store, "x", first, rank))
    return {"written": written, "x": x, "y": y, "loaded": loaded, "listed": store.list_checkpoints()}


def test_the_space_check_never_reclaims_a_save_that_dcps_checkpoint_process_is_writing(
    mp, small_tmpfs
) -> None:
    """The directory of a save still running in DCP's checkpoint process is not a failed save's: the save
    that finds no room fails, and the one being written commits intact."""
    for rank, r in enumerate(mp.run(save_without_room_while_one_is_written, 2, str(small_tmpfs))):
        if rank == 0:  # the scenario: "y" was staged while "x" had rank 0's file in its directory
            assert r["written"], (rank, r)
        assert r["x"] == "ok" and r["loaded"] == "ok", (rank, r)
        assert "not enough space" in r["y"], (rank, r)
        assert r["listed"] == ["w", "x"], (rank, r)


def dtensor_saves_on_a_tmpfs_sized_for_its_shards(rank: int, world: int, root: str) -> dict:
    """Four saves of a 3.5 MiB DTensor sharded over the ranks (1.75 MiB each) on the 8 MiB tmpfs with
    ``keep_in_memory=1``: the committed checkpoint and the next save fit (7 MiB), but not if each rank
    counted the whole tensor (7 MiB a save)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    store = MemStore(root, "job", keep_in_memory=1, io_threads=1)
    mesh = init_device_mesh("cpu", (world,))
    n = (7 << 20) // 2 // 4 // world
    saved = []
    for i in range(4):
        local = torch.full((n,), float(10 * i + rank))
        sd, cid = {"w": DTensor.from_local(local, mesh, [Shard(0)])}, f"s{i}"
        writer = MemoryStorageWriter(store)
        saved.append(outcome(lambda: dcp.save(sd, checkpoint_id=cid, storage_writer=writer)))  # noqa: B023
    out = {"w": DTensor.from_local(torch.zeros(n), mesh, [Shard(0)])}
    loaded = outcome(lambda: dcp.load(out, checkpoint_id="s3", storage_reader=MemoryStorageReader(store)))
    return {
        "saved": saved,
        "loaded": loaded,
        "exact": torch.equal(out["w"].to_local(), local),
        "listed": store.list_checkpoints(),
    }


def test_a_rank_asks_room_for_its_shard_of_a_dtensor_not_the_whole_tensor(mp, small_tmpfs) -> None:
    for rank, r in enumerate(mp.run(dtensor_saves_on_a_tmpfs_sized_for_its_shards, 2, str(small_tmpfs))):
        assert r["saved"] == ["ok"] * 4 and r["loaded"] == "ok" and r["exact"], (rank, r)
        assert r["listed"] == ["s3"], (rank, r)
