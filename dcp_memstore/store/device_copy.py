"""Device-to-host copies of CUDA tensors into shard file mappings.

Preferred path: the mapping is page-locked (``MappedFile.pin_for_cuda``) and each tensor is one
non-blocking copy on a side stream, DMA straight into tmpfs pages. Fallback, where the driver refuses to
register the mapping (or ``DCP_MEMSTORE_NO_HOST_REGISTER=1`` forces it, for tests): chunks go through two
pinned bounce buffers, reused across checkpoints, so the DMA of one chunk overlaps the memcpy of the
previous one into the mapping. Either way ``copy`` returns once every byte is on the host.
"""

from __future__ import annotations

import os

import torch

from dcp_memstore.store.mapping import MappedFile

CHUNK_BYTES = 32 << 20
ENV_NO_REGISTER = "DCP_MEMSTORE_NO_HOST_REGISTER"


class DeviceToHost:
    """Copies GPU tensors into host views of mapped files; holds its side stream and bounce buffers."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._stream: torch.cuda.Stream | None = None
        self._bounce: list[torch.Tensor] = []

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor, MappedFile]]) -> None:
        """Copy each CUDA ``src`` into its host ``dst`` (a view of ``mf``); returns when all have landed."""
        if not pairs:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())  # the values the trainer computed so far
        force_bounce = os.environ.get(ENV_NO_REGISTER) == "1"
        bounced = []
        with torch.cuda.stream(stream):
            for src, dst, mf in pairs:
                if not force_bounce and mf.pin_for_cuda():
                    dst.copy_(src.detach(), non_blocking=True)
                else:
                    bounced.append((src, dst))
        keep_alive = []
        if bounced:
            keep_alive = self._through_bounce_buffers(bounced, stream)
        stream.synchronize()
        del keep_alive  # temporaries the side stream read from live until it is done with them

    def _through_bounce_buffers(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream
    ) -> list[torch.Tensor]:
        if not self._bounce:
            self._bounce = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
        events = [torch.cuda.Event(), torch.cuda.Event()]
        pending: list[tuple[int, torch.Tensor, int] | None] = [None, None]  # (buffer, destination, length)
        k = 0
        sources = []
        for src, dst in pairs:
            # A contiguous copy, if one is needed, is made on the stream that reads it.
            with torch.cuda.stream(stream):
                s = src.detach().contiguous().reshape(-1).view(torch.uint8)
            sources.append(s)
            d = dst.reshape(-1).view(torch.uint8)
            for off in range(0, s.numel(), self.chunk_bytes):
                n = min(self.chunk_bytes, s.numel() - off)
                b = k % 2
                self._drain(pending, events, b)  # buffer b must be emptied before it is refilled
                with torch.cuda.stream(stream):
                    self._bounce[b][:n].copy_(s[off : off + n], non_blocking=True)
                    events[b].record(stream)
                pending[b] = (b, d[off : off + n], n)
                k += 1
        for b in (k % 2, (k + 1) % 2):
            self._drain(pending, events, b)
        return sources

    def _drain(self, pending: list, events: list[torch.cuda.Event], b: int) -> None:
        if pending[b] is not None:
            _, dest, n = pending[b]
            events[b].synchronize()
            dest.copy_(self._bounce[b][:n])
            pending[b] = None
