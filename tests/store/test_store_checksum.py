"""Checksums computed chunk by chunk (fused with a copy, a pwrite or a pread) equal the checksum of the bytes,
whatever the size relative to the chunk sizes."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from dcp_memstore.store.checksum import (
    CHUNK,
    IO_CHUNK,
    checksum_memory,
    copy_with_checksum,
    read_with_checksum,
    write_with_checksum,
)

SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 777, IO_CHUNK + 5, 2 * IO_CHUNK]


@pytest.mark.parametrize("n", SIZES)
def test_every_chunked_checksum_is_the_checksum_of_the_bytes(n, shm_dir):
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    expected = xxhash.xxh3_64_intdigest(src.numpy().tobytes())
    dst = torch.zeros(n, dtype=torch.uint8)
    assert copy_with_checksum(dst, src) == expected
    assert torch.equal(dst, src)
    assert checksum_memory(src.data_ptr(), n) == expected
    fd = os.open(shm_dir / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert write_with_checksum(fd, 64, src) == expected
        back = torch.zeros(n, dtype=torch.uint8)
        assert read_with_checksum(fd, 64, back) == expected
        assert torch.equal(back, src)
    finally:
        os.close(fd)
