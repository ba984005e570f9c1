"""Let Megatron-Core's async checkpointing machinery run on a CPU-only torch, for tests and benchmarks.

Megatron 0.16 calls CUDA-only functions unconditionally on the async save path, whatever the strategy:
``TemporalAsyncCaller.schedule_async_call`` and the torch_dist writer's ``preload_tensors`` call
``torch.cuda.synchronize()``; ``AsyncCallsQueue.maybe_finalize_async_calls``,
``AsyncCaller.sync_all_async_calls`` and torch_dist's ``save_state_dict_async_finalize`` build their
small control tensors on ``torch.cuda.current_device()``. On a machine without CUDA those raise. This
shim makes ``synchronize`` a no-op and ``current_device`` answer "cpu" (the control tensors then live on
the CPU, which the gloo process group handles). It is applied only where torch has no CUDA, and only in
test and benchmark processes; dcp_memstore itself never patches torch.
"""

from __future__ import annotations

import torch


def shim_cuda_for_cpu() -> bool:
    """Apply the shim if this torch has no CUDA; return whether it was applied."""
    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    return True
