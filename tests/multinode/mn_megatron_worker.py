"""A Megatron job over several nodes (one rank per node), run by torchrun on every node of a namespace
cluster: three attempts at one checkpoint directory, through ``MemStoreSaveStrategy``.

1. an async save written by Megatron's forked worker on every rank, whose finalize step never runs: the
   queue is closed with ``abort=True`` (as an in-process restart does). Its directory stays in the store
   of every node but the coordinator's, with this rank's results record in it.
2. the same directory again, asynchronously; rank 1's forked worker is SIGKILLed (the store's crash
   point) before it leaves its results. Finalizing raises on every rank, or commits.
3. the same directory once more, synchronously, then loaded back.

Events, one line ``@@mn {json}`` each (see mn_worker.emit): ``aborted`` (the files this node's store
holds of the checkpoint), ``retried`` (finalize's error, what is committed), ``loaded`` (whether the
third save loaded back bit for bit, and the error if not).

    python mn_megatron_worker.py CKPTS    (CKPTS: a directory every node sees; DCP_MEMSTORE_JOB_ID set)
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing as mdc
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from dcp_memstore import MemStore
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy
from dcp_memstore.store.faults import ENV as CRASH_AT
from tests.megatron import test_megatron_strategies as megatron_state
from tests.megatron.cuda_shim import shim_cuda_for_cpu
from tests.multinode.mn_worker import emit
from tests.multiproc.mp_harness import assert_bit_equal

CKPT = "iter_0000010"  # the checkpoint directory's name, and the id in the store
WORKER_WAIT_S = 60.0


def state(seed: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    values = megatron_state.local_values(rank, seed)
    obj = megatron_state.rank_object(rank, seed)
    return {**megatron_state.sharded(values, obj, rank, world), **megatron_state.common_state(seed)}


def attempts(store: MemStore, ckpt_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    save = MemStoreSaveStrategy(store)

    queue = AsyncCallsQueue()
    queue.schedule_async_request(mdc.save(state(1), ckpt_dir, sharded_strategy=save, async_sharded_save=True))
    queue.async_calls[0].async_caller.process.join(WORKER_WAIT_S)
    dist.barrier()
    queue.close(abort=True)  # the first attempt is never finalized
    emit(event="aborted", files=sorted(os.listdir(store.layout.checkpoint_dir(CKPT))))

    queue = AsyncCallsQueue()
    request = mdc.save(state(2), ckpt_dir, sharded_strategy=save, async_sharded_save=True)
    if rank == 1:  # the forked worker inherits this and kills itself before it leaves its results
        os.environ[CRASH_AT] = "write-data:1"
    queue.schedule_async_request(request)
    os.environ.pop(CRASH_AT, None)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = None
    except CheckpointException as e:  # DCP's, a BaseException
        error = str(e)
    emit(event="retried", error=error, committed=store.list_checkpoints())

    try:
        mdc.save(state(3), ckpt_dir, sharded_strategy=save)
        load = MemStoreLoadStrategy(store)
        loaded = mdc.load(megatron_state.template(rank, world), ckpt_dir, sharded_strategy=load)
        assert_bit_equal(loaded, megatron_state.expected_loaded(rank, 3), f"rank {rank}")
        emit(event="loaded", ok=True)
    except (AssertionError, CheckpointException) as e:  # raised on every rank
        emit(event="loaded", ok=False, error=str(e)[-2000:])


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    shim_cuda_for_cpu()  # Megatron's async path calls CUDA-only functions; see cuda_shim
    dist.init_process_group("gloo")
    store = MemStore(keep_in_memory=2, io_threads=1, stage_timeout_s=30, replication_timeout_s=3)
    try:
        attempts(store, str(Path(sys.argv[1]) / CKPT))
        dist.barrier()
    finally:
        store.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
