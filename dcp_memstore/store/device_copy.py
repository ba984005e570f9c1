"""Device-to-host copies of CUDA tensors into shard file mappings.

Preferred path: the mapping is page-locked (``MappedFile.pin_for_cuda``) and each tensor is one
non-blocking copy on a side stream, DMA straight into tmpfs pages. Fallback, where the driver refuses to
register the mapping (or ``DCP_MEMSTORE_NO_HOST_REGISTER=1`` forces it, for tests): chunks go through two
pinned bounce buffers, reused across checkpoints, so the DMA of one chunk overlaps the memcpy of the
previous one into the mapping. Either way ``copy`` returns once every byte is on the host.

``finish_queued_work`` orders the blocking copies that I/O threads make of GPU tensors (a synchronous
save's, a load's) after the work the caller queued on them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from dcp_memstore.store.mapping import MappedFile, cuda_index

CHUNK_BYTES = 32 << 20
ENV_NO_REGISTER = "DCP_MEMSTORE_NO_HOST_REGISTER"


def finish_queued_work(tensors: Iterable[torch.Tensor]) -> None:
    """Block until the work this thread has queued on each GPU of ``tensors`` (on its current stream there)
    is done, before other threads copy from or into them: their copies run on their own current stream, the
    GPU's default stream, which is not ordered after a stream the caller made current (torch's streams do
    not synchronize with the default stream), so they would read values not computed yet, or be overwritten
    by work queued before them. For the same reason an I/O thread calls it after its copies into them,
    before the caller uses them. A no-op for tensors not on a GPU."""
    for device in {cuda_index(t.device) for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with its conjugate and negative bits resolved (a new tensor, made on the current
    stream, only where one is set): a tensor whose bytes are its values."""
    return t.detach().resolve_conj().resolve_neg()


class DeviceToHost:
    """Copies GPU tensors into host views of mapped files; holds its side streams and bounce buffers."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._streams: dict[int, torch.cuda.Stream] = {}  # one side stream per GPU
        self._bounce: list[torch.Tensor] = []

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor, MappedFile]]) -> None:
        """Copy each CUDA ``src`` into its host ``dst`` (a view of ``mf``); returns when all have landed.

        Each GPU's copies run on that GPU's side stream, after the work already queued on its current
        stream (the values the trainer computed so far), whichever GPU is current in this thread. Also on
        an error, this returns only once the copies already queued are done: the caller then gives the
        files back, and no DMA may still be writing into them."""
        by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor, MappedFile]]] = {}
        for pair in pairs:
            by_device.setdefault(cuda_index(pair[0].device), []).append(pair)
        force_bounce = os.environ.get(ENV_NO_REGISTER) == "1"
        used: list[torch.cuda.Stream] = []
        # The temporaries made here (resolved conj/neg bits, contiguous copies) are made on the side stream
        # that reads them and let go once their copies are queued: the caching allocator gives a freed
        # block only to later allocations on the same stream, which run after those copies. Holding them
        # all to the end would hold their sum of GPU memory at once.
        try:
            for device, group in by_device.items():
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                used.append(stream)
                bounced = []
                with torch.cuda.stream(stream):
                    for src, dst, mf in group:
                        if not force_bounce and mf.pin_for_cuda(device):
                            # conj/neg bits resolved on the GPU: copy_ resolves them on the host tensor
                            # right after it queues the DMA, before the bytes have landed
                            dst.copy_(_plain(src), non_blocking=True)
                        else:
                            bounced.append((src, dst))
                if bounced:
                    self._through_bounce_buffers(bounced, stream)
        finally:
            for stream in used:
                stream.synchronize()

    def _through_bounce_buffers(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream
    ) -> None:
        if not self._bounce:
            self._bounce = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
        events = [torch.cuda.Event(), torch.cuda.Event()]
        pending: list[tuple[int, torch.Tensor, int] | None] = [None, None]  # (buffer, destination, length)
        k = 0
        for src, dst in pairs:
            # A contiguous copy, if one is needed, is made on the stream that reads it (see ``copy``).
            with torch.cuda.stream(stream):
                s = _plain(src).contiguous().reshape(-1).view(torch.uint8)
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

    def _drain(self, pending: list, events: list[torch.cuda.Event], b: int) -> None:
        if pending[b] is not None:
            _, dest, n = pending[b]
            events[b].synchronize()
            dest.copy_(self._bounce[b][:n])
            pending[b] = None
