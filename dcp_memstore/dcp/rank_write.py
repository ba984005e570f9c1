"""One rank's ``write_data``: place this rank's items into shard files, copy and checksum them.

Items that are views of this save's staging slot (``dcp.async_save``) are only checksummed, and their
files renamed into the checkpoint. Everything else is copied by ``io_threads`` threads, one shard file
each; DCP's serialised values go to one objects file.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_memstore.dcp.stager import Stager
from dcp_memstore.dcp.state_tree import own_copies_in
from dcp_memstore.dcp.storable import check_tensor
from dcp_memstore.memstore import MemStore
from dcp_memstore.store import catalog, events
from dcp_memstore.store.checksum import (
    checksum_bytes,
    checksum_memory,
    copy_with_checksum,
    write_with_checksum,
)
from dcp_memstore.store.device_copy import finish_queued_work
from dcp_memstore.store.faults import crash_point
from dcp_memstore.store.layout import objects_name, shard_name
from dcp_memstore.store.manifest import ShardLocation, dtype_name, manifest_bytes_estimate
from dcp_memstore.store.mapping import MAPPINGS, MappedFile
from dcp_memstore.store.packing import ITEM_ALIGN, pack
from dcp_memstore.store.pool import Claims, FilePool, round_up
from dcp_memstore.store.records import write_atomic
from dcp_memstore.store.space import space_errors
from dcp_memstore.store.threads import run_parallel

log = logging.getLogger(__name__)
# A staged file is renamed into the checkpoint if this rank's items fill at least this much of it. One
# they fill whole is at least 80% full: a file reused from the pool may be 25% larger than its contents.
MIN_FILL = 0.75


class RankWrite:
    """One rank's ``write_data``: place, copy, checksum, and name this rank's files of the checkpoint."""

    def __init__(
        self,
        store: MemStore,
        rank: int,
        checkpoint_id: str,
        slot: str | None,
        plan: SavePlan,
        planner: SavePlanner,
        check_space: Callable[[int, int, list[int]], None],
        reserve_ahead: bool = True,
    ) -> None:
        """``check_space(needed, rank, files)``: the writer's space check (which may first reclaim failed
        saves' files and evict beyond ``keep_in_memory``), of ``needed`` bytes, shard files of ``files``
        bytes among them. ``reserve_ahead``: a save that copies its tensors (not staged) has the next save's
        files allocated in the background once it is committed; not where nothing would claim them (DCP's
        checkpoint process)."""
        self.store = store
        self.check_space = check_space
        self.rank = rank
        self.checkpoint_id = checkpoint_id
        self.reserve_ahead = reserve_ahead
        self.dir = store.layout.checkpoint_dir(checkpoint_id)
        self.slot = slot
        self.plan, self.planner = plan, planner
        self.results: list[WriteResult] = []
        self.claimed: list[bool] = []  # per file copied into: whether it was reused (else new)
        self.slot_files: dict[tuple[int, int], str] = {}  # identity -> path of this save's staged files
        if self.slot is not None:
            for e in os.scandir(self.slot):
                st = e.stat()
                self.slot_files[(st.st_dev, st.st_ino)] = e.path

    def run(self) -> list[WriteResult]:
        started = time.perf_counter()
        staged: dict[int, tuple[MappedFile, list[tuple[WriteItem, int, torch.Tensor]]]] = {}
        to_copy: list[tuple[WriteItem, torch.Tensor]] = []
        objects: list[tuple[WriteItem, memoryview]] = []
        for item in self.plan.items:
            if item.type == WriteItemType.BYTE_IO:
                self._copy_out_of_files(item)
            data = self.planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                objects.append((item, buf))
                continue
            check_tensor(item.index.fqn, data)
            t = data.detach().resolve_conj().resolve_neg()  # raw bytes must hold the values, not lazy bits
            if t.device.type not in ("cpu", "cuda"):
                t = t.cpu()  # written from host memory (pwrite, or memcpy into the mapping)
            mf = MAPPINGS.find(t)
            mf = mf if mf is not None and mf.key in self.slot_files else None
            off = mf.contains(t) if mf is not None else None
            if off is not None:
                staged.setdefault(id(mf), (mf, []))[1].append((item, off, t))
            else:
                to_copy.append((item, t))
        sparse = self._sparse_files(staged)
        to_copy += [(item, t) for key in sparse for item, _, t in staged.pop(key)[1]]

        names: dict[int, str] = {}
        next_index = 0
        for key in staged:
            names[key] = shard_name(self.rank, next_index)
            next_index += 1
        copy_files = self._place_copies(to_copy, next_index)
        # Checked again here because with plan caching DCP hands prepare_local_plan an empty plan, and the
        # plan's sizes are whole tensors where the rank writes a shard of them.
        needed = sum(round_up(size) for _, size, _ in copy_files)
        needed += round_up(sum(len(b) + (-len(b) % ITEM_ALIGN) for _, b in objects)) if objects else 0
        needed += manifest_bytes_estimate(it.index.fqn for it in self.plan.items)
        self.check_space(needed, self.rank, [size for _, size, _ in copy_files])
        stager = Stager.of(self.store) if self.reserve_ahead and self.slot is None and copy_files else None

        jobs = [
            functools.partial(self._checksum_staged, names[k], entries) for k, (_, entries) in staged.items()
        ]
        claims = FilePool(self.store.layout, self.rank).claims([size for _, size, _ in copy_files])
        jobs += [functools.partial(self._copy_into, claims, b, f) for b, f in enumerate(copy_files)]
        finish_queued_work(t for _, t in to_copy)  # GPU tensors are copied by other threads
        for part in run_parallel(lambda job: job(), jobs, self.store.io_threads):
            self.results.extend(part)
        if stager is not None:
            gpu = next((t.device for _, t in to_copy if t.device.type == "cuda"), None)
            sizes = [size for _, size, _ in copy_files]
            stager.reserve_next(self.rank, sizes, gpu, ready=self._committed, unstaged=True)
        self._write_objects(objects)
        crash_point("write-data", self.rank)
        for key, (mf, _) in staged.items():
            os.rename(self.slot_files[mf.key], self.dir / names[key])
        if self.slot is not None:  # files this rank's items did not need, or filled too little of
            catalog.recycle(self.store.layout, Path(self.slot), staged=True)
        events.emit(
            self.store.layout, "write", self.checkpoint_id, self.rank, time.perf_counter() - started,
            nbytes=sum(r.size_in_bytes for r in self.results),
        )  # fmt: skip
        reused = sum(self.claimed)
        log.debug(
            "rank %d, checkpoint %r: shard files: %d staged by async_save, %d reused, %d new",
            self.rank, self.checkpoint_id, len(staged), reused, len(self.claimed) - reused,
        )  # fmt: skip
        return self.results

    @staticmethod
    def _sparse_files(
        staged: dict[int, tuple[MappedFile, list[tuple[WriteItem, int, torch.Tensor]]]],
    ) -> list[int]:
        """The keys of the staged files that this rank's items fill less than ``MIN_FILL`` of: their items
        are copied into files of their own, and the files go back to the pool. The stager put every value
        of the state dict into this rank's files, and DCP writes a value held by several ranks (a DDP
        model's weights) from one of them only: renamed into the checkpoint, a file would keep the values
        other ranks write too, and each rank's files the whole state dict."""
        sparse = []
        for key, (mf, entries) in staged.items():
            spans = {off: t.numel() * t.element_size() for _, off, t in entries}  # an item saved twice: once
            filled = round_up(sum(n + (-n % ITEM_ALIGN) for n in spans.values()))
            if filled < MIN_FILL * mf.size:
                sparse.append(key)
        return sparse

    def _committed(self) -> bool:
        """Whether this checkpoint is committed (then every rank's files of it exist)."""
        return catalog.read_commit(self.store.layout, self.checkpoint_id) is not None

    def _checksum_staged(
        self, name: str, entries: list[tuple[WriteItem, int, torch.Tensor]]
    ) -> list[WriteResult]:
        return [
            _tensor_result(item, name, off, t, checksum_memory(t.data_ptr(), t.numel() * t.element_size()))
            for item, off, t in entries
        ]

    def _place_copies(self, to_copy: list[tuple[WriteItem, torch.Tensor]], first_index: int) -> list:
        """Split the tensors to copy into ``io_threads`` files: (name, size, [(item, offset, tensor)])."""
        if not to_copy:
            return []
        sizes = [t.numel() * t.element_size() for _, t in to_copy]
        placements, file_sizes = pack(sizes, self.store.io_threads)
        return [
            (
                shard_name(self.rank, first_index + b),
                size,
                [(item, p.offset, t) for (item, t), p in zip(to_copy, placements, strict=True) if p.bin == b],
            )
            for b, size in enumerate(file_sizes)
        ]

    def _copy_into(self, claims: Claims, index: int, spec: tuple[str, int, list]) -> list[WriteResult]:
        """One I/O thread's file, this save's file ``index`` of ``claims``: claim it (from the pool if
        possible), copy its tensors, checksum them.

        A reused file is written through its mapping (mapped once per process, then cached: steady-state
        saves are plain memcpy); a new file is written with pwrite, which spares mapping and faulting in
        pages of a file that may never be reused here. GPU tensors always go through the (pinned) mapping."""
        name, _, entries = spec
        fd, reused = claims.claim(index, self.dir / name)
        self.claimed.append(reused)
        gpu = next((t.device for _, _, t in entries if t.device.type == "cuda"), None)
        mf = MAPPINGS.map_fd(fd) if reused or gpu is not None else None
        if gpu is not None:
            mf.pin_for_cuda(gpu)
        out = []
        try:
            for item, off, t in entries:
                if mf is not None:
                    digest = copy_with_checksum(mf.tensor(off, t.dtype, t.shape), t)
                else:
                    digest = write_with_checksum(fd, off, t.contiguous())
                out.append(_tensor_result(item, name, off, t, digest))
        finally:
            if mf is None:
                os.close(fd)
        return out

    def _copy_out_of_files(self, item: WriteItem) -> None:
        """Before DCP pickles value ``item`` whole: tensors in it that the stager put into shard files get
        copies of their own (see ``state_tree.own_copies_in``). Only in a staged save, whose state dict is
        this save's own copy, and with a planner that can look the value up (DCP's default one can)."""
        lookup = getattr(self.planner, "lookup_object", None)
        if self.slot is not None and lookup is not None:
            own_copies_in(lookup(item.index), lambda t: MAPPINGS.find(t) is not None)

    def _write_objects(self, objects: list[tuple[WriteItem, memoryview]]) -> None:
        if not objects:
            return
        name = objects_name(self.rank)
        blob = bytearray()
        for item, buf in objects:
            off = len(blob)
            blob += buf
            blob += b"\0" * (-len(blob) % ITEM_ALIGN)
            loc = ShardLocation(name, off, len(buf), checksum_bytes(buf))
            self.results.append(WriteResult(index=item.index, size_in_bytes=len(buf), storage_data=loc))
        with space_errors(self.store.layout.root, len(blob), "for the values DCP serialised"):
            write_atomic(self.dir / name, blob)


def _tensor_result(item: WriteItem, file: str, offset: int, t: torch.Tensor, digest: int) -> WriteResult:
    """DCP's record of one written tensor item: where its bytes are, their checksum, dtype and shape."""
    n = t.numel() * t.element_size()
    loc = ShardLocation(file, offset, n, digest, dtype_name(t.dtype), tuple(t.shape))
    return WriteResult(index=item.index, size_in_bytes=n, storage_data=loc)
