"""FilePool: evicted shard files are reused (same inode, already allocated and mapped) and trimmed; a save's
files are paired with pooled files together, so one that grew does not take the others' files."""

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


def _acquire(pool: FilePool, dest, size: int):
    """Claim and map one file, as a save of one file does."""
    return pool.claims([size]).acquire(0, dest)


def test_round_up_to_pages():
    assert round_up(0) == FILE_ALIGN
    assert round_up(1) == FILE_ALIGN
    assert round_up(FILE_ALIGN) == FILE_ALIGN
    assert round_up(FILE_ALIGN + 1) == 2 * FILE_ALIGN


def test_acquire_from_empty_pool_makes_an_allocated_mapped_file(layout, shm_dir):
    pool = FilePool(layout, 0)
    dest = shm_dir / "a.shard"
    mf, reused = _acquire(pool, dest, 10_000)
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
    first, _ = _acquire(pool, shm_dir / "a.shard", 64 << 10)
    ino = os.stat(shm_dir / "a.shard").st_ino
    pool.release(shm_dir / "a.shard")
    assert not (shm_dir / "a.shard").exists()
    assert [p.stat().st_ino for p in _pooled(pool)] == [ino]
    assert pool.reusable_bytes() == 64 << 10

    again, reused = _acquire(pool, shm_dir / "b.shard", 60 << 10)  # a bit smaller still fits
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
    _acquire(pool, shm_dir / "new", 64 << 10)
    assert os.stat(shm_dir / "new").st_ino == inos["right"]
    assert sorted(p.stat().st_ino for p in _pooled(pool)) == sorted([inos["small"], inos["huge"]])


def test_a_pooled_file_that_does_not_fit_is_deleted_never_resized(layout, shm_dir):
    # Another process may map a pooled file at its old size: resizing it would break that mapping.
    pool = FilePool(layout, 0)
    _acquire(pool, shm_dir / "a", 8 << 10)
    ino = os.stat(shm_dir / "a").st_ino
    pool.release(shm_dir / "a")
    mf, _ = _acquire(pool, shm_dir / "b", 1 << 20)
    st = os.stat(shm_dir / "b")
    assert st.st_ino != ino
    assert st.st_size == mf.size == 1 << 20
    assert _pooled(pool) == []  # the misfit's memory went back before the new file was allocated
    mf.tensor(0, torch.uint8, (1 << 20,)).fill_(7)  # the whole new size is usable


def test_trim_keeps_only_the_newest_files(layout, shm_dir):
    pool = FilePool(layout, 0)
    paths = [shm_dir / f"f{i}" for i in range(4)]
    for p in paths:
        _acquire(pool, p, 4096)
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


def test_trim_keeps_the_newest_files_of_checkpoints_and_of_staging_apart(layout, shm_dir):
    """A rank whose staged files go back unwritten (another rank writes their values: DDP) needs, for its
    next save, files to stage into and files to write: newer files of one kind must not push out the
    other kind's, or every save allocates new files again."""
    pool = FilePool(layout, 0)
    paths = [shm_dir / f"f{i}" for i in range(4)]
    for p in paths:
        _acquire(pool, p, 4096)
    inos = [os.stat(p).st_ino for p in paths]
    for i, p in enumerate(paths):
        os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))  # the checkpoints' files are newer
        pool.release(p, staged=i < 2)
    pool.trim(keep=1)
    assert sorted(p.stat().st_ino for p in _pooled(pool)) == sorted([inos[1], inos[3]])


def test_pools_are_per_rank(layout, shm_dir):
    _acquire(FilePool(layout, 0), shm_dir / "a", 4096)
    FilePool(layout, 0).release(shm_dir / "a")
    assert FilePool(layout, 1).reusable_bytes() == 0
    _acquire(FilePool(layout, 1), shm_dir / "b", 4096)
    assert os.stat(shm_dir / "b").st_ino != _pooled(FilePool(layout, 0))[0].stat().st_ino


def test_unmatched_names_the_sizes_no_pooled_file_serves(layout, shm_dir):
    pool = FilePool(layout, 0)
    _acquire(pool, shm_dir / "a", 64 << 10)
    _acquire(pool, shm_dir / "b", 1 << 20)
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


def _pool_of(layout, shm_dir, sizes: dict[str, int]) -> tuple[FilePool, dict[str, int]]:
    """Rank 0's pool holding one file per entry of ``sizes`` (name -> bytes); the files' inodes by name."""
    pool = FilePool(layout, 0)
    inos = {}
    for name, size in sizes.items():
        os.close(allocate_file(shm_dir / name, size))
        inos[name] = os.stat(shm_dir / name).st_ino
        pool.release(shm_dir / name)
    return pool, inos


def test_a_grown_file_deletes_only_the_pooled_files_no_other_file_of_the_save_reuses(layout, shm_dir):
    """A save of files of 1 MiB and 64 KiB before; now the 1 MiB one needs 2 MiB. Claimed in that order
    (parallel threads claim in any order), the 2 MiB file is new, the old 1 MiB file and a stray 8 KiB one
    are deleted for its memory, and the 64 KiB file still serves the save's other file."""
    pool, inos = _pool_of(layout, shm_dir, {"big": 1 << 20, "small": 64 << 10, "stray": 8 << 10})
    claims = pool.claims([2 << 20, 64 << 10])
    fd, reused = claims.claim(0, shm_dir / "grown")
    os.close(fd)
    assert not reused
    assert _pooled(pool) and [p.stat().st_ino for p in _pooled(pool)] == [inos["small"]]
    fd, reused = claims.claim(1, shm_dir / "same")
    os.close(fd)
    assert reused and os.stat(shm_dir / "same").st_ino == inos["small"]
    assert os.stat(shm_dir / "grown").st_size == 2 << 20
    assert _pooled(pool) == []


def test_a_claim_whose_pooled_file_another_process_took_takes_another_that_fits(layout, shm_dir):
    """Another process (a second save of the rank) may claim the file paired with this save's file first:
    another fitting file is taken then, but not the one paired with another file of this save, which that
    file needs (here it is the only one that fits it, and the one a claim takes first: mapped here)."""
    _acquire(FilePool(layout, 0), shm_dir / "z", 72 << 10)  # mapped in this process, then pooled
    z = os.stat(shm_dir / "z").st_ino
    FilePool(layout, 0).release(shm_dir / "z")
    pool, inos = _pool_of(layout, shm_dir, {"x": 64 << 10, "y": 66 << 10})
    inos["z"] = z
    claims = pool.claims([64 << 10, 70 << 10])  # z is paired with 70 KiB (none other fits it), x with 64
    (x,) = [f for f in _pooled(pool) if f.stat().st_ino == inos["x"]]
    x.rename(shm_dir / "elsewhere")  # the other process's claim: a rename
    fd, reused = claims.claim(0, shm_dir / "first")
    os.close(fd)
    assert reused and os.stat(shm_dir / "first").st_ino == inos["y"]
    fd, reused = claims.claim(1, shm_dir / "second")
    os.close(fd)
    assert reused and os.stat(shm_dir / "second").st_ino == inos["z"]
