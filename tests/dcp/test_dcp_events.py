"""Structured events of saves and uploads: each phase reports its checkpoint, bytes and time to the
store's ``on_event`` callback and to the ``dcp_memstore.events`` logger; reporting never fails a save."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import torch
from dcp_state import assert_tree_equal, async_save, load_fresh, save, snapshot

from dcp_memstore import Event, MemStore, PersistError
from dcp_memstore.store import catalog


def _state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1000, generator=g).half(), "step": i}


TENSOR_BYTES = 256 * 1024 * 4 + 1000 * 2


def _events(shm_dir: Path, **kw) -> tuple[MemStore, list[Event]]:
    seen: list[Event] = []
    return MemStore(root=shm_dir, job_id="job", io_threads=2, on_event=seen.append, **kw), seen


def test_a_save_reports_its_write_and_commit_with_the_bytes_written(shm_dir, caplog):
    store, seen = _events(shm_dir)
    with store, caplog.at_level(logging.INFO, logger="dcp_memstore.events"):
        save(store, _state(1), "step-1")
        assert [e.phase for e in seen] == ["write", "commit"]
        write, commit = seen
        assert {(e.checkpoint_id, e.job_id, e.rank, e.ok) for e in seen} == {("step-1", "job", 0, True)}
        assert write.nbytes > TENSOR_BYTES  # the tensors and the pickled step
        assert commit.nbytes == catalog.read_commit(store.layout, "step-1").nbytes
        assert write.seconds > 0 and commit.seconds > 0 and write.gb_per_s > 0
        logged = [r.dcp_memstore_event for r in caplog.records if hasattr(r, "dcp_memstore_event")]
        assert logged == seen
        assert "write 'step-1' rank 0:" in caplog.text and " GB/s)" in caplog.text


def test_async_save_reports_the_staging_training_waits_for(shm_dir):
    store, seen = _events(shm_dir)
    with store:
        async_save(store, _state(2), "step-2").result()
        assert [e.phase for e in seen] == ["stage", "write", "commit"]
        assert seen[0].checkpoint_id == "step-2" and seen[0].nbytes == TENSOR_BYTES


def test_a_callback_that_raises_fails_no_save(shm_dir, caplog):
    def broken(event: Event) -> None:
        raise RuntimeError("metrics backend down")

    sd = _state(3)
    expected = snapshot(sd)
    with MemStore(root=shm_dir, job_id="job", on_event=broken) as store:
        save(store, sd, "step-3")
        assert_tree_equal(expected, load_fresh(store, sd, "step-3"))
    assert "on_event callback" in caplog.text and "metrics backend down" in caplog.text


def test_a_callback_that_exits_ends_no_background_thread(shm_dir, tmp_path):
    """sys.exit() in a callback (a job that gives up on a failure event) raises SystemExit in the thread
    that reports: the persister's. Uploads must go on (before, the thread died without a word and every
    later upload stalled, its status 'queued')."""

    def exits(event: Event) -> None:
        sys.exit(1)

    with MemStore(root=shm_dir, job_id="job", on_event=exits, persist_to=str(tmp_path / "t")) as store:
        for cid in ("a", "b"):
            save(store, _state(1), cid)
            store.persist(cid)
            assert store.wait_persisted(cid, timeout=30).persisted


def test_a_closed_store_calls_its_callback_no_more(shm_dir):
    store, seen = _events(shm_dir)
    store.close()
    with MemStore(root=shm_dir, job_id="job") as other:
        save(other, _state(4), "step-4")
    assert seen == []


def test_an_on_event_that_cannot_be_called_is_refused_before_anything_is_made(shm_dir):
    root = shm_dir / "never-made"
    with pytest.raises(TypeError, match="on_event must be a callable taking one Event, got list"):
        MemStore(root=root, job_id="job", on_event=[])
    assert not root.exists()


def test_uploads_report_failures_then_what_is_still_owed(shm_dir, tmp_path):
    target = tmp_path / "bucket"
    store, seen = _events(shm_dir, persist_to=str(target), persist_on_close=False)
    with store:
        target.rmdir()
        target.write_bytes(b"")  # every upload fails for good (NotADirectoryError)
        save(store, _state(5), "a")
        save(store, _state(6), "b")
        for cid in ("a", "b"):
            store.persist(cid)
            with pytest.raises(PersistError):
                store.wait_persisted(cid, timeout=30)
        failed = [e for e in seen if e.phase == "persist"]
        assert {e.checkpoint_id for e in failed} == {"a", "b"}
        assert all(not e.ok and e.retry_s is None and e.error for e in failed)
        assert all(str(target) in e.target for e in failed)

        target.unlink()  # fixed; only "a" is asked for again, "b" stays owed
        target.mkdir()
        seen.clear()
        store.persist("a")
        store.wait_persisted("a", timeout=60)
        local = sum(p.stat().st_size for p in store.layout.checkpoint_dir("a").glob("__*"))
        upload = [e for e in seen if e.phase == "upload"]
        persist = [e for e in seen if e.phase == "persist"]
        assert [e.checkpoint_id for e in upload] == ["a"] and upload[0].nbytes == local
        assert [(e.checkpoint_id, e.ok, e.owed) for e in persist] == [("a", True, ("b",))]
        assert persist[0].nbytes == catalog.read_commit(store.layout, "a").nbytes
        assert persist[0].target.endswith("/a") and persist[0].seconds > 0


def test_a_slow_callback_has_the_persist_event_before_wait_persisted_returns(shm_dir, tmp_path):
    """The ``persist`` event, success or failure, is delivered before the state that ends
    ``wait_persisted`` is set: a metrics callback slower than the wait still sees it first."""
    seen: list[Event] = []

    def slow(event: Event) -> None:
        if event.phase == "persist":
            time.sleep(0.5)  # a slow metrics backend
        seen.append(event)

    target = tmp_path / "bucket"
    with MemStore(root=shm_dir, job_id="job", on_event=slow, persist_to=str(target)) as store:
        save(store, _state(7), "ok")
        store.persist("ok")
        store.wait_persisted("ok", timeout=60)
        assert [(e.checkpoint_id, e.ok) for e in seen if e.phase == "persist"] == [("ok", True)]

        target.rename(tmp_path / "moved")
        target.write_bytes(b"")  # uploads fail for good (NotADirectoryError)
        save(store, _state(8), "bad")
        store.persist("bad")
        with pytest.raises(PersistError):
            store.wait_persisted("bad", timeout=30)
        persisted = [(e.checkpoint_id, e.ok) for e in seen if e.phase == "persist"]
        assert persisted == [("ok", True), ("bad", False)]
