"""Persistence to a plain directory: policy, standard layout, publication, retention holds, fallback reads."""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_memstore.persist.persister as persister_module
from dcp_memstore import MemStore, PersistError
from dcp_memstore.persist.export import remote_name
from dcp_memstore.persist.progress import Progress
from dcp_memstore.persist.target import COMMITTED, PROBE, STOCK_METADATA, PersistTarget
from dcp_memstore.persist.target import MANIFEST as REMOTE_MANIFEST
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import COMMITTED as LOCAL_COMMITTED
from dcp_memstore.store.layout import MANIFEST
from dcp_memstore.store.manifest import Manifest
from tests.dcp.dcp_state import assert_tree_equal, blank_like, load, save, snapshot


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "half": torch.randn(17, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 30, (5, 4), generator=g),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "step": seed,
        "meta": {"name": "run", "lr": [0.1, 0.01]},
    }


@pytest.fixture
def bucket_dir(tmp_path):
    return tmp_path / "persisted"


def _pstore(shm_dir, bucket_dir, **kw) -> MemStore:
    return MemStore(root=shm_dir, job_id="job", io_threads=2, persist_to=str(bucket_dir), **kw)


def test_every_nth_checkpoint_is_persisted_and_others_are_not(shm_dir, bucket_dir):
    with _pstore(shm_dir, bucket_dir, persist_every=2, keep_in_memory=4, persist_on_close=False) as store:
        for i in range(1, 5):
            save(store, _state(i), f"step-{i}")
        store.wait_persisted("step-2", timeout=60)
        store.wait_persisted("step-4", timeout=60)
        assert store.status("step-1").persist == "not requested"
        assert store.status("step-3").persist == "not requested"
        assert store.status("step-4").persisted
        assert store.status("step-4").files_uploaded == store.status("step-4").files_total == 3
        with pytest.raises(ValueError, match="not being persisted"):
            store.wait_persisted("step-3", timeout=1)
    assert sorted(p.name for p in bucket_dir.iterdir()) == ["step-2", "step-4"]


def test_persisted_checkpoint_loads_with_stock_pytorch_without_dcp_memstore(shm_dir, bucket_dir):
    sd = _state(7)
    with _pstore(shm_dir, bucket_dir) as store:
        save(store, sd, "final")
        store.persist("final")
        store.wait_persisted("final", timeout=60)
    torch.save(snapshot(sd), bucket_dir / "expected.pt")
    script = f"""
import sys
sys.modules["dcp_memstore"] = None  # any import of our package fails
import torch, torch.distributed.checkpoint as dcp
expected = torch.load({str(bucket_dir / "expected.pt")!r})
out = {{k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in expected.items()}}
out["step"], out["meta"] = 0, {{"name": "", "lr": [0.0, 0.0]}}
dcp.load(out, storage_reader=dcp.FileSystemReader({str(bucket_dir / "final")!r}))
for k, v in expected.items():
    if isinstance(v, torch.Tensor):
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    else:
        assert out[k] == v, (k, out[k], v)
assert "dcp_memstore" not in repr(open({str(bucket_dir / "final" / STOCK_METADATA)!r}, "rb").read())
print("STOCK-OK")
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "STOCK-OK" in res.stdout, res.stderr[-3000:]


def test_the_persisted_metadata_says_what_filesystemwriter_says_of_the_same_state(
    shm_dir, bucket_dir, tmp_path
):
    """A persisted checkpoint's stock .metadata gives what FileSystemWriter's gives of the same state dict:
    every value's storage metadata, the planner's data, and the version of the file format its files are
    in, so stock readers, of this torch and later ones, take it for one of their own."""
    sd = _state(3)
    with _pstore(shm_dir, bucket_dir) as store:
        save(store, sd, "c")
        store.persist("c")
        store.wait_persisted("c", timeout=60)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"), no_dist=True)
    ours = dcp.FileSystemReader(bucket_dir / "c").read_metadata()
    stock = dcp.FileSystemReader(tmp_path / "stock").read_metadata()
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert (ours.planner_data, ours.version) == (stock.planner_data, stock.version)


def _evict_at_first_persisted_read(store: MemStore, monkeypatch) -> list[str]:
    """Make the first read of a checkpoint's PERSISTED record evict that checkpoint first (a real
    discard, at a point no real timing hits reliably); returns the list of what it evicted."""
    real = Progress.persisted
    evictions: list[str] = []

    def evicted_first(progress: Progress) -> bool:
        if not evictions:
            evictions.append(progress.checkpoint_id)
            catalog.discard(store.layout, store.layout.checkpoint_dir(progress.checkpoint_id))
        return real(progress)

    monkeypatch.setattr(Progress, "persisted", evicted_first)
    return evictions


def test_status_of_a_checkpoint_evicted_while_status_reads_it_is_persisted(shm_dir, bucket_dir, monkeypatch):
    """Published, then evicted between status()'s reads of its records (the hold already gone, PERSISTED
    not yet read): status says persisted, not "not requested", and wait_persisted returns. The eviction is
    injected at that point (a patched read), since no real timing can hit the gap reliably."""
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(1), "a")
        store.persist("a")
        store.wait_persisted("a", timeout=60)
        evictions = _evict_at_first_persisted_read(store, monkeypatch)
        st = store.status("a")
        assert evictions == ["a"]
        assert (st.in_memory, st.persist, st.persisted) == (False, "persisted", True)
        assert store.wait_persisted("a", timeout=5).persisted


def test_status_of_a_committed_checkpoint_without_manifest_names_the_damage(shm_dir, bucket_dir):
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(1), "a")
        (store.layout.checkpoint_dir("a") / MANIFEST).unlink()
        with pytest.raises(FileNotFoundError, match="'a' is committed .* but has no manifest"):
            store.status("a")


def test_close_persists_the_newest_checkpoint(shm_dir, bucket_dir):
    store = _pstore(shm_dir, bucket_dir)
    save(store, _state(1), "a")
    save(store, _state(2), "b")
    assert store.status("b").persist == "not requested"
    store.close()
    assert (bucket_dir / "b" / COMMITTED).exists()
    assert not (bucket_dir / "a").exists()


def test_empty_tmpfs_restores_newest_persisted_checkpoint(shm_dir, bucket_dir, tmp_path, fresh_root):
    sd = _state(3)
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        save(store, _state(2), "old")
        save(store, sd, "new")
        store.wait_persisted("new", timeout=60)
    with MemStore(root=fresh_root, job_id="job", persist_to=str(bucket_dir)) as fresh:
        assert fresh.list_checkpoints() == []
        assert fresh.latest_checkpoint() == "new"
        assert fresh.status("new").persisted and not fresh.status("new").in_memory
        assert_tree_equal(sd, load(fresh, blank_like(sd), "new"))


def test_a_job_resumed_from_its_bucket_by_a_node_whose_clock_is_behind_saves_newer_checkpoints(
    shm_dir, bucket_dir, fresh_root, monkeypatch
):
    """Commit times order the checkpoints of every tier (latest_checkpoint): a job resumed on an empty
    tmpfs from a checkpoint that a node with a clock 10 minutes ahead persisted commits its next ones
    after it, or latest_checkpoint kept returning the persisted one. ``time.time`` is replaced (fault
    injection: a test cannot set the machine's clock)."""
    wall_clock = time.time
    monkeypatch.setattr(time, "time", lambda: wall_clock() + 600)
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        save(store, _state(1), "step-1")
        store.wait_persisted("step-1", timeout=60)
    monkeypatch.setattr(time, "time", wall_clock)
    with MemStore(root=fresh_root, job_id="job", persist_to=str(bucket_dir), persist_on_close=False) as fresh:
        assert fresh.latest_checkpoint() == "step-1"
        save(fresh, _state(2), "step-2")
        assert fresh.latest_checkpoint() == "step-2"
        assert_tree_equal(_state(2), load(fresh, blank_like(_state(2)), fresh.latest_checkpoint()))


def test_a_damaged_persisted_commit_marker_hides_only_its_checkpoint(shm_dir, bucket_dir, fresh_root, caplog):
    """One damaged commit marker in the bucket made the whole listing fail: a fresh node resumed from
    nothing. Now that checkpoint alone is passed over, with a warning naming the marker."""
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        for i in (1, 2):
            save(store, _state(i), f"step-{i}")
            store.wait_persisted(f"step-{i}", timeout=60)
    (bucket_dir / "step-2" / COMMITTED).write_bytes(b"\xc1 not msgpack")
    with MemStore(root=fresh_root, job_id="job", persist_to=str(bucket_dir)) as fresh:
        assert fresh.latest_checkpoint() == "step-1"
        assert_tree_equal(_state(1), load(fresh, blank_like(_state(1)), "step-1"))
    assert f"not listed: the commit marker {bucket_dir}/step-2/{COMMITTED} is damaged" in caplog.text


def test_a_damaged_persisted_commit_marker_of_a_checkpoint_in_memory_fails_its_wait_saying_what_to_do(
    shm_dir, bucket_dir
):
    """Nothing retries a damaged marker (latest_checkpoint hides that copy): status said 'retrying' and a
    wait_persisted without a timeout never returned. It is 'failed', naming the marker; once the copy is
    removed there, persist(id) uploads it again."""
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(1), "a")
        store.persist("a")
        store.wait_persisted("a", timeout=60)
        (bucket_dir / "a" / COMMITTED).write_bytes(b"\xff garbage")
        st = store.status("a")
        assert (
            st.persist == "failed" and f"the commit marker {bucket_dir}/a/{COMMITTED} is damaged" in st.error
        )
        with pytest.raises(PersistError, match=f"Remove {bucket_dir}/a there, then store.persist"):
            store.wait_persisted("a")
        subprocess.run(["rm", "-rf", str(bucket_dir / "a")], check=True)
        store.persist("a")
        assert store.wait_persisted("a", timeout=60).persisted_url == f"{bucket_dir}/a"


def test_a_persisted_commit_marker_that_cannot_be_read_now_is_named_not_left_out(
    shm_dir, bucket_dir, fresh_root, monkeypatch, caplog
):
    """A marker whose read fails (the server refused that one request) was left out of the listing
    without a word, and a fresh node resumed from an older checkpoint. Now the listing fails naming it,
    which latest_checkpoint logs. The failure is injected (a real server cannot be made to fail one
    request)."""
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        for i in (1, 2):
            save(store, _state(i), f"step-{i}")
            store.wait_persisted(f"step-{i}", timeout=60)
    with MemStore(root=fresh_root, job_id="job", persist_to=str(bucket_dir)) as fresh:
        read = type(fresh.target.fs).cat_file

        def flaky(fs, path, *args, **kwargs):
            if path.endswith(f"step-2/{COMMITTED}"):
                raise ConnectionError("injected: connection reset")
            return read(fs, path, *args, **kwargs)

        monkeypatch.setattr(type(fresh.target.fs), "cat_file", flaky)
        assert fresh.latest_checkpoint() is None  # nothing in memory; the bucket could not be listed
        monkeypatch.undo()
    assert f"cannot read {bucket_dir}/step-2/{COMMITTED}: ConnectionError" in caplog.text


def test_an_upload_under_an_id_another_job_publishes_meanwhile_stops_and_leaves_that_one_whole(
    shm_dir, bucket_dir, fresh_root, monkeypatch
):
    """Two jobs on one prefix (each run should have its own) save the same id. Job B's upload is held up
    after its first file while job A publishes its checkpoint; B's next file overwrote A's published one,
    and stock DCP then loaded A's checkpoint with B's values. Now B stops before that file, failed for
    good, and A's checkpoint stays whole. The hold-up is a stand-in for ``upload_file`` (fault
    injection: the two uploads cannot be interleaved from outside)."""
    first_done, go_on = threading.Event(), threading.Event()
    upload = persister_module.upload_file

    def held_up(target, cid, local_dir, *args, **kwargs):
        placed = upload(target, cid, local_dir, *args, **kwargs)
        if Path(local_dir).is_relative_to(shm_dir) and not first_done.is_set():  # B, its first file
            first_done.set()
            go_on.wait(60)
        return placed

    monkeypatch.setattr(persister_module, "upload_file", held_up)
    a_sd, b_sd = _state(1), _state(2)
    b_store = MemStore(root=shm_dir, job_id="b", io_threads=1, persist_to=str(bucket_dir), persist_every=1)
    a_store = MemStore(root=fresh_root, job_id="a", io_threads=1, persist_to=str(bucket_dir))
    try:
        save(b_store, b_sd, "step-1")  # a shard file and a file of serialised values, one after the other
        assert first_done.wait(60)
        save(a_store, a_sd, "step-1")
        a_store.persist("step-1")
        a_store.wait_persisted("step-1", timeout=60)
        go_on.set()
        with pytest.raises(PersistError, match="already holds another checkpoint"):
            b_store.wait_persisted("step-1", timeout=60)
    finally:
        go_on.set()
        b_store.close()
        a_store.close()
    out = blank_like(a_sd)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(bucket_dir / "step-1")), no_dist=True)
    assert_tree_equal(out, a_sd)


def _load_error_on_another_node(fresh_root: Path, bucket_dir: Path, sd: dict, cid: str) -> BaseException:
    """What a load of ``cid`` raises in a store with the same job and ``persist_to`` whose tmpfs does not
    have it (another node, or this one after a reboot): it reads the persisted copy."""
    with (
        MemStore(root=fresh_root, job_id="job", persist_to=str(bucket_dir)) as fresh,
        pytest.raises(BaseException) as ei,  # noqa: B017 - DCP wraps it
    ):
        load(fresh, blank_like(sd), cid)
    return ei.value


def test_a_damaged_persisted_manifest_is_refused_naming_it(shm_dir, bucket_dir, fresh_root):
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        save(store, _state(3), "c")
        store.wait_persisted("c", timeout=60)
    manifest = bucket_dir / "c" / REMOTE_MANIFEST
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x01
    manifest.write_bytes(data)
    error = _load_error_on_another_node(fresh_root, bucket_dir, _state(3), "c")
    # the damage, not "'c' not found" next to a list of the persisted checkpoints that names it
    damage = f"c/{REMOTE_MANIFEST}: the manifest is corrupt: its xxh3_64 checksum does not match"
    assert damage in str(error) and "not found" not in str(error)


@pytest.mark.parametrize("damage", ["delete", "corrupt", "empty"])
def test_reader_falls_back_per_file_to_the_persisted_copy(shm_dir, bucket_dir, damage):
    sd = _state(4)
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        save(store, sd, "c")
        store.wait_persisted("c", timeout=60)
        victim = store.layout.checkpoint_dir("c") / "__0_0.shard"
        if damage == "delete":
            victim.unlink()
        elif damage == "empty":
            os.truncate(victim, 0)
        else:
            with open(victim, "r+b") as f:
                f.seek(0)
                byte = f.read(1)
                f.seek(0)
                f.write(bytes([byte[0] ^ 0xFF]))
        assert_tree_equal(sd, load(store, blank_like(sd), "c"))


def test_a_local_copy_that_fails_its_checksum_is_not_uploaded(shm_dir, bucket_dir):
    """A byte of a committed shard file flips in memory before the upload. The upload fails for good,
    naming the file and the item, and publishes nothing: the persisted copy, which a reader falls back
    to when the local copy is corrupt, never holds bytes that fail their checksum. (Before, the bytes
    were uploaded as they were and published as persisted: stock DCP loaded the wrong values.)"""
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(4), "c")
        local = store.layout.checkpoint_dir("c")
        item = next(it for it in Manifest.read(local / MANIFEST).items if it.fqn == "w")
        with open(local / item.location.file, "r+b") as f:
            f.seek(item.location.offset + 5)
            byte = f.read(1)
            f.seek(item.location.offset + 5)
            f.write(bytes([byte[0] ^ 0x01]))
        store.persist("c")
        with pytest.raises(PersistError, match=f"{item.location.file}.* w.* checksum"):
            store.wait_persisted("c", timeout=60)
    assert not (bucket_dir / "c" / COMMITTED).exists()
    assert not (bucket_dir / "c" / STOCK_METADATA).exists()
    # the checksum is computed while the file is written: what was written is discarded, temporary included
    assert not (bucket_dir / "c" / remote_name(item.location.file)).exists()
    assert list((bucket_dir / "c").glob(".*.tmp-*")) == []


def test_a_corrupt_local_commit_marker_is_passed_over_for_the_persisted_copy(shm_dir, bucket_dir, caplog):
    sd = _state(6)
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        save(store, _state(5), "a")
        save(store, sd, "b")
        store.wait_persisted("b", timeout=60)
        marker = store.layout.checkpoint_dir("b") / LOCAL_COMMITTED
        marker.write_bytes(b"\xc1")
        assert store.list_checkpoints() == ["a"]
        assert store.latest_checkpoint() == "b"
        assert_tree_equal(sd, load(store, blank_like(sd), "b"))
    assert f"{marker} is not a valid dcp_memstore record" in caplog.text
    assert f"reading it from {bucket_dir}/b instead" in caplog.text


@pytest.mark.parametrize("damage", ["corrupt", "deleted"])
def test_a_damaged_local_manifest_is_passed_over_for_the_persisted_copy(shm_dir, bucket_dir, caplog, damage):
    """The local manifest of a persisted checkpoint is damaged: the load reads the persisted copy, with a
    warning naming the damaged file, instead of failing; without a persisted copy it fails naming it."""
    sd = _state(7)
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        save(store, sd, "b")
        store.wait_persisted("b", timeout=60)
        save(store, _state(8), "local-only")  # persist_every=1: wait for it, then damage its manifest too
        store.wait_persisted("local-only", timeout=60)
        subprocess.run(["rm", "-rf", str(bucket_dir / "local-only")], check=True)
        for cid in ("b", "local-only"):
            manifest = store.layout.checkpoint_dir(cid) / MANIFEST
            if damage == "deleted":
                manifest.unlink()
            else:
                data = bytearray(manifest.read_bytes())
                data[len(data) // 2] ^= 0x01
                manifest.write_bytes(data)
        assert_tree_equal(sd, load(store, blank_like(sd), "b"))
        assert f"{store.layout.checkpoint_dir('b') / MANIFEST}" in caplog.text
        assert f"reading it from {bucket_dir}/b instead" in caplog.text
        with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
            load(store, blank_like(sd), "local-only")
        assert str(store.layout.checkpoint_dir("local-only") / MANIFEST) in str(ei.value)


def test_a_truncated_persisted_file_is_an_error_saying_how_short(shm_dir, bucket_dir, fresh_root):
    with _pstore(shm_dir, bucket_dir, persist_every=1) as store:
        save(store, _state(4), "c")
        store.wait_persisted("c", timeout=60)
    victim = bucket_dir / "c" / "__0_0.distcp"
    os.truncate(victim, victim.stat().st_size // 2)
    error = _load_error_on_another_node(fresh_root, bucket_dir, _state(4), "c")
    size = victim.stat().st_size
    assert f"TruncatedShardError: {bucket_dir}/c/__0_0.distcp is only {size} bytes long, where item " in str(
        error
    )


def test_damaged_local_copy_without_persisted_copy_still_fails(shm_dir, bucket_dir):
    sd = _state(5)
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, sd, "c")
        (store.layout.checkpoint_dir("c") / "__0_0.shard").unlink()
        with pytest.raises(BaseException, match="__0_0.shard"):  # noqa: B017 - DCP wraps it
            load(store, blank_like(sd), "c")


def test_retention_keeps_owed_checkpoints_until_persisted(shm_dir, tmp_path):
    blocked = tmp_path / "not-a-dir"
    with MemStore(
        root=shm_dir,
        job_id="job",
        keep_in_memory=1,
        persist_to=str(blocked),
        persist_every=1,
        persist_on_close=False,
    ) as store:
        _block(blocked)
        for i in range(3):
            save(store, _state(i), f"s{i}")
        assert store.list_checkpoints() == ["s0", "s1", "s2"]  # keep_in_memory=1, but all are owed
        _wait_for_failed(store, "s0")
        st = store.status("s0")
        assert st.persist == "failed" and "not-a-dir" in st.error
        with pytest.raises(PersistError, match="not-a-dir"):
            store.wait_persisted("s0", timeout=10)


def test_persist_on_demand_and_retry_after_failure(shm_dir, tmp_path):
    target = tmp_path / "late"
    with MemStore(root=shm_dir, job_id="job", persist_to=str(target), persist_on_close=False) as store:
        _block(target)  # first attempt fails for good
        save(store, _state(1), "x")
        store.persist("x")
        with pytest.raises(PersistError):
            store.wait_persisted("x", timeout=30)
        target.unlink()
        target.mkdir()  # fixed (a directory gone is not made again: see below)
        store.persist("x")  # retries
        assert store.wait_persisted("x", timeout=60).persisted
        assert catalog.holds(store.layout, "x") == []


def test_a_persist_directory_gone_while_the_job_runs_is_not_made_again(shm_dir, tmp_path):
    """persist_to on a file system that is unmounted (here: removed) while the job runs: making it again
    would put the checkpoints on whatever lies beneath (the local disk under a mount point) and report
    them persisted. The upload fails for good, naming it, until it is back and persist(id) is called."""
    target = tmp_path / "mounted" / "run"
    with MemStore(root=shm_dir, job_id="job", persist_to=str(target), persist_on_close=False) as store:
        save(store, _state(1), "a")
        store.persist("a")
        store.wait_persisted("a", timeout=60)
        subprocess.run(["rm", "-rf", str(tmp_path / "mounted")], check=True)
        save(store, _state(2), "b")
        store.persist("b")
        with pytest.raises(PersistError, match=f"persist_to directory {target} is gone"):
            store.wait_persisted("b", timeout=30)
        assert not target.exists()
        target.mkdir(parents=True)  # back
        store.persist("b")
        assert store.wait_persisted("b", timeout=60).persisted_url == f"{target}/b"


def test_a_passing_error_looking_at_the_persist_directory_is_retried(shm_dir, tmp_path, monkeypatch):
    """A network file system's passing error (ESTALE) on the persist directory is no sign that it is
    gone: the upload retries. (os.stat is made to fail once: a real NFS server cannot be had here.)"""
    target = tmp_path / "t"
    stat, failed = os.stat, []

    def stale_once(path, *args, **kwargs):
        if str(path) == str(target) and not failed:
            failed.append(path)
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return stat(path, *args, **kwargs)

    with MemStore(root=shm_dir, job_id="job", persist_to=str(target), persist_on_close=False) as store:
        monkeypatch.setattr(os, "stat", stale_once)
        save(store, _state(1), "a")
        store.persist("a")
        assert store.wait_persisted("a", timeout=60).persisted and failed


def test_close_keeps_its_timeout_while_the_target_does_not_answer(shm_dir, bucket_dir):
    """close(timeout) has persist() owe the newest checkpoint, which looks at the target for up to 5 s of
    its own: within close, close's sooner deadline holds. (The persisted commit marker is replaced by a
    FIFO nobody writes: reading it blocks, as on a frozen server.)"""
    store = _pstore(shm_dir, bucket_dir)
    save(store, _state(1), "a")
    store.persist("a")
    store.wait_persisted("a", timeout=60)
    marker = bucket_dir / "a" / COMMITTED
    marker.unlink()
    os.mkfifo(marker)
    try:
        start = time.monotonic()
        store.close(timeout=1)
        assert time.monotonic() - start < 2  # the docs: up to 1 s for uploads, 1 s for the persister
    finally:
        os.close(os.open(marker, os.O_RDWR))  # the blocked reads end


def test_a_wait_for_a_checkpoint_not_in_memory_that_times_out_on_the_target_names_both(shm_dir, bucket_dir):
    """The documented TimeoutError, not a bare 'no answer within 1.0 s' (the marker is a FIFO nobody
    writes: reading it blocks, as on a frozen server)."""
    with _pstore(shm_dir, bucket_dir, keep_in_memory=1, persist_on_close=False) as store:
        save(store, _state(1), "a")
        store.persist("a")
        store.wait_persisted("a", timeout=60)
        save(store, _state(2), "b")  # "a" evicted
        marker = bucket_dir / "a" / COMMITTED
        marker.unlink()
        os.mkfifo(marker)
        try:
            expected = (
                f"checkpoint 'a' not persisted after 1.0 s: {bucket_dir} did not answer whether it is there"
            )
            with pytest.raises(TimeoutError, match=expected):
                store.wait_persisted("a", timeout=1)
        finally:
            os.close(os.open(marker, os.O_RDWR))  # the blocked read ends


def _block(target: Path) -> None:
    """Replace the (empty) persist directory ``target`` with a file, so that every upload to it fails for
    good (NotADirectoryError): a target that breaks while the job runs (opening the store checks it)."""
    target.rmdir()
    target.write_bytes(b"")


def _tight_store(root, target, **kw) -> MemStore:
    """A store in the small tmpfs that owes every checkpoint to ``target`` and keeps one otherwise; every
    upload fails for good (see ``_block``)."""
    store = MemStore(
        root=root,
        job_id="job",
        keep_in_memory=1,
        io_threads=1,
        persist_to=str(target),
        persist_every=1,
        persist_on_close=False,
        **kw,
    )
    _block(target)
    return store


def test_full_memory_of_owed_checkpoints_is_a_clear_error(small_tmpfs, tmp_path):
    blocked = tmp_path / "blocked"
    sd = {"w": torch.randn(512, 1024)}  # 2 MiB per checkpoint in an 8 MiB tmpfs
    with _tight_store(small_tmpfs, blocked) as store:
        saved = []
        with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
            for i in range(5):
                save(store, sd, f"s{i}")
                saved.append(f"s{i}")
        assert "held in memory until uploaded" in str(ei.value)
        assert store.list_checkpoints() == saved and len(saved) >= 2
        for cid in saved:
            assert_tree_equal(sd, load(store, blank_like(sd), cid))


def test_backlog_wait_does_not_wait_for_uploads_that_failed_for_good(small_tmpfs, tmp_path):
    blocked = tmp_path / "blocked"
    sd = {"w": torch.randn(512, 1024)}
    with _tight_store(small_tmpfs, blocked, persist_backlog="wait", stage_timeout_s=600) as store:
        t0 = time.monotonic()
        with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
            for i in range(5):
                save(store, sd, f"s{i}")
                _wait_for_failed(store, f"s{i}")
        assert "uploads failed for" in str(ei.value) and "not-a-dir" not in str(ei.value)
        assert time.monotonic() - t0 < 120


def test_full_memory_held_for_another_open_store_names_its_target(small_tmpfs, tmp_path):
    """Store A of the job (persist_to ``a``, every upload failing for good) fills memory with checkpoints
    it owes to ``a``; store B of the same job (persist_to ``b``, open beside it, so A's holds bind B too)
    cannot save. B's error names ``a``, not B's own target, as what the checkpoints wait for, with their
    uploads' failure and what to do (before, it said they were held until uploaded to ``b`` and that
    B's uploads were behind its saves). A store without persist_to names ``a`` the same way."""
    a_target, b_target = tmp_path / "a", tmp_path / "b"
    a_target.mkdir()
    b_target.mkdir()
    sd = {"w": torch.randn(512, 1024)}  # 2 MiB per checkpoint in an 8 MiB tmpfs
    with _tight_store(small_tmpfs, a_target) as a:
        held = []
        with pytest.raises(BaseException):  # noqa: B017 - DCP wraps it
            for i in range(5):
                save(a, sd, f"s{i}")
                held.append(f"s{i}")
                _wait_for_failed(a, f"s{i}")
        a_url = a.target.url
        for persist_to in (str(b_target), None):
            b = MemStore(
                root=small_tmpfs, job_id="job", keep_in_memory=1, io_threads=1, persist_to=persist_to
            )
            with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
                save(b, sd, "b0")
            b.close()
            msg = str(ei.value)
            assert f"{len(held)} checkpoint(s) held in memory until uploaded to {a_url} by another " in msg
            assert f"store of this job: {held}; their uploads failed for {held}: store.persist(id) on " in msg
            assert "a store with that persist_to retries them, or free memory with store.delete(id)" in msg
            assert "until uploaded to " + str(b_target) not in msg and "behind saves" not in msg, msg


def test_a_store_without_persist_to_warns_of_owed_checkpoints_and_evicts_them(shm_dir, tmp_path):
    blocked = tmp_path / "blocked"
    with _tight_store(shm_dir, blocked) as store:
        for i in range(3):
            save(store, _state(i), f"s{i}")
    with pytest.warns(UserWarning, match=r"\['s0', 's1', 's2'\].*persist_to"):
        store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1)
    save(store, _state(3), "s3")
    assert store.list_checkpoints() == ["s3"]  # no longer held for an upload this store never makes
    store.close()


def test_full_memory_of_owed_checkpoints_without_persist_to_is_a_clear_error_or_evicted(
    small_tmpfs, tmp_path
):
    """Checkpoints that an earlier store owed to a persist_to that no store has open now fill the tmpfs.
    A store that keeps as many fails a save that does not fit, naming them and the way out; one that keeps
    fewer evicts those beyond its keep_in_memory (as its next commit would) and saves."""
    blocked = tmp_path / "blocked"
    sd = {"w": torch.randn(512, 1024)}
    store = _tight_store(small_tmpfs, blocked)
    with pytest.raises(BaseException):  # noqa: B017
        for i in range(5):
            save(store, sd, f"s{i}")
    owed = store.list_checkpoints()
    store.close()
    assert len(owed) > 1, owed
    with pytest.warns(UserWarning, match="owed to persistent storage"):
        store = MemStore(root=small_tmpfs, job_id="job", keep_in_memory=len(owed), io_threads=1)
    with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
        save(store, sd, "next")
    assert "InsufficientSpaceError" in repr(ei.value) and "store.delete(id)" in str(ei.value)
    assert store.list_checkpoints() == owed
    store.close()
    with pytest.warns(UserWarning, match="owed to persistent storage"):
        store = MemStore(root=small_tmpfs, job_id="job", keep_in_memory=1, io_threads=1)
    save(store, sd, "next")
    assert store.list_checkpoints() == ["next"]
    store.close()


def _wait_for_failed(store: MemStore, cid: str) -> None:
    deadline = time.monotonic() + 30
    while store.status(cid).persist != "failed":
        assert time.monotonic() < deadline, store.status(cid)
        time.sleep(0.02)


def test_a_persist_to_that_cannot_work_is_refused_when_the_store_opens(shm_dir, tmp_path):
    """A file where the directory should be, a directory below a file, and URLs missing their ``//`` or
    their path (which would otherwise be taken for local directories such as ``./s3:``) are refused by
    the constructor, naming persist_to, before anything is saved."""
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"")
    for target, why in [
        (a_file, "cannot be written: FileExistsError"),
        (a_file / "sub", "cannot be written: NotADirectoryError"),
        ("s3:/bucket/run", "is no URL with a path"),
        ("s3://", "is no URL with a path"),
    ]:
        with pytest.raises(ValueError, match=f"persist_to='{target}.* {why}"):
            MemStore(root=shm_dir, job_id="job", persist_to=str(target))
    assert not Path("s3:").exists()


def test_a_persist_to_in_the_stores_own_directory_is_refused_before_anything_is_made(shm_dir):
    """Copies persisted there would be evicted with the checkpoints they copy (the root: a checkpoint
    named as the job would be persisted into the job's directory)."""
    job_dir = shm_dir.resolve() / "job"
    for target, where in [
        (job_dir / "checkpoints", "inside"),
        (job_dir, "inside"),
        (shm_dir, "the MemStore root"),
    ]:
        with pytest.raises(ValueError, match=f"persist_to='{target}' is {where} the store's own directory"):
            MemStore(root=shm_dir, job_id="job", persist_to=str(target))
    assert not job_dir.exists()
    with MemStore(root=shm_dir, job_id="job", persist_to=str(shm_dir / "persisted")) as store:
        assert store.target is not None


def test_bad_persist_configuration_is_refused(shm_dir):
    with pytest.raises(ValueError, match="persist_to"):
        MemStore(root=shm_dir, job_id="job", persist_to="")
    with pytest.raises(ValueError, match="no usable fsspec file system"):
        MemStore(root=shm_dir, job_id="job", persist_to="nosuchproto://x/y")
    with pytest.raises(ValueError, match="persist_every"):
        MemStore(root=shm_dir, job_id="job", persist_to="/tmp/x", persist_every=0)
    with pytest.raises(ValueError, match="need persist_to"):
        MemStore(root=shm_dir, job_id="job", persist_every=2)
    with pytest.raises(ValueError, match="persist_backlog"):
        MemStore(root=shm_dir, job_id="job", persist_to="/tmp/x", persist_backlog="drop")
    with MemStore(root=shm_dir, job_id="job") as plain:
        save(plain, _state(), "a")
        with pytest.raises(ValueError, match="no persist_to"):
            plain.persist("a")
        assert plain.status("a").persist == "off"


@pytest.mark.parametrize("bad", ["5", True, -1, float("nan")])
def test_a_bad_timeout_is_refused_naming_it_before_anything_is_stopped(shm_dir, bucket_dir, bad):
    """wait_persisted and close refuse a timeout that is no number of seconds >= 0: NaN would wait forever,
    a str failed deep inside with a TypeError, and a close that failed half way left the store open."""
    store = _pstore(shm_dir, bucket_dir, persist_on_close=False)
    save(store, _state(), "a")
    with pytest.raises(
        ValueError, match=rf"timeout must be None \(no limit\) or a number of seconds >= 0, got {bad!r}"
    ):
        store.wait_persisted("a", bad)
    with pytest.raises(ValueError, match="timeout must be None"):
        store.close(bad)
    assert store.list_checkpoints() == ["a"]  # still open: nothing was stopped
    store.persist("a")
    store.close(math.inf)  # no limit, like None
    store.close()  # closed cleanly: a second close is a no-op
    with MemStore(root=shm_dir, job_id="job", persist_to=str(bucket_dir)) as again:
        assert again.status("a").persisted


def test_a_timeout_of_years_waits_as_one_without_a_limit(shm_dir, bucket_dir):
    """A timeout too long for a thread wait (1e10 s, past ``threading.TIMEOUT_MAX``) is no limit: the
    waits read a published copy as persisted. (Before, the look at its commit marker raised OverflowError,
    so wait_replicated said ``retrying`` and wait_persisted and close never returned.)"""
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(), "a")
        store.persist("a")
        assert store.wait_persisted("a", timeout=1e10).persisted
        assert store.wait_replicated("a", timeout=1e10).persist == "persisted"
        store.close(timeout=1e10)


def test_stores_killed_while_probing_persist_to_leave_one_probe_object_at_most(
    shm_dir, bucket_dir, monkeypatch
):
    """Opening a store writes a probe object under persist_to and removes it. A process killed in between
    left one object per start, for good; now every start writes the same name, so the next start removes
    it. The kill is a removal that fails (fault injection: it cannot be timed from outside)."""
    fs_type = type(PersistTarget(str(bucket_dir)).fs)

    def killed(fs, path, *args, **kwargs):
        raise OSError("stand-in: the process was killed before it removed the probe")

    with monkeypatch.context() as patched:
        patched.setattr(fs_type, "rm_file", killed)
        for _ in range(3):
            _pstore(shm_dir, bucket_dir).close()
    assert [p.name for p in bucket_dir.iterdir() if "probe" in p.name] == [PROBE]
    _pstore(shm_dir, bucket_dir).close()
    assert [p.name for p in bucket_dir.iterdir() if "probe" in p.name] == []


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"job_id": "../x"}, "invalid job id"),
        ({"replicas": -1}, "replicas must be"),
        ({"transport": "udp"}, "transport must be"),
        ({"replication_timeout_s": 0}, "replication_timeout_s must be"),
        ({"replication_secret": "short"}, "replication secret"),
    ],
)
def test_other_bad_arguments_are_refused_before_persist_to_is_probed(shm_dir, tmp_path, kwargs, error):
    """The write probe of persist_to makes its directory (and may wait on a slow bucket): an argument
    refused after it left a new directory behind."""
    target = tmp_path / "new-target"
    with pytest.raises(ValueError, match=error):
        MemStore(**{"root": shm_dir / "root", "job_id": "job", "persist_to": str(target), **kwargs})
    assert not target.exists()
    assert not (shm_dir / "root").exists()


def test_persist_of_an_unknown_checkpoint_names_those_that_exist(shm_dir, bucket_dir):
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(), "a")
        with pytest.raises(FileNotFoundError, match="'a'"):
            store.persist("nope")
        with pytest.raises(ValueError):
            store.persist("../a")


def test_persist_of_a_checkpoint_evicted_as_its_hold_is_placed_names_those_that_exist(
    shm_dir, bucket_dir, monkeypatch
):
    """Evicted between persist()'s look at its commit and the placing of its hold (the holds directory is
    gone with it): the same FileNotFoundError as for an unknown id, naming the checkpoints that exist, not
    one about ``<checkpoint>/holds``. The eviction is injected at that point (a patched read), since no
    real timing can hit the gap reliably."""
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(1), "a")
        save(store, _state(2), "b")
        evictions = _evict_at_first_persisted_read(store, monkeypatch)
        with pytest.raises(
            FileNotFoundError, match=r"'a' not found in store .*committed checkpoints: \['b'\]"
        ):
            store.persist("a")
        assert evictions == ["a"]


def test_a_checkpoint_persisted_elsewhere_is_not_reported_persisted_to_a_new_target(
    shm_dir, tmp_path, fresh_root
):
    """Persisted to one directory, then the job restarts with persist_to naming another: there the
    checkpoint is not persisted until it is uploaded there."""
    first, second = tmp_path / "first", tmp_path / "second"
    sd = _state(2)
    with _pstore(shm_dir, first, persist_on_close=False) as store:
        save(store, sd, "a")
        store.persist("a")
        store.wait_persisted("a", timeout=60)
    with _pstore(shm_dir, second, persist_on_close=False) as store:
        st = store.status("a")
        assert (st.persist, st.persisted_url, st.files_uploaded) == ("not requested", None, 0)
        store.persist("a")
        assert store.wait_persisted("a", timeout=60).persisted_url == f"{second}/a"
    assert (second / "a" / COMMITTED).exists()
    with MemStore(root=fresh_root, job_id="job", persist_to=str(second)) as fresh:
        assert_tree_equal(sd, load(fresh, blank_like(sd), "a"))


_KILLED_UPLOADER = """
import sys
sys.path.insert(0, {repo!r})
from dcp_memstore import MemStore
from tests.dcp.dcp_state import save
from tests.persist.test_persist_dir import _state
store = MemStore(root={root!r}, job_id="job", io_threads=1, persist_to={target!r}, persist_every=1,
                 persist_on_close=False)
save(store, _state(8), "c")
store.wait_persisted("c", timeout=60)
print("NOT-KILLED", flush=True)
"""


def test_a_restart_uploads_again_what_was_removed_from_the_target(shm_dir, bucket_dir, fresh_root):
    """The persister is killed after its first file's upload; the half-uploaded directory is removed
    from the target (a clean-up), then the job restarts: the checkpoint is uploaded whole, not waited
    for forever."""
    repo = str(Path(__file__).resolve().parents[2])
    code = _KILLED_UPLOADER.format(repo=repo, root=str(shm_dir), target=str(bucket_dir))
    env = dict(os.environ, DCP_MEMSTORE_CRASH_AT="persist-upload:0:1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == -9 and "NOT-KILLED" not in res.stdout, res.stderr[-3000:]
    subprocess.run(["rm", "-rf", str(bucket_dir / "c")], check=True)
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        assert store.wait_persisted("c", timeout=30).persisted
    with MemStore(root=fresh_root, job_id="job", persist_to=str(bucket_dir)) as fresh:
        assert_tree_equal(_state(8), load(fresh, blank_like(_state(8)), "c"))


def test_a_restart_removes_the_temporary_file_of_an_upload_killed_while_writing(shm_dir, bucket_dir):
    """The persister is SIGKILLed once a file's bytes are written into the target directory under its
    temporary name, before the rename: that file stays behind. The restarted job uploads the
    checkpoint, and once it is published, removes the leftover: nothing but the checkpoint's own files
    stays in the target."""
    repo = str(Path(__file__).resolve().parents[2])
    code = _KILLED_UPLOADER.format(repo=repo, root=str(shm_dir), target=str(bucket_dir))
    env = dict(os.environ, DCP_MEMSTORE_CRASH_AT="persist-write:0:1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == -9 and "NOT-KILLED" not in res.stdout, res.stderr[-3000:]
    left = [p.name for p in (bucket_dir / "c").iterdir() if ".tmp-" in p.name]
    assert len(left) == 1 and left[0].startswith(".__0_0.distcp.tmp-"), left
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        assert store.wait_persisted("c", timeout=30).persisted
    assert not [p for p in (bucket_dir / "c").rglob("*") if ".tmp-" in p.name]
    assert (bucket_dir / "c" / "__0_0.distcp").is_file()


@pytest.mark.parametrize("verify", [True, False])
def test_a_missing_local_file_is_not_read_from_another_save_persisted_under_its_id(
    shm_dir, bucket_dir, verify
):
    """The id is persisted by an earlier save (so this save's upload is refused); a file of this save goes
    missing from memory: the load fails saying so, and never reads the other save's bytes in its place
    (which, with checksums off, would load the wrong tensors without a word)."""
    first, second = _state(1), _state(2)
    with _pstore(shm_dir, bucket_dir, keep_in_memory=3, verify_checksums=verify) as store:
        save(store, first, "final")
        store.persist("final")
        store.wait_persisted("final", timeout=60)
        store.delete("final")
        save(store, second, "final")
        (store.layout.checkpoint_dir("final") / "__0_0.shard").unlink()
        with pytest.raises(BaseException, match="__0_0.shard of checkpoint 'final' is in no tier"):  # noqa: B017
            load(store, blank_like(second), "final")


@pytest.mark.parametrize(
    ("name", "sibling"), [("run[1]", "run1"), ("lr*2", "lr-x2"), ("what?", "whatX"), ("run::2", "run")]
)
def test_a_persist_directory_named_with_glob_characters_lists_its_checkpoints(
    shm_dir, tmp_path, name, sibling
):
    """A fresh node finds (and loads) the checkpoints persisted under a directory whose name has
    characters that are special in glob patterns, instead of resuming from nothing, and not those of
    another run in a directory whose name the pattern would match. ``::`` chains URLs in fsspec: the
    uploads into ``run::2`` went into ``run``."""
    target, sd = tmp_path / name, _state(4)
    with _pstore(shm_dir, target, persist_every=1) as store:
        save(store, sd, "c")
        store.wait_persisted("c", timeout=60)
    with _pstore(Path(str(shm_dir) + "-other"), tmp_path / sibling, persist_every=1) as other:
        save(other, _state(5), "newer-of-another-run")
        other.wait_persisted("newer-of-another-run", timeout=60)
    fresh_root = Path(str(shm_dir) + "-fresh")
    try:
        with MemStore(root=fresh_root, job_id="job", persist_to=str(target)) as fresh:
            assert fresh.latest_checkpoint() == "c"
            assert_tree_equal(sd, load(fresh, blank_like(sd), "c"))
    finally:
        subprocess.run(["rm", "-rf", str(fresh_root), str(shm_dir) + "-other"], check=True)


_IN_NEW_PID_NAMESPACE = """
import os
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from dcp_memstore import MemStore, PersistError
from tests.dcp.dcp_state import save
from tests.persist.test_persist_dir import _block, _state, _wait_for_failed
assert os.getpid() == 1, os.getpid()
target = Path({target!r})
with MemStore(root={root!r}, job_id="job", persist_to=str(target), persist_on_close=False) as store:
    if {first}:
        _block(target)
        save(store, _state(3), "c")
        store.persist("c")
        _wait_for_failed(store, "c")
    else:
        print(store.wait_persisted("c", timeout=60).persist, flush=True)
"""


def test_a_restart_in_a_new_pid_namespace_retries_an_upload_that_failed(shm_dir, tmp_path):
    """The job's upload fails for good (the target broke), the job ends, the target is fixed and the job
    restarts in a new container (a new PID namespace) whose process has the pid the failed one had (pid
    1, as a container's first process): the restart retries the upload, as it does elsewhere. Before, the
    old process's state record was taken for the new process's own, by its pid: the upload was never
    retried and status() said failed."""
    if subprocess.run(["unshare", "-p", "-f", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a PID namespace here (unshare needs root)")
    target = tmp_path / "late"
    target.mkdir()
    repo = str(Path(__file__).resolve().parents[2])
    outputs = []
    for first in (True, False):
        if not first:
            target.unlink()  # fixed
        code = _IN_NEW_PID_NAMESPACE.format(repo=repo, root=str(shm_dir), target=str(target), first=first)
        cmd = ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", code]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        outputs.append(res.stdout.strip())
    assert outputs == ["", "persisted"]


def test_two_stores_with_different_targets_each_hold_a_checkpoint_until_their_own_upload(shm_dir, tmp_path):
    """Two stores of one job persist to two directories. Each target's upload holds the checkpoint in
    memory on its own: A's publication does not release B's hold (B's upload, failing meanwhile, would
    otherwise never finish, and the checkpoint would be evicted before B has it), and A's request does
    not make B upload. (Before, both shared one hold, and A's publication evicted the checkpoint.)"""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    opts = {"keep_in_memory": 1, "persist_on_close": False}
    with _pstore(shm_dir, a_dir, **opts) as a, _pstore(shm_dir, b_dir, **opts) as b:
        sd = _state(1)
        save(a, sd, "c1")
        a.persist("c1")
        a.wait_persisted("c1", timeout=60)
        assert b.status("c1").persist == "not requested"  # A's request is A's only
        save(a, _state(2), "c2")
        assert a.list_checkpoints() == ["c2"]  # c1 was held for A only
        save(a, sd, "c3")
        b_dir.rmdir()
        b_dir.write_bytes(b"")  # a file where B's directory should be: B's uploads fail
        b.persist("c3")
        with pytest.raises(PersistError):
            b.wait_persisted("c3", timeout=60)
        a.persist("c3")
        a.wait_persisted("c3", timeout=60)
        save(a, _state(4), "c4")
        assert a.list_checkpoints() == ["c3", "c4"]  # still held for B
        assert b.status("c3").persist == "failed"
        b_dir.unlink()
        b_dir.mkdir()
        b.persist("c3")
        b.wait_persisted("c3", timeout=60)
        save(a, _state(5), "c5")
        assert a.list_checkpoints() == ["c5"]  # no hold left: evicted
    assert (a_dir / "c3" / COMMITTED).exists() and (b_dir / "c3" / COMMITTED).exists()
    assert not (b_dir / "c1").exists()


def test_status_tells_a_persisted_copy_deleted_from_the_target_and_persist_uploads_it_again(
    shm_dir, bucket_dir
):
    """The persisted copy of a checkpoint still in memory is deleted from the target. status() checks its
    commit marker (one read per call, only for a checkpoint recorded as persisted): not ``persisted``, with
    an error naming the URL; ``wait_persisted`` does not wait for it; ``store.persist(id)`` uploads it
    again. (Before, status reported it persisted from the records in memory, and persist did nothing.)"""
    sd = _state(2)
    with _pstore(shm_dir, bucket_dir, persist_every=1, persist_on_close=False) as store:
        save(store, sd, "c")
        store.wait_persisted("c", timeout=60)
        subprocess.run(["rm", "-rf", str(bucket_dir / "c")], check=True)
        st = store.status("c")
        assert (st.persist, st.persisted_url, st.files_uploaded) == ("not requested", None, 0)
        assert f"persisted to {bucket_dir}/c, but that copy is gone" in st.error
        with pytest.raises(
            ValueError, match=r"not being persisted \(not requested: .* that copy is gone .*\); call"
        ):
            store.wait_persisted("c", timeout=5)
        store.persist("c")
        assert store.wait_persisted("c", timeout=60).persisted_url == f"{bucket_dir}/c"
    with _pstore(Path(str(shm_dir) + "-other"), bucket_dir) as other:
        try:
            assert_tree_equal(sd, load(other, blank_like(sd), "c"))
        finally:
            subprocess.run(["rm", "-rf", str(other.layout.root)], check=True)


def test_a_load_that_needs_a_persisted_copy_deleted_from_the_target_names_its_url(shm_dir, bucket_dir):
    """A file of a checkpoint in memory is lost here, and its persisted copy, which the load would read
    instead, was deleted from the target: the load fails naming the URL of the copy that is gone.
    (Before, it said the file was in no tier, as if the checkpoint had never been persisted.)"""
    sd = _state(3)
    with _pstore(shm_dir, bucket_dir, persist_every=1, persist_on_close=False) as store:
        save(store, sd, "c")
        store.wait_persisted("c", timeout=60)
        subprocess.run(["rm", "-rf", str(bucket_dir / "c")], check=True)
        (store.layout.checkpoint_dir("c") / "__0_0.shard").unlink()
        with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
            load(store, blank_like(sd), "c")
        assert f"persisted to {bucket_dir}/c, but that copy is gone" in str(ei.value)
        assert "file __0_0.shard of checkpoint 'c' cannot be read from memory" in str(ei.value)


_OWES_AND_WAITS = """
import sys
import time
sys.path.insert(0, {repo!r})
from pathlib import Path
from dcp_memstore import MemStore
from tests.dcp.dcp_state import save
from tests.persist.test_persist_dir import _block, _state, _wait_for_failed
target = Path({target!r})
store = MemStore(root={root!r}, job_id="job", keep_in_memory=1, persist_to=str(target), persist_on_close=0)
_block(target)
save(store, _state(1), "c1")
store.persist("c1")
_wait_for_failed(store, "c1")
print("owed", flush=True)
time.sleep(600)
"""


def test_a_hold_for_a_target_no_running_process_has_open_is_evicted_by_another_store(shm_dir, tmp_path):
    """A process owes c1 to target A, whose uploads fail, and stays alive: a store of the same job with
    persist_to B keeps c1 in memory for A (it may still upload it). Once that process is SIGKILLed, no
    process will ever upload c1 to A (a job restarted with a new persist_to): the store warns at open and
    its next commit evicts c1 like any other, instead of pinning it in memory for good."""
    repo = str(Path(__file__).resolve().parents[2])
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    code = _OWES_AND_WAITS.format(repo=repo, root=str(shm_dir), target=str(a_dir))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "owed"
        opts = {"keep_in_memory": 1, "persist_on_close": False}
        with _pstore(shm_dir, b_dir, **opts) as b:
            save(b, _state(2), "c2")
            assert b.list_checkpoints() == ["c1", "c2"]  # A's upload may still come
            owner.kill()
            owner.wait(timeout=30)
            with pytest.warns(UserWarning, match=r"\['c1'\].*no running process of the job has open"):
                _pstore(shm_dir, b_dir, **opts).close()
            save(b, _state(3), "c3")
            assert b.list_checkpoints() == ["c3"]
    finally:
        owner.kill()
        owner.wait(timeout=30)


def test_a_checkpoint_an_earlier_version_held_for_its_upload_is_uploaded_and_released(shm_dir, bucket_dir):
    """A store of an earlier version held owed checkpoints under one name, ``persist``, for every target
    (placed here by hand, as that version did). The job restarted on the same tmpfs with this version
    uploads it and releases it (before, no store ever released that hold: the checkpoint stayed in
    memory for good, never uploaded)."""
    with MemStore(root=shm_dir, job_id="job", keep_in_memory=1) as old:
        save(old, _state(1), "c1")
        catalog.hold(old.layout, "c1", "persist")
    with _pstore(shm_dir, bucket_dir, keep_in_memory=1, persist_on_close=False) as store:
        assert store.wait_persisted("c1", timeout=60).persisted
        save(store, _state(2), "c2")
        assert store.list_checkpoints() == ["c2"]


def test_deleting_a_checkpoint_whose_upload_failed_removes_what_it_left_in_the_target(shm_dir, bucket_dir):
    """The upload of "c" fails for good once one of its files is in the target (a directory stands where
    its objects file must go). That partial directory is never taken for a checkpoint, by stock DCP nor
    by a store. Deleting "c" from memory removes it from the target; deleting a published checkpoint
    from memory leaves its persisted copy. (Before, the partial directory stayed for good.)"""
    with _pstore(shm_dir, bucket_dir, persist_on_close=False) as store:
        save(store, _state(1), "p")
        store.persist("p")
        store.wait_persisted("p", timeout=60)
        save(store, _state(2), "c")
        (bucket_dir / "c" / remote_name("__0_objects.bin") / "blocker").mkdir(parents=True)
        store.persist("c")
        with pytest.raises(PersistError, match="IsADirectoryError"):
            store.wait_persisted("c", timeout=60)
        assert (bucket_dir / "c" / "__0_0.distcp").is_file()
        assert not (bucket_dir / "c" / ".metadata").exists()  # what stock DCP reads first: not a checkpoint
        with pytest.raises(CheckpointException):  # torch 2.10 and 2.11 say only 'metadata is None'
            dcp.load(
                blank_like(_state(2)), storage_reader=dcp.FileSystemReader(bucket_dir / "c"), no_dist=True
            )
        store.delete("c")
        store.delete("p")
        deadline = time.monotonic() + 30
        while (bucket_dir / "c").exists():
            assert time.monotonic() < deadline, sorted(p.name for p in (bucket_dir / "c").rglob("*"))
            time.sleep(0.05)
    assert (bucket_dir / "p" / COMMITTED).is_file()
    assert sorted(p.name for p in bucket_dir.iterdir()) == ["p"]
