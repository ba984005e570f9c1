"""GPU paths: D2H staging into the pinned tmpfs mapping, sync save of CUDA tensors, H2D load. Need CUDA."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.store.mapping import MAPPINGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def store():
    root = tempfile.mkdtemp(prefix="dcpms-gpu-", dir="/dev/shm")
    s = MemStore(root=root, job_id="gpu")
    yield s
    s.close()
    shutil.rmtree(root, ignore_errors=True)


def _state(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(1024, 1024, device="cuda", generator=g),
        "h": torch.randn(4096, 257, device="cuda", generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 30, (12345,), device="cuda", generator=g),
        "step": seed,
    }


def test_async_save_stages_into_pinned_mapping_and_round_trips(store):
    sd = _state(1)
    fut = dcp.async_save(sd, checkpoint_id="a", storage_writer=MemoryStorageWriter(store), no_dist=True)
    fut.result()
    d = store.require_checkpoint("a")
    pinned = [MAPPINGS.map_path(p).host_registered for p in d.glob("*.shard")]
    assert pinned and all(pinned)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, checkpoint_id="a", storage_reader=MemoryStorageReader(store), no_dist=True)
    for k in ("w", "h", "i"):
        assert out[k].is_cuda and torch.equal(out[k], sd[k])
    assert out["step"] == 1


def test_staged_copy_is_isolated_from_later_training_updates(store):
    sd = _state(2)
    expected = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    fut = dcp.async_save(sd, checkpoint_id="b", storage_writer=MemoryStorageWriter(store), no_dist=True)
    for v in expected:
        sd[v].add_(1)  # training goes on right after async_save returns
    fut.result()
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, checkpoint_id="b", storage_reader=MemoryStorageReader(store), no_dist=True)
    for k in expected:
        assert torch.equal(out[k], expected[k])


def test_sync_save_of_cuda_tensors_round_trips(store):
    sd = _state(3)
    dcp.save(sd, checkpoint_id="c", storage_writer=MemoryStorageWriter(store), no_dist=True)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, checkpoint_id="c", storage_reader=MemoryStorageReader(store), no_dist=True)
    for k in ("w", "h", "i"):
        assert torch.equal(out[k], sd[k])


def test_bounce_buffer_path_when_registration_is_refused(store, monkeypatch):
    monkeypatch.setenv("DCP_MEMSTORE_NO_HOST_REGISTER", "1")
    sd = {"big": torch.randn(40 << 20 >> 2, device="cuda"), "odd": torch.randn(333, 7, device="cuda")[:, ::2]}
    dcp.async_save(sd, checkpoint_id="d", storage_writer=MemoryStorageWriter(store), no_dist=True).result()
    out = {k: torch.zeros(v.shape, device="cuda") for k, v in sd.items()}
    dcp.load(out, checkpoint_id="d", storage_reader=MemoryStorageReader(store), no_dist=True)
    for k in sd:
        assert torch.equal(out[k], sd[k])
