"""The dcp-memstore command: list, show and delete against a real store."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemoryStorageWriter, MemStore
from dcp_memstore.cli import main
from dcp_memstore.persist.progress import is_persist_hold
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import StoreLayout


@pytest.fixture
def root():
    d = tempfile.mkdtemp(prefix="dcpms-cli-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_show_delete(root, capsys):
    store = MemStore(root=root, job_id="j")
    for i in (1, 2):
        sd = {"w": torch.arange(10.0) * i}
        dcp.save(sd, checkpoint_id=f"step-{i}", storage_writer=MemoryStorageWriter(store), no_dist=True)

    code, out, _ = _cli(capsys, "list", "--root", root, "--job-id", "j")
    assert code == 0
    assert out.index("step-1") < out.index("step-2")

    code, out, _ = _cli(capsys, "show", "step-2", "--root", root, "--job-id", "j", "--items")
    assert code == 0 and "__0_0.shard" in out and " w " in out

    assert _cli(capsys, "delete", "step-1", "--root", root, "--job-id", "j")[0] == 0
    assert store.list_checkpoints() == ["step-2"]
    store.close()  # stops the allocation of the next save's files, which would outlive the root's removal


def test_list_says_the_memory_a_checkpoint_takes_which_tmpfs_sizing_needs(root, capsys):
    """Items are aligned, so many small ones take far more memory than their data: operations.md sizes
    the tmpfs from the memory `list` shows."""
    with MemStore(root=root, job_id="j") as store:
        sd = {f"t{i}": torch.ones(4) for i in range(3000)}  # 48 kB of data
        dcp.save(sd, checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True)
        du = subprocess.run(
            ["du", "-sB1", str(store.layout.checkpoint_dir("a"))], capture_output=True, text=True
        )
        code, out, _ = _cli(capsys, "list", "--root", root, "--job-id", "j")
    data, memory = re.search(r"seq 1 +([0-9.]+) MiB \(([0-9.]+) MiB in memory\)", out).groups()
    assert code == 0 and float(data) == 0.0
    assert float(memory) == round(int(du.stdout.split()[0]) / 2**20, 1) > 0.1


def test_output_cut_short_by_its_reader_is_no_error(root):
    """`dcp-memstore show ID --items | head -1` in a script with pipefail: the reader leaving is not an
    error of the store (no message, exit code 0)."""
    with MemStore(root=root, job_id="j") as store:
        sd = {f"t{i}": torch.ones(4) for i in range(3000)}  # more lines than a pipe buffers
        dcp.save(sd, checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True)
    command = f"{sys.executable} -m dcp_memstore.cli show a --items --root {root} --job-id j | head -1"
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr, done.stdout.startswith("checkpoint a: 3000 items")) == (0, "", True)


def test_delete_of_a_checkpoint_being_loaded_is_refused_and_changes_nothing(root, capsys):
    with MemStore(root=root, job_id="j") as store:
        sd = {"w": torch.arange(10.0)}
        dcp.save(sd, checkpoint_id="step-1", storage_writer=MemoryStorageWriter(store), no_dist=True)
        # the hold a load of this (live) process places on it while it reads (see the reader)
        hold = catalog.process_hold(store.layout, "step-1", "load")
        code, _, err = _cli(capsys, "delete", "step-1", "--root", root, "--job-id", "j")
        assert code == 2
        assert f"'step-1' in store {store.layout.job_dir} is being loaded (pid {os.getpid()} on host" in err
        assert store.list_checkpoints() == ["step-1"]
        catalog.release(store.layout, "step-1", hold)
        assert _cli(capsys, "delete", "step-1", "--root", root, "--job-id", "j")[0] == 0
        assert store.list_checkpoints() == []


def test_a_load_hold_whose_record_is_damaged_pins_nothing(root, capsys, caplog):
    """No process can be found to release such a hold: it must not keep its checkpoint from eviction, nor
    from `dcp-memstore delete` (which troubleshooting.md gives as the fix for a damaged record)."""

    def damage_a_load_hold(cid: str) -> None:
        holds = store.layout.checkpoint_dir(cid) / "holds"
        holds.mkdir(exist_ok=True)
        (holds / "load-p12345-deadbeef").write_bytes(b"junk\n")

    with MemStore(root=root, job_id="j", keep_in_memory=1) as store:
        writer = MemoryStorageWriter(store)
        dcp.save({"w": torch.ones(3)}, checkpoint_id="a", storage_writer=writer, no_dist=True)
        damage_a_load_hold("a")
        dcp.save(
            {"w": torch.ones(3)}, checkpoint_id="b", storage_writer=MemoryStorageWriter(store), no_dist=True
        )
        assert store.list_checkpoints() == ["b"]  # "a" evicted
        assert "dropping hold load-p12345-deadbeef of checkpoint 'a': its record is damaged" in caplog.text
        damage_a_load_hold("b")
        assert _cli(capsys, "delete", "b", "--root", root, "--job-id", "j")[0] == 0
        assert store.list_checkpoints() == []


def test_unknown_checkpoint_is_a_clear_error(root, capsys):
    MemStore(root=root, job_id="j").close()
    code, _, err = _cli(capsys, "show", "nope", "--root", root, "--job-id", "j")
    assert code == 2
    assert "checkpoint 'nope' not found" in err


def test_a_wrong_job_id_or_root_is_a_clear_error_that_names_the_jobs_there(root, capsys, tmp_path):
    """A mistyped or defaulted --job-id says which jobs have a store under the root (before, only that
    there was none for that job); a root without any says so. Nothing is created."""
    for job in ("run-42", "run-7"):
        MemStore(root=root, job_id=job).close()
    code, out, err = _cli(capsys, "list", "--root", root, "--job-id", "run-4")
    assert (code, out) == (2, "")
    assert err == (
        f"dcp-memstore: no dcp_memstore store for job 'run-4' under {root} (the jobs there are run-42, "
        "run-7); check --root and --job-id\n"
    )
    code, _, err = _cli(capsys, "show", "a", "--root", str(tmp_path / "none"), "--job-id", "run-42")
    assert code == 2 and "(no job has a store there)" in err
    assert not (tmp_path / "none").exists() and not Path(root, "run-4").exists()


def test_list_and_show_say_which_checkpoints_are_held(root, capsys, tmp_path):
    blocked = tmp_path / "file"
    store = MemStore(root=root, job_id="j", persist_to=str(blocked), persist_every=1, persist_on_close=False)
    blocked.rmdir()
    blocked.write_bytes(b"")  # uploads fail: the checkpoint stays owed (held)
    dcp.save({"w": torch.ones(3)}, checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True)
    store.close()
    code, out, _ = _cli(capsys, "list", "--root", root, "--job-id", "j")
    assert code == 0 and "held for: persist" in out
    code, out, _ = _cli(capsys, "show", "a", "--root", root, "--job-id", "j")
    assert code == 0 and "held in memory for: persist" in out


@contextlib.contextmanager
def _read_only_view(root: str, tmp_path: Path) -> Iterator[Path]:
    """``root`` seen through a read-only bind mount (needs root), unmounted on leaving."""
    view = tmp_path / "ro"
    view.mkdir()
    subprocess.run(["mount", "--bind", root, str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_list_and_show_change_nothing_warn_about_nothing_and_work_read_only(root, capsys, tmp_path):
    blocked = tmp_path / "file"
    store = MemStore(root=root, job_id="j", persist_to=str(blocked), persist_every=1, persist_on_close=False)
    blocked.rmdir()
    blocked.write_bytes(b"")  # uploads fail: the checkpoint stays owed to persistent storage
    dcp.save({"w": torch.ones(3)}, checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True)
    store.close()
    before = sorted(str(p) for p in Path(root).rglob("*"))
    with _read_only_view(root, tmp_path) as view, warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "owed to persistent storage, but no persist_to"
        code, out, err = _cli(capsys, "list", "--root", str(view), "--job-id", "j")
        assert (code, err) == (0, "") and "held for: persist" in out
        code, out, err = _cli(capsys, "show", "a", "--root", str(view), "--job-id", "j")
        assert (code, err) == (0, "") and "held in memory for: persist" in out
    assert sorted(str(p) for p in Path(root).rglob("*")) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_delete_on_a_read_only_mount_is_a_clear_error_that_changes_nothing(root, capsys, tmp_path):
    store = MemStore(root=root, job_id="j")
    dcp.save({"w": torch.ones(3)}, checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True)
    store.close()
    before = sorted(str(p) for p in Path(root).rglob("*"))
    with _read_only_view(root, tmp_path) as view:
        code, out, err = _cli(capsys, "delete", "a", "--root", str(view), "--job-id", "j")
    assert (code, out) == (2, "")
    assert err.startswith(f"dcp-memstore: [Errno 30] cannot delete 'a' from store {view / 'j'}: ")
    assert "Read-only file system (" in err and "deleting needs write access to the store" in err
    assert err.count("Errno") == 1
    assert sorted(str(p) for p in Path(root).rglob("*")) == before


_AS_NOBODY = """
import sys, torch, torch.distributed.checkpoint as dcp
from dcp_memstore import MemoryStorageWriter, MemStore
import os; os.setgid(65534); os.setuid(65534)  # imported first: the interpreter may live where nobody reads
with MemStore(root=sys.argv[1], job_id="j") as store:
    for cid in sys.argv[2:]:
        writer = MemoryStorageWriter(store)
        dcp.save({"w": torch.ones(3)}, checkpoint_id=cid, storage_writer=writer, no_dist=True)
    print(store.list_checkpoints())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running the job as another user needs root")
def test_a_delete_run_by_root_leaves_the_store_usable_by_the_jobs_own_user(root, capsys):
    """An operator frees memory with `sudo dcp-memstore delete`; the job, run by its own user, must still
    open its store (the command's process lock file, root's, must not stop it)."""
    os.chown(root, 65534, 65534)

    def as_job_user(*ids: str) -> str:
        cmd = [sys.executable, "-c", _AS_NOBODY, root, *ids]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert as_job_user("a", "b") == "['a', 'b']"
    assert _cli(capsys, "delete", "a", "--root", root, "--job-id", "j")[0] == 0  # as root, still running
    assert [str(p) for p in Path(root).rglob("*") if p.lstat().st_uid != 65534] == []
    assert as_job_user("c") == "['b', 'c']"


def test_delete_warns_about_nothing_and_leaves_an_owed_checkpoint_owed(root, capsys, tmp_path):
    """Deleting one checkpoint while another is owed to persistent storage says only that it deleted it
    (before, it printed the store's warning that it would evict the owed one, which it did not), and the
    owed one stays held in memory for its upload."""
    blocked = tmp_path / "file"
    store = MemStore(root=root, job_id="j", persist_to=str(blocked), persist_every=1, persist_on_close=False)
    blocked.rmdir()
    blocked.write_bytes(b"")  # uploads fail: the checkpoints stay owed to persistent storage
    for cid in ("a", "b"):
        sd = {"w": torch.ones(3)}
        dcp.save(sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True)
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code, out, err = _cli(capsys, "delete", "b", "--root", root, "--job-id", "j")
    assert (code, out, err) == (0, "deleted b\n", "")
    layout = StoreLayout(Path(root), "j")
    assert [r.checkpoint_id for r in catalog.committed(layout)] == ["a"]
    assert [is_persist_hold(h) for h in catalog.hold_names(layout, "a")] == [True]


def _tree_bytes(path: str) -> int:
    """Bytes the files under ``path`` take in memory (what du counts)."""
    return sum(p.stat().st_blocks * 512 for p in Path(path).rglob("*") if p.is_file())


def test_delete_frees_the_memory_beyond_the_files_kept_for_the_next_save(root, capsys):
    store = MemStore(root=root, job_id="j", io_threads=1)
    for i in (1, 2):
        sd = {"w": torch.full((2 << 20,), float(i))}  # 8 MiB each
        dcp.save(sd, checkpoint_id=f"step-{i}", storage_writer=MemoryStorageWriter(store), no_dist=True)
    store.close()
    before = _tree_bytes(root)
    for cid in ("step-1", "step-2"):
        assert _cli(capsys, "delete", cid, "--root", root, "--job-id", "j")[0] == 0
    # one shard file stays in the pool for the next save; the other one's memory is free
    assert before - _tree_bytes(root) >= 8 << 20
    assert len(list(Path(root, "j", "pool").rglob("*.shard"))) == 1
