"""A Megatron async save whose forked writer is killed, on 2 gloo ranks.

Megatron's ``AsyncCallsQueue`` forks the trainer to run each request's ``async_fn``. When that process
dies (SIGKILL: the OOM killer, say) the request's finalize step runs only once every rank's queue sees
its writer gone, and a trainer may start its next save before that. The next save must neither wait for
the dead writer nor leave its staging slot behind.

The writer is killed for real, by the store's crash point (``DCP_MEMSTORE_CRASH_AT``) in the forked
process. Megatron calls CUDA-only functions on its async path even for CPU tensors; ``cuda_shim`` stands
them in for this CPU-only torch, in the job's processes only (see its docstring).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from dcp_memstore import MemStore  # noqa: E402
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy  # noqa: E402
from dcp_memstore.store.faults import ENV as CRASH_AT  # noqa: E402
from tests.megatron import test_megatron_strategies as megatron_state  # noqa: E402
from tests.megatron.cuda_shim import shim_cuda_for_cpu  # noqa: E402
from tests.multiproc.mp_harness import JOB_ID, assert_bit_equal  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
CRASHED, NEXT = "iter_0000010", "iter_0000020"  # checkpoint directories' names
JOB_WAIT_S = 90.0  # the job takes a few seconds; a save waiting for the dead writer hangs past this


def crashed_writer_job(rank: int, world: int, root: str, ckpts: str) -> dict[str, Any]:
    """Each rank: an async save whose writer on rank 1 is SIGKILLed, the next async save before that one
    is finalized, then both finalized and the second loaded back; report."""
    shim_cuda_for_cpu()  # Megatron's async path calls CUDA-only functions; see cuda_shim
    store = MemStore(root, JOB_ID, keep_in_memory=2, io_threads=2, stage_timeout_s=20)
    save, load = MemStoreSaveStrategy(store), MemStoreLoadStrategy(store)
    queue = AsyncCallsQueue()
    base = Path(ckpts)
    out: dict[str, Any] = {}

    def state(seed: int) -> dict[str, Any]:
        values = megatron_state.local_values(rank, seed)
        return {
            **megatron_state.sharded(values, megatron_state.rank_object(rank, seed), rank, world),
            **megatron_state.common_state(seed),
        }

    request = mdc.save(state(1), str(base / CRASHED), sharded_strategy=save, async_sharded_save=True)
    if rank == 1:  # the forked writer inherits this and kills itself after checksumming
        os.environ[CRASH_AT] = "write-data:1"
    queue.schedule_async_request(request)
    os.environ.pop(CRASH_AT, None)
    queue.async_calls[0].async_caller.process.join(60)  # this rank's writer has ended, or died
    dist.barrier()

    t0 = time.monotonic()
    request = mdc.save(state(2), str(base / NEXT), sharded_strategy=save, async_sharded_save=True)
    out["next_save_s"] = time.monotonic() - t0
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)  # the crashed save first, as Megatron orders them
        out["crashed"] = None
    except CheckpointException as e:
        out["crashed"] = str(e)
    out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    out["loaded"] = mdc.load(megatron_state.template(rank, world), str(base / NEXT), sharded_strategy=load)
    out["committed"] = store.list_checkpoints()
    out["staging_left"] = sorted(os.listdir(store.layout.staging_dir))
    store.close()
    return out


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the 2-rank job once; its ranks' reports (fails if it hangs)."""
    yield from megatron_state.run_megatron_job(crashed_writer_job, (CRASHED, NEXT), timeout=JOB_WAIT_S)


def test_next_save_does_not_wait_for_a_killed_writer(job: list[dict]) -> None:
    """The save after one whose forked writer was SIGKILLed stages and plans at once (before, that rank
    waited for the dead writer's results forever, and the other ranks in the planning's collectives)."""
    for rep in job:
        assert rep["next_save_s"] < 15, rep["next_save_s"]


def test_killed_writer_fails_its_save_and_the_next_one_commits(job: list[dict]) -> None:
    """Finalizing the save whose writer died raises on every rank and commits nothing; the save after it
    commits, loads back bit for bit, and no staging slot (tmpfs memory) is left behind."""
    for rank, rep in enumerate(job):
        assert rep["crashed"] is not None and "did not run to its end" in rep["crashed"], rep["crashed"]
        assert rep["finalized"] == [1]
        assert rep["committed"] == [NEXT]
        assert rep["staging_left"] == []
        assert_bit_equal(rep["loaded"], megatron_state.expected_loaded(rank, 2), f"rank {rank} next save")
