"""Persistence against a real S3 server (SeaweedFS): stock loading, outages, bad credentials, crashes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dcp_memstore import MemStore, PersistError
from dcp_memstore.answer_deadline import MIN_ANSWER_S
from dcp_memstore.persist.export import remote_name
from dcp_memstore.persist.publish import remote_commit
from dcp_memstore.persist.target import COMMITTED, STOCK_METADATA, PersistTarget
from dcp_memstore.persisting import PERSIST_LOOK_S
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import MANIFEST
from dcp_memstore.store.manifest import Manifest, ManifestItem
from tests.dcp.dcp_state import assert_tree_equal, blank_like, load, save

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int = 0, mib: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(mib * 256, 1024, generator=g),
        "b": torch.randn(33, generator=g).to(torch.bfloat16),
        "step": seed,
        "extra": {"tag": f"s{seed}"},
    }


def _store(root, url, server, **kw) -> MemStore:
    kw.setdefault("persist_on_close", False)
    return MemStore(
        root=root, job_id="job", io_threads=2, persist_to=url, storage_options=server.storage_options(), **kw
    )


def _keys(server, url: str) -> list[str]:
    bucket = url.removeprefix("s3://")
    return sorted(p[len(bucket) + 1 :] for p in server.filesystem().find(bucket))


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_s3_roundtrip_loads_with_stock_fsspec_reader_and_from_empty_tmpfs(shm_dir, s3_bucket, tmp_path):
    server, url = s3_bucket
    sd = _state(1, mib=20)  # a 20 MiB item: several multipart parts, several ranged reads back
    with _store(shm_dir, url, server, persist_every=1) as store:
        save(store, sd, "step-1")
        st = store.wait_persisted("step-1", timeout=120)
        assert st.persisted_url == f"{url}/step-1"
    keys = _keys(server, url)
    assert "step-1/.metadata" in keys and f"step-1/{COMMITTED}" in keys
    assert any(k.endswith(".distcp") for k in keys)

    torch.save(sd, tmp_path / "expected.pt")
    script = f"""
import sys
sys.modules["dcp_memstore"] = None  # stock PyTorch only
import torch, torch.distributed.checkpoint as dcp
expected = torch.load({str(tmp_path / "expected.pt")!r})
out = {{"w": torch.zeros_like(expected["w"]), "b": torch.zeros_like(expected["b"]), \
"step": 0, "extra": {{"tag": ""}}}}
dcp.load(out, checkpoint_id={f"{url}/step-1"!r}, no_dist=True)  # FsspecReader, credentials from the env
assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"])
assert out["step"] == expected["step"] and out["extra"] == expected["extra"], out
print("STOCK-OK")
"""
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID=server.key,
        AWS_SECRET_ACCESS_KEY=server.secret,
        AWS_ENDPOINT_URL=server.endpoint_url,
        AWS_DEFAULT_REGION="us-east-1",
    )
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert "STOCK-OK" in res.stdout, res.stderr[-3000:]

    with _store(Path(str(shm_dir) + "-fresh"), url, server) as fresh:
        try:
            assert fresh.latest_checkpoint() == "step-1"
            assert_tree_equal(sd, load(fresh, blank_like(sd), "step-1"))
        finally:
            subprocess.run(["rm", "-rf", str(fresh.layout.root)], check=True)


def test_server_down_mid_upload_retries_while_training_goes_on(shm_dir, s3_bucket, fresh_root):
    server, url = s3_bucket
    states = [_state(i, mib=8) for i in range(3)]
    with _store(shm_dir, url, server, persist_every=1, keep_in_memory=1) as store:
        save(store, states[0], "s0")
        _wait_for(lambda: store.status("s0").persist in ("uploading", "persisted"), 60, "upload start")
        server.kill()  # mid-upload (or just after): the persister must retry, not lose or half-publish
        t0 = time.monotonic()
        save(store, states[1], "s1")  # training and saving go on while the store is down
        save(store, states[2], "s2")
        assert time.monotonic() - t0 < 30
        if not store.status("s0").persisted:
            _wait_for(lambda: store.status("s0").persist == "retrying", 90, "retrying state")
            assert store.status("s0").error
        assert store.list_checkpoints()[-2:] == ["s1", "s2"]  # owed ones are held past keep_in_memory=1
        server.start()
        for cid in ("s0", "s1", "s2"):
            store.wait_persisted(cid, timeout=180)
        _wait_for(lambda: store.list_checkpoints() == ["s2"], 30, "eviction of persisted checkpoints")
    with _store(fresh_root, url, server) as fresh:
        for i, cid in enumerate(("s0", "s1", "s2")):
            assert_tree_equal(states[i], load(fresh, blank_like(states[i]), cid))


def test_backlog_wait_lets_saves_through_once_the_server_is_back(small_tmpfs, s3_bucket):
    server, url = s3_bucket
    sd = {"w": torch.randn(512, 1024)}  # 2 MiB per checkpoint: at most three fit in the 8 MiB tmpfs
    with MemStore(
        root=small_tmpfs,
        job_id="job",
        keep_in_memory=1,
        io_threads=1,
        persist_to=url,
        storage_options=server.storage_options(),
        persist_every=1,
        persist_backlog="wait",
        stage_timeout_s=120,
        persist_on_close=False,
    ) as store:
        server.stop()
        restarter = threading.Timer(5.0, server.start)
        restarter.start()
        try:
            t0 = time.monotonic()
            for i in range(5):
                save(store, sd, f"s{i}")  # the ones that do not fit wait for uploads to free memory
            waited = time.monotonic() - t0
        finally:
            restarter.join()
        assert waited >= 5.0
        assert store.list_checkpoints()[-1] == "s4"
        store.wait_persisted("s4", timeout=120)
    with _store(small_tmpfs, url, server) as again:
        assert_tree_equal(sd, load(again, blank_like(sd), "s4"))


def _bad_options(server, url: str, fault: str, monkeypatch, tmp_path) -> tuple[str, dict, str]:
    """``(persist_to, storage_options, error type)`` of a target the real server refuses: a wrong secret,
    no credentials at all (none in the environment either), or a bucket that does not exist."""
    opts, target = server.storage_options(), url
    if fault == "wrong-secret":
        opts["secret"] = "not-the-secret"
    elif fault == "no-credentials":
        del opts["key"], opts["secret"]
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    else:
        target = "s3://no-such-bucket-here/prefix"
    expected = {
        "wrong-secret": "PermissionError",
        "no-credentials": "NoCredentialsError",
        "missing-bucket": "FileNotFoundError",
    }[fault]
    return target, opts, expected


@pytest.mark.parametrize("fault", ["wrong-secret", "no-credentials", "missing-bucket"])
def test_bad_credentials_or_bucket_are_refused_when_the_store_opens(
    shm_dir, s3_bucket, fault, monkeypatch, tmp_path
):
    server, url = s3_bucket
    target, opts, expected = _bad_options(server, url, fault, monkeypatch, tmp_path)
    with pytest.raises(ValueError, match=f"persist_to='{target}' cannot be written: {expected}"):
        MemStore(root=shm_dir, job_id="job", persist_to=target, storage_options=opts)
    assert _keys(server, url) == []


def test_a_store_opens_while_the_server_is_down_and_uploads_once_it_is_back(shm_dir, s3_bucket, caplog):
    server, url = s3_bucket
    server.stop()
    t0 = time.monotonic()
    with _store(shm_dir, url, server, persist_every=1) as store:
        assert time.monotonic() - t0 < 30  # the check at open is bounded; training is not held up
        assert f"cannot reach persist_to={url!r} now" in caplog.text
        server.start()
        save(store, _state(3), "a")
        assert store.wait_persisted("a", timeout=120).persisted


@pytest.mark.parametrize("fault", ["wrong-secret", "no-credentials", "missing-bucket"])
def test_bad_credentials_or_bucket_fail_clearly_and_publish_nothing(
    shm_dir, s3_bucket, fault, caplog, monkeypatch, tmp_path
):
    """Credentials or bucket go bad while the job runs (the check at open passed): the bucket is removed
    from the server, or the storage options the store's target uses are swapped for refused ones."""
    server, url = s3_bucket
    _, opts, expected = _bad_options(server, url, fault, monkeypatch, tmp_path)
    caplog.set_level(logging.ERROR, logger="dcp_memstore")
    with _store(shm_dir, url, server, persist_every=1) as store:
        if fault == "missing-bucket":
            server.filesystem().rmdir(url.removeprefix("s3://"))
        else:
            store.target.storage_options = opts
        save(store, _state(1), "a")
        with pytest.raises(PersistError) as ei:
            store.wait_persisted("a", timeout=120)
        st = store.status("a")
        assert st.persist == "failed"
        assert expected in st.error and expected in str(ei.value)
        assert any("persisting checkpoint 'a'" in r.getMessage() for r in caplog.records)
        assert store.list_checkpoints() == ["a"]  # still in memory, held
    if fault == "missing-bucket":
        server.make_bucket(url.removeprefix("s3://"))
    assert _keys(server, url) == []  # nothing half-visible
    with _store(Path(str(shm_dir) + "-other"), url, server) as other:
        try:
            assert other.latest_checkpoint() is None
        finally:
            subprocess.run(["rm", "-rf", str(other.layout.root)], check=True)


def test_a_corrupt_item_late_in_a_multipart_upload_publishes_nothing_and_aborts_the_upload(
    shm_dir, s3_bucket
):
    """A byte near the end of a 40 MiB tensor flips in memory before its upload. Its checksum is computed
    while it is sent, so the mismatch shows only after two 16 MiB parts are in the bucket: the upload is
    aborted (no object, no multipart upload left open) and nothing is published, so stock DCP and our
    reader never take the corrupt bytes for the checkpoint."""
    server, url = s3_bucket
    with _store(shm_dir, url, server) as store:
        save(store, _state(1, mib=40), "c")
        item = _flip_a_byte_near_the_end_of(store, "c", "w")
        store.persist("c")
        with pytest.raises(PersistError, match=f"{item.location.file}.* w .*checksum"):
            store.wait_persisted("c", timeout=120)
        assert store.list_checkpoints() == ["c"]  # still held in memory
    keys = _keys(server, url)  # the checkpoint's other files are uploaded, but not this one, nor published
    assert "c/" + remote_name(item.location.file) not in keys
    assert f"c/{COMMITTED}" not in keys and f"c/{STOCK_METADATA}" not in keys
    assert server.filesystem().list_multipart_uploads(url.removeprefix("s3://")) == []


def _flip_a_byte_near_the_end_of(store: MemStore, cid: str, fqn: str) -> ManifestItem:
    """Corrupt item ``fqn`` of checkpoint ``cid`` in memory (a bit of its 100th byte from the end); the
    item."""
    local = store.layout.checkpoint_dir(cid)
    item = next(it for it in Manifest.read(local / MANIFEST).items if it.fqn == fqn)
    at = item.location.offset + item.location.length - 100
    with open(local / item.location.file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    return item


def test_an_id_published_by_another_save_is_refused_and_left_intact(shm_dir, s3_bucket, fresh_root):
    server, url = s3_bucket
    first, second = _state(1), _state(2)
    with _store(shm_dir, url, server, persist_every=1, keep_in_memory=3) as store:
        save(store, first, "final")
        store.wait_persisted("final", timeout=120)
        store.delete("final")
        save(store, second, "final")  # same id, other data: overwriting would mix two checkpoints
        with pytest.raises(PersistError, match="already holds another checkpoint"):
            store.wait_persisted("final", timeout=120)
        assert store.list_checkpoints() == ["final"]  # kept (held) in memory
    with _store(fresh_root, url, server) as fresh:
        assert_tree_equal(first, load(fresh, blank_like(first), "final"))


def test_a_checkpoint_deleted_and_saved_again_during_its_upload_is_persisted_as_the_new_save(
    shm_dir, s3_bucket, fresh_root
):
    """The upload of "c" waits for a frozen server; meanwhile "c" is deleted and saved again with other
    values (with the same sequence number: it was the newest) and the new save is persisted. Once the
    server answers, the first save's upload round neither publishes in the new save's place nor marks it
    persisted or failed: the new save is published, and loads with its values. (Before, the round went
    on with the new save's files under the first save's commit record, published that record and
    marked the new save persisted, which the bucket did not hold.)"""
    server, url = s3_bucket
    first, second = _state(1, mib=2), _state(2, mib=2)
    with _store(shm_dir, url, server) as store:
        save(store, first, "c")
        server.pause()
        try:
            store.persist("c")
            time.sleep(1.0)  # the persister is waiting for the server
            store.delete("c")
            save(store, second, "c")
            store.persist("c")
        finally:
            server.resume()
        store.wait_persisted("c", timeout=120)
        saved = catalog.read_commit(store.layout, "c")
    assert remote_commit(PersistTarget(url, server.storage_options()), "c") == saved
    with _store(fresh_root, url, server) as fresh:
        assert_tree_equal(second, load(fresh, blank_like(second), "c"))


_CRASHING_SAVER = """
import json, os, sys, time
import torch
sys.path.insert(0, {repo!r})
from dcp_memstore import MemStore
from tests.dcp.dcp_state import save
from tests.persist.test_persist_s3 import _state
store = MemStore(root={root!r}, job_id="job", io_threads=1, persist_to={url!r},
                 storage_options=json.loads(os.environ["OPTS"]), persist_every=1, persist_on_close=False)
save(store, _state(5, mib={mib}), "c")
print("SAVED", flush=True)
store.wait_persisted("c", timeout=120)
print("NOT-KILLED", flush=True)
"""


def _run_killed_saver(shm_dir, server, url: str, point: str, mib: int) -> None:
    """Save a checkpoint of ``mib`` MiB in a new process that persists it (one file at a time, the shard
    file first) and is SIGKILLed at its first pass of crash point ``point`` (rank 0)."""
    env = dict(os.environ, OPTS=json.dumps(server.storage_options()), DCP_MEMSTORE_CRASH_AT=f"{point}:0:1")
    code = textwrap.dedent(_CRASHING_SAVER.format(repo=str(REPO), root=str(shm_dir), url=url, mib=mib))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == -signal.SIGKILL, res.stdout + res.stderr[-3000:]
    assert "SAVED" in res.stdout and "NOT-KILLED" not in res.stdout


@pytest.mark.parametrize("point", ["persist-upload", "persist-publish"])
def test_kill_during_upload_or_publication_never_lists_a_partial_checkpoint(
    shm_dir, s3_bucket, point, fresh_root
):
    server, url = s3_bucket
    _run_killed_saver(shm_dir, server, url, point, mib=2)
    keys = _keys(server, url)
    assert f"c/{COMMITTED}" not in keys
    assert ("c/" + STOCK_METADATA in keys) == (point == "persist-publish")
    other = _store(Path(str(shm_dir) + "-other"), url, server)
    try:
        assert other.latest_checkpoint() is None  # a partial upload is never listed
        # The job restarts: the owed upload resumes and completes.
        with _store(shm_dir, url, server) as store:
            assert store.status("c").persist in ("queued", "uploading", "persisted")
            store.wait_persisted("c", timeout=120)
            assert store.latest_checkpoint() == "c"
        # a process that listed the partial upload (an evaluation job polling) sees it published: it does
        # not keep the listing of the checkpoint's directory from then
        assert other.latest_checkpoint() == "c"
    finally:
        other.close()
        subprocess.run(["rm", "-rf", str(other.layout.root)], check=True)
    with _store(fresh_root, url, server) as fresh:
        assert_tree_equal(_state(5, mib=2), load(fresh, blank_like(_state(5, mib=2)), "c"))


def test_persist_looks_at_a_frozen_server_for_a_few_seconds_only(shm_dir, s3_bucket):
    """``persist`` runs on the training thread. Asked again for a persisted checkpoint (is the copy still
    there?) or for one not in memory (is it persisted?), it waited for s3fs's timeouts and retries of a
    server that does not answer (a minute here, more with botocore's defaults)."""
    server, url = s3_bucket
    with _store(shm_dir, url, server) as store:
        save(store, _state(1), "c")
        store.persist("c")
        store.wait_persisted("c", timeout=60)
        server.pause()
        try:
            start = time.monotonic()
            store.persist("c")  # the target does not say it lost the copy: taken to hold it
            assert time.monotonic() - start < PERSIST_LOOK_S + 3
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="'other' is not in this node's memory, and s3://"):
                store.persist("other")
            assert time.monotonic() - start < PERSIST_LOOK_S + 3
        finally:
            server.resume()
        assert store.status("c").persisted


def test_a_restart_aborts_the_multipart_upload_of_a_process_killed_mid_file(shm_dir, s3_bucket):
    """The persister is SIGKILLed while uploading a 40 MiB file: two 16 MiB parts are in the bucket, in a
    multipart upload nothing completes or aborts (its parts are billed until a lifecycle rule removes
    them). The restarted job uploads the file again under a new upload, and aborts the killed one: no
    multipart upload is left open. (Before, the killed upload stayed open for good.)"""
    server, url = s3_bucket
    bucket, fs = url.removeprefix("s3://"), server.filesystem()
    _run_killed_saver(shm_dir, server, url, "persist-write", mib=40)
    (killed,) = fs.list_multipart_uploads(bucket)
    assert killed["Key"] == "c/__0_0.distcp", killed
    with _store(shm_dir, url, server) as store:
        store.wait_persisted("c", timeout=120)
    assert fs.list_multipart_uploads(bucket) == []


_UPLOADER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from dcp_memstore import MemStore
from tests.dcp.dcp_state import save
from tests.persist.test_persist_s3 import _state
store = MemStore(root={root!r}, job_id="job", io_threads=1, persist_to={url!r},
                 storage_options=json.loads(os.environ["OPTS"]), persist_every=1, persist_on_close=False)
save(store, _state(5, mib=40), "c")
time.sleep(600)  # uploads until killed
"""


def test_a_checkpoint_deleted_while_another_process_uploads_it_leaves_nothing_in_the_bucket(
    shm_dir, s3_bucket
):
    """Another process of the node is in the middle of uploading "c" (40 MiB) and waits for a frozen
    server when this process deletes "c" from memory. Once the server answers, that upload lands its
    file; only then is what the upload left removed, that file included: the bucket holds nothing of
    "c". (Before, it stayed for good, never listed; a removal that did not wait for the upload under
    way would leave the file that landed after it.)"""
    server, url = s3_bucket
    bucket, fs = url.removeprefix("s3://"), server.filesystem()
    env = dict(os.environ, OPTS=json.dumps(server.storage_options()))
    env.pop("DCP_MEMSTORE_CRASH_AT", None)
    code = textwrap.dedent(_UPLOADER.format(repo=str(REPO), root=str(shm_dir), url=url))
    uploader = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        _wait_for(lambda: fs.list_multipart_uploads(bucket) != [], 120, "the upload to start")
        server.pause()
        try:
            store = _store(shm_dir, url, server)  # its check of the target waits for the server in vain
            store.delete("c")
            time.sleep(1.0)  # the removal must wait for the upload under way
        finally:
            server.resume()
        with store:

            def nothing_left() -> bool:  # the upload ended (no multipart upload open), and nothing stays
                return fs.list_multipart_uploads(bucket) == [] and _keys(server, url) == []

            _wait_for(nothing_left, 60, "the end of the upload and the removal of what it left")
            time.sleep(1.0)
            assert nothing_left(), _keys(server, url)
    finally:
        uploader.kill()
        uploader.wait()


def test_a_prefix_with_glob_characters_lists_its_checkpoints(shm_dir, s3_bucket, fresh_root):
    """Checkpoints persisted under a prefix with a glob character in it are listed by a fresh node."""
    server, url = s3_bucket
    prefix, sd = f"{url}/run[1]", _state(6)
    with _store(shm_dir, prefix, server, persist_every=1) as store:
        save(store, sd, "c")
        store.wait_persisted("c", timeout=120)
    with _store(fresh_root, prefix, server) as fresh:
        assert fresh.latest_checkpoint() == "c"
        assert_tree_equal(sd, load(fresh, blank_like(sd), "c"))


def test_removing_a_failed_upload_under_a_prefix_with_glob_characters_removes_only_its_files(
    shm_dir, s3_bucket, fresh_root
):
    """A checkpoint whose upload under ``run[1]`` failed for good is deleted from memory, so the persister
    removes what the upload left there. s3fs's ``rm`` takes its path as a pattern, and that removal took
    the checkpoint another run had published under ``run1`` with it; now only ``run[1]/c`` goes."""
    server, url = s3_bucket
    sd = _state(2)
    with _store(fresh_root, f"{url}/run1", server) as other:
        save(other, sd, "c")
        other.persist("c")
        other.wait_persisted("c", timeout=120)
    published = _keys(server, url)
    with _store(shm_dir, f"{url}/run[1]", server) as store:
        save(store, _state(3), "c")
        _flip_a_byte_near_the_end_of(store, "c", "w")
        store.persist("c")
        with pytest.raises(PersistError):
            store.wait_persisted("c", timeout=120)
        assert any(k.startswith("run[1]/c/") for k in _keys(server, url))  # what the failed upload left
        store.delete("c")
        _wait_for(lambda: _keys(server, url) == published, 60, "the failed upload's files removed")
    with _store(shm_dir, f"{url}/run1", server) as fresh:
        assert_tree_equal(sd, load(fresh, blank_like(sd), "c"))


def test_a_wait_and_close_keep_their_timeout_while_the_server_does_not_answer(shm_dir, s3_bucket):
    """A frozen server (SIGSTOP: connections accepted, never answered) makes s3fs wait out its timeouts
    and retries: minutes. ``wait_persisted(timeout=2)`` and ``close(timeout=2)`` look there for the
    published copy, and give up on that look at their deadline (before: about 310 s each)."""
    server, url = s3_bucket
    store = _store(shm_dir, url, server, persist_on_close=True)
    try:
        save(store, _state(1), "a")
        store.persist("a")
        store.wait_persisted("a", timeout=120)
        server.pause()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"cannot read .*TimeoutError: no answer within"):
            store.wait_persisted("a", timeout=2)
        waited = time.monotonic() - started
        started = time.monotonic()
        store.close(timeout=2)
        closed = time.monotonic() - started
    finally:
        server.resume()
        store.close()
    assert waited < 2 + MIN_ANSWER_S + 3, waited
    assert closed < 2 + 2 * MIN_ANSWER_S + 3, closed


def test_a_load_from_a_persisted_copy_missing_an_object_names_its_url(shm_dir, s3_bucket, fresh_root):
    """An object of a persisted checkpoint is deleted from the bucket after publication; a node without the
    checkpoint in memory loads it from there: the error names the object's URL (``s3://...``) and says it
    is gone. (Before: the bare s3fs FileNotFoundError, naming ``bucket/key`` without the scheme.)"""
    server, url = s3_bucket
    sd = _state(1)
    with _store(shm_dir, url, server, persist_every=1) as store:
        save(store, sd, "c")
        store.wait_persisted("c", timeout=120)
    server.filesystem().rm_file(f"{url}/c/__0_0.distcp")
    with _store(fresh_root, url, server) as fresh:
        assert fresh.latest_checkpoint() == "c"  # its commit marker is there
        with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
            load(fresh, blank_like(sd), "c")
    assert f"{url}/c/__0_0.distcp is gone from the persisted copy of checkpoint 'c'" in str(ei.value)
