"""Corruption of stored bytes: dcp.load names the file and item;
verify_checksums=False loads them as they are."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest
import torch
from dcp_state import assert_tree_equal, async_save, load, load_fresh, save, snapshot
from torch.distributed.checkpoint.api import CheckpointException

from dcp_memstore import MemStore
from dcp_memstore.store.layout import MANIFEST
from dcp_memstore.store.manifest import Manifest


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g)},
        "ids": torch.arange(1000, dtype=torch.int64),
        "step": 1234,
        "name": "run-checksums",
    }


def _location(store: MemStore, cid: str, fqn: str):
    d = store.require_checkpoint(cid)
    (item,) = [it for it in Manifest.read(d / MANIFEST).items if it.fqn == fqn]
    return d / item.location.file, item.location


def _flip(path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_flipped_byte_in_a_shard_fails_load_naming_file_and_item(shm_dir, mode):
    store = MemStore(root=shm_dir, job_id="job", io_threads=2)
    sd = _state()
    if mode == "save":
        save(store, sd, "c")
    else:
        async_save(store, sd, "c").result()
    path, loc = _location(store, "c", "model.w")
    _flip(path, loc.offset + 4 * 123 + 2)
    with pytest.raises(CheckpointException) as ei:
        load_fresh(store, sd, "c")
    msg = str(ei.value)
    assert "ChecksumMismatchError" in msg
    assert f"checksum mismatch in {path} for item model.w" in msg
    assert f"expected xxh3_64 {loc.checksum:#018x}" in msg


def test_with_verification_off_the_corrupt_value_is_loaded(shm_dir):
    store = MemStore(root=shm_dir, job_id="job", io_threads=2)
    sd = _state()
    expected = snapshot(sd)
    save(store, sd, "c")
    path, loc = _location(store, "c", "model.w")
    _flip(path, loc.offset + 4 * 123 + 2)
    lax = MemStore(root=shm_dir, job_id="job", verify_checksums=False)
    out = load_fresh(lax, sd, "c")
    w_exp, w_out = expected["model"]["w"].reshape(-1), out["model"]["w"].reshape(-1)
    differs = (w_exp.view(torch.int32) != w_out.view(torch.int32)).nonzero().flatten().tolist()
    assert differs == [123]
    assert w_out[123:124].view(torch.int32).item() == w_exp[123:124].view(torch.int32).item() ^ (0x10 << 16)
    expected["model"]["w"] = out["model"]["w"]  # everything else is intact
    assert_tree_equal(expected, out)


def test_corrupt_non_tensor_value_is_detected(store):
    sd = _state()
    save(store, sd, "c")
    path, loc = _location(store, "c", "name")
    assert path.name == "__0_objects.bin"
    _flip(path, loc.offset + loc.length - 1)
    with pytest.raises(CheckpointException) as ei:
        load_fresh(store, sd, "c")
    assert f"checksum mismatch in {path} for item name" in str(ei.value)


def test_corruption_in_one_checkpoint_leaves_the_others_loadable(store):
    a, b = _state(), _state()
    b["model"]["w"].add_(1.0)
    save(store, a, "a")
    save(store, b, "b")
    path, loc = _location(store, "a", "ids")
    _flip(path, loc.offset)
    with pytest.raises(CheckpointException, match="for item ids"):
        load_fresh(store, a, "a")
    assert_tree_equal(b, load_fresh(store, b, "b"))


def test_truncated_shard_file_gives_an_error_not_a_crash(store):
    sd = _state()
    save(store, sd, "c")
    path, loc = _location(store, "c", "model.w")
    os.truncate(path, loc.offset + loc.length // 2)  # a SIGBUS if anything read past the end
    with pytest.raises(CheckpointException) as ei:
        load_fresh(store, sd, "c")
    assert str(path) in str(ei.value)


def test_unreadable_manifest_is_a_clear_error(store):
    sd = _state()
    save(store, sd, "c")
    manifest = store.require_checkpoint("c") / MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:50])
    with pytest.raises(CheckpointException) as ei:
        load(store, snapshot(sd), "c")
    assert str(manifest) in str(ei.value)


def _small(store: MemStore) -> tuple[dict, Path]:
    """A checkpoint 'c' of one int32 tensor, small enough to flip every bit of its manifest; returns the
    saved values and the manifest's path."""
    sd = {"b": torch.arange(200, dtype=torch.int32).reshape(10, 20)}
    save(store, sd, "c")
    return snapshot(sd), store.require_checkpoint("c") / MANIFEST


def _edit_record(manifest: Path, edit) -> None:
    """Apply ``edit`` to the manifest's record with msgpack, leaving its stored digest as it was."""
    envelope = msgpack.unpackb(manifest.read_bytes())
    record = msgpack.unpackb(envelope["body"])
    edit(record)
    manifest.write_bytes(msgpack.packb({**envelope, "body": msgpack.packb(record)}))


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r["items"][0][2].__setitem__(5, [10, 21]),
        lambda r: r["items"][0][2].__setitem__(4, "float32"),
        lambda r: r["dcp"]["state_dict_metadata"]["b"]["chunks"][0].__setitem__(1, [5, 20]),
    ],
    ids=["stored-shape", "stored-dtype", "dcp-chunk-size"],
)
def test_an_edited_manifest_is_refused_naming_it(store, edit):
    _, manifest = _small(store)
    _edit_record(manifest, edit)
    with pytest.raises(CheckpointException) as ei:
        load(store, {"b": torch.zeros(10, 20, dtype=torch.int32)}, "c")
    cause = ei.value.failures[0][0]  # what the rank raised: DCP before 2.12 kept only 'metadata is None'
    assert type(cause) is ValueError
    assert str(cause).startswith(f"{manifest}: the manifest is corrupt: its xxh3_64 checksum does not match")


def test_every_bit_flip_of_the_manifest_loads_the_saved_values_or_fails_naming_it(store):
    expected, manifest = _small(store)
    good = manifest.read_bytes()
    failed = 0
    for bit in range(len(good) * 8):
        damaged = bytearray(good)
        damaged[bit // 8] ^= 1 << (bit % 8)
        manifest.write_bytes(damaged)
        out = {"b": torch.zeros(10, 20, dtype=torch.int32)}
        try:
            load(store, out, "c")
        except CheckpointException as e:
            assert f"{manifest}: " in str(e) and "load another checkpoint" in str(e), f"bit {bit}: {e}"
            failed += 1
        else:
            assert torch.equal(out["b"], expected["b"]), f"bit {bit} loaded wrong values"
    assert failed > 0
    manifest.write_bytes(good)
    assert_tree_equal(expected, load(store, {"b": torch.zeros(10, 20, dtype=torch.int32)}, "c"))


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda r: r["items"][0][2].__setitem__(4, "float32"),
            "item b (chunk at (0, 0)) is stored as float32 of shape (10, 20), "
            "but DCP's metadata says int32 of shape (10, 20)",
        ),
        (
            lambda r: r["dcp"]["state_dict_metadata"]["b"]["chunks"][0].__setitem__(1, [5, 20]),
            "item b (chunk at (0, 0)) is stored as int32 of shape (10, 20), "
            "but DCP's metadata says int32 of shape (5, 20)",
        ),
        (
            lambda r: r["items"][0].__setitem__(1, [1, 0]),
            "DCP's metadata lists item b (chunk at (0, 0)), which the manifest has no entry for",
        ),
        (
            lambda r: r["dcp"]["state_dict_metadata"]["b"].pop("requires_grad"),
            "its DCP metadata is malformed (KeyError: 'requires_grad')",
        ),
    ],
    ids=["stored-dtype", "dcp-chunk-size", "chunk-offset", "missing-field"],
)
def test_a_manifest_whose_items_and_dcp_metadata_disagree_fails_naming_it(store, edit, problem):
    """A manifest written that way (its digest matches): the load fails before it reads anything, naming
    the manifest, instead of a bare KeyError or a load of bytes read as another dtype or shape."""
    _, manifest = _small(store)
    record = Manifest.read(manifest).to_record()
    edit(record)
    Manifest.from_record(record).write(manifest)
    out = {"b": torch.zeros(10, 20, dtype=torch.int32)}
    with pytest.raises(CheckpointException) as ei:
        load(store, out, "c")
    assert f"{manifest}: {problem}; this copy of the checkpoint cannot be read" in str(ei.value)
    assert not out["b"].any()


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("size", [0, 100])
def test_a_shard_file_shorter_than_its_manifest_says_is_an_error_saying_how_short(shm_dir, size, verify):
    store = MemStore(root=shm_dir, job_id="job", verify_checksums=verify)
    _small(store)
    path, _ = _location(store, "c", "b")
    os.truncate(path, size)
    with pytest.raises(CheckpointException) as ei:
        load(store, {"b": torch.zeros(10, 20, dtype=torch.int32)}, "c")
    msg = str(ei.value)
    assert (
        f"TruncatedShardError: {path} is only {size} bytes long, where item b (chunk at (0, 0)) needs 800"
        in msg
    )
    assert "checksum mismatch" not in msg and "verify_checksums" not in msg


def test_a_deleted_shard_file_with_no_other_copy_is_in_no_tier(store):
    _small(store)
    path, _ = _location(store, "c", "b")
    path.unlink()
    with pytest.raises(CheckpointException) as ei:
        load(store, {"b": torch.zeros(10, 20, dtype=torch.int32)}, "c")
    assert f"FileNotFoundError: file {path.name} of checkpoint 'c' is in no tier (" in str(ei.value)
    assert "load another checkpoint" in str(ei.value)
