"""dcp.async_save on 2 gloo ranks with the THREAD and PROCESS executors and plan caching, loaded bit-exact;
the state holds a DTensor and a ShardedTensor as well as plain tensors. Also a state that every rank holds
whole (DDP): its checkpoints take its size once, and steady-state saves make no new files."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_harness import MultiProc, assert_bit_equal, blank_like, make_tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, init_from_local_shards
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore

pytestmark = pytest.mark.slow

SAVES = 4
KEEP = 2


def expected_state(step: int, rank: int) -> dict:
    """What the training state holds at ``step``: per-rank values, replicated values, a plain value."""
    return {
        f"rank{rank}": {
            "w": make_tensor(step * 100 + rank * 10 + 1, (64, 33), torch.float32),
            "b": make_tensor(step * 100 + rank * 10 + 2, (17,), torch.bfloat16),
        },
        "shared": {"ids": make_tensor(step * 100 + 91, (9,), torch.int64)},
        "extra": {"step": step},
    }


def global_tensor(step: int) -> torch.Tensor:
    return make_tensor(step * 100 + 95, (10, 6), torch.float32)


def sharded(full: torch.Tensor, rank: int, world: int) -> ShardedTensor:
    """``full`` as a ShardedTensor, in row blocks, one per rank (a collective)."""
    rows = full.shape[0] // world
    meta = ShardMetadata([rank * rows, 0], [rows, full.shape[1]], f"rank:{rank}/cpu")
    return init_from_local_shards(
        [LocalShard(full[rank * rows : (rank + 1) * rows].clone(), meta)], *full.shape
    )


def async_saves(rank: int, world: int, root: str, executor: str, plan_caching: bool, flatten: bool) -> dict:
    """Train in place, async-save after every step, clobber the live tensors while the save runs, wait on
    each future; then load the kept checkpoints bit-exact. Without ``flatten`` DCP pickles the nested dicts
    whole (float, bfloat16 and int64 tensors in one of them)."""
    kind = AsyncCheckpointerType(executor)
    mesh = init_device_mesh("cpu", (world,))
    store = MemStore(root, "job", keep_in_memory=KEEP)
    writer = MemoryStorageWriter(store)  # one writer and one planner for the whole run, as a trainer would
    planner = DefaultSavePlanner(enable_plan_caching=plan_caching, flatten_state_dict=flatten)
    live = expected_state(0, rank)
    live["dt"] = distribute_tensor(global_tensor(0), mesh, [Shard(0)])
    live["st"] = sharded(global_tensor(0), rank, world)
    for step in range(1, SAVES + 1):
        # "training": the same tensor objects get new values
        for key, src in expected_state(step, rank).items():
            if key == "extra":
                live[key] = dict(src)
            else:
                for name, t in src.items():
                    live[key][name].copy_(t)
        live["dt"].to_local().copy_(distribute_tensor(global_tensor(step), mesh, [Shard(0)]).to_local())
        live["st"].local_shards()[0].tensor.copy_(sharded(global_tensor(step), rank, world).local_tensor())
        fut = dcp.async_save(
            live,
            checkpoint_id=f"step-{step}",
            storage_writer=writer,
            planner=planner,
            async_checkpointer_type=kind,
        )
        for key in ("shared", f"rank{rank}"):  # the next steps overwrite the state while the save runs
            for t in live[key].values():
                t.fill_(7)
        live["dt"].to_local().fill_(7)
        live["st"].local_shards()[0].tensor.fill_(7)
        fut.result(timeout=120)
    listed = store.list_checkpoints()
    latest = store.latest_checkpoint()
    reader = MemoryStorageReader(store)
    for step in range(SAVES - KEEP + 1, SAVES + 1):
        expected = expected_state(step, rank)
        # without flatten the nested dicts were pickled whole: DCP loads each into a key that holds None
        target = blank_like(expected) if flatten else dict.fromkeys(expected)
        target["dt"] = distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)])
        target["st"] = sharded(torch.zeros(10, 6), rank, world)
        dcp.load(target, checkpoint_id=f"step-{step}", storage_reader=reader)
        assert_bit_equal(target.pop("dt").full_tensor(), global_tensor(step), f"step-{step} dt")
        expected_st = sharded(global_tensor(step), rank, world).local_tensor()
        assert_bit_equal(target.pop("st").local_tensor(), expected_st, f"step-{step} st")
        assert_bit_equal(target, expected, f"step-{step} rank {rank}")
    writer.close()
    return {"listed": listed, "latest": latest}


@pytest.mark.parametrize(
    ("executor", "plan_caching", "flatten"),
    [
        ("thread", False, True),
        ("thread", True, True),
        ("process", False, True),
        ("process", True, True),
        ("process", False, False),
    ],
)
def test_async_saves_then_load(mp: MultiProc, executor: str, plan_caching: bool, flatten: bool) -> None:
    results = mp.run(async_saves, 2, str(mp.root), executor, plan_caching, flatten)
    kept = [f"step-{s}" for s in range(SAVES - KEEP + 1, SAVES + 1)]
    assert results == [{"listed": kept, "latest": kept[-1]}] * 2
    assert sorted(p.name for p in (mp.job_dir / "checkpoints").iterdir()) == kept
    assert not any((mp.job_dir / "staging").iterdir()), "staging slots left behind after every save finished"


REPLICATED_SAVES = 7


def replicated_state(step: int, layers: int = 8) -> dict:
    """A DDP trainer's state: the same values on every rank, of sizes that no two ranks' files split alike."""
    return {f"layer{i}": make_tensor(step * 100 + i, ((i + 1) * 4096,), torch.float32) for i in range(layers)}


def _shard_files(job_dir: str) -> dict[int, int]:
    """Inode -> size of every shard file of the job: checkpoints, pools, staging slots."""
    return {
        (st := os.stat(os.path.join(d, f))).st_ino: st.st_size
        for d, _, files in os.walk(job_dir)
        for f in files
        if f.endswith(".shard")
    }


class _Lines(logging.Handler):
    """Collects the messages of the loggers it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def async_saves_replicated(rank: int, world: int, root: str, layers: int) -> dict:
    """Async-save a state every rank holds whole; after each save, rank 0 notes the bytes of the newest
    checkpoint's shard files and the shard files of the job. Then load the kept checkpoints bit-exact.
    Each rank also returns the debug line its stager logged for each save (which files it reused)."""
    import torch.distributed as dist

    stager_log = logging.getLogger("dcp_memstore.dcp.stager")
    stager_log.setLevel(logging.DEBUG)
    stager_log.addHandler(stagings := _Lines())
    store = MemStore(root, "job", keep_in_memory=KEEP, io_threads=2)
    writer = MemoryStorageWriter(store)
    checkpoint_bytes, files = [], []
    for step in range(1, REPLICATED_SAVES + 1):
        state = replicated_state(step, layers)
        fut = dcp.async_save(state, checkpoint_id=f"step-{step}", storage_writer=writer)
        fut.result(timeout=120)
        dist.barrier()
        newest = store.layout.checkpoint_dir(f"step-{step}")
        checkpoint_bytes.append(sum(_shard_files(str(newest)).values()))
        files.append(_shard_files(str(store.layout.job_dir)))
        dist.barrier()  # rank 0 looked before the next save
    reader = MemoryStorageReader(store)
    for step in range(REPLICATED_SAVES - KEEP + 1, REPLICATED_SAVES + 1):
        target = blank_like(replicated_state(step, layers))
        dcp.load(target, checkpoint_id=f"step-{step}", storage_reader=reader)
        assert_bit_equal(target, replicated_state(step, layers), f"step-{step} rank {rank}")
    store.close()
    return {"checkpoint_bytes": checkpoint_bytes, "files": files, "stagings": stagings.lines}


@pytest.mark.parametrize("layers", [8, 1], ids=["both-ranks-write", "one-rank-writes"])
def test_async_saves_of_a_state_every_rank_holds(mp: MultiProc, layers: int) -> None:
    """DCP writes each value that every rank holds from one rank only, but the stager copies the whole
    state dict into each rank's files. A checkpoint must still take the state's size once (with two ranks,
    not twice: a staged file the rank writes little of is not kept in it), and once the job holds its
    checkpoints, saves reuse the files they had (the pool keeps the staged files as well as the
    checkpoints' own), also on a rank that DCP gives no value to write (a single value), which has no
    file in any checkpoint: allocating its staging files anew at every save would hold training up."""
    results = mp.run(async_saves_replicated, 2, str(mp.root), layers)
    state_bytes = sum(t.numel() * t.element_size() for t in replicated_state(0, layers).values())
    ranks0 = results[0]
    assert all(b < 1.3 * state_bytes for b in ranks0["checkpoint_bytes"]), (
        f"checkpoints take {ranks0['checkpoint_bytes']} bytes of shard files for a state of {state_bytes}"
    )
    steady = ranks0["files"][KEEP + 1 :]
    made = [sorted(set(f) - set(steady[0])) for f in steady]
    assert not any(made), f"steady-state saves made new shard files (inodes per save): {made}"
    for rank, result in enumerate(results):  # files a save makes and drops again are in no snapshot above
        new = [line for line in result["stagings"][KEEP + 1 :] if not line.endswith(", 0 new")]
        assert not new, f"rank {rank}'s steady-state saves staged into new files: {new}"
