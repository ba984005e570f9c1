"""MemStore: argument checks, defaults from the environment, tmpfs warning, queries, delete, close."""

from __future__ import annotations

import pickle
import socket
import subprocess
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.memstore import DEFAULT_ROOT, resolve_root
from dcp_memstore.persist.persister import local_rank_and_size
from dcp_memstore.replication.service import job_node_info
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import COMMITTED, INPROGRESS, shard_name
from dcp_memstore.store.records import write_record


def _commit(store, cid):
    d = catalog.begin(store.layout, cid)
    (d / shard_name(0, 0)).write_bytes(b"x" * 4096)
    catalog.commit(store.layout, cid, 4096)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"keep_in_memory": 0}, "keep_in_memory must be an int >= 1, got 0"),
        ({"keep_in_memory": -3}, "keep_in_memory must be an int >= 1, got -3"),
        ({"keep_in_memory": 2.0}, "keep_in_memory must be an int >= 1, got 2.0"),
        ({"keep_in_memory": True}, "keep_in_memory must be an int >= 1, got True"),
        ({"max_in_flight": "x"}, "max_in_flight must be an int >= 1, got 'x'"),
        ({"max_in_flight": 0}, "max_in_flight must be an int >= 1, got 0"),
        ({"io_threads": 0}, "io_threads must be an int >= 1, got 0"),
        ({"io_threads": 257}, "io_threads must be an int from 1 to 256, got 257"),
        ({"io_threads": 10**30}, "io_threads must be an int from 1 to 256, got 10000"),
        ({"stage_timeout_s": 0}, "stage_timeout_s must be > 0, got 0"),
        ({"stage_timeout_s": -1.0}, "stage_timeout_s must be > 0"),
        ({"stage_timeout_s": "5"}, "stage_timeout_s must be > 0, got '5' (a number of seconds"),
        ({"stage_timeout_s": None}, "stage_timeout_s must be > 0, got None (a number of seconds"),
        ({"stage_timeout_s": float("nan")}, "stage_timeout_s must be > 0"),
        ({"replication_timeout_s": "5"}, "replication_timeout_s must be > 0, got '5' (a number of seconds"),
        ({"verify_checksums": "false"}, "verify_checksums must be True or False, got 'false'"),
        ({"verify_checksums": None}, "verify_checksums must be True or False, got None"),
        ({"persist_on_close": "no"}, "persist_on_close must be True or False, got 'no'"),
        ({"persist_on_close": 2}, "persist_on_close must be True or False, got 2"),
        ({"replication_bind": 5}, "replication_bind must be a host name or IP address (a str), got 5"),
        ({"replication_bind": ""}, "replication_bind must be a host name or IP address (a str), got ''"),
        ({"job_id": "a/b"}, "invalid job id 'a/b'"),
        ({"job_id": ".."}, "invalid job id '..'"),
        ({"job_id": ""}, "invalid job id ''"),
    ],
)
def test_bad_arguments_raise_valueerror_and_create_nothing(shm_dir, kwargs, text):
    root = shm_dir / "root"
    with pytest.raises(ValueError) as ei:
        MemStore(root=root, **kwargs)
    assert text in str(ei.value)
    assert not root.exists()


@pytest.mark.parametrize("var", ["DCP_MEMSTORE_JOB_ID", "TORCHELASTIC_RUN_ID"])
def test_an_invalid_job_id_from_the_environment_names_its_variable(shm_dir, monkeypatch, var):
    """torchrun's run id (--rdzv-id) is read as the job id: a user who never gave one must learn where it
    came from."""
    monkeypatch.delenv("DCP_MEMSTORE_JOB_ID", raising=False)
    monkeypatch.setenv(var, "my run")
    with pytest.raises(
        ValueError, match=rf"invalid job id 'my run': .* It was read from \${var}; give a job id"
    ):
        MemStore(root=shm_dir / "root")
    assert not (shm_dir / "root").exists()


def test_a_negative_replica_count_from_the_environment_names_its_variable(shm_dir, monkeypatch):
    monkeypatch.setenv("DCP_MEMSTORE_REPLICAS", "-1")
    with pytest.raises(
        ValueError, match=r"replicas must be an int >= 0 .* got -1 \(read from \$DCP_MEMSTORE_REPLICAS\)"
    ):
        MemStore(root=shm_dir / "root", job_id="j")
    assert not (shm_dir / "root").exists()


def test_root_that_is_a_file_is_refused(shm_dir):
    f = shm_dir / "file"
    f.write_text("not a dir")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        MemStore(root=f, job_id="j")


@pytest.mark.parametrize("root", [5, b"/dev/shm/x", 1.5])
def test_a_root_that_is_no_path_is_a_typeerror_naming_root(root):
    with pytest.raises(TypeError, match=r"root must be a directory path \(a str or os.PathLike\), got "):
        MemStore(root=root, job_id="j")


def test_a_root_where_no_directory_can_be_made_says_so_and_what_to_do(shm_dir):
    """A root below a file, or a job id whose directory is a file: the error names the root and the job,
    keeps its type (NotADirectoryError), and nothing is created."""
    (shm_dir / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as ei:
        MemStore(root=shm_dir / "file" / "sub", job_id="j")
    assert f"cannot create the directories of job 'j' under MemStore root {shm_dir / 'file' / 'sub'}" in str(
        ei.value
    )
    assert "pass a writable directory on tmpfs as root (or $DCP_MEMSTORE_ROOT)" in str(ei.value)
    (shm_dir / "root").mkdir()
    (shm_dir / "root" / "taken").write_text("x")
    with pytest.raises(NotADirectoryError, match="cannot create the directories of job 'taken'"):
        MemStore(root=shm_dir / "root", job_id="taken")
    assert sorted(p.name for p in shm_dir.rglob("*")) == ["file", "root", "taken"]


def test_root_on_tmpfs_gives_no_warning_and_creates_the_layout(shm_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = MemStore(root=shm_dir / "new" / "root", job_id="run-1")
    assert s.root == shm_dir / "new" / "root"
    for sub in ("checkpoints", "staging", "trash", "pool"):
        assert (shm_dir / "new" / "root" / "run-1" / sub).is_dir()
    assert s.list_checkpoints() == []
    assert s.latest_checkpoint() is None


def test_a_new_root_is_resolved_like_an_existing_one(shm_dir):
    """A root given with '..' or through a symlink names the same store as its resolved path, also when
    the store makes it: saves are ordered per store directory, so two stores of one job must agree."""
    (shm_dir / "real").mkdir()
    (shm_dir / "link").symlink_to(shm_dir / "real")
    first = MemStore(root=shm_dir / "link" / "x" / ".." / "store", job_id="j")
    again = MemStore(root=shm_dir / "link" / "store", job_id="j")
    assert first.root == again.root == shm_dir / "real" / "store"
    assert first.layout.job_dir == again.layout.job_dir
    assert not (shm_dir / "real" / "x").exists()


def test_root_on_disk_warns(disk_dir):
    with pytest.warns(UserWarning, match="not on a memory file system") as rec:
        MemStore(root=disk_dir / "store", job_id="j")
    assert str(disk_dir / "store") in str(rec[0].message)


def test_defaults_come_from_the_environment(shm_dir, monkeypatch):
    monkeypatch.setenv("DCP_MEMSTORE_ROOT", str(shm_dir / "envroot"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    monkeypatch.delenv("DCP_MEMSTORE_JOB_ID", raising=False)
    s = MemStore()
    assert (s.root, s.job_id) == (shm_dir / "envroot", "elastic-7")
    monkeypatch.setenv("DCP_MEMSTORE_JOB_ID", "explicit-job")
    assert MemStore().job_id == "explicit-job"
    monkeypatch.delenv("DCP_MEMSTORE_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert MemStore().job_id == "default"
    assert MemStore(job_id="given").job_id == "given"


def test_an_empty_root_counts_as_unset_not_as_the_current_directory(shm_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DCP_MEMSTORE_ROOT", str(shm_dir))
    assert MemStore(root="", job_id="j").root == shm_dir
    monkeypatch.setenv("DCP_MEMSTORE_ROOT", "")
    assert resolve_root(None) == resolve_root("") == Path(DEFAULT_ROOT)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_environment_variable_is_named(shm_dir, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match=r"\$LOCAL_WORLD_SIZE='x' is not an int"):
        MemStore(root=shm_dir, job_id="j")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("DCP_MEMSTORE_REPLICAS", "")  # empty: unset, as for the other variables
    assert MemStore(root=shm_dir, job_id="j").replicas == 1


def test_empty_torchrun_variables_count_as_unset_under_a_process_group(shm_dir, monkeypatch, tmp_path):
    """An empty LOCAL_WORLD_SIZE or LOCAL_RANK counts as unset, as every variable the store reads, also where
    a process group exists: the job is one node of the group's size."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    monkeypatch.setenv("LOCAL_RANK", "")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert job_node_info().multi_node is False
        assert local_rank_and_size() == (0, 1)
        with MemStore(root=shm_dir, job_id="j", persist_to=tmp_path / "persisted") as s:
            assert s.replication() is None
    finally:
        dist.destroy_process_group()


def test_defaults(shm_dir):
    s = MemStore(root=shm_dir, job_id="j")
    assert (s.keep_in_memory, s.max_in_flight, s.verify_checksums) == (2, 1, True)
    assert 1 <= s.io_threads <= 4


def test_list_latest_and_require(store):
    for cid in ("b", "c", "a"):
        _commit(store, cid)
    catalog.begin(store.layout, "in-progress")
    assert store.list_checkpoints() == ["b", "c", "a"]
    assert store.latest_checkpoint() == "a"
    assert store.require_checkpoint("c") == store.layout.checkpoint_dir("c")
    with pytest.raises(FileNotFoundError) as ei:
        store.require_checkpoint("in-progress")
    assert "'in-progress' not found" in str(ei.value)
    assert "['b', 'c', 'a']" in str(ei.value)
    with pytest.raises(ValueError, match="invalid checkpoint id"):
        store.require_checkpoint("../b")


def test_delete_removes_only_that_checkpoint(store):
    for cid in ("a", "b", "c"):
        _commit(store, cid)
    store.delete("c")
    assert store.list_checkpoints() == ["a", "b"]
    assert store.latest_checkpoint() == "b"
    assert not store.layout.checkpoint_dir("c").exists()
    with pytest.raises(FileNotFoundError, match="'c' not found"):
        store.delete("c")


def test_a_corrupt_commit_marker_of_an_old_checkpoint_blocks_neither_resume_nor_saves(store):
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    for cid in ("c1", "c2"):
        dcp.save(sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True)
    marker = store.layout.checkpoint_dir("c1") / COMMITTED
    marker.write_bytes(b"")
    assert store.list_checkpoints() == ["c2"]
    assert store.latest_checkpoint() == "c2"
    out = {"w": torch.zeros(3, 4)}
    dcp.load(out, checkpoint_id="c2", storage_reader=MemoryStorageReader(store), no_dist=True)
    assert torch.equal(out["w"], sd["w"])
    dcp.save(sd, checkpoint_id="c3", storage_writer=MemoryStorageWriter(store), no_dist=True)
    assert store.list_checkpoints() == ["c2", "c3"]
    with pytest.raises(ValueError, match="Checkpoint 'c1' has a corrupt commit marker") as ei:
        dcp.load(out, checkpoint_id="c1", storage_reader=MemoryStorageReader(store), no_dist=True)
    assert f"{marker} is not a valid dcp_memstore record" in str(ei.value)
    assert "store.delete('c1')" in str(ei.value)
    store.delete("c1")
    assert not store.layout.checkpoint_dir("c1").exists()
    assert store.list_checkpoints() == ["c2", "c3"]


def test_a_new_store_clears_leftovers_of_dead_saves(shm_dir):
    s = MemStore(root=shm_dir, job_id="j")
    _commit(s, "good")
    p = subprocess.Popen(["sleep", "60"])
    owner = {"pid": p.pid, "create_time": psutil.Process(p.pid).create_time(), "host": socket.gethostname()}
    p.kill()
    p.wait()
    d = s.layout.checkpoints_dir / "half-written"
    d.mkdir()
    write_record(d / INPROGRESS, owner)
    MemStore(root=shm_dir, job_id="j")
    assert not d.exists()
    assert s.list_checkpoints() == ["good"]


def test_closed_store_refuses_queries_and_close_is_idempotent(store):
    state = {"w": torch.ones(8)}
    with store as s:
        assert s.list_checkpoints() == []
        dcp.save(state, checkpoint_id="early", storage_writer=MemoryStorageWriter(store), no_dist=True)
    with pytest.raises(RuntimeError, match="is closed"):
        store.list_checkpoints()
    with pytest.raises(RuntimeError, match="is closed"):
        store.latest_checkpoint()
    for query in (store.status, store.wait_persisted, store.require_checkpoint, store.delete):
        with pytest.raises(RuntimeError, match="is closed"):
            query("early")
    with pytest.raises(BaseException, match="is closed"):  # CheckpointException derives from BaseException
        dcp.save(state, checkpoint_id="late", storage_writer=MemoryStorageWriter(store), no_dist=True)
    with pytest.raises(RuntimeError, match="is closed; make a new MemStore"):
        dcp.async_save(state, checkpoint_id="late", storage_writer=MemoryStorageWriter(store), no_dist=True)
    with pytest.raises(RuntimeError, match="is closed"):
        dcp.load(state, checkpoint_id="early", storage_reader=MemoryStorageReader(store), no_dist=True)
    assert [r.checkpoint_id for r in catalog.committed(store.layout)] == ["early"]
    assert not any(store.layout.staging_dir.iterdir())
    store.close()


@pytest.mark.parametrize("bad", ["5", True, -1, float("nan")])
def test_wait_replicated_refuses_a_bad_timeout_naming_it(store, bad):
    """wait_replicated takes the timeouts wait_persisted and close take: a str failed with a TypeError
    that named no argument, and a bool, a negative number or NaN were taken (NaN: a wait that never
    times out) where replication was on, and passed unnoticed where it is off, as here."""
    _commit(store, "a")
    with pytest.raises(
        ValueError, match=rf"timeout must be None \(no limit\) or a number of seconds >= 0, got {bad!r}"
    ):
        store.wait_replicated("a", bad)
    assert store.wait_replicated("a", float("inf")).replication == "off"  # no limit, like None


def test_store_is_picklable(store):
    _commit(store, "a")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.layout == store.layout
    assert clone.list_checkpoints() == ["a"]
    assert "keep_in_memory=2" in repr(store)
