"""FilePool: evicted shard files are reused (same inode, already allocated and mapped) and trimmed."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from dcp_memstore.store.layout import SHARD_SUFFIX
from dcp_memstore.store.mapping import MAPPINGS
from dcp_memstore.store.pool import FILE_ALIGN, FilePool, round_up
from dcp_memstore.store.space import allocate_file


def _pooled(pool):
    return sorted(p for p in pool.dir.iterdir() if p.name.endswith(SHARD_SUFFIX))


def test_round_up_to_pages():
    assert round_up(0) == FILE_ALIGN
    assert round_up(1) == FILE_ALIGN
    assert round_up(FILE_ALIGN) == FILE_ALIGN
    assert round_up(FILE_ALIGN + 1) == 2 * FILE_ALIGN


def test_acquire_from_empty_pool_makes_an_allocated_mapped_file(layout, shm_dir):
    pool = FilePool(layout, 0)
    dest = shm_dir / "a.shard"
    mf, reused = pool.acquire(dest, 10_000)
    assert not reused
    st = os.stat(dest)
    assert mf.size == st.st_size == round_up(10_000)
    assert st.st_blocks * 512 >= st.st_size  # allocated up front, not sparse
    assert mf.key == (st.st_dev, st.st_ino)
    t = mf.tensor(0, torch.int64, (10,))
    t.copy_(torch.arange(10))
    with open(dest, "rb") as f:
        assert torch.equal(torch.frombuffer(bytearray(f.read(80)), dtype=torch.int64), torch.arange(10))


def test_release_then_acquire_reuses_the_same_inode_and_mapping(layout, shm_dir):
    pool = FilePool(layout, 0)
    first, _ = pool.acquire(shm_dir / "a.shard", 64 << 10)
    ino = os.stat(shm_dir / "a.shard").st_ino
    pool.release(shm_dir / "a.shard")
    assert not (shm_dir / "a.shard").exists()
    assert [p.stat().st_ino for p in _pooled(pool)] == [ino]
    assert pool.reusable_bytes() == 64 << 10

    again, reused = pool.acquire(shm_dir / "b.shard", 60 << 10)  # a bit smaller still fits
    assert reused
    assert os.stat(shm_dir / "b.shard").st_ino == ino
    assert again is first  # the cached mapping, not a new one
    assert _pooled(pool) == []
    assert pool.reusable_bytes() == 0


def test_acquire_prefers_a_pooled_file_of_the_right_size(layout, shm_dir):
    pool = FilePool(layout, 0)
    inos = {}
    for name, size in (("small", 8 << 10), ("right", 64 << 10), ("huge", 1 << 20)):
        os.close(allocate_file(shm_dir / name, size))
        inos[name] = os.stat(shm_dir / name).st_ino
        pool.release(shm_dir / name)
    pool.acquire(shm_dir / "new", 64 << 10)
    assert os.stat(shm_dir / "new").st_ino == inos["right"]
    assert sorted(p.stat().st_ino for p in _pooled(pool)) == sorted([inos["small"], inos["huge"]])


def test_a_pooled_file_that_does_not_fit_is_deleted_never_resized(layout, shm_dir):
    # Another process may map a pooled file at its old size: resizing it would break that mapping.
    pool = FilePool(layout, 0)
    pool.acquire(shm_dir / "a", 8 << 10)
    ino = os.stat(shm_dir / "a").st_ino
    pool.release(shm_dir / "a")
    mf, _ = pool.acquire(shm_dir / "b", 1 << 20)
    st = os.stat(shm_dir / "b")
    assert st.st_ino != ino
    assert st.st_size == mf.size == 1 << 20
    assert _pooled(pool) == []  # the misfit's memory went back before the new file was allocated
    mf.tensor(0, torch.uint8, (1 << 20,)).fill_(7)  # the whole new size is usable


def test_trim_keeps_only_the_newest_files(layout, shm_dir):
    pool = FilePool(layout, 0)
    paths = [shm_dir / f"f{i}" for i in range(4)]
    for p in paths:
        pool.acquire(p, 4096)
    inos = [os.stat(p).st_ino for p in paths]
    assert len(set(inos)) == 4
    for i, p in enumerate(paths):
        os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))  # f3 is the newest
        pool.release(p)
    pool.trim(keep=2)
    assert sorted(p.stat().st_ino for p in _pooled(pool)) == sorted(inos[2:])
    pool.trim(keep=0)
    assert _pooled(pool) == []
    for ino in inos:  # their mappings are dropped too, so the memory can be freed
        assert not MAPPINGS.is_mapped((os.stat(shm_dir).st_dev, ino))


def test_pools_are_per_rank(layout, shm_dir):
    FilePool(layout, 0).acquire(shm_dir / "a", 4096)
    FilePool(layout, 0).release(shm_dir / "a")
    assert FilePool(layout, 1).reusable_bytes() == 0
    FilePool(layout, 1).acquire(shm_dir / "b", 4096)
    assert os.stat(shm_dir / "b").st_ino != _pooled(FilePool(layout, 0))[0].stat().st_ino


def test_unmatched_names_the_sizes_no_pooled_file_serves(layout, shm_dir):
    pool = FilePool(layout, 0)
    pool.acquire(shm_dir / "a", 64 << 10)
    pool.acquire(shm_dir / "b", 1 << 20)
    pool.release(shm_dir / "a")
    pool.release(shm_dir / "b")
    # 1 MiB serves 900 KiB (within the slack); 64 KiB serves 60 KiB; nothing serves a second 60 KiB or 4 MiB
    assert pool.unmatched([900 << 10, 60 << 10, 60 << 10, 4 << 20]) == [4 << 20, round_up(60 << 10)]
    assert pool.unmatched([1 << 20, 64 << 10]) == []
    assert FilePool(layout, 1).unmatched([4096]) == [4096]  # another rank's pool is empty


def test_release_into_a_deleted_store_does_not_make_it_again(layout, shm_dir):
    """A save or reservation that finishes after its store was removed (``rm -rf`` of the job's directory)
    must not put the store's directories back with files in them, holding memory nobody owns."""
    outside = shm_dir / "elsewhere"
    outside.mkdir()
    path = outside / "a.shard"
    os.close(allocate_file(path, FILE_ALIGN))
    pool = FilePool(layout, 0)
    shutil.rmtree(layout.job_dir)
    with pytest.raises(FileNotFoundError):
        pool.release(path)
    assert not layout.job_dir.exists()
    assert path.exists()  # left where it was, for its caller to delete
