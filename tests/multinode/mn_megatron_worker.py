"""A Megatron job over several nodes (one rank per node), run by torchrun on every node of a namespace
cluster, saving through ``MemStoreSaveStrategy``; the second argument picks what it does.

``attempts``: three attempts at one checkpoint directory.

1. an async save written by Megatron's forked worker on every rank, whose finalize step never runs: the
   queue is closed with ``abort=True`` (as an in-process restart does). Its directory stays in the store
   of every node but the coordinator's, with this rank's results record in it.
2. the same directory again, asynchronously; rank 1's forked worker is SIGKILLed (the store's crash
   point) before it leaves its results. Finalizing raises on every rank, or commits.
3. the same directory once more, synchronously, then loaded back.

Events, one line ``@@mn {json}`` each (see mn_worker.emit): ``aborted`` (the files this node's store
holds of the checkpoint), ``retried`` (finalize's error, what is committed), ``loaded`` (whether the
third save loaded back bit for bit, and the error if not).

``opened``: an async save written by Megatron's forked workers; before it is finalized, another process
opens the store on node 1 (which clears what dead saves left there). Then it is finalized and loaded back.
Last, another async save is written and never finalized: the job ends first. Events: ``opened`` (node 1:
the files its store still holds of the save), ``finalized`` (finalize's error, what is committed),
``loaded`` (as above), ``unfinalized`` (the files this node's store holds of the last save).

    python mn_megatron_worker.py CKPTS [attempts|opened]
    (CKPTS: a directory every node sees, holding the checkpoint directories; DCP_MEMSTORE_JOB_ID set)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing as mdc
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from dcp_memstore import MemStore
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy
from dcp_memstore.store.faults import ENV as CRASH_AT
from tests.megatron import test_megatron_strategies as megatron_state
from tests.megatron.cuda_shim import shim_cuda_for_cpu
from tests.multinode.mn_worker import emit
from tests.multiproc.mp_harness import assert_bit_equal

CKPT = "iter_0000010"  # the checkpoint directory's name, and the id in the store (attempts, opened)
UNFINALIZED = "iter_0000020"  # opened: the save the job never finalizes
OPEN_STORE = "from dcp_memstore import MemStore; MemStore(io_threads=1).close()"  # root, job id: from env
WORKER_WAIT_S = 60.0


def state(seed: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    values = megatron_state.local_values(rank, seed)
    obj = megatron_state.rank_object(rank, seed)
    return {**megatron_state.sharded(values, obj, rank, world), **megatron_state.common_state(seed)}


def check_loaded(store: MemStore, ckpt_dir: str, seed: int) -> None:
    """Load ``ckpt_dir`` through the store; AssertionError unless it is ``state(seed)``, bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    load = MemStoreLoadStrategy(store)
    loaded = mdc.load(megatron_state.template(rank, world), ckpt_dir, sharded_strategy=load)
    assert_bit_equal(loaded, megatron_state.expected_loaded(rank, seed), f"rank {rank}")


def written(store: MemStore, seed: int, ckpt_dir: str) -> AsyncCallsQueue:
    """An async save of ``state(seed)`` whose forked worker has written it on every rank; not finalized."""
    queue = megatron_state.written_not_finalized(store, state(seed), ckpt_dir)
    dist.barrier()
    return queue


def finalize(queue: AsyncCallsQueue) -> str | None:
    """Run the finalize step of the queue's saves; the error it raised on every rank, or None."""
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointException as e:  # DCP's, a BaseException
        return str(e)
    return None


def attempts(store: MemStore, ckpt_dir: str) -> None:
    rank = dist.get_rank()
    save = MemStoreSaveStrategy(store)

    written(store, 1, ckpt_dir).close(abort=True)  # the first attempt is never finalized
    emit(event="aborted", files=sorted(os.listdir(store.layout.checkpoint_dir(CKPT))))

    queue = AsyncCallsQueue()
    request = mdc.save(state(2), ckpt_dir, sharded_strategy=save, async_sharded_save=True)
    if rank == 1:  # the forked worker inherits this and kills itself before it leaves its results
        os.environ[CRASH_AT] = "write-data:1"
    queue.schedule_async_request(request)
    os.environ.pop(CRASH_AT, None)
    emit(event="retried", error=finalize(queue), committed=store.list_checkpoints())

    try:
        mdc.save(state(3), ckpt_dir, sharded_strategy=save)
        check_loaded(store, ckpt_dir, 3)
        emit(event="loaded", ok=True)
    except (AssertionError, CheckpointException) as e:  # raised on every rank
        emit(event="loaded", ok=False, error=str(e)[-2000:])


def opened(store: MemStore, ckpt_dir: str) -> None:
    rank = dist.get_rank()
    queue = written(store, 4, ckpt_dir)
    if rank == 1:  # another process of the job starts on this node: its store clears dead saves' leftovers
        subprocess.run([sys.executable, "-c", OPEN_STORE], check=True, timeout=WORKER_WAIT_S)
        d = store.layout.checkpoint_dir(CKPT)
        emit(event="opened", files=sorted(os.listdir(d)) if d.is_dir() else None)
    dist.barrier()
    emit(event="finalized", error=finalize(queue), committed=store.list_checkpoints())
    try:
        check_loaded(store, ckpt_dir, 4)
        emit(event="loaded", ok=True)
    except (AssertionError, CheckpointingException) as e:  # not committed: "not a distributed checkpoint"
        emit(event="loaded", ok=False, error=str(e)[-2000:])
    written(store, 5, str(Path(ckpt_dir).with_name(UNFINALIZED)))  # the job ends before its finalize step
    emit(event="unfinalized", files=sorted(os.listdir(store.layout.checkpoint_dir(UNFINALIZED))))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    shim_cuda_for_cpu()  # Megatron's async path calls CUDA-only functions; see cuda_shim
    dist.init_process_group("gloo")
    store = MemStore(keep_in_memory=2, io_threads=1, stage_timeout_s=30, replication_timeout_s=3)
    try:
        scenario = {"attempts": attempts, "opened": opened}[sys.argv[2] if len(sys.argv) > 2 else "attempts"]
        scenario(store, str(Path(sys.argv[1]) / CKPT))
        dist.barrier()
    finally:
        store.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
