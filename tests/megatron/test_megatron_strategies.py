"""Megatron-Core ``dist_checkpointing`` save and load through dcp_memstore's strategies, on 2 gloo ranks.

One 2-rank job (tests/multiproc/mp_harness.py) builds a Megatron sharded state dict by hand: tensor-
parallel shards (``ShardedTensor.from_rank_offsets`` on dim 0 and dim 1, float32, bfloat16 and int64, with
NaN, -0.0 and inf in them), a replicated tensor, a ShardedObject per rank and common state. It saves it
synchronously, asynchronously with Megatron's ``AsyncCallsQueue`` (the write in a forked process) and with
``AsyncRequest.execute_sync()``, changing the live tensors right after each async ``save`` returns, and
loads every checkpoint back. It returns what it saw; the tests below compare it, bit for bit, with what
the state held when it was saved.

Megatron calls CUDA-only functions on its async path even for CPU tensors; ``cuda_shim`` stands them in
for this CPU-only torch, in the job's processes only (see its docstring).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import (  # noqa: E402
    AsyncCallsQueue,
    AsyncRequest,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelSaveStrategyWrapper,
)
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_memstore import MemStore  # noqa: E402
from dcp_memstore.megatron import (  # noqa: E402
    BACKEND,
    POINTER,
    MemStoreLoadStrategy,
    MemStoreSaveStrategy,
    checkpoint_id_for,
)
from dcp_memstore.megatron.checkpoint_dir import resolve_checkpoint_id, write_pointer  # noqa: E402
from dcp_memstore.megatron.save import _write_rank  # noqa: E402
from tests.megatron.cuda_shim import shim_cuda_for_cpu  # noqa: E402
from tests.multiproc.mp_harness import (  # noqa: E402
    JOB_ID,
    JOB_TIMEOUT_S,
    MultiProc,
    assert_bit_equal,
    make_tensor,
)

pytestmark = pytest.mark.slow

WORLD = 2
SYNC, ASYNC, EXEC = "iter_0000001", "iter_0000002", "iter_0000003"  # checkpoint directories' names
FAILED = "iter_0000099"  # a save whose write fails
STAGE_FAILED = "iter_0000098"  # a save whose staging fails on one rank
WRITE_FAILED = "iter_0000097"  # a synchronous save whose write fails on one rank
MEGATRON_FILES = ["common.pt", POINTER, "metadata.json"]  # all that a checkpoint_dir holds


# -- the state: deterministic per (rank, seed), so the parent recomputes what each rank saved ------------


def local_values(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """The tensors rank ``rank`` holds in the state of ``seed``."""
    return {
        "w_col": make_tensor(seed * 100 + rank, (8, 6), torch.float32),  # TP shard, dim 0
        "w_row": make_tensor(seed * 100 + 10 + rank, (5, 4), torch.bfloat16),  # TP shard, dim 1
        "steps": make_tensor(seed * 100 + 30 + rank, (3,), torch.int64),  # TP shard of an int tensor
        "norm": make_tensor(seed * 100 + 20, (6,), torch.float32),  # replicated: the same on every rank
    }


def rank_object(rank: int, seed: int) -> dict[str, Any]:
    """What the rank's ShardedObject holds (a data loader position and an RNG state, say)."""
    return {
        "rank": rank,
        "consumed": 1000 * seed + rank,
        "rng": torch.Generator().manual_seed(seed + rank).get_state(),
    }


def common_state(seed: int) -> dict[str, Any]:
    """Non-sharded state, the same on every rank (Megatron puts it in common.pt)."""
    return {"iteration": seed, "args": {"lr": 0.125, "name": f"run-{seed}"}}


def sharded(values: dict[str, torch.Tensor], obj: Any, rank: int, world: int) -> dict[str, Any]:
    """Megatron's sharded state dict over ``values`` (a load template when they are zeros, obj None)."""
    return {
        "layer": {
            "weight": ShardedTensor.from_rank_offsets("layer.weight", values["w_col"], (0, rank, world)),
            "proj": ShardedTensor.from_rank_offsets("layer.proj", values["w_row"], (1, rank, world)),
        },
        "norm": ShardedTensor.from_rank_offsets("norm.weight", values["norm"], replica_id=rank),
        "optimizer": {
            "steps": ShardedTensor.from_rank_offsets("opt.steps", values["steps"], (0, rank, world))
        },
        "loader": ShardedObject("loader_state", obj, (world,), (rank,)),
    }


def expected_loaded(rank: int, seed: int) -> dict[str, Any]:
    """What ``dist_checkpointing.load`` must return on ``rank`` for the checkpoint of ``seed``."""
    v = local_values(rank, seed)
    return {
        "layer": {"weight": v["w_col"], "proj": v["w_row"]},
        "norm": v["norm"],
        "optimizer": {"steps": v["steps"]},
        "loader": rank_object(rank, seed),
        **common_state(seed),
    }


def template(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    """A fresh load target: zeroed tensors of the right shapes on ``device`` (loads fill them in place)."""
    zeros = {k: torch.zeros_like(t, device=device) for k, t in local_values(rank, 0).items()}
    return sharded(zeros, None, rank, world)


# -- the job ----------------------------------------------------------------------------------------------


def megatron_job(rank: int, world: int, root: str, ckpts: str) -> dict[str, Any]:
    """Each rank: save three checkpoints (sync, AsyncCallsQueue, execute_sync), load them; report."""
    shim_cuda_for_cpu()  # Megatron's async path calls CUDA-only functions; see cuda_shim
    seen: list[tuple[str, str]] = []  # (phase, checkpoint id) of the events this process reports
    store = MemStore(
        root,
        JOB_ID,
        keep_in_memory=3,
        io_threads=2,
        on_event=lambda e: seen.append((e.phase, e.checkpoint_id)),
    )
    save, load = MemStoreSaveStrategy(store), MemStoreLoadStrategy(store)
    out: dict[str, Any] = {}
    base = Path(ckpts)

    def state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        values = local_values(rank, seed)
        return values, {**sharded(values, rank_object(rank, seed), rank, world), **common_state(seed)}

    def clobber(values: dict[str, torch.Tensor]) -> None:  # training goes on: the live tensors change
        for t in values.values():
            t.fill_(7)

    # 1. synchronous save, then loads (one resharded: the whole of layer.weight on every rank)
    _, sd = state(1)
    out["sync_returned"] = mdc.save(sd, str(base / SYNC), sharded_strategy=save)
    out["sync"] = mdc.load(template(rank, world), str(base / SYNC), sharded_strategy=load)
    whole = ShardedTensor.from_rank_offsets("layer.weight", torch.zeros(8 * world, 6), replica_id=rank)
    out["resharded"] = mdc.load({"w": whole}, str(base / SYNC), sharded_strategy=load)["w"]

    # 2. the same id again (another directory, same base name): refused on every rank, nothing left stuck
    try:
        mdc.save(state(9)[1], str(base / "again" / SYNC), sharded_strategy=save)
        out["exists_error"] = None
    except CheckpointException as e:  # DCP's, a BaseException: raised on every rank
        out["exists_error"] = f"{type(e).__name__}: {e}"

    # 3. async through Megatron's AsyncCallsQueue: staged in the trainer, written in a forked process,
    # committed in the finalize step. The live tensors change before the write is even scheduled.
    values, sd = state(2)
    queue = AsyncCallsQueue()
    request = mdc.save(sd, str(base / ASYNC), sharded_strategy=save, async_sharded_save=True)
    out["request_is_megatron"] = isinstance(request, AsyncRequest)
    out["staged_in_trainer"] = sorted(os.listdir(store.layout.staging_dir))
    clobber(values)
    queue.schedule_async_request(request)
    record = Path(request.async_fn_args[3])  # where this rank's worker leaves its results
    deadline = time.monotonic() + 60
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.barrier()  # every rank's worker has written its part
    out["written_not_committed"] = {
        "record": record.exists(),
        "committed": ASYNC in store.list_checkpoints(),
        "checkpoint_dir": sorted(os.listdir(base / ASYNC)),
    }
    out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    out["async_events"] = [phase for phase, cid in seen if cid == ASYNC]
    out["async"] = mdc.load(template(rank, world), str(base / ASYNC), sharded_strategy=load)

    # 4. a write that fails in the worker (its staged files are gone): finalize raises on every rank, the
    # checkpoint is not committed, metadata.json is not written, and the next save works
    _, sd = state(4)
    request = mdc.save(sd, str(base / FAILED), sharded_strategy=save, async_sharded_save=True)
    for slot in os.listdir(store.layout.staging_dir):
        if slot.startswith(f"r{rank}-p{os.getpid()}-"):
            shutil.rmtree(store.layout.staging_dir / slot)
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        out["failed_write"] = None
    except CheckpointException as e:
        out["failed_write"] = str(e)
    out["failed_state"] = {
        "committed": FAILED in store.list_checkpoints(),
        "checkpoint_dir": sorted(os.listdir(base / FAILED)),
    }

    # 4b. staging fails on rank 1 only (it saves through a store it closed): the save fails on every rank
    # when planning (a collective), at once, instead of leaving rank 0 waiting there for rank 1
    closed = MemStore(root, JOB_ID, keep_in_memory=3, io_threads=2)
    closed.close()
    strategy = MemStoreSaveStrategy(closed if rank == 1 else store)
    t0 = time.monotonic()
    try:
        mdc.save(state(6)[1], str(base / STAGE_FAILED), sharded_strategy=strategy, async_sharded_save=True)
        out["stage_failed"] = None
    except CheckpointException as e:
        out["stage_failed"] = {"error": str(e), "seconds": time.monotonic() - t0}

    # 4c. a synchronous save whose write fails on rank 1 only (a meta tensor, refused when written): rank 1
    # still reaches the finalize step, so the save fails there on every rank, instead of rank 0 waiting in
    # its collective until the group times out
    data = torch.ones(4, 6) if rank == 0 else torch.empty(4, 6, device="meta")
    t0 = time.monotonic()
    try:
        bad = {"w": ShardedTensor.from_rank_offsets("bad.w", data, (0, rank, world))}
        mdc.save(bad, str(base / WRITE_FAILED), sharded_strategy=save)
        out["write_failed"] = None
    except CheckpointException as e:
        out["write_failed"] = {"error": str(e), "seconds": time.monotonic() - t0}

    # 5. async request run inline with execute_sync(), through Megatron's fully parallel wrapper (which
    # spreads the main replicas of replicated tensors over the ranks)
    values, sd = state(3)
    wrapped = FullyParallelSaveStrategyWrapper(save)
    request = mdc.save(sd, str(base / EXEC), sharded_strategy=wrapped, async_sharded_save=True)
    clobber(values)
    request.execute_sync()
    out["exec"] = mdc.load(template(rank, world), str(base / EXEC), sharded_strategy=load)

    # 6. which strategy ran, and where the data is
    out["dirs"] = {name: sorted(os.listdir(base / name)) for name in (SYNC, ASYNC, EXEC)}
    out["metadata_json"] = json.loads((base / SYNC / "metadata.json").read_text())
    out["pointer"] = json.loads((base / SYNC / POINTER).read_text())
    out["store_checkpoints"] = store.list_checkpoints()
    out["store_files"] = sorted(os.listdir(store.layout.checkpoint_dir(ASYNC)))
    out["staging_left"] = sorted(os.listdir(store.layout.staging_dir))
    out["saves_committed"], out["loads"] = save.saves_committed, load.loads

    # 7. Megatron without our load strategy: common state yes, tensors no (a clear error)
    out["common_only"] = mdc.load_common_state_dict(str(base / SYNC))
    try:
        mdc.load(template(rank, world), str(base / SYNC))
        out["default_load_error"] = None
    except CheckpointingException as e:
        out["default_load_error"] = str(e)
    try:  # a strict load reads the checkpoint's sharded metadata first
        mdc.load(template(rank, world), str(base / SYNC), strict="return_all")
        out["default_strict_load_error"] = None
    except Exception as e:  # noqa: BLE001 - the test checks which error it is
        out["default_strict_load_error"] = f"{type(e).__name__}: {e}"

    # 8. strict handling and metadata queries (load_sharded_metadata / load_tensors_metadata)
    loaded, missing, unexpected = mdc.load(
        template(rank, world), str(base / EXEC), sharded_strategy=load, strict="return_all"
    )
    out["strict"] = {"loaded": loaded, "missing": sorted(missing), "unexpected": sorted(unexpected)}
    out["tensors_metadata"] = {
        k: (tuple(v.global_shape), v.dtype)
        for k, v in mdc.load_tensors_metadata(str(base / SYNC), sharded_strategy=load).items()
    }
    store.close()
    return out


def written_not_finalized(store: MemStore, sd: dict[str, Any], ckpt_dir: str) -> AsyncCallsQueue:
    """An async save of ``sd`` into ``ckpt_dir`` whose forked worker (Megatron's ``AsyncCallsQueue``) has
    written this rank's part; the queue holding it, not finalized."""
    queue = AsyncCallsQueue()
    save = MemStoreSaveStrategy(store)
    queue.schedule_async_request(mdc.save(sd, ckpt_dir, sharded_strategy=save, async_sharded_save=True))
    queue.async_calls[0].async_caller.process.join(60)
    return queue


def run_megatron_job(
    fn: Callable, dirs: Iterable[str], *args: Any, timeout: float = JOB_TIMEOUT_S
) -> Iterator[list[dict[str, Any]]]:
    """For a module's fixture: run ``fn(rank, world, root, ckpts, *args)`` once on WORLD gloo ranks, where
    ``ckpts`` holds the empty checkpoint directories ``dirs`` (Megatron wants checkpoint_dir to exist);
    yield the ranks' reports (failing if the job fails or outlasts ``timeout``), then remove everything."""
    m = MultiProc()
    try:
        ckpts = m.workdir / "ckpts"
        for name in dirs:
            (ckpts / name).mkdir(parents=True)
        yield m.start(fn, WORLD, str(m.root), str(ckpts), *args).check(timeout=timeout)
    finally:
        m.close()


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the 2-rank job once for the module; its ranks' reports."""
    dirs = (SYNC, ASYNC, EXEC, FAILED, STAGE_FAILED, WRITE_FAILED, f"again/{SYNC}")
    yield from run_megatron_job(megatron_job, dirs)


# -- the tests ----------------------------------------------------------------------------------------------


def test_sync_save_loads_bit_exact(job: list[dict]) -> None:
    """A synchronous dist_checkpointing.save through MemStoreSaveStrategy returns None and loads back bit
    for bit: TP shards on either dim, replicated tensor, int tensor, ShardedObject, common state."""
    for rank, rep in enumerate(job):
        assert rep["sync_returned"] is None
        assert_bit_equal(rep["sync"], expected_loaded(rank, 1), f"rank {rank} sync")


def test_load_reshards(job: list[dict]) -> None:
    """A load may ask for another sharding than the save's (DCP resharding): the whole TP-sharded tensor."""
    whole = torch.cat([local_values(r, 1)["w_col"] for r in range(WORLD)])
    for rank, rep in enumerate(job):
        assert_bit_equal(rep["resharded"], whole, f"rank {rank} layer.weight, whole")


def test_async_queue_stages_in_trainer_writes_in_worker_commits_at_finalize(job: list[dict]) -> None:
    """With async_sharded_save=True the strategy returns Megatron's AsyncRequest; the data is staged before
    save() returns (the live tensors, changed before the request was even scheduled, do not leak in); the
    forked worker writes it, but the checkpoint is committed, and metadata.json written, only by the
    finalize step of AsyncCallsQueue; then it loads bit for bit."""
    for rank, rep in enumerate(job):
        assert rep["request_is_megatron"]
        assert len([s for s in rep["staged_in_trainer"] if s.startswith(f"r{rank}-")]) == 1
        # both ranks' workers have written; no commit, no metadata.json yet (only Megatron's common.pt)
        assert rep["written_not_committed"] == {
            "record": True,
            "committed": False,
            "checkpoint_dir": ["common.pt"],
        }
        assert rep["finalized"] == [0]
        assert_bit_equal(rep["async"], expected_loaded(rank, 2), f"rank {rank} async")
        # the trainer reports the staging by the checkpoint's id, and the coordinator the commit; the
        # write's event is the forked worker's (logged there, no callback in a child)
        assert rep["async_events"] == (["stage", "commit"] if rank == 0 else ["stage"])


def test_execute_sync_loads_bit_exact(job: list[dict]) -> None:
    """AsyncRequest.execute_sync() runs the write and the commit inline, here with our strategy wrapped in
    Megatron's FullyParallelSaveStrategyWrapper; the tensors changed after save() returned do not reach the
    checkpoint."""
    for rank, rep in enumerate(job):
        assert_bit_equal(rep["exec"], expected_loaded(rank, 3), f"rank {rank} execute_sync")


def test_our_strategy_ran_and_data_is_in_the_store(job: list[dict]) -> None:
    """Our strategies, not Megatron's torch_dist defaults, did the saving and loading: metadata.json names
    our backend, checkpoint_dir holds only Megatron's small files and our pointer (no .distcp, no .metadata),
    the store holds the three checkpoints under the directories' names with shard files and a manifest,
    our strategies' counters moved, and no staging slot or results record is left."""
    for rep in job:
        assert rep["saves_committed"] == 3 and rep["loads"] == 4
        assert rep["store_checkpoints"] == [SYNC, ASYNC, EXEC]
        assert "manifest.msgpack" in rep["store_files"] and "COMMITTED" in rep["store_files"]
        assert any(f.endswith(".shard") for f in rep["store_files"])
        assert not any(f.startswith("megatron-results") for f in rep["store_files"])
        assert rep["staging_left"] == []
    rank0 = job[0]
    assert rank0["dirs"] == {name: MEGATRON_FILES for name in (SYNC, ASYNC, EXEC)}
    assert rank0["metadata_json"]["sharded_backend"] == BACKEND
    assert rank0["pointer"]["checkpoint_id"] == SYNC and rank0["pointer"]["job_id"] == JOB_ID


def test_existing_id_is_refused_and_later_saves_work(job: list[dict]) -> None:
    """A save whose directory's base name is already a committed checkpoint fails on every rank (nothing is
    overwritten) and does not hold up the saves after it."""
    for rep in job:
        assert rep["exists_error"] is not None and "already exists" in rep["exists_error"]
        assert ASYNC in rep["store_checkpoints"]


def test_failed_write_raises_everywhere_and_commits_nothing(job: list[dict]) -> None:
    """When a rank's write fails in Megatron's async worker, finalizing raises on every rank, the
    checkpoint is not committed in the store, Megatron writes no metadata.json, and the next save (the
    execute_sync one) still works."""
    for rep in job:
        assert rep["failed_write"] is not None and "failed" in rep["failed_write"]
        assert rep["failed_state"] == {"committed": False, "checkpoint_dir": ["common.pt"]}
        assert FAILED not in rep["store_checkpoints"] and EXEC in rep["store_checkpoints"]


def test_staging_failure_on_one_rank_fails_the_save_on_every_rank_at_once(job: list[dict]) -> None:
    """A rank whose staging fails still takes part in the planning, where the save fails on every rank
    with its error (before, the other rank waited in a collective until the group timed out)."""
    for rep in job:
        failed = rep["stage_failed"]
        assert failed is not None and "is closed" in failed["error"], failed
        assert failed["seconds"] < 60, failed
        assert STAGE_FAILED not in rep["store_checkpoints"] and EXEC in rep["store_checkpoints"]


def test_megatron_without_our_load_strategy(job: list[dict]) -> None:
    """Megatron alone still reads the common state (load_common_state_dict), and loading tensors without
    MemStoreLoadStrategy fails saying which store holds them, also with a ``strict`` mode that reads the
    checkpoint's sharded metadata first (before, that was Megatron's bare NotImplementedError)."""
    for rep in job:
        assert rep["common_only"] == common_state(1)
        err = rep["default_load_error"]
        assert err is not None and "MemStoreLoadStrategy" in err and f"job_id={JOB_ID!r}" in err
        err = rep["default_strict_load_error"]
        assert err is not None and err.startswith("CheckpointingException: "), err
        assert "MemStoreLoadStrategy" in err and f"job_id={JOB_ID!r}" in err, err


def test_strict_load_and_metadata(job: list[dict]) -> None:
    """strict='return_all' (which reads the checkpoint's sharded metadata) finds no missing or unexpected
    keys; load_tensors_metadata reports every tensor's global shape and dtype."""
    for rank, rep in enumerate(job):
        assert rep["strict"]["missing"] == [] and rep["strict"]["unexpected"] == []
        assert_bit_equal(rep["strict"]["loaded"], expected_loaded(rank, 3), f"rank {rank} strict")
        assert rep["tensors_metadata"] == {
            "layer.weight": ((8 * WORLD, 6), torch.float32),
            "layer.proj": ((5, 4 * WORLD), torch.bfloat16),
            "norm.weight": ((6,), torch.float32),
            "opt.steps": ((3 * WORLD,), torch.int64),
        }


# -- the checkpoint_dir mapping (one process) ----------------------------------------------------------------


def test_checkpoint_id_is_the_directory_name() -> None:
    """The store id is checkpoint_dir's base name, validated; URLs and names the store refuses fail."""
    assert checkpoint_id_for("/ckpts/run1/iter_0000100") == "iter_0000100"
    assert checkpoint_id_for(Path("/ckpts/run1/iter_0000100/")) == "iter_0000100"
    for bad in ("/ckpts/run 1/iter 100", "msc://bucket/iter_1", "/ckpts/.hidden"):
        with pytest.raises(ValueError):
            checkpoint_id_for(bad)


def test_pointer_names_the_checkpoint_to_load(tmp_path: Path, store: MemStore) -> None:
    """Loading follows the pointer (a renamed directory still finds its checkpoint) and refuses a pointer
    to another job's store; without a pointer the base name is the id."""
    assert resolve_checkpoint_id(tmp_path / "iter_7", store) == "iter_7"
    renamed = tmp_path / "best"
    renamed.mkdir()
    write_pointer(renamed, store, "iter_7", Metadata({}, storage_meta=StorageMeta(save_id="a-save")))
    assert resolve_checkpoint_id(renamed, store) == "iter_7"
    other = MemStore(root=store.root, job_id="other-job")
    try:
        with pytest.raises(CheckpointingException, match="other-job|job"):
            resolve_checkpoint_id(renamed, other)
    finally:
        other.close()


def test_a_synchronous_save_whose_write_fails_on_one_rank_fails_on_every_rank_at_once(
    job: list[dict],
) -> None:
    """The failing rank records its error and still finalizes, where every rank raises it (before, its
    error skipped its finalize step and the other rank waited in finalize's collective)."""
    for rep in job:
        failed = rep["write_failed"]
        assert failed is not None and "state_dict entry 'bad.w' is a meta tensor" in failed["error"], failed
        assert failed["seconds"] < 60, failed
        assert WRITE_FAILED not in rep["store_checkpoints"] and EXEC in rep["store_checkpoints"]


def test_async_fn_does_not_raise_when_it_cannot_even_record_its_outcome(tmp_path: Path) -> None:
    """async_fn must never raise: a raise skips the rank's finalize in a synchronous save, and the other
    ranks wait for it in finalize's collective. When even the record cannot be written (here its directory
    is gone), finalize finds no record and fails on every rank."""

    class FullTmpfs:
        def write_data(self, plan: Any, data: Any) -> Any:
            raise OSError(28, "No space left on device")

    _write_rank(FullTmpfs(), None, None, str(tmp_path / "gone" / "record"), os.getpid())  # type: ignore[arg-type]
    assert not (tmp_path / "gone").exists()


def test_tensors_metadata_of_properties_with_strides_gives_shape_and_dtype(shm_dir: str) -> None:
    """torch 2.15 records a tensor's strides in DCP's tensor properties, and ``torch.empty`` refuses them
    (Megatron-Core 0.16.1's own ``load_tensors_metadata`` fails on every checkpoint there). The properties
    of the torch installed here are given that field by hand, as torch 2.15 records it."""
    props = TensorProperties(dtype=torch.bfloat16)
    props.strides = (3, 1)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(properties=props, size=torch.Size([4, 3]), chunks=[chunk]),
            "obj": BytesStorageMetadata(),
        }
    )
    with MemStore(root=shm_dir, job_id=JOB_ID) as store:
        out = MemStoreLoadStrategy(store).load_tensors_metadata("unused", md)
    assert list(out) == ["w"]  # tensors only, as Megatron's torch_dist strategy gives
    assert (out["w"].global_shape, out["w"].dtype, out["w"].data) == ((4, 3), torch.bfloat16, None)
