"""Agreeing across ranks without pickling: msgpack bytes exchanged as uint8 tensors."""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

from dcp_memstore.store.checksum import memory_view


def dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def other_ranks_wait() -> bool:
    """Whether this process is one of several ranks: an error it raises before DCP's first collective of
    a save or load would leave the others waiting in that collective until the group times out."""
    return dist_active() and dist.get_world_size() > 1


def _device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the CPU if it has a CPU backend (``gloo``, or a
    ``cpu:`` entry in a ``device:backend`` list), else the current GPU (``nccl`` or ``cuda:nccl`` alone)."""
    backend = str(dist.get_backend(group))
    on_cpu = "gloo" in backend or "cpu:" in backend or "nccl" not in backend
    return torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())


def all_gather_records(record: Any, group: Any = None) -> list[Any]:
    """Every rank's ``record`` (msgpack-encodable), in rank order."""
    if not dist_active():
        return [record]
    dev = _device(group)
    data = torch.frombuffer(bytearray(msgpack.packb(record, use_bin_type=True)), dtype=torch.uint8).to(dev)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    bufs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(n)]
    dist.all_gather(bufs, padded, group=group)
    out = []
    for buf, size in zip(bufs, sizes, strict=False):
        host = buf[: int(size.item())].cpu().contiguous()
        out.append(msgpack.unpackb(bytes(memory_view(host.data_ptr(), host.numel())), raw=False))
    return out
