"""Publishing a persisted checkpoint, and finding published ones.

Each rank records every file it uploaded as a part record (``.dcp_memstore/parts/<file>``). When all the
checkpoint's files have parts, the publisher writes, in this order: our manifest (remote locations and
checksums, msgpack), the stock ``.metadata`` (pickled DCP Metadata, what stock readers look for), and last
our COMMITTED marker. Each is one atomic object; before ``.metadata`` exists neither stock DCP nor we take
the directory for a checkpoint, and we list only directories with COMMITTED.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable

import msgpack
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_memstore.dcp.metadata_codec import decode_metadata
from dcp_memstore.persist.export import STOCK_FORMAT_VERSION, PersistedItem, remote_name
from dcp_memstore.persist.target import (
    COMMITTED,
    MANIFEST,
    PARTS,
    STOCK_METADATA,
    PersistTarget,
    describe,
    literal,
)
from dcp_memstore.store.catalog import CommitRecord
from dcp_memstore.store.manifest import Manifest, ManifestItem, ShardLocation

log = logging.getLogger(__name__)


def write_part(target: PersistTarget, commit: CommitRecord, file: str, placed: list[PersistedItem]) -> None:
    """Record that ``file`` of the save ``commit`` is uploaded and where its items are."""
    body = msgpack.packb({"commit": commit.to_record(), "items": [p.to_record() for p in placed]})
    target.put_atomic(target.path(commit.checkpoint_id, PARTS, file), body)


def read_parts(target: PersistTarget, commit: CommitRecord) -> dict[str, list[PersistedItem]]:
    """The part records of the save ``commit`` uploaded so far (not those of an earlier save under the same
    id), by local file name."""
    checkpoint_id = commit.checkpoint_id
    fs = target.fs
    directory = target.path(checkpoint_id, PARTS)
    try:
        paths = [
            p
            for p in fs.ls(directory, detail=False, refresh=True)
            if not p.rsplit("/", 1)[-1].startswith(".")
        ]
    except FileNotFoundError:
        return {}
    out: dict[str, list[PersistedItem]] = {}
    for path, body in fs.cat([literal(p) for p in paths], on_error="omit").items():
        r = msgpack.unpackb(body)
        if r.get("commit") == commit.to_record():
            out[path.rsplit("/", 1)[-1]] = [PersistedItem.from_record(x) for x in r["items"]]
    return out


def publish(
    target: PersistTarget,
    manifest: Manifest,
    commit: CommitRecord,
    parts: dict[str, list[PersistedItem]],
    before_marker: Callable[[], None] = lambda: None,
) -> None:
    """Make the persisted checkpoint visible (all of ``manifest``'s files must be in ``parts``).
    ``before_marker`` runs between ``.metadata`` and the COMMITTED marker (a crash point for tests)."""
    cid = manifest.checkpoint_id
    missing = sorted(set(manifest.files) - set(parts))
    if missing:
        raise ValueError(f"cannot publish {cid!r}: files not uploaded yet: {missing}")
    placed = {p.index: (file, p) for file, ps in parts.items() for p in ps}
    remote_items: list[ManifestItem] = []
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for i, it in enumerate(manifest.items):
        file, p = placed[i]
        loc = it.location
        name = remote_name(file)
        remote_items.append(
            ManifestItem(
                it.fqn,
                it.chunk_offset,
                ShardLocation(name, p.payload, loc.length, loc.checksum, loc.dtype, loc.shape),
            )
        )
        storage[MetadataIndex(it.fqn, it.chunk_offset)] = _StorageInfo(name, p.offset, p.length)
    remote = Manifest(cid, manifest.world_size, remote_items, manifest.dcp, manifest.created)
    target.put_atomic(target.path(cid, MANIFEST), remote.encode())
    stock = decode_metadata(manifest.dcp, storage)
    stock.version = STOCK_FORMAT_VERSION
    target.put_atomic(target.path(cid, STOCK_METADATA), pickle.dumps(stock))
    before_marker()
    target.put_atomic(target.path(cid, COMMITTED), msgpack.packb(commit.to_record()))


class DamagedMarkerError(ValueError):
    """A persisted commit marker that cannot be decoded. Its copy is not listed, and nothing uploads over
    it (whose save it was cannot be told): someone removes it. Permanent."""


def _decode_marker(target: PersistTarget, checkpoint_id: str, body: bytes) -> CommitRecord:
    try:
        return CommitRecord.from_record(checkpoint_id, msgpack.unpackb(body))
    except Exception as e:  # noqa: BLE001 - any damage, whatever the decoder raises
        url = target.url_of(checkpoint_id)
        raise DamagedMarkerError(
            f"the commit marker {url}/{COMMITTED} is damaged ({type(e).__name__}: {e}): that copy is not "
            f"used. Remove {url} there, then store.persist(id) uploads it again while it is in memory; "
            "or save under another id"
        ) from e


def remote_commit(target: PersistTarget, checkpoint_id: str) -> CommitRecord | None:
    """The commit record of persisted checkpoint ``checkpoint_id``, or None if it is not (fully) persisted.
    DamagedMarkerError if its marker cannot be decoded."""
    try:
        body = target.fs.cat_file(target.path(checkpoint_id, COMMITTED))
    except FileNotFoundError:
        return None
    return _decode_marker(target, checkpoint_id, body)


def remote_committed(target: PersistTarget) -> list[CommitRecord]:
    """Every fully persisted checkpoint under the target, oldest commit first. A damaged commit marker is
    passed over with a warning naming it (the other checkpoints still count); one that cannot be read
    now (the server failed that request) fails the whole listing, naming it, rather than leave that
    checkpoint out of it; one deleted since the listing is left out."""
    fs = target.fs
    target.forget_listings()
    try:
        markers = fs.glob(f"{literal(target.root)}/*/{COMMITTED}")
    except FileNotFoundError:
        return []
    if not markers:
        return []
    out = []
    for path, body in fs.cat([literal(m) for m in markers], on_error="return").items():
        cid = path[len(target.root) + 1 :].split("/", 1)[0]
        if isinstance(body, FileNotFoundError):
            continue
        if isinstance(body, BaseException):
            raise OSError(f"cannot read {target.url_of(cid)}/{COMMITTED}: {describe(body)}") from body
        try:
            out.append(_decode_marker(target, cid, body))
        except DamagedMarkerError as e:  # that checkpoint is not listed; the others are
            log.warning("persisted checkpoint %r is not listed: %s", cid, e)
    return sorted(out, key=lambda r: (r.committed_at, r.seq))


def read_remote_manifest(target: PersistTarget, checkpoint_id: str) -> Manifest:
    """Our manifest of a persisted checkpoint (remote file names, payload offsets, checksums); ValueError
    naming it if it is damaged (see ``Manifest.decode``)."""
    data = target.fs.cat_file(target.path(checkpoint_id, MANIFEST))
    return Manifest.decode(data, f"{target.url_of(checkpoint_id)}/{MANIFEST}", checkpoint_id)
