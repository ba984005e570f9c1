"""Reuse of shard files across checkpoints.

Evicted checkpoints' shard files are moved (renamed) into a per-rank pool instead of being deleted. A new
save claims a pooled file by renaming it to its own path: its tmpfs pages are already allocated and, in the
process that wrote it before, already mapped (and pinned), so steady-state saves pay neither allocation nor
page faults. Claims are renames, so ranks and processes can race for pool files safely.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

from dcp_memstore.store.layout import SHARD_SUFFIX, StoreLayout
from dcp_memstore.store.mapping import MAPPINGS, MappedFile
from dcp_memstore.store.space import allocate_file

FILE_ALIGN = 4096
_MAX_SLACK = 1.25  # a pooled file up to this much larger than needed is used as it is


def round_up(n: int, align: int = FILE_ALIGN) -> int:
    return max(align, (n + align - 1) // align * align)


class FilePool:
    """The pool of reusable shard files of one rank."""

    def __init__(self, layout: StoreLayout, rank: int) -> None:
        self.dir = layout.pool_dir(rank)

    def _entries(self) -> list[os.DirEntry]:
        try:
            return [e for e in os.scandir(self.dir) if e.name.endswith(SHARD_SUFFIX)]
        except FileNotFoundError:
            return []

    def reusable_bytes(self) -> int:
        return sum(st.st_size for e in self._entries() if (st := _stat(e)) is not None)

    def claim(self, dest: Path, size: int) -> tuple[int, bool]:
        """Put a fully allocated file of at least ``size`` bytes at ``dest``: a pooled file that fits, else a
        new one. Returns an O_RDWR descriptor (the caller closes it or hands it to ``MAPPINGS.map_fd``) and
        whether the file was reused.

        A pooled file is never resized: another process may hold a mapping of it at its old size (DCP's
        checkpoint process keeps the storages it received), and a file shrunk under a mapping raises SIGBUS.
        When no pooled file fits, the misfits are deleted first so their memory serves the new file.
        """
        size = round_up(size)
        fitting, misfits = self._candidates(size)
        for entry in fitting:
            try:
                os.rename(entry.path, dest)
            except FileNotFoundError:
                continue  # another process claimed it first
            return os.open(dest, os.O_RDWR | os.O_CLOEXEC), True
        for entry in misfits:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        if misfits:
            MAPPINGS.prune()  # a deleted file this process maps keeps its memory until unmapped
        return allocate_file(dest, size), False

    def unmatched(self, sizes: list[int]) -> list[int]:
        """The sizes among ``sizes`` that no pooled file would serve (each file serving one size)."""
        free = [st for e in self._entries() if (st := _stat(e)) is not None]
        missing = []
        for size in sorted((round_up(s) for s in sizes), reverse=True):
            fits = [f for f in free if _fits(f.st_size, size)]
            if fits:
                free.remove(min(fits, key=lambda f: f.st_size))
            else:
                missing.append(size)
        return missing

    def acquire(self, dest: Path, size: int) -> tuple[MappedFile, bool]:
        """``claim`` a file and map it into this process (pages faulted in, for writing); returns the
        mapping and whether the file was reused."""
        fd, reused = self.claim(dest, size)
        return MAPPINGS.map_fd(fd), reused

    def release(self, path: Path) -> None:
        """Return a shard file to the pool. FileNotFoundError if the store was deleted (its directory is not
        made again: a store removed under a running save or reservation stays removed)."""
        self.dir.mkdir(exist_ok=True)
        os.rename(path, self.dir / f"{uuid.uuid4().hex}{SHARD_SUFFIX}")

    def trim(self, keep: int) -> None:
        """Delete all but the ``keep`` newest pooled files, and this process's mappings of them."""
        entries = sorted(self._entries(), key=_mtime, reverse=True)[keep:]
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
        if entries:
            MAPPINGS.prune()

    def _candidates(self, size: int) -> tuple[list[os.DirEntry], list[os.DirEntry]]:
        """Pooled files that fit ``size`` (those already mapped here first, then the tightest),
        and the rest."""
        fitting, misfits = [], []
        for e in self._entries():
            st = _stat(e)
            if st is None:
                continue
            if _fits(st.st_size, size):
                fitting.append((not MAPPINGS.is_mapped((st.st_dev, st.st_ino)), st.st_size, e))
            else:
                misfits.append(e)
        return [e for *_, e in sorted(fitting, key=lambda f: f[:2])], misfits


def _fits(file_size: int, size: int) -> bool:
    """Whether a pooled file of ``file_size`` bytes serves a file of ``size`` bytes (rounded up)."""
    return size <= file_size <= size * _MAX_SLACK


def _stat(e: os.DirEntry) -> os.stat_result | None:
    try:
        return e.stat()
    except FileNotFoundError:
        return None


def _mtime(e: os.DirEntry) -> float:
    st = _stat(e)
    return st.st_mtime if st is not None else 0.0
