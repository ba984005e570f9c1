"""Small msgpack records on disk: atomic writes and size-capped, pickle-free reads.

Every control file of the store (markers, manifests) goes through here, so a crash never leaves a
half-written one visible: data goes to a temporary name in the same directory and is renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

MAX_RECORD_BYTES = 1 << 30  # a manifest of a very large model stays far below this


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file to write that replaces ``path`` (fsynced) when the block ends without an error, and never in
    part: readers see either the old file or the whole new one. Until then it has a hidden temporary name
    in the same directory, ``.<name>.tmp-<pid>-<8 hex>``, which only a killed process leaves behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
