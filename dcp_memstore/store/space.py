"""Admission control for the node-local store: is there room for a checkpoint, and is the root in memory?

A tmpfs file that outgrows the memory behind it kills the writer with SIGBUS, so every shard file is
allocated up front (``allocate_file``) and the bytes a checkpoint needs are checked against what the file
system and the machine's memory can still give before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import psutil

from dcp_memstore.errors import InsufficientSpaceError

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EDQUOT})  # a full file system, or memory


def filesystem_type(path: Path) -> str:
    """The type of the file system holding ``path`` (longest matching mount point), or '' if unknown."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (target == mp or target.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
            best, fstype = mp, part.fstype
    return fstype


def is_memory_backed(path: Path) -> bool:
    """True if ``path`` lies on a memory file system (tmpfs, ramfs, hugetlbfs)."""
    return filesystem_type(path) in MEMORY_FILESYSTEMS


def _cgroup_levels(mount: Path, rel: str) -> list[Path]:
    """The cgroup directory ``rel`` under ``mount`` and each of its ancestors up to ``mount`` itself.

    In a container without a cgroup namespace, ``rel`` names a host path that the container's mount lacks;
    the walk then ends at the mount, which is the container's own cgroup."""
    level = mount / rel.strip("/")
    levels = [level]
    while level != mount:
        level = level.parent
        levels.append(level)
    return levels


def _level_headroom(level: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """Bytes the cgroup at ``level`` may still charge, or None if it sets no limit (or cannot be read)."""
    try:
        limit = (level / limit_file).read_text().strip()
        usage = int((level / usage_file).read_text())
        stat = dict(line.split() for line in (level / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
        return None
    return max(0, int(limit) - usage + int(stat.get(inactive_key, 0)))


def cgroup_headroom() -> int | None:
    """Bytes this process's cgroup may still charge before a memory limit, or None if unlimited.

    tmpfs pages are charged to the cgroup that touches them first, so in a container the limit, not the
    machine's free memory, decides whether a checkpoint fits (beyond it the OOM killer, not an error).
    Every ancestor's limit applies too, and a batch system often sets it there only (Slurm limits the
    job's cgroup, not the task's below it), so this is the smallest headroom of the process's cgroup and
    each ancestor. Reads cgroup v2 (memory.max) or v1 (memory.limit_in_bytes); inactive file cache, which
    the kernel reclaims before it fails an allocation, counts as free."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    root = Path("/sys/fs/cgroup")
    headrooms = []
    for _, controllers, rel in lines:
        if controllers == "":
            files = ("memory.max", "memory.current", "inactive_file")
            levels = _cgroup_levels(root, rel)
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            levels = _cgroup_levels(root / "memory", rel)
        else:
            continue
        headrooms += [h for level in levels if (h := _level_headroom(level, *files)) is not None]
    return min(headrooms, default=None)


def free_bytes(path: Path) -> int:
    """Bytes a new file under ``path`` can still take: the file system's free space, and for a memory
    file system also no more than the machine's available memory and the cgroup's headroom. A memory file
    system without a size (ramfs, whose statvfs reports 0 blocks, all of them free) is bounded by memory
    alone."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    fstype = filesystem_type(path)  # one pass over the mount table, for every space check of a save
    if fstype in MEMORY_FILESYSTEMS:
        memory = psutil.virtual_memory().available
        free = memory if fstype == "ramfs" else min(free, memory)
        headroom = cgroup_headroom()
        if headroom is not None:
            free = min(free, headroom)
    return free


def check_space(path: Path, needed: int, reusable: int = 0) -> None:
    """Raise InsufficientSpaceError unless ``needed`` bytes fit in the free space plus ``reusable`` bytes of
    already-allocated files that the write will reuse."""
    free = free_bytes(path)
    if needed > free + reusable:
        # counted in free already: not more room on top of it
        detail = f"including {reusable} bytes of pooled files of evicted checkpoints" if reusable else ""
        raise InsufficientSpaceError(str(path), needed, free + reusable, detail)


@contextlib.contextmanager
def space_errors(path: Path, needed: int, detail: str = "") -> Iterator[None]:
    """Turn a full file system or memory (ENOSPC, ENOMEM, EDQUOT) inside the block into an
    InsufficientSpaceError about ``path`` that says ``needed`` bytes were wanted; other errors pass."""
    try:
        yield
    except InsufficientSpaceError:
        raise
    except OSError as e:
        if e.errno not in FULL_ERRNOS:
            raise
        raise InsufficientSpaceError(str(path), needed, free_bytes(path), detail) from e


def allocate_file(path: Path, size: int) -> int:
    """Create (or grow) ``path`` to ``size`` bytes with every block allocated; return an O_RDWR fd.

    On a full file system this raises InsufficientSpaceError and leaves no file behind (a new file) or the
    file's old size (an existing one), instead of the SIGBUS a sparse tmpfs file gives later.
    """
    existed = path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with space_errors(path.parent, size):
        try:
            old = os.fstat(fd).st_size
            if size > old:
                os.posix_fallocate(fd, 0, size)
            elif size < old:
                os.ftruncate(fd, size)
            return fd
        except OSError:
            os.close(fd)
            if not existed:
                path.unlink(missing_ok=True)
            else:
                with open(path, "r+b") as f:
                    f.truncate(old)
            raise
