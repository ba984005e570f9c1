"""Core benchmark of dcp_memstore: DCP save/load throughput against torch's FileSystemWriter/Reader and
the memcpy bound, all measured in the same run on the same tmpfs.

Configurations: 1 rank (plain tensors, no process group) and 2 ranks (processes spawned with
torch.multiprocessing, gloo, the state dict's tensors as DTensors sharded on dim 0, so each rank holds and
writes half of the bytes; both ranks on this machine and this tmpfs). Every configuration runs in new
processes and in rounds: after the warm-up saves, each round times every operation below once, so that a
change in what else runs on the machine hits an operation and its baseline alike. Measured:

* ``in-RAM memcpy``: the state dict copied into preallocated, already-faulted tensors (``copy_``), split
  over the same threads and in the same way as the store splits its copies. Baseline of the async-save
  blocking time.
* ``memcpy bound``: the same bytes copied into views of one preallocated, already-faulted tmpfs file
  mapping, same threads, same split. No tmpfs store can write faster.
* ``FileSystemWriter`` / ``FileSystemReader``: ``dcp.save`` / ``dcp.load`` with torch's file system storage
  on the same tmpfs, ``thread_count`` = the store's ``io_threads``. Every FileSystemWriter save writes new
  files (it has no other mode), so it is the baseline of first and steady-state saves alike.
* ``memstore save, first``: ``dcp.save`` into a fresh store (new shard files).
* ``memstore save, steady state``: after ``--warmup-saves`` saves (6), with ``keep_in_memory=2``, when
  evicted checkpoints' shard files (allocated, and mapped on their first reuse) are reused.
* ``memstore async_save, blocking``: the time ``dcp.async_save`` takes to return (staging: the copy into
  tmpfs shard files); its future is waited outside the timing. ``until done`` times the whole save.
* ``memstore load, restart``: ``dcp.load`` of a checkpoint whose files this process has never mapped (a
  copy of the newest one in a new store), as a restarted job finds its checkpoints. ``same process``: the
  newest checkpoint loaded by the processes that wrote it (their mappings cached), with checksum checks
  and without.
* With CUDA (1 rank): the state dict on the GPU; async-save blocking time (device-to-host straight into
  the pinned tmpfs mapping) against a pinned ``cudaMemcpy`` of the same bytes into preallocated pinned
  host tensors.

Numbers: median, min and max over ``--reps`` repetitions; with 2 ranks a repetition lasts as long as its
slowest rank. GB/s counts every rank's bytes, 1 GB = 1e9 bytes. ``CPU s`` is the CPU time (user + system,
all ranks' processes together) that the operation used: on a machine shared with other work it shows the
cost of an operation when its wall time is inflated by waiting for a core; ``by CPU s`` is the comparison
with the baseline made with CPU seconds instead of wall seconds (for information: targets are judged on
wall time). The load average before and after the run is printed with the results.

Everything is written under one temporary directory in the tmpfs (``--tmp``, default /dev/shm) that is
removed at the end, also on an error or Ctrl-C.

Run: ``python benchmarks/bench_core.py`` (``nox -s bench``); ``--quick`` for a small smoke run;
``--json PATH`` also writes the results as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import platform
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.store.mapping import MAPPINGS
from dcp_memstore.store.packing import Placement, pack

GB = 1e9
GIB = 1 << 30
ROW = 1024  # elements per row; every tensor is (rows, ROW)

Specs = list[tuple[str, torch.dtype, int]]  # (name, dtype, rows per rank)

# Operation names, in table order.
RAM = "in-RAM memcpy (copy into preallocated)"
BOUND = "memcpy bound (into faulted tmpfs mapping)"
FSW = "FileSystemWriter save"
FSR = "FileSystemReader load"
FIRST = "memstore save, first (fresh store)"
STEADY = "memstore save, steady state"
ASYNC = "memstore async_save, blocking"
ASYNC_TOTAL = "memstore async_save, until done"
LOAD = "memstore load, restart (not mapped)"
LOAD_CACHED = "memstore load, same process"
LOAD_NOVERIFY = "memstore load, same process, no verify"
GPU_PINNED = "GPU: pinned cudaMemcpy D2H"
GPU_ASYNC = "GPU: memstore async_save, blocking"
ORDER = [
    RAM,
    BOUND,
    FSW,
    FSR,
    FIRST,
    STEADY,
    ASYNC,
    ASYNC_TOTAL,
    LOAD,
    LOAD_CACHED,
    LOAD_NOVERIFY,
    GPU_PINNED,
    GPU_ASYNC,
]


# -- results -------------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    """One operation's repetitions: wall seconds (slowest rank) and CPU seconds (all ranks)."""

    name: str
    seconds: list[float]
    cpu_seconds: list[float]
    nbytes: int  # all ranks together

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / GB


@dataclass(frozen=True)
class Check:
    """A comparison of ``op`` with ``baseline``, with a target or (``target`` None) for information.

    ``faster``: ratio = t(baseline) / t(op), to be >= target (a speed-up, or a fraction of a bound).
    Otherwise ratio = t(op) / t(baseline), to be <= target (an allowed slowdown).
    """

    op: str
    baseline: str
    target: float | None
    faster: bool
    label: str


CHECKS = [
    Check(FIRST, FSW, 2.0, True, "x FSW"),
    Check(STEADY, FSW, 3.0, True, "x FSW"),
    Check(STEADY, BOUND, 0.60, True, "of bound"),
    Check(ASYNC, RAM, 1.25, False, "x memcpy"),
    Check(ASYNC_TOTAL, RAM, None, False, "x memcpy"),
    Check(LOAD, FSR, 3.0, True, "x FSR"),
    Check(LOAD_CACHED, FSR, None, True, "x FSR"),
    Check(LOAD_NOVERIFY, FSR, None, True, "x FSR"),
    Check(GPU_ASYNC, GPU_PINNED, 0.85, True, "of pinned"),
]


@dataclass
class ConfigResult:
    ranks: int
    io_threads: int
    torch_threads: int
    bytes_per_rank: int
    tensors: int
    measurements: dict[str, Measurement] = field(default_factory=dict)


# -- the state dict ------------------------------------------------------------------------------------------


def tensor_specs(total_bytes: int, count: int) -> Specs:
    """``count`` tensors of uneven sizes (0.25x to 1.75x the mean), alternately float32 and bfloat16, that
    together hold about ``total_bytes`` bytes; the same on every rank and in every run."""
    gen = torch.Generator().manual_seed(1234)
    weights = torch.empty(count).uniform_(0.25, 1.75, generator=gen).tolist()
    scale = total_bytes / sum(weights)
    specs = []
    for i, w in enumerate(weights):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        itemsize = torch.empty((), dtype=dtype).element_size()
        specs.append((f"layers.{i // 4}.param{i % 4}", dtype, max(1, round(w * scale / (ROW * itemsize)))))
    return specs


def spec_bytes(specs: Specs) -> int:
    return sum(rows * ROW * torch.empty((), dtype=dt).element_size() for _, dt, rows in specs)


def make_state_dict(specs: Specs, world: int, fill: bool, device: str = "cpu") -> dict[str, Any]:
    """Tensors of ``specs`` (rows per rank); with ``world > 1``, DTensors sharded on dim 0 over the world.
    Every tensor is written once (random values with ``fill``, else zeros), so its pages are faulted in."""
    rank = dist.get_rank() if world > 1 else 0
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(torch.device(device).type, (world,))
    sd: dict[str, Any] = {}
    for name, dtype, rows in specs:
        t = torch.empty((rows, ROW), dtype=dtype, device=device)
        if fill:
            t.uniform_(-1.0, 1.0, generator=gen)
        else:
            t.zero_()
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            t = DTensor.from_local(
                t, mesh, [Shard(0)], run_check=False, shape=(rows * world, ROW), stride=(ROW, 1)
            )
        sd[name] = t
    return sd


def local_tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    """The local tensors of a state dict (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return [v.to_local() if isinstance(v, DTensor) else v for v in sd.values()]


def assert_equal(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for x, y in zip(local_tensors(a), local_tensors(b), strict=True):
        if not torch.equal(x, y):
            raise AssertionError(f"{what}: the loaded state dict differs from the saved one")


def zero_(sd: dict[str, Any]) -> None:
    for t in local_tensors(sd):
        t.zero_()


def thread_bins(src: list[torch.Tensor], threads: int) -> tuple[list[Placement], list[int], list[list[int]]]:
    """The store's split of ``src`` over ``threads`` files: placements, file sizes, tensor indices per
    file."""
    placements, file_sizes = pack([t.numel() * t.element_size() for t in src], threads)
    bins: list[list[int]] = [[] for _ in file_sizes]
    for i, p in enumerate(placements):
        bins[p.bin].append(i)
    return placements, file_sizes, bins


def parallel_copy(dst: list[torch.Tensor], src: list[torch.Tensor], bins: list[list[int]]) -> None:
    """``dst[i].copy_(src[i])`` with one thread per bin, as the store runs its copies."""

    def run(idx: list[int]) -> None:
        for i in idx:
            dst[i].copy_(src[i])

    if len(bins) == 1:
        run(bins[0])
        return
    with ThreadPoolExecutor(len(bins)) as ex:
        list(ex.map(run, bins))


# -- timing across ranks -------------------------------------------------------------------------------------


def cpu_time() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Ranks:
    """This process's rank and the world size; the collectives are no-ops for one rank."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def reduce(self, wall: float, cpu: float) -> tuple[float, float]:
        """(slowest rank's wall seconds, all ranks' CPU seconds)."""
        if self.world == 1:
            return wall, cpu
        t = torch.tensor([wall, -cpu], dtype=torch.float64)
        c = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
        return float(t[0]), float(c[0])

    def timed(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """Wall seconds of ``fn`` on the slowest rank (all start together) and CPU seconds of all ranks."""
        self.barrier()
        c0, t0 = cpu_time(), time.perf_counter()
        fn()
        return self.reduce(time.perf_counter() - t0, cpu_time() - c0)


# -- the worker processes ------------------------------------------------------------------------------------


@dataclass
class WorkerArgs:
    world: int
    total_bytes: int
    tensors: int
    reps: int
    warmup_saves: int
    base: str  # this configuration's directory in the tmpfs
    out: str  # rank 0 writes its results here (JSON)
    port: int
    io_threads: int | None
    gpu: bool


def worker(rank: int, args: WorkerArgs) -> None:
    """One rank of one configuration (a spawned process)."""
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    world = args.world
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it; MemStore's io_threads default reads it
    # intra-op threads: the cores per rank (torchrun sets OMP_NUM_THREADS=1 for 2 ranks on 2 cores)
    torch_threads = max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(torch_threads)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ranks = Ranks(rank, world)
        specs = tensor_specs(args.total_bytes // world, args.tensors)
        probe = Path(args.base) / f"probe-r{rank}"
        io_threads = MemStore(root=probe, job_id="probe", io_threads=args.io_threads).io_threads
        shutil.rmtree(probe, ignore_errors=True)
        res = ConfigResult(world, io_threads, torch_threads, spec_bytes(specs), len(specs))

        def record(name: str, timings: list[tuple[float, float]]) -> None:
            m = Measurement(
                name, [w for w, _ in timings], [c for _, c in timings], res.bytes_per_rank * world
            )
            res.measurements[name] = m
            if rank == 0:
                print(f"  [{world} rank(s)] {name}: {m.median:.3f} s, {m.gbps:.2f} GB/s", flush=True)

        cpu_benchmarks(ranks, args, specs, io_threads, record)
        gc.collect()
        if args.gpu and world == 1 and torch.cuda.is_available():
            gpu_variant(ranks, args, specs, io_threads, record)
        if rank == 0:
            Path(args.out).write_text(json.dumps(asdict(res)))
    finally:
        if world > 1:
            dist.destroy_process_group()


Record = Callable[[str, list[tuple[float, float]]], None]


def cpu_benchmarks(ranks: Ranks, args: WorkerArgs, specs: Specs, io_threads: int, record: Record) -> None:
    """Every CPU measurement, in rounds: each round times every operation once, so that a change in what
    else runs on the machine affects an operation and its baseline alike."""
    base = Path(args.base)
    sd = make_state_dict(specs, args.world, fill=True)
    dest = make_state_dict(specs, args.world, fill=False)
    src_t, dst_t = local_tensors(sd), local_tensors(dest)
    placements, file_sizes, bins = thread_bins(src_t, io_threads)
    timings: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, timing: tuple[float, float]) -> None:
        timings.setdefault(name, []).append(timing)

    store = MemStore(root=base / "store", job_id="steady", io_threads=io_threads, keep_in_memory=2)
    unverified = MemStore(root=base / "store", job_id="steady", io_threads=io_threads, verify_checksums=False)
    step = iter(range(10**9))

    def save() -> None:
        dcp.save(sd, checkpoint_id=f"step-{next(step)}", storage_writer=MemoryStorageWriter(store))

    def load(s: MemStore, cid: str) -> None:
        dcp.load(dest, checkpoint_id=cid, storage_reader=MemoryStorageReader(s))

    for _ in range(args.warmup_saves):
        save()
    async_save(ranks, store, sd, step)  # warm-up: the stager's first slot
    parallel_copy(dst_t, src_t, bins)  # warm-up
    for r in range(args.reps):
        if ranks.rank == 0:
            print(f"  [{args.world} rank(s)] round {r + 1}/{args.reps}", flush=True)
        add(RAM, ranks.timed(lambda: parallel_copy(dst_t, src_t, bins)))
        add(BOUND, memcpy_bound(ranks, base, src_t, placements, file_sizes, bins))

        # FileSystemWriter / FileSystemReader on the same tmpfs, the same thread count
        fsw_dir = base / f"fsw-{r}"
        writer = dcp.FileSystemWriter(fsw_dir, thread_count=io_threads)
        add(FSW, ranks.timed(lambda w=writer: dcp.save(sd, storage_writer=w)))
        zero_(dest)
        reader = dcp.FileSystemReader(fsw_dir)
        add(FSR, ranks.timed(lambda rd=reader: dcp.load(dest, storage_reader=rd)))
        assert_equal(sd, dest, "FileSystemReader")
        remove(ranks, fsw_dir)

        # memstore: first save into a fresh store; steady state; async save
        fresh = MemStore(root=base / "first", job_id=f"fresh-{r}", io_threads=io_threads)
        add(
            FIRST,
            ranks.timed(
                lambda s=fresh: dcp.save(sd, checkpoint_id="step-0", storage_writer=MemoryStorageWriter(s))
            ),
        )
        drop_store(ranks, fresh)
        add(STEADY, ranks.timed(save))
        blocking, until_done = async_save(ranks, store, sd, step)
        add(ASYNC, blocking)
        add(ASYNC_TOTAL, until_done)

        # memstore loads: as after a restart (a copy of the newest checkpoint, never mapped by this process),
        # and in the process that wrote it (its mappings cached), with and without checksum checks
        latest = store.latest_checkpoint()
        assert latest is not None
        restarted = copy_store(ranks, store, latest, base / f"restart-{r}", io_threads)
        zero_(dest)
        add(LOAD, ranks.timed(lambda s=restarted, c=latest: load(s, c)))
        assert_equal(sd, dest, "MemoryStorageReader (restart)")
        drop_store(ranks, restarted)
        zero_(dest)
        add(LOAD_CACHED, ranks.timed(lambda c=latest: load(store, c)))
        assert_equal(sd, dest, "MemoryStorageReader")
        add(LOAD_NOVERIFY, ranks.timed(lambda c=latest: load(unverified, c)))
    for name in ORDER:
        if name in timings:
            record(name, timings[name])
    drop_store(ranks, store)


def remove(ranks: Ranks, path: Path) -> None:
    """Delete ``path`` (rank 0), once every rank is done with it."""
    ranks.barrier()
    if ranks.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    ranks.barrier()


def copy_store(ranks: Ranks, store: MemStore, cid: str, root: Path, io_threads: int) -> MemStore:
    """A new store under ``root`` holding a copy of ``store``'s checkpoint ``cid``: files in the tmpfs
    that this process has never mapped, as a restarted job finds its checkpoints."""
    if ranks.rank == 0:
        shutil.copytree(store.layout.checkpoint_dir(cid), root / store.job_id / "checkpoints" / cid)
    ranks.barrier()
    return MemStore(root=root, job_id=store.job_id, io_threads=io_threads)


def memcpy_bound(
    ranks: Ranks,
    base: Path,
    src: list[torch.Tensor],
    placements: list[Placement],
    file_sizes: list[int],
    bins: list[list[int]],
) -> tuple[float, float]:
    """Timing of copying ``src`` into views of a tmpfs file that is allocated, mapped and faulted in first."""
    path = base / f"bound-r{ranks.rank}"
    size = sum(file_sizes)
    starts = [sum(file_sizes[:b]) for b in range(len(file_sizes))]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            timing = _bound_copies(ranks, mm, starts, src, placements, bins)
            gc.collect()
        finally:
            mm.close()  # the views died with _bound_copies' frame
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return timing


def _bound_copies(
    ranks: Ranks,
    mm: mmap.mmap,
    starts: list[int],
    src: list[torch.Tensor],
    placements: list[Placement],
    bins: list[list[int]],
) -> tuple[float, float]:
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    flat.fill_(0)  # fault every page in once
    views = []
    for t, p in zip(src, placements, strict=True):
        start = starts[p.bin] + p.offset
        views.append(flat[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
    parallel_copy(views, src, bins)  # warm-up
    timing = ranks.timed(lambda: parallel_copy(views, src, bins))
    for v, t in zip(views, src, strict=True):
        if not torch.equal(v, t):
            raise AssertionError("memcpy bound: copy mismatch")
    return timing


def async_save(
    ranks: Ranks, store: MemStore, sd: dict[str, Any], step: Iterator[int]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Timings of one ``dcp.async_save``: until it returns, and until its future is done."""
    writer = MemoryStorageWriter(store)
    cid = f"step-{next(step)}"
    ranks.barrier()
    c0, t0 = cpu_time(), time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=cid, storage_writer=writer)
    c1, t1 = cpu_time(), time.perf_counter()
    fut.result()
    c2, t2 = cpu_time(), time.perf_counter()
    return ranks.reduce(t1 - t0, c1 - c0), ranks.reduce(t2 - t0, c2 - c0)


def drop_store(ranks: Ranks, store: MemStore) -> None:
    """Close a store (which stops the allocation of its next save's files), delete its files (rank 0) and
    release every rank's mappings of them."""
    ranks.barrier()
    store.close()
    ranks.barrier()
    if ranks.rank == 0:
        shutil.rmtree(store.layout.job_dir, ignore_errors=True)
    ranks.barrier()
    gc.collect()
    MAPPINGS.prune()


def gpu_variant(ranks: Ranks, args: WorkerArgs, specs: Specs, io_threads: int, record: Record) -> None:
    """The state dict on the GPU: async_save blocking time (device-to-host into the pinned tmpfs mapping)
    against a pinned cudaMemcpy of the same bytes into preallocated pinned host tensors, the two timed in
    turn in each round; then the newest checkpoint is loaded back onto the GPU and compared bit for bit,
    so a fast but wrong copy cannot pass."""
    if ranks.rank == 0:
        print("  GPU variant", flush=True)
    sd = make_state_dict(specs, 1, fill=True, device="cuda")
    src = local_tensors(sd)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]

    def d2h() -> None:
        for d, s in zip(pinned, src, strict=True):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()

    d2h()  # warm-up
    store = MemStore(root=Path(args.base) / "gpu", job_id="gpu", io_threads=io_threads, keep_in_memory=2)
    torch.cuda.synchronize()
    step = iter(range(10**9))
    for _ in range(args.warmup_saves):
        async_save(ranks, store, sd, step)
    rounds = [(ranks.timed(d2h), async_save(ranks, store, sd, step)[0]) for _ in range(args.reps)]
    record(GPU_PINNED, [r[0] for r in rounds])
    record(GPU_ASYNC, [r[1] for r in rounds])
    pinned.clear()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, checkpoint_id=store.latest_checkpoint(), storage_reader=MemoryStorageReader(store))
    assert_equal(sd, out, "GPU variant")
    drop_store(ranks, store)


# -- the parent process: configurations, table, JSON ---------------------------------------------------------


def run_world(world: int, args: argparse.Namespace, tmp: Path) -> ConfigResult:
    """Run one configuration in ``world`` new processes; return rank 0's results."""
    base, out = tmp / f"w{world}", tmp / f"result-{world}.json"
    base.mkdir()
    wargs = WorkerArgs(
        world=world,
        total_bytes=int(args.size_gib * GIB),
        tensors=args.tensors,
        reps=args.reps,
        warmup_saves=args.warmup_saves,
        base=str(base),
        out=str(out),
        port=free_port(),
        io_threads=args.io_threads,
        gpu=not args.no_gpu,
    )
    try:
        mp.start_processes(worker, args=(wargs,), nprocs=world, join=True, start_method="spawn")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    raw = json.loads(out.read_text())
    raw["measurements"] = {k: Measurement(**v) for k, v in raw["measurements"].items()}
    return ConfigResult(**raw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(res: ConfigResult) -> list[dict[str, Any]]:
    """Table rows: every measurement, once per comparison it takes part in (or once, without one)."""
    out = []
    for name, m in res.measurements.items():
        row: dict[str, Any] = {
            "operation": name,
            "median_s": m.median,
            "min_s": min(m.seconds),
            "max_s": max(m.seconds),
            "gbps": m.gbps,
            "cpu_s": statistics.median(m.cpu_seconds),
            "baseline": None,
            "ratio": None,
            "cpu_ratio": None,
            "ratio_label": None,
            "target": None,
            "passed": None,
        }
        checks = [c for c in CHECKS if c.op == name and c.baseline in res.measurements]
        if not checks:
            out.append(row)
        for c in checks:
            bm = res.measurements[c.baseline]
            ratio = bm.median / m.median if c.faster else m.median / bm.median
            b_cpu, op_cpu = statistics.median(bm.cpu_seconds), row["cpu_s"]
            cpu_ratio = (b_cpu / op_cpu if c.faster else op_cpu / b_cpu) if min(b_cpu, op_cpu) > 0 else None
            r = dict(row, baseline=c.baseline, ratio=ratio, cpu_ratio=cpu_ratio, ratio_label=c.label)
            if c.target is not None:
                r["target"] = f"{'>=' if c.faster else '<='} {c.target:g}"
                r["passed"] = ratio >= c.target if c.faster else ratio <= c.target
            out.append(r)
    return out


def format_table(res: ConfigResult, reps: int) -> str:
    """A Markdown table of one configuration."""
    head = (
        f"{res.ranks} rank(s): {res.bytes_per_rank * res.ranks / GIB:.2f} GiB, "
        f"{res.tensors} tensors per rank "
        f"({res.bytes_per_rank / GIB:.2f} GiB per rank), io_threads={res.io_threads} and "
        f"torch threads={res.torch_threads} per rank; median [min-max] of {reps} reps"
    )
    cols = ["operation", "seconds", "GB/s", "CPU s", "vs baseline", "by CPU s", "target", "result"]
    body = [
        [
            r["operation"],
            f"{r['median_s']:.3f} [{r['min_s']:.3f}-{r['max_s']:.3f}]",
            f"{r['gbps']:.2f}",
            f"{r['cpu_s']:.2f}",
            "" if r["ratio"] is None else f"{r['ratio']:.2f} {r['ratio_label']}",
            "" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.2f}",
            r["target"] or "",
            {None: "", True: "PASS", False: "FAIL"}[r["passed"]],
        ]
        for r in rows(res)
    ]
    return "\n".join([head, "", markdown_table(cols, body)])


def markdown_table(cols: list[str], body: list[list[str]]) -> str:
    """A Markdown table with columns padded to their widest cell (the benchmarks' common output)."""
    widths = [max(len(x) for x in col) for col in zip(cols, *body, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def run_record(info: dict, args: Any, wall: float, load_before: Any, load_after: Any) -> dict[str, Any]:
    """What every benchmark's --json output starts with: the machine, the arguments, wall time, load."""
    return {
        "machine": info,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal")), 0)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "ram_gib": round(mem / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="dcp_memstore core benchmark: save/load against FileSystemWriter/Reader and memcpy."
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="state dict size, all ranks together (2)")
    p.add_argument("--tensors", type=int, default=100, help="tensors in the state dict (100)")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts to run (1,2)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each operation (3)")
    p.add_argument(
        "--warmup-saves",
        type=int,
        default=6,
        help="saves before steady state is timed (6: a new shard file is written with pwrite and mapped "
        "on its first reuse, so with keep_in_memory=2 every file is mapped from the 6th save on)",
    )
    p.add_argument("--io-threads", type=int, default=None, help="MemStore io_threads (the store's default)")
    p.add_argument("--quick", action="store_true", help="smoke run: 64 MiB, 20 tensors, 2 reps")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU variant where CUDA is available")
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    p.add_argument("--tmp", default="/dev/shm", help="tmpfs directory to work in (/dev/shm)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib, args.tensors, args.reps, args.warmup_saves = 1 / 16, 20, 2, 2
    try:
        args.ranks = [int(r) for r in str(args.ranks).split(",") if r.strip()]
    except ValueError:
        p.error("--ranks takes comma-separated integers, e.g. 1,2")
    if not args.ranks or min(args.ranks) < 1 or args.reps < 1 or args.tensors < 1 or args.size_gib <= 0:
        p.error("--ranks, --reps, --tensors and --size-gib must be positive")
    return args


def check_memory(args: argparse.Namespace) -> None:
    """Refuse to start where a configuration cannot fit: about 6.5 copies of the state dict may live at
    once (source, load destination, and in the tmpfs store 2 kept + 1 in flight + pooled files)."""
    need = 6.5 * args.size_gib * GIB
    free_tmp = shutil.disk_usage(args.tmp).free
    with open("/proc/meminfo") as f:
        avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable"))
    if need > avail or 4.5 * args.size_gib * GIB > free_tmp:
        sys.exit(
            f"bench_core: needs about {need / GIB:.1f} GiB of memory ({4.5 * args.size_gib:.1f} GiB of it in "
            f"{args.tmp}); {avail / GIB:.1f} GiB available, {free_tmp / GIB:.1f} GiB free in {args.tmp}. "
            "Use a smaller --size-gib."
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_memory(args)
    info = machine()
    print(
        f"bench_core: {info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB RAM, "
        f"kernel {info['kernel']}, Python {info['python']}, torch {info['torch']}"
        + (f", GPU {info['cuda']}" if info["cuda"] else ""),
        flush=True,
    )
    load_before = os.getloadavg()
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dcp_memstore_bench_", dir=args.tmp))
    results: list[ConfigResult] = []
    try:
        for world in args.ranks:
            print(f"running {world} rank(s) ...", flush=True)
            results.append(run_world(world, args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()
    print()
    for res in results:
        print(format_table(res, args.reps))
        print()
    missed = [r for res in results for r in rows(res) if r["passed"] is False]
    print(
        f"wall time {wall:.0f} s; load average (1/5/15 min) before "
        f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}; "
        + (f"{len(missed)} target(s) missed" if missed else "all targets met")
    )
    if args.json:
        payload = {
            **run_record(info, args, wall, load_before, load_after),
            "configs": [
                {
                    "ranks": res.ranks,
                    "io_threads": res.io_threads,
                    "torch_threads": res.torch_threads,
                    "bytes_per_rank": res.bytes_per_rank,
                    "tensors": res.tensors,
                    "measurements": {k: asdict(m) for k, m in res.measurements.items()},
                    "rows": rows(res),
                }
                for res in results
            ],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
