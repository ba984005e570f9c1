"""The commit protocol on disk: begin/commit visibility, seq order, eviction, retention holds,
clearing dead processes' leftovers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time

import msgpack
import psutil
import pytest

from dcp_memstore.store import catalog, liveness
from dcp_memstore.store.layout import (
    COMMITTED,
    INPROGRESS,
    SHARD_SUFFIX,
    reserve_name,
    shard_name,
)
from dcp_memstore.store.records import read_record, write_record
from tests.liveness_tokens import dead_token


def _committed_ids(layout):
    return [r.checkpoint_id for r in catalog.committed(layout)]


def _save(layout, cid, payload=b"x" * 8192):
    """A complete checkpoint as a save leaves it: begin, one shard file, commit."""
    d = catalog.begin(layout, cid)
    (d / shard_name(0, 0)).write_bytes(payload)
    catalog.commit(layout, cid, len(payload))
    return d


def _owner_of(proc: subprocess.Popen) -> dict:
    return {
        "pid": proc.pid,
        "create_time": psutil.Process(proc.pid).create_time(),
        "host": socket.gethostname(),
        "started": time.time(),
    }


@pytest.fixture
def dead_owner():
    """An owner record of a process that really ran and is now dead (reaped)."""
    p = subprocess.Popen(["sleep", "60"])
    owner = _owner_of(p)
    p.kill()
    p.wait()
    assert not psutil.pid_exists(p.pid) or psutil.Process(p.pid).create_time() != owner["create_time"]
    return owner


@pytest.fixture
def live_owner():
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield _owner_of(p)
    finally:
        p.kill()
        p.wait()


def _uncommitted(layout, name, owner):
    d = layout.checkpoints_dir / name
    d.mkdir()
    write_record(d / INPROGRESS, owner)
    (d / shard_name(0, 0)).write_bytes(b"y" * 4096)
    return d


def test_begun_checkpoint_is_invisible_until_committed(layout):
    d = catalog.begin(layout, "step-1")
    assert d == layout.checkpoint_dir("step-1")
    assert (d / INPROGRESS).exists()
    assert catalog.committed(layout) == []
    assert catalog.read_commit(layout, "step-1") is None
    rec = catalog.commit(layout, "step-1", 123)
    assert (rec.checkpoint_id, rec.seq, rec.nbytes) == ("step-1", 1, 123)
    assert not (d / INPROGRESS).exists()
    assert catalog.read_commit(layout, "step-1") == rec
    assert catalog.committed(layout) == [rec]


def test_begin_of_an_existing_checkpoint_fails_and_leaves_nothing(layout):
    _save(layout, "step-1")
    before = sorted(os.listdir(layout.checkpoints_dir))
    with pytest.raises(OSError):
        catalog.begin(layout, "step-1")
    assert sorted(os.listdir(layout.checkpoints_dir)) == before
    assert catalog.read_commit(layout, "step-1").seq == 1


def test_committed_is_ordered_by_commit_seq_not_name_or_begin_order(layout):
    for cid in ("zeta", "alpha", "mid"):
        catalog.begin(layout, cid)
    for cid in ("mid", "zeta", "alpha"):
        catalog.commit(layout, cid, 1)
    recs = catalog.committed(layout)
    assert [r.checkpoint_id for r in recs] == ["mid", "zeta", "alpha"]
    assert [r.seq for r in recs] == [1, 2, 3]


def test_seq_keeps_growing_after_eviction(layout):
    for i in range(3):
        _save(layout, f"s{i}")
    catalog.evict(layout, keep=1)
    rec = catalog.commit(layout, catalog.begin(layout, "s3").name, 1)
    assert rec.seq == 4
    assert _committed_ids(layout) == ["s2", "s3"]


def test_evict_keeps_newest_n_and_pools_their_shard_files(layout):
    inodes = {}
    for i in range(5):
        d = _save(layout, f"s{i}")
        (d / "__0_objects.bin").write_bytes(b"objects")
        inodes[f"s{i}"] = os.stat(d / shard_name(0, 0)).st_ino
    victims = catalog.evict(layout, keep=2)
    assert victims == ["s0", "s1", "s2"]
    assert _committed_ids(layout) == ["s3", "s4"]
    assert sorted(os.listdir(layout.checkpoints_dir)) == ["s3", "s4"]
    assert os.listdir(layout.trash_dir) == []
    pooled = {os.stat(p).st_ino for p in layout.pool_dir(0).iterdir()}
    assert pooled == {inodes[v] for v in victims}  # shard files kept for reuse, objects file deleted
    assert catalog.evict(layout, keep=2) == []


def test_clear_abandoned_removes_dead_owners_leftovers_and_keeps_live_ones(layout, dead_owner, live_owner):
    _save(layout, "done")
    dead = _uncommitted(layout, "dead-save", dead_owner)
    dead_ino = os.stat(dead / shard_name(0, 0)).st_ino
    live = _uncommitted(layout, "live-save", live_owner)
    dead_new = layout.checkpoints_dir / ".new-0123"
    dead_new.mkdir()
    write_record(dead_new / INPROGRESS, dead_owner)
    live_new = layout.checkpoints_dir / ".new-4567"
    live_new.mkdir()
    write_record(live_new / INPROGRESS, live_owner)
    no_marker = layout.checkpoints_dir / "stray"
    no_marker.mkdir()
    (layout.trash_dir / "old.abc").mkdir()

    cleared = catalog.clear_abandoned(layout)

    assert sorted(cleared) == ["dead-save", "stray"]
    assert sorted(os.listdir(layout.checkpoints_dir)) == [".new-4567", "done", "live-save"]
    assert (live / INPROGRESS).exists() and (live / shard_name(0, 0)).exists()
    assert os.listdir(layout.trash_dir) == []
    assert [os.stat(p).st_ino for p in layout.pool_dir(0).iterdir()] == [dead_ino]
    assert _committed_ids(layout) == ["done"]


def test_clear_abandoned_with_before_clears_own_stale_saves_only(layout, live_owner):
    mine = catalog.begin(layout, "mine-old")
    started = read_record(mine / INPROGRESS)["started"]
    other = _uncommitted(layout, "other-live", live_owner)
    assert catalog.clear_abandoned(layout) == []  # this process is alive: nothing to clear
    assert catalog.clear_abandoned(layout, before=started) == []  # not started before that instant
    assert catalog.clear_abandoned(layout, before=started + 1.0) == ["mine-old"]
    assert not mine.exists()
    assert other.exists()


def test_clear_abandoned_recognises_a_save_whose_process_died(layout):
    """A forked process begins a checkpoint and dies without committing: the next clear removes it."""
    pid = os.fork()
    if pid == 0:  # child: a save that dies mid-way
        code = 1
        try:
            d = catalog.begin(layout, "crashed")
            (d / shard_name(0, 0)).write_bytes(b"z" * 4096)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read_record(layout.checkpoint_dir("crashed") / INPROGRESS)["pid"] == pid
    assert catalog.clear_abandoned(layout) == ["crashed"]
    assert not layout.checkpoint_dir("crashed").exists()
    assert len(list(layout.pool_dir(0).iterdir())) == 1


def test_discard_makes_the_checkpoint_invisible_and_is_idempotent(layout):
    d = _save(layout, "s0")
    catalog.discard(layout, d)
    assert not d.exists()
    assert _committed_ids(layout) == []
    catalog.discard(layout, d)  # already gone: nothing to do, no error


def test_eviction_and_discard_still_work_when_the_trash_directory_was_removed(layout):
    for i in range(3):
        _save(layout, f"s{i}")
    shutil.rmtree(layout.trash_dir)  # e.g. the job directory removed under a live process
    assert catalog.evict(layout, keep=2) == ["s0"]
    shutil.rmtree(layout.trash_dir)
    catalog.discard(layout, layout.checkpoint_dir("s1"))
    assert _committed_ids(layout) == ["s2"]
    assert not layout.checkpoint_dir("s0").exists() and not layout.checkpoint_dir("s1").exists()
    assert len(list(layout.pool_dir(0).glob(f"*{SHARD_SUFFIX}"))) == 2  # their files serve later saves


def test_commit_marker_is_a_record_with_seq_and_size(layout):
    d = _save(layout, "s0", payload=b"p" * 100)
    r = read_record(d / COMMITTED)
    assert r["seq"] == 1 and r["nbytes"] == 100 and r["committed_at"] <= time.time()


def test_a_reservation_area_without_its_owner_record_yet_is_kept_while_its_process_lives(layout):
    """The area is made before its owner record is written: the lock token in its name keeps it meanwhile."""
    pool = layout.pool_dir(0)
    pool.mkdir(parents=True)
    live = pool / reserve_name(0, liveness.own_token(layout), "aa11")
    dead = pool / reserve_name(0, dead_token(layout), "bb22")
    for area in (live, dead):
        area.mkdir()
        (area / shard_name(0, 0)).write_bytes(b"r" * 4096)
    catalog.clear_abandoned(layout)
    assert live.exists()
    assert not dead.exists()
    assert len(list(pool.glob(f"*{SHARD_SUFFIX}"))) == 1  # the dead one's file went into the pool


@pytest.mark.parametrize(
    "marker",
    [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"seq": 1})],
    ids=["empty", "not-msgpack", "not-a-map", "field-missing"],
)
def test_a_corrupt_commit_marker_is_skipped_with_a_warning_and_never_evicted(layout, caplog, marker):
    old = _save(layout, "old")
    for cid in ("a", "b", "c"):
        _save(layout, cid)
    (old / COMMITTED).write_bytes(marker)
    with caplog.at_level("WARNING", logger="dcp_memstore.store.catalog"):
        assert _committed_ids(layout) == ["a", "b", "c"]
        assert catalog.next_seq(layout) == 5
        assert catalog.evict(layout, keep=1) == ["a", "b"]
        assert catalog.clear_abandoned(layout) == []
    assert old.is_dir() and (old / shard_name(0, 0)).read_bytes() == b"x" * 8192
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]  # once, not at every listing
    assert f"skipping checkpoint directory {old}: {old / COMMITTED} is not a" in warning.getMessage()
    assert "store.delete('old') or `dcp-memstore delete old`" in warning.getMessage()
    with pytest.raises(ValueError, match="Checkpoint 'old' has a corrupt commit marker") as ei:
        catalog.read_commit(layout, "old")
    assert str(old / COMMITTED) in str(ei.value)


def test_a_process_hold_keeps_a_checkpoint_until_released(layout):
    _save(layout, "s0")
    _save(layout, "s1")
    name = catalog.process_hold(layout, "s0", "load")
    assert name is not None and name.startswith(f"load-p{os.getpid()}-")
    assert catalog.holds(layout, "s0") == [name]
    assert catalog.evict(layout, keep=1) == []
    catalog.release(layout, "s0", name)
    assert catalog.evict(layout, keep=1) == ["s0"]


def test_a_process_hold_of_a_checkpoint_that_is_not_committed_holds_nothing(layout):
    assert catalog.process_hold(layout, "never", "load") is None
    d = catalog.begin(layout, "saving")  # e.g. a save of an evicted checkpoint's id, not committed yet
    assert catalog.process_hold(layout, "saving", "load") is None
    assert catalog.holds(layout, "saving") == []
    assert d.exists()


def test_holds_of_dead_processes_are_dropped_and_those_of_live_ones_kept(layout, dead_owner, live_owner):
    """A killed reader must not pin its checkpoint for good: eviction (and a store's start) drop its
    hold; another running process's hold stands, as do holds that belong to no process."""
    for cid in ("dead", "live", "persist", "newest"):
        _save(layout, cid)
    catalog.hold(layout, "dead", f"load-p{dead_owner['pid']}-0a1b2c3d", dead_owner)
    catalog.hold(layout, "live", f"load-p{live_owner['pid']}-0a1b2c3d", live_owner)
    catalog.hold(layout, "persist", "persist", {"reason": "on demand"})
    assert catalog.evict(layout, keep=1) == ["dead"]
    assert _committed_ids(layout) == ["live", "persist", "newest"]

    _save(layout, "dead-again")
    catalog.hold(layout, "dead-again", f"load-p{dead_owner['pid']}-4e5f6a7b", dead_owner)
    catalog.clear_abandoned(layout)
    assert not list((layout.checkpoint_dir("dead-again") / "holds").iterdir())


def test_a_hold_placed_while_an_eviction_runs_is_never_missed(layout, monkeypatch):
    """Eviction looks at the holds, then removes the checkpoint: a hold placed in between would hold a
    checkpoint that is gone. process_hold either holds it before the eviction looks, or finds it gone."""
    _save(layout, "s0")
    _save(layout, "s1")
    placed: list[str | None] = []
    holder = threading.Thread(target=lambda: placed.append(catalog.process_hold(layout, "s0", "load")))
    holds = catalog.holds

    def holds_while_a_load_starts(lay, cid):
        found = holds(lay, cid)
        if holder.ident is None:  # not started yet
            holder.start()
            holder.join(timeout=1.0)  # it waits for the eviction to end; without the lock it holds now
        return found

    monkeypatch.setattr(catalog, "holds", holds_while_a_load_starts)
    victims = catalog.evict(layout, keep=1)
    holder.join()
    assert (victims, placed) == (["s0"], [None])
    assert _committed_ids(layout) == ["s1"]


def test_a_new_save_does_not_join_a_copy_prepared_for_an_earlier_save_that_never_committed(layout):
    # another node's coordinator was killed between prepare and commit: this node kept its prepared copy
    old = catalog.begin(layout, "step-2")
    (old / "__0_0.shard").write_bytes(b"old save")
    write_record(old / "PREPARED", {"committed_at": 1.0, "nbytes": 8})
    d = catalog.join(layout, "step-2")
    assert d == old and d.is_dir()
    assert sorted(p.name for p in d.iterdir()) == ["INPROGRESS"]  # begun anew: old files, markers gone


def test_a_prepared_copy_whose_commit_never_came_goes_once_keep_newer_checkpoints_are_committed(layout):
    """Step 2 was prepared on this node after step 1 committed; its commit never came. It stays while
    it could still be among the keep_in_memory=2 newest (step 3 alone was committed since), and is
    discarded (its files to the pool) after step 4's commit. Step 5, prepared after those commits (its
    commit may be on the way), stays."""
    _save(layout, "step-1")
    prepared = catalog.join(layout, "step-2")
    (prepared / shard_name(0, 0)).write_bytes(b"x" * 8192)
    write_record(prepared / "PREPARED", {"committed_at": 2.0, "nbytes": 8192, "next_seq": 2})
    _save(layout, "step-3")
    catalog.drop_superseded(layout, keep=2)
    assert prepared.is_dir()
    _save(layout, "step-4")
    in_flight = catalog.join(layout, "step-5")
    write_record(
        in_flight / "PREPARED", {"committed_at": 5.0, "nbytes": 8, "next_seq": catalog.next_seq(layout)}
    )
    catalog.drop_superseded(layout, keep=2)
    assert not prepared.exists() and in_flight.is_dir()
    assert list(catalog.prepared(layout)) == ["step-5"]
    assert (layout.pools_dir / "rank0").is_dir() and any((layout.pools_dir / "rank0").iterdir())


def test_joining_a_checkpoint_begun_for_this_save_keeps_what_other_ranks_wrote(layout):
    d = catalog.begin(layout, "step-2")
    (d / "__0_0.shard").write_bytes(b"rank 0")
    assert catalog.join(layout, "step-2") == d
    assert (d / "__0_0.shard").read_bytes() == b"rank 0"
