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
        total = 0
        for e in self._entries():
            with contextlib.suppress(FileNotFoundError):
                total += e.stat().st_size
        return total

    def claim(self, dest: Path, size: int) -> int:
        """Make a fully allocated file of at least ``size`` bytes at ``dest``, from the pool if possible;
        return an O_RDWR descriptor of it (the caller closes it or hands it to ``MAPPINGS.map_fd``)."""
        size = round_up(size)
        for entry in self._ranked(size):
            try:
                os.rename(entry.path, dest)
            except FileNotFoundError:
                continue  # another process claimed it first
            break
        return allocate_file(dest, self._target_size(dest, size))

    def acquire(self, dest: Path, size: int) -> MappedFile:
        """``claim`` a file and map it into this process (pages faulted in, for writing)."""
        return MAPPINGS.map_fd(self.claim(dest, size), populate_write=True)

    def release(self, path: Path) -> None:
        """Return a shard file to the pool."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.rename(path, self.dir / f"{uuid.uuid4().hex}{SHARD_SUFFIX}")

    def trim(self, keep: int) -> None:
        """Delete all but the ``keep`` newest pooled files."""
        entries = sorted(self._entries(), key=_mtime, reverse=True)
        for e in entries[keep:]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
        MAPPINGS.prune()

    def _ranked(self, size: int) -> list[os.DirEntry]:
        """Pool files in order of preference: already mapped here and big enough, then big enough, then any."""
        scored = []
        for e in self._entries():
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            mapped = MAPPINGS.is_mapped((st.st_dev, st.st_ino))
            fits = size <= st.st_size <= size * _MAX_SLACK
            scored.append((not (mapped and fits), not fits, abs(st.st_size - size), e))
        return [e for *_, e in sorted(scored, key=lambda s: s[:3])]

    @staticmethod
    def _target_size(path: Path, size: int) -> int:
        try:
            current = os.stat(path).st_size
        except FileNotFoundError:
            return size
        return current if size <= current <= size * _MAX_SLACK else size


def _mtime(e: os.DirEntry) -> float:
    try:
        return e.stat().st_mtime
    except FileNotFoundError:
        return 0.0
