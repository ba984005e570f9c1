"""Admission control on a real small tmpfs (and a ramfs): check_space, allocate_file (ENOSPC),
is_memory_backed."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import InsufficientSpaceError, MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.store.space import allocate_file, check_space, filesystem_type, free_bytes, is_memory_backed

MiB = 1 << 20


def _df_fstype(path) -> str:
    return subprocess.run(
        ["df", "--output=fstype", str(path)], capture_output=True, text=True, check=True
    ).stdout.split()[-1]


def test_dev_shm_is_memory_backed():
    assert is_memory_backed("/dev/shm")
    assert filesystem_type("/dev/shm") == _df_fstype("/dev/shm") == "tmpfs"


def test_small_tmpfs_mount_is_memory_backed(small_tmpfs):
    assert is_memory_backed(small_tmpfs)
    assert is_memory_backed(small_tmpfs / "not-yet-created")


def test_a_directory_on_disk_is_not_memory_backed(tmp_path):
    fstype = _df_fstype(tmp_path)
    if fstype in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {fstype} here; no disk directory to check")
    assert not is_memory_backed(tmp_path)
    assert filesystem_type(tmp_path) == fstype


def test_a_store_on_ramfs_saves_and_loads(ramfs):
    """ramfs reports 0 blocks free (it has no size), so every save failed for lack of space; its room is
    the memory available, as for tmpfs."""
    assert is_memory_backed(ramfs) and os.statvfs(ramfs).f_bavail == 0
    assert free_bytes(ramfs) > 64 * MiB
    sd = {"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(3)), "step": 3}
    with MemStore(root=ramfs / "store", job_id="job") as store:
        dcp.save(sd, checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True)
        dcp.async_save(
            sd, checkpoint_id="b", storage_writer=MemoryStorageWriter(store), no_dist=True
        ).result()
        for cid in ("a", "b"):
            out = {"w": torch.zeros(256, 1024), "step": 0}
            dcp.load(out, checkpoint_id=cid, storage_reader=MemoryStorageReader(store), no_dist=True)
            assert torch.equal(out["w"], sd["w"]) and out["step"] == 3


def test_free_bytes_matches_the_mount(small_tmpfs):
    free = free_bytes(small_tmpfs)
    assert 7 * MiB < free <= 8 * MiB
    fd = allocate_file(small_tmpfs / "f", 4 * MiB)
    os.close(fd)
    assert free_bytes(small_tmpfs) == free - 4 * MiB


def test_check_space_passes_when_it_fits(small_tmpfs):
    check_space(small_tmpfs, 4 * MiB)
    check_space(small_tmpfs, 12 * MiB, reusable=6 * MiB)  # reused files need no new room


def test_check_space_reports_needed_and_free_bytes(small_tmpfs):
    free = free_bytes(small_tmpfs)
    with pytest.raises(InsufficientSpaceError) as ei:
        check_space(small_tmpfs, 20 * MiB)
    e = ei.value
    assert (e.needed, e.free) == (20 * MiB, free)
    assert isinstance(e, OSError) and e.errno == 28
    msg = str(e)
    assert msg.startswith(f"not enough space in {small_tmpfs}")
    assert f"{20 * MiB} bytes needed, {free} bytes free" in msg
    assert os.listdir(small_tmpfs) == []


def test_check_space_counts_reusable_bytes_in_free(small_tmpfs):
    free = free_bytes(small_tmpfs)
    with pytest.raises(InsufficientSpaceError) as ei:
        check_space(small_tmpfs, 20 * MiB, reusable=2 * MiB)
    assert ei.value.free == free + 2 * MiB
    free_and_pool = f"{free + 2 * MiB} bytes free (including 2097152 bytes of pooled files"
    assert free_and_pool in str(ei.value)  # counted in free, not more on top of it
    assert "more bytes" not in str(ei.value)


def test_allocate_file_allocates_every_block(small_tmpfs):
    path = small_tmpfs / "f"
    fd = allocate_file(path, 3 * MiB)
    try:
        st = os.fstat(fd)
        assert st.st_size == 3 * MiB
        assert st.st_blocks * 512 >= 3 * MiB
        assert os.read(fd, 16) == b"\0" * 16
    finally:
        os.close(fd)


def test_allocate_file_beyond_the_tmpfs_raises_and_leaves_no_file(small_tmpfs):
    path = small_tmpfs / "big.shard"
    with pytest.raises(InsufficientSpaceError) as ei:
        allocate_file(path, 16 * MiB)
    assert ei.value.needed == 16 * MiB
    assert ei.value.free <= 8 * MiB
    assert "16777216 bytes needed" in str(ei.value)
    assert not path.exists()
    assert os.listdir(small_tmpfs) == []
    assert free_bytes(small_tmpfs) > 7 * MiB  # nothing half-allocated is left holding memory


def test_growing_an_existing_file_beyond_the_tmpfs_keeps_its_old_size_and_bytes(small_tmpfs):
    path = small_tmpfs / "f.shard"
    fd = allocate_file(path, 1 * MiB)
    os.pwrite(fd, b"keep me", 0)
    os.close(fd)
    with pytest.raises(InsufficientSpaceError):
        allocate_file(path, 16 * MiB)
    assert path.stat().st_size == 1 * MiB
    assert path.read_bytes()[:7] == b"keep me"


def test_allocate_file_shrinks_an_existing_file(shm_dir):
    path = shm_dir / "f"
    os.close(allocate_file(path, 1 * MiB))
    fd = allocate_file(path, 4096)
    os.close(fd)
    assert path.stat().st_size == 4096
