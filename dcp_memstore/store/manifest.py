"""The per-checkpoint manifest: where every item's bytes are and their checksum, in msgpack.

Written once by the coordinator at commit. It also carries the DCP metadata in an encoded form (see
``dcp_memstore.dcp.metadata_codec``); the store treats that part as opaque. Nothing here is pickled.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from dcp_memstore.store.checksum import ALGORITHM
from dcp_memstore.store.ids import validate_file_name
from dcp_memstore.store.records import decode_record, read_record, write_atomic

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardLocation:
    """Where one stored item lives: ``length`` bytes at ``offset`` of ``file`` (a name in the checkpoint
    directory), with their xxh3-64 checksum. Tensor items also record dtype and chunk shape so they can be
    viewed without any other metadata."""

    file: str
    offset: int
    length: int
    checksum: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def to_record(self) -> list:
        return [
            self.file,
            self.offset,
            self.length,
            self.checksum,
            self.dtype,
            None if self.shape is None else list(self.shape),
        ]

    @classmethod
    def from_record(cls, r: list) -> ShardLocation:
        file, offset, length, checksum, dtype, shape = r
        return cls(
            str(file),
            int(offset),
            int(length),
            int(checksum),
            None if dtype is None else str(dtype),
            None if shape is None else tuple(int(s) for s in shape),
        )


MANIFEST_BYTES_PER_ITEM = 192  # measured: 172 with names of a few characters, plus 4 per character


def manifest_bytes_estimate(fqns: Iterable[str]) -> int:
    """More than the manifest of items named ``fqns`` takes: each item's entry and its share of DCP's
    metadata (which names it again), for checking free space before a save writes anything."""
    return 4096 + sum(MANIFEST_BYTES_PER_ITEM + 4 * len(f) for f in fqns)


@dataclass
class ManifestItem:
    fqn: str
    chunk_offset: tuple[int, ...] | None
    location: ShardLocation


@dataclass
class Manifest:
    checkpoint_id: str
    world_size: int
    items: list[ManifestItem]
    dcp: dict[str, Any]
    created: float = field(default_factory=time.time)

    @property
    def files(self) -> dict[str, int]:
        """Each file the checkpoint uses, with the bytes of it that hold data."""
        out: dict[str, int] = {}
        for it in self.items:
            end = it.location.offset + it.location.length
            out[it.location.file] = max(out.get(it.location.file, 0), end)
        return out

    @property
    def nbytes(self) -> int:
        return sum(it.location.length for it in self.items)

    def to_record(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "checksum": ALGORITHM,
            "checkpoint_id": self.checkpoint_id,
            "world_size": self.world_size,
            "created": self.created,
            "items": [
                [it.fqn, None if it.chunk_offset is None else list(it.chunk_offset), it.location.to_record()]
                for it in self.items
            ],
            "dcp": self.dcp,
        }

    @classmethod
    def from_record(cls, r: dict) -> Manifest:
        if not isinstance(r, dict) or r.get("format") != FORMAT_VERSION or r.get("checksum") != ALGORITHM:
            raise ValueError(
                f"unsupported manifest (format {r.get('format') if isinstance(r, dict) else r!r})"
            )
        items = [
            ManifestItem(
                str(fqn), None if off is None else tuple(int(o) for o in off), ShardLocation.from_record(loc)
            )
            for fqn, off, loc in r["items"]
        ]
        return cls(str(r["checkpoint_id"]), int(r["world_size"]), items, r["dcp"], float(r["created"]))

    def encode(self) -> bytes:
        """The manifest as written to disk and sent to other nodes (msgpack)."""
        return msgpack.packb(self.to_record(), use_bin_type=True)

    def write(self, path: Path) -> None:
        write_atomic(path, self.encode())

    @classmethod
    def decode(cls, data: bytes, checkpoint_id: str) -> Manifest:
        """The manifest of checkpoint ``checkpoint_id`` from bytes received from a peer; ValueError if it
        is malformed, of another checkpoint, or names a file that is not a plain name in the checkpoint."""
        try:
            m = cls.from_record(decode_record(data, f"the manifest of {checkpoint_id}"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"the manifest of {checkpoint_id} is malformed: {e}") from e
        if m.checkpoint_id != checkpoint_id:
            raise ValueError(f"the manifest is of checkpoint {m.checkpoint_id!r}, not {checkpoint_id!r}")
        for f in m.files:
            validate_file_name(f)
        return m

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            return cls.from_record(read_record(path))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e
