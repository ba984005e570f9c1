"""Megatron-Core benchmark: ``dist_checkpointing.save`` through ``MemStoreSaveStrategy`` against Megatron's
default torch_dist strategy, both on the same tmpfs, in the same run.

``--ranks`` processes (default 2, spawned, gloo, CPU tensors) each hold a Megatron sharded state dict of
``--tensors`` tensors (alternately float32 and bfloat16, uneven sizes; bench_core's ``tensor_specs``),
tensor-parallel shards on dim 0 (``ShardedTensor.from_rank_offsets``), about ``--size-gib`` in all, plus a
ShardedObject per rank and some common state. Each strategy saves it with ``async_sharded_save=True``
and the request goes to Megatron's ``AsyncCallsQueue`` (a forked worker per save), as Megatron-LM does.
``MemStoreSaveStrategy`` is timed a second time with Megatron's persistent worker
(``AsyncCallsQueue(persistent=True)``, Megatron-LM's ``--use-persistent-ckpt-worker``: one spawned
process per rank, started by the first save, to which every request is pickled; no fork):

* ``blocking``: from the ``dist_checkpointing.save`` call until ``schedule_async_request`` returns, i.e.
  what the training loop waits for (ours: staging copy into tmpfs plus planning; torch_dist: planning,
  then the fork, whose copy-on-write pages are its snapshot of CPU tensors).
* ``until committed``: until ``maybe_finalize_async_calls(blocking=True)`` returns (checkpoint complete,
  metadata.json written); in between, the rank runs one stand-in training step (below), as training would.
* ``training step right after save``: that stand-in step (every live tensor rewritten in place, values
  unchanged, as an optimizer step does), run as soon as the save has been scheduled, against the same step
  with no save in flight. While a forked writer still shares the trainer's memory, every page the step
  writes is copied first (copy-on-write): torch_dist's worker lives until all bytes are written, ours
  only checksums and renames files that staging already filled.
  A persistent worker forks nothing, so the step right after the save pays no copy-on-write.
* ``load``: ``dist_checkpointing.load`` of the checkpoint into preallocated tensors (ours: from the store;
  torch_dist: ``.distcp`` files), checked bit for bit against the saved state.

torch_dist writes its ``.distcp`` files in the checkpoint directory under ``--tmp`` (default /dev/shm);
``MemStoreSaveStrategy`` writes into a store whose root is under the same directory (the checkpoint
directory then only gets Megatron's small files). Defaults of each: torch_dist ``thread_count=2`` (two
writer processes per rank), the store's ``io_threads`` (cores per local rank, at most 4),
``keep_in_memory=2``. ``--warmup-saves`` untimed saves of each strategy come first (3: from the 4th save
on, the store stages into the files of evicted checkpoints, already allocated, as in a training job; the
blocking time of the very first save, which allocates new tmpfs files, and for torch_dist starts a
multiprocessing manager for its results queue, is reported on its own; the persistent worker's first
save comes after the store's and only starts the worker, which imports torch and Megatron while the
save is "in flight"), then ``--reps`` rounds, each timing the three ways (the order alternating).
Median [min-max] over the rounds, the slowest rank's wall time; ``CPU s`` is the CPU time of all ranks
and of their child processes (the forked writers once reaped, the persistent worker as it runs); GB/s
counts all ranks' bytes (1 GB = 1e9 B); ``ratio`` is the baseline's median time over this row's (above
1: this row is faster). The persistent worker's first save is not timed, and its checkpoints are loaded
(and checked) but not timed: the load is the store's.

Megatron calls CUDA-only functions on its async path (``tests/megatron/cuda_shim.py``); on a machine
without CUDA that shim is applied in the benchmark's processes.

Run from the repository root: ``python benchmarks/bench_megatron.py`` (needs ``pip install
'dcp_memstore[megatron]'``); ``--quick`` for a smoke run; ``--json PATH`` also writes the timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.bench_core import (  # noqa: E402
    GIB,
    ROW,
    Measurement,
    Ranks,
    free_port,
    machine,
    markdown_table,
    spec_bytes,
    tensor_specs,
)

# how each way of saving is named in the checkpoint directories (a valid checkpoint id) and in the table
KINDS = {"torch_dist": "torch_dist", "memstore": "memstore", "memstore_pw": "memstore, persistent worker"}
PERSISTENT = "memstore_pw"  # our strategy through AsyncCallsQueue(persistent=True)
OPS = [  # (operation, baseline) in table order
    ("torch_dist async save, blocking, first save", None),
    ("memstore async save, blocking, first save", "torch_dist async save, blocking, first save"),
    ("torch_dist async save, blocking", None),
    ("memstore async save, blocking", "torch_dist async save, blocking"),
    ("memstore, persistent worker async save, blocking", "torch_dist async save, blocking"),
    ("torch_dist async save, until committed", None),
    ("memstore async save, until committed", "torch_dist async save, until committed"),
    ("memstore, persistent worker async save, until committed", "torch_dist async save, until committed"),
    ("training step, no save in flight", None),
    ("torch_dist: training step right after save", "training step, no save in flight"),
    ("memstore: training step right after save", "training step, no save in flight"),
    ("memstore, persistent worker: training step right after save", "training step, no save in flight"),
    ("torch_dist load", None),
    ("memstore load", "torch_dist load"),
]


@dataclass
class Args:
    world: int
    total_bytes: int
    tensors: int
    reps: int
    warmup_saves: int
    base: str
    out: str
    port: int


def cpu_with_children() -> float:
    """CPU seconds of this process, of its reaped children (Megatron's forked writers) and of those that
    live (a persistent worker)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # it ended since it was listed: counted once reaped
            times = child.cpu_times()
            live += times.user + times.system
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + live


def worker(rank: int, args: Args) -> None:
    """One rank: warm up, then time the three ways of saving in alternating rounds; rank 0 writes the
    results."""
    warnings.simplefilter("ignore")  # Megatron warns about missing Transformer Engine/Apex at import
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), LOCAL_WORLD_SIZE=str(args.world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from dcp_memstore import MemStore
    from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy
    from tests.megatron.cuda_shim import shim_cuda_for_cpu, shim_persistent_worker_for_cpu

    shim_cuda_for_cpu()
    shim_persistent_worker_for_cpu()
    try:
        ranks, world, base = Ranks(rank, args.world), args.world, Path(args.base)
        specs = tensor_specs(args.total_bytes // world, args.tensors)
        gen = torch.Generator().manual_seed(1000 + rank)
        local = {
            name: torch.empty(rows, ROW, dtype=dt).uniform_(-1, 1, generator=gen) for name, dt, rows in specs
        }

        def sharded(values: dict[str, torch.Tensor], obj: Any) -> dict[str, Any]:
            sd: dict[str, Any] = {
                n: ShardedTensor.from_rank_offsets(n, t, (0, rank, world)) for n, t in values.items()
            }
            return {**sd, "loader": ShardedObject("loader", obj, (world,), (rank,)), "iteration": 7}

        store = MemStore(root=base / "store", job_id="bench", keep_in_memory=2)
        ours = MemStoreSaveStrategy(store)
        strategies = {"torch_dist": get_default_save_sharded_strategy(), "memstore": ours, PERSISTENT: ours}
        load_ours = MemStoreLoadStrategy(store)
        loaders = {"torch_dist": None, "memstore": load_ours, PERSISTENT: load_ours}
        forking = AsyncCallsQueue()
        queues = {"torch_dist": forking, "memstore": forking, PERSISTENT: AsyncCallsQueue(persistent=True)}
        counter = iter(range(10**9))
        timings: dict[str, list[tuple[float, float]]] = {}
        dest = {n: torch.zeros_like(t) for n, t in local.items()}

        def ckpt_dir(kind: str) -> Path:
            d = base / "ckpts" / f"{kind}_{next(counter):07d}"
            if rank == 0:
                d.mkdir(parents=True)
            ranks.barrier()
            return d

        def save(kind: str) -> tuple[Path, tuple[float, float], tuple[float, float]]:
            d = ckpt_dir(kind)
            ranks.barrier()
            c0, t0 = cpu_with_children(), time.perf_counter()
            request = mdc.save(
                sharded(local, {"rank": rank}),
                str(d),
                sharded_strategy=strategies[kind],
                async_sharded_save=True,
            )
            queues[kind].schedule_async_request(request)
            c1, t1 = cpu_with_children(), time.perf_counter()
            step = step_timing()  # training goes on while the save is written
            queues[kind].maybe_finalize_async_calls(blocking=True)
            c2, t2 = cpu_with_children(), time.perf_counter()
            return d, ranks.reduce(t1 - t0, c1 - c0), ranks.reduce(t2 - t0, c2 - c0), step

        def step_timing() -> tuple[float, float]:
            """A stand-in for an optimizer step: every live tensor rewritten in place (values unchanged).
            While a forked writer shares the trainer's pages, each page written is copied first."""
            c0, t0 = cpu_with_children(), time.perf_counter()
            for t in local.values():
                t.mul_(1.0)
            return time.perf_counter() - t0, cpu_with_children() - c0

        def load(kind: str, d: Path) -> tuple[float, float]:
            for t in dest.values():
                t.zero_()

            def run() -> None:
                mdc.load(sharded(dest, None), str(d), sharded_strategy=loaders[kind])

            timing = ranks.timed(run)
            if not all(torch.equal(dest[n], local[n]) for n in local):
                raise AssertionError(f"{kind}: the loaded state differs from the saved one")
            return timing

        def remove(d: Path) -> None:
            ranks.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            ranks.barrier()

        for i in range(args.warmup_saves):  # the first saves: new files, torch_dist's results-queue manager
            for kind in strategies:
                d, blocking, _, _ = save(kind)
                if i == 0 and kind != PERSISTENT:  # it follows the store's first save (see the docstring)
                    timings[f"{KINDS[kind]} async save, blocking, first save"] = [blocking]
                remove(d)
        for r in range(args.reps):
            if rank == 0:
                print(f"  round {r + 1}/{args.reps}", flush=True)
            ranks.barrier()
            timings.setdefault("training step, no save in flight", []).append(ranks.reduce(*step_timing()))
            for kind in list(strategies) if r % 2 == 0 else reversed(list(strategies)):
                d, blocking, total, step = save(kind)
                label = KINDS[kind]
                timings.setdefault(f"{label} async save, blocking", []).append(blocking)
                timings.setdefault(f"{label} async save, until committed", []).append(total)
                timings.setdefault(f"{label}: training step right after save", []).append(ranks.reduce(*step))
                loaded = load(kind, d)  # checks what it loads bit for bit
                if kind != PERSISTENT:  # the same load as the store's
                    timings.setdefault(f"{label} load", []).append(loaded)
                remove(d)
        if rank == 0:
            nbytes = spec_bytes(specs) * world
            result = {
                name: asdict(Measurement(name, [w for w, _ in t], [c for _, c in t], nbytes))
                for name, t in timings.items()
            }
            meta = {
                "ranks": world,
                "bytes_per_rank": spec_bytes(specs),
                "tensors": len(specs),
                "io_threads": store.io_threads,
                "torch_dist_thread_count": strategies["torch_dist"].thread_count,
            }
            Path(args.out).write_text(json.dumps({"meta": meta, "measurements": result}))
        persistent = queues.pop(PERSISTENT)
        persistent.close()  # stops the worker
        del persistent  # now, while the process group exists: Megatron's __del__ asks it for this rank
        store.close()
    finally:
        dist.destroy_process_group()


def table(meta: dict[str, Any], ms: dict[str, Measurement], reps: int) -> str:
    """A Markdown table of the measurements, each compared with its torch_dist baseline."""
    head = (
        f"{meta['ranks']} rank(s): {meta['bytes_per_rank'] * meta['ranks'] / GIB:.2f} GiB, {meta['tensors']} "
        f"tensors per rank; memstore io_threads={meta['io_threads']}, torch_dist "
        f"thread_count={meta['torch_dist_thread_count']}; median [min-max] of {reps} rounds "
        "(first save: one save)"
    )
    cols = ["operation", "seconds", "GB/s", "CPU s", "ratio (baseline / this)"]
    body = []
    for name, baseline in OPS:
        m = ms[name]
        ratio = f"{ms[baseline].median / m.median:.2f}" if baseline else ""
        body.append(
            [
                name,
                f"{m.median:.3f} [{min(m.seconds):.3f}-{max(m.seconds):.3f}]",
                f"{m.gbps:.2f}",
                f"{statistics.median(m.cpu_seconds):.2f}",
                ratio,
            ]
        )
    return "\n".join([head, "", markdown_table(cols, body)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state dict size, all ranks together (1)")
    p.add_argument("--tensors", type=int, default=64, help="tensors per rank (64)")
    p.add_argument("--ranks", type=int, default=2, help="ranks (2)")
    p.add_argument("--reps", type=int, default=3, help="timed rounds (3)")
    p.add_argument(
        "--warmup-saves",
        type=int,
        default=3,
        help="untimed saves of each strategy first (3: with keep_in_memory=2 the store's later saves reuse "
        "the files of evicted checkpoints, as a training job's do)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 64 MiB, 16 tensors, 2 rounds")
    p.add_argument("--tmp", default="/dev/shm", help="tmpfs directory to work in (/dev/shm)")
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib, args.tensors, args.reps = 1 / 16, 16, 2
    if args.ranks < 1 or args.reps < 1 or args.tensors < 1 or args.size_gib <= 0 or args.warmup_saves < 1:
        p.error("--ranks, --reps, --tensors, --warmup-saves and --size-gib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    print(
        f"bench_megatron: {info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB RAM, kernel "
        f"{info['kernel']}, Python {info['python']}, torch {info['torch']}, megatron-core "
        f"{_version('megatron-core')}",
        flush=True,
    )
    load_before, started = os.getloadavg(), time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dcp_memstore_bench_megatron_", dir=args.tmp))
    try:
        out = tmp / "result.json"
        wargs = Args(
            world=args.ranks,
            total_bytes=int(args.size_gib * GIB),
            tensors=args.tensors,
            reps=args.reps,
            warmup_saves=args.warmup_saves,
            base=str(tmp),
            out=str(out),
            port=free_port(),
        )
        mp.start_processes(worker, args=(wargs,), nprocs=args.ranks, join=True, start_method="spawn")
        raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ms = {k: Measurement(**v) for k, v in raw["measurements"].items()}
    print()
    print(table(raw["meta"], ms, args.reps))
    wall, load_after = time.perf_counter() - started, os.getloadavg()
    print(
        f"\nwall time {wall:.0f} s; load average (1/5/15 min) "
        f"before {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load_after)}"
    )
    if args.json:
        payload = {
            "machine": info,
            "args": vars(args),
            "meta": raw["meta"],
            "measurements": raw["measurements"],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
