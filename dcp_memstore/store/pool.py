"""Reuse of shard files across checkpoints.

Evicted checkpoints' shard files are moved (renamed) into a per-rank pool instead of being deleted. A new
save claims a pooled file by renaming it to its own path: its tmpfs pages are already allocated and, in the
process that wrote it before, already mapped (and pinned), so steady-state saves pay neither allocation nor
page faults. Claims are renames, so ranks and processes can race for pool files safely. A save decides
which pooled file serves which of its files before it claims any (``Claims``), so that a file that outgrew
its pooled file does not take the memory of those its other files reuse.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from pathlib import Path

from dcp_memstore.store.layout import SHARD_SUFFIX, StoreLayout
from dcp_memstore.store.mapping import MAPPINGS, MappedFile
from dcp_memstore.store.space import allocate_file

FILE_ALIGN = 4096
# Name prefix of a pooled file that a save staged and returned unwritten (``release(staged=True)``)
STAGED_PREFIX = "staged-"
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

    def reusable_bytes(self, sizes: list[int] | None = None) -> int:
        """The bytes of a save's shard files of ``sizes`` that this pool provides without new memory: each
        file a pooled file serves counts its own size (the pooled file's slack, up to a quarter more,
        serves nothing else), and the pooled files that serve none count whole (``Claims`` deletes them
        before it allocates a file). With ``sizes`` None (a save whose files are not known yet), every
        pooled file's size."""
        if sizes is None:
            return sum(st.st_size for e in self._entries() if (st := _stat(e)) is not None)
        rounded = [round_up(s) for s in sizes]
        chosen, spare = self._match(rounded)
        served = sum(s for s, e in zip(rounded, chosen, strict=True) if e is not None)
        return served + sum(st.st_size for e in spare if (st := _stat(e)) is not None)

    def claims(self, sizes: list[int]) -> Claims:
        """The claims of one save's files of ``sizes`` bytes on this pool, decided together before any file
        is claimed (see ``Claims``)."""
        return Claims(self, sizes)

    def unmatched(self, sizes: list[int]) -> list[int]:
        """The sizes among ``sizes`` (page-rounded, largest first) that no pooled file would serve, each file
        serving one size: the files a save of ``sizes`` allocates new."""
        rounded = [round_up(s) for s in sizes]
        chosen, _ = self._match(rounded)
        return sorted((s for s, e in zip(rounded, chosen, strict=True) if e is None), reverse=True)

    def release(self, path: Path, staged: bool = False) -> None:
        """Return a shard file to the pool; ``staged``: a file a save staged into and did not keep, as a rank
        does where another rank writes most of its values (DDP), which its next save stages into again
        (``trim`` keeps those apart). FileNotFoundError if the store was deleted (its directory is not made
        again: a store removed under a running save or reservation stays removed)."""
        self.dir.mkdir(exist_ok=True)
        os.rename(path, self.dir / f"{STAGED_PREFIX if staged else ''}{uuid.uuid4().hex}{SHARD_SUFFIX}")

    def trim(self, keep: int) -> None:
        """Delete all but the ``keep`` newest pooled files of checkpoints and the ``keep`` newest staged
        files returned unwritten (see ``release``), and this process's mappings of the deleted ones. A rank
        that returns staged files needs both for its next save: files to stage into, files to write."""
        kinds: dict[bool, list[os.DirEntry]] = {}
        for e in sorted(self._entries(), key=_mtime, reverse=True):
            kinds.setdefault(e.name.startswith(STAGED_PREFIX), []).append(e)
        entries = [e for kind in kinds.values() for e in kind[keep:]]
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
        if entries:
            MAPPINGS.prune()

    def _fitting(self, size: int) -> list[os.DirEntry]:
        """Pooled files that serve ``size`` bytes, in the order a claim takes them (``_preference``)."""
        found = [(e, st) for e in self._entries() if (st := _stat(e)) is not None and _fits(st.st_size, size)]
        return [e for e, st in sorted(found, key=lambda f: _preference(f[1]))]

    def _match(self, sizes: list[int]) -> tuple[list[os.DirEntry | None], list[os.DirEntry]]:
        """Pair each of ``sizes`` (page-rounded) with a pooled file that serves it, largest size first, each
        taking the fitting file ``_preference`` puts first, each file serving one size. Returns the file of
        each size (None: no pooled file serves it) and the pooled files that serve none."""
        free = [(e, st) for e in self._entries() if (st := _stat(e)) is not None]
        chosen: list[os.DirEntry | None] = [None] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            fits = [f for f in free if _fits(f[1].st_size, sizes[i])]
            if fits:
                best = min(fits, key=lambda f: _preference(f[1]))
                free.remove(best)
                chosen[i] = best[0]
        return chosen, [e for e, _ in free]


class Claims:
    """One save's claims on a rank's pool, one per file, decided together before any is made.

    Each file of the save is paired with a pooled file that fits it (``FilePool._match``: the pairing by
    which ``unmatched`` tells a reservation what to allocate ahead). A file that none fits is allocated new,
    and the pooled files that serve no file of the save are deleted first, so their memory serves it; the
    files paired with the save's other files stay for them (a save whose one file grew still reuses the
    others). The space check counts a reused pooled file as the size it serves and every other pooled file
    whole (``FilePool.reusable_bytes``): each is either reused or deleted before a new file is allocated.
    ``claim`` may be called for several files at once, from several threads."""

    def __init__(self, pool: FilePool, sizes: list[int]) -> None:
        self.pool = pool
        self.sizes = [round_up(s) for s in sizes]
        self._chosen, self._spare = pool._match(self.sizes)
        self._promised = {e.path for e in self._chosen if e is not None}
        self._spare_lock = threading.Lock()

    def claim(self, index: int, dest: Path) -> tuple[int, bool]:
        """Put a fully allocated file for the save's file ``index`` at ``dest``: the pooled file chosen for
        it, else (another process took that one) a pooled file that fits and no other file of the save was
        given, else a new one. Returns an O_RDWR descriptor (the caller closes it or hands it to
        ``MAPPINGS.map_fd``) and whether the file was reused.

        A pooled file is never resized: another process may hold a mapping of it at its old size (DCP's
        checkpoint process keeps the storages it received), and a file shrunk under a mapping raises SIGBUS.
        """
        chosen = self._chosen[index]
        if (chosen is not None and _take(chosen.path, dest)) or any(
            _take(e.path, dest) for e in self.pool._fitting(self.sizes[index]) if e.path not in self._promised
        ):
            return os.open(dest, os.O_RDWR | os.O_CLOEXEC), True
        self._delete_spare()
        return allocate_file(dest, self.sizes[index]), False

    def acquire(self, index: int, dest: Path) -> tuple[MappedFile, bool]:
        """``claim`` the file and map it into this process (pages faulted in, for writing); returns the
        mapping and whether the file was reused."""
        fd, reused = self.claim(index, dest)
        return MAPPINGS.map_fd(fd), reused

    def _delete_spare(self) -> None:
        """Delete the pooled files that serve no file of this save (once, before any new file is allocated:
        the threads allocating others wait here until their memory is back)."""
        with self._spare_lock:
            spare, self._spare = self._spare, []
            for e in spare:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
            if spare:
                MAPPINGS.prune()  # a deleted file this process maps keeps its memory until unmapped


def _take(path: str, dest: Path) -> bool:
    """Rename pooled file ``path`` to ``dest``; False if another process (or thread) claimed it first."""
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return False
    return True


def _preference(st: os.stat_result) -> tuple[bool, int]:
    """Which of the pooled files that fit a claim takes first: one already mapped here (no page faults, and
    pinned already), then the smallest."""
    return not MAPPINGS.is_mapped((st.st_dev, st.st_ino)), st.st_size


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
