"""Megatron-Core's FullyParallelLoadStrategyWrapper around MemStoreLoadStrategy with CUDA tensors, with the
wrapper's default exchange ("broadcast", which moves the tensors it exchanges to the GPU and so needs
CUDA) and with "gather_object": the 2-rank job of tests/megatron/test_megatron_fully_parallel_load.py, run
with tensors on the GPU. The ranks use gloo (which exchanges CUDA tensors too), so that they may share
one GPU. Need CUDA and megatron-core."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

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
