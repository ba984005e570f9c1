"""DCP ``Metadata`` to and from msgpack-encodable values, so reading a checkpoint unpickles nothing.

Covers what DCP's planners put there: tensor and bytes storage metadata, the planner's flattening map (tuples
of str/int, tagged ``{"__tuple__": [...]}``; a dict whose one key is that tag, such as the map of a state dict
with that one key, is stored as ``{"__tuple__": {...}}``), storage meta and version. Anything else in
``planner_data`` raises a TypeError that names the offending value at save time, never a silent loss. A
tensor's strides, which DCP records from torch 2.15 on, are kept where DCP gave them and given back where the
installed torch has the field, so a checkpoint moves between torch releases as DCP's own pickled metadata
does.

A tensor's ``pin_memory`` is recorded, and read back (from older manifests too), as False. DCP takes it
from the tensor it planned from, which for ``async_save`` is the staged copy: a view of a shard file,
page-locked on a GPU machine and not elsewhere, so the same state dict would record True on one machine
and False on another. It says nothing of the checkpoint, and True breaks a load that allocates from the
metadata on a GPU (``load_sharded_optimizer_state_dict``: "Only dense CPU tensors can be pinned").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_memstore.store.manifest import (
    UNREADABLE,
    Manifest,
    ManifestItem,
    ShardLocation,
    dtype_from_name,
    dtype_name,
    item_name,
)

_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve": torch.preserve_format,
}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
_TUPLE = "__tuple__"
_HAS_STRIDES = "strides" in TensorProperties.__dataclass_fields__  # torch 2.15 and later


def _plain(value: Any, where: str) -> Any:
    """Encode planner data: plain values, lists, tuples (tagged) and str-keyed dicts."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_plain(v, where) for v in value]}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        plain = {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
        # a dict whose one key is the tag would read back as a tuple: escaped as the tag over a dict
        return {_TUPLE: plain} if set(plain) == {_TUPLE} else plain
    raise TypeError(
        f"{where} holds a {type(value).__name__}, which dcp_memstore cannot store without pickling; "
        "a custom planner's planner_data may hold only None, bool, int, float, str, bytes, lists, tuples "
        "and dicts with str keys"
    )


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            tagged = value[_TUPLE]
            if isinstance(tagged, dict):  # an escaped dict (see _plain); a tuple is tagged as a list
                return {k: _unplain(v) for k, v in tagged.items()}
            return tuple(_unplain(v) for v in tagged)
        return {k: _unplain(v) for k, v in value.items()}
    return value


def _encode_storage_md(md: Any) -> dict:
    if isinstance(md, BytesStorageMetadata):
        return {"kind": "bytes"}
    p = md.properties
    encoded = {
        "kind": "tensor",
        "dtype": dtype_name(p.dtype),
        "requires_grad": bool(p.requires_grad),
        "memory_format": _MEMORY_FORMAT_NAMES.get(p.memory_format, "contiguous"),
        "pin_memory": False,  # see the module docstring
        "size": list(md.size),
        "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
    }
    strides = getattr(p, "strides", None)
    if strides is not None:
        encoded["strides"] = [int(x) for x in strides]
    return encoded


def _decode_storage_md(r: dict) -> Any:
    if r["kind"] == "bytes":
        return BytesStorageMetadata()
    props = TensorProperties(
        dtype=dtype_from_name(r["dtype"]),
        requires_grad=r["requires_grad"],
        memory_format=_MEMORY_FORMATS[r["memory_format"]],
        pin_memory=False,  # see the module docstring
    )
    if _HAS_STRIDES and r.get("strides") is not None:
        props.strides = tuple(r["strides"])
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in r["chunks"]]
    return TensorStorageMetadata(properties=props, size=torch.Size(r["size"]), chunks=chunks)


def encode_metadata(md: Metadata) -> dict:
    """Everything of ``md`` except ``storage_data`` (the store's manifest items carry that)."""
    sm = md.storage_meta
    return {
        "state_dict_metadata": {fqn: _encode_storage_md(v) for fqn, v in md.state_dict_metadata.items()},
        "planner_data": _plain(md.planner_data, "planner_data"),
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        },
        "version": md.version,
    }


def with_stored_dtypes(md: Metadata, items: Iterable[ManifestItem]) -> Metadata:
    """``md`` with each tensor's dtype as its ``items`` were written (``md`` itself where they agree).

    They differ where DCP's save-plan cache (``DefaultSavePlanner(enable_plan_caching=True)``) handed
    back an earlier save's metadata: its check of a cached plan compares sizes and chunks, not dtypes, so a
    tensor whose dtype changed since (a model cast to bf16, say) keeps the old dtype there, while its
    items hold the new dtype's bytes. Committed as it was, such a checkpoint could not be read.
    FileSystemWriter's files carry their own dtypes, so stock DCP reads the new one too. A tensor whose
    chunks were written with different dtypes raises ValueError (DCP's metadata has one dtype a tensor)."""
    written: dict[str, set[str]] = {}
    for it in items:
        if it.location.dtype is not None:
            written.setdefault(it.fqn, set()).add(it.location.dtype)
    fixed = {}
    for fqn, entry in md.state_dict_metadata.items():
        dtypes = written.get(fqn)
        if not isinstance(entry, TensorStorageMetadata) or not dtypes:
            continue
        if len(dtypes) > 1:
            raise ValueError(
                f"the chunks of tensor {fqn!r} were written as {sorted(dtypes)}; give it one dtype on every "
                "rank"
            )
        (dtype,) = dtypes
        if dtype != dtype_name(entry.properties.dtype):
            props = dataclasses.replace(entry.properties, dtype=dtype_from_name(dtype))
            fixed[fqn] = dataclasses.replace(entry, properties=props)
    if not fixed:
        return md
    return dataclasses.replace(md, state_dict_metadata={**md.state_dict_metadata, **fixed})


def decode_metadata(r: dict, storage_data: dict[MetadataIndex, Any]) -> Metadata:
    sm = r["storage_meta"]
    return Metadata(
        state_dict_metadata={fqn: _decode_storage_md(v) for fqn, v in r["state_dict_metadata"].items()},
        planner_data=_unplain(r["planner_data"]),
        storage_data=storage_data,
        storage_meta=None
        if sm is None
        else StorageMeta(
            checkpoint_id=sm["checkpoint_id"],
            save_id=sm["save_id"],
            load_id=sm["load_id"],
            modules=sm["modules"],
        ),
        version=r["version"],
    )


def metadata_of(manifest: Manifest) -> Metadata:
    """The DCP metadata ``manifest`` carries, with the manifest's item locations as its ``storage_data``.

    ValueError naming the manifest if that metadata does not decode, or lists an item the manifest does
    not hold or holds with another dtype or shape. Checked before anything is read: a load would otherwise
    fail later with a bare KeyError, or fill its tensors from bytes read as the wrong dtype or shape."""
    locations = {MetadataIndex(it.fqn, it.chunk_offset): it.location for it in manifest.items}
    try:
        md = decode_metadata(manifest.dcp, dict(locations))
        for fqn, entry in md.state_dict_metadata.items():
            _check_stored(fqn, entry, locations)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        problem = (
            str(e) if type(e) is ValueError else f"its DCP metadata is malformed ({type(e).__name__}: {e})"
        )
        raise ValueError(f"{manifest.source}: {problem}; {UNREADABLE}") from e
    return md


def _check_stored(fqn: str, entry: Any, locations: dict[MetadataIndex, ShardLocation]) -> None:
    """ValueError unless every item DCP's metadata lists for ``fqn`` is in ``locations`` with the dtype and
    shape DCP's metadata gives it (none for serialised values)."""
    if isinstance(entry, BytesStorageMetadata):
        expected = {MetadataIndex(fqn): (None, None)}
    else:
        dtype = dtype_name(entry.properties.dtype)
        expected = {MetadataIndex(fqn, c.offsets): (dtype, tuple(c.sizes)) for c in entry.chunks}
    for index, (dtype, shape) in expected.items():
        loc = locations.get(index)
        name = item_name(fqn, index.offset)
        if loc is None:
            raise ValueError(f"DCP's metadata lists item {name}, which the manifest has no entry for")
        if (loc.dtype, loc.shape) != (dtype, shape):
            raise ValueError(
                f"item {name} is stored as {loc.dtype or 'bytes'} of shape {loc.shape}, but DCP's metadata "
                f"says {dtype or 'bytes'} of shape {shape}"
            )
