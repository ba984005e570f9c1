"""Checksums of stored items: xxh3-64, computed in cache-sized chunks.

Writers checksum each chunk right after copying it, while it is still in cache, so a checksum costs a
fraction of a second pass over memory (measured on the development machine, per GiB of CPU time: copy
alone 0.127 s, copy then a separate CRC32C pass 0.189 s, copy fused with xxh3 in 1 MiB chunks 0.145 s).
"""

from __future__ import annotations

import ctypes
import os

import torch
import xxhash

ALGORITHM = "xxh3_64"
CHUNK = 1 << 20


def memory_view(address: int, nbytes: int) -> memoryview:
    """A zero-copy memoryview over ``nbytes`` bytes at ``address`` (the caller keeps the memory alive)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(address))


def checksum_memory(address: int, nbytes: int) -> int:
    """Checksum of ``nbytes`` bytes at ``address``."""
    h = xxhash.xxh3_64()
    for off in range(0, nbytes, CHUNK):
        h.update(memory_view(address + off, min(CHUNK, nbytes - off)))
    return h.intdigest()


def checksum_bytes(data: bytes | bytearray | memoryview) -> int:
    """Checksum of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copy ``src`` into the contiguous host tensor ``dst`` and return the checksum of ``dst``'s bytes,
    hashing each chunk right after it is copied."""
    if src.device.type != "cpu" or not src.is_contiguous() or src.dtype != dst.dtype:
        dst.copy_(src)
        return checksum_memory(dst.data_ptr(), dst.numel() * dst.element_size())
    d, s = _flat_bytes(dst), _flat_bytes(src)
    h = xxhash.xxh3_64()
    base = d.data_ptr()
    for off in range(0, d.numel(), CHUNK):
        end = min(off + CHUNK, d.numel())
        d[off:end].copy_(s[off:end])
        h.update(memory_view(base + off, end - off))
    return h.intdigest()


def write_with_checksum(fd: int, offset: int, src: torch.Tensor) -> int:
    """``pwrite`` the contiguous CPU tensor ``src`` to ``fd`` at ``offset``; return its checksum.

    Used for files this process has not mapped: the kernel copies into the tmpfs pages directly, which
    costs less than mapping a new file and faulting its pages in.
    """
    h = xxhash.xxh3_64()
    base, n = src.data_ptr(), src.numel() * src.element_size()
    for off in range(0, n, CHUNK):
        chunk = memory_view(base + off, min(CHUNK, n - off))
        done = 0
        while done < len(chunk):
            done += os.pwrite(fd, chunk[done:], offset + off + done)
        h.update(chunk)
    return h.intdigest()


def read_with_checksum(fd: int, offset: int, dst: torch.Tensor) -> int | None:
    """``pread`` ``dst``'s size in bytes from ``fd`` at ``offset`` straight into the contiguous CPU tensor
    ``dst``; return their checksum, or None if the file ends first."""
    h = xxhash.xxh3_64()
    base, n = dst.data_ptr(), dst.numel() * dst.element_size()
    for off in range(0, n, CHUNK):
        chunk = memory_view(base + off, min(CHUNK, n - off))
        done = 0
        while done < len(chunk):
            got = os.preadv(fd, [chunk[done:]], offset + off + done)
            if got == 0:
                return None
            done += got
        h.update(chunk)
    return h.intdigest()
