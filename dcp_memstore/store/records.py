"""Small msgpack records on disk: atomic writes and size-capped, pickle-free reads.

Every control file of the store (markers, manifests) goes through here, so a crash never leaves a
half-written one visible: data goes to a temporary name in the same directory and is renamed into place.
The writer holds an ``flock`` on its temporary file until the rename, so that what a killed writer left
can be told from a file being written (``clear_temporaries``), also on a file system that other hosts
share and whose locks they see (NFS).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

MAX_RECORD_BYTES = 1 << 30  # a manifest of a very large model stays far below this
_TEMPORARY_RE = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}")  # the name atomic_file gives its temporary file


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file to write that replaces ``path`` (fsynced) when the block ends without an error, and never in
    part: readers see either the old file or the whole new one. Until then it has a hidden temporary name
    in the same directory, ``.<name>.tmp-<pid>-<8 hex>``, locked by this process, which only a killed
    process leaves behind (``clear_temporaries`` removes it)."""
    f, tmp = _locked_temporary(path)
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # still locked: ``clear_temporaries`` never removes it under the rename
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _locked_temporary(path: Path) -> tuple[BinaryIO, Path]:
    """A new temporary file for ``path``, open and locked. One that ``clear_temporaries`` removed between
    its creation and the lock (it found it unlocked) is made again under another name. Where the file
    system refuses locks, the file stays unlocked: ``clear_temporaries`` cannot take its lock either."""
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        f = open(tmp, "xb")  # noqa: SIM115 - returned open, closed by atomic_file
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:
            return f, tmp
        if same_file(f.fileno(), tmp):
            return f, tmp
        f.close()


def clear_temporaries(directory: Path) -> list[str]:
    """Remove the temporary files of ``atomic_file`` in ``directory`` that killed writers left (no
    process holds their lock; a writer that ended renamed or removed its own); their names, sorted. A
    file whose lock cannot be taken (a live writer's, or locks refused by the file system) stays."""
    try:
        entries = [
            e
            for e in os.scandir(directory)
            if _TEMPORARY_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False)
        ]
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for e in entries:
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # renamed into place or removed meanwhile, or no plain file
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                continue
            if same_file(fd, Path(e.path)):
                Path(e.path).unlink(missing_ok=True)  # another process clearing them may be first
                removed.append(e.name)
        finally:
            os.close(fd)
    return sorted(removed)


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file open as ``fd`` (not removed, nor replaced by another since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def write_atomic(path: Path, data: bytes | bytearray) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one."""
    with atomic_file(path) as f:
        f.write(data)


def write_record(path: Path, record: Any) -> None:
    """Atomically write ``record`` (msgpack-encodable) to ``path``."""
    write_atomic(path, msgpack.packb(record, use_bin_type=True))


def read_capped(path: Path, max_bytes: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of the record file ``path``; FileNotFoundError if absent, ValueError if it is larger than
    ``max_bytes`` (checked before anything is read, so a huge file is never loaded into memory)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{path} is {size} bytes, more than the {max_bytes} allowed for a record")
        return f.read()


def read_record(path: Path, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """Read a msgpack record; raises FileNotFoundError if absent and ValueError if too large or malformed."""
    return decode_record(read_capped(path, max_bytes), str(path))


def decode_record(data: bytes, what: str = "data") -> Any:
    """Decode a msgpack record (pickle-free); ValueError naming ``what`` if it is malformed."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_RECORD_BYTES)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"{what} is not a valid dcp_memstore record: {str(e) or type(e).__name__}") from e
