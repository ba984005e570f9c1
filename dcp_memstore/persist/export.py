"""Upload one shard file of a committed checkpoint in the standard DCP layout.

Each local file ``__<rank>_<k>.shard`` (or ``__<rank>_objects.bin``) becomes one remote file
``__<rank>_<k>.distcp``: its items in order, tensors framed by ``torch.save`` and serialized values as raw
bytes, exactly what stock ``FileSystemReader``/``FsspecReader`` read. Bytes stream from the tmpfs mapping
into the file system's writer in pieces of 4 MiB (for s3fs: multipart parts of ``BLOCK_SIZE``, uploaded
one after another), so memory used per upload stays under two parts, whatever the file's size. The
remote file is replaced whole or not at all (``PersistTarget.open_whole``): uploads of one file by two
nodes are idempotent. Each item's checksum is computed from the very pieces that are sent, as they are
sent (memory is read once), and checked when the item is written: the persisted copy is what a reader
falls back to when a copy in memory is corrupt, so a corrupt one must never become it. A mismatch raises
inside ``open_whole``, which then discards the upload (the temporary file; the multipart upload).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dcp_memstore.persist.framing import write_framed, write_in_pieces
from dcp_memstore.persist.open_uploads import OpenUploads
from dcp_memstore.persist.target import PersistTarget
from dcp_memstore.store.checksum import hasher, memory_view
from dcp_memstore.store.manifest import ManifestItem, dtype_from_name
from dcp_memstore.store.mapping import MAPPINGS

BLOCK_SIZE = 16 << 20  # multipart part size: bounds the persister's memory per concurrent upload
# What torch's FileSystemWriter stamps as the version of the checkpoints whose files it frames as these
# are; the stock .metadata of a persisted checkpoint says it too, so stock readers take it for theirs.
STOCK_FORMAT_VERSION = "1.0.0"


def remote_name(local_name: str) -> str:
    """The persisted file name for local shard file ``local_name``."""
    return local_name.rsplit(".", 1)[0] + ".distcp"


@dataclass(frozen=True)
class PersistedItem:
    """Where one item landed in its remote file: the stock-DCP slice (``offset``, ``length``) and, inside it,
    where the raw bytes start (``payload``, relative to the file)."""

    index: int  # position of the item in the local manifest
    offset: int
    length: int
    payload: int

    def to_record(self) -> list[int]:
        return [self.index, self.offset, self.length, self.payload]

    @classmethod
    def from_record(cls, r: list) -> PersistedItem:
        return cls(*(int(x) for x in r))


def upload_file(
    target: PersistTarget,
    checkpoint_id: str,
    local_dir: Path,
    file: str,
    items: list[tuple[int, ManifestItem]],
    written: Callable[[], None] = lambda: None,
    uploads: OpenUploads | None = None,
) -> list[PersistedItem]:
    """Upload local ``file`` (whose items, with their manifest positions, are ``items``) and return where
    each item landed; ``written`` is called once every item is sent, before the remote file is complete
    (a crash point); ``uploads`` records a multipart upload while it is open (``open_whole``). Raises
    whatever the file system raises, and ValueError for an item that is not in the file or fails its
    checksum; the remote file is then as it was (``open_whole``)."""
    mf = MAPPINGS.map_path(local_dir / file)
    path = target.path(checkpoint_id, remote_name(file))
    placed: list[PersistedItem] = []
    pos = 0
    with target.open_whole(path, BLOCK_SIZE, uploads) as out:
        for index, item in sorted(items, key=lambda x: x[1].location.offset):
            loc = item.location
            if loc.offset + loc.length > mf.size:
                raise ValueError(f"{local_dir / file} is shorter than its manifest says ({item.fqn})")
            data = memory_view(mf.address + loc.offset, loc.length)
            h = hasher()  # the manifest's checksum, of the bytes sent
            if loc.dtype is None:
                write_in_pieces(out, data, h.update)
                length, payload = loc.length, 0
            else:
                length, payload = write_framed(out, data, dtype_from_name(loc.dtype), loc.shape, h.update)
            if h.intdigest() != loc.checksum:  # a reader falls back to the persisted copy: it must be whole
                raise ValueError(
                    f"{local_dir / file}: item {item.fqn} does not match its checksum (expected xxh3_64 "
                    f"{loc.checksum:#018x}, got {h.intdigest():#018x}): this copy in memory is corrupt and "
                    "is not uploaded; the checkpoint stays held in memory until store.delete(id)"
                )
            placed.append(PersistedItem(index, pos, length, pos + payload))
            pos += length
        written()
    size = target.fs.size(path)
    if size != pos:
        raise OSError(f"{path}: uploaded {size} bytes, expected {pos}")
    return placed
