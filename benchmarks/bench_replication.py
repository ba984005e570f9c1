"""Replication benchmark of dcp_memstore: what moving a checkpoint's files to a peer node (and back) costs
with the replication transport, against plain sockets moving the same bytes between the same two nodes.

Everything runs in one invocation, across two "nodes" of a ``tests/netns.py`` Cluster: two Linux network
namespaces joined by veth through a bridge, each with its own address and its own tmpfs root. Node A
(``n0``) holds a checkpoint's files, written first into its tmpfs (``<rootA>/<job>/checkpoints/<ckpt>/``,
``--files`` shard files, ``--size-mib`` in all, random bytes), so no measurement reads cold pages. Node B
(``n1``) runs one process with a ``PeerServer`` (its tmpfs root, the job id, a shared secret) and, on another
port, a plain-socket baseline server. Node A runs one client process with a ``TcpTransport``. The parent
process (this script, outside the namespaces) only drives them: JSON lines on their stdin/stdout.

1. **Replication A -> B.** ``TcpTransport.put_file`` of every file to B's server, which keeps them as its
   replica ``<rootB>/<job>/replicas/<node>/<ckpt>/`` (signed requests, go-ahead round trip, xxh3-64 on both
   ends, received into a new preallocated mapped file, renamed into place once verified). Baseline: a plain
   TCP sender in A doing one ``sendall`` of the file's ``mmap`` to a plain receiver in B that creates a new
   file, preallocates it (``posix_fallocate``), maps it and ``recv_into``'s the bytes straight into the
   mapping, then acknowledges with one byte (so both timings end when the receiver holds the bytes). For
   information: the same receiver into a file that already exists and is faulted in (reused across
   repetitions): the network and copy cost without the cost of new tmpfs pages.
2. **Restore from the peer B -> A.** ``TcpTransport.get_file`` of every file from B's replica into a new
   directory in A's tmpfs, against the raw receiver in A fetching the same replica files from a raw sender
   in B (``sendall`` of the file's ``mmap``, after an 8-byte size), into new preallocated files; and, for
   information, into reused faulted files.

Files go one TCP connection per file, ``--streams`` files at a time (the same for ours and the raw socket).
Each repetition times every operation once, the order alternating between repetitions (ours first in even
ones, last in odd ones), after one untimed warm-up round (connections, imports, the reused files faulted
in). Destinations are deleted (untimed) before every operation, so each one writes into new tmpfs pages as
a real transfer does. Reported: median [min-max] of ``--repeats`` repetitions of the time, GB/s (1 GB =
1e9 B), the CPU seconds of node A's and node B's process, and per repetition ours/raw GB/s (same
repetition, same conditions), median [min-max]; target >= 0.80 (judged on the median). "by CPU s" repeats
the comparison with the two processes' CPU seconds (steadier on a shared machine; approximate, as the
kernel charges veth/TCP work to whichever process runs when it happens).

3. **Training-step time, replication on vs off** (``--step-time``): a 2-node torchrun job
   (``Cluster.torchrun``, 1 rank per node, gloo over the veth, CPU) trains an MLP (bench_persist's
   Trainer, wrapped in DistributedDataParallel) for ``--steps`` steps after
   ``--warmup-steps``; every ``--every`` steps the parameters and momentum buffers, as DTensors sharded on
   dim 0 (each node saves half, as an FSDP job would), are saved with ``dcp.async_save`` through
   ``MemoryStorageWriter(MemStore(root, job_id, replicas=R))`` on a process group of its own; the previous
   save's future is waited for just before the next save. Once with ``R=1`` (replication on) and once with
   ``R=0`` (off), ``--step-reps`` times in alternating order. Reported: mean (and median, p90) step time,
   the slowest rank's per step, and the on/off ratio of the means; each rank's CPU seconds over the timed
   loop (training, staging and, when on, replication); with replication on, how long
   ``store.wait_replicated`` of the last checkpoint took after the loop and its
   ``store.status(id).replication``. ``--skip-transfers`` runs part 3 alone.

This is a noisy 2-vCPU VM: nothing is pinned, and the two nodes' processes, the kernel's TCP/veth work and
this script share both cores, so every figure is a median with its spread, and the CPU columns say where the
time went. Needs root (network namespaces, tmpfs mounts). Run from the repository root:
``python benchmarks/bench_replication.py`` (1 GiB in 8 files, 3 repetitions); ``--quick`` for a small run;
``--json PATH`` also writes every timing as JSON. The namespaces, mounts, processes and temporary files are
removed at the end, also on an error, Ctrl-C or SIGTERM; leftovers of a run that was SIGKILLed are removed
by the next one (``cleanup_stale``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import queue
import secrets
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_core import machine, run_record  # noqa: E402
from benchmarks.bench_persist import Trainer, cpu_of, cpu_self, parallel, pct, spread, table  # noqa: E402
from dcp_memstore import MemStore  # noqa: E402
from dcp_memstore.store.layout import StoreLayout  # noqa: E402
from tests.netns import Cluster, Node, cleanup_stale, netns_unavailable  # noqa: E402

MIB = 1 << 20
GB = 1e9
JOB = "bench-repl"
CKPT = "step-100"
SOURCE_NODE = "node0"  # the name node A's files are replicated under on node B
SECRET_ENV = "DCPMS_BENCH_SECRET"  # the replication secret, hex, to the node processes (not on argv)
TARGET = 0.80
STARTUP_S = 120.0  # a node process importing torch on a busy 2-core machine
OP_TIMEOUT_S = 900.0
TRAIN_TIMEOUT_S = 1200.0
BLOCK = 8 * MIB  # source files are written in blocks of this size, each stamped with its position

# operation names
PUT = "ours: TcpTransport.put_file -> PeerServer"
GET = "ours: TcpTransport.get_file <- PeerServer replica"
RAW_NEW = "raw socket: sendall(mmap) -> recv_into new preallocated file"
RAW_REUSE = "raw socket into a reused, faulted-in file (info)"

# raw baseline protocol: one request per connection, (op, size, path length) then the path (UTF-8)
_RAW_HEADER = struct.Struct(">BQH")
_SIZE = struct.Struct(">Q")
RAW_RECV_NEW, RAW_RECV_REUSE, RAW_SEND = 1, 2, 3


# -- the plain-socket baseline (runs in the node processes) --------------------------------------------------


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """``recv_into`` until ``view`` is full, straight into it. Raises ConnectionError on an early EOF."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (headers of the raw protocol)."""
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_mapped(sock: socket.socket, path: Path) -> None:
    """``sendall`` of the whole file at ``path`` from a read-only mapping of it (no copy in this process)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        with memoryview(mm) as view:
            sock.sendall(view)
    finally:
        mm.close()


class RawSink:
    """Where the raw baseline receives files: a new file preallocated to its size and mapped (``reuse``
    false, what a real receiver of a new file does), or a file kept mapped from an earlier transfer of the
    same path (``reuse`` true: its pages already exist and are faulted in, so only the network and the copy
    are left)."""

    def __init__(self) -> None:
        self._kept: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def receive(self, sock: socket.socket, path: Path, size: int, reuse: bool) -> None:
        if size == 0:
            path.touch()
            return
        if reuse:
            mm = self._kept_map(path, size)
            with memoryview(mm) as view:
                recv_exact(sock, view)
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            with memoryview(mm) as view:
                recv_exact(sock, view)
        finally:
            mm.close()

    def _kept_map(self, path: Path, size: int) -> mmap.mmap:
        with self._lock:
            mm = self._kept.get(str(path))
            if mm is None or len(mm) != size:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                    mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                self._kept[str(path)] = mm
            return mm


class RawServer:
    """Plain TCP server of the baseline: receives a file into ``RawSink`` (then acknowledges with one byte)
    or sends one with ``send_mapped`` (after its size). Only paths under ``root``. A thread per connection."""

    def __init__(self, host: str, root: Path) -> None:
        self.root = root.resolve()
        self.sink = RawSink()
        self._sock = socket.create_server((host, 0), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="raw-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="raw-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                op, size, n = _RAW_HEADER.unpack(recv_bytes(conn, _RAW_HEADER.size))
                path = Path(recv_bytes(conn, n).decode()).resolve()
                if not path.is_relative_to(self.root):
                    raise ValueError(f"{path} is not under {self.root}")
                if op in (RAW_RECV_NEW, RAW_RECV_REUSE):
                    self.sink.receive(conn, path, size, reuse=op == RAW_RECV_REUSE)
                    conn.sendall(b"\1")
                elif op == RAW_SEND:
                    conn.sendall(_SIZE.pack(path.stat().st_size))
                    send_mapped(conn, path)
            except (OSError, ValueError, struct.error):
                traceback.print_exc()  # the client sees the connection close early and fails

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


# -- the node processes (roles of this script) ---------------------------------------------------------------


def _emit(msg: dict[str, Any]) -> None:
    """One protocol line to the parent (stdout carries nothing else)."""
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _secret() -> bytes:
    """The job's replication secret, given by the parent in the environment (argv is world-readable)."""
    return bytes.fromhex(os.environ[SECRET_ENV])


def serve_role(argv: list[str]) -> int:
    """Node B: a PeerServer on the node's tmpfs root and the raw baseline server, until stdin closes."""
    from dcp_memstore.replication import PeerServer

    p = argparse.ArgumentParser(prog="bench_replication.py _serve")
    p.add_argument("--root", required=True)
    p.add_argument("--host", required=True)
    a = p.parse_args(argv)
    server = PeerServer(a.root, JOB, _secret(), bind_host=a.host)
    raw = RawServer(a.host, Path(a.root))
    _emit({"pid": os.getpid(), "peer_port": server.address[1], "raw_port": raw.port})
    try:
        for line in sys.stdin:
            if json.loads(line).get("cmd") == "quit":
                break
    finally:
        raw.close()
        server.close()
    return 0


def client_role(argv: list[str]) -> int:
    """Node A: runs the parent's transfer commands (one JSON line each) and answers with their wall and CPU
    seconds, until stdin closes."""
    from dcp_memstore.replication import TcpTransport

    transport = TcpTransport(JOB, _secret(), timeout_s=OP_TIMEOUT_S)
    sink = RawSink()
    _emit({"pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            _emit({"ok": True, **client_op(cmd, transport, sink)})
        except Exception:
            _emit({"ok": False, "error": traceback.format_exc()})
    transport.close()
    return 0


def client_op(cmd: dict[str, Any], transport: Any, sink: RawSink) -> dict[str, float]:
    """Run one transfer command: every file of ``cmd["files"]``, ``cmd["streams"]`` at a time, each on its
    own connection; returns wall seconds and this process's CPU seconds."""
    addr = (cmd["addr"][0], int(cmd["addr"][1]))
    dest = Path(cmd.get("dest", "."))

    def put(f: str) -> None:
        transport.put_file(addr, SOURCE_NODE, CKPT, Path(f).name, Path(f))

    def get(f: str) -> None:
        layout = StoreLayout(Path(cmd["root"]), JOB)  # the store whose process lock names the temporary
        transport.get_file(
            addr, CKPT, Path(f).name, dest / Path(f).name, source_node=SOURCE_NODE, layout=layout
        )

    def raw_send(f: str) -> None:
        op = RAW_RECV_REUSE if cmd["reuse"] else RAW_RECV_NEW
        target = str(dest / Path(f).name).encode()
        with socket.create_connection(addr, timeout=OP_TIMEOUT_S) as s:
            s.sendall(_RAW_HEADER.pack(op, os.stat(f).st_size, len(target)) + target)
            send_mapped(s, Path(f))
            if recv_bytes(s, 1) != b"\1":
                raise ConnectionError("raw receiver did not acknowledge")

    def raw_fetch(f: str) -> None:
        remote = f.encode()
        with socket.create_connection(addr, timeout=OP_TIMEOUT_S) as s:
            s.sendall(_RAW_HEADER.pack(RAW_SEND, 0, len(remote)) + remote)
            (size,) = _SIZE.unpack(recv_bytes(s, _SIZE.size))
            sink.receive(s, dest / Path(f).name, size, reuse=cmd["reuse"])

    fn: Callable[[str], None] = {"put": put, "get": get, "raw_send": raw_send, "raw_fetch": raw_fetch}[
        cmd["cmd"]
    ]
    c0, t0 = cpu_self(), time.perf_counter()
    parallel(fn, cmd["files"], cmd["streams"])
    return {"seconds": time.perf_counter() - t0, "cpu": cpu_self() - c0}


# -- driving the node processes (parent) ---------------------------------------------------------------------


class NodeProcess:
    """A role of this script running inside a cluster node, driven by JSON lines on its stdin and stdout;
    its stderr goes to ``log`` (whose tail is shown when it fails)."""

    def __init__(self, node: Node, role: str, args: list[str], log: Path, secret: str) -> None:
        self.node, self.role, self.log = node, role, log
        with open(log, "wb") as err:  # the child keeps its own descriptor
            self.proc = node.popen(
                [sys.executable, str(Path(__file__).resolve()), role, *args],
                env=node.env({SECRET_ENV: secret}),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"pump-{role}", daemon=True).start()
        self.hello = self._next(STARTUP_S, "starting")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _fail(self, why: str) -> RuntimeError:
        tail = ""
        with contextlib.suppress(OSError):
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        return RuntimeError(f"{self.role} on {self.node.name}: {why}; its stderr ends with:\n{tail}")

    def _next(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise self._fail(f"no answer within {timeout:.0f} s ({what})") from None
        if line is None:
            raise self._fail(f"exited with {self.proc.wait()} ({what})")
        return json.loads(line)

    def call(self, cmd: dict[str, Any], timeout: float = OP_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        res = self._next(timeout, cmd["cmd"])
        if not res.get("ok", False):
            raise self._fail(f"{cmd['cmd']} failed:\n{res.get('error')}")
        return res

    def stop(self) -> None:
        """Ask the process to quit and wait for it (Cluster.close() kills whatever is left)."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(15)


# -- parts 1 and 2: transfers --------------------------------------------------------------------------------


@dataclass
class Transfer:
    """One operation's repetitions: wall seconds, and CPU seconds of node A's and node B's process."""

    name: str
    seconds: list[float] = field(default_factory=list)
    cpu_a: list[float] = field(default_factory=list)
    cpu_b: list[float] = field(default_factory=list)

    def cpu_total(self) -> list[float]:
        return [a + b for a, b in zip(self.cpu_a, self.cpu_b, strict=True)]


@dataclass
class Direction:
    """The operations of one part (replication A -> B, or restore B -> A) and which are compared."""

    title: str
    ours: str
    baseline: str
    ops: dict[str, Transfer]

    def ratios(self, other: str | None = None) -> list[float]:
        """ours GB/s / ``other``'s GB/s (default: the baseline), per repetition."""
        b = self.ops[other or self.baseline].seconds
        return [tb / to for to, tb in zip(self.ops[self.ours].seconds, b, strict=True)]

    def cpu_ratio(self, other: str | None = None) -> float:
        """``other``'s CPU seconds (both nodes' processes) / ours, medians: the ratio by CPU time, steadier
        than wall time on a shared machine (approximate: the kernel's veth/TCP work is charged to whichever
        process runs when it happens)."""
        ours, b = self.ops[self.ours], self.ops[other or self.baseline]
        return statistics.median(b.cpu_total()) / statistics.median(ours.cpu_total())


@dataclass
class Step:
    """One timed operation: its name, the client command, and what to delete (untimed) before it."""

    name: str
    cmd: dict[str, Any]
    clear: list[Path]
    check_dir: Path  # where the received copies land (for the untimed check)


def write_sources(directory: Path, total: int, files: int) -> list[Path]:
    """``files`` shard files of ``total`` bytes in all: random bytes, each BLOCK stamped with its file and
    block number (so a misplaced block is caught by the checks). Written before anything is timed."""
    directory.mkdir(parents=True)
    base = bytearray(os.urandom(BLOCK))
    sizes = [total // files + (1 if i < total % files else 0) for i in range(files)]
    paths = []
    for i, size in enumerate(sizes):
        path = directory / f"__0_{i}.shard"
        with open(path, "wb") as f:
            for off in range(0, size, BLOCK):
                struct.pack_into(">QQ", base, 0, i, off)
                f.write(memoryview(base)[: min(BLOCK, size - off)])
        paths.append(path)
    return paths


def check_copy(src: Path, dst: Path) -> None:
    """Untimed sanity check of a received file: same size, same bytes at its start, middle and end."""
    size = src.stat().st_size
    if dst.stat().st_size != size:
        raise AssertionError(f"{dst}: {dst.stat().st_size} bytes, {src} has {size}")
    with open(src, "rb") as a, open(dst, "rb") as b:
        for off in {0, max(0, size // 2 - MIB // 2), max(0, size - MIB)}:
            if os.pread(a.fileno(), MIB, off) != os.pread(b.fileno(), MIB, off):
                raise AssertionError(f"{dst} differs from {src} near offset {off}")


def clear(paths: list[Path]) -> None:
    """Empty the directories ``paths`` (untimed, before an operation), so every transfer writes new files
    into new tmpfs pages, as a real one does, and the tmpfs never holds more than 3 copies."""
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)


def run_transfers(cluster: Cluster, args: argparse.Namespace, logs: Path) -> tuple[Direction, Direction]:
    """Parts 1 and 2: start B's servers and A's client, warm up, then ``--repeats`` rounds."""
    a, b = cluster.node(0), cluster.node(1)
    total = args.size_mib * MIB
    print(f"writing {args.files} files, {args.size_mib} MiB in all, into node A's tmpfs ...", flush=True)
    sources = write_sources(a.root / JOB / "checkpoints" / CKPT, total, args.files)
    replica = b.root / JOB / "replicas" / SOURCE_NODE / CKPT  # PeerServer's layout (StoreLayout.replica_dir)
    b_new, b_reuse = b.root / "raw" / "new", b.root / "raw" / "reuse"
    a_ours, a_new, a_reuse = (a.root / "restored" / x for x in ("ours", "raw-new", "raw-reuse"))
    clear([b_reuse, a_reuse])

    secret = secrets.token_hex(32)
    server = NodeProcess(b, "_serve", ["--root", str(b.root), "--host", b.addr], logs / "node-b.log", secret)
    client = NodeProcess(a, "_client", [], logs / "node-a.log", secret)
    b_pid = int(server.hello["pid"])
    peer = [b.addr, server.hello["peer_port"]]
    raw = [b.addr, server.hello["raw_port"]]
    files = [str(p) for p in sources]
    remote = [str(replica / p.name) for p in sources]
    common = {"streams": args.streams}
    replicate = [
        Step(PUT, {"cmd": "put", "addr": peer, "files": files, **common}, [replica, b_new], replica),
        Step(
            RAW_NEW,
            {"cmd": "raw_send", "addr": raw, "files": files, "dest": str(b_new), "reuse": False, **common},
            [b_new],
            b_new,
        ),
        Step(
            RAW_REUSE,
            {"cmd": "raw_send", "addr": raw, "files": files, "dest": str(b_reuse), "reuse": True, **common},
            [b_new],
            b_reuse,
        ),
    ]
    restore = [
        Step(
            GET,
            {"cmd": "get", "addr": peer, "files": remote, "dest": str(a_ours), "root": str(a.root), **common},
            [a_ours, a_new],
            a_ours,
        ),
        Step(
            RAW_NEW,
            {"cmd": "raw_fetch", "addr": raw, "files": remote, "dest": str(a_new), "reuse": False, **common},
            [a_ours, a_new],
            a_new,
        ),
        Step(
            RAW_REUSE,
            {"cmd": "raw_fetch", "addr": raw, "files": remote, "dest": str(a_reuse), "reuse": True, **common},
            [a_ours, a_new],
            a_reuse,
        ),
    ]
    parts = [
        Direction("Replication A -> B", PUT, RAW_NEW, {s.name: Transfer(s.name) for s in replicate}),
        Direction("Restore from peer B -> A", GET, RAW_NEW, {s.name: Transfer(s.name) for s in restore}),
    ]
    try:
        for rep in range(-1, args.repeats):  # -1: the untimed warm-up round
            for direction, steps in zip(parts, (replicate, restore), strict=True):
                label = "warm-up" if rep < 0 else f"rep {rep}"
                for step in steps if rep % 2 == 0 or rep < 0 else steps[::-1]:
                    clear(step.clear)
                    b0 = cpu_of(b_pid)
                    res = client.call(step.cmd)
                    cpu_b = cpu_of(b_pid) - b0
                    for src in sources:
                        check_copy(src, step.check_dir / src.name)
                    print(
                        f"  [{direction.title}, {label}] {step.name}: {res['seconds']:.3f} s, "
                        f"{total / res['seconds'] / GB:.2f} GB/s, CPU A {res['cpu']:.2f} s, B {cpu_b:.2f} s",
                        flush=True,
                    )
                    if rep >= 0:
                        op = direction.ops[step.name]
                        op.seconds.append(res["seconds"])
                        op.cpu_a.append(res["cpu"])
                        op.cpu_b.append(cpu_b)
    finally:
        client.stop()
        server.stop()
    return parts[0], parts[1]


def direction_table(d: Direction, args: argparse.Namespace) -> str:
    """A Markdown table of one part (every operation, with ours/this per repetition) and its verdict."""
    total = args.size_mib * MIB
    head = (
        f"{d.title}: {args.size_mib} MiB in {args.files} files of {args.size_mib / args.files:.0f} MiB, "
        f"{args.streams} stream(s) (one TCP connection per file); median [min-max] of {args.repeats} reps"
    )
    body = []
    for name, op in d.ops.items():
        if name == d.ours:
            vs = by_cpu = ""
        else:
            vs = spread(d.ratios(name), "{:.2f}") + (" <- baseline" if name == d.baseline else "")
            by_cpu = f"{d.cpu_ratio(name):.2f}"
        body.append(
            [
                name,
                spread(op.seconds, "{:.3f}"),
                spread([total / s / GB for s in op.seconds], "{:.2f}"),
                f"{statistics.median(op.cpu_a):.2f} / {statistics.median(op.cpu_b):.2f}",
                vs,
                by_cpu,
            ]
        )
    cols = ["operation", "seconds", "GB/s", "CPU s (A / B)", "ours / this (GB/s ratio)", "by CPU s"]
    ratio = statistics.median(d.ratios())
    verdict = (
        f"ours / raw socket = {spread(d.ratios(), '{:.2f}')}: target >= {TARGET:.2f} "
        f"{'MET' if ratio >= TARGET else 'MISSED'} (median)"
    )
    return "\n".join([head, "", table(cols, body), "", verdict])


# -- part 3: training-step time, replication on vs off -------------------------------------------------------


def sharded_state(model: Any, opt: Any, mesh: Any) -> dict[str, Any]:
    """Parameters and momentum buffers as DTensors sharded on dim 0 over ``mesh``: views of the live
    tensors (the optimizer updates them in place), each rank's chunk of rows, as FSDP would save them."""
    from torch.distributed.tensor import DTensor, Shard

    rank, world = mesh.get_local_rank(), mesh.size()

    def shard(t: Any) -> Any:
        local = t.detach().chunk(world, 0)[rank]
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())

    params = list(model.named_parameters())
    return {
        "model": {n: shard(p) for n, p in params},
        "optim": {n: shard(opt.state[p]["momentum_buffer"]) for n, p in params},
    }


def train_role(argv: list[str]) -> int:
    """One rank of the part-3 job (under torchrun, on a cluster node): train, async_save every ``--every``
    steps into a MemStore with ``replicas=--replicas``, write the per-step times to ``--out``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from dcp_memstore import MemoryStorageWriter

    p = argparse.ArgumentParser(prog="bench_replication.py _train")
    for name in ("replicas", "steps", "warmup-steps", "every", "ckpt-mib", "batch", "threads"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--wait-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt_group = dist.new_group(backend="gloo")  # async_save's collectives run beside DDP's all-reduces
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tr = Trainer(a.ckpt_mib * MIB, a.batch)  # the same seed on every rank
    plain = tr.model
    tr.model = DistributedDataParallel(plain)  # Trainer.step now all-reduces gradients across the nodes
    state = sharded_state(plain, tr.opt, mesh)
    store = MemStore(root=os.environ["DCP_MEMSTORE_ROOT"], job_id=a.job, replicas=a.replicas)
    step_s: list[float] = []
    saves: list[bool] = []
    staging_s: list[float] = []
    fut = None
    last = None
    try:
        dist.barrier()
        w0, c0 = time.perf_counter(), cpu_self()
        for i in range(a.warmup_steps + a.steps):
            if i == a.warmup_steps:
                w0, c0 = time.perf_counter(), cpu_self()
            t0 = time.perf_counter()
            tr.step()
            is_save = (i + 1) % a.every == 0
            if is_save:
                if fut is not None:
                    fut.result()
                t2 = time.perf_counter()
                last = f"step-{i + 1}"
                fut = dcp.async_save(
                    state,
                    checkpoint_id=last,
                    storage_writer=MemoryStorageWriter(store),
                    process_group=ckpt_group,
                )
                if i >= a.warmup_steps:
                    staging_s.append(time.perf_counter() - t2)
            if i >= a.warmup_steps:
                step_s.append(time.perf_counter() - t0)
                saves.append(is_save)
        if fut is not None:
            fut.result()
        loop_s, loop_cpu_s = time.perf_counter() - w0, cpu_self() - c0
        t0 = time.perf_counter()
        if a.replicas and last is not None:
            store.wait_replicated(last, timeout=a.wait_timeout)
        wait_s = time.perf_counter() - t0
        replication = store.status(last).replication if last is not None else None
        result = {
            "rank": rank,
            "step_s": step_s,
            "saves": saves,
            "staging_s": staging_s,
            "loop_s": loop_s,
            "loop_cpu_s": loop_cpu_s,  # this process, all its threads (training, staging, replication)
            "wait_replicated_s": wait_s,
            "last_checkpoint": last,
            "replication": replication,
            "state_mib_per_rank": sum(
                t.to_local().numel() * t.to_local().element_size()
                for part in state.values()
                for t in part.values()
            )
            / MIB,
        }
        Path(a.out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        store.close()
        dist.destroy_process_group()
    return 0


@dataclass
class StepRun:
    """One part-3 run: per timed step, the slowest rank's time; and each rank's result as written."""

    replicas: int
    rep: int
    step_s: list[float]
    saves: list[bool]
    ranks: list[dict[str, Any]]

    def sel(self, which: str) -> list[float]:
        if which == "all":
            return self.step_s
        return [t for t, s in zip(self.step_s, self.saves, strict=True) if s == (which == "save")]


def step_run(cluster: Cluster, args: argparse.Namespace, tmp: Path, replicas: int, rep: int) -> StepRun:
    """One 2-node torchrun job of ``train_role`` with ``replicas`` (the node roots wiped first)."""
    for node in cluster.nodes:
        node.wipe_root()
    out = tmp / f"steps-r{replicas}-{rep}"
    out.mkdir()
    train_args: list[object] = ["_train", "--replicas", replicas, "--job", f"bench-steps-r{replicas}-{rep}"]
    train_args += ["--steps", args.steps, "--warmup-steps", args.warmup_steps, "--every", args.every]
    train_args += ["--ckpt-mib", args.ckpt_mib, "--batch", args.batch, "--threads", args.torch_threads]
    train_args += ["--out", out]
    env = {"OMP_NUM_THREADS": str(args.torch_threads), "PYTHONPATH": str(REPO)}
    procs = cluster.torchrun(Path(__file__).resolve(), train_args, nproc_per_node=1, env=env, log_dir=out)
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        codes.append(None)
    if codes != [0] * len(procs):
        tails = []
        for i in range(len(procs)):
            with contextlib.suppress(OSError):
                lines = (out / f"node{i}.log").read_text(errors="replace").splitlines()
                ranks = [ln for ln in lines if ln.startswith("[rank")]  # the worker's own output
                shown = ranks[-25:] if ranks else lines[-40:]
                tails.append(f"--- node{i}.log, {len(shown)} of its lines\n" + "\n".join(shown))
        raise RuntimeError(
            f"torchrun with replicas={replicas} failed (exit codes {codes}):\n" + "\n".join(tails)
        )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]
    step_s = [max(ts) for ts in zip(*(r["step_s"] for r in ranks), strict=True)]
    return StepRun(replicas, rep, step_s, ranks[0]["saves"], ranks)


def run_step_time(cluster: Cluster, args: argparse.Namespace, tmp: Path) -> list[StepRun]:
    """Part 3: ``--step-reps`` runs with replication off and on, the order alternating."""
    runs = []
    for rep in range(args.step_reps):
        for replicas in (0, 1) if rep % 2 == 0 else (1, 0):
            print(f"part 3: torchrun, 2 nodes x 1 rank, replicas={replicas} (rep {rep}) ...", flush=True)
            r = step_run(cluster, args, tmp, replicas, rep)
            print(
                f"  replicas={replicas}: mean step {statistics.mean(r.step_s) * 1000:.1f} ms, "
                f"replication of the last checkpoint: {[x['replication'] for x in r.ranks]}",
                flush=True,
            )
            runs.append(r)
    return runs


def step_table(runs: list[StepRun], args: argparse.Namespace) -> str:
    """Part 3's table (step times per configuration) and the on/off ratio of mean step times."""
    by = {k: [r for r in runs if r.replicas == k] for k in (0, 1)}
    state = runs[0].ranks[0]["state_mib_per_rank"]
    h = Trainer.width(args.ckpt_mib * MIB)
    head = (
        f"Training step time: 2 nodes x 1 rank (torchrun, gloo over veth, DDP), MLP {Trainer.LAYERS} x "
        f"Linear({h}, {h}), SGD momentum, batch {args.batch}, {args.torch_threads} torch thread(s) per rank, "
        f"state {args.ckpt_mib} MiB "
        f"({state:.0f} MiB saved per rank), async_save every {args.every} steps, {args.steps} timed steps "
        f"after {args.warmup_steps}; per step the slowest rank; {args.step_reps} rep(s)"
    )
    cols = ["replication", "steps", "mean ms", "median ms", "p90 ms", "save steps mean ms"]
    cols += ["other steps mean ms", "staging ms (median)", "loop s", "CPU s per rank", "wait_replicated s"]
    cols += ["last checkpoint"]
    body = []
    for k, label in ((0, "off (replicas=0)"), (1, "on (replicas=1)")):
        rs = by[k]
        xs = [t * 1000 for r in rs for t in r.step_s]
        body.append(
            [
                label,
                str(len(xs)),
                f"{statistics.mean(xs):.1f}",
                f"{statistics.median(xs):.1f}",
                f"{pct(xs, 0.9):.1f}",
                f"{statistics.mean([t * 1000 for r in rs for t in r.sel('save')]):.1f}",
                f"{statistics.mean([t * 1000 for r in rs for t in r.sel('other')]):.1f}",
                f"{statistics.median([t * 1000 for r in rs for x in r.ranks for t in x['staging_s']]):.1f}",
                spread([max(x["loop_s"] for x in r.ranks) for r in rs], "{:.1f}"),
                " / ".join(
                    f"{statistics.median([r.ranks[i]['loop_cpu_s'] for r in rs]):.1f}" for i in (0, 1)
                ),
                spread([max(x["wait_replicated_s"] for x in r.ranks) for r in rs], "{:.2f}"),
                ", ".join(sorted({str(x["replication"]) for r in rs for x in r.ranks})),
            ]
        )
    ratios = [
        statistics.mean(on.step_s) / statistics.mean(off.step_s) for off, on in zip(by[0], by[1], strict=True)
    ]
    return "\n".join(
        [head, "", table(cols, body), "", f"on/off ratio of mean step time: {spread(ratios, '{:.2f}')}"]
    )


# -- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (see the module docstring); ``--quick`` shrinks everything for a smoke run."""
    p = argparse.ArgumentParser(
        description="dcp_memstore replication benchmark across two network namespaces: put_file/get_file "
        "against raw sockets, and (--step-time) training step time with replication on/off."
    )
    p.add_argument("--size-mib", type=int, default=1024, help="checkpoint size, all files together (1024)")
    p.add_argument("--files", type=int, default=8, help="shard files it is split into (8)")
    p.add_argument("--streams", type=int, default=1, help="files in flight at once, ours and raw alike (1)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions of every transfer (3)")
    p.add_argument("--quick", action="store_true", help="small run: 128 MiB in 4 files (and a short part 3)")
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    p.add_argument("--tmp", default="/dev/shm", help="directory for logs and part-3 results (/dev/shm)")
    g = p.add_argument_group("part 3: training step time with MemStore(replicas=1) against replicas=0")
    g.add_argument("--step-time", action="store_true", help="also run part 3: step time, replication on/off")
    g.add_argument("--skip-transfers", action="store_true", help="with --step-time: run part 3 only")
    g.add_argument("--steps", type=int, default=60, help="timed training steps per run (60)")
    g.add_argument("--warmup-steps", type=int, default=10, help="steps before the timed ones (10)")
    g.add_argument("--every", type=int, default=5, help="async_save every this many steps (5)")
    g.add_argument("--ckpt-mib", type=int, default=64, help="parameters + momentum, whole model (64)")
    g.add_argument("--batch", type=int, default=32, help="training batch size per rank (32)")
    g.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads per rank (1: 2 ranks, 2 cores)"
    )
    g.add_argument("--step-reps", type=int, default=1, help="runs of each configuration, alternating (1)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.files = 128, 4
        args.steps, args.warmup_steps, args.ckpt_mib = 20, 5, 16
    counts = (args.size_mib, args.files, args.streams, args.repeats, args.steps, args.every, args.ckpt_mib)
    if min(counts) < 1 or min(args.batch, args.torch_threads, args.step_reps) < 1 or args.warmup_steps < 0:
        p.error("sizes, counts and repetitions must be positive")
    if args.files > args.size_mib * MIB:
        p.error("--files cannot exceed the number of bytes")
    if args.skip_transfers and not args.step_time:
        p.error("--skip-transfers leaves nothing to run without --step-time")
    return args


def tmpfs_mib(args: argparse.Namespace) -> int:
    """Each node's tmpfs: at most 3 copies of the checkpoint at once (A: sources, reused files, one restored
    copy; B: the replica, reused files, one raw copy), or part 3's stores, plus room to spare."""
    transfers = 0 if args.skip_transfers else 3.25 * args.size_mib
    part3 = 6 * args.ckpt_mib if args.step_time else 0  # own + replicated halves, kept, in flight, pooled
    return int(max(transfers, part3)) + 256


def check_memory(args: argparse.Namespace) -> None:
    """Refuse to start where the two node tmpfs cannot be filled (they live in this machine's memory)."""
    need = 2 * tmpfs_mib(args) * MIB + (1 << 30)
    with open("/proc/meminfo") as f:
        avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable"))
    if need > avail:
        sys.exit(
            f"bench_replication: needs about {need / (1 << 30):.1f} GiB of memory (two node tmpfs of "
            f"{tmpfs_mib(args)} MiB), {avail / (1 << 30):.1f} GiB available. Use a smaller --size-mib."
        )


TMP_PREFIX = "dcpms_bench_repl_"


def remove_stale_tmp(base: Path) -> None:
    """Remove the temporary directories (logs, part-3 results) of earlier runs that were killed before
    their cleanup: ``<TMP_PREFIX><pid>_*`` whose process is gone."""
    for d in base.glob(f"{TMP_PREFIX}*_*"):
        pid = d.name[len(TMP_PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP: unwind like Ctrl-C, so the ``finally`` blocks remove the cluster."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """The benchmark, or (first argument ``_serve``, ``_client``, ``_train``) one of its node processes."""
    argv = sys.argv[1:] if argv is None else argv
    roles = {"_serve": serve_role, "_client": client_role, "_train": train_role}
    if argv and argv[0] in roles:
        return roles[argv[0]](argv[1:])
    args = parse_args(argv)
    reason = netns_unavailable()
    if reason is not None:
        sys.exit(f"bench_replication: cannot build the 2-node cluster here: {reason}")
    stale = cleanup_stale()
    if stale:
        print(f"removed leftovers of {len(stale)} crashed cluster run(s): {', '.join(stale)}")
    check_memory(args)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    info = machine()
    print(
        f"bench_replication: {info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB RAM, "
        f"kernel {info['kernel']}, Python {info['python']}, torch {info['torch']}",
        flush=True,
    )
    step_reason = None if args.step_time else "not requested (--step-time)"
    load_before = os.getloadavg()
    started = time.perf_counter()
    remove_stale_tmp(Path(args.tmp))
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}_", dir=args.tmp))
    cluster = Cluster(2, tmpfs_mib=tmpfs_mib(args))
    runs: list[StepRun] = []
    directions: list[Direction] = []
    step_error: str | None = None
    try:
        cluster.start()
        print(
            f"cluster {cluster.token}: node A {cluster.node(0).addr}, node B {cluster.node(1).addr} "
            f"({cluster.subnet}), tmpfs {tmpfs_mib(args)} MiB each",
            flush=True,
        )
        if not args.skip_transfers:
            print("parts 1 and 2: put_file / get_file against raw sockets ...", flush=True)
            directions = list(run_transfers(cluster, args, tmp))
        if step_reason is None:
            try:
                runs = run_step_time(cluster, args, tmp)
            except (RuntimeError, OSError, ValueError) as e:  # parts 1 and 2 are still reported
                step_error = f"{type(e).__name__}: {e}"
                print(f"part 3 (--step-time) FAILED: {step_error}", file=sys.stderr, flush=True)
        elif args.step_time:
            print(f"part 3 (--step-time) SKIPPED: {step_reason}", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: removing the cluster ...", file=sys.stderr)
        return 130
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a 2nd Ctrl-C must not cut cleanup short
        try:
            cluster.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            signal.signal(signal.SIGINT, previous)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()
    print()
    for d in directions:
        print(direction_table(d, args))
        print()
    if directions:
        print(
            table(
                ["target", "ours / raw socket (GB/s), median [min-max]", "result"], target_rows(*directions)
            )
        )
        print()
    if runs:
        print(step_table(runs, args))
        print()
    elif step_error:
        print("Training step time: FAILED (see the error above)\n")
    print(
        f"Noisy machine: {info['cpus']} vCPUs shared, unpinned, by both nodes' processes, "
        "the kernel's veth/TCP work and this script; figures move between runs, read them with their spread."
    )
    print(
        f"wall time {wall:.0f} s; load average (1/5/15 min) before "
        f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}"
    )
    if args.json:
        step_json: dict[str, Any] = {"skipped": step_reason}
        if runs:
            step_json = {"runs": [asdict(r) for r in runs]}
        elif step_error:
            step_json = {"error": step_error}
        payload = {
            **run_record(info, args, wall, load_before, load_after),
            "target": TARGET,
            "transfers": [
                {
                    "title": d.title,
                    "ours": d.ours,
                    "baseline": d.baseline,
                    "nbytes": args.size_mib * MIB,
                    "files": args.files,
                    "streams": args.streams,
                    "ratios": d.ratios(),
                    "cpu_ratio": d.cpu_ratio(),
                    "ops": {k: asdict(v) for k, v in d.ops.items()},
                }
                for d in directions
            ],
            "step_time": step_json,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 1 if step_error else 0


def target_rows(replicate: Direction, restore: Direction) -> list[list[str]]:
    """The summary of the two throughput targets: ours/raw per repetition, judged on the median."""
    rows = []
    for d, what in ((replicate, "replication, put_file"), (restore, "restore from peer, get_file")):
        r = d.ratios()
        met = statistics.median(r) >= TARGET
        rows.append([f"{what} >= {TARGET:.2f} x raw socket", spread(r, "{:.2f}"), "MET" if met else "MISSED"])
    return rows


if __name__ == "__main__":
    sys.exit(main())
