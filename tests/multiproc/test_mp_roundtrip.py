"""dcp.save/dcp.load across gloo ranks: 2 and 4 ranks bit-exact, resharding 2 -> 1 and 2 -> 4, DTensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mp_harness import MultiProc, assert_bit_equal, blank_like, make_tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore

pytestmark = pytest.mark.slow

SEEDS = (11, 12, 13)  # three saves in a row; keep_in_memory=2 keeps the last two
# Global tensors saved as DTensors. "odd" does not divide evenly: Shard(0) over 4 ranks leaves rank 3 an
# empty local shard, and Shard(1) of its 5 columns over 4 ranks gives 2, 2, 1, 0 columns.
GLOBAL = {"even": ((8, 6), torch.float32), "odd": ((3, 5), torch.bfloat16)}


def ckpt(seed: int) -> str:
    return f"ckpt-{seed}"


def rank_state(seed: int, rank: int) -> dict:
    """Values only ``rank`` saves (distinct per rank) plus values every rank saves identically."""
    return {
        f"rank{rank}": {
            "w": make_tensor(seed * 1000 + rank * 10 + 1, (5, 7), torch.float32),
            "b": make_tensor(seed * 1000 + rank * 10 + 2, (13,), torch.bfloat16),
        },
        "shared": {
            "ids": make_tensor(seed * 1000 + 901, (6,), torch.int64),
            "h": make_tensor(seed * 1000 + 902, (3, 4), torch.float16),
            "scalar": make_tensor(seed * 1000 + 903, (), torch.float64),
        },
        "extra": {"step": seed, "name": f"run-{seed}"},
    }


def plain_target(seed: int, ranks: list[int]) -> tuple[dict, dict]:
    """(load target, expected values) for the per-rank values of ``ranks`` and the replicated values."""
    expected: dict = {}
    for r in ranks:
        expected.update(rank_state(seed, r))
    return blank_like(expected), expected


def global_tensors(seed: int) -> dict[str, torch.Tensor]:
    return {k: make_tensor(seed * 1000 + 500 + i, s, dt) for i, (k, (s, dt)) in enumerate(GLOBAL.items())}


def dtensors(values: dict[str, torch.Tensor], mesh, placement: Placement) -> dict:
    return {k: distribute_tensor(t, mesh, [placement]) for k, t in values.items()}


def expected_local(full: torch.Tensor, placement: Placement, rank: int, world: int) -> torch.Tensor:
    """The local part of ``full`` on ``rank``, computed without DTensor (torch.chunk semantics)."""
    if isinstance(placement, Replicate):
        return full
    dim = placement.dim
    chunks = full.chunk(world, dim)
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, full.size(dim), 0)


def check_dtensors(loaded: dict, seed: int, placement: Placement, rank: int, world: int) -> None:
    for k, full in global_tensors(seed).items():
        dt = loaded[k]
        assert tuple(dt.placements) == (placement,), f"{k}: placements {dt.placements}"
        assert_bit_equal(
            dt.to_local(), expected_local(full, placement, rank, world), f"{k} local on rank {rank}"
        )
        assert_bit_equal(dt.full_tensor(), full, f"{k} gathered")


def save_and_load(rank: int, world: int, root: str, job_id: str) -> dict:
    """Save SEEDS in a row with Shard(0) DTensors; load back the two kept ones on the same world size."""
    mesh = init_device_mesh("cpu", (world,))
    store = MemStore(root, job_id, keep_in_memory=2, io_threads=2)  # two shard files per rank
    for seed in SEEDS:
        state = rank_state(seed, rank) | {"dt": dtensors(global_tensors(seed), mesh, Shard(0))}
        dcp.save(state, checkpoint_id=ckpt(seed), storage_writer=MemoryStorageWriter(store))
    for seed in SEEDS[-2:]:
        target, expected = plain_target(seed, [rank])
        shapes = {k: torch.zeros(s, dtype=dt) for k, (s, dt) in GLOBAL.items()}
        target["dt"] = dtensors(shapes, mesh, Shard(0))
        dcp.load(target, checkpoint_id=ckpt(seed), storage_reader=MemoryStorageReader(store))
        check_dtensors(target.pop("dt"), seed, Shard(0), rank, world)
        assert_bit_equal(target, expected, f"{ckpt(seed)} rank {rank}")
    return {"latest": store.latest_checkpoint(), "listed": store.list_checkpoints()}


def load_resharded(rank: int, world: int, root: str, job_id: str, saved_world: int) -> dict:
    """Load the newest checkpoint saved by ``saved_world`` ranks on ``world`` ranks: DTensors as Shard(1)
    and as Replicate(), per-rank values of rank ``rank % saved_world`` (all of them on a single rank)."""
    seed = SEEDS[-1]
    mesh = init_device_mesh("cpu", (world,))
    store = MemStore(root, job_id)
    latest = store.latest_checkpoint()
    assert latest == ckpt(seed), latest
    reader = MemoryStorageReader(store)
    for placement in (Shard(1), Replicate()):
        shapes = {k: torch.zeros(s, dtype=dt) for k, (s, dt) in GLOBAL.items()}
        target = {"dt": dtensors(shapes, mesh, placement)}
        dcp.load(target, checkpoint_id=latest, storage_reader=reader)
        check_dtensors(target["dt"], seed, placement, rank, world)
    ranks = list(range(saved_world)) if world == 1 else [rank % saved_world]
    target, expected = plain_target(seed, ranks)
    dcp.load(target, checkpoint_id=latest, storage_reader=reader)
    assert_bit_equal(target, expected, f"plain values on rank {rank}")
    if world == 1:  # and once more without any process group
        dist.destroy_process_group()
        target, expected = plain_target(seed, ranks)
        dcp.load(target, checkpoint_id=latest, storage_reader=MemoryStorageReader(store), no_dist=True)
        assert_bit_equal(target, expected, "plain values with no_dist=True")
    return {"latest": latest}


def save_four_and_load_two(rank: int, world: int, root: str) -> dict:
    """On 4 ranks: reshard the 2-rank checkpoints (job "two"), then the 4-rank round trip (job "four")."""
    resharded = load_resharded(rank, world, root, "two", saved_world=2)
    return {"resharded": resharded, "own": save_and_load(rank, world, root, "four")}


@pytest.fixture(scope="module")
def two_rank_store(module_mp: MultiProc) -> tuple[MultiProc, list[dict]]:
    """Job "two": SEEDS saved and loaded back by 2 ranks (the other tests reshard its checkpoints)."""
    return module_mp, module_mp.run(save_and_load, 2, str(module_mp.root), "two")


def test_two_ranks_round_trip(two_rank_store: tuple[MultiProc, list[dict]]) -> None:
    _, results = two_rank_store
    assert [r["latest"] for r in results] == [ckpt(SEEDS[-1])] * 2
    assert all(r["listed"] == [ckpt(s) for s in SEEDS[-2:]] for r in results), results


def test_reshard_two_ranks_to_one(two_rank_store: tuple[MultiProc, list[dict]]) -> None:
    mp, _ = two_rank_store
    results = mp.run(load_resharded, 1, str(mp.root), "two", 2)
    assert results == [{"latest": ckpt(SEEDS[-1])}]


def test_four_ranks_round_trip_and_reshard_from_two(two_rank_store: tuple[MultiProc, list[dict]]) -> None:
    mp, _ = two_rank_store
    results = mp.run(save_four_and_load_two, 4, str(mp.root))
    assert [r["resharded"]["latest"] for r in results] == [ckpt(SEEDS[-1])] * 4
    assert [r["own"]["latest"] for r in results] == [ckpt(SEEDS[-1])] * 4
    assert all(r["own"]["listed"] == [ckpt(s) for s in SEEDS[-2:]] for r in results), results
    assert sorted(p.name for p in (mp.root / "four" / "checkpoints").iterdir()) == [
        ckpt(s) for s in SEEDS[-2:]
    ]


def test_a_job_restarted_with_fewer_ranks_frees_the_pools_of_the_ranks_it_lost(mp: MultiProc) -> None:
    """A 2-rank job leaves both ranks' reusable shard files in the pools; restarted on one rank, its first
    commit must free rank 1's (no save of rank 1 comes to reuse them) and keep rank 0's for its next save."""
    mp.run(save_and_load, 2, str(mp.root), "shrink")
    store = MemStore(mp.root, "shrink", keep_in_memory=2, io_threads=2)
    try:
        layout = store.layout
        assert [len(list(layout.pool_dir(r).glob("*.shard"))) for r in (0, 1)] == [2, 2]
        state = rank_state(21, 0)
        dcp.save(state, checkpoint_id="one-rank", storage_writer=MemoryStorageWriter(store), no_dist=True)
        assert list(layout.pool_dir(1).glob("*.shard")) == []
        assert len(list(layout.pool_dir(0).glob("*.shard"))) == 2
        target = blank_like(state)
        dcp.load(target, checkpoint_id="one-rank", storage_reader=MemoryStorageReader(store), no_dist=True)
        assert_bit_equal(target, state, "one-rank")
    finally:
        store.close()
