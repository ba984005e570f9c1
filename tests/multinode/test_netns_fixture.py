"""The namespace cluster itself (tests/netns.py): nodes talk TCP to each other and to nothing else, a pulled
link cuts them off and plugging it back restores them, torchrun with gloo runs across nodes, and nothing is
left behind by close(), a failing test, a failed start or a crashed run."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tests.netns as netns
from tests.netns import Cluster, NetnsError, cleanup_stale, netns_unavailable, torchrun_argv

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_TIMEOUT_S = 150.0  # 2 agents + 4 workers importing torch on 2 cores

# Receives until EOF, answers "<bytes> <sha256>".
SERVER = """
import hashlib, socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    h, n = hashlib.sha256(), 0
    while chunk := c.recv(1 << 16):
        h.update(chunk)
        n += len(chunk)
    c.sendall(f"{n} {h.hexdigest()}".encode())
    c.close()
"""

# Sends argv[3] bytes (0: only connects) to argv[1]:argv[2], retrying refusals for argv[4] seconds.
CLIENT = """
import hashlib, os, socket, sys, time
host, port, size, patience = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + patience
while True:
    try:
        c = socket.create_connection((host, port), timeout=2)
        break
    except OSError as e:
        if time.monotonic() > deadline:
            print(f"FAIL {type(e).__name__} {e}")
            sys.exit(3)
        time.sleep(0.05)
data = os.urandom(size)
c.sendall(data)
c.shutdown(socket.SHUT_WR)
reply = b""
while chunk := c.recv(4096):
    reply += chunk
want = f"{size} {hashlib.sha256(data).hexdigest()}"
print("OK" if reply.decode() == want else f"MISMATCH {reply!r} != {want!r}")
"""

# One connection attempt to each (host, port) given; prints the outcome of each.
PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        print(target, "CONNECTED")
    except OSError as e:
        print(target, type(e).__name__, e)
"""

TRAIN = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
line = (
    f"RESULT rank={os.environ['RANK']} group_rank={os.environ['GROUP_RANK']} "
    f"local_rank={os.environ['LOCAL_RANK']} sum={t.item():g} root={os.environ['DCP_MEMSTORE_ROOT']}\\n"
)
os.write(1, line.encode())  # one write: a node's workers share the log, and print() writes the end apart
dist.barrier()
dist.destroy_process_group()
"""
RESULT = re.compile(r"RESULT rank=(\d+) group_rank=(\d+) local_rank=(\d+) sum=(\S+) root=(\S+)")


def py(code: str, *args: object) -> list[str]:
    return [sys.executable, "-c", code, *(str(a) for a in args)]


def start_server(node, host: str | None = None) -> int:
    """A SERVER on ``host`` (default: the node's address) in the node; returns its port."""
    srv = node.popen(py(SERVER, host or node.addr, 0), stdout=subprocess.PIPE, text=True)
    word, port = srv.stdout.readline().split()
    assert word == "listening"
    return int(port)


def send(node, host: str, port: int, size: int, patience: float = 5.0) -> str:
    return node.run(py(CLIENT, host, port, size, patience), timeout=60).stdout.strip()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def traces(token: str) -> list[str]:
    """Everything of cluster ``token`` still on the host: namespaces, mounts, state files and directories."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    found = [ns for ns in names if token in ns]
    with open("/proc/mounts") as f:
        found += [line.strip() for line in f if token in line]
    found += [str(p) for p in netns.STATE_DIR.glob(f"*{token}*")]
    return found


@pytest.fixture
def netns_ok() -> None:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)


def test_nodes_talk_tcp(cluster2):
    n0, n1 = cluster2.node(0), cluster2.node(1)
    assert n0.addr != n1.addr and n0.name != n1.name
    port = start_server(n1)
    assert send(n0, n1.addr, port, 4 << 20) == "OK"
    # Each node's root is its own tmpfs.
    (n0.root / "x").write_bytes(b"0")
    assert not (n1.root / "x").exists()
    with open("/proc/mounts") as f:
        fstypes = {line.split()[1]: line.split()[2] for line in f}
    assert fstypes[str(n0.root)] == fstypes[str(n1.root)] == "tmpfs"
    n0.wipe_root()
    assert list(n0.root.iterdir()) == []


def test_nodes_cannot_reach_the_host(cluster2):
    n0 = cluster2.node(0)
    host_lo = socket.create_server(("127.0.0.1", 0))
    host_any = socket.create_server(("0.0.0.0", 0))
    host_lo.settimeout(0.5)
    host_any.settimeout(0.5)
    with host_lo, host_any:
        lo_port, any_port = host_lo.getsockname()[1], host_any.getsockname()[1]
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
        host_ips = [ip for ip in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)", out) if not ip.startswith("127.")]
        targets = [f"127.0.0.1:{lo_port}", f"127.0.0.1:{any_port}", *(f"{ip}:{any_port}" for ip in host_ips)]
        res = n0.run(py(PROBE, *targets), timeout=60, check=True).stdout
        assert "CONNECTED" not in res, res
        for sock in (host_lo, host_any):
            with pytest.raises(TimeoutError):
                sock.accept()
    # The node's own loopback works.
    assert send(n0, "127.0.0.1", start_server(n0, "127.0.0.1"), 1000) == "OK"


def test_link_down_cuts_a_node_off(cluster2):
    n0, n1 = cluster2.node(0), cluster2.node(1)
    port = start_server(n1)
    assert send(n0, n1.addr, port, 1 << 20) == "OK"
    n1.link_down()
    t0 = time.monotonic()
    out = send(n0, n1.addr, port, 1000, patience=0)
    assert out.startswith("FAIL"), out
    assert time.monotonic() - t0 < 30
    n1.link_up()
    assert send(n0, n1.addr, port, 1 << 20, patience=10) == "OK"


def test_torchrun_gloo_across_nodes(cluster2, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    procs = cluster2.torchrun(script, nproc_per_node=2, log_dir=tmp_path)
    deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(1.0, deadline - time.monotonic()))
    logs = [(tmp_path / f"node{i}.log").read_text(errors="replace") for i in range(2)]
    detail = "\n".join(
        f"--- node{i} (rc {p.returncode})\n{log[-4000:]}"
        for i, (p, log) in enumerate(zip(procs, logs, strict=True))
    )
    assert [p.returncode for p in procs] == [0, 0], detail
    seen = {}
    for i, log in enumerate(logs):
        for m in RESULT.finditer(log):
            rank, group_rank, local_rank, total, root = m.groups()
            assert (int(group_rank), root) == (i, str(cluster2.node(i).root)), detail
            assert int(rank) == 2 * i + int(local_rank), detail
            assert float(total) == 1 + 2 + 3 + 4, detail
            seen[int(rank)] = i
    assert seen == {0: 0, 1: 0, 2: 1, 3: 1}, detail


def test_torchrun_argv():
    argv = torchrun_argv(1, 2, 4, "/x/train.py", ["--steps", 3], "10.1.2.1", 29555, python="py")
    assert argv == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=4",
        "--master-addr=10.1.2.1",
        "--master-port=29555",
        "/x/train.py",
        "--steps",
        "3",
    ]
    argv = torchrun_argv(0, 2, 1, "/x/w.py", [7], python="py", agent=["-c", "A"], worker=["py", "-c", "W"])
    assert argv[:3] == ["py", "-c", "A"], argv  # the agent: code that calls torchrun's main
    assert argv[-6:] == ["--no-python", "py", "-c", "W", "/x/w.py", "7"], argv  # workers run `py -c W`


def test_close_leaves_nothing_even_when_the_test_fails(netns_ok):
    links_before = host_links()
    c = Cluster(3, tmpfs_mib=16)
    pids = []
    with pytest.raises(ZeroDivisionError), c:
        for node in c.nodes:
            p = node.popen(py("import time; time.sleep(600)"))
            # A grandchild in a session of its own: out of reach of the process group kill.
            q = node.popen(
                ["sh", "-c", "setsid sleep 600 & echo $!; exec sleep 600"], stdout=subprocess.PIPE, text=True
            )
            pids += [p.pid, q.pid, int(q.stdout.readline())]
            (node.root / "data").write_bytes(b"x" * 1000)
        assert all(alive(pid) for pid in pids)
        1 / 0  # noqa: B018
    assert traces(c.token) == []
    assert not [pid for pid in pids if alive(pid)]
    assert host_links() == links_before
    assert not any(node.root.exists() for node in c.nodes)
    c.close()  # idempotent


def test_failed_start_removes_what_it_built(netns_ok, monkeypatch):
    real_cmd = netns._cmd

    def failing_cmd(argv, check=True):
        if argv[0] == "mount" and argv[-1].endswith("/n1"):
            raise NetnsError("injected mount failure")
        return real_cmd(argv, check)

    monkeypatch.setattr(netns, "_cmd", failing_cmd)
    c = Cluster(2)
    with pytest.raises(NetnsError, match="injected"):
        c.start()
    monkeypatch.undo()
    assert traces(c.token) == []
    c.close()


def test_stale_cluster_of_a_dead_process_is_removed(netns_ok):
    code = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.netns import Cluster
        c = Cluster(2, tmpfs_mib=8).start()
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sleeper = c.node(0).popen([sys.executable, "-c", "import time; time.sleep(600)"], **quiet)
        print(c.token, sleeper.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    token, sleeper = res.stdout.split()
    assert re.fullmatch(r"[0-9a-f]{6}", token), res
    try:
        assert alive(int(sleeper))
        left = traces(token)
        assert len(left) >= 3, left  # namespaces, mounts and the owner file survived the crash
    finally:
        removed = cleanup_stale()
    assert token in removed
    assert traces(token) == []
    assert not alive(int(sleeper))
    # A live cluster is not touched.
    with Cluster(2, tmpfs_mib=8) as live:
        assert live.token not in cleanup_stale()
        assert len(traces(live.token)) >= 3
    assert traces(live.token) == []
