"""``MemoryStorageReader``: DCP's StorageReader over a ``MemStore``.

Reads are zero-copy up to the destination: each stored item is a view of the mapped shard file, DCP's
planner narrows it to the requested region (resharding), and one ``copy_`` moves it into the destination
tensor (host-to-device straight from tmpfs pages for GPU destinations). Checksums of every item read are
verified first, in parallel, unless the store turns verification off.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_memstore.dcp.metadata_codec import decode_metadata, dtype_from_name
from dcp_memstore.errors import ChecksumMismatchError
from dcp_memstore.store.checksum import checksum_memory, memory_view
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import MANIFEST
from dcp_memstore.store.manifest import Manifest, ShardLocation
from dcp_memstore.store.mapping import MAPPINGS, MappedFile
from dcp_memstore.store.memstore import MemStore
from dcp_memstore.store.threads import run_parallel


class MemoryStorageReader(StorageReader):
    """Reads DCP checkpoints from a ``MemStore``; pass it as ``storage_reader`` to ``dcp.load`` with
    ``checkpoint_id`` set to a committed checkpoint's name (e.g. ``store.latest_checkpoint()``)."""

    def __init__(self, store: MemStore) -> None:
        if not isinstance(store, MemStore):
            raise TypeError(f"MemoryStorageReader needs a MemStore, got {type(store).__name__}")
        super().__init__()
        self.store = store
        self.checkpoint_id: str | None = None
        self._dir: Path | None = None
        self._storage_data: dict[MetadataIndex, ShardLocation] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is None:
            raise ValueError(
                "dcp.load with MemoryStorageReader needs checkpoint_id='NAME', e.g. store.latest_checkpoint()"
            )
        self.checkpoint_id = validate_name(checkpoint_id)
        self._dir = self.store.require_checkpoint(self.checkpoint_id)
        self._storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            validate_name(checkpoint_id)
            return True
        except ValueError:
            return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._dir is None:
            raise ValueError("MemoryStorageReader.read_metadata called before reset(checkpoint_id)")
        manifest = Manifest.read(self._dir / MANIFEST)
        self._storage_data = {MetadataIndex(it.fqn, it.chunk_offset): it.location for it in manifest.items}
        return decode_metadata(manifest.dcp, dict(self._storage_data))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not self._storage_data:
            self._storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._dir is not None
        files: dict[str, MappedFile] = {}
        for name in sorted({self._storage_data[r.storage_index].file for r in plan.items}):
            files[name] = MAPPINGS.map_path(self._dir / name)
        if self.store.verify_checksums:
            self._verify(plan.items, files)
        copies = []
        for req in plan.items:
            loc = self._storage_data[req.storage_index]
            mf = files[loc.file]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(memory_view(mf.address + loc.offset, loc.length))))
                continue
            src = mf.tensor(loc.offset, dtype_from_name(loc.dtype), loc.shape)
            src = narrow_tensor_by_index(src, req.storage_offsets, req.lengths)
            dst = planner.resolve_tensor(req).detach()
            if dst.size() != src.size():
                raise ValueError(
                    f"{req.storage_index.fqn}: stored region {tuple(src.size())} does not match "
                    f"destination {tuple(dst.size())}"
                )
            if dst.is_cuda:
                mf.pin_for_cuda()  # host-to-device from page-locked tmpfs pages
            copies.append((req, src, dst))
        run_parallel(lambda c: c[2].copy_(c[1]), copies, self.store.io_threads)
        for req, _, dst in copies:
            planner.commit_tensor(req, dst)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _verify(self, items: list[ReadItem], files: dict[str, MappedFile]) -> None:
        unique = {}
        for req in items:
            unique.setdefault((req.storage_index.fqn, req.storage_index.offset), req.storage_index)

        def check(index: MetadataIndex) -> None:
            loc = self._storage_data[index]
            mf = files[loc.file]
            if loc.offset + loc.length > mf.size:
                raise ChecksumMismatchError(str(self._dir / loc.file), _item_name(index), loc.checksum, 0)
            actual = checksum_memory(mf.address + loc.offset, loc.length)
            if actual != loc.checksum:
                raise ChecksumMismatchError(
                    str(self._dir / loc.file), _item_name(index), loc.checksum, actual
                )

        run_parallel(check, unique.values(), self.store.io_threads)


def _item_name(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn} (chunk at {tuple(index.offset)})"
