"""Megatron-Core's ``FullyParallelLoadStrategyWrapper`` around ``MemStoreLoadStrategy``, on 2 gloo ranks.

Megatron-LM wraps the load strategy with it for ``--ckpt-fully-parallel-load``: each rank reads only part
of what the ranks need together (a replicated tensor is read by one rank), then the ranks exchange what
they read. One 2-rank job saves the state of test_megatron_strategies twice, with ``MemStoreSaveStrategy``
plain and wrapped in ``FullyParallelSaveStrategyWrapper``, and loads each checkpoint through the load
wrapper, and once with another sharding (the whole tensor-parallel tensor on each rank). The tests compare
what came back, bit for bit, with what was saved.

The wrapper's exchange runs on CUDA except with ``exchange_algo="gather_object"``: its default
(``"broadcast"``) and ``"gather_rounds"`` move every tensor to exchange to the GPU, and it calls
``torch.cuda.synchronize()`` whatever the algorithm. On this CPU-only torch, ``cuda_shim`` stands in the
latter; the default algorithm is run too, to pin the error a user gets without CUDA (docs/megatron.md).
tests/gpu/test_gpu_megatron.py runs the same job with CUDA tensors and the default algorithm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

import torch  # noqa: E402
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from dcp_memstore import MemStore  # noqa: E402
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy  # noqa: E402
from tests.megatron import test_megatron_strategies as megatron_state  # noqa: E402
from tests.megatron.cuda_shim import shim_cuda_for_cpu  # noqa: E402
from tests.multiproc.mp_harness import JOB_ID, assert_bit_equal  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = megatron_state.WORLD
PLAIN, WRAPPED = "iter_0000001", "iter_0000002"  # saved by MemStoreSaveStrategy, plain and wrapped
SEEDS = {PLAIN: 1, WRAPPED: 2}
RESHARDED = "resharded"  # the load of PLAIN with the whole tensor-parallel tensor on each rank
DEFAULT = None  # exchange_algo left to the wrapper's default ("broadcast")
CPU_ALGOS = ("gather_object", DEFAULT)  # the default last: on CPU it fails (see the module docstring)


def to_cpu(value: Any) -> Any:
    """``value`` (nested dicts) with every tensor on the CPU, for the parent to compare."""
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value.cpu() if isinstance(value, torch.Tensor) else value


def tensor_devices(template: Any, loaded: Any) -> set[str]:
    """The device types of what ``loaded`` holds where the load template has a ShardedTensor (a
    ShardedObject's tensors are unpickled on the CPU, wherever the model is)."""
    if isinstance(template, dict):
        return set().union(*(tensor_devices(v, loaded[k]) for k, v in template.items()))
    return {loaded.device.type} if isinstance(template, ShardedTensor) else set()


def fully_parallel_load_job(
    rank: int, world: int, root: str, ckpts: str, device: str, algos: tuple[str | None, ...]
) -> dict[Any, Any]:
    """Each rank: save PLAIN and WRAPPED from tensors on ``device``, then for each exchange algorithm in
    ``algos`` load both and RESHARDED through FullyParallelLoadStrategyWrapper into tensors on ``device``.
    Report per (algorithm, load) what came back, or the error it raised."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    shim_cuda_for_cpu()  # the wrapper calls torch.cuda.synchronize(); see cuda_shim
    store = MemStore(root, JOB_ID, keep_in_memory=3, io_threads=2)
    save = MemStoreSaveStrategy(store)
    base = Path(ckpts)

    def on_device(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: t.to(device) for k, t in values.items()}

    for name, strategy in ((PLAIN, save), (WRAPPED, FullyParallelSaveStrategyWrapper(save))):
        seed = SEEDS[name]
        values = on_device(megatron_state.local_values(rank, seed))
        sd = {
            **megatron_state.sharded(values, megatron_state.rank_object(rank, seed), rank, world),
            **megatron_state.common_state(seed),
        }
        mdc.save(sd, str(base / name), sharded_strategy=strategy)

    def template() -> dict[str, Any]:
        zeros = {k: torch.zeros_like(t) for k, t in megatron_state.local_values(rank, 0).items()}
        return megatron_state.sharded(on_device(zeros), None, rank, world)

    def resharded() -> dict[str, Any]:
        whole = torch.zeros(8 * world, 6, device=device)  # layer.weight, all tensor-parallel shards
        norm = torch.zeros(6, device=device)
        return {
            "w": ShardedTensor.from_rank_offsets("layer.weight", whole, replica_id=rank),
            "norm": ShardedTensor.from_rank_offsets("norm.weight", norm, replica_id=rank),
        }

    out: dict[Any, Any] = {}
    for algo in algos:
        for load, (name, sd) in {
            PLAIN: (PLAIN, template()),
            WRAPPED: (WRAPPED, template()),
            RESHARDED: (PLAIN, resharded()),
        }.items():
            ours = MemStoreLoadStrategy(store)
            options = {} if algo is DEFAULT else {"exchange_algo": algo}
            wrapper = FullyParallelLoadStrategyWrapper(ours, **options)
            try:
                loaded = mdc.load(sd, str(base / name), sharded_strategy=wrapper)
            except Exception as e:  # Megatron's CUDA-only exchange on CPU; DCP's errors end the job
                out[algo, load] = {"error": f"{type(e).__name__}: {e}"}
                continue
            norm = sd["norm"]  # the template's ShardedTensor: the wrapper set which rank reads it
            out[algo, load] = {
                "loaded": to_cpu(loaded),
                "devices": tensor_devices(sd, loaded),
                "read_norm": norm.replica_id == 0,
                "our_loads": ours.loads,
            }
    store.close()
    return out


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the 2-rank job on CPU tensors once for the module; its ranks' reports."""
    yield from megatron_state.run_megatron_job(fully_parallel_load_job, (PLAIN, WRAPPED), "cpu", CPU_ALGOS)


def expected(rank: int, load: str) -> dict[str, Any]:
    """What the load ``load`` must return on ``rank``."""
    if load == RESHARDED:
        seed = SEEDS[PLAIN]
        return {
            "w": torch.cat([megatron_state.local_values(r, seed)["w_col"] for r in range(WORLD)]),
            "norm": megatron_state.local_values(rank, seed)["norm"],
            **megatron_state.common_state(seed),
        }
    return megatron_state.expected_loaded(rank, SEEDS[load])


def assert_fully_parallel_loads(reports: list[dict], algo: str | None, device: str) -> None:
    """Every load through the wrapper with ``algo`` returned, on every rank, the saved tensors, objects and
    common state bit for bit, in tensors on ``device``; MemStoreLoadStrategy read them; and the replicated
    tensor was read from the store by one rank only, the other getting it by the wrapper's exchange."""
    for load in (PLAIN, WRAPPED, RESHARDED):
        for rank, rep in enumerate(reports):
            got = rep[algo, load]
            assert "error" not in got, f"rank {rank} {load} with {algo}: {got.get('error')}"
            assert_bit_equal(got["loaded"], expected(rank, load), f"rank {rank} {load} with {algo}")
            assert got["devices"] == {device}, got["devices"]
            assert got["our_loads"] > 0
        assert sorted(rep[algo, load]["read_norm"] for rep in reports) == [False, True], load


def test_gather_object_loads_bit_exact(job: list[dict]) -> None:
    """With exchange_algo="gather_object" (the algorithm that runs without CUDA), checkpoints saved with
    our save strategy, plain or wrapped, load through the wrapper bit for bit: tensor-parallel shards,
    the replicated tensor, ShardedObjects, common state; so does a load with another sharding."""
    assert_fully_parallel_loads(job, "gather_object", "cpu")


@pytest.mark.skipif(
    torch.backends.cuda.is_built(),
    reason="asserts the error of a torch built without CUDA; tests/gpu/test_gpu_megatron.py runs the "
    "default exchange where CUDA exists",
)
def test_default_exchange_needs_cuda(job: list[dict]) -> None:
    """Without CUDA, the wrapper's default exchange ("broadcast") fails in Megatron when it moves the
    replicated tensor to the GPU, on every rank; docs/megatron.md quotes this error. Only a torch built
    without CUDA raises this one: with a GPU the exchange works, and a CUDA build without a GPU raises
    another error."""
    for rep in job:
        for load in (PLAIN, WRAPPED, RESHARDED):
            err = rep[DEFAULT, load].get("error")
            assert err == "AssertionError: Torch not compiled with CUDA enabled", (load, err)
