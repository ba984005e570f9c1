"""The job's replication peers: this process's place in the job, every rank's server address, the secret.

Every rank runs a peer server and announces its address in the torch.distributed store under
``dcp_memstore/<job>/addr/<rank>``; a rank reads the others' when it first needs them. ``Peers`` is plain
data (picklable), so DCP's checkpoint process can commit and replicate with what the training process
learned.

A rank that has not announced its server may be starting (slower to open its ``MemStore``), or dead (it
failed or was killed before), or never open one: nothing of this package ran there, so nothing tells
these apart but time. The ranks of a job start their replication at the same point of the training
script (when the ``MemStore`` opens after ``init_process_group``, else at its first save or load), so a
live one announces soon after the others: a lookup waits for ranks that have not announced until
``ANNOUNCE_GRACE_S`` after this rank's own replication started, then fails naming them. Past that, it
fails at once: a rank that missed the start is not waited for again on every call.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dcp_memstore.replication.placement import NodeInfo, node_of, peer_rank, replica_targets
from dcp_memstore.replication.transport import PeerAddress
from dcp_memstore.store.ids import validate_name

ENV_BIND = "DCP_MEMSTORE_BIND"
ANNOUNCE_GRACE_S = 60.0  # how long after this rank's start the others' servers are waited for
_POLL_S = (0.02, 1.0)  # first and longest pause between two looks: every rank polls the job's store


def node_name(node: int) -> str:
    """The name node ``node``'s replicas are kept under on its peers (``replicas/<name>/``)."""
    return f"node{node}"


def address_key(job_id: str, rank: int) -> str:
    return f"dcp_memstore/{validate_name(job_id, 'job id')}/addr/{rank}"


def default_bind_host() -> str:
    """Where this rank's peer server listens when the user does not say: ``$DCP_MEMSTORE_BIND``, else the
    local address of the interface that reaches the rendezvous host (``$MASTER_ADDR``), which is the
    network the job's ranks already talk on, else 127.0.0.1 (a single machine)."""
    return os.environ.get(ENV_BIND) or _route_host()


def announced_host(bound: str) -> str:
    """The address to give peers for a server bound to ``bound`` (a wildcard such as 0.0.0.0 is not an
    address peers can reach: give the one that routes to the rendezvous host)."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(bound).is_unspecified:
            return _route_host()
    return bound


def _route_host() -> str:
    """The local IPv4 address that routes to ``$MASTER_ADDR`` (no packet is sent), else 127.0.0.1."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
            return s.getsockname()[0]
    return "127.0.0.1"


def announce(store: Any, job_id: str, rank: int, address: PeerAddress) -> None:
    """Publish rank ``rank``'s server address in the torch.distributed store."""
    store.set(address_key(job_id, rank), f"{address[0]} {address[1]}")


def lookup(store: Any, job_id: str, node: NodeInfo, deadline: float, waited: str) -> dict[int, PeerAddress]:
    """Every rank's server address in the job of this process (``node``), waiting until ``deadline``
    (``time.monotonic()``) for ranks that have not announced one; past it, RuntimeError naming them and
    their nodes, with how long they were waited for (``waited``, e.g. "within 60 s of this rank's
    start"). The store is polled with short ``check`` calls rather than one long ``wait``: a wait holds
    the store client's lock, stalling every other use of the store in this process (another thread's
    lookup, ``dist.new_group``) until it ends. The pause between two looks doubles up to a second, so
    that a big job's ranks waiting for a late one do not flood the store's server."""
    keys = [address_key(job_id, r) for r in range(node.world_size)]
    pause = _POLL_S[0]
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing:
                raise RuntimeError(_not_announced(job_id, node, missing, waited))
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])
    out = {r: _address(store, k) for r, k in enumerate(keys)}
    check_reachable(out)
    return out


def announced(store: Any, job_id: str, ranks: Iterable[int]) -> dict[int, PeerAddress]:
    """The server addresses of those of ``ranks`` that have announced one by now, without waiting."""
    keys = {r: address_key(job_id, r) for r in ranks}
    return {r: _address(store, k) for r, k in keys.items() if store.check([k])}


def _address(store: Any, key: str) -> PeerAddress:
    host, port = bytes(store.get(key)).decode().rsplit(" ", 1)
    return (host, int(port))


def _not_announced(job_id: str, node: NodeInfo, missing: list[int], waited: str) -> str:
    where = ", ".join(f"rank {r} on node {node_of(r, node.local_world_size)}" for r in missing)
    return (
        f"{where} of job {job_id!r} announced no replication server {waited}. Such a rank failed or was "
        "killed before opening its MemStore (see its node's log), opens none, or opens one with another "
        "job id: every rank must create its MemStore with the same job id after init_process_group, "
        "before the first save or load. Restart the job once every rank does"
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


def check_reachable(addresses: dict[int, PeerAddress]) -> None:
    """Raise ValueError if some ranks announced a loopback address while others announced one on a
    network: those are other machines, which cannot reach a loopback address. (All on loopback is one
    machine, e.g. a test.) Typical cause: ``$MASTER_ADDR`` names the rendezvous host, whose name resolves
    to 127.0.1.1 on that host itself, so its servers bound to the route to it."""
    loopback = sorted(r for r, (host, _) in addresses.items() if _is_loopback(host))
    if loopback and len(loopback) < len(addresses):
        hosts = sorted({addresses[r][0] for r in loopback})
        raise ValueError(
            f"ranks {loopback} announced their replication servers on loopback addresses "
            f"({', '.join(hosts)}), which the job's other nodes cannot reach; give those ranks' MemStore "
            f"replication_bind= (or ${ENV_BIND}) their node's address on the job's network"
        )


@dataclass(frozen=True)
class Peers:
    """Who replicates where in job ``job_id``: this process's ``node`` info, the replication factor ``k``
    (0: replication off; commits still reach every node), the job's ``secret`` and every rank's server."""

    job_id: str
    node: NodeInfo
    k: int
    secret: bytes
    addresses: dict[int, PeerAddress]

    @property
    def name(self) -> str:
        """This node's name (``node<i>``)."""
        return node_name(self.node.node_rank)

    def server(self, node: int, local_rank: int | None = None) -> PeerAddress:
        """The server of local rank ``local_rank`` (default: this process's) on node ``node``."""
        lr = self.node.local_rank if local_rank is None else local_rank
        return self.addresses[peer_rank(node, lr, self.node.local_world_size)]

    def targets(self) -> list[int]:
        """The nodes this node's files are replicated to, nearest first (none when ``k`` is 0)."""
        return replica_targets(self.node.node_rank, self.node.nnodes, self.k) if self.k else []

    def other_nodes(self) -> list[int]:
        return [n for n in range(self.node.nnodes) if n != self.node.node_rank]

    def node_ranks(self, node: int | None = None) -> range:
        """The global ranks on node ``node`` (default: this one)."""
        n = self.node.node_rank if node is None else node
        lws = self.node.local_world_size
        return range(n * lws, (n + 1) * lws)

    def pushes(self, rank_of_file: int | None) -> bool:
        """Whether this process sends a file written by rank ``rank_of_file`` (one process per file on
        each node: the local rank equal to the writer's rank modulo the ranks per node)."""
        return rank_of_file is not None and rank_of_file % self.node.local_world_size == self.node.local_rank
