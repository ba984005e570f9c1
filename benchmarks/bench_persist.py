"""Persistence benchmark of dcp_memstore: what uploading checkpoints to S3 or a directory costs, against
plain s3fs / ``shutil`` copies of the same bytes, and what it does to the step time of a training loop.

Everything runs in one process, against one real S3 server started for the run (SeaweedFS ``weed mini``
on 127.0.0.1, from ``tests/s3_server.py``; it shares the machine's cores with the benchmark). Three parts:

1. **Persist to S3 vs raw s3fs.** A checkpoint of ``--size-mib`` (16 float32 tensors and a small
   non-tensor entry, so the rank writes ``__0_0.shard``, ``__0_1.shard`` and ``__0_objects.bin``) is saved
   with ``dcp.save`` into a fresh store whose ``persist_to`` is a bucket (``persist_every=None``); timed:
   ``store.persist(id)`` until ``store.wait_persisted(id)`` returns, i.e. upload, part records and
   publication. Baselines, the same local shard files uploaded to another prefix of the same bucket:
   ``fs.put_file`` with one thread per file and as many threads as the persister has (``io_threads``), and
   ``fs.put(list, list)`` (one call, s3fs's own concurrency). The faster of the two is "raw s3fs put".
   For information: ``fs.put_file`` with ``max_concurrency=1``, i.e. one multipart part at a time per file,
   as the file-like writer the persister streams into (``fs.open(..., "wb")``) uploads.
2. **Persist to a directory vs ``shutil.copyfile``.** The same with ``persist_to`` a directory on disk
   (``--disk-dir``, default a temporary directory under /tmp), against ``shutil.copyfile`` of the same files
   on ``io_threads`` threads, then ``fsync`` of each file and of its directory, as the persister makes
   every file it writes durable; for information also without the fsyncs (page cache only). ``--dir-reps``
   repetitions (9: they are cheap and noisier). ``os.sync()`` runs before every timed operation, outside
   the timing.
3. **Training-step time, persistence off vs on.** An MLP (8 layers of h x h, SGD with momentum; h chosen so
   that parameters plus momentum are ``--ckpt-mib``) trained on random data, its batch size calibrated at
   the start for about ``--step-ms`` per step. Every ``--every`` steps the model and optimizer state are
   saved with ``dcp.async_save`` into the store; the previous save's future is waited for just before the
   next save is issued, as a trainer would. Run with ``persist_to=None`` ("off") and with ``persist_to=`` a
   bucket and ``persist_every=1`` ("on"), and for information with ``persist_to=None`` and every checkpoint
   kept in memory ("keep": no shard file is reused, so every save stages into new tmpfs pages, as saves do
   while uploads lag and hold their checkpoints), the order alternating over ``--reps`` rounds.
   ``--warmup-steps`` (and their saves) run before the timed steps. Reported per configuration: step-time
   median, p90 and mean over all steps, over the steps that issue a save (``fut.result()`` of the previous
   save plus ``async_save`` staging) and over the others; the spread of the median across rounds; the
   on/off ratio of medians. With persistence on, uploads still owed when the loop ends are waited for
   afterwards (reported, not part of any step).

Numbers: median [min-max] over ``--reps`` repetitions (part 1 and 2: each repetition times every operation
once, the order alternating between repetitions). MB/s counts the local shard files' bytes (1 MB = 1e6 B).
``CPU s`` is this process's CPU time (user + system, all threads) and, for S3, the server's; in part 3
also that of the upload threads (the persister's, its pool's and fsspec's event loop).

Run from the repository root: ``python benchmarks/bench_persist.py`` (about 7 minutes on 2 cores);
``--quick`` for a small smoke run (about 1 to 2 minutes); ``--json PATH`` also writes every timing as JSON.
Everything is removed at the end (the store roots in /dev/shm, the directories on disk, the server and its
data), also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from benchmarks.bench_core import cpu_time as cpu_self  # noqa: E402
from benchmarks.bench_core import machine as core_machine  # noqa: E402
from benchmarks.bench_core import markdown_table as table  # noqa: E402
from benchmarks.bench_core import run_record  # noqa: E402
from dcp_memstore import MemoryStorageWriter, MemStore  # noqa: E402
from tests.s3_server import SeaweedS3  # noqa: E402

MB = 1e6
MIB = 1 << 20
ROW = 1024  # float32 elements per row of the part-1 tensors
WAIT_S = 900.0  # longest wait for one checkpoint's upload

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning)

# operation names (parts 1 and 2)
PERSIST_S3 = "persist to S3 (persist -> wait_persisted)"
PUT_FILE = "raw s3fs put_file, 1 thread per file"
PUT_LIST = "raw s3fs put([files], [paths])"
PUT_SEQ = "s3fs put_file, max_concurrency=1 (info)"
PERSIST_DIR = "persist to directory (persist -> wait_persisted)"
COPYFILE = "raw shutil.copyfile, 1 thread per file (info)"
COPYFILE_SYNC = "raw shutil.copyfile + fsync, 1 thread per file"


# -- small helpers -------------------------------------------------------------------------------------------


def cpu_of(pid: int | None, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid`` (or its thread ``tid``) so far; 0 where unreadable."""
    if pid is None:
        return 0.0
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_cpu(prefixes: tuple[str, ...]) -> float:
    """CPU seconds so far of this process's live Python threads whose name starts with one of ``prefixes``."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith(prefixes) and t.native_id is not None:
            total += cpu_of(os.getpid(), t.native_id)
    return total


UPLOAD_THREADS = ("dcp_memstore_persist", "fsspecIO")  # the persister, its upload pool, fsspec's event loop


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linear interpolation."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    """``median [min-max]``."""
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def data_files(store: MemStore, cid: str) -> list[Path]:
    """The checkpoint's shard files and objects file (what the persister uploads), by name."""
    d = store.layout.checkpoint_dir(cid)
    return sorted(p for p in d.iterdir() if p.is_file() and p.name.startswith("__"))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parallel(fn: Callable[[Any], Any], items: list[Any], threads: int) -> None:
    with ThreadPoolExecutor(max(1, min(threads, len(items)))) as ex:
        list(ex.map(fn, items))


def machine() -> dict[str, Any]:
    return {**core_machine(), "torch_threads": torch.get_num_threads()}


# -- parts 1 and 2: upload throughput ------------------------------------------------------------------------


@dataclass
class Op:
    """One operation's repetitions."""

    name: str
    seconds: list[float] = field(default_factory=list)
    cpu_self: list[float] = field(default_factory=list)
    cpu_server: list[float] = field(default_factory=list)
    info: bool = False  # shown for information, not a baseline candidate

    def mbps(self, nbytes: int) -> list[float]:
        return [nbytes / s / MB for s in self.seconds]


@dataclass
class UploadResult:
    target: str
    nbytes: int
    files: list[str]
    threads: int
    ops: dict[str, Op]
    persist: str
    baselines: list[str]

    def best_baseline(self) -> str:
        return min(self.baselines, key=lambda n: statistics.median(self.ops[n].seconds))

    def ratios(self) -> list[float]:
        """persist MB/s / best raw MB/s, per repetition (same repetition, same conditions)."""
        b = self.ops[self.best_baseline()]
        return [tb / tp for tp, tb in zip(self.ops[self.persist].seconds, b.seconds, strict=True)]


def state_dict_for_upload(total_bytes: int, tensors: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1234)
    rows = max(1, total_bytes // (tensors * ROW * 4))
    sd: dict[str, Any] = {f"layers.{i}.weight": torch.empty(rows, ROW) for i in range(tensors)}
    for t in sd.values():
        t.uniform_(-1.0, 1.0, generator=gen)
    sd["meta"] = {"step": 1, "note": "bench_persist"}  # a non-tensor item: the rank's objects file
    return sd


def bench_upload(
    label: str,
    store: MemStore,
    sd: dict[str, Any],
    reps: int,
    persist_name: str,
    raws: dict[str, Callable[[list[Path], int], None]],
    baselines: list[str],
    after_rep: Callable[[int], None],
    server_pid: int | None,
    sync: bool,
) -> UploadResult:
    """Time ``store.persist`` -> ``wait_persisted`` and every raw upload in ``raws`` once per repetition,
    the order alternating. ``raws[name](files, rep)`` uploads ``files`` (rep: a fresh destination)."""
    ops = {persist_name: Op(persist_name)} | {n: Op(n, info=n not in baselines) for n in raws}
    threads = store.io_threads
    # warm-up, untimed: connections, thread pools, the persister's file system object
    small = {"w": torch.ones(4 * ROW), "meta": {"warm": True}}
    dcp.save(small, checkpoint_id="warmup", storage_writer=MemoryStorageWriter(store), no_dist=True)
    store.persist("warmup")
    store.wait_persisted("warmup", timeout=WAIT_S)
    for fn in raws.values():
        fn(data_files(store, "warmup"), -1)
    after_rep(-1)
    nbytes, names = 0, []
    for rep in range(reps):
        cid = f"rep-{rep}"
        dcp.save(sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True)
        files = data_files(store, cid)
        nbytes, names = sum(f.stat().st_size for f in files), [f.name for f in files]

        def run_persist(c: str = cid) -> None:
            store.persist(c)
            store.wait_persisted(c, timeout=WAIT_S)

        order: list[tuple[str, Callable[[], None]]] = [(persist_name, run_persist)]
        order += [(n, lambda fn=fn, r=rep, fs=files: fn(fs, r)) for n, fn in raws.items()]
        if rep % 2:
            order.reverse()
        for name, fn in order:
            gc.collect()
            if sync:
                os.sync()
            c0, s0, t0 = cpu_self(), cpu_of(server_pid), time.perf_counter()
            fn()
            t1 = time.perf_counter()
            op = ops[name]
            op.seconds.append(t1 - t0)
            op.cpu_self.append(cpu_self() - c0)
            op.cpu_server.append(cpu_of(server_pid) - s0)
            print(
                f"  [{label} rep {rep}] {name}: {t1 - t0:.2f} s, {nbytes / (t1 - t0) / MB:.0f} MB/s",
                flush=True,
            )
        after_rep(rep)
    return UploadResult(label, nbytes, names, threads, ops, persist_name, baselines)


def s3_part(
    args: argparse.Namespace, srv: SeaweedS3, bucket: str, shm: Path, sd: dict[str, Any]
) -> UploadResult:
    name = bucket.removeprefix("s3://")
    fs = srv.filesystem()  # the baselines' own client, not shared with the persister
    store = MemStore(
        root=shm / "s3",
        job_id="bench",
        keep_in_memory=2,
        persist_to=f"{bucket}/persisted",
        persist_every=None,
        persist_on_close=False,
        storage_options=srv.storage_options(),
    )
    threads = store.io_threads

    def dest(kind: str, rep: int, f: Path) -> str:
        return f"{name}/{kind}/rep{rep}/{f.stem}.distcp"

    def put_file(files: list[Path], rep: int) -> None:
        parallel(lambda f: fs.put_file(str(f), dest("put_file", rep, f)), files, threads)

    def put_list(files: list[Path], rep: int) -> None:
        fs.put([str(f) for f in files], [dest("put", rep, f) for f in files])

    def put_seq(files: list[Path], rep: int) -> None:
        parallel(lambda f: fs.put_file(str(f), dest("put_seq", rep, f), max_concurrency=1), files, threads)

    def after_rep(rep: int) -> None:  # untimed: keep the server's disk from filling up
        for kind in ("put_file", "put", "put_seq"):
            with contextlib.suppress(FileNotFoundError):
                fs.rm(f"{name}/{kind}/rep{rep}", recursive=True)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(f"{name}/persisted", recursive=True)
        fs.invalidate_cache()

    pid = srv._proc.pid if getattr(srv, "_proc", None) is not None else None
    try:
        return bench_upload(
            "S3",
            store,
            sd,
            args.reps,
            PERSIST_S3,
            {PUT_FILE: put_file, PUT_LIST: put_list, PUT_SEQ: put_seq},
            [PUT_FILE, PUT_LIST],
            after_rep,
            pid,
            sync=False,
        )
    finally:
        store.close()
        shutil.rmtree(shm / "s3", ignore_errors=True)


def dir_part(args: argparse.Namespace, disk: Path, shm: Path, sd: dict[str, Any]) -> UploadResult:
    target = disk / "persisted"
    store = MemStore(
        root=shm / "dir",
        job_id="bench",
        keep_in_memory=2,
        persist_to=str(target),
        persist_every=None,
        persist_on_close=False,
    )
    threads = store.io_threads

    def copy(files: list[Path], rep: int, durable: bool = False) -> None:
        out = disk / ("copyfile_sync" if durable else "copyfile") / f"rep{rep}"
        out.mkdir(parents=True, exist_ok=True)

        def one(f: Path) -> None:
            dst = out / f"{f.stem}.distcp"
            shutil.copyfile(f, dst)
            if durable:  # what the persister does with every file it writes to a directory
                fsync_path(dst)
                fsync_path(out)

        parallel(one, files, threads)

    def copy_sync(files: list[Path], rep: int) -> None:
        copy(files, rep, durable=True)

    def after_rep(rep: int) -> None:
        shutil.rmtree(disk / "copyfile", ignore_errors=True)
        shutil.rmtree(disk / "copyfile_sync", ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)

    try:
        return bench_upload(
            "directory",
            store,
            sd,
            args.dir_reps,
            PERSIST_DIR,
            {COPYFILE_SYNC: copy_sync, COPYFILE: copy},
            [COPYFILE_SYNC],
            after_rep,
            None,
            True,
        )
    finally:
        store.close()
        shutil.rmtree(shm / "dir", ignore_errors=True)


def upload_table(res: UploadResult) -> str:
    reps = len(res.ops[res.persist].seconds)
    best = res.best_baseline()
    persist_t = res.ops[res.persist].seconds
    body = []
    for name, op in res.ops.items():
        mbps = op.mbps(res.nbytes)
        if name == res.persist:
            vs = f"{spread(res.ratios(), '{:.2f}')} of raw"
        else:
            r = [tb / tp for tp, tb in zip(persist_t, op.seconds, strict=True)]
            vs = f"{spread(r, '{:.2f}')}" + (" <- raw (best)" if name == best else "")
        body.append(
            [
                name,
                spread(op.seconds, "{:.2f}"),
                spread(mbps, "{:.0f}"),
                f"{statistics.median(op.cpu_self):.2f}"
                + (f" / {statistics.median(op.cpu_server):.2f}" if any(op.cpu_server) else ""),
                vs,
            ]
        )
    cpu_col = "CPU s (bench / server)" if any(any(o.cpu_server) for o in res.ops.values()) else "CPU s"
    head = (
        f"Persist to {res.target}: {res.nbytes / MIB:.0f} MiB in {len(res.files)} files "
        f"({', '.join(res.files)}), {res.threads} threads; median [min-max] of {reps} reps"
    )
    cols = ["operation", "seconds", "MB/s", cpu_col, "persist / this (MB/s ratio)"]
    ratio = statistics.median(res.ratios())
    verdict = (
        f"persist / raw ({best}) = {spread(res.ratios(), '{:.2f}')}: "
        f"target >= 0.80 {'MET' if ratio >= 0.80 else 'MISSED'} (median)"
    )
    return "\n".join([head, "", table(cols, body), "", verdict])


# -- part 3: training step time ------------------------------------------------------------------------------

# Configurations of part 3: off (no persistence), on (persist_every=1 to S3), and for information "keep"
# (no persistence, but every checkpoint kept in memory: no shard file is ever reused, so each save stages
# into new tmpfs pages, as saves do while uploads lag behind and hold their checkpoints).
CONFIGS = ("off", "on", "keep")
CONFIG_LABEL = {
    "off": "off: persist_to=None",
    "on": "on: persist_to=S3, persist_every=N (--persist-every)",
    "keep": "keep (info): persist_to=None, keep_in_memory=all",
}


class Trainer:
    """An MLP of 8 h x h layers with SGD + momentum, on fixed random data."""

    LAYERS = 8

    def __init__(self, ckpt_bytes: int, batch: int, seed: int = 0) -> None:
        self.h = h = self.width(ckpt_bytes)
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for _ in range(self.LAYERS):
            layers += [torch.nn.Linear(h, h), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.set_batch(batch, gen)
        self.step()  # creates the momentum buffers

    @classmethod
    def width(cls, ckpt_bytes: int) -> int:
        """h such that parameters + momentum (float32: 2 * 4 * LAYERS * h * h bytes) fill ckpt_bytes."""
        return max(64, int((ckpt_bytes / (8 * cls.LAYERS)) ** 0.5))

    def set_batch(self, batch: int, gen: torch.Generator | None = None) -> None:
        gen = gen or torch.Generator().manual_seed(1)
        self.batch = batch
        self.x = torch.randn(batch, self.h, generator=gen)
        self.y = torch.randn(batch, self.h, generator=gen)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": 0}

    def state_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        for s in self.opt.state_dict()["state"].values():
            n += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
        return n


def calibrate(ckpt_bytes: int, step_ms: float) -> tuple[int, float]:
    """A batch size for about ``step_ms`` per step (at least 8), and the step time measured with it (ms:
    the fastest of 8 steps)."""

    def measure(tr: Trainer) -> float:  # the fastest of 8 steps: robust to other work on the machine
        for _ in range(2):
            tr.step()
        ts = []
        for _ in range(8):
            t0 = time.perf_counter()
            tr.step()
            ts.append(time.perf_counter() - t0)
        return min(ts) * 1000

    tr = Trainer(ckpt_bytes, 8)
    batch, got = 8, measure(tr)
    while got < step_ms and batch < 2048:  # double until a step takes at least step_ms
        prev, prev_t = batch, got
        batch *= 2
        tr.set_batch(batch)
        got = measure(tr)
        if got >= step_ms:  # interpolate between the last two sizes
            frac = (step_ms - prev_t) / max(1e-3, got - prev_t)
            batch = max(8, int(prev + frac * (batch - prev)))
            tr.set_batch(batch)
            got = measure(tr)
            break
    del tr
    gc.collect()
    return batch, got


@dataclass
class TrainRun:
    config: str  # "off" or "on"
    rep: int
    step_s: list[float]  # every timed step, the save call included where there is one
    saves: list[bool]  # which steps issued a save
    save_call_s: list[float]  # per save: fut.result() of the previous one + async_save until it returned
    staging_s: list[float]  # per save: async_save until it returned
    drain_s: float = 0.0  # after the loop: until every owed checkpoint was persisted
    persisted_in_loop: int = 0  # checkpoints persisted when the loop ended
    owed_at_end: int = 0
    loop_s: float = 0.0  # wall time of the timed steps, until the last save's future is done
    cpu_proc_s: float = 0.0  # this process's CPU time in that time
    cpu_upload_s: float = 0.0  # of which the upload threads (UPLOAD_THREADS)
    cpu_server_s: float = 0.0  # the S3 server's CPU time in that time

    def sel(self, which: str) -> list[float]:
        if which == "all":
            return self.step_s
        want = which == "save"
        return [t for t, s in zip(self.step_s, self.saves, strict=True) if s == want]


def train_run(
    config: str,
    rep: int,
    args: argparse.Namespace,
    batch: int,
    shm: Path,
    srv: SeaweedS3,
    bucket: str,
) -> TrainRun:
    on = config == "on"
    root = shm / f"train-{config}-{rep}"
    prefix = f"{bucket}/train-{config}-{rep}"
    kw: dict[str, Any] = {}
    if on:
        kw = {
            "persist_to": prefix,
            "persist_every": args.persist_every,
            "storage_options": srv.storage_options(),
        }
    keep = 10**6 if config == "keep" else 2
    store = MemStore(root=root, job_id="train", keep_in_memory=keep, persist_on_close=False, **kw)
    pid = srv._proc.pid if getattr(srv, "_proc", None) is not None else None
    tr = Trainer(args.ckpt_mib * MIB, batch)
    state = tr.state()
    run = TrainRun(config, rep, [], [], [], [])
    fut = None
    saved: list[str] = []
    total = args.warmup_steps + args.steps
    s0 = u0 = c0 = w0 = 0.0
    try:
        for i in range(total):
            if i == args.warmup_steps:
                s0, u0, c0, w0 = cpu_of(pid), thread_cpu(UPLOAD_THREADS), cpu_self(), time.perf_counter()
            t0 = time.perf_counter()
            tr.step()
            is_save = (i + 1) % args.every == 0
            if is_save:
                t1 = time.perf_counter()
                if fut is not None:
                    fut.result()
                t2 = time.perf_counter()
                cid = f"step-{i + 1}"
                fut = dcp.async_save(
                    state, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True
                )
                t3 = time.perf_counter()
                saved.append(cid)
            t_end = time.perf_counter()
            if i >= args.warmup_steps:
                run.step_s.append(t_end - t0)
                run.saves.append(is_save)
                if is_save:
                    run.save_call_s.append(t3 - t1)
                    run.staging_s.append(t3 - t2)
        if fut is not None:
            fut.result()
        run.loop_s = time.perf_counter() - w0
        run.cpu_server_s = cpu_of(pid) - s0
        run.cpu_upload_s = thread_cpu(UPLOAD_THREADS) - u0
        run.cpu_proc_s = cpu_self() - c0
        if on:
            saved = [c for i, c in enumerate(saved, 1) if i % args.persist_every == 0]  # the owed ones
            run.persisted_in_loop = sum(store.status(c).persisted for c in saved)
            run.owed_at_end = len(saved) - run.persisted_in_loop
            t0 = time.perf_counter()
            for c in saved:
                store.wait_persisted(c, timeout=WAIT_S)
            run.drain_s = time.perf_counter() - t0
    finally:
        store.close(timeout=WAIT_S)
        shutil.rmtree(root, ignore_errors=True)
        if on:
            fs = srv.filesystem()
            with contextlib.suppress(FileNotFoundError):
                fs.rm(prefix.removeprefix("s3://"), recursive=True)
        del tr, state
        gc.collect()
    return run


def train_tables(runs: list[TrainRun], args: argparse.Namespace) -> str:
    configs = [c for c in CONFIGS if any(r.config == c for r in runs)]
    by = {c: [r for r in runs if r.config == c] for c in configs}
    out: list[str] = []
    cols = ["config", "steps", "median ms", "p90 ms", "mean ms", "median of rep medians [min-max]"]
    body = []
    for which, label in (("all", "all steps"), ("save", "save steps"), ("other", "other steps")):
        for c in configs:
            xs = [t * 1000 for r in by[c] for t in r.sel(which)]
            meds = [statistics.median(r.sel(which)) * 1000 for r in by[c]]
            body.append(
                [
                    f"{c}, {label}",
                    str(len(xs)),
                    f"{statistics.median(xs):.1f}",
                    f"{pct(xs, 0.9):.1f}",
                    f"{statistics.mean(xs):.1f}",
                    spread(meds),
                ]
            )
    out.append(table(cols, body))
    out.append("")
    cols2 = [
        "config",
        "async_save staging ms",
        "fut.result + staging ms",
        "loop wall s",
        "CPU s: bench (upload threads) / server",
        "persisted in loop",
        "drain s",
    ]
    body2 = []
    for c in configs:
        rs = by[c]
        body2.append(
            [
                c,
                spread([t * 1000 for r in rs for t in r.staging_s]),
                spread([t * 1000 for r in rs for t in r.save_call_s]),
                spread([r.loop_s for r in rs], "{:.1f}"),
                f"{statistics.median([r.cpu_proc_s for r in rs]):.1f} "
                f"({statistics.median([r.cpu_upload_s for r in rs]):.1f}) / "
                f"{statistics.median([r.cpu_server_s for r in rs]):.1f}",
                ""
                if c != "on"
                else ", ".join(
                    f"{r.persisted_in_loop}/{len(r.staging_s) + args.warmup_steps // args.every}" for r in rs
                ),
                "" if c != "on" else spread([r.drain_s for r in rs], "{:.2f}"),
            ]
        )
    out.append(table(cols2, body2))
    out.append("")
    for c in configs[1:]:
        for which, label in (("all", "all steps"), ("save", "save steps"), ("other", "other steps")):
            off = [statistics.median(r.sel(which)) for r in by["off"]]
            other = [statistics.median(r.sel(which)) for r in by[c]]
            ratios = [a / b for a, b in zip(other, off, strict=True)]  # same round, same conditions
            noise = max(off) - min(off)
            diff = statistics.median(other) - statistics.median(off)
            out.append(
                f"{c}/off, {label}: ratio of medians {spread(ratios, '{:.2f}')}; median {c} - off = "
                f"{diff * 1000:+.1f} ms, spread of the off medians {noise * 1000:.1f} ms: "
                + ("within" if abs(diff) <= noise else "BEYOND")
                + " the noise of repeated off runs"
            )
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="dcp_memstore persistence benchmark: persist vs raw s3fs/copy, training step time on/off."
    )
    p.add_argument("--size-mib", type=int, default=1024, help="checkpoint size for parts 1 and 2 (1024)")
    p.add_argument("--tensors", type=int, default=16, help="float32 tensors in that checkpoint (16)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every measurement (3)")
    p.add_argument(
        "--dir-reps", type=int, default=9, help="repetitions of part 2 (9: cheap, and noisier than S3)"
    )
    p.add_argument("--ckpt-mib", type=int, default=256, help="training state: parameters + momentum (256)")
    p.add_argument("--steps", type=int, default=60, help="timed training steps per run (60)")
    p.add_argument("--warmup-steps", type=int, default=10, help="training steps before the timed ones (10)")
    p.add_argument("--every", type=int, default=5, help="async_save every this many steps (5)")
    p.add_argument(
        "--persist-every", type=int, default=1, help="part 3 'on': persist every Nth checkpoint (1)"
    )
    p.add_argument("--step-ms", type=float, default=75.0, help="target step time for the calibration (75)")
    p.add_argument("--batch", type=int, default=0, help="training batch size (default: calibrated)")
    p.add_argument("--parts", default="s3,dir,train", help="comma-separated parts to run (s3,dir,train)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 128 MiB, 64 MiB state, 30 steps, 2 reps (4 in part 2)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    p.add_argument("--tmp", default="/dev/shm", help="tmpfs directory for the stores (/dev/shm)")
    p.add_argument("--disk-dir", default=None, help="directory on disk for part 2 (a temp dir in /tmp)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.ckpt_mib, args.steps, args.reps, args.dir_reps = 128, 64, 30, 2, 4
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if min(args.size_mib, args.tensors, args.reps, args.dir_reps, args.ckpt_mib, args.steps, args.every) < 1:
        p.error("sizes, counts and --reps must be positive")
    if args.reps < 2 and "train" in args.parts:
        p.error("part 3 needs --reps >= 2 (the spread of repeated runs)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    print(
        f"bench_persist: {info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB RAM, "
        f"kernel {info['kernel']}, Python {info['python']}, torch {info['torch']}",
        flush=True,
    )
    load_before = os.getloadavg()
    started = time.perf_counter()
    shm = Path(tempfile.mkdtemp(prefix="dcpms_bench_persist_", dir=args.tmp))
    disk = Path(tempfile.mkdtemp(prefix="dcpms_bench_persist_", dir=args.disk_dir))
    srv = SeaweedS3()
    uploads: list[UploadResult] = []
    runs: list[TrainRun] = []
    batch, step_ms = 0, 0.0
    try:
        srv.start()
        bucket = srv.make_bucket(f"bench-{secrets.token_hex(4)}")
        print(
            f"S3 server up in {srv.startup_seconds or 0:.1f} s at {srv.endpoint_url}, bucket {bucket}",
            flush=True,
        )
        if "s3" in args.parts or "dir" in args.parts:
            sd = state_dict_for_upload(args.size_mib * MIB, args.tensors)
            if "s3" in args.parts:
                print("part 1: persist to S3 vs raw s3fs ...", flush=True)
                uploads.append(s3_part(args, srv, bucket, shm, sd))
            if "dir" in args.parts:
                print("part 2: persist to a directory vs shutil.copyfile ...", flush=True)
                uploads.append(dir_part(args, disk, shm, sd))
            del sd
            gc.collect()
        if "train" in args.parts:
            if args.batch:
                batch, step_ms = args.batch, 0.0
            else:
                batch, step_ms = calibrate(args.ckpt_mib * MIB, args.step_ms)
            print(
                f"part 3: training, batch {batch} ({step_ms:.0f} ms per step when calibrated) ...", flush=True
            )
            for rep in range(args.reps):
                for config in CONFIGS if rep % 2 == 0 else CONFIGS[::-1]:
                    r = train_run(config, rep, args, batch, shm, srv, bucket)
                    runs.append(r)
                    print(
                        f"  [train rep {rep}] persistence {config}: median step "
                        f"{statistics.median(r.step_s) * 1000:.1f} ms"
                        + (
                            f", {r.persisted_in_loop} persisted in loop, drain {r.drain_s:.1f} s"
                            if config == "on"
                            else ""
                        ),
                        flush=True,
                    )
    finally:
        srv.cleanup()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()
    print()
    for res in uploads:
        print(upload_table(res))
        print()
    if runs:
        h = Trainer.width(args.ckpt_mib * MIB)
        print(
            f"Training step time: MLP {Trainer.LAYERS} x Linear({h}, {h}), SGD momentum, batch {batch}, "
            f"state {args.ckpt_mib} MiB, async_save every {args.every} steps, {args.steps} timed steps after "
            f"{args.warmup_steps}; "
            f"{args.reps} reps alternating"
        )
        print("; ".join(CONFIG_LABEL.values()))
        print()
        print(train_tables(runs, args))
        print()
    print(
        f"wall time {wall:.0f} s; load average (1/5/15 min) before "
        f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}"
    )
    if args.json:
        payload = {
            **run_record(info, args, wall, load_before, load_after),
            "uploads": [
                {
                    "target": r.target,
                    "nbytes": r.nbytes,
                    "files": r.files,
                    "threads": r.threads,
                    "best_baseline": r.best_baseline(),
                    "ratios": r.ratios(),
                    "ops": {k: asdict(v) for k, v in r.ops.items()},
                }
                for r in uploads
            ],
            "train": {"batch": batch, "calibrated_step_ms": step_ms, "runs": [asdict(r) for r in runs]},
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
