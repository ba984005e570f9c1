"""Megatron-Core checkpoints in memory: train, save asynchronously every N steps, resume from the newest.

    pip install '.[megatron]' -c constraints.txt   # from the repository root; see docs/megatron.md
    torchrun --nproc-per-node 2 examples/megatron_train.py --steps 20 --save-every 5
    torchrun --nproc-per-node 2 examples/megatron_train.py --steps 30 --save-every 5   # resumes at step 20
    ... --persistent-worker   # writes through Megatron's persistent worker instead of a fork per save

A tiny tensor-parallel MLP (a column-parallel then a row-parallel linear layer, split over the ranks by
hand as Megatron's layers split them) learns a fixed random linear map with SGD and momentum, on CPU with
gloo. Every ``--save-every`` steps its Megatron sharded state dict (weight shards, the replicated bias,
momentum, each rank's RNG state as a ShardedObject, the step as common state) is saved with
``dist_checkpointing.save(..., sharded_strategy=MemStoreSaveStrategy(store), async_sharded_save=True)``
and handed to Megatron's ``AsyncCallsQueue``: the tensors are staged into tmpfs before ``save`` returns,
written by the queue's forked worker (or, with ``--persistent-worker``, by one spawned worker process per
rank, as Megatron-LM's ``--use-persistent-ckpt-worker`` does), and committed when the queue finalizes the
request. At start-up
``store.latest_checkpoint()`` names the newest committed checkpoint and ``MemStoreLoadStrategy`` restores
it in place. The last line (loss and a digest of the weights) is the same whether the 30 steps ran in one
go or were resumed at step 20; a run that resumes at ``--steps`` trains nothing and says so. Checkpoint
directories (Megatron's ``common.pt``, ``metadata.json`` and ``dcp_memstore.json``) go under ``--save``;
the tensors go to the store (``--root``, job ``--job-id``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, PersistentAsyncCaller

from dcp_memstore import MemStore
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy

D_IN, HIDDEN, D_OUT, BATCH, LR, MOMENTUM = 32, 64, 16, 64, 0.02, 0.9


def init_state(rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's shards of the parameters (the same full weights whatever the world size) and momentum."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(HIDDEN, D_IN, generator=g) / D_IN**0.5  # column-parallel: rows split over the ranks
    w2 = torch.randn(D_OUT, HIDDEN, generator=g) / HIDDEN**0.5  # row-parallel: columns split
    params = {
        "w1": w1.chunk(world, 0)[rank].clone(),
        "w2": w2.chunk(world, 1)[rank].clone(),
        "b2": torch.zeros(D_OUT),  # replicated
    }
    return {**params, **{f"m_{k}": torch.zeros_like(v) for k, v in params.items()}}


def sharded_state_dict(state: dict[str, torch.Tensor], step: int, rank: int, world: int) -> dict[str, Any]:
    """Megatron's view of the training state: which global tensor each local tensor is a piece of."""
    sd: dict[str, Any] = {"step": step}  # not sharded: Megatron's common state (common.pt)
    for prefix in ("", "m_"):
        sd[f"{prefix}w1"] = ShardedTensor.from_rank_offsets(
            f"{prefix}w1", state[f"{prefix}w1"], (0, rank, world)
        )
        sd[f"{prefix}w2"] = ShardedTensor.from_rank_offsets(
            f"{prefix}w2", state[f"{prefix}w2"], (1, rank, world)
        )
        sd[f"{prefix}b2"] = ShardedTensor.from_rank_offsets(
            f"{prefix}b2", state[f"{prefix}b2"], replica_id=rank
        )
    sd["rng"] = ShardedObject("rng", torch.get_rng_state(), (world,), (rank,))
    return sd


def train_step(state: dict[str, torch.Tensor], target: torch.Tensor) -> float:
    """One SGD-with-momentum step on a batch drawn from the global RNG (the same on every rank)."""
    x = torch.randn(BATCH, D_IN)
    params = {k: state[k].requires_grad_() for k in ("w1", "w2", "b2")}
    h = torch.relu(x @ params["w1"].T)  # this rank's slice of the hidden layer
    y = dist_fn.all_reduce(h @ params["w2"].T) + params["b2"]  # row-parallel: sum the partial outputs
    loss = torch.nn.functional.mse_loss(y, x @ target.T)
    loss.backward()
    with torch.no_grad():
        for k, p in params.items():
            state[f"m_{k}"].mul_(MOMENTUM).add_(p.grad)
            p.sub_(LR * state[f"m_{k}"])
            p.grad = None
            p.requires_grad_(False)
    return loss.item()


def shim_cuda_for_cpu() -> None:
    """CPU-only demo: Megatron's async queue calls torch.cuda.synchronize() and puts its small control
    tensors on torch.cuda.current_device() even for CPU tensors, and its persistent worker selects a GPU
    (torch.cuda.set_device) first thing. Not needed on a GPU machine."""
    shim_cuda_calls()
    PersistentAsyncCaller.async_loop = staticmethod(persistent_worker_on_cpu)


def shim_cuda_calls() -> None:
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"


def persistent_worker_on_cpu(*args: Any, **kwargs: Any) -> None:
    """The persistent worker's loop on a CPU-only machine, with its GPU selection made a no-op. The worker is
    a spawned process: it finds this function by importing this script anew (``main`` does not run), so
    Megatron's class is unpatched there."""
    shim_cuda_calls()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    PersistentAsyncCaller.async_loop(*args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="train until this step (default 20)")
    p.add_argument("--save-every", type=int, default=5, help="save asynchronously every N steps (default 5)")
    p.add_argument("--save", default="/tmp/dcp_memstore_megatron_example", help="checkpoint directories")
    p.add_argument("--root", default="/dev/shm/dcp_memstore", help="the store's tmpfs root")
    p.add_argument("--job-id", default="megatron-example", help="the store's job id (same to resume)")
    p.add_argument(
        "--persistent-worker",
        action="store_true",
        help="write through Megatron's persistent worker (one spawned process per rank) instead of a fork "
        "of the trainer per save",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        shim_cuda_for_cpu()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = MemStore(root=args.root, job_id=args.job_id, keep_in_memory=2)
    save_strategy, load_strategy = MemStoreSaveStrategy(store), MemStoreLoadStrategy(store)
    torch.manual_seed(1)  # the same data on every rank: tensor parallelism splits the model, not the batch
    target = torch.randn(D_OUT, D_IN, generator=torch.Generator().manual_seed(2))
    state, step, loss = init_state(rank, world), 0, None

    latest = store.latest_checkpoint()  # collective: the newest checkpoint every rank can load
    if latest is not None:
        ckpt_dir = os.path.join(args.save, latest)
        loaded = dist_checkpointing.load(
            sharded_state_dict(state, 0, rank, world), ckpt_dir, sharded_strategy=load_strategy
        )
        step = loaded["step"]  # the tensors were loaded in place into ``state``
        torch.set_rng_state(loaded["rng"])
        if rank == 0:
            print(f"resumed from {ckpt_dir} (step {step})", flush=True)

    queue = AsyncCallsQueue(persistent=args.persistent_worker)
    try:
        while step < args.steps:
            loss = train_step(state, target)
            step += 1
            queue.maybe_finalize_async_calls(blocking=False)  # commit saves whose writes have finished
            if step % args.save_every == 0:
                ckpt_dir = Path(args.save) / f"iter_{step:07d}"  # its name is the checkpoint id in the store
                if rank == 0:
                    ckpt_dir.mkdir(parents=True, exist_ok=True)  # Megatron writes common.pt there (rank 0)
                request = dist_checkpointing.save(
                    sharded_state_dict(state, step, rank, world),
                    str(ckpt_dir),
                    sharded_strategy=save_strategy,
                    async_sharded_save=True,
                )
                queue.schedule_async_request(request)  # returns at once; training goes on
                if rank == 0:
                    way = "on its way"
                    if args.persistent_worker:  # the worker started with the first save
                        way += f" to the persistent worker (pid {queue.persistent_caller.process.pid})"
                    print(f"step {step}: loss {loss:.6f}, checkpoint {ckpt_dir.name} {way}", flush=True)
        queue.maybe_finalize_async_calls(blocking=True)
    except BaseException:
        # a dead persistent worker never answers the stop request of a plain close(), which Megatron's
        # queue also sends when it is collected at exit: without this the process would not end
        queue.close(abort=True)
        raise
    digest = sum(float(state[k].double().sum()) for k in ("w1", "w2", "b2"))
    digest = torch.tensor([digest], dtype=torch.float64)
    dist.all_reduce(digest)
    if rank == 0:
        trained = f"loss {loss:.6f}" if loss is not None else f"no step left to train (--steps {args.steps})"
        print(f"done at step {step}: {trained}, weights digest {digest.item():.12e}", flush=True)
    queue.close()  # stops a persistent worker
    del queue  # while the process group exists: Megatron's PersistentAsyncCaller.__del__ asks it for the rank
    store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
