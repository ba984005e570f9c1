"""The per-checkpoint manifest: where every item's bytes are and their checksum, in msgpack.

Written once by the coordinator at commit. It also carries the DCP metadata in an encoded form (see
``dcp_memstore.dcp.metadata_codec``); the store treats that part as opaque. Nothing here is pickled.

The encoded manifest (on tmpfs, sent to other nodes, in persistent storage) is a msgpack map
``{"format": 2, "checksum": "xxh3_64", "digest": <xxh3-64 of body>, "body": <the record, msgpack>}``, and
every decode verifies the digest before it looks at the record. Item checksums cannot catch a damaged
manifest: a wrong dtype or shape reinterprets bytes that still hash as recorded. Format 1 had no digest and
is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch

from dcp_memstore.store.checksum import ALGORITHM, checksum_bytes
from dcp_memstore.store.ids import validate_file_name
from dcp_memstore.store.records import decode_record, read_capped, write_atomic

FORMAT_VERSION = 2
UNREADABLE = "this copy of the checkpoint cannot be read; load another checkpoint (store.list_checkpoints())"


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest records for ``dtype`` (``float32``, ``bfloat16``, ...)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a manifest's dtype name stands for; ValueError if this torch has none of that name."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint metadata")
    return dt


def item_name(fqn: str, chunk_offset: Iterable[int] | None) -> str:
    """How errors name a stored item: its fqn, and for one chunk of a sharded tensor where it starts."""
    return fqn if chunk_offset is None else f"{fqn} (chunk at {tuple(chunk_offset)})"


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

    def check_length(self) -> None:
        """ValueError unless a tensor item's stored length is what its dtype and shape take: a cheap
        cross-check that the manifest describes the bytes it points at."""
        loc = self.location
        if loc.dtype is None:
            return
        if loc.shape is None:
            raise ValueError(f"item {item_name(self.fqn, self.chunk_offset)} has a dtype but no shape")
        needed = math.prod(loc.shape) * dtype_from_name(loc.dtype).itemsize
        if loc.length != needed or any(s < 0 for s in loc.shape):
            raise ValueError(
                f"item {item_name(self.fqn, self.chunk_offset)} in {loc.file} is {loc.length} bytes long, "
                f"but {loc.dtype} of shape {list(loc.shape)} takes {needed}"
            )


@dataclass
class Manifest:
    checkpoint_id: str
    world_size: int
    items: list[ManifestItem]
    dcp: dict[str, Any]
    created: float = field(default_factory=time.time)
    source: str = field(default="", compare=False)  # where it was decoded from (a path or URL), for errors

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
        """The manifest's record (the body the encoded form carries with its digest)."""
        return {
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
        items = [
            ManifestItem(
                str(fqn), None if off is None else tuple(int(o) for o in off), ShardLocation.from_record(loc)
            )
            for fqn, off, loc in r["items"]
        ]
        return cls(str(r["checkpoint_id"]), int(r["world_size"]), items, r["dcp"], float(r["created"]))

    def encode(self) -> bytes:
        """The manifest as written to disk, sent to other nodes and persisted (msgpack, with its digest)."""
        body = msgpack.packb(self.to_record(), use_bin_type=True)
        return msgpack.packb(
            {"format": FORMAT_VERSION, "checksum": ALGORITHM, "digest": checksum_bytes(body), "body": body},
            use_bin_type=True,
        )

    def write(self, path: Path) -> None:
        write_atomic(path, self.encode())

    @classmethod
    def decode(cls, data: bytes, source: str, checkpoint_id: str | None = None) -> Manifest:
        """The manifest encoded in ``data``, read from ``source`` (a path or URL, which every error names).

        ValueError if its digest does not match (any damage to it), if it is of another format, malformed,
        of another checkpoint than ``checkpoint_id`` (when given), names a file that is not a plain name in
        the checkpoint, or records a tensor item whose length is not what its dtype and shape take."""
        try:
            m = cls.from_record(decode_record(_verified_body(data), "its body"))
            if checkpoint_id is not None and m.checkpoint_id != checkpoint_id:
                raise ValueError(f"it is the manifest of {m.checkpoint_id!r}, not of {checkpoint_id!r}")
            for f in m.files:
                validate_file_name(f)
            for it in m.items:
                it.check_length()
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            problem = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
            raise ValueError(f"{source}: {problem}; {UNREADABLE}") from e
        m.source = source
        return m

    @classmethod
    def read(cls, path: Path, checkpoint_id: str | None = None) -> Manifest:
        """The manifest in file ``path``; FileNotFoundError if there is none, else as ``decode``."""
        return cls.decode(read_capped(path), str(path), checkpoint_id)


def _verified_body(data: bytes) -> bytes:
    """The record inside an encoded manifest, once its digest matches; ValueError saying what is wrong."""
    envelope = decode_record(data, "it")
    if not isinstance(envelope, dict):
        raise ValueError(f"unsupported manifest (a {type(envelope).__name__}, not a map)")
    fmt, algorithm = envelope.get("format"), envelope.get("checksum")
    if fmt != FORMAT_VERSION or algorithm != ALGORITHM:
        raise ValueError(
            f"unsupported manifest (format {fmt!r}, checksum {algorithm!r}; this version reads format "
            f"{FORMAT_VERSION} with {ALGORITHM}): written by another version of dcp_memstore, or damaged"
        )
    body, digest = envelope.get("body"), envelope.get("digest")
    if not isinstance(body, bytes) or checksum_bytes(body) != digest:
        raise ValueError(f"the manifest is corrupt: its {ALGORITHM} checksum does not match its contents")
    return body
