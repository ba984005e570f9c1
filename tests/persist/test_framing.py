"""torch.save framing: archives torch.load reads back exactly, and the recorded offset of the raw bytes."""

from __future__ import annotations

import io

import pytest
import torch

from dcp_memstore.persist.framing import WRITE_PIECE, disable_torch_save_crc32, write_framed


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1000,), torch.float32),
        ((3, 5), torch.bfloat16),
        ((), torch.float64),
        ((0, 4), torch.float32),
        ((7,), torch.bool),
        ((2, 3), torch.complex64),
        ((4096, 3), torch.int64),  # a payload bigger than the headers kept to find it
    ],
)
def test_archive_loads_back_and_payload_offset_points_at_the_raw_bytes(shape, dtype):
    """The archive loads back with stock torch.load, the recorded offset points at the raw bytes, and
    ``on_payload`` (the upload's checksum) sees exactly those bytes, whatever torch writes around them."""
    disable_torch_save_crc32()
    src = (torch.arange(max(1, torch.Size(shape).numel())) % 97).to(dtype)[: torch.Size(shape).numel()]
    src = src.reshape(shape)
    raw = bytearray(src.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    sink = io.BytesIO(b"prefix")  # archives start anywhere in a file
    sink.seek(0, io.SEEK_END)
    seen = []  # what a checksum computed while sending sees: the raw bytes exactly, once
    length, payload = write_framed(
        sink, memoryview(raw), dtype, shape, lambda piece: seen.append(bytes(piece))
    )
    assert b"".join(seen) == bytes(raw)
    data = sink.getvalue()[6:]
    assert len(data) == length
    assert data[payload : payload + len(raw)] == bytes(raw)
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded.dtype == dtype and tuple(loaded.shape) == shape
    assert torch.equal(loaded, src)


def test_big_tensors_reach_the_stream_in_bounded_pieces():
    class Sink(io.RawIOBase):
        def __init__(self) -> None:
            self.n, self.largest = 0, 0

        def write(self, b) -> int:
            n = memoryview(b).nbytes
            self.n, self.largest = self.n + n, max(self.largest, n)
            return n

    raw = bytearray(24 << 20)
    sink = Sink()
    length, _ = write_framed(sink, memoryview(raw), torch.float32, (6 << 20,))
    assert sink.n == length > len(raw)
    assert sink.largest <= WRITE_PIECE
