"""``MemoryStorageReader``: DCP's StorageReader over a ``MemStore``.

Reads are zero-copy up to the destination: each stored item is a view of the mapped shard file, DCP's
planner narrows it to the requested region (resharding), and one ``copy_`` moves it into the destination
tensor (host-to-device straight from tmpfs pages for GPU destinations). Every item read is checked against
its checksum, unless the store turns verification off: whole items into CPU tensors are hashed while they
are copied, other reads verify the stored item before copying from it. Files are read in parallel, except
reads whose destinations share memory: those run in plan order on one thread; so do all the reads of a
planner with its own ``resolve_tensor`` or ``commit_tensor``, each between its two calls.

A load holds this node's copy of its checkpoint (a retention hold, ``catalog.process_hold``) from
``read_metadata`` until ``read_data`` ends, so saves committing meanwhile, in this process or another,
neither evict it nor reuse its files while they are read. A load that fails in between (its planner
raises; DCP tells the reader nothing) releases it when DCP drops that load's metadata.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_memstore.dcp import storable
from dcp_memstore.dcp.metadata_codec import metadata_of
from dcp_memstore.errors import ChecksumMismatchError, CorruptShardError, TruncatedShardError
from dcp_memstore.memstore import CheckpointSource, MemStore
from dcp_memstore.store import catalog
from dcp_memstore.store.checksum import (
    checksum_bytes,
    checksum_memory,
    copy_with_checksum,
    memory_view,
    read_with_checksum,
)
from dcp_memstore.store.collective import other_ranks_wait
from dcp_memstore.store.device_copy import finish_queued_work
from dcp_memstore.store.ids import is_valid_name, validate_name
from dcp_memstore.store.layout import MANIFEST
from dcp_memstore.store.manifest import Manifest, ShardLocation, dtype_from_name, dtype_name, item_name
from dcp_memstore.store.mapping import MAPPINGS, MappedFile
from dcp_memstore.store.space import FULL_ERRNOS
from dcp_memstore.store.threads import run_parallel

if TYPE_CHECKING:
    from dcp_memstore.persist.remote_read import RemoteCheckpoint

log = logging.getLogger(__name__)
NEEDS_CHECKPOINT_ID = (
    "dcp.load with MemoryStorageReader needs checkpoint_id='NAME', e.g. store.latest_checkpoint(); "
    "every load names the checkpoint it reads"
)


class MemoryStorageReader(StorageReader):
    """Reads DCP checkpoints from a ``MemStore``; pass it as ``storage_reader`` to ``dcp.load`` with
    ``checkpoint_id`` set to a committed checkpoint's name (e.g. ``store.latest_checkpoint()``)."""

    def __init__(self, store: MemStore) -> None:
        if not isinstance(store, MemStore):
            raise TypeError(f"MemoryStorageReader needs a MemStore, got {type(store).__name__}")
        super().__init__()
        self.store = store
        self.checkpoint_id: str | None = None
        self._source: CheckpointSource | None = None
        self._storage_data: dict[MetadataIndex, ShardLocation] = {}
        self._loaded = False
        self._deferred_error: Exception | None = None  # of reset(), raised where every rank plans the load
        self._read_error: Exception | None = None  # of this load's read_metadata (see _rank_local_metadata)
        self._hold: weakref.finalize | None = None  # releases this load's retention hold, once
        # (file identity, offset, length) of the stored items this load verified, so that an item several
        # reads take regions of (DCP's resharding) is hashed once, also where they are read one at a time
        # (a copy fetched again after a failed check is a new file: verified again)
        self._verified: set[tuple[tuple[int, int], int, int]] = set()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Aim the next load at ``checkpoint_id`` (``dcp.load`` calls this with its ``checkpoint_id``, and
        not at all when that is None). DCP's older entry points (``load_state_dict``,
        ``load_sharded_optimizer_state_dict``) call it without one: the next load then reads the checkpoint
        this reader was last aimed at, as a ``FileSystemReader`` reads its path."""
        self._storage_data, self._loaded, self._deferred_error, self._read_error = {}, False, None, None
        self._source = None  # until the new aim is found: a failed reset leaves no earlier checkpoint to load
        try:
            if checkpoint_id is None:
                if self.checkpoint_id is None:
                    raise ValueError(NEEDS_CHECKPOINT_ID)
                checkpoint_id = self.checkpoint_id
            self.checkpoint_id = validate_name(checkpoint_id)
            self._source = self.store.open_checkpoint(self.checkpoint_id)
        except Exception as e:
            if not other_ranks_wait():
                raise
            # dcp.load calls this before its collectives; a rank that raised here would leave the others
            # waiting in them: the load fails in read_metadata (a collective step), on every rank at once
            self._source, self._deferred_error = None, e

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_valid_name(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if "rank" in kwargs:
            return self._rank_local_metadata()
        self._read_error = None
        try:
            return self._read_metadata()
        except Exception as e:
            self._read_error = e
            raise

    def _rank_local_metadata(self) -> Metadata:
        """DCP's fallback after a failed ``read_metadata()``. There is no rank-local metadata, and a load
        that went on without collectives on this rank alone would leave the other ranks waiting in them.

        Where this load's read failed, the answer is an empty metadata that lets DCP go on to
        ``set_up_storage_reader``, which raises that read's error, where every rank plans the load. DCP
        2.10 and 2.11 drop the errors of both reads and raise a bare ``AssertionError: metadata is None``,
        so the user would never see why the checkpoint could not be read (a corrupt manifest, a missing
        checkpoint id); 2.12 and later put the two messages in that AssertionError's text."""
        if self._read_error is None:
            raise ValueError(
                "MemoryStorageReader has no rank-local metadata; the checkpoint's could not be read"
            )
        return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        if self._deferred_error is not None:
            raise self._deferred_error
        src = self._source
        if src is None or self._loaded:
            # dcp.load skips reset() when checkpoint_id is None: never load a checkpoint it did not name
            raise ValueError(NEEDS_CHECKPOINT_ID)
        self._release_hold()  # of an earlier load that failed between read_metadata and read_data
        try:
            self._source = src = self._held(src)
            metadata = None
            if src.local_dir is not None:
                try:
                    metadata = metadata_of(Manifest.read(src.local_dir / MANIFEST))
                except (ValueError, FileNotFoundError) as e:  # damaged here: read another tier's copy
                    self._release_hold()
                    self._source = src = self.store.instead_of_local(src.checkpoint_id, e)
            if metadata is None and src.cluster is not None:
                src.fetch_dir.mkdir(parents=True, exist_ok=True)
                metadata = metadata_of(src.cluster.manifest(src.fetch_dir))
            elif metadata is None:
                metadata = metadata_of(src.remote.manifest)
        except BaseException:
            self._release_hold()
            raise
        self._tie_hold(metadata)
        self._storage_data = dict(metadata.storage_data)
        return metadata

    def _held(self, src: CheckpointSource) -> CheckpointSource:
        """``src``, with this node's copy held against eviction until the load ends: a save that commits
        meanwhile (in this process or another) would otherwise evict it and hand its files to a new save
        while they are read, and the load would copy that save's bytes. The hold is released when
        ``read_data`` ends, else (the load failed in between: DCP says nothing) when DCP drops the load's
        metadata (``_tie_hold``) or this reader reads the metadata of its next load; eviction drops it if
        this process dies. A copy evicted since ``reset`` is looked up again: in another tier, or
        FileNotFoundError naming the committed checkpoints. On a tmpfs too full for the hold's record the
        load goes on without it, with a warning: a job must be able to resume from a full tmpfs."""
        if src.local_dir is None:
            return src  # nothing of it on this node to evict
        try:
            name = catalog.process_hold(self.store.layout, src.checkpoint_id, "load")
        except OSError as e:
            if e.errno not in FULL_ERRNOS:
                raise
            log.warning(
                "no room in %s for the record that holds checkpoint %r while it is loaded (%s); loading it "
                "without: a save of this job that commits meanwhile could evict it",
                self.store.layout.root, src.checkpoint_id, e,
            )  # fmt: skip
            return src
        if name is None:
            return self._held(self.store.open_checkpoint(src.checkpoint_id))
        self._hold = weakref.finalize(self, catalog.release, self.store.layout, src.checkpoint_id, name)
        return src

    def _tie_hold(self, metadata: Metadata) -> None:
        """Let this load's hold live as long as ``metadata``, which DCP (and its planner) keeps until the
        load ends, rather than as long as this reader: a load that fails before ``read_data`` then releases
        it when DCP drops that metadata (with the error, which a reference cycle may keep until the garbage
        collector runs), not at this reader's next load, which a job that trains on may never make."""
        if self._hold is not None:
            _, release, args, _ = self._hold.detach()
            self._hold = weakref.finalize(metadata, release, *args)

    def _release_hold(self) -> None:
        """Release this load's retention hold, if it has one."""
        if self._hold is not None:
            self._hold()
            self._hold = None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._read_error is not None:  # DCP went on with _rank_local_metadata's stand-in
            error, self._read_error = self._read_error, None
            raise error
        if not self._storage_data:
            self._storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._source is not None
        self._loaded = True  # one load per reset: the next one names its checkpoint again
        # A process that only loads (an evaluation job) never saves, which is where mappings of files
        # deleted since (by another process's delete or pool trim) are dropped; each keeps its memory.
        MAPPINGS.prune()
        self._verified = set()
        try:
            self._read_plan(plan, planner)
        finally:
            self._release_hold()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan`` into the planner's destinations, then hand them to the planner in
        plan order (the planner is called from this thread only). A planner with its own
        ``resolve_tensor`` or ``commit_tensor`` gets each item's pair of calls in turn (``_read_in_pairs``).

        Files are read in parallel, one task per file. Reads whose destinations share memory (one tensor
        under two keys, as tied weights loading an untied checkpoint; overlapping views) run in plan order
        in one task of their own: the item later in the plan wins, as with FileSystemReader, and no other
        thread writes into a destination while it is copied and hashed (which made the result random and
        failed intact checkpoints with ChecksumMismatchError)."""
        if _pairs_tensors(planner):
            self._read_in_pairs(plan, planner)
            return
        reads = []
        for req in plan.items:
            loc = self._storage_data[req.storage_index]
            dst = None if req.type == LoadItemType.BYTE_IO else planner.resolve_tensor(req).detach()
            reads.append(_Read(req, loc, dst))
        shared = _shares_memory(reads)
        by_file: dict[str, list[_Read]] = {}
        for r, s in zip(reads, shared, strict=True):
            if not s:
                by_file.setdefault(r.loc.file, []).append(r)
        tasks = [[file_reads] for file_reads in by_file.values()]
        in_order = [r for r, s in zip(reads, shared, strict=True) if s]
        if in_order:
            tasks.insert(0, [list(run) for _, run in itertools.groupby(in_order, key=lambda r: r.loc.file)])
        finish_queued_work(r.dst for r in reads if r.dst is not None)  # GPU destinations: see there
        run_parallel(self._read_runs, tasks, self.store.io_threads)
        for r in reads:
            if r.dst is None:
                planner.load_bytes(r.req, io.BytesIO(r.data))
            else:
                planner.commit_tensor(r.req, r.dst)

    def _read_in_pairs(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read the items of ``plan`` one by one in plan order on this thread (and its current GPU stream),
        each tensor between its ``resolve_tensor`` and its ``commit_tensor``, as FileSystemReader does."""
        for req in plan.items:
            loc = self._storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                r = _Read(req, loc, None)
                self._read_file_or_fall_back([r])
                planner.load_bytes(req, io.BytesIO(r.data))
            else:
                r = _Read(req, loc, planner.resolve_tensor(req).detach())
                self._read_file_or_fall_back([r])
                planner.commit_tensor(req, r.dst)

    def _read_runs(self, runs: list[list[_Read]]) -> None:
        """Read ``runs`` one after another, each the reads of one file; return once the copies into GPU
        destinations are done. A host-to-device ``copy_`` into a destination that is not contiguous (DCP's
        resharding narrows destinations, a transposed or channels-last parameter) lands in a temporary
        and ends with a device-side copy that is only queued, on this thread's stream, which the caller's
        own current stream is not ordered after."""
        try:
            for run in runs:
                self._read_file_or_fall_back(run)
        finally:
            finish_queued_work(r.dst for run in runs for r in run if r.dst is not None)

    def _read_file_or_fall_back(self, reads: list[_Read]) -> None:
        """Read one file's items from the nearest tier that has it intact: this node's copy, else a replica
        this node keeps for another node, else a copy fetched from another node's memory, else the
        persisted copy (the last error stands if none)."""
        src = self._source
        file = reads[0].loc.file
        error: Exception | None = None
        if src.local_dir is not None:
            try:
                self._read_file(src.local_dir, reads)
                return
            except (FileNotFoundError, CorruptShardError) as e:
                error = e
        for directory in src.kept_replicas(file):
            try:
                self._read_file(directory, reads)
            except (FileNotFoundError, CorruptShardError) as e:
                error = e
                continue
            log.warning("%s; read it from the replica this node keeps in %s instead", error, directory)
            return
        if src.cluster is not None and src.cluster.has(file):
            # this node's own copy failed already: fetch from the others, and from the next holder when
            # a fetched copy fails its item checksums (the transfer checksum only proves the transfer)
            tried = {src.cluster.own_copy} if error is not None else set()
            damaged = [error] if isinstance(error, CorruptShardError) else []
            dest = src.fetch_dir / file
            src.fetch_dir.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    if not dest.exists():
                        tried.add(src.cluster.fetch(file, dest, tried))
                    self._read_file(src.fetch_dir, reads)
                except CorruptShardError as e:
                    dest.unlink(missing_ok=True)
                    error = e
                    damaged.append(e)
                    continue
                except FileNotFoundError as e:  # no holder left
                    error = _no_intact_copy(file, src.checkpoint_id, damaged, e) if damaged else e
                    break
                if error is not None:
                    log.warning("%s; read it from another node's memory instead", error)
                return
        try:
            remote = src.remote
        except FileNotFoundError as gone:  # persisted once, that copy deleted since: say both
            raise FileNotFoundError(
                f"file {file} of checkpoint {src.checkpoint_id!r} cannot be read from memory "
                f"({error}); {gone}"
            ) from error
        if remote is None:
            if error is None or isinstance(error, FileNotFoundError):
                raise FileNotFoundError(
                    f"file {file} of checkpoint {src.checkpoint_id!r} is in no tier"
                    f"{f' ({error})' if error else ''}; load another checkpoint (store.list_checkpoints())"
                ) from error
            raise error
        if error is not None:
            log.warning("%s; reading it from %s instead", error, remote.target.url_of(src.checkpoint_id))
        for r in reads:
            self._read_remote(remote, r)

    def _read_remote(self, remote: RemoteCheckpoint, r: _Read) -> None:
        """Read ``r`` from the persisted copy, checked against the checksum this checkpoint recorded."""
        loc = remote.locations[r.req.storage_index]
        buf, actual = remote.fetch(loc)
        r.loc = dataclasses.replace(loc, checksum=r.loc.checksum)
        if actual is None:
            raise _truncated(remote.describe(loc), r, remote.size(loc))
        self._check(r, actual, remote.describe(loc))
        if r.dst is None:
            r.data = bytes(memory_view(buf.data_ptr(), loc.length))
        else:
            r.dst.copy_(_region(buf.view(dtype_from_name(loc.dtype)).view(loc.shape), r))

    def _read_file(self, directory: Path, reads: list[_Read]) -> None:
        """Read one file's items into their destinations, verifying checksums.

        Whole items into contiguous CPU destinations, from a file this process has not mapped (a restart),
        are read with pread straight into the destination and hashed chunk by chunk while in cache.
        Everything else (resharded regions, GPU destinations, files already mapped here) is copied from
        the file's mapping."""
        path = directory / reads[0].loc.file
        st = os.stat(path)
        _check_size(path, st.st_size, reads)  # an emptied or truncated file, before it is mapped
        if MAPPINGS.is_mapped((st.st_dev, st.st_ino)) or not all(r.whole() for r in reads):
            self._read_mapped(MAPPINGS.map_path(path), reads, path)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for r in reads:
                    if r.dst is None:
                        r.data = _pread_all(fd, r.loc.length, r.loc.offset)
                        actual = checksum_bytes(r.data) if len(r.data) == r.loc.length else None
                    else:
                        actual = read_with_checksum(fd, r.loc.offset, r.dst)
                    if actual is None:  # the file shrank while it was read
                        raise _truncated(path, r, os.fstat(fd).st_size)
                    self._check(r, actual, path)
            finally:
                os.close(fd)

    def _read_mapped(self, mf: MappedFile, reads: list[_Read], path: Path) -> None:
        """Copy each read from the mapping. A whole item into a CPU tensor is hashed chunk by chunk as it
        is copied (one pass over the bytes); other reads verify the stored item first, once per item."""
        _check_size(path, mf.size, reads)  # the mapping's size: the file may have changed since its stat
        verified = self._verified
        for r in reads:
            loc, item = r.loc, (mf.key, r.loc.offset, r.loc.length)
            if item not in verified and self.store.verify_checksums and r.dst is not None and r.whole():
                stored = mf.tensor(loc.offset, r.dst.dtype, loc.shape)
                self._check(r, copy_with_checksum(r.dst, stored), path)
                verified.add(item)
                continue
            if item not in verified:
                if self.store.verify_checksums:
                    actual = checksum_memory(mf.address + loc.offset, loc.length)
                else:
                    actual = loc.checksum  # not verified: skip the pass over the bytes
                self._check(r, actual, path)
                verified.add(item)
            if r.dst is None:
                r.data = bytes(memory_view(mf.address + loc.offset, loc.length))
                continue
            src = _region(mf.tensor(loc.offset, dtype_from_name(loc.dtype), loc.shape), r)
            if r.dst.is_cuda:
                mf.pin_for_cuda(r.dst.device)  # host-to-device from page-locked tmpfs pages
            r.dst.copy_(src)

    def _check(self, r: _Read, actual: int, path: Path | str) -> None:
        """Raise ChecksumMismatchError unless ``actual`` is the recorded checksum (or verification is off)."""
        if self.store.verify_checksums and actual != r.loc.checksum:
            raise ChecksumMismatchError(str(path), _item_name(r.req.storage_index), r.loc.checksum, actual)


@dataclass
class _Read:
    """One ReadItem, where its bytes are, and where they go (``dst``, or ``data`` for serialised values)."""

    req: ReadItem
    loc: ShardLocation
    dst: torch.Tensor | None
    data: bytes = b""
    plain: bool = field(init=False)  # dst is a tensor whose bytes are its values (storable.problem)

    def __post_init__(self) -> None:
        self.plain = self.dst is not None and storable.problem(self.dst) is None

    def whole(self) -> bool:
        """True if the whole stored item goes unchanged into a contiguous CPU tensor whose bytes are its
        value (or is bytes); anything else is copied with ``copy_``, which a tensor subclass dispatches."""
        if self.dst is None:
            return True
        return (
            self.dst.device.type == "cpu"
            and self.plain
            and not self.dst.is_conj()  # its bytes are the conjugate (or negation) of its values
            and not self.dst.is_neg()
            and self.dst.is_contiguous()
            and dtype_name(self.dst.dtype) == self.loc.dtype
            and tuple(self.dst.shape) == self.loc.shape
            and not any(self.req.storage_offsets)
        )


def _pairs_tensors(planner: LoadPlanner) -> bool:
    """Whether ``planner`` has a ``resolve_tensor`` or ``commit_tensor`` of its own. DCP calls the two "in
    pair for each Tensor value", and such a planner may hold state from one to the other (Megatron's
    MCoreLoadPlanner keeps one intermediate tensor, for FP8 destinations, and asserts that the commit
    follows its resolve), so its items are not read in parallel. DCP's own planners hold none."""
    cls = type(planner)
    return (
        cls.resolve_tensor is not DefaultLoadPlanner.resolve_tensor
        or cls.commit_tensor is not DefaultLoadPlanner.commit_tensor
    )


def _region(stored: torch.Tensor, r: _Read) -> torch.Tensor:
    """The part of a stored item that read ``r`` asks for (DCP resharding), checked against its
    destination."""
    src = narrow_tensor_by_index(stored, r.req.storage_offsets, r.req.lengths)
    if r.dst.size() != src.size():
        raise ValueError(
            f"{r.req.storage_index.fqn}: stored region {tuple(src.size())} does not "
            f"match destination {tuple(r.dst.size())}"
        )
    return src


def _shares_memory(reads: list[_Read]) -> list[bool]:
    """For each read, whether its destination's memory overlaps another read's destination. Byte spans
    (from the first to one past the last element, so interleaved strided views count as overlapping)
    are sorted by start, per device: O(n log n) in the reads. A destination whose bytes are not plain
    memory of its own (a tensor subclass, whose copy_ writes where it decides; sparse, meta) counts as
    overlapping, to be safe."""
    shared = [False] * len(reads)
    by_device: dict[torch.device, list[tuple[int, int, int]]] = {}
    for i, r in enumerate(reads):
        dst = r.dst
        if dst is None or dst.numel() == 0:
            continue
        if not r.plain:
            shared[i] = True
            continue
        if dst.is_contiguous():
            nbytes = dst.nbytes
        else:
            last = sum((n - 1) * stride for n, stride in zip(dst.shape, dst.stride(), strict=True))
            nbytes = (last + 1) * dst.element_size()
        start = dst.data_ptr()
        by_device.setdefault(dst.device, []).append((start, start + nbytes, i))
    for spans in by_device.values():
        spans.sort()
        first, end = 0, 0  # the group's first span not marked yet, and the group's end
        for k, (start, stop, _) in enumerate(spans):
            if start >= end:  # overlaps no span before it: a new group
                first, end = k, stop
                continue
            end = max(end, stop)
            for *_, i in spans[first : k + 1]:
                shared[i] = True
            first = k + 1
    return shared


def _item_name(index: MetadataIndex) -> str:
    return item_name(index.fqn, index.offset)


def _no_intact_copy(
    file: str, checkpoint_id: str, damaged: list[Exception], last: Exception
) -> CorruptShardError:
    """The error of a file whose copies that could be read all failed their checks (``damaged``) and that
    no other node can give (``last``): the damage is the cause, not a file missing everywhere."""
    why = "; ".join(str(d).rstrip(".") for d in damaged)
    return CorruptShardError(f"no intact copy of file {file} of checkpoint {checkpoint_id!r}: {why}; {last}")


def _truncated(path: Path | str, r: _Read, size: int) -> TruncatedShardError:
    """The error for read ``r`` from ``path``, a file of ``size`` bytes that ends before its item does."""
    return TruncatedShardError(str(path), _item_name(r.req.storage_index), size, r.loc.offset + r.loc.length)


def _pread_all(fd: int, nbytes: int, offset: int) -> bytes:
    """``nbytes`` bytes of ``fd`` from ``offset``, fewer only if the file ends first. One read returns at
    most 2 GiB - 4 KiB on Linux, so a longer value (a big pickled object) takes several."""
    pieces, got = [], 0
    while got < nbytes:
        more = os.pread(fd, nbytes - got, offset + got)
        if not more:
            break
        pieces.append(more)
        got += len(more)
    return b"".join(pieces)


def _check_size(path: Path, size: int, reads: list[_Read]) -> None:
    """TruncatedShardError if the file at ``path`` (``size`` bytes) ends before one of ``reads``' items.
    Checked before anything is read: reading a mapping past the end of its file is a SIGBUS."""
    for r in reads:
        if r.loc.offset + r.loc.length > size:
            raise _truncated(path, r, size)
