"""Which tensors a save can store, and the error that names the others.

dcp_memstore stores a tensor as the bytes it has in memory. Those bytes are its value only for a dense
(``torch.strided``), non-quantized tensor that has data (not ``meta``) and no
``__torch_dispatch__`` of its own (a wrapper subclass keeps its values in other tensors). The writer refuses
the others by DCP's name for them before anything is written: at planning, where DCP's plan shows the
problem (layout, dtype), so that every rank fails before any copies; otherwise when a rank resolves its
items. DCP pickles tensors it does not write as tensors (inside a tuple, say), and those are left alone.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.planner import SavePlan

_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _layout_or_dtype_problem(layout: torch.layout, dtype: torch.dtype) -> str | None:
    if layout != torch.strided:
        return (
            f"a {layout} tensor; only dense (torch.strided) tensors can be saved: save a dense copy of it "
            "(to_dense() for a sparse layout)"
        )
    if dtype in _QUANTIZED:
        return (
            "a quantized tensor, whose scale and zero point raw bytes do not keep: save its dequantize(), "
            "or its int_repr() with q_scale() and q_zero_point()"
        )
    return None


def problem(t: torch.Tensor) -> str | None:
    """Why ``t``'s bytes would not hold its value (a phrase to follow "is"), or None if they do."""
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return (
            f"a {type(t).__name__}, a tensor subclass whose values are not its own bytes: save the plain "
            "tensors it is made of"
        )
    if t.device.type == "meta":
        return "a meta tensor, which has no data: materialize it (to_empty() and initialize it) first"
    return _layout_or_dtype_problem(t.layout, t.dtype)


def _refuse(name: str, why: str) -> ValueError:
    return ValueError(f"state_dict entry {name!r} is {why}")


def check_tensor(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the state dict entry ``name`` if ``problem(t)``."""
    why = problem(t)
    if why is not None:
        raise _refuse(name, why)


def check_plan(plan: SavePlan) -> None:
    """Raise ``ValueError`` for the first tensor item of ``plan`` whose layout or dtype cannot be saved."""
    for item in plan.items:
        if item.tensor_data is not None:
            props = item.tensor_data.properties
            why = _layout_or_dtype_problem(props.layout, props.dtype)
            if why is not None:
                raise _refuse(item.index.fqn, why)
