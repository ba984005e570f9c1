"""Harness for the multi-process tests: start gloo ranks, collect their results, kill and reap them."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import hashlib
import importlib.util
import inspect
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from tests.dcp.dcp_state import bits

JOB_TIMEOUT_S = 180.0  # a whole job (torch import included) on a busy 2-core machine
PG_TIMEOUT_S = 120.0  # gloo collectives: a rank stuck on a dead peer errors out instead of hanging forever
JOB_ID = "job"
LOG_TAIL_CHARS = 4000  # of each rank's output, in a failed job's message


def _context() -> Any:
    """Ranks are forked from a server process that imported torch, dcp_memstore and Megatron-Core once,
    instead of each spawned rank importing them anew (seconds per rank on 2 cores). A forked rank inherits
    the server's stdout and stderr, not the test's, so each rank writes its output to ``rank<r>.log`` (see
    ``errors``), and it gets the parent's environment as it is when the job starts, as a spawned one
    would."""
    ctx = mp.get_context("forkserver")
    # what is not installed (Megatron-Core) is skipped by the forkserver
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed.checkpoint", "dcp_memstore", "megatron.core.dist_checkpointing"]
    )
    return ctx


_CONTEXT = _context()

# ---------------------------------------------------------------------------------------------------------
# parent side


class JobFailed(AssertionError):
    """A spawned job did not end the way the test expected."""


class Job:
    """``world`` processes running ``fn(rank, world, *args)`` inside an initialized gloo group.

    Each process makes itself the leader of a new session, so killing its process group also kills what
    it started (DCP's checkpoint subprocess with the PROCESS executor, for instance).
    """

    def __init__(self, fn: Callable, world: int, args: tuple, workdir: Path) -> None:
        self.name = f"{fn.__name__}-{uuid.uuid4().hex[:6]}"
        self.world = world
        self.outdir = workdir / self.name
        self.outdir.mkdir(parents=True)
        init_method = f"file://{self.outdir / 'pg-init'}"
        env = dict(os.environ)  # now, as a spawned child would see it (a test may have set some)
        self.procs = [
            _CONTEXT.Process(
                target=_child_main,
                args=(
                    inspect.getfile(fn),
                    fn.__name__,
                    rank,
                    world,
                    init_method,
                    str(self.outdir),
                    env,
                    args,
                ),
                name=f"{self.name}-rank{rank}",
            )
            for rank in range(world)
        ]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait(self, timeout: float = JOB_TIMEOUT_S, ranks: list[int] | None = None) -> bool:
        """Join ``ranks`` (default all) until ``timeout``; True if they all exited."""
        deadline = time.monotonic() + timeout
        for r in range(self.world) if ranks is None else ranks:
            self.procs[r].join(max(0.0, deadline - time.monotonic()))
        return all(not self.procs[r].is_alive() for r in (range(self.world) if ranks is None else ranks))

    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def kill(self) -> None:
        """SIGKILL every rank and everything each one started, then reap them."""
        for p in self.procs:
            if p.pid is None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # the rank's session: the rank and its children
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(30)

    def survivors(self) -> list[int]:
        """Pids of live (non-zombie) processes of this job: ranks and anything in their process groups."""
        import psutil

        groups = {p.pid for p in self.procs if p.pid is not None}
        alive = [p.pid for p in self.procs if p.is_alive()]
        for proc in psutil.process_iter(["status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) in groups:
                    alive.append(proc.pid)
            except (psutil.Error, ProcessLookupError):
                continue
        return sorted(set(alive))

    def assert_gone(self) -> None:
        """Fail unless no process of this job is still running."""
        deadline = time.monotonic() + 10
        while (left := self.survivors()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            raise JobFailed(f"{self.name}: processes still running after the kill: {left}")

    def errors(self) -> str:
        """Each rank's traceback where it failed, and the end of each rank's output (``rank<r>.log``)."""
        out = []
        for r in range(self.world):
            err, log = self.outdir / f"rank{r}.error", self.outdir / f"rank{r}.log"
            if err.exists():
                out.append(f"--- rank {r} ---\n{err.read_text()}")
            if log.exists() and (tail := log.read_text(errors="replace")[-LOG_TAIL_CHARS:]):
                out.append(f"--- rank {r} output (end) ---\n{tail}")
        return "\n".join(out)

    def results(self) -> list[Any]:
        """Each rank's return value (None where a rank returned nothing or never finished)."""
        out = []
        for r in range(self.world):
            f = self.outdir / f"rank{r}.result"
            out.append(pickle.loads(f.read_bytes()) if f.exists() else None)
        return out

    def check(self, timeout: float = JOB_TIMEOUT_S) -> list[Any]:
        """Wait for a job that must succeed on every rank; return each rank's result."""
        finished = self.wait(timeout)
        codes = self.exitcodes()
        if not finished:
            self.kill()
            raise JobFailed(
                f"{self.name} timed out after {timeout:.0f}s (exit codes {codes})\n{self.errors()}"
            )
        if any(c != 0 for c in codes):
            self.kill()
            raise JobFailed(f"{self.name} failed, exit codes {codes}\n{self.errors()}")
        self.kill()  # nothing should be left, but reap whatever a rank started
        self.assert_gone()
        return self.results()


class MultiProc:
    """Jobs of one test (or module) and the tmpfs store root they share; ``close`` leaves nothing behind."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dcp-memstore-mp-", dir="/dev/shm"))
        self.workdir = Path(tempfile.mkdtemp(prefix="dcp-memstore-mp-"))
        self.jobs: list[Job] = []

    def start(self, fn: Callable, world: int, *args: Any) -> Job:
        job = Job(fn, world, args, self.workdir)
        self.jobs.append(job)
        return job

    def run(self, fn: Callable, world: int, *args: Any) -> list[Any]:
        """Run ``fn`` on ``world`` ranks to completion; return each rank's result, or fail with tracebacks."""
        return self.start(fn, world, *args).check()

    @property
    def job_dir(self) -> Path:
        return self.root / JOB_ID

    def close(self) -> None:
        try:
            for job in self.jobs:
                job.kill()
            for job in self.jobs:
                job.assert_gone()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            shutil.rmtree(self.workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# child side


def _load_function(path: str, name: str) -> Callable:
    """Import the test module at ``path`` under a private name (works whatever pytest's import mode)."""
    mod_name = f"_mp_worker_{Path(path).stem}"
    mod = sys.modules.get(mod_name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return getattr(mod, name)


def _child_main(
    path: str, name: str, rank: int, world: int, init_method: str, outdir: str, env: dict, args: tuple
) -> None:
    os.setsid()
    gc.freeze()  # what the forkserver imported stays shared with it: this rank's collector never writes to it
    log_fd = os.open(Path(outdir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    faulthandler.enable()  # a crash in native code shows its Python stack in the rank's log
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",  # DCP's PROCESS executor starts its own group there
            "GLOO_SOCKET_IFNAME": "lo",
        }
    )
    code = 1
    try:
        import torch.distributed as dist

        fn = _load_function(path, name)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = fn(rank, world, *args)
        _write(Path(outdir) / f"rank{rank}.result", pickle.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()
        code = 0
    except BaseException:
        _write(Path(outdir) / f"rank{rank}.error", traceback.format_exc().encode())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: DCP's executor threads and daemon processes can make it hang; the
        # parent kills this rank's process group after it exits.
        os._exit(code)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# deterministic state and bit-exact comparison (used inside workers)


def make_tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic data; float tensors also hold NaN, -0.0 and +-inf so only a bit-exact copy compares
    equal."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 1000).to(dtype)
        flat = t.view(-1)
        specials = [float("nan"), -0.0, float("inf"), float("-inf")]
        for i, v in enumerate(specials[: flat.numel()]):
            flat[i] = v
        return t
    return torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).to(dtype)


def assert_bit_equal(actual: Any, expected: Any, what: str) -> None:
    """Fail unless ``actual`` and ``expected`` (nested dicts of tensors and plain values) are
    bit-identical."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (
            f"{what}: keys {sorted(actual) if isinstance(actual, dict) else actual!r} != {sorted(expected)}"
        )
        for k in expected:
            assert_bit_equal(actual[k], expected[k], f"{what}.{k}")
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, expected a tensor"
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert torch.equal(bits(actual), bits(expected)), f"{what}: values differ\n{actual}\n!=\n{expected}"
        return
    assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def digest(value: Any) -> str:
    """SHA-256 over a nested dict of tensors and plain values (keys, dtypes, shapes and bytes)."""
    h = hashlib.sha256()

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict):
            for k in sorted(v):
                walk(v[k], f"{path}.{k}")
        elif isinstance(v, torch.Tensor):
            h.update(f"{path}:{v.dtype}:{tuple(v.shape)}:".encode())
            h.update(bits(v).numpy().tobytes())
        else:
            h.update(f"{path}={v!r};".encode())

    walk(value, "")
    return h.hexdigest()


def blank_like(value: Any) -> Any:
    """Same structure with every tensor zeroed and every plain value replaced, as a load target."""
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return type(value)()


class SlowPlanner(DefaultSavePlanner):
    """Holds a save for 4 s inside DCP's collectives on every rank (between planning and writing). It lives
    here, not in a test module: DCP's PROCESS executor pickles the planner to its checkpoint process, which
    has to import its class."""

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        time.sleep(4)
        return super().finish_plan(new_plan)


class SlowWriteOnRank1(DefaultSavePlanner):
    """Holds rank 1's write for 4 s (at its first item), while the other ranks have written their files into
    the checkpoint's directory and wait for rank 1 in DCP's collective. Importable, as ``SlowPlanner``."""

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == 1 and not getattr(self, "_slept", False):
            self._slept = True
            time.sleep(4)
        return super().resolve_data(write_item)


def write_record(path: Path, text: str) -> None:
    """Atomically write a small text file (survives a SIGKILL of the writer: old or new, never half)."""
    _write(path, text.encode())
