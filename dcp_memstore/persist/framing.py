"""torch.save framing of stored tensor bytes, streamed, so stock DCP readers can load persisted files.

Stock ``FileSystemReader``/``FsspecReader`` expect every tensor item to be a ``torch.save`` archive at
its offset. ``torch.save`` of a tensor made with ``torch.frombuffer`` over the tmpfs mapping hands the
tensor's bytes to the stream as one zero-copy memoryview, so framing costs a few hundred bytes of headers
(with torch's CRC32 turned off; our xxh3 checksums cover the data). We also record where the raw bytes
start inside the archive, from its zip local header, so our reader can fetch them without unpickling.
"""

from __future__ import annotations

import io
import struct
import threading
from collections.abc import Callable

import torch

_HEADER_MAX = 4096  # writes up to this size are kept to find the zip headers; the payload passes through
WRITE_PIECE = 4 << 20  # big writes go to the sink in pieces, so a buffered sink flushes parts as it fills
_LOCAL_HEADER = b"PK\x03\x04"
_crc = threading.local()
OnPiece = Callable[[memoryview], object]  # sees each piece of a payload just before it is written


def disable_torch_save_crc32() -> None:
    """Turn off torch.save's CRC32 (about 2 GB/s of CPU otherwise) in this thread: torch keeps the
    setting per thread. torch.load reads archives either way."""
    if not getattr(_crc, "off", False):
        torch.serialization.set_crc32_options(False)
        _crc.off = True


class _Tap(io.RawIOBase):
    """A write-only stream that forwards to ``sink`` and remembers the small writes and their offsets.
    The archive's payload (``payload_len`` bytes from where the zip record of ``…/data/0`` puts them) goes
    to the sink through ``on_payload``, piece by piece (``write_in_pieces``)."""

    def __init__(self, sink, payload_len: int = 0, on_payload: OnPiece | None = None) -> None:
        super().__init__()
        self.sink = sink
        self.pos = 0
        self.small: dict[int, bytes] = {}
        self.payload_len = payload_len
        self.on_payload = on_payload
        self.payload_seen = 0  # payload bytes handed to on_payload
        self._start: int | None = None  # where the payload starts, once its record's header is written

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if n <= _HEADER_MAX:
            self.small[self.pos] = bytes(mv)
            if self._start is None:
                self._start = self._find_payload()
        lo = hi = 0  # the part of this write that is payload
        if self.on_payload is not None and self._start is not None:
            lo = min(n, max(0, self._start - self.pos))
            hi = max(lo, min(n, self._start + self.payload_len - self.pos))
        write_in_pieces(self.sink, mv[:lo])
        write_in_pieces(self.sink, mv[lo:hi], self.on_payload)
        write_in_pieces(self.sink, mv[hi:])
        self.payload_seen += hi - lo
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def _find_payload(self) -> int | None:
        """Offset in the archive where the storage bytes (``…/data/0``) start, once the zip local header
        and the name of their record are written; None before."""
        for pos, data in self.small.items():
            if len(data) == 30 and data.startswith(_LOCAL_HEADER):
                name_len, extra_len = struct.unpack_from("<HH", data, 26)
                name = self.small.get(pos + 30, b"")
                if name.endswith(b"/data/0"):
                    return pos + 30 + name_len + extra_len
        return None

    def payload_offset(self) -> int:
        """Offset in the archive where the storage bytes (``…/data/0``) start."""
        if self._start is None:
            raise RuntimeError("torch.save wrote no storage record: cannot locate the tensor's bytes")
        return self._start


def write_in_pieces(sink, data: memoryview, on_piece: OnPiece | None = None) -> None:
    """``sink.write(data)`` in pieces of at most ``WRITE_PIECE`` bytes: fsspec's buffered writers copy a
    whole write into their buffer before they flush a part, so one big write would cost its size in RAM.
    ``on_piece`` (a checksum's ``update``) sees each piece just before the sink, while it is in cache:
    memory is read once for both."""
    for start in range(0, data.nbytes, WRITE_PIECE):
        piece = data[start : start + WRITE_PIECE]
        if on_piece is not None:
            on_piece(piece)
        sink.write(piece)


def write_framed(
    sink, data: memoryview, dtype: torch.dtype, shape: tuple[int, ...], on_payload: OnPiece | None = None
) -> tuple[int, int]:
    """Write ``data`` (a tensor's raw bytes) to ``sink`` as a ``torch.save`` archive of a tensor of
    ``dtype`` and ``shape``; ``on_payload`` (a checksum's ``update``) sees exactly the archive's copy of
    ``data``, in order, as it goes to the sink. Returns (archive length, offset of the raw bytes inside
    the archive)."""
    if data.nbytes:
        tensor = torch.frombuffer(data, dtype=dtype).view(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
    disable_torch_save_crc32()
    tap = _Tap(sink, data.nbytes, on_payload)
    torch.save(tensor, tap)
    if on_payload is not None and tap.payload_seen != data.nbytes:
        raise RuntimeError(
            f"torch.save wrote {tap.payload_seen} of the tensor's {data.nbytes} bytes where its storage "
            "record puts them: the framed bytes cannot be checked"
        )
    return tap.pos, tap.payload_offset()
