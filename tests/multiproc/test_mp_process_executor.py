"""dcp.async_save with DCP's PROCESS executor: state dicts that grow and shrink,
and the sharing-strategy guard."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp
from mp_harness import JOB_ID, MultiProc, assert_bit_equal, blank_like, make_tensor
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.store.layout import SHARD_SUFFIX, parse_slot

pytestmark = pytest.mark.slow

PROCESS = AsyncCheckpointerType.PROCESS
SAVE_TIMEOUT_S = 60.0  # one async save on a busy 2-core machine takes well under a second once warm
STAGE_TIMEOUT_S = 8.0  # a save stuck behind a dead slot: StagingTimeoutError, well within the test's time

# What each of the five saves holds: weights only, + Adam state, + one large tensor, then shrinking back.
PHASES = [
    ("model",),
    ("model", "optim"),
    ("model", "optim", "big"),
    ("model", "optim"),
    ("model",),
]
PARAMS = {
    "w": ((256, 256), torch.float32),
    "emb": ((300, 64), torch.float16),
    "b": ((256,), torch.bfloat16),
}


def growing_state(step: int, rank: int) -> dict:
    """Rank ``rank``'s state at save ``step`` (1-based): the groups of ``PHASES[step - 1]``, new values
    each step."""
    seed = step * 1000 + rank * 100
    groups = PHASES[step - 1]
    mine: dict = {}
    if "model" in groups:
        mine["model"] = {k: make_tensor(seed + i, s, dt) for i, (k, (s, dt)) in enumerate(PARAMS.items())}
    if "optim" in groups:  # Adam: exp_avg and exp_avg_sq shaped like each parameter, and a step count
        mine["optim"] = {
            f"{k}.{moment}": make_tensor(seed + 10 + 2 * i + j, s, dt)
            for i, (k, (s, dt)) in enumerate(PARAMS.items())
            for j, moment in enumerate(("exp_avg", "exp_avg_sq"))
        }
        mine["optim"]["step"] = torch.tensor(float(step), dtype=torch.float32)
    if "big" in groups:
        mine["big"] = {"activations": make_tensor(seed + 50, (768, 512), torch.float32)}  # 1.5 MiB
    return {
        f"rank{rank}": mine,
        "shared": {
            "ids": make_tensor(step * 1000 + 999, (33,), torch.int64)
        },  # replicated: one rank writes it
        "extra": {"step": step},
    }


def _pool_sizes(store: MemStore, rank: int) -> list[int]:
    d = store.layout.pool_dir(rank)
    return (
        sorted(e.stat().st_size for e in os.scandir(d) if e.name.endswith(SHARD_SUFFIX)) if d.exists() else []
    )


def _my_slots(store: MemStore, rank: int) -> list[str]:
    return sorted(
        n for n in os.listdir(store.layout.staging_dir) if (s := parse_slot(n)) is not None and s[0] == rank
    )


def growing_then_shrinking_saves(rank: int, world: int, root: str) -> dict:
    """Five PROCESS-executor async saves through one writer, each waited on and loaded back bit-exact.
    The store's callback (a lambda: it cannot be pickled) stays in this process."""
    seen: list[tuple[str, str | None]] = []
    store = MemStore(
        root,
        JOB_ID,
        keep_in_memory=1,
        io_threads=2,
        stage_timeout_s=STAGE_TIMEOUT_S,
        on_event=lambda e: seen.append((e.phase, e.checkpoint_id)),
    )
    writer = MemoryStorageWriter(store)
    pool_before: list[list[int]] = []
    for step in range(1, len(PHASES) + 1):
        live = growing_state(step, rank)
        pool_before.append(_pool_sizes(store, rank))
        ckpt = f"step-{step}"
        fut = dcp.async_save(live, checkpoint_id=ckpt, storage_writer=writer, async_checkpointer_type=PROCESS)
        for t in [*live[f"rank{rank}"].get("model", {}).values(), live["shared"]["ids"]]:
            t.fill_(7)  # training goes on while the checkpoint process writes the staged copy
        fut.result(timeout=SAVE_TIMEOUT_S)
        assert store.list_checkpoints() == [ckpt], f"rank {rank} after {ckpt}: {store.list_checkpoints()}"
        assert _my_slots(store, rank) == [], f"rank {rank}: staging slot left after {ckpt} finished"
        expected = growing_state(step, rank)
        target = blank_like(expected)
        dcp.load(target, checkpoint_id=ckpt, storage_reader=MemoryStorageReader(store))
        assert_bit_equal(target, expected, f"{ckpt} on rank {rank}")
    writer.close()
    return {"latest": store.latest_checkpoint(), "pool_before": pool_before, "events": seen}


def test_process_executor_state_dict_grows_and_shrinks(mp: MultiProc) -> None:
    """Pooled shard files of other sizes must never be resized under DCP's checkpoint process, which keeps
    the storages it received (at their old size): every save of a growing, then shrinking, state succeeds."""
    results = mp.run(growing_then_shrinking_saves, 2, str(mp.root))
    last = f"step-{len(PHASES)}"
    assert [r["latest"] for r in results] == [last, last]
    # the time training waited is reported here, where it waited (DCP names the save only in its
    # checkpoint process, which writes, commits and logs the rest)
    assert [r["events"] for r in results] == [[("stage", None)] * len(PHASES)] * 2
    for rank, r in enumerate(results):
        pools = r["pool_before"]
        # the scenario this guards: from save 3 on, evicted files of the previous sizes sit in the pool
        assert all(pools[i] for i in range(2, len(PHASES))), f"rank {rank}: pool never filled: {pools}"
        assert len({s for p in pools for s in p}) >= 3, f"rank {rank}: pooled sizes did not vary: {pools}"
    assert sorted(os.listdir(mp.job_dir / "checkpoints")) == [last]
    assert os.listdir(mp.job_dir / "staging") == [], "staging slot left after every save finished"


# ---------------------------------------------------------------------------------------------------------
# the 'file_system' sharing strategy


def small_state(step: int, rank: int) -> dict:
    return {
        f"rank{rank}": {"w": make_tensor(step * 10 + rank, (128, 96), torch.float32)},
        "extra": {"step": step},
    }


def refused_then_recovered(rank: int, world: int, root: str) -> dict:
    """Async-save under 'file_system' (must fail, not hang), then save again with one and the same writer
    under 'file_descriptor'. Outcomes are returned, not raised, so each test checks its own part."""
    store = MemStore(root, JOB_ID, stage_timeout_s=STAGE_TIMEOUT_S)
    writer = MemoryStorageWriter(store)  # one writer for the run, as a trainer keeps it
    out: dict = {}
    tmp.set_sharing_strategy("file_system")
    try:
        fut = dcp.async_save(
            small_state(1, rank),
            checkpoint_id="step-1",
            storage_writer=writer,
            async_checkpointer_type=PROCESS,
        )
        try:
            fut.result(timeout=SAVE_TIMEOUT_S)
            out["refused"] = "no error: the save succeeded"
        except concurrent.futures.TimeoutError:
            out["refused"] = f"hang: the future neither failed nor finished in {SAVE_TIMEOUT_S:.0f}s"
        except Exception as e:
            out["refused"] = f"{type(e).__name__}: {e}"
    finally:
        tmp.set_sharing_strategy("file_descriptor")
    out["listed_after_refusal"] = store.list_checkpoints()
    try:
        expected = small_state(2, rank)
        fut = dcp.async_save(
            small_state(2, rank),
            checkpoint_id="step-2",
            storage_writer=writer,
            async_checkpointer_type=PROCESS,
        )
        fut.result(timeout=SAVE_TIMEOUT_S)
        target = blank_like(expected)
        dcp.load(target, checkpoint_id="step-2", storage_reader=MemoryStorageReader(store))
        assert_bit_equal(target, expected, f"step-2 on rank {rank}")
        out["recovered"] = "ok"
    except Exception as e:
        out["recovered"] = f"{type(e).__name__}: {e}"
    out["listed"] = store.list_checkpoints()
    return out


@pytest.fixture(scope="module")
def strategy_run(module_mp: MultiProc) -> tuple[MultiProc, list[dict]]:
    job = module_mp.start(refused_then_recovered, 2, str(module_mp.root))
    try:
        return module_mp, job.check()
    finally:  # 'file_system' pickling leaves torch_<pid>_* segments that a killed shm manager may not remove
        for pid in job.pids:
            for f in Path("/dev/shm").glob(f"torch_{pid}_*"):
                f.unlink(missing_ok=True)


def test_file_system_sharing_strategy_is_refused(strategy_run: tuple[MultiProc, list[dict]]) -> None:
    """The writer cannot reach the checkpoint process under 'file_system': the save fails, naming the fix."""
    _, results = strategy_run
    for rank, r in enumerate(results):
        assert r["refused"].startswith("RuntimeError: ") and "file_descriptor" in r["refused"], (
            f"rank {rank}: {r['refused']}"
        )
        assert r["listed_after_refusal"] == [], f"rank {rank}: {r}"


def test_save_after_refused_save_succeeds(strategy_run: tuple[MultiProc, list[dict]]) -> None:
    """The refused save must not poison the store: the next save (same writer) commits and loads bit-exact."""
    mp, results = strategy_run
    for rank, r in enumerate(results):
        assert r["recovered"] == "ok", f"rank {rank}: {r['recovered']}"
        assert r["listed"] == ["step-2"], f"rank {rank}: {r}"
    assert os.listdir(mp.job_dir / "staging") == [], "staging slot left after the saves finished"
