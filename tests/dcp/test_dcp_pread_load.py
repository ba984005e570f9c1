"""Loads of shard files this process has not mapped (a restarted job's): whole items are read with pread
straight into their destinations and hashed as they land, and the files stay unmapped."""

from __future__ import annotations

import os

import pytest
import torch
from dcp_state import assert_tree_equal, load_fresh, save, snapshot
from torch.distributed.checkpoint.api import CheckpointException

from dcp_memstore.dcp import reader
from dcp_memstore.store.layout import MANIFEST
from dcp_memstore.store.manifest import Manifest
from dcp_memstore.store.mapping import MAPPINGS


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(512, 64, generator=g),
        "ids": torch.arange(5000, dtype=torch.int64),
        "notes": ["step"] * 2000,  # a value DCP pickles: read as bytes
    }


def _files(store, cid: str) -> set:
    d = store.require_checkpoint(cid)
    return {d / item.location.file for item in Manifest.read(d / MANIFEST).items}


def test_a_load_of_files_this_process_never_mapped_is_bit_exact_and_maps_none(store):
    sd = _state()
    expected = snapshot(sd)
    save(store, sd, "c")  # a first save writes new files with pwrite: nothing of them is mapped here
    files = _files(store, "c")
    keys = {(os.stat(f).st_dev, os.stat(f).st_ino) for f in files}
    assert not any(MAPPINGS.is_mapped(k) for k in keys)
    assert_tree_equal(expected, load_fresh(store, sd, "c"))
    assert not any(MAPPINGS.is_mapped(k) for k in keys), "the load mapped a file it could read with pread"


def test_a_value_longer_than_one_read_returns_is_read_whole(store, monkeypatch):
    """Linux returns at most 2 GiB - 4 KiB per read, so a pickled value longer than that takes several.
    A tmpfs read returns short only at that size, so os.pread is capped here instead (a fault the real
    file cannot produce at test size)."""
    sd = _state()
    expected = snapshot(sd)
    save(store, sd, "c")
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real_pread(fd, min(n, 1000), offset))
    assert_tree_equal(expected, load_fresh(store, sd, "c"))


def test_a_file_that_shrinks_while_it_is_read_is_a_truncated_shard_error(store, monkeypatch):
    """The file's size is checked before it is read; one truncated after that check (another process
    deleting the checkpoint's data; made to happen at that moment here) must not load as a short read."""
    sd = {"w": torch.randn(1 << 18)}  # 1 MiB, one item
    save(store, sd, "c")
    (path,) = _files(store, "c")
    real_read = reader.read_with_checksum

    def truncated_first(fd: int, offset: int, dst: torch.Tensor):
        os.truncate(path, 1000)
        return real_read(fd, offset, dst)

    monkeypatch.setattr(reader, "read_with_checksum", truncated_first)
    with pytest.raises(CheckpointException) as ei:
        load_fresh(store, sd, "c")
    msg = str(ei.value)
    assert f"TruncatedShardError: {path} is only 1000 bytes long, where item w (chunk at (0,)) needs" in msg
