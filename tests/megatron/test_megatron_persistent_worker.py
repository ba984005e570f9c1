"""Megatron's persistent checkpoint worker (``AsyncCallsQueue(persistent=True)``) with our strategy, on 2
gloo ranks.

Megatron-LM's ``--use-persistent-ckpt-worker`` gives each rank one spawned worker process that runs the
``async_fn`` of every request it is sent, instead of forking the trainer for each save: the request,
with our writer and the staged tensors in it, is pickled to that process. Each rank here makes async saves
one after another through one queue: three that commit, and between them one whose write fails in the
worker. The live tensors are overwritten right after each ``save`` returns.

Megatron does not watch that worker. A second job, on one rank, has it killed for real (SIGKILL: the
store's crash point while it writes, or a kill while it waits for work): no request sent to it is ever
run or finalized, so the trainer's later saves must fail, saying why.

Megatron calls CUDA-only functions on its async path even for CPU tensors, and its persistent worker
selects a CUDA device first thing; ``cuda_shim`` stands them in for this CPU-only torch, in the job's
processes only (see its docstring).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

import torch  # noqa: E402
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from dcp_memstore import MemoryStorageWriter, MemStore, StagingTimeoutError  # noqa: E402
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy  # noqa: E402
from dcp_memstore.megatron.save import MEGATRON_SAVE, _writer_marker  # noqa: E402
from dcp_memstore.store import liveness  # noqa: E402
from dcp_memstore.store.faults import ENV as CRASH_AT  # noqa: E402
from tests.megatron import test_megatron_strategies as megatron_state  # noqa: E402
from tests.megatron.cuda_shim import shim_cuda_for_cpu, shim_persistent_worker_for_cpu  # noqa: E402
from tests.megatron.test_megatron_fully_parallel_load import tensor_devices, to_cpu  # noqa: E402
from tests.multiproc.mp_harness import JOB_ID, MultiProc, assert_bit_equal  # noqa: E402

pytestmark = pytest.mark.slow

# (checkpoint directory, seed of its state, whether its write is made to fail), in the order saved
SAVES = [
    ("iter_0000001", 1, False),
    ("iter_0000002", 2, True),
    ("iter_0000003", 3, False),
    ("iter_0000004", 4, False),
]
KEEP = 2  # keep_in_memory: the first save is evicted by the last
WRITE_WAIT_S = 60.0  # for the worker to leave a save's results (it imports torch and Megatron first)
JOB_WAIT_S = 150.0
# the killed workers' job: checkpoint directories, in the order saved (the last two digits seed the state)
WRITTEN, KILLED, REFUSED, REFUSED_AGAIN = "iter_0000011", "iter_0000012", "iter_0000013", "iter_0000014"
FIRST_KILLED, FIRST_REFUSED = "iter_0000021", "iter_0000022"
IDLE_WRITTEN, QUEUED, WAITING = "iter_0000031", "iter_0000032", "iter_0000033"
AFTER_ABORT = "iter_0000041"
KILLED_JOB_DIRS = (
    WRITTEN,
    KILLED,
    REFUSED,
    REFUSED_AGAIN,
    FIRST_KILLED,
    FIRST_REFUSED,
    IDLE_WRITTEN,
    QUEUED,
    WAITING,
    AFTER_ABORT,
)
STAGE_TIMEOUT_S = 3
ORPHAN_WAIT_S = 10  # the worker checks for its trainer twice a second


def state(rank: int, world: int, seed: int, device: str = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """The live tensors of ``rank`` in the state of ``seed`` (on ``device``), and Megatron's sharded state
    dict of them."""
    values = {k: t.to(device) for k, t in megatron_state.local_values(rank, seed).items()}
    obj = megatron_state.rank_object(rank, seed)
    return values, {**megatron_state.sharded(values, obj, rank, world), **megatron_state.common_state(seed)}


def persistent_worker_job(
    rank: int, world: int, root: str, ckpts: str, device: str = "cpu"
) -> dict[str, Any]:
    """Each rank: the async saves of ``SAVES`` from tensors on ``device`` through one persistent-worker
    queue, each finalized and loaded back into tensors on ``device`` before the next; report who wrote
    each and what came back (on the CPU)."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    shim_cuda_for_cpu()  # Megatron's async path calls CUDA-only functions; see cuda_shim
    shim_persistent_worker_for_cpu()
    store = MemStore(root, JOB_ID, keep_in_memory=KEEP, io_threads=2)
    save, load = MemStoreSaveStrategy(store), MemStoreLoadStrategy(store)
    queue = AsyncCallsQueue(persistent=True)
    base = Path(ckpts)
    out: dict[str, Any] = {"trainer": liveness.own_token(store.layout), "saves": {}}

    for name, seed, fail in SAVES:
        values, sd = state(rank, world, seed, device)
        request = mdc.save(sd, str(base / name), sharded_strategy=save, async_sharded_save=True)
        if fail:  # the staged files vanish before the worker moves them into the checkpoint
            for slot in os.listdir(store.layout.staging_dir):
                if slot.startswith(f"r{rank}-p{os.getpid()}-"):
                    shutil.rmtree(store.layout.staging_dir / slot)
        for t in values.values():  # training goes on: the live tensors change
            t.fill_(7)
        queue.schedule_async_request(request)
        record = Path(request.async_fn_args[3])  # where this rank's write leaves its results
        deadline = time.monotonic() + WRITE_WAIT_S
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert record.exists(), (
            f"rank {rank}: the persistent worker wrote nothing of {name} in {WRITE_WAIT_S}s"
        )
        seen: dict[str, Any] = {
            "writer": _writer_marker(record).read_text().split("\n"),  # its token, and what it is
            "committed_before_finalize": name in store.list_checkpoints(),
        }
        try:
            seen["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
            target = megatron_state.template(rank, world, device)
            loaded = mdc.load(target, str(base / name), sharded_strategy=load)
            seen["devices"] = tensor_devices(target, loaded)
            seen["loaded"] = to_cpu(loaded)
        except CheckpointException as e:
            seen["error"] = str(e)
        seen["worker_alive"] = queue.persistent_caller.process.is_alive()
        out["saves"][name] = seen

    out["committed"] = store.list_checkpoints()
    out["staging_left"] = sorted(os.listdir(store.layout.staging_dir))
    worker = queue.persistent_caller.process
    queue.close()  # sends the worker its stop request and waits for it
    del queue  # now, while the process group exists: Megatron's __del__ asks it for this rank
    out["worker_exitcode"] = worker.exitcode
    store.close()
    return out


def killed_worker_job(rank: int, world: int, root: str, ckpts: str) -> dict[str, Any]:
    """One rank, one strategy, three persistent-worker queues, each closed with ``abort=True`` and let go
    after use. Through the first: a save, then one whose worker is SIGKILLed while it writes, then two
    more. Through the second: a save whose new worker is SIGKILLed in its first write, then one more.
    Through the third: a save, then the idle worker is SIGKILLed, then a save queued for it and one that
    must wait for the queued one. Report what each did."""
    shim_cuda_for_cpu()
    shim_persistent_worker_for_cpu()
    store = MemStore(root, JOB_ID, io_threads=2, stage_timeout_s=STAGE_TIMEOUT_S)
    base = Path(ckpts)
    out: dict[str, Any] = {}

    def save(queue: AsyncCallsQueue, strategy: MemStoreSaveStrategy, name: str, crash: str = "") -> str:
        """Save ``name`` through ``queue``; its outcome ("scheduled" or the error), and the seconds taken."""
        t0 = time.monotonic()
        try:
            sd = state(rank, world, int(name[-2:]))[1]
            request = mdc.save(sd, str(base / name), sharded_strategy=strategy, async_sharded_save=True)
        except (CheckpointException, StagingTimeoutError) as e:
            out[f"{name}_s"] = time.monotonic() - t0
            return f"{type(e).__name__}: {e}"
        out[f"{name}_s"] = time.monotonic() - t0
        if crash:  # a worker spawned now inherits it
            os.environ[CRASH_AT] = crash
        queue.schedule_async_request(request)
        os.environ.pop(CRASH_AT, None)
        return "scheduled"

    # 1. the worker is killed in its second write, after it wrote a save: recognised
    queue, strategy = AsyncCallsQueue(persistent=True), MemStoreSaveStrategy(store)
    out[WRITTEN] = save(queue, strategy, WRITTEN, crash=f"write-data:{rank}:2")
    out["written_finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    out[KILLED] = save(queue, strategy, KILLED)
    out[REFUSED] = save(queue, strategy, REFUSED)  # made at once: its turn comes when the worker has died
    out[REFUSED_AGAIN] = save(queue, strategy, REFUSED_AGAIN)
    worker = queue.persistent_caller.process
    worker.join(WRITE_WAIT_S)
    out["worker_exitcode"] = worker.exitcode
    out["refused_finalized"] = queue.maybe_finalize_async_calls(blocking=False)
    queue.close(abort=True)
    del queue  # now, while the process group exists: Megatron's __del__ asks it for this rank

    # 2. the same strategy, through a new queue (the first one's requests were let go with it), whose new
    # worker is killed in its first write: recognised too
    queue = AsyncCallsQueue(persistent=True)
    out[FIRST_KILLED] = save(queue, strategy, FIRST_KILLED, crash=f"write-data:{rank}:1")
    queue.persistent_caller.process.join(WRITE_WAIT_S)
    out[FIRST_REFUSED] = save(queue, strategy, FIRST_REFUSED)
    queue.close(abort=True)
    del queue

    # 3. a new queue, whose worker is killed while it waits for work: not recognised, so the saves queue
    # up behind the one sent to it
    queue = AsyncCallsQueue(persistent=True)
    out[IDLE_WRITTEN] = save(queue, strategy, IDLE_WRITTEN)
    out["idle_written_finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    worker = getattr(queue.persistent_caller, "process", None)
    if worker is not None:  # None where that save failed (the test says how)
        worker.kill()
        worker.join(WRITE_WAIT_S)
    out[QUEUED] = save(queue, strategy, QUEUED)  # sent to the dead worker: never run
    out[WAITING] = save(queue, strategy, WAITING)
    out["queued_finalized"] = queue.maybe_finalize_async_calls(blocking=False)  # seconds later: nothing
    out["committed"] = store.list_checkpoints()
    queue.close(abort=True)
    del queue

    # 4. a new queue (forked writers: quicker to start): the save queued for the dead worker, never
    # started, was let go with its queue, and no longer counts
    queue = AsyncCallsQueue()
    out[AFTER_ABORT] = save(queue, strategy, AFTER_ABORT)
    out["after_abort_finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    out["committed_at_last"] = store.list_checkpoints()
    queue.close()
    del queue
    store.close()
    return out


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the 2-rank job once; its ranks' reports (fails if it hangs)."""
    dirs = [name for name, _, _ in SAVES]
    yield from megatron_state.run_megatron_job(persistent_worker_job, dirs, timeout=JOB_WAIT_S)


def test_one_persistent_process_writes_every_save(job: list[dict]) -> None:
    """Each rank's saves are all written by one process, neither the trainer nor a fork per save (a forked
    writer takes a liveness token of its own), and each rank has its own worker."""
    writers = []
    for rep in job:
        tokens = {token for token, _ in (seen["writer"] for seen in rep["saves"].values())}
        assert len(tokens) == 1, tokens
        assert rep["trainer"] not in tokens
        assert all(kind == "persistent" for _, kind in (seen["writer"] for seen in rep["saves"].values()))
        writers += tokens
    assert len(set(writers)) == len(job)


def assert_saves_committed_at_finalize_and_loaded_bit_exact(reports: list[dict], device: str) -> None:
    """Every save of ``SAVES`` was committed only when finalized, and each that was not made to fail loaded
    back bit for bit into tensors on ``device``."""
    for rank, rep in enumerate(reports):
        for name, seed, fail in SAVES:
            seen = rep["saves"][name]
            assert seen["committed_before_finalize"] is False
            if not fail:
                assert "error" not in seen, seen.get("error")
                assert_bit_equal(
                    seen["loaded"], megatron_state.expected_loaded(rank, seed), f"rank {rank} {name}"
                )
                assert seen["devices"] == {device}


def test_saves_commit_at_finalize_and_load_back_bit_exact(job: list[dict]) -> None:
    """A save written by the persistent worker is committed only when finalized; it then loads back bit for
    bit, though the live tensors were overwritten as soon as ``save`` returned."""
    assert_saves_committed_at_finalize_and_loaded_bit_exact(job, "cpu")


def test_a_failed_write_raises_on_every_rank_and_the_worker_writes_the_next_save(job: list[dict]) -> None:
    """A write that fails in the worker fails its save at finalize on every rank, naming the rank's error,
    and commits nothing; the worker lives on and later saves commit, with retention applied."""
    failed = next(name for name, _, fail in SAVES if fail)
    kept = [name for name, _, fail in SAVES if not fail][-KEEP:]
    for rep in job:
        error = rep["saves"][failed]["error"]
        assert f"writing checkpoint '{failed}' failed" in error, error
        assert all(seen["worker_alive"] for seen in rep["saves"].values())
        assert rep["committed"] == kept


def test_the_worker_stops_cleanly_and_leaves_no_staging_memory(job: list[dict]) -> None:
    """``queue.close()`` stops each rank's worker (exit code 0), and no staging slot (tmpfs memory) is
    left behind."""
    for rep in job:
        assert rep["worker_exitcode"] == 0
        assert rep["staging_left"] == []


@pytest.fixture(scope="module")
def killed() -> Any:
    """Run the one-rank job whose worker is killed; its report."""
    m = MultiProc()
    try:
        for name in KILLED_JOB_DIRS:
            (m.workdir / "ckpts" / name).mkdir(parents=True)
        yield m.start(killed_worker_job, 1, str(m.root), str(m.workdir / "ckpts")).check(timeout=JOB_WAIT_S)[
            0
        ]
    finally:
        m.close()


def assert_refused_at_once(killed: dict, name: str, died_writing: str) -> None:
    """Save ``name`` failed at once (in DCP's CheckpointException, on every rank) with an error that names
    the dead worker, the checkpoint it was writing (``died_writing``), and the way out."""
    error = killed[name]
    assert error.startswith("CheckpointException"), error
    assert "persistent checkpoint worker of this rank" in error, error
    assert f"died while writing checkpoint {died_writing!r}" in error and "Restart the job" in error, error
    assert killed[f"{name}_s"] < STAGE_TIMEOUT_S, killed[f"{name}_s"]


def test_a_save_after_the_persistent_worker_died_writing_fails_at_once_saying_so(killed: dict) -> None:
    """Megatron never runs what it sends to a dead persistent worker. Once the worker dies writing a save,
    every later save fails at once, saying so, instead of being sent to that worker and waited for: the
    worker killed in its second write and the one killed in its first (which had written nothing) alike.
    The saves of a queue that was closed with ``abort=True`` and let go no longer count: the strategy
    saves through a new queue."""
    assert killed[WRITTEN] == "scheduled" and killed["written_finalized"] == [0]
    assert killed[KILLED] == "scheduled"
    assert killed["worker_exitcode"] == -9
    for name in (REFUSED, REFUSED_AGAIN):
        assert_refused_at_once(killed, name, KILLED)
    assert killed["refused_finalized"] == []
    assert killed[FIRST_KILLED] == "scheduled"
    assert_refused_at_once(killed, FIRST_REFUSED, FIRST_KILLED)


def test_a_worker_dead_between_saves_fails_the_save_that_waits_for_it(killed: dict) -> None:
    """A worker killed while it waits for work (after it wrote a save) cannot be told from one that has
    not started the write it was sent. The save sent to it stages at once,
    and the one that must wait for it fails after stage_timeout_s with a StagingTimeoutError that names a
    dead persistent worker as a cause. Nothing is committed but the saves the live workers wrote."""
    assert killed[IDLE_WRITTEN] == "scheduled" and killed["idle_written_finalized"] == [0]
    assert killed[QUEUED] == "scheduled"
    assert killed[f"{QUEUED}_s"] < STAGE_TIMEOUT_S, killed[f"{QUEUED}_s"]
    error = killed[WAITING]
    assert error.startswith("StagingTimeoutError") and f"waited {STAGE_TIMEOUT_S}s" in error, error
    assert "persistent worker" in error, error
    assert killed[f"{WAITING}_s"] < 3 * STAGE_TIMEOUT_S, killed[f"{WAITING}_s"]
    assert killed["queued_finalized"] == []
    assert killed["committed"] == [WRITTEN, IDLE_WRITTEN]


def test_a_save_sent_to_a_dead_worker_no_longer_counts_once_its_queue_is_aborted_and_let_go(
    killed: dict,
) -> None:
    """The docs' way out (close the queue with abort=True and let go of it): the save the dead worker
    never started stops counting, and the next save, through a new queue, is written and committed
    (before, every later save of the process waited for it: StagingTimeoutError)."""
    assert killed[AFTER_ABORT] == "scheduled", killed[AFTER_ABORT]
    assert killed[f"{AFTER_ABORT}_s"] < STAGE_TIMEOUT_S, killed[f"{AFTER_ABORT}_s"]
    assert killed["after_abort_finalized"] == [0]
    assert killed["committed_at_last"] == [IDLE_WRITTEN, AFTER_ABORT]


def test_a_sharing_strategy_that_cannot_send_the_writer_names_megatrons_way_out(store: MemStore) -> None:
    """Megatron pickles a request for its persistent worker in its queue's feeder thread, which only prints
    the error and drops the request. So that printed error must say what to do in Megatron's terms: the
    'file_descriptor' sharing strategy, or the forked worker, and that this save is lost."""
    writer = MemoryStorageWriter(store)
    writer.save_api = MEGATRON_SAVE  # as MemStoreSaveStrategy sets it
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        with pytest.raises(RuntimeError) as e:
            pickle.dumps(writer)
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    message = str(e.value)
    assert "reach Megatron's persistent worker" in message, message
    assert "set_sharing_strategy('file_descriptor')" in message, message
    assert "AsyncCallsQueue() without persistent=True" in message and "restart the job" in message, message
    assert "THREAD executor" not in message, message


def orphaning_job(rank: int, world: int, root: str, ckpts: str) -> None:
    """One rank: a save through the persistent worker, finalized; then the worker's pid goes to a file
    and the trainer SIGKILLs itself."""
    shim_cuda_for_cpu()
    shim_persistent_worker_for_cpu()
    store = MemStore(root, JOB_ID, io_threads=2)
    queue, strategy = AsyncCallsQueue(persistent=True), MemStoreSaveStrategy(store)
    sd = state(rank, world, 1)[1]
    queue.schedule_async_request(
        mdc.save(sd, str(Path(ckpts) / WRITTEN), sharded_strategy=strategy, async_sharded_save=True)
    )
    queue.maybe_finalize_async_calls(blocking=True)
    (Path(ckpts) / "worker.pid").write_text(str(queue.persistent_caller.process.pid))
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_worker_ends_when_its_trainer_is_killed() -> None:
    """Megatron's persistent worker waits for requests for as long as it lives; once its trainer is
    SIGKILLed it ends too (within a few seconds), instead of living on as an orphan that keeps the
    mappings of the shard files it wrote."""
    m = MultiProc()
    try:
        ckpts = m.workdir / "ckpts"
        (ckpts / WRITTEN).mkdir(parents=True)
        job = m.start(orphaning_job, 1, str(m.root), str(ckpts))
        assert job.wait(timeout=JOB_WAIT_S), job.errors()
        assert job.exitcodes() == [-signal.SIGKILL], job.errors()
        worker = int((ckpts / "worker.pid").read_text())
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while _runs(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _runs(worker), f"the persistent worker (pid {worker}) outlived its trainer"
    finally:
        m.close()


def _runs(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
