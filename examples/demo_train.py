"""One rank of the demo's training job; ``examples/demo.py`` launches it under torchrun.

A small MLP (with dropout, so the RNG state matters) is trained data-parallel (DDP, gloo, CPU) on
synthetic regression data. Everything is deterministic: the model is initialised from a fixed seed, each
rank's dropout draws from its own seeded RNG stream, and the batch of step ``s`` is generated from ``s``
alone, so a resumed run sees exactly the batches an uninterrupted run sees.

Every ``--every`` steps the full training state (model, optimizer, step, each rank's RNG state) goes to
the in-memory store with ``dcp.async_save``; the next save first waits for the previous one. At start-up
the newest checkpoint every rank can load (``store.latest_checkpoint()``) is restored with ``dcp.load``.

With ``--fail-at-step S`` rank ``--fail-rank`` stops at the start of step ``S``, tells the driver its pid
and waits there to be killed with SIGKILL. Before that every rank waits for the save in flight, so the
crash lands at a known point and the demo's output is repeatable. A real crash lands anywhere, also in
the middle of a save; that one is then simply not a checkpoint, and the restart resumes from the one
before it.

Rank 0 reports progress as one JSON object per line on stdout, prefixed with ``@@demo``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore

EVENT_PREFIX = "@@demo "
STACKS_ENV = "DCP_MEMSTORE_DEMO_STACKS"
_STACK_FILES: list[Any] = []
IN_FEATURES = 16
HIDDEN = 64
GLOBAL_BATCH = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of one training process."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="MemStore root (a directory on tmpfs)")
    p.add_argument("--job-id", required=True, help="MemStore job id")
    p.add_argument("--steps", type=int, default=20, help="train until this step (1-based, inclusive)")
    p.add_argument("--every", type=int, default=4, help="checkpoint after every N-th step")
    p.add_argument("--fail-at-step", type=int, default=0, help="wait to be SIGKILLed at this step (0: never)")
    p.add_argument("--fail-rank", type=int, default=1, help="the rank that is killed")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--final-params", required=True, help="rank 0 writes the final parameters here (torch.save)"
    )
    return p.parse_args(argv)


def stacks_on_sigusr1() -> None:
    """Write every thread's Python stack on SIGUSR1: the driver sends it to a job that does not end in
    time, and copies the stacks into the job's log. Into ``$DCP_MEMSTORE_DEMO_STACKS-<pid>.txt`` when the
    driver set it (so that processes signalled together do not interleave), else to stderr."""
    prefix = os.environ.get(STACKS_ENV)
    out = open(f"{prefix}-{os.getpid()}.txt", "w") if prefix else sys.stderr  # noqa: SIM115 - kept open
    _STACK_FILES.append(out)  # faulthandler writes to it whenever the signal comes
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)


def emit(**event: Any) -> None:
    """Send one progress event to the driver: one line on stdout, written by a single ``os.write`` so that
    lines of the two ranks (sharing one pipe) never interleave."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (EVENT_PREFIX + json.dumps(event) + "\n").encode())


def checkpoint(pending: Any, state: dict, cid: str, store: MemStore, group: Any) -> tuple[Any, dict]:
    """``dcp.async_save`` of ``state`` as ``cid`` once the previous save (``pending``) is done (at most one
    in flight): the new save's future, and what the step reports (id, ms waited, ms staging)."""
    t0 = time.perf_counter()
    if pending is not None:
        pending.result()
    t1 = time.perf_counter()
    future = dcp.async_save(
        state, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), process_group=group
    )
    t2 = time.perf_counter()
    return future, {"id": cid, "wait_ms": (t1 - t0) * 1e3, "stage_ms": (t2 - t1) * 1e3}


def build_model() -> nn.Module:
    """The model: a three-layer MLP with dropout (initialised from the global RNG)."""
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    )


def make_batch(step: int, seed: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch; depends only on (seed, step, rank, world)."""
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(IN_FEATURES, 1, generator=teacher) / IN_FEATURES**0.5
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=g)
    y = 2 * torch.sin(2 * (x @ w)) + 0.05 * torch.randn(GLOBAL_BATCH, 1, generator=g)
    return x[rank::world], y[rank::world]


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int
) -> dict[str, Any]:
    """What a checkpoint holds: model, optimizer, the last finished step and this rank's RNG state.

    Model and optimizer entries are the same on every rank (DCP writes them once); the RNG state differs
    per rank (each rank draws its own dropout masks), so it is stored under a per-rank key.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "step": step,
        "rng": {f"rank{rank}": torch.get_rng_state()},
    }


def resume(
    store: MemStore, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> tuple[str | None, int]:
    """Load the newest checkpoint every rank has; return its id and the last step it finished (0: none)."""
    latest = store.latest_checkpoint()  # a collective: every rank agrees on the answer
    if latest is None:
        return None, 0
    state = training_state(model, optimizer, 0, rank)
    dcp.load(state, checkpoint_id=latest, storage_reader=MemoryStorageReader(store))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"][f"rank{rank}"])
    return latest, int(state["step"])


def wait_to_be_killed(rank: int, step: int) -> None:
    """Tell the driver this process's pid and block until it SIGKILLs us (exit 3 if it never does)."""
    emit(event="kill-me", rank=rank, pid=os.getpid(), step=step)
    time.sleep(60)
    print(f"rank {rank}: waited 60 s at step {step} and nobody killed this process", file=sys.stderr)
    sys.exit(3)


def main(argv: list[str] | None = None) -> None:
    """Train, checkpointing asynchronously, resuming from the store if it holds a checkpoint."""
    args = parse_args(argv)
    stacks_on_sigusr1()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # fixed thread count: the same reduction order in every run
    emit(event="hello", rank=rank, pid=os.getpid())

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(args.seed + 1 + rank)  # each rank's own dropout stream

    store = MemStore(root=args.root, job_id=args.job_id)
    # Background saves talk over their own process group, so they never interleave with DDP's all-reduces.
    ckpt_group = dist.new_group(backend="gloo")
    resumed_from, done = resume(store, model, optimizer, rank)
    if rank == 0:
        emit(event="start", resumed_from=resumed_from, first_step=done + 1)

    pending = None
    for step in range(done + 1, args.steps + 1):
        if step == args.fail_at_step:
            # Staging for the demo, not part of training: every rank lets the last checkpoint commit and
            # reports its last step first, so the crash lands at the same point every time.
            if pending is not None:
                pending.result()
            dist.barrier()
            if rank == args.fail_rank:
                wait_to_be_killed(rank, step)
        x, y = make_batch(step, args.seed, rank, world)
        model.train()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks here
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world

        saved = None
        if step % args.every == 0:
            state = training_state(model, optimizer, step, rank)
            pending, saved = checkpoint(pending, state, f"step-{step}", store, ckpt_group)
        if rank == 0:
            emit(event="step", step=step, loss=float(global_loss).hex(), save=saved)

    if pending is not None:
        pending.result()
    if rank == 0:
        params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save(params, args.final_params)
        emit(event="done")
    store.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
