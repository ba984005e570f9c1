"""A rank SIGKILLed at each step of a 2-rank save: the previous checkpoint survives and the store recovers."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mp_harness import JOB_ID, MultiProc, assert_bit_equal, blank_like, make_tensor

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore

pytestmark = pytest.mark.slow

A, B, C = "ckpt-a", "ckpt-b", "ckpt-c"
SEED = {A: 1, B: 2, C: 3}


def state(ckpt: str, rank: int) -> dict:
    seed = SEED[ckpt] * 1000
    return {
        f"rank{rank}": {
            "w": make_tensor(seed + rank * 10 + 1, (96, 40), torch.float32),
            "b": make_tensor(seed + rank * 10 + 2, (50,), torch.bfloat16),
            "ids": make_tensor(seed + rank * 10 + 3, (20,), torch.int64),
        },
        "shared": {"emb": make_tensor(seed + 901, (32, 16), torch.float16)},
        "extra": {"name": ckpt},
    }


def load_and_check(store: MemStore, ckpt: str, rank: int) -> None:
    expected = state(ckpt, rank)
    target = blank_like(expected)
    dcp.load(target, checkpoint_id=ckpt, storage_reader=MemoryStorageReader(store))
    assert_bit_equal(target, expected, f"{ckpt} on rank {rank}")


def save_a_then_crash_in_b(rank: int, world: int, root: str, crash_at: str, b_async: bool) -> str:
    """Save A; then save B with ``DCP_MEMSTORE_CRASH_AT=crash_at`` so one rank kills itself in B's save."""
    store = MemStore(root, JOB_ID)
    writer = MemoryStorageWriter(store)
    dcp.save(state(A, rank), checkpoint_id=A, storage_writer=writer)
    os.environ["DCP_MEMSTORE_CRASH_AT"] = crash_at
    if b_async:
        dcp.async_save(state(B, rank), checkpoint_id=B, storage_writer=writer).result(timeout=120)
    else:
        dcp.save(state(B, rank), checkpoint_id=B, storage_writer=writer)
    return "B saved without crashing"  # only a rank not named in crash_at may get here


def recover(rank: int, world: int, root: str) -> dict:
    """A new job on the same store: what start-up left, what is visible, what loads; then save C."""
    store = MemStore(root, JOB_ID)  # start-up clears what dead saves left behind
    dist.barrier()  # every rank's start-up is done before anyone looks
    layout = store.layout
    found = {
        "checkpoint_dirs": sorted(os.listdir(layout.checkpoints_dir)),
        "staging": sorted(os.listdir(layout.staging_dir)),
        "trash": sorted(os.listdir(layout.trash_dir)),
        "listed": store.list_checkpoints(),
        "latest": store.latest_checkpoint(),
    }
    dist.barrier()  # both ranks looked before either saves C
    for ckpt in found["listed"]:
        load_and_check(store, ckpt, rank)
    dcp.save(state(C, rank), checkpoint_id=C, storage_writer=MemoryStorageWriter(store))
    load_and_check(store, C, rank)
    found["latest_after_c"] = store.latest_checkpoint()
    return found


@pytest.mark.parametrize(
    ("crash_at", "b_async"),
    [
        ("stage-copy:1", True),  # rank 1 dies while copying B into its staging slot
        (
            "write-data:1",
            True,
        ),  # rank 1 dies after checksumming its staged B files, before naming them into B
        ("write-data:0", False),  # the coordinator dies in a plain dcp.save, B's directory already made
        ("before-commit:0", True),  # the coordinator dies with B's manifest written, COMMITTED not yet
        ("after-commit:0", True),  # the coordinator dies right after committing B: B must be kept
    ],
)
def test_crash_during_save(mp: MultiProc, crash_at: str, b_async: bool) -> None:
    crash_rank = int(crash_at.split(":")[1])
    job = mp.start(save_a_then_crash_in_b, 2, str(mp.root), crash_at, b_async)
    assert job.wait(ranks=[crash_rank]), f"rank {crash_rank} did not crash at {crash_at}"
    assert job.exitcodes()[crash_rank] == -signal.SIGKILL, (
        f"rank {crash_rank} ended with exit code {job.exitcodes()[crash_rank]}, not SIGKILL\n{job.errors()}"
    )
    # The other rank is stuck in (or failing out of) a collective with the dead one: tear the job down.
    job.kill()
    job.assert_gone()
    b_dir = mp.job_dir / "checkpoints" / B
    assert b_dir.exists() or crash_at.startswith("stage-copy"), "the crash left nothing of B to clear"

    found = mp.run(recover, 2, str(mp.root))

    committed = [A, B] if crash_at.startswith("after-commit") else [A]
    for r, f in enumerate(found):
        assert f["latest"] == committed[-1], f"rank {r}: {f}"
        assert f["listed"] == committed, f"rank {r}: {f}"
        assert f["checkpoint_dirs"] == committed, f"rank {r}: leftovers of the dead save: {f}"
        assert f["staging"] == [], f"rank {r}: staging slots of the dead save left on tmpfs: {f}"
        assert f["trash"] == [], f"rank {r}: {f}"
        assert f["latest_after_c"] == C, f"rank {r}: {f}"
