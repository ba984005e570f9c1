"""Reading items of a persisted checkpoint: ranged, parallel reads of the raw bytes, checksum verified.

Our manifest beside the persisted files records where each item's raw bytes start inside its torch.save
archive, so we fetch exactly those bytes (nothing is unpickled) in ranges of ``RANGE`` bytes on several
threads, then check the item's xxh3-64 checksum.
"""

from __future__ import annotations

import ctypes

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_memstore.persist.publish import read_remote_manifest
from dcp_memstore.persist.target import PersistTarget
from dcp_memstore.store.checksum import checksum_memory
from dcp_memstore.store.manifest import Manifest, ShardLocation
from dcp_memstore.store.threads import run_parallel

RANGE = 8 << 20


class RemoteCheckpoint:
    """A persisted checkpoint, read item by item."""

    def __init__(self, target: PersistTarget, checkpoint_id: str, threads: int) -> None:
        self.target, self.checkpoint_id, self.threads = target, checkpoint_id, threads
        self.manifest: Manifest = read_remote_manifest(target, checkpoint_id)
        self.locations: dict[MetadataIndex, ShardLocation] = {
            MetadataIndex(it.fqn, it.chunk_offset): it.location for it in self.manifest.items
        }

    def describe(self, loc: ShardLocation) -> str:
        return self.target.url_of(self.checkpoint_id) + "/" + loc.file

    def size(self, loc: ShardLocation) -> int:
        """The size in bytes of the persisted object that holds ``loc`` (to say how short it is)."""
        return self.target.fs.size(self.target.path(self.checkpoint_id, loc.file))

    def fetch(self, loc: ShardLocation) -> tuple[torch.Tensor, int | None]:
        """The item's raw bytes as a uint8 tensor, and their checksum (None if the object is short); a
        FileNotFoundError naming the object's URL if it is gone."""
        buf = torch.empty(loc.length, dtype=torch.uint8)
        if loc.length == 0:
            return buf, checksum_memory(0, 0)
        path = self.target.path(self.checkpoint_id, loc.file)
        fs = self.target.fs
        short = False

        def one(start: int) -> None:
            nonlocal short
            end = min(start + RANGE, loc.length)
            data = fs.cat_file(path, start=loc.offset + start, end=loc.offset + end)
            if len(data) != end - start:
                short = True
                return
            ctypes.memmove(buf.data_ptr() + start, data, end - start)

        try:
            run_parallel(one, range(0, loc.length, RANGE), self.threads, pool="fetch")
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{self.describe(loc)} is gone from the persisted copy of checkpoint {self.checkpoint_id!r} "
                "(deleted there since it was published): load another checkpoint"
            ) from e
        return buf, None if short else checksum_memory(buf.data_ptr(), loc.length)
