"""Several "nodes" on one machine for multi-node tests: Linux network namespaces joined by a bridge.

Why: replication sends each node's shards to a peer node over TCP, and what has to be tested there (two
hosts with their own addresses and their own tmpfs, a peer that disappears from the network, a node
replaced by an empty one, torchrun across nodes) cannot be faked with processes on one loopback. Network
namespaces give each node its own interfaces, addresses, routes and loopback, for the price of a few
``ip`` calls and without touching the host's network at all.

Topology of a ``Cluster(n)`` (``<t>`` is a random 6-hex token, so that parallel runs and leftovers of
crashed ones never collide)::

    netns dcpms-<t>-br:   bridge br0, ports p0 .. p<n-1>        (no address: a plain switch)
    netns dcpms-<t>-n<i>: lo, eth0 = 10.<x>.<y>.<i+1>/24         (veth, its peer is p<i> on the bridge)
    tmpfs /run/dcpms-netns/<t>/n<i>                               (node i's store root, own size limit)

The veth pairs are created from inside the bridge namespace with their other end moved straight into the
node namespace, so no link ever appears on the host. Nodes have no default route: they reach each other
and their own loopback, nothing else (the host's services included).

Usage::

    with Cluster(2) as c:                       # start() on enter, close() on exit
        n0, n1 = c.node(0), c.node(1)
        srv = n1.popen([sys.executable, "server.py", n1.addr])   # runs in n1's namespace
        n0.run([sys.executable, "client.py", n1.addr], timeout=30)
        n1.link_down()                          # the "cable" is pulled: packets to/from n1 vanish
        n1.wipe_root()                          # n1 comes back as a fresh machine
        procs = c.torchrun("train.py", nproc_per_node=2, log_dir=tmp)   # one torchrun per node

Processes started through a node run in their own process group; ``close()`` kills them (and anything
else still in the namespaces), deletes the namespaces (which deletes the veths and the bridge), unmounts
and removes the tmpfs roots. It is idempotent and safe after a failed or partial ``start()``.

Every cluster first writes ``/run/dcpms-netns/<t>.owner`` (pid and start time of the creating process)
and removes it last; ``cleanup_stale()`` removes whatever belongs to a token whose owner is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

PREFIX = "dcpms-"
STATE_DIR = Path("/run/dcpms-netns")  # <token>.owner files and <token>/n<i> tmpfs mount points
NODE_IF = "eth0"  # each node's interface, inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"
IP_TIMEOUT_S = 30.0  # one `ip` call; they take milliseconds, but the machine may be busy
KILL_WAIT_S = 15.0  # for killed processes to be gone
_NS_RE = re.compile(r"^dcpms-([0-9a-f]{6})-(?:n\d+|br|probe)$")
_LIVE: set[Cluster] = set()  # started and not yet closed, for the atexit hook


class NetnsError(RuntimeError):
    """An ``ip``/``mount`` command failed while building a cluster."""


# ---------------------------------------------------------------------------------------------------------
# small helpers


def _cmd(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and res.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _cmd(["ip", *args], check=check)


def _netns_names() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _mounts_under(base: Path) -> list[str]:
    """Mount points at or below ``base`` (deepest first), from /proc/mounts."""
    prefix = str(base).rstrip("/") + "/"
    out = []
    with open("/proc/mounts") as f:
        for line in f:
            mnt = line.split()[1].replace("\\040", " ")
            if mnt == str(base) or mnt.startswith(prefix):
                out.append(mnt)
    return sorted(out, key=len, reverse=True)


def _umount(path: str) -> None:
    if _cmd(["umount", path], check=False).returncode != 0:
        _cmd(["umount", "-l", path], check=False)  # still busy: detach now, freed when unused


def _proc_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime
    except (OSError, IndexError):
        return None


def _write_owner(token: str) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_DIR / f".{token}.owner.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "start": _proc_start_time(os.getpid())}))
    os.replace(tmp, STATE_DIR / f"{token}.owner")


def _owner_alive(token: str) -> bool:
    try:
        owner = json.loads((STATE_DIR / f"{token}.owner").read_text())
    except (OSError, ValueError):
        return False  # written before anything else exists and removed after all is gone: no owner
    return _proc_start_time(int(owner["pid"])) == owner["start"]


def _kill_netns_procs(names: Iterable[str], timeout: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL every process in the namespaces ``names`` until none is left; returns those still there."""
    names = list(names)
    deadline = time.monotonic() + timeout
    while True:
        pids = [pid for ns in names for pid in _netns_pids(ns)]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _teardown_token(token: str, namespaces: Iterable[str]) -> list[str]:
    """Remove every trace of ``token``: processes in its namespaces, the namespaces (with their veths and
    bridge), mounts and directories under STATE_DIR, the owner file last. Missing pieces are fine.
    Returns a description of what could not be removed."""
    problems = []
    namespaces = list(namespaces)
    left = _kill_netns_procs(namespaces)
    if left:
        problems.append(f"processes {left} survived SIGKILL")
    existing = set(_netns_names())
    for ns in namespaces:
        if ns in existing:
            res = _ip("netns", "del", ns, check=False)
            if res.returncode != 0:
                problems.append(f"ip netns del {ns}: {res.stderr.strip()}")
    base = STATE_DIR / token
    for mnt in _mounts_under(base):
        _umount(mnt)
    still = _mounts_under(base)
    if still:
        problems.append(f"still mounted: {still}")
    shutil.rmtree(base, ignore_errors=True)
    if base.exists():
        problems.append(f"cannot remove {base}")
    if not problems:
        (STATE_DIR / f"{token}.owner").unlink(missing_ok=True)
    return problems


def cleanup_stale() -> list[str]:
    """Remove namespaces, mounts and directories of clusters whose creating process is gone (a crashed or
    killed test run). Clusters of live processes, this one included, are left alone. Returns the tokens
    removed."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    by_token: dict[str, list[str]] = {}
    for ns in _netns_names():
        m = _NS_RE.match(ns)
        if m:
            by_token.setdefault(m.group(1), []).append(ns)
    if STATE_DIR.is_dir():
        for entry in STATE_DIR.iterdir():
            m = re.match(r"^([0-9a-f]{6})(?:\.owner)?$", entry.name)
            if m:
                by_token.setdefault(m.group(1), [])
    removed = []
    for token, namespaces in sorted(by_token.items()):
        if not _owner_alive(token):
            _teardown_token(token, namespaces)
            removed.append(token)
    return removed


def _host_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks the host has addresses or routes in (default routes excluded)."""
    nets = []
    for args in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for tok in _ip(*args, check=False).stdout.split():
            if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", tok):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(tok, strict=False))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _host_networks()
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{random.randint(64, 254)}.{random.randint(0, 254)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError("no free 10.x.y.0/24 subnet found")


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """Why the multi-node tests cannot run here, or None if they can. Checks root, the ``ip`` and
    ``mount`` tools, and actually builds (and removes) a namespace with a bridge, a veth and a tmpfs."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tmpfs mounts need root"
    for tool in ("ip", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    token = secrets.token_hex(3)
    ns = f"{PREFIX}{token}-probe"
    mnt = STATE_DIR / token / "probe"
    try:
        _write_owner(token)
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _ip("-n", ns, "link", "set", "pa", "master", BRIDGE)
        mnt.mkdir(parents=True)
        _cmd(["mount", "-t", "tmpfs", "-o", "size=1m", f"{PREFIX}{token}-probe", str(mnt)])
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return f"cannot build a network namespace with a bridge, veth and tmpfs: {e}"
    finally:
        _teardown_token(token, [ns])
    return None


# ---------------------------------------------------------------------------------------------------------
# torchrun


def torchrun_argv(
    node_rank: int,
    nnodes: int,
    nproc_per_node: int,
    script: str | os.PathLike,
    args: Sequence[object] = (),
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    python: str = sys.executable,
    agent: Sequence[str] = ("-m", "torch.distributed.run"),
    worker: Sequence[str] | None = None,
) -> list[str]:
    """argv of ``python -m torch.distributed.run`` for node ``node_rank`` of a static ``nnodes`` job
    (the default static rendezvous: node 0's agent hosts the store on ``master_addr:master_port``).

    ``agent`` replaces ``-m torch.distributed.run`` (``-c CODE``, code that ends by calling its main);
    ``worker``, when given, is the command each worker runs ``script`` with (torchrun's ``--no-python``)
    instead of torchrun's own ``python -u``."""
    start = [] if worker is None else ["--no-python", *worker]
    return [
        python,
        *agent,
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        *start,
        str(script),
        *(str(a) for a in args),
    ]


# ---------------------------------------------------------------------------------------------------------
# nodes and clusters


class Node:
    """One node of a Cluster: namespace ``name``, address ``addr`` on ``ifname``, tmpfs store ``root``."""

    def __init__(self, cluster: Cluster, index: int, addr: str) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"{PREFIX}{cluster.token}-n{index}"
        self.addr = addr
        self.ifname = NODE_IF
        self.root = STATE_DIR / cluster.token / f"n{index}"
        self._port = f"p{index}"  # this node's port on the bridge

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.name}, {self.addr}, {self.root})"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus what a process on this node needs: ``DCP_MEMSTORE_ROOT`` (the
        node's tmpfs), ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` (the node's interface; without them
        gloo picks the address the shared hostname resolves to, 127.0.0.1 here), then ``extra``."""
        env = dict(os.environ)
        env.update(
            DCP_MEMSTORE_ROOT=str(self.root),
            GLOO_SOCKET_IFNAME=self.ifname,
            TP_SOCKET_IFNAME=self.ifname,
        )
        env.update(extra or {})
        return env

    def popen(self, argv: Sequence[str | os.PathLike], env: Mapping[str, str] | None = None, **kw):
        """``subprocess.Popen`` of ``argv`` inside this node's namespace, in a new session (so its own
        process group), tracked so that ``Cluster.close()`` kills it. ``env`` defaults to ``self.env()``;
        a given ``env`` is used as is. Other keywords go to Popen."""
        return self.cluster._popen(self, argv, env, **kw)

    def run(
        self,
        argv: Sequence[str | os.PathLike],
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | bytes | None = None,
        check: bool = False,
        capture_output: bool = True,
        text: bool = True,
        **kw,
    ) -> subprocess.CompletedProcess:
        """Like ``subprocess.run`` inside this node's namespace; output captured as text by default. On
        timeout the whole process group is killed and ``subprocess.TimeoutExpired`` raised."""
        if capture_output:
            kw.setdefault("stdout", subprocess.PIPE)
            kw.setdefault("stderr", subprocess.PIPE)
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        p = self.popen(argv, env=env, text=text, **kw)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cluster._kill(p)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        res = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            res.check_returncode()
        return res

    def free_port(self) -> int:
        """A TCP port the OS reports free on this node's address (asked inside the namespace)."""
        code = f"import socket; s = socket.socket(); s.bind(({self.addr!r}, 0)); print(s.getsockname()[1])"
        res = self.run([sys.executable, "-c", code], timeout=30, check=True)
        return int(res.stdout.strip())

    def link_down(self) -> None:
        """Pull the node's cable: its port on the bridge goes down. The node keeps its address and
        routes; packets to and from it are silently dropped (peers see timeouts, not refusals)."""
        _ip("-n", self.cluster.bridge_ns, "link", "set", self._port, "down")

    def link_up(self) -> None:
        """Plug the cable back in (the node is reachable again within milliseconds)."""
        _ip("-n", self.cluster.bridge_ns, "link", "set", self._port, "up")

    def kill(self) -> None:
        """The machine dies: SIGKILL every process in the node's namespace (torchrun's workers too, which
        run in sessions of their own)."""
        left = _kill_netns_procs([self.name])
        if left:
            raise NetnsError(f"processes {left} in {self.name} survived SIGKILL")

    def wipe_root(self) -> None:
        """Delete everything in the node's tmpfs (a replaced node comes back empty)."""
        for entry in os.scandir(self.root):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


class Cluster:
    """``n`` nodes (network namespaces on one bridge, each with a private tmpfs); see the module doc."""

    def __init__(self, n: int, tmpfs_mib: int = 256) -> None:
        if n < 2:
            raise ValueError(f"a cluster needs at least 2 nodes, not {n}")
        if n > 250:
            raise ValueError("at most 250 nodes fit in the /24")
        self.n = n
        self.tmpfs_mib = tmpfs_mib
        self.token = secrets.token_hex(3)
        self.bridge_ns = f"{PREFIX}{self.token}-br"
        self.subnet: ipaddress.IPv4Network | None = None
        self._nodes: list[Node] = []
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    def __repr__(self) -> str:
        return f"Cluster(n={self.n}, token={self.token}, subnet={self.subnet})"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this cluster may have created (nodes, then the bridge)."""
        return [f"{PREFIX}{self.token}-n{i}" for i in range(self.n)] + [self.bridge_ns]

    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes)

    def node(self, i: int) -> Node:
        return self._nodes[i]

    def start(self) -> Cluster:
        """Build the namespaces, bridge, veths and tmpfs roots. On any failure, everything built so far is
        removed again before the error propagates."""
        if self._started or self._closed:
            raise RuntimeError("a Cluster is started once")
        self._started = True
        _write_owner(self.token)  # before anything exists, so a crash leaves nothing unowned
        _LIVE.add(self)
        try:
            self.subnet = _pick_subnet()
            hosts = list(self.subnet.hosts())
            br = self.bridge_ns
            _ip("netns", "add", br)
            _ip("-n", br, "link", "set", "lo", "up")
            _ip("-n", br, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", br, "link", "set", BRIDGE, "up")
            for i in range(self.n):
                node = Node(self, i, str(hosts[i]))
                self._nodes.append(node)
                _ip("netns", "add", node.name)
                _ip("-n", node.name, "link", "set", "lo", "up")
                veth = ("type", "veth", "peer", "name", NODE_IF, "netns", node.name)
                _ip("-n", br, "link", "add", node._port, *veth)  # the peer is born in the node
                _ip("-n", br, "link", "set", node._port, "master", BRIDGE)
                _ip("-n", br, "link", "set", node._port, "up")
                _ip("-n", node.name, "addr", "add", f"{node.addr}/{self.subnet.prefixlen}", "dev", NODE_IF)
                _ip("-n", node.name, "link", "set", NODE_IF, "up")
                node.root.mkdir(parents=True)
                opts = f"size={self.tmpfs_mib}m,mode=0755"
                _cmd(["mount", "-t", "tmpfs", "-o", opts, node.name, str(node.root)])  # device = ns name
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process started on the nodes (and anything else inside the namespaces), delete the
        namespaces with their links, unmount and remove the tmpfs roots. Idempotent; works after a
        partial ``start()``. Raises NetnsError only if something could not be removed."""
        with self._lock:
            if self._closed or not self._started:
                self._closed = True
                return
            self._closed = True
        for p in list(self._procs):
            self._kill(p)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(KILL_WAIT_S)
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        problems = _teardown_token(self.token, self.namespaces)
        _LIVE.discard(self)
        if problems:
            raise NetnsError(f"cluster {self.token} not fully removed: {'; '.join(problems)}")

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def free_port(self) -> int:
        """A free TCP port on node 0 (for torchrun's ``--master-port``)."""
        return self._nodes[0].free_port()

    def torchrun(
        self,
        script: str | os.PathLike,
        args: Sequence[object] = (),
        nproc_per_node: int = 1,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        master_port: int | None = None,
    ) -> list[subprocess.Popen]:
        """Start one torchrun agent per node (static rendezvous, master = node 0 at a free port), each with
        ``node.env(env)``. With ``log_dir``, node i's stdout and stderr go to ``log_dir/node<i>.log``."""
        port = master_port if master_port is not None else self.free_port()
        procs = []
        for node in self._nodes:
            argv = torchrun_argv(node.index, self.n, nproc_per_node, script, args, self._nodes[0].addr, port)
            if log_dir is None:
                procs.append(node.popen(argv, env=node.env(env)))
                continue
            with open(Path(log_dir) / f"node{node.index}.log", "wb") as log:  # the child keeps its own fd
                procs.append(node.popen(argv, env=node.env(env), stdout=log, stderr=subprocess.STDOUT))
        return procs

    # -- process tracking

    def _popen(self, node: Node, argv: Sequence[str | os.PathLike], env, **kw) -> subprocess.Popen:
        with self._lock:
            if self._closed or not self._started:
                raise RuntimeError("cluster is not running")
            p = subprocess.Popen(
                ["ip", "netns", "exec", node.name, *(str(a) for a in argv)],
                env=dict(env) if env is not None else node.env(),
                start_new_session=True,
                **kw,
            )
            self._procs.append(p)
            return p

    @staticmethod
    def _kill(p: subprocess.Popen) -> None:
        """SIGKILL ``p``'s process group. Only while ``p`` is unreaped: then its pid (= its group id)
        cannot have been reused. Stragglers of reaped leaders are swept from the namespaces by close()."""
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)


@atexit.register
def _close_live() -> None:
    for c in list(_LIVE):
        with contextlib.suppress(Exception):
            c.close()
