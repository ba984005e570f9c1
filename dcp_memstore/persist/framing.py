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

import torch

_HEADER_MAX = 4096  # writes up to this size are kept to find the zip headers; the payload passes through
WRITE_PIECE = 4 << 20  # big writes go to the sink in pieces, so a buffered sink flushes parts as it fills
_LOCAL_HEADER = b"PK\x03\x04"
_crc = threading.local()


def disable_torch_save_crc32() -> None:
    """Turn off torch.save's CRC32 (about 2 GB/s of CPU otherwise) in this thread: torch keeps the
    setting per thread. torch.load reads archives either way."""
    if not getattr(_crc, "off", False):
        torch.serialization.set_crc32_options(False)
        _crc.off = True


class _Tap(io.RawIOBase):
    """A write-only stream that forwards to ``sink`` and remembers the small writes and their offsets."""

    def __init__(self, sink) -> None:
        super().__init__()
        self.sink = sink
        self.pos = 0
        self.small: dict[int, bytes] = {}

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if n <= _HEADER_MAX:
            self.small[self.pos] = bytes(mv)
        write_in_pieces(self.sink, mv)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def payload_offset(self) -> int:
        """Offset in the archive where the storage bytes (``…/data/0``) start."""
        for pos, data in self.small.items():
            if len(data) == 30 and data.startswith(_LOCAL_HEADER):
                name_len, extra_len = struct.unpack_from("<HH", data, 26)
                name = self.small.get(pos + 30, b"")
                if name.endswith(b"/data/0"):
                    return pos + 30 + name_len + extra_len
        raise RuntimeError("torch.save wrote no storage record: cannot locate the tensor's bytes")


def write_in_pieces(sink, data: memoryview) -> None:
    """``sink.write(data)`` in pieces of at most ``WRITE_PIECE`` bytes: fsspec's buffered writers copy a
    whole write into their buffer before they flush a part, so one big write would cost its size in RAM."""
    for start in range(0, data.nbytes, WRITE_PIECE):
        sink.write(data[start : start + WRITE_PIECE])


def write_framed(sink, data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    """Write ``data`` (a tensor's raw bytes) to ``sink`` as a ``torch.save`` archive of a tensor of
    ``dtype`` and ``shape``. Returns (archive length, offset of the raw bytes inside the archive)."""
    if data.nbytes:
        tensor = torch.frombuffer(data, dtype=dtype).view(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
    disable_torch_save_crc32()
    tap = _Tap(sink)
    torch.save(tensor, tap)
    return tap.pos, tap.payload_offset()
