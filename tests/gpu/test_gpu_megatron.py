"""Megatron-Core with CUDA tensors, on 2 gloo ranks (gloo exchanges CUDA tensors too, so that they may
share one GPU). Need CUDA and megatron-core.

- FullyParallelLoadStrategyWrapper around MemStoreLoadStrategy, with the wrapper's default exchange
  ("broadcast", which moves the tensors it exchanges to the GPU and so needs CUDA) and with
  "gather_object": the job of tests/megatron/test_megatron_fully_parallel_load.py.
- Async saves through Megatron's persistent worker, which selects the rank's GPU first thing: the job of
  tests/megatron/test_megatron_persistent_worker.py (on CPU, that selection is stood in).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

from tests.megatron import test_megatron_persistent_worker as persistent  # noqa: E402
from tests.megatron import test_megatron_strategies as megatron_state  # noqa: E402
from tests.megatron.test_megatron_fully_parallel_load import (  # noqa: E402
    DEFAULT,
    PLAIN,
    WRAPPED,
    assert_fully_parallel_loads,
    fully_parallel_load_job,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the 2-rank job on CUDA tensors once for the module; its ranks' reports."""
    yield from megatron_state.run_megatron_job(
        fully_parallel_load_job, (PLAIN, WRAPPED), "cuda", (DEFAULT, "gather_object")
    )


def test_default_exchange_loads_cuda_tensors_bit_exact(job: list[dict]) -> None:
    """With the wrapper's default exchange, checkpoints saved from CUDA tensors with our save strategy,
    plain or wrapped, load through the wrapper into CUDA tensors bit for bit, and so does a load with
    another sharding."""
    assert_fully_parallel_loads(job, DEFAULT, "cuda")


def test_gather_object_loads_cuda_tensors_bit_exact(job: list[dict]) -> None:
    """The same with exchange_algo="gather_object"."""
    assert_fully_parallel_loads(job, "gather_object", "cuda")


@pytest.fixture(scope="module")
def persistent_job() -> Any:
    """Run the persistent-worker job on CUDA tensors once for the module; its ranks' reports."""
    dirs = [name for name, _, _ in persistent.SAVES]
    yield from megatron_state.run_megatron_job(
        persistent.persistent_worker_job, dirs, "cuda", timeout=persistent.JOB_WAIT_S
    )


def test_persistent_worker_saves_cuda_tensors_and_loads_them_bit_exact(persistent_job: list[dict]) -> None:
    """Async saves of CUDA tensors written by Megatron's persistent worker commit at finalize and load back
    into CUDA tensors bit for bit; one worker process per rank writes all of its saves."""
    persistent.assert_saves_committed_at_finalize_and_loaded_bit_exact(persistent_job, "cuda")
    for rep in persistent_job:
        assert len({seen["writer"] for seen in rep["saves"].values()}) == 1
