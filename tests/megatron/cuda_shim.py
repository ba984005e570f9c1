"""Let Megatron-Core's async checkpointing machinery run on a CPU-only torch, for tests and benchmarks.

Megatron 0.16 calls CUDA-only functions unconditionally on the async save path, whatever the strategy:
``TemporalAsyncCaller.schedule_async_call`` and the torch_dist writer's ``preload_tensors`` call
``torch.cuda.synchronize()``; ``AsyncCallsQueue.maybe_finalize_async_calls``,
``AsyncCaller.sync_all_async_calls`` and torch_dist's ``save_state_dict_async_finalize`` build their
small control tensors on ``torch.cuda.current_device()``. On a machine without CUDA those raise. This
shim makes ``synchronize`` a no-op and ``current_device`` answer "cpu" (the control tensors then live on
the CPU, which the gloo process group handles). Megatron's persistent worker, a spawned process, needs
its own shim (``shim_persistent_worker_for_cpu``). They are applied only where torch has no CUDA, and only
in test and benchmark processes; dcp_memstore itself never patches torch.
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


def shim_persistent_worker_for_cpu() -> bool:
    """Let Megatron's persistent checkpoint worker (``AsyncCallsQueue(persistent=True)``) start on a torch
    without CUDA; return whether the shim was applied.

    The worker is a spawned process, so ``shim_cuda_for_cpu`` in the trainer does not reach it, and its
    loop (``PersistentAsyncCaller.async_loop``) begins with ``torch.cuda.set_device(rank %
    torch.cuda.device_count())``, a division by zero without CUDA. The trainer reads the worker's target
    from the class when it starts the worker; this makes it ``_async_loop_on_cpu``, which the spawned
    process finds by name (this module), shims there, and runs Megatron's own loop.
    """
    if torch.cuda.is_available():
        return False
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    PersistentAsyncCaller.async_loop = staticmethod(_async_loop_on_cpu)
    return True


def _async_loop_on_cpu(*args: object, **kwargs: object) -> None:
    """The persistent worker's target under ``shim_persistent_worker_for_cpu``: Megatron's loop, with its
    device selection made a no-op (the class is unpatched in this fresh process)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    shim_cuda_for_cpu()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    PersistentAsyncCaller.async_loop(*args, **kwargs)
