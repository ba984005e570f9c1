"""Helpers for the single-process DCP tests: training states to save and bit-exact comparison of trees."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.dcp.stager import Stager


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (so -0.0 != 0.0 and NaN payloads count)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_tree_equal(expected: Any, actual: Any, path: str = "") -> None:
    """Same structure, same types, and every tensor the same dtype, shape and bytes."""
    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert torch.equal(bits(actual), bits(expected)), f"{where}: bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual).__name__}"
        assert list(actual.keys()) == list(expected.keys()), (
            f"{where}: keys {list(actual)} != {list(expected)}"
        )
        for k in expected:
            assert_tree_equal(expected[k], actual[k], f"{path}.{k}" if path else str(k))
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), (
            f"{where}: {type(actual).__name__} != {type(expected).__name__}"
        )
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_tree_equal(e, a, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r} != {expected!r}"


def snapshot(tree: Any) -> Any:
    """A deep copy of ``tree`` with every tensor cloned (what a checkpoint of it must hold)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [snapshot(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(snapshot(v) for v in tree)
    return tree


def blank_like(tree: Any) -> Any:
    """Same structure as ``tree``, tensors zeroed (or flipped for bool), other leaves set to different
    values."""
    if isinstance(tree, torch.Tensor):
        return ~tree.detach().clone() if tree.dtype == torch.bool else torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: blank_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [blank_like(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(blank_like(v) for v in tree)
    if isinstance(tree, bool):
        return not tree
    if isinstance(tree, (int, float)):
        return type(tree)(-12345)
    if isinstance(tree, str):
        return "blank-" + tree
    return None


class Trainer:
    """A small model with an Adam optimizer that really trains, deterministically from ``seed``."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.optim = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.step_count = 0
        self.data = torch.Generator().manual_seed(1000 + seed)
        for _ in range(2):
            self.step()

    def step(self) -> None:
        x = torch.randn(5, 8, generator=self.data)
        self.optim.zero_grad()
        self.model(x).square().mean().backward()
        self.optim.step()
        self.step_count += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optim.state_dict(),
            "step": self.step_count,
            "run_name": "run-42",
            "schedule": {"warmup": 100, "milestones": [1000, 2000], "decay": {"kind": "cosine", "min": 0.5}},
            "rng": torch.get_rng_state(),
            "data_rng": self.data.get_state(),
        }

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def save(store: MemStore, sd: dict, cid: str, **kw: Any) -> Any:
    return dcp.save(sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True, **kw)


def async_save(store: MemStore, sd: dict, cid: str, **kw: Any) -> Any:
    return dcp.async_save(
        sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True, **kw
    )


def load(store: MemStore, sd: dict, cid: str | os.PathLike, **kw: Any) -> dict:
    dcp.load(sd, checkpoint_id=cid, storage_reader=MemoryStorageReader(store), no_dist=True, **kw)
    return sd


def load_fresh(store: MemStore, like: dict, cid: str) -> dict:
    """Load checkpoint ``cid`` into a blank state dict shaped like ``like`` and return it."""
    return load(store, blank_like(like), cid)


def store_tree(store: MemStore, pool: bool = True) -> list[str]:
    """Every path under the store root (relative), to show that a failed call wrote nothing. With
    ``pool=False`` the file pool is left out: a failed async save gives its staged files to the pool.
    Files that an earlier save is still allocating ahead in the background are waited for first."""
    Stager.of(store).wait_reserved()
    root = str(store.root)
    out = []
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            out.append(os.path.relpath(os.path.join(d, name), root))
    if not pool:
        pool_dir = os.path.relpath(store.layout.pools_dir, root)
        out = [p for p in out if p != pool_dir and not p.startswith(pool_dir + os.sep)]
    return sorted(out)
