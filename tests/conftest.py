"""Shared fixtures: fresh store roots on /dev/shm, a small real tmpfs mount, a clean DCP plan cache."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from torch.distributed.checkpoint.planner import SavePlanner

from dcp_memstore import MemStore
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.mapping import MAPPINGS

SHM = "/dev/shm"
SMALL_TMPFS_BYTES = 8 << 20


def _remove_contents(d: Path) -> None:
    """Delete everything below ``d``, then drop this process's cached mappings of the deleted files."""
    for entry in os.scandir(d):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    MAPPINGS.prune()


@pytest.fixture
def shm_dir():
    """A fresh, empty directory on /dev/shm (tmpfs), removed with everything in it afterwards."""
    d = Path(tempfile.mkdtemp(prefix="dcpms-test-", dir=SHM))
    yield d
    _remove_contents(d)
    d.rmdir()


@pytest.fixture
def store(shm_dir):
    """A MemStore on a fresh /dev/shm root with two io threads (so two shard files per rank)."""
    s = MemStore(root=shm_dir, job_id="job", io_threads=2)
    yield s
    s.close()


@pytest.fixture
def small_tmpfs():
    """A real 8 MiB tmpfs mounted on a fresh directory; unmounted and removed afterwards."""
    mnt = Path(tempfile.mkdtemp(prefix="dcpms-tmpfs-"))
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_TMPFS_BYTES}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a small tmpfs to exhaust (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        _remove_contents(mnt)
        gc.collect()  # free mappings only garbage still refers to, so the unmount is not busy
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)  # a mapping still alive in a tensor
        mnt.rmdir()


@pytest.fixture
def clean_plan_cache():
    """Empty DCP's process-wide save-plan cache before and after the test (it is keyed by planner class)."""

    def clear() -> None:
        for name, cache in vars(SavePlanner).items():
            if name.startswith("_cached_") and isinstance(cache, dict):
                cache.clear()

    clear()
    yield
    clear()


@pytest.fixture
def layout(shm_dir):
    """A job's store layout on a fresh tmpfs directory, its directories created."""
    lay = StoreLayout(shm_dir, "job")
    lay.ensure()
    return lay


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a disk file system (not tmpfs); the test is skipped where there is none."""
    fstype = subprocess.run(
        ["df", "--output=fstype", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    if fstype in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {fstype} here; no disk directory to try")
    return tmp_path
