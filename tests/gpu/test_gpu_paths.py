"""GPU paths: D2H staging into the pinned tmpfs mapping, sync save of CUDA tensors, H2D load, DTensor and
ShardedTensor on GPU meshes, a refused registration, several GPUs. Need CUDA."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import init_from_local_shards
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.store.mapping import MAPPINGS
from dcp_memstore.store.space import allocate_file

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
    reader = MemoryStorageReader(store)
    reader.reset("a")
    entries = reader.read_metadata().state_dict_metadata
    # planned from the page-locked staged copies, recorded unpinned: a CUDA allocation from it works
    assert not any(e.properties.pin_memory for k, e in entries.items() if k in ("w", "h", "i"))


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
    sd = {
        "big": torch.randn(40 << 20 >> 2, device="cuda"),
        "odd": torch.randn(333, 7, device="cuda")[:, ::2],
        "conj": torch.randn(333, dtype=torch.complex64, device="cuda").conj(),  # a view with the conj bit
    }
    dcp.async_save(sd, checkpoint_id="d", storage_writer=MemoryStorageWriter(store), no_dist=True).result()
    out = {k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in sd.items()}
    dcp.load(out, checkpoint_id="d", storage_reader=MemoryStorageReader(store), no_dist=True)
    for k in sd:
        assert torch.equal(out[k], sd[k])


def test_conjugate_and_negative_views_stage_through_the_pinned_mapping_as_their_values(store):
    """Views whose values are the conjugate or the negation of their bytes (contiguous or not) are staged
    into the registered mapping as their values, also while the GPU is still busy when async_save is
    called (the DMA then lands well after the call that queued it returned)."""
    z = torch.randn(4 << 20, dtype=torch.complex64, device="cuda")  # 32 MiB
    sd = {"conj": z.conj(), "neg": z.conj().imag, "strided_conj": z.view(2048, 2048)[:, ::2].conj()}
    assert sd["conj"].is_conj() and sd["neg"].is_neg() and sd["strided_conj"].is_conj()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time on the current stream
    fut = dcp.async_save(sd, checkpoint_id="cn", storage_writer=MemoryStorageWriter(store), no_dist=True)
    fut.result()
    d = store.require_checkpoint("cn")
    assert all(MAPPINGS.map_path(p).host_registered for p in d.glob("*.shard"))
    out = {k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in sd.items()}
    dcp.load(out, checkpoint_id="cn", storage_reader=MemoryStorageReader(store), no_dist=True)
    for k in sd:
        assert torch.equal(out[k], sd[k]), k


@pytest.fixture
def two_file_store(shm_dir):
    """A store whose saves write two shard files per rank, copied by two I/O threads (not the caller)."""
    s = MemStore(root=shm_dir, job_id="gpu", io_threads=2)
    yield s
    s.close()


def test_sync_save_waits_for_work_queued_on_the_callers_stream(two_file_store):
    """dcp.save of tensors the trainer computes on a stream of its own (made current) saves the values that
    work computes, though the I/O threads that copy them to the host run on other streams."""
    x, y = torch.zeros(64 << 20, device="cuda"), torch.zeros(64 << 20, device="cuda")  # 256 MiB each
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU time: longer than the save takes
        x.fill_(3.0)
        y.fill_(4.0)
        dcp.save(
            {"x": x, "y": y},
            checkpoint_id="ss",
            storage_writer=MemoryStorageWriter(two_file_store),
            no_dist=True,
        )
    assert len(list(two_file_store.require_checkpoint("ss").glob("*.shard"))) == 2
    out = {"x": torch.zeros_like(x), "y": torch.zeros_like(y)}
    dcp.load(out, checkpoint_id="ss", storage_reader=MemoryStorageReader(two_file_store), no_dist=True)
    assert torch.equal(out["x"], torch.full_like(x, 3.0))
    assert torch.equal(out["y"], torch.full_like(y, 4.0))


def test_load_waits_for_work_queued_on_the_callers_stream(two_file_store):
    """dcp.load into tensors that work queued on the trainer's own stream still writes leaves the loaded
    values in them: the I/O threads' copies into them start after that work, not before it."""
    x, y = torch.full((64 << 20,), 3.0, device="cuda"), torch.full((64 << 20,), 4.0, device="cuda")
    dcp.save(
        {"x": x, "y": y}, checkpoint_id="sl", storage_writer=MemoryStorageWriter(two_file_store), no_dist=True
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(4_000_000_000)  # an optimizer step, say, still running: longer than the load
        x.fill_(9.0)
        y.fill_(9.0)
        dcp.load(
            {"x": x, "y": y},
            checkpoint_id="sl",
            storage_reader=MemoryStorageReader(two_file_store),
            no_dist=True,
        )
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3.0))
    assert torch.equal(y, torch.full_like(y, 4.0))


def test_load_into_non_contiguous_destinations_is_done_when_it_returns(two_file_store):
    """dcp.load into GPU destinations that are not contiguous (a transposed parameter; DCP's resharding
    narrows destinations too), called under the trainer's own stream: when it returns, the I/O threads'
    copies have landed, including the device-side copy out of the temporary that a host-to-device copy_
    into such a destination ends with, which the I/O thread only queues on the GPU's default stream."""
    rows, cols = 1 << 20, 64  # 256 MiB each; written transposed, so the device-side copy is slow
    x, y = torch.randn(rows, cols, device="cuda"), torch.randn(rows, cols, device="cuda")
    dcp.save(
        {"x": x, "y": y}, checkpoint_id="nc", storage_writer=MemoryStorageWriter(two_file_store), no_dist=True
    )
    out = {"x": torch.zeros(cols, rows, device="cuda").t(), "y": torch.zeros(cols, rows, device="cuda").t()}
    assert not out["x"].is_contiguous()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dcp.load(out, checkpoint_id="nc", storage_reader=MemoryStorageReader(two_file_store), no_dist=True)
        assert torch.cuda.default_stream().query()  # nothing the I/O threads queued is still running
        same = [torch.equal(out[k], v) for k, v in (("x", x), ("y", y))]  # read on the trainer's stream
    assert same == [True, True]


def test_async_save_waits_for_gpu_work_queued_before_it(store):
    """The side stream starts after what the trainer queued: a fill still behind a long kernel is saved."""
    x = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the current stream
    x.fill_(3.0)  # queued behind it: not done when async_save is called
    fut = dcp.async_save({"x": x}, checkpoint_id="q", storage_writer=MemoryStorageWriter(store), no_dist=True)
    x.fill_(5.0)  # training goes on
    fut.result()
    out = {"x": torch.zeros_like(x)}
    dcp.load(out, checkpoint_id="q", storage_reader=MemoryStorageReader(store), no_dist=True)
    assert torch.equal(out["x"], torch.full_like(x, 3.0))


def test_refused_registration_leaves_the_calling_thread_usable(store):
    """A refused cudaHostRegister (here: the range is registered already) is remembered, and the CUDA error
    it leaves does not surface in the caller's next kernel launch."""
    path = Path(store.layout.job_dir) / "refused.bin"
    mf = MAPPINGS.map_fd(allocate_file(path, 1 << 20))
    err = torch.cuda.cudart().cudaHostRegister(mf.address, mf.size, 0)
    assert int(getattr(err, "value", err)) == 0
    try:
        assert not mf.pin_for_cuda(torch.cuda.current_device())
        assert mf.pin_refused
        y = torch.ones(8, device="cuda") * 2  # a kernel launch in this thread
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 2.0))
        assert not mf.pin_for_cuda(torch.cuda.current_device())  # not asked again
    finally:
        torch.cuda.cudart().cudaHostUnregister(mf.address)
        os.unlink(path)
        MAPPINGS.prune()


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield
    dist.destroy_process_group()


def test_dtensor_and_sharded_tensor_on_gpu_stage_to_the_host(store, one_rank_group):
    """Staging copies the local tensors of a DTensor on a GPU mesh and of a ShardedTensor placed on a GPU
    into shard files on the host, with no copy left on the GPU, and the save loads back bit for bit."""
    mesh = init_device_mesh("cuda", (1,))
    full = torch.randn(4096, 1024, device="cuda")  # 16 MiB
    meta = ShardMetadata([0, 0], list(full.shape), "rank:0/cuda:0")
    sd = {
        "dt": distribute_tensor(full.clone(), mesh, [Shard(0)]),
        "st": init_from_local_shards([LocalShard(full.clone(), meta)], *full.shape),
    }
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fut = dcp.async_save(sd, checkpoint_id="m", storage_writer=MemoryStorageWriter(store))
    assert torch.cuda.memory_allocated() - before < 1 << 20  # the staged state dict holds no GPU copy
    fut.result()
    out = {
        "dt": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
        "st": init_from_local_shards([LocalShard(torch.zeros_like(full), meta)], *full.shape),
    }
    dcp.load(out, checkpoint_id="m", storage_reader=MemoryStorageReader(store))
    assert torch.equal(out["dt"].to_local(), full)
    assert torch.equal(out["st"].local_tensor(), full)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu_than_the_current_one(store):
    """Tensors on GPU 1 while GPU 0 is current: their copies wait for GPU 1's queued work."""
    torch.cuda.set_device(0)
    x = torch.zeros(64 << 20, device="cuda:1")
    with torch.cuda.device(1):
        torch.cuda._sleep(2_000_000_000)
    x.fill_(4.0)  # on GPU 1's current stream, behind the sleep
    fut = dcp.async_save(
        {"x": x}, checkpoint_id="g1", storage_writer=MemoryStorageWriter(store), no_dist=True
    )
    fut.result()
    out = {"x": torch.zeros_like(x)}
    dcp.load(out, checkpoint_id="g1", storage_reader=MemoryStorageReader(store), no_dist=True)
    assert torch.equal(out["x"], torch.full_like(x, 4.0))
