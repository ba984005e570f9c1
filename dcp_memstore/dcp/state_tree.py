"""Walking a state dict's tensors: plain tensors, DTensor local shards, ShardedTensor local shards.

``tensors`` lists them in a fixed order; ``rebuild`` returns the same structure with each of those tensors
replaced (in the same order) and every other value copied, which is what a stager must hand to DCP: a
state dict that later training steps cannot change. Both go only where DCP's traversal goes (dicts, and
lists that hold a tensor, a dict or such a list): DCP pickles any other value whole, a tuple say, and a
tensor in it must be a copy of its own, not a view of a shard file, whose whole storage would be pickled
with it.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.remote_device import _remote_device
from torch.distributed.tensor import DTensor

_ATOMS = (type(None), bool, int, float, complex, str, bytes)  # values a copy would return unchanged


def _traversed_list(value: Any) -> bool:
    """Whether ``value`` is a list that DCP goes into (as its ``traverse_state_dict`` decides) instead of
    pickling it whole."""
    return isinstance(value, list) and any(
        isinstance(v, (torch.Tensor, dict)) or _traversed_list(v) for v in value
    )


def _children(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        yield from value.values()
    elif _traversed_list(value):
        yield from value


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor whose bytes a save stores, in traversal order."""
    out: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, DTensor):
            out.append(v._local_tensor)  # the very object rebuild() sees, not a fresh view
        elif isinstance(v, ShardedTensor):
            out.extend(s.tensor for s in v.local_shards())
        elif isinstance(v, torch.Tensor):
            out.append(v)
        else:
            for c in _children(v):
                walk(c)

    walk(value)
    return out


def rebuild(value: Any, replace: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor that ``tensors(value)`` lists passed through ``replace``, and a copy of
    each value DCP pickles whole."""
    whole = _pickled_whole(value)
    return _rebuild(value, replace, iter(_through_pickle(whole) if whole else ()))


def _rebuild(value: Any, replace: Callable[[torch.Tensor], torch.Tensor], copies: Iterator[Any]) -> Any:
    if isinstance(value, DTensor):
        return _dtensor_like(value, replace(value._local_tensor))
    if isinstance(value, ShardedTensor):
        return _sharded_like(value, [replace(s.tensor) for s in value.local_shards()])
    if isinstance(value, torch.Tensor):
        return replace(value)
    if isinstance(value, dict):  # DCP flattens mappings, so a plain dict stands in for any dict type
        return {k: _rebuild(v, replace, copies) for k, v in value.items()}
    if _traversed_list(value):
        return [_rebuild(v, replace, copies) for v in value]
    return value if isinstance(value, _ATOMS) else next(copies)


def own_copies_in(value: Any, in_file: Callable[[torch.Tensor], bool]) -> None:
    """Replace, in place inside ``value`` (a dict or list that DCP is about to pickle whole), each tensor
    that views a shard file (``in_file``) by a copy of its own; DTensors and ShardedTensors are rebuilt
    around the copies. Pickled as a view, a tensor carries its whole storage, the shard file, and torch
    refuses to pickle views of one storage as different dtypes. This is for staged values that DCP
    pickles after all: with ``flatten_state_dict=False`` it pickles every nested dict, whose tensors the
    stager put into shard files like every other."""
    keys = list(value) if isinstance(value, dict) else range(len(value)) if _traversed_list(value) else ()
    for k in keys:
        child = value[k]
        if isinstance(child, (torch.Tensor, ShardedTensor)):  # a DTensor is a torch.Tensor
            if any(in_file(t) for t in tensors(child)):
                value[k] = rebuild(child, lambda t: t.clone() if in_file(t) else t)
        else:
            own_copies_in(child, in_file)


def _pickled_whole(value: Any) -> list[Any]:
    """The values in ``value`` that DCP pickles whole (other than immutable atoms), in traversal order."""
    out: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, (torch.Tensor, ShardedTensor, _ATOMS)):
            return
        if isinstance(v, dict) or _traversed_list(v):
            for c in _children(v):
                walk(c)
        else:
            out.append(v)

    walk(value)
    return out


def _through_pickle(values: list[Any]) -> list[Any]:
    """``values`` saved with ``torch.save`` and loaded back, all at once, onto the CPU (as DCP's own stager
    copies them). The copy holds what DCP's pickle of the live values would hold now (views of one storage,
    parameters, ``requires_grad``, references to themselves), which ``copy.deepcopy`` does not always give,
    and it refuses no tensor that DCP's pickle takes (deepcopy refuses those that are not graph leaves)."""
    buf = io.BytesIO()
    torch.save(values, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=False)  # bytes made here, just now


def _dtensor_like(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local`` (a staged copy of its
    local tensor), wherever ``local`` lives. Not ``DTensor.from_local``: that moves a local tensor onto
    the mesh's device, which for a GPU mesh would copy the staged tensor back to the GPU.

    The DTensor is made around an empty placeholder and given the real local tensor afterwards, as DCP's
    own stager does: a DTensor takes its local tensor's storage offset, and torch cannot pickle one whose
    offset is not 0 (pickle raises; DCP's PROCESS executor segfaults sending it to its checkpoint
    process), while staged locals are views at offsets inside shard files."""
    dt = DTensor(local.new_empty(0), like._spec, requires_grad=local.requires_grad)
    dt._local_tensor = local
    return dt


def _sharded_like(like: ShardedTensor, locals_: list[torch.Tensor]) -> ShardedTensor:
    """A ShardedTensor with ``like``'s global metadata around ``locals_`` (staged copies of its local
    shards, on the CPU). Its metadata places every shard on the CPU, as ``ShardedTensor.to("cpu")`` does,
    and says pinned if the staged shards are (views of a page-locked shard file)."""
    pins = [torch.cuda.is_initialized() and t.is_pinned() for t in locals_]
    if any(pins) and not all(pins):  # torch wants one pin state for all local shards: copy the pinned out
        locals_ = [t.clone() if p else t for t, p in zip(locals_, pins, strict=True)]
    pinned = bool(pins) and all(pins)
    meta = copy.deepcopy(like.metadata())
    meta.tensor_properties.pin_memory = pinned
    for m in meta.shards_metadata:
        m.placement = _on_cpu(m.placement)
    shards = [
        Shard(t, dataclasses.replace(s.metadata, placement=_on_cpu(s.metadata.placement)))
        for s, t in zip(like.local_shards(), locals_, strict=True)
    ]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=like._process_group
    )


def _on_cpu(placement: _remote_device | None) -> _remote_device | None:
    return None if placement is None else _remote_device(f"rank:{placement.rank()}/cpu")
