"""Two nodes uploading the same files of one checkpoint to the same target, to a directory and to S3.

It happens after a restart on fewer nodes: a node takes over the files of a node that left the job (see
``recovery.orphans``); when that node comes back later with its memory intact, both hold the files as
their own copy and both upload them, while the other may already have published the checkpoint. Each
upload must replace the remote file whole or leave it as it was, and part records and publication must
be idempotent."""

from __future__ import annotations

import gc
import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemStore
from dcp_memstore.persist.export import BLOCK_SIZE, remote_name, upload_file
from dcp_memstore.persist.open_uploads import OpenUploads
from dcp_memstore.persist.target import COMMITTED, PARTS, STOCK_METADATA, PersistTarget
from dcp_memstore.persist.target import MANIFEST as REMOTE_MANIFEST
from dcp_memstore.store.layout import MANIFEST, StoreLayout
from dcp_memstore.store.manifest import Manifest
from tests.dcp.dcp_state import assert_tree_equal, blank_like, load, save
from tests.persist.test_persist_s3 import _run_killed_saver, _state


@pytest.fixture(params=["dir", "s3"])
def target(request, tmp_path) -> Iterator[tuple[str, dict]]:
    """(persist_to, storage_options) of an empty directory, or of a new bucket on a real S3 server."""
    if request.param == "dir":
        yield str(tmp_path / "persisted"), {}
    else:
        server, url = request.getfixturevalue("s3_bucket")
        yield url, server.storage_options()


@pytest.fixture
def other_root(shm_dir) -> Iterator[Path]:
    """A second node's tmpfs root."""
    root = Path(f"{shm_dir}-other")
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=True)


def _store(root: Path, target: tuple[str, dict]) -> MemStore:
    url, options = target
    return MemStore(
        root=root, job_id="job", io_threads=2, persist_to=url, storage_options=options, persist_on_close=False
    )


def _remote_files(t: PersistTarget, cid: str) -> dict[str, str]:
    """The SHA-256 of every object under the checkpoint's remote directory (hidden temporary files
    included), by path."""
    return {p: hashlib.sha256(t.fs.cat_file(p)).hexdigest() for p in t.fs.find(t.path(cid), withdirs=False)}


def test_a_second_upload_of_a_published_file_that_fails_midway_leaves_it_whole(shm_dir, target, tmp_path):
    """The checkpoint is published; another node uploads one of its files again and fails in the middle
    (its copy is shorter than the manifest says). The published file stays whole: nothing of the failed
    upload is visible, and stock DCP loads the checkpoint. (Before, a local target's file was truncated
    in place, and s3fs completed the upload with what was written when the writer was closed.) A whole
    upload of it again writes the same bytes, with the items where the part record says."""
    with _store(shm_dir, target) as store:
        save(store, _state(3, mib=2), "s1")
        store.persist("s1")
        store.wait_persisted("s1", timeout=60)
        local = store.layout.checkpoint_dir("s1")
    t = PersistTarget(target[0], target[1])
    before = _remote_files(t, "s1")
    by_file: dict[str, list] = {}
    for i, it in enumerate(Manifest.read(local / MANIFEST).items):
        by_file.setdefault(it.location.file, []).append((i, it))
    file, items = max(by_file.items(), key=lambda kv: len(kv[1]))
    assert len(items) > 1, by_file  # the upload writes an item before it fails
    copy = shm_dir / "other-node-copy"
    copy.mkdir()
    shutil.copyfile(local / file, copy / file)
    last = max(it.location.offset for _, it in items)
    with open(copy / file, "r+b") as f:
        f.truncate(last + 1)  # every item but the last fits
    with pytest.raises(ValueError, match="shorter than its manifest"):
        upload_file(t, "s1", copy, file, items)
    assert t.path("s1", remote_name(file)) in before
    assert _remote_files(t, "s1") == before
    shutil.copyfile(local / file, copy / file)  # a whole copy: the same bytes land at the same places
    recorded = msgpack.unpackb(t.fs.cat_file(t.path("s1", PARTS, file)))["items"]
    assert [p.to_record() for p in upload_file(t, "s1", copy, file, items)] == recorded
    assert _remote_files(t, "s1") == before
    if target[0].startswith("/"):
        out = blank_like(_state(3, mib=2))
        dcp.load(out, storage_reader=dcp.FileSystemReader(f"{target[0]}/s1"), no_dist=True)
        assert_tree_equal(_state(3, mib=2), out)


def test_two_nodes_uploading_the_same_files_publish_the_checkpoint_once(shm_dir, other_root, target):
    """Two nodes hold the same committed checkpoint as their own copy and both upload and publish it at
    the same time: both end persisted, the target holds one file and one part record per local file
    and nothing else (no leftover temporary file), and a store on an empty tmpfs loads it."""
    url, _ = target
    with _store(shm_dir, target) as a:
        save(a, _state(4, mib=2), "s1")
        shutil.copytree(a.layout.checkpoint_dir("s1"), other_root / "job" / "checkpoints" / "s1")
        with _store(other_root, target) as b:
            assert b.list_checkpoints() == ["s1"]
            a.persist("s1")
            b.persist("s1")
            for store in (a, b):
                st = store.wait_persisted("s1", timeout=60)
                assert st.files_uploaded == st.files_total > 1, st
            local = sorted(p.name for p in a.layout.checkpoint_dir("s1").glob("__*"))
    t = PersistTarget(url, target[1])
    names = sorted(p.removeprefix(t.path("s1") + "/") for p in _remote_files(t, "s1"))
    ours = [COMMITTED, REMOTE_MANIFEST, STOCK_METADATA]
    assert names == sorted([remote_name(f) for f in local] + [f"{PARTS}/{f}" for f in local] + ours)
    fresh = Path(f"{other_root}-fresh")
    try:
        with _store(fresh, target) as store:
            assert store.latest_checkpoint() == "s1"
            assert_tree_equal(_state(4, mib=2), load(store, blank_like(_state(4, mib=2)), "s1"))
    finally:
        subprocess.run(["rm", "-rf", str(fresh)], check=True)


def test_an_upload_whose_abort_fails_never_completes_with_what_was_written(shm_dir, s3_bucket):
    """A multipart re-upload of a published file fails midway and the abort of its multipart upload fails
    too (a mock: one refused request, which the real server does not produce on demand). The writer is
    then dropped: it must not complete the upload with the parts sent so far when it is collected
    (before, fsspec's finalizer closed it, and the published object was replaced by a torn one). The
    upload's own error is what the caller sees. The next clean-up aborts the upload (before, its parts
    stayed in the bucket for good)."""
    server, url = s3_bucket
    state = {"w": torch.randn(10 << 20), "v": torch.randn(1 << 10)}  # 40 MiB: multipart parts
    with MemStore(
        root=shm_dir, job_id="job", io_threads=1, persist_to=url, storage_options=server.storage_options()
    ) as store:
        save(store, state, "s1")
        store.persist("s1")
        store.wait_persisted("s1", timeout=60)
        local = store.layout.checkpoint_dir("s1")
    t = PersistTarget(url, server.storage_options())
    before = _remote_files(t, "s1")
    items = list(enumerate(Manifest.read(local / MANIFEST).items))
    (file,) = {it.location.file for _, it in items}
    copy = shm_dir / "other-node-copy"
    copy.mkdir()
    shutil.copyfile(local / file, copy / file)
    last = max(it.location.offset for _, it in items)
    assert last > 2 * BLOCK_SIZE  # parts of the first item are uploaded before the failure
    with open(copy / file, "r+b") as f:
        f.truncate(last + 1)
    fs = t.fs

    def refused(*args, **kwargs):
        raise ConnectionError("abort refused (mock)")

    uploads = OpenUploads(store.layout, t)
    fs.abort_mpu = refused
    try:
        with pytest.raises(ValueError, match="shorter than its manifest"):
            upload_file(t, "s1", copy, file, items, uploads=uploads)
        gc.collect()
    finally:
        del fs.abort_mpu
    assert _remote_files(t, "s1") == before
    bucket = url.removeprefix("s3://")
    assert len(fs.list_multipart_uploads(bucket)) == 1
    assert uploads.abort_orphans() == [t.path("s1", remote_name(file))]  # its process lives, but gave it up
    assert fs.list_multipart_uploads(bucket) == []


def test_an_upload_that_fails_to_complete_is_aborted(shm_dir, s3_bucket):
    """Completing a multipart upload fails (a mock: one refused request, which the real server does not
    produce on demand). The upload is aborted, not left in the bucket with its parts, where each retry
    would leave another whole file's worth of storage nobody sees."""
    server, url = s3_bucket
    state = {"w": torch.randn(10 << 20)}  # 40 MiB: multipart parts
    with MemStore(root=shm_dir, job_id="job", io_threads=1, persist_on_close=False) as store:
        save(store, state, "s1")
        local = store.layout.checkpoint_dir("s1")
        items = list(enumerate(Manifest.read(local / MANIFEST).items))
        (file,) = {it.location.file for _, it in items}
        t = PersistTarget(url, server.storage_options())
        fs = t.fs
        call = fs.call_s3

        def refused(method, *args, **kwargs):
            if method == "complete_multipart_upload":
                raise ConnectionError("complete refused (mock)")
            return call(method, *args, **kwargs)

        fs.call_s3 = refused
        try:
            with pytest.raises(ConnectionError, match="complete refused"):
                upload_file(t, "s1", local, file, items)
        finally:
            fs.call_s3 = call
    bucket = url.removeprefix("s3://")
    assert fs.list_multipart_uploads(bucket) == []
    assert not fs.exists(t.path("s1", remote_name(file)))


def test_a_restart_aborts_its_killed_upload_but_never_another_nodes_live_upload_of_the_file(
    shm_dir, other_root, s3_bucket
):
    """Node B's persister is SIGKILLed in the middle of ``c/__0_0.distcp``: its multipart upload stays
    open. Node A holds a copy of the checkpoint (a take-over) and uploads the same file: its multipart
    upload is open, parts sent, when B's job restarts and publishes the checkpoint, and when A's own
    node clears what its killed processes left. B aborts its killed upload only; A's live upload is
    left alone, and completes. (Before, B's killed upload stayed open for good; aborting every upload
    of the file would have failed A's.)"""
    server, url = s3_bucket
    bucket, fs = url.removeprefix("s3://"), server.filesystem()
    _run_killed_saver(other_root, server, url, "persist-write", mib=40)
    (killed,) = fs.list_multipart_uploads(bucket)
    a = StoreLayout(shm_dir, "job")
    local = shutil.copytree(other_root / "job" / "checkpoints" / "c", a.checkpoint_dir("c"))
    file = "__0_0.shard"
    items = [
        (i, it) for i, it in enumerate(Manifest.read(local / MANIFEST).items) if it.location.file == file
    ]
    t = PersistTarget(url, server.storage_options())

    def while_a_uploads() -> None:
        (live,) = [u for u in fs.list_multipart_uploads(bucket) if u["UploadId"] != killed["UploadId"]]
        with _store(other_root, (url, server.storage_options())) as b:
            b.wait_persisted("c", timeout=120)
        assert OpenUploads(a, t).abort_orphans() == []  # A's process lives
        assert fs.list_multipart_uploads(bucket) == [live]

    upload_file(t, "c", local, file, items, while_a_uploads, OpenUploads(a, t))
    assert fs.list_multipart_uploads(bucket) == []
    fresh = Path(f"{other_root}-fresh")
    try:
        with _store(fresh, (url, server.storage_options())) as store:
            assert_tree_equal(_state(5, mib=40), load(store, blank_like(_state(5, mib=40)), "c"))
    finally:
        subprocess.run(["rm", "-rf", str(fresh)], check=True)
