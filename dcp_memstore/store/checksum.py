"""CRC32C checksums over memory without copying it.

crc32c uses the CPU's CRC instruction and releases the GIL, so checksumming in a background thread does
not stall the training thread's Python.
"""

from __future__ import annotations

import ctypes

import crc32c
import torch

ALGORITHM = "crc32c"


def memory_view(address: int, nbytes: int) -> memoryview:
    """A zero-copy, read-only memoryview over ``nbytes`` bytes at ``address`` (caller keeps it alive)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(address)).toreadonly()


def checksum_memory(address: int, nbytes: int) -> int:
    """CRC32C of ``nbytes`` bytes at ``address``."""
    return crc32c.crc32c(memory_view(address, nbytes))


def checksum_bytes(data: bytes | bytearray | memoryview) -> int:
    """CRC32C of a bytes-like object."""
    return crc32c.crc32c(data)


def checksum_tensor(t: torch.Tensor) -> int:
    """CRC32C of a contiguous CPU tensor's bytes."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("checksum_tensor needs a contiguous CPU tensor")
    return checksum_memory(t.data_ptr(), t.numel() * t.element_size())
