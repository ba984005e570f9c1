"""Owner liveness by a lock each process holds for its life: a killed process is seen dead at once, a
forked child answers for itself only, and a lock file removed under a live process is taken again."""

from __future__ import annotations

import os
import shutil
import signal

from dcp_memstore.store import catalog, liveness
from dcp_memstore.store.layout import INPROGRESS
from dcp_memstore.store.records import read_record


def _in_child(fn, then_wait: bool) -> int:
    """Fork a child that runs ``fn`` then either waits for SIGKILL or exits; returns its pid once ``fn``
    ran."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            fn()
            os.write(w, b"x")
            code = 0
            if then_wait:
                signal.pause()
        finally:
            os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    return pid


def test_a_killed_process_is_dead_and_a_running_one_alive(layout):
    pid = _in_child(lambda: catalog.begin(layout, "child"), then_wait=True)
    token = read_record(layout.checkpoint_dir("child") / INPROGRESS)["lock"]
    assert liveness.alive(layout, token)
    assert catalog.clear_abandoned(layout) == []
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert not liveness.alive(layout, token)
    assert not (layout.procs_dir / f"{token}.lock").exists()  # judged dead once, then gone
    assert not liveness.alive(layout, token)


def test_a_forked_child_does_not_answer_for_its_parent(layout):
    """The child inherits the parent's lock descriptor; its records must die with it, not with the
    parent, and its exit must leave the parent's lock held."""
    mine = liveness.own_token(layout)
    pid = _in_child(lambda: catalog.begin(layout, "child"), then_wait=False)
    os.waitpid(pid, 0)
    child = read_record(layout.checkpoint_dir("child") / INPROGRESS)["lock"]
    assert child != mine
    assert catalog.clear_abandoned(layout) == ["child"]
    assert liveness.alive(layout, mine)


def test_a_lock_file_removed_under_a_live_process_is_taken_again(layout):
    """``rm -rf`` of the job directory under a running job: its later saves are still its own."""
    old = liveness.own_token(layout)
    shutil.rmtree(layout.job_dir)
    layout.ensure()
    catalog.begin(layout, "after")
    new = read_record(layout.checkpoint_dir("after") / INPROGRESS)["lock"]
    assert new != old and liveness.alive(layout, new)
    assert catalog.clear_abandoned(layout) == []


def test_sweep_removes_the_lock_files_of_exited_processes_only(layout):
    mine = liveness.own_token(layout)
    for _ in range(3):
        os.waitpid(_in_child(lambda: liveness.own_token(layout), then_wait=False), 0)
    assert len(os.listdir(layout.procs_dir)) == 4
    liveness.sweep(layout)
    assert os.listdir(layout.procs_dir) == [f"{mine}.lock"]


def test_a_record_whose_lock_is_not_a_token_is_not_taken_for_a_path(layout, tmp_path):
    """A damaged record must not make liveness open (or remove) a file outside the job's lock files."""
    outside = tmp_path / "victim.lock"
    outside.write_text("keep")
    bad = os.path.relpath(outside.with_suffix(""), layout.procs_dir)
    assert not liveness.is_token(bad)
    owner = {"lock": bad, "pid": os.getpid(), "host": "elsewhere"}
    assert catalog._owner_alive(layout, owner)  # judged as a record without a lock: another host's
    assert outside.read_text() == "keep"
