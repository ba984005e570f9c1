"""Bad input through DCP: each gives a clear error before anything is written, and leaves the store usable."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_state import assert_tree_equal, async_save, load, load_fresh, save, snapshot, store_tree
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._async_thread_executor import _ThreadBasedAsyncCheckpointExecutor
from torch.distributed.checkpoint.api import CheckpointException
from torch.testing._internal.two_tensor import TwoTensor

from dcp_memstore import InsufficientSpaceError, MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.dcp.reader import NEEDS_CHECKPOINT_ID
from dcp_memstore.dcp.stager import Stager
from dcp_memstore.errors import ChecksumMismatchError, TruncatedShardError
from dcp_memstore.replication.transport import ReplicationError
from dcp_memstore.store import catalog, liveness
from dcp_memstore.store.layout import INPROGRESS, shard_name
from dcp_memstore.store.records import write_record
from dcp_memstore.store.space import allocate_file, free_bytes

MiB = 1 << 20
BAD_IDS = ["a/b", "../evil", "..", "", "x" * 200, "/abs/path", "sp ace"]


def _state(i: int = 0, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(n, generator=g), "step": i}


def _assert_no_checkpoint_or_slot_left(store: MemStore) -> None:
    """A failed async save leaves no checkpoint directory and no staging slot (its files may be pooled)."""
    assert list(store.layout.checkpoints_dir.iterdir()) == []
    assert list(store.layout.staging_dir.iterdir()) == []
    assert list(store.layout.trash_dir.iterdir()) == []


@pytest.fixture
def quick_store(shm_dir):
    """A store whose async saves give up after 20 s instead of 10 minutes if an earlier one wedged."""
    s = MemStore(root=shm_dir, job_id="job", io_threads=2, stage_timeout_s=20)
    yield s
    s.close()


@pytest.mark.parametrize("cid", BAD_IDS)
def test_save_with_invalid_id_raises_valueerror_naming_it_and_writes_nothing(quick_store, cid):
    before = store_tree(quick_store)
    with pytest.raises(ValueError) as ei:
        save(quick_store, _state(), cid)
    assert f"invalid checkpoint id {cid!r}" in str(ei.value)
    assert store_tree(quick_store) == before
    assert quick_store.list_checkpoints() == []


@pytest.mark.parametrize("cid", ["a/b", "../evil", ""])
def test_async_save_with_invalid_id_fails_cleanly_and_later_saves_proceed(quick_store, cid):
    fut = async_save(quick_store, _state(), cid)  # DCP stages before it hands the id to the writer
    with pytest.raises(ValueError, match="invalid checkpoint id"):
        fut.result()
    _assert_no_checkpoint_or_slot_left(quick_store)
    t0 = time.monotonic()
    async_save(quick_store, _state(1), "good").result()
    assert time.monotonic() - t0 < 10, "the failed save left a ticket that the next save had to wait out"
    assert_tree_equal(_state(1), load_fresh(quick_store, _state(1), "good"))


@pytest.mark.parametrize("cid", BAD_IDS)
def test_load_with_invalid_id_raises_valueerror(quick_store, cid):
    save(quick_store, _state(), "ok")
    with pytest.raises(ValueError, match="invalid checkpoint id"):
        load(quick_store, _state(9), cid)


def test_load_of_unknown_checkpoint_names_it_and_lists_existing_ones(quick_store):
    save(quick_store, _state(0), "step-1")
    save(quick_store, _state(1), "step-2")
    with pytest.raises(FileNotFoundError) as ei:
        load(quick_store, _state(9), "step-3")
    msg = str(ei.value)
    assert "'step-3' not found" in msg
    assert "['step-1', 'step-2']" in msg


def test_load_from_an_empty_store_says_there_are_none(quick_store):
    with pytest.raises(FileNotFoundError, match="committed checkpoints: none"):
        load(quick_store, _state(), "step-1")


@pytest.mark.parametrize(
    "reader_used_before", ["no", "loaded", "loaded, then a bad id", "loaded, then unknown"]
)
def test_load_with_checkpoint_id_none_is_a_clear_error(quick_store, reader_used_before):
    """The None that latest_checkpoint() returns when there is nothing to resume from never loads anything,
    also with a reader that loaded a checkpoint before (DCP does not reset a reader when the id is None),
    and with one whose last load failed on its checkpoint id (that reset found nothing to aim at)."""
    save(quick_store, _state(1), "a")
    reader = MemoryStorageReader(quick_store)
    if reader_used_before != "no":
        dcp.load(_state(5), checkpoint_id="a", storage_reader=reader, no_dist=True)
    if reader_used_before.endswith(("bad id", "unknown")):
        bad = "bad/id" if reader_used_before.endswith("bad id") else "missing"
        with pytest.raises((ValueError, FileNotFoundError)):
            dcp.load(_state(5), checkpoint_id=bad, storage_reader=reader, no_dist=True)
    dest = _state(5)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(dest, checkpoint_id=None, storage_reader=reader, no_dist=True)
    cause = ei.value.failures[0][0]  # what the rank raised: DCP before 2.12 kept only 'metadata is None'
    assert type(cause) is ValueError and str(cause) == NEEDS_CHECKPOINT_ID
    assert_tree_equal(dest, _state(5))  # nothing loaded
    dcp.load(dest, checkpoint_id="a", storage_reader=reader, no_dist=True)  # the reader still works
    assert_tree_equal(dest, _state(1))


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_saving_an_existing_id_raises_and_keeps_the_original(quick_store, mode):
    save(quick_store, _state(0), "step-1")
    before = store_tree(quick_store, pool=mode == "save")
    with pytest.raises(CheckpointException) as ei:
        if mode == "save":
            save(quick_store, _state(1), "step-1")
        else:
            async_save(quick_store, _state(1), "step-1").result()
    msg = str(ei.value)
    assert "CheckpointExistsError" in msg and "'step-1' already exists" in msg
    assert "store.delete" in msg
    assert store_tree(quick_store, pool=mode == "save") == before
    assert_tree_equal(_state(0), load_fresh(quick_store, _state(0), "step-1"))
    t0 = time.monotonic()
    async_save(quick_store, _state(2), "step-2").result()  # the store is still usable
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_checkpoint_id_none_is_a_clear_error(quick_store, mode):
    before = store_tree(quick_store, pool=mode == "save")
    writer = MemoryStorageWriter(quick_store)
    with pytest.raises(CheckpointException) as ei:
        if mode == "save":
            dcp.save(_state(), checkpoint_id=None, storage_writer=writer, no_dist=True)
        else:
            dcp.async_save(_state(), checkpoint_id=None, storage_writer=writer, no_dist=True).result()
    assert "needs checkpoint_id='NAME'" in str(ei.value)
    assert store_tree(quick_store, pool=mode == "save") == before
    t0 = time.monotonic()
    async_save(quick_store, _state(1), "after").result()
    assert time.monotonic() - t0 < 10, (
        "the failed save left a staging slot that the next save had to wait out"
    )
    assert quick_store.list_checkpoints() == ["after"]


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_checkpoint_id_none_on_a_reused_writer_does_not_reuse_the_old_id(quick_store, mode):
    writer = MemoryStorageWriter(quick_store)
    dcp.save(_state(0), checkpoint_id="first", storage_writer=writer, no_dist=True)
    with pytest.raises(CheckpointException) as ei:
        if mode == "save":
            dcp.save(_state(1), checkpoint_id=None, storage_writer=writer, no_dist=True)
        else:
            dcp.async_save(_state(1), checkpoint_id=None, storage_writer=writer, no_dist=True).result()
    assert "needs checkpoint_id='NAME'" in str(ei.value)
    assert_tree_equal(_state(0), load_fresh(quick_store, _state(0), "first"))
    dcp.async_save(_state(2), checkpoint_id="second", storage_writer=writer, no_dist=True).result()
    assert quick_store.list_checkpoints() == ["first", "second"]


def _unstorable() -> dict:
    """Tensors whose raw bytes do not hold their values, each with the words its error must contain."""
    with warnings.catch_warnings():
        # torch deprecates quantized tensors; users still have them
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 3, torch.qint8)
    return {
        "sparse": (torch.eye(4).to_sparse(), "sparse_coo tensor", "to_dense()"),
        "meta": (torch.empty(4, device="meta"), "meta tensor", "materialize"),
        "quantized": (quantized, "quantized tensor", "dequantize()"),
        # a wrapper subclass: its values live in two inner tensors; copying it into a shard file kept one
        "subclass": (
            TwoTensor(torch.ones(4), torch.zeros(4)),
            "TwoTensor, a tensor subclass",
            "plain tensors",
        ),
    }


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize("kind", list(_unstorable()))
def test_a_tensor_whose_bytes_cannot_be_stored_is_refused_by_name_before_anything_is_written(
    quick_store, mode, kind
):
    """Sparse and meta tensors used to fail inside the copy with torch's words and no name; a quantized one
    was stored without its scale and zero point, a wrapper subclass (async_save) without its values."""
    tensor, what, fix = _unstorable()[kind]
    save(quick_store, _state(0), "ok")
    before = store_tree(quick_store, pool=False)
    sd = {"model": {"layers": [_state(1)["w"], tensor]}, "step": 1}
    with pytest.raises((ValueError, CheckpointException)) as ei:
        if mode == "save":
            save(quick_store, sd, "bad")
        else:
            async_save(quick_store, sd, "bad").result()  # staged, then refused by the background save
    msg = str(ei.value)
    assert "state_dict entry 'model.layers.1' is a" in msg and what in msg and fix in msg
    assert store_tree(quick_store, pool=False) == before
    assert quick_store.list_checkpoints() == ["ok"]
    async_save(quick_store, _state(2), "next").result()  # no ticket or slot left behind
    assert_tree_equal(_state(2), load_fresh(quick_store, _state(2), "next"))


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize("flatten", [True, False])
def test_tensors_that_dcp_pickles_whole_are_not_refused(quick_store, mode, flatten):
    """DCP pickles a tuple whole (and, with flatten_state_dict=False, every nested value): a sparse
    tensor inside one is not written as a tensor, so it is saved."""
    sparse = torch.eye(3).to_sparse()
    sd = {"pair": (torch.arange(3.0), sparse), "nested": {"s": sparse}}
    planner = DefaultSavePlanner(flatten_state_dict=flatten)
    if flatten:
        sd = {"pair": sd["pair"]}  # flattened, "nested.s" would be a tensor item, refused as above
    if mode == "save":
        save(quick_store, sd, "c", planner=planner)
    else:
        async_save(quick_store, sd, "c", planner=planner).result()
    dest = {k: None for k in sd} if not flatten else {"pair": None}
    out = load(quick_store, dest, "c")
    assert torch.equal(out["pair"][0], torch.arange(3.0))
    assert torch.equal(out["pair"][1].to_dense(), torch.eye(3))
    if not flatten:
        assert torch.equal(out["nested"]["s"].to_dense(), torch.eye(3))


@pytest.fixture
def tmpfs_store(small_tmpfs):
    s = MemStore(root=small_tmpfs / "store", job_id="job", io_threads=2, stage_timeout_s=20)
    yield s
    s.close()


def test_save_bigger_than_the_tmpfs_fails_before_writing_and_previous_checkpoint_survives(tmpfs_store):
    small = _state(0, n=256 << 10)  # 1 MiB
    save(tmpfs_store, small, "ok")
    before = store_tree(tmpfs_store)
    with pytest.raises(CheckpointException) as ei:
        save(tmpfs_store, _state(1, n=4 << 20), "too-big")  # 16 MiB on an 8 MiB tmpfs
    msg = str(ei.value)
    assert "InsufficientSpaceError" in msg
    needed = int(re.search(r"(\d+) bytes needed", msg).group(1))
    assert 16 * MiB < needed < 16 * MiB + 64 * 1024  # the data, and the manifest to come
    assert "bytes free" in msg
    assert store_tree(tmpfs_store) == before
    assert tmpfs_store.list_checkpoints() == ["ok"]
    assert_tree_equal(small, load_fresh(tmpfs_store, small, "ok"))


def test_async_save_bigger_than_the_tmpfs_fails_at_once_and_previous_checkpoint_survives(tmpfs_store):
    small = _state(0, n=256 << 10)
    async_save(tmpfs_store, small, "ok").result()
    before = store_tree(tmpfs_store)
    with pytest.raises(InsufficientSpaceError) as ei:
        async_save(tmpfs_store, _state(1, n=4 << 20), "too-big")  # raised by staging, in the caller
    assert ei.value.needed >= 16 * MiB
    assert ei.value.free < 8 * MiB
    assert f"{ei.value.needed} bytes needed, {ei.value.free} bytes free" in str(ei.value)
    assert store_tree(tmpfs_store) == before
    assert_tree_equal(small, load_fresh(tmpfs_store, small, "ok"))
    nxt = _state(2, n=256 << 10)
    t0 = time.monotonic()
    async_save(tmpfs_store, nxt, "next").result()
    assert time.monotonic() - t0 < 10
    assert_tree_equal(nxt, load_fresh(tmpfs_store, nxt, "next"))


def test_retained_checkpoints_that_leave_no_room_give_a_clear_error(tmpfs_store):
    """Two 3 MiB checkpoints kept on an 8 MiB tmpfs: the third cannot fit, and says how to fix it."""
    states = [_state(i, n=768 << 10) for i in range(3)]
    save(tmpfs_store, states[0], "s0")
    save(tmpfs_store, states[1], "s1")
    expected = snapshot(states[1])
    with pytest.raises(CheckpointException) as ei:
        save(tmpfs_store, states[2], "s2")
    assert "Lower keep_in_memory" in str(ei.value)
    assert tmpfs_store.list_checkpoints() == ["s0", "s1"]
    assert_tree_equal(expected, load_fresh(tmpfs_store, expected, "s1"))


def test_the_store_reopened_with_a_lower_keep_in_memory_as_the_error_advises_saves_again(tmpfs_store):
    """Following that advice works: the save reopened with ``keep_in_memory=1`` evicts the older of the
    two kept checkpoints to make room (before, eviction came only after a commit, which no save reached)."""
    states = [_state(i, n=768 << 10) for i in range(4)]
    for i in range(2):
        save(tmpfs_store, states[i], f"s{i}")
    with pytest.raises(CheckpointException, match="Lower keep_in_memory"):
        save(tmpfs_store, states[2], "s2")
    tmpfs_store.close()
    with MemStore(root=tmpfs_store.root, job_id="job", keep_in_memory=1, io_threads=2) as store:
        for i in (2, 3):
            save(store, states[i], f"s{i}")
            assert store.list_checkpoints() == [f"s{i}"]
        assert_tree_equal(snapshot(states[3]), load_fresh(store, states[3], "s3"))


_SAVE_THREE = """
import sys, torch, torch.distributed.checkpoint as dcp
from dcp_memstore import MemStore, MemoryStorageWriter
store = MemStore(root=sys.argv[1], job_id="job", keep_in_memory=1, io_threads=2)
for i in range(3):
    sd = {"w": torch.full((768 << 10,), float(i)), "step": i}
    dcp.save(sd, checkpoint_id=f"s{i}", storage_writer=MemoryStorageWriter(store), no_dist=True)
"""


def test_a_job_killed_between_a_commit_and_its_eviction_saves_again_on_a_full_tmpfs(small_tmpfs):
    """A job with ``keep_in_memory=1`` on a tmpfs that holds two checkpoints (``keep_in_memory`` +
    ``max_in_flight``, as docs/configuration.md sizes it) is SIGKILLed right after its third commit,
    before its eviction: two checkpoints are left. The restarted job's save evicts the older one instead
    of failing for lack of space, for good."""
    root = small_tmpfs / "store"
    env = {**os.environ, "DCP_MEMSTORE_CRASH_AT": "after-commit:0:3"}
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE_THREE, str(root)], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with MemStore(root=root, job_id="job", keep_in_memory=1, io_threads=2) as store:
        assert store.list_checkpoints() == ["s1", "s2"]
        state = _state(3, n=768 << 10)
        save(store, state, "s3")
        assert store.list_checkpoints() == ["s3"]
        assert_tree_equal(snapshot(state), load_fresh(store, state, "s3"))


def test_space_error_with_plan_caching_is_clear_and_keeps_previous(tmpfs_store, clean_plan_cache):
    """With a cached plan the writer sees no items at planning time; the space error must still come, and
    its advice (lower keep_in_memory) must work: the check that sees the bytes evicts beyond it."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    states = [_state(i, n=768 << 10) for i in range(3)]  # 3 MiB each, two kept on 8 MiB
    save(tmpfs_store, states[0], "s0", planner=planner)
    save(tmpfs_store, states[1], "s1", planner=planner)
    expected = snapshot(states[1])
    before = store_tree(tmpfs_store)
    with pytest.raises(CheckpointException) as ei:
        save(tmpfs_store, states[2], "s2", planner=planner)
    msg = str(ei.value)
    assert "InsufficientSpaceError" in msg and "bytes needed" in msg and "bytes free" in msg
    assert store_tree(tmpfs_store) == before  # not even the directory the failed save began
    assert tmpfs_store.list_checkpoints() == ["s0", "s1"]
    assert_tree_equal(expected, load_fresh(tmpfs_store, expected, "s1"))
    tmpfs_store.close()
    with MemStore(root=tmpfs_store.root, job_id="job", io_threads=2, keep_in_memory=1) as store:
        save(store, states[2], "s2", planner=planner)  # the failed id can be saved now
        assert store.list_checkpoints() == ["s2"]
        assert_tree_equal(states[2], load_fresh(store, states[2], "s2"))


def test_store_on_disk_warns_but_still_works(disk_dir):
    with pytest.warns(UserWarning, match="not on a memory file system"):
        store = MemStore(root=disk_dir / "store", job_id="job")
    save(store, _state(3), "a")
    assert_tree_equal(_state(3), load_fresh(store, _state(3), "a"))


@pytest.mark.parametrize("bad", ["/dev/shm/store", None, 3, object()])
def test_writer_and_reader_need_a_memstore(bad):
    with pytest.raises(TypeError, match="needs a MemStore, got"):
        MemoryStorageWriter(bad)
    with pytest.raises(TypeError, match="needs a MemStore, got"):
        MemoryStorageReader(bad)


def test_use_collectives_false_is_refused(quick_store):
    before = store_tree(quick_store)
    with pytest.raises(ValueError, match="use_collectives=True"):  # without collectives DCP raises it as is
        save(quick_store, _state(), "a", use_collectives=False)
    assert store_tree(quick_store) == before


@pytest.mark.parametrize(
    "error",
    [
        InsufficientSpaceError("/dev/shm/x", 10, 5, "2 ranks"),
        ChecksumMismatchError("/dev/shm/x/__0_0.shard", "model.w", 1, 2),
        TruncatedShardError("/dev/shm/x/__0_0.shard", "model.w", 100, 800),
        ReplicationError(("10.0.0.2", 4000), "no_space", "no room"),
    ],
)
def test_errors_survive_pickling_with_their_message(error):
    """DCP hands a rank's exception to the other ranks pickled."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)


class _PausingPlanner(DefaultSavePlanner):
    """Holds its save after the checkpoint's directory was begun (DCP calls ``finish_plan`` between
    ``prepare_global_plan`` and ``write_data``) until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.begun, self.go = threading.Event(), threading.Event()

    def finish_plan(self, new_plan):
        self.begun.set()
        assert self.go.wait(60)
        return super().finish_plan(new_plan)


def test_a_second_save_of_an_id_being_saved_in_this_process_is_refused(quick_store):
    """Two saves under one id at once must not both write its files: the second one is refused, and the
    first one commits its own values."""
    planner, first = _PausingPlanner(), _state(1)
    result: list = []
    t = threading.Thread(target=lambda: result.append(save(quick_store, first, "x", planner=planner)))
    t.start()
    try:
        assert planner.begun.wait(60)
        # CheckpointException derives from BaseException
        with pytest.raises(BaseException) as ei:  # noqa: B017
            save(quick_store, _state(2), "x")
        assert "CheckpointExistsError" in str(ei.value), ei.value
        assert "'x' is being saved right now by another save in this process" in str(ei.value)
    finally:
        planner.go.set()
        t.join(60)
    assert result and quick_store.list_checkpoints() == ["x"]
    assert_tree_equal(first, load_fresh(quick_store, first, "x"))


def test_a_save_of_an_id_another_running_process_is_saving_is_refused(quick_store):
    """Two runs that share a root and job id: the directory of a save that another live process began is
    left alone; once that process is gone, it is a dead save's leftover and the id can be saved."""
    # not this process's child (DCP's checkpoint process would be): a sleep whose shell exits at once
    pid = int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True).stdout)
    other = psutil.Process(pid)
    try:
        assert other.ppid() != os.getpid()
        directory = quick_store.layout.checkpoint_dir("x")
        directory.mkdir()
        owner = {"pid": pid, "create_time": other.create_time(), "host": socket.gethostname()}
        write_record(directory / INPROGRESS, {**owner, "started": time.time()})
        (directory / "__0_0.shard").write_bytes(b"other process's data")
        # CheckpointException derives from BaseException
        with pytest.raises(BaseException) as ei:  # noqa: B017
            save(quick_store, _state(2), "x")
        assert f"'x' is being saved right now by process {pid}" in str(ei.value), ei.value
        assert "its own job_id" in str(ei.value)
        assert (directory / "__0_0.shard").read_bytes() == b"other process's data"
    finally:
        other.kill()
        other.wait(10)
    save(quick_store, _state(2), "x")
    assert_tree_equal(_state(2), load_fresh(quick_store, _state(2), "x"))


_STUCK_SAVE = """
import sys, threading, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from dcp_memstore import MemoryStorageWriter, MemStore

class Stuck(DefaultSavePlanner):  # the save's directory is begun before finish_plan
    def finish_plan(self, new_plan):
        print("begun", flush=True)
        threading.Event().wait()

store = MemStore(root=sys.argv[1], job_id="job")
dcp.save({"w": torch.ones(1000)}, storage_writer=MemoryStorageWriter(store), checkpoint_id="x",
         planner=Stuck(), no_dist=True)
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_a_save_killed_in_another_container_is_cleared_once_its_process_is_gone(quick_store):
    """A job restarted in a new container (new hostname, new PID namespace) that shares the node's tmpfs
    finds the directory of a save killed in the old container: it must be cleared, not kept for good. A
    save running in the other container is left alone while its process lives."""
    with subprocess.Popen(
        ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", 'hostname other-box && exec "$@"']
        + ["sh", sys.executable, "-c", _STUCK_SAVE, str(quick_store.layout.root)],
        stdout=subprocess.PIPE,
        text=True,
    ) as box:
        try:
            assert box.stdout.readline() == "begun\n"
            with pytest.raises(BaseException) as ei:  # noqa: B017 (CheckpointException: BaseException)
                save(quick_store, _state(2), "x")
            assert "'x' is being saved right now by process 1 on host other-box" in str(ei.value), ei.value
        finally:
            for p in psutil.Process(box.pid).children(recursive=True):
                p.kill()  # SIGKILL the save in the other container
            box.wait(30)
    save(quick_store, _state(2), "x")
    assert_tree_equal(_state(2), load_fresh(quick_store, _state(2), "x"))
    # the dead process's lock file went with its leftovers; this process's own stays while it lives
    assert os.listdir(quick_store.layout.procs_dir) == [f"{liveness.own_token(quick_store.layout)}.lock"]


# Stages an async save of checkpoint "y" with DCP_MEMSTORE_CRASH_AT=stage-slot: SIGKILLed right after its
# staging slot is made, before the slot's owner record is written.
_STAGING_KILLED = """
import sys, torch, torch.distributed.checkpoint as dcp
from dcp_memstore import MemoryStorageWriter, MemStore

store = MemStore(root=sys.argv[1], job_id="job")
writer = MemoryStorageWriter(store)
dcp.async_save({"w": torch.ones(1000)}, storage_writer=writer, checkpoint_id="y", no_dist=True)
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_a_staging_slot_of_a_process_killed_in_another_container_is_recycled(quick_store):
    """A staging slot is made before its owner record; a process killed in between (in another PID
    namespace) left a slot judged by the pid in its name: that pid of another namespace (2 here) is a live
    process in this one, so the slot, and its memory, were kept for good. The name carries the process's
    lock token now."""
    env = dict(os.environ, DCP_MEMSTORE_CRASH_AT="stage-slot")
    box = subprocess.run(
        # a shell as the namespace's pid 1 (which ignores its own SIGKILL), the save its child, pid 2 there
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", '"$@"; exit $?', "sh"]
        + [sys.executable, "-c", _STAGING_KILLED, str(quick_store.layout.root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    staging = quick_store.layout.staging_dir
    left = os.listdir(staging)
    assert box.returncode == 128 + signal.SIGKILL, (box.returncode, box.stderr[-2000:])
    assert len(left) == 1 and not os.listdir(staging / left[0]), left  # the slot, without its owner record
    MemStore(root=quick_store.layout.root, job_id="job").close()  # the job restarts here
    assert os.listdir(staging) == []
    save(quick_store, _state(3), "y")  # and saves as usual
    assert_tree_equal(_state(3), load_fresh(quick_store, _state(3), "y"))


def _fill(store: MemStore, leave: int) -> Path:
    """Take all of ``store``'s file system but ``leave`` bytes, in one allocated file; its path. The files
    the store allocates ahead of its next save, in the background, are allocated first: they would take
    some of what is measured here."""
    Stager.of(store).wait_reserved()
    filler = store.root / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, free_bytes(store.root) - leave)
    finally:
        os.close(fd)
    return filler


def _refused_for_want_of_space(store: MemStore, sd: dict, cid: str) -> None:
    """``dcp.save`` of ``sd`` as ``cid`` fails with InsufficientSpaceError and leaves nothing in the store."""
    before = store_tree(store)
    with pytest.raises(CheckpointException) as ei:
        save(store, sd, cid)
    assert "InsufficientSpaceError" in str(ei.value) and "bytes needed" in str(ei.value)
    assert store_tree(store) == before


def test_space_check_counts_alignment_and_manifest_not_just_tensor_bytes(tmpfs_store):
    """2000 one-element tensors hold 8 KB of values but take 128 KB of aligned slots and about 350 KB of
    manifest: a save whose raw bytes fit but whose files do not must fail before it writes anything."""
    many = {f"t{i}": torch.full((1,), float(i)) for i in range(2000)} | {"w": torch.ones(256 << 10)}
    raw = 2000 * 4 + MiB
    filler = _fill(tmpfs_store, leave=raw + 64 * 1024)
    _refused_for_want_of_space(tmpfs_store, many, "many")
    filler.unlink()
    save(tmpfs_store, many, "many")  # with room, the same save goes through
    assert_tree_equal(many, load_fresh(tmpfs_store, many, "many"))


@pytest.mark.parametrize("leave", [0, 256 << 10], ids=["tmpfs-full", "a-serialised-value-to-write"])
def test_a_pooled_file_counts_as_room_for_the_file_it_serves_not_its_whole_size(small_tmpfs, leave):
    """A save reuses a pooled file up to a quarter larger than its file whole, so that slack is no room
    for anything else. Counted as room, a save passed the space check and then failed with a bare ENOSPC
    (no bytes needed or free) writing its serialised values, or its in-progress marker on a full tmpfs,
    which also left that marker's directory behind."""
    store = MemStore(root=small_tmpfs / "store", job_id="job", keep_in_memory=1, io_threads=1)
    for cid in ("a", "b"):  # a's 3 MiB file goes to the pool
        save(store, {"w": torch.ones(3 * MiB // 4)}, cid)
    filler = _fill(store, leave=leave)
    sd = {"w": torch.arange(5 * MiB // 2 // 4, dtype=torch.float32)}  # 2.5 MiB: served by the pooled file
    if leave:
        sd["blob"] = b"x" * (600 << 10)  # 600 KiB: more than the room left beside the reused file
    _refused_for_want_of_space(store, sd, "c")
    filler.unlink()
    b = {"w": torch.ones(3 * MiB // 4)}
    assert_tree_equal(load_fresh(store, b, "b"), b)
    save(store, sd, "c")  # with room, the same save goes through
    assert_tree_equal(sd, load_fresh(store, sd, "c"))
    store.close()


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_a_save_that_only_fits_once_the_checkpoint_beyond_keep_is_evicted_gets_the_room(small_tmpfs, mode):
    """The check that counts pooled files as the size they serve is the one that reclaims (evicts beyond a
    lowered keep_in_memory): counting their slack as room, staging passed its check, evicted nothing and
    failed allocating a file."""
    root = small_tmpfs / "store"
    with MemStore(root=root, job_id="job", keep_in_memory=2, io_threads=2) as store:
        save(store, {"w": torch.ones(5 * MiB // 4 // 4)}, "a")  # 1.25 MiB: pooled once "a" is evicted
        for cid in ("b", "c"):
            save(store, {"w": torch.ones(MiB // 2 // 4)}, cid)
    store = MemStore(root=root, job_id="job", keep_in_memory=1, io_threads=2)
    filler = _fill(store, leave=5 * MiB // 8)
    sd = {"x": torch.full((MiB // 4,), 1.0), "y": torch.full((3 * MiB // 4 // 4,), 2.0)}
    if mode == "save":
        save(store, sd, "d")
    else:
        async_save(store, sd, "d").result()
    assert store.list_checkpoints() == ["d"]
    assert_tree_equal(sd, load_fresh(store, sd, "d"))
    store.close()
    filler.unlink()


def test_a_checkpoint_loads_from_a_full_tmpfs(tmpfs_store, caplog):
    """A job must resume from a tmpfs that something filled: the load's retention hold, a record in the
    tmpfs, does not fit, so the load goes on without it and says so (it failed with a bare ENOSPC)."""
    sd = _state(4)
    save(tmpfs_store, sd, "a")
    filler = _fill(tmpfs_store, leave=0)
    with caplog.at_level(logging.WARNING, logger="dcp_memstore"):
        assert_tree_equal(load_fresh(tmpfs_store, sd, "a"), sd)
    assert "no room in" in caplog.text and "loading it without" in caplog.text
    filler.unlink()


def test_async_save_space_check_counts_whole_pages_of_the_staged_files(tmpfs_store):
    """Staging allocates each shard file in whole pages and writes its slot's owner record: an async save
    whose tensor bytes fit but whose files do not must fail at its space check, naming the store root and
    the bytes the files take, before it allocates anything (not half-way, with one file's numbers)."""
    sd = {"a": torch.ones((MiB + 64) // 4), "b": torch.ones((MiB + 64) // 4)}  # one file each, 2 MiB + 128
    filler = _fill(tmpfs_store, leave=2 * MiB + 4096)
    before = store_tree(tmpfs_store)
    with pytest.raises(InsufficientSpaceError) as ei:
        async_save(tmpfs_store, sd, "c")
    assert ei.value.root == str(tmpfs_store.root)
    assert ei.value.needed >= 2 * (MiB + 4096) + 4096  # two files of whole pages, and the slot's record
    assert ei.value.free == 2 * MiB + 4096
    assert store_tree(tmpfs_store) == before  # no file allocated, not even into the pool
    filler.unlink()
    async_save(tmpfs_store, sd, "c").result()
    assert_tree_equal(sd, load_fresh(tmpfs_store, sd, "c"))


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_a_failed_save_whose_files_fill_the_tmpfs_does_not_fail_every_later_save(tmpfs_store, mode):
    """In a job of several ranks a save that fails on one rank (say its objects did not fit) leaves the
    directory its coordinator began, with the files the other ranks wrote: no rank may remove it while
    the others might still write. Those files were cleared only after the next commit, so when they
    left too little room, every later save failed for want of space and none ever committed. Here the
    directory is made as such a save leaves it (begun by this process, before this save)."""
    layout = tmpfs_store.layout
    left = catalog.begin(layout, "failed")
    os.close(allocate_file(left / shard_name(0, 0), 3 * MiB))
    time.sleep(0.01)  # this save starts after the failed one
    sd = {"a": torch.ones(MiB // 2), "b": torch.ones(MiB // 2)}  # 4 MiB in two files of 2 MiB
    _fill(tmpfs_store, leave=2 * MiB)  # room for 2 MiB more: enough only with the failed save's 3 MiB
    if mode == "save":
        save(tmpfs_store, sd, "next")
    else:
        async_save(tmpfs_store, sd, "next").result()
    assert_tree_equal(sd, load_fresh(tmpfs_store, sd, "next"))
    assert not left.exists()
    assert tmpfs_store.list_checkpoints() == ["next"]


class _FailAfterBegin(DefaultSavePlanner):
    """Fails the save after the writer began the checkpoint's directory, in DCP's planner: the writer is
    not told, as a coordinator is not told when another rank fails."""

    def finish_plan(self, new_plan):
        raise RuntimeError("failed elsewhere")


@pytest.mark.parametrize("retry", ["save", "async_save"])
def test_retrying_an_id_whose_save_failed_elsewhere_is_not_refused(quick_store, retry):
    with pytest.raises(BaseException, match="failed elsewhere") as ei:  # noqa: B017 - CheckpointException
        save(quick_store, _state(1), "x", planner=_FailAfterBegin())
    assert quick_store.layout.checkpoint_dir("x").exists()  # the failed attempt's directory
    # while the failed writer lives on in ``ei``: from this thread, or from DCP's background thread
    if retry == "save":
        save(quick_store, _state(2), "x")
    else:
        async_save(quick_store, _state(2), "x").result(timeout=60)
    assert_tree_equal(_state(2), load_fresh(quick_store, _state(2), "x"))
    del ei


class _UnstorablePlannerData(DefaultSavePlanner):
    """A custom planner that puts into the metadata's planner_data a value msgpack cannot hold."""

    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        return plans, dataclasses.replace(md, planner_data={"tag": object()})


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_planner_data_that_cannot_be_stored_fails_the_save_and_leaves_nothing_of_it(quick_store, mode):
    """The metadata is encoded only at the commit, after the data is written; failing there, the save
    names the value and leaves no directory behind (before, its shard files stayed until the next
    commit), and the id can be saved again."""
    save(quick_store, _state(0), "kept")
    with pytest.raises(BaseException, match="planner_data.tag holds a object"):  # noqa: B017
        if mode == "save":
            save(quick_store, _state(1), "x", planner=_UnstorablePlannerData())
        else:
            async_save(quick_store, _state(1), "x", planner=_UnstorablePlannerData()).result(timeout=60)
    assert sorted(os.listdir(quick_store.layout.checkpoints_dir)) == ["kept"]
    save(quick_store, _state(2), "x")
    assert quick_store.list_checkpoints() == ["kept", "x"]
    assert_tree_equal(_state(2), load_fresh(quick_store, _state(2), "x"))


def test_retrying_a_failed_id_with_async_save_while_async_save_has_not_returned(quick_store, monkeypatch):
    """The thread of the failed save of "x" is still inside ``dcp.async_save`` (its retry of "x") when the
    background save of that retry plans: it is the retry's thread now, not a save of "x" still running."""
    with pytest.raises(BaseException, match="failed elsewhere"):  # noqa: B017 - CheckpointException
        save(quick_store, _state(1), "x", planner=_FailAfterBegin())
    submit = _ThreadBasedAsyncCheckpointExecutor.execute_save

    def submit_then_linger(self, *args, **kwargs):  # fault injection: widens a window that is short
        fut = submit(self, *args, **kwargs)
        time.sleep(1.0)  # the background save plans while this thread is still inside dcp.async_save
        return fut

    monkeypatch.setattr(_ThreadBasedAsyncCheckpointExecutor, "execute_save", submit_then_linger)
    async_save(quick_store, _state(2), "x").result(timeout=60)
    assert_tree_equal(_state(2), load_fresh(quick_store, _state(2), "x"))


def test_dcp_entry_points_that_reset_without_an_id_read_the_checkpoint_the_reader_was_aimed_at(quick_store):
    """DCP's deprecated load_state_dict (and load_sharded_optimizer_state_dict) call reset() without an id."""
    save(quick_store, _state(1), "a")
    save(quick_store, _state(2), "b")
    with (
        pytest.raises(ValueError, match="needs checkpoint_id="),
        pytest.warns(FutureWarning, match="deprecated"),
    ):
        dcp.load_state_dict(_state(5), storage_reader=MemoryStorageReader(quick_store), no_dist=True)
    reader = MemoryStorageReader(quick_store)
    reader.reset("a")
    dest = _state(5)
    with pytest.warns(FutureWarning, match="deprecated"):
        dcp.load_state_dict(dest, storage_reader=reader, no_dist=True)
    assert_tree_equal(dest, _state(1))
