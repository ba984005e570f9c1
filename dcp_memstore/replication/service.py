"""This process's part in replication when a job spans several nodes: its peer server, its replicator
thread, and the job's peers (learned through the torch.distributed store).

Started by ``MemStore`` once a process group exists and the job has more than one node; a single node
needs none of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from dcp_memstore.replication.auth import shared_secret
from dcp_memstore.replication.peers import (
    ANNOUNCE_GRACE_S,
    Peers,
    announce,
    announced,
    announced_host,
    lookup,
)
from dcp_memstore.replication.placement import NodeInfo, peer_rank
from dcp_memstore.replication.rdma import RdmaTransport
from dcp_memstore.replication.replicator import Replicator
from dcp_memstore.replication.select import choose_transport
from dcp_memstore.replication.server import CommitHandler, PeerServer, ReplicatedHandler, ReplicationState
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import PeerAddress
from dcp_memstore.store.layout import StoreLayout

log = logging.getLogger(__name__)


def job_node_info() -> NodeInfo | None:
    """This process's place in the job if torch.distributed is initialized (rank and world size from the
    process group, node shape from torchrun's environment), else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    env = dict(os.environ, RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    local = os.environ.get("LOCAL_WORLD_SIZE", "")  # empty counts as unset
    try:
        more_than_the_group = int(local) > dist.get_world_size()
    except ValueError:  # empty, or not an int (NodeInfo.from_env names the variable)
        more_than_the_group = False
    if not local or more_than_the_group:
        env.update(LOCAL_WORLD_SIZE=env["WORLD_SIZE"], LOCAL_RANK=env["RANK"], GROUP_RANK="0")
    return NodeInfo.from_env(env)


class ReplicationService:
    """The peer server and replicator of one process of job ``job_id`` (see module docstring).

    ``k``: replicas of each node's files (0: none; commits still reach every node). ``on_commit`` commits
    a checkpoint on this node when the coordinator says so; ``on_replicated`` records another node's
    report that its files of a checkpoint are replicated (``safe_point``); ``replication_state`` tells
    peers the replication state of this node's files of a checkpoint (``stat``). ``timeout_s`` bounds the
    wait for other ranks to announce their servers (see ``peers``); ``io_timeout_s`` how long a peer may
    stay silent in a transfer; ``keep`` the store's ``keep_in_memory`` (a checkpoint whose replicas are
    done is evicted if it is past its turn)."""

    def __init__(
        self,
        layout: StoreLayout,
        node: NodeInfo,
        *,
        k: int,
        bind_host: str,
        secret: bytes | str | None,
        transport: str,
        on_commit: CommitHandler,
        on_replicated: ReplicatedHandler,
        replication_state: ReplicationState,
        timeout_s: float,
        io_timeout_s: float,
        keep: int,
    ) -> None:
        self.layout, self.node, self.k, self.timeout_s = layout, node, k, timeout_s
        self._store: Any = dist.distributed_c10d._get_default_store()
        self.secret = shared_secret(self._store, layout.job_id, node.rank, secret)
        self._peers: Peers | None = None
        self._lock = threading.Lock()
        self.replicator: Replicator | None = None
        self.control = TcpTransport(layout.job_id, self.secret, io_timeout_s)
        try:
            self._data = choose_transport(layout.job_id, self.secret, transport, io_timeout_s) if k else None
        except BaseException:
            self.control.close()
            raise
        endpoint = self._data.endpoint() if isinstance(self._data, RdmaTransport) else None
        try:  # a node that sends by RDMA also receives by RDMA
            self.server = PeerServer(
                layout,
                layout.job_id,
                self.secret,
                bind_host,
                on_commit=on_commit,
                on_replicated=on_replicated,
                replication_state=replication_state,
                rdma=endpoint,
                io_timeout_s=io_timeout_s,
            )
        except BaseException:
            for resource in (endpoint, self._data, self.control):
                if resource is not None:
                    resource.close()
            raise
        host, port = self.server.address
        announce(self._store, layout.job_id, node.rank, (announced_host(host), port))
        self._started = time.monotonic()
        if k and node.multi_node:
            self.replicator = Replicator(layout, self._peers_for_replicator, self._data, keep, self.control)
        log.info(
            "replication: node %d of %d, rank %d serving on %s:%d, %d replica(s) per file",
            node.node_rank, node.nnodes, node.rank, host, port, min(k, node.nnodes - 1),
        )  # fmt: skip

    def peers(self) -> Peers:
        """The job's peers. A rank that has not announced its server is waited for until
        ``ANNOUNCE_GRACE_S`` (at most ``timeout_s``) after this service started, then RuntimeError naming
        it, at once on every later call (see the ``peers`` module docstring: the rule)."""
        return self._learn(min(self.timeout_s, ANNOUNCE_GRACE_S))

    def servers_now(self, nodes: list[int]) -> dict[int, PeerAddress]:
        """The server of this process's local rank on each of ``nodes`` that has announced it by now:
        no waiting (a status does not wait for a rank that is late, or dead)."""
        ranks = {n: peer_rank(n, self.node.local_rank, self.node.local_world_size) for n in nodes}
        if self._peers is not None:
            return {n: self._peers.addresses[r] for n, r in ranks.items()}
        found = announced(self._store, self.layout.job_id, ranks.values())
        return {n: found[r] for n, r in ranks.items() if r in found}

    def _peers_for_replicator(self) -> Peers:
        """``peers`` for the replicator thread, which holds up no caller: it waits ``timeout_s``."""
        return self._learn(self.timeout_s)

    def _learn(self, wait_s: float) -> Peers:
        """The job's peers, waiting until ``wait_s`` after this service started for ranks that have not
        announced their servers; looked up without the lock, so that one caller's wait holds up no other
        (the replicator's longer one, a status call's)."""
        if self._peers is None:
            waited = f"within {wait_s:g} s of this rank's start"
            addresses = lookup(self._store, self.layout.job_id, self.node, self._started + wait_s, waited)
            with self._lock:
                if self._peers is None:
                    self._peers = Peers(self.layout.job_id, self.node, self.k, self.secret, addresses)
        return self._peers

    def wake(self) -> None:
        if self.replicator is not None:
            self.replicator.wake()

    def close(self, timeout: float | None = None) -> None:
        """Stop replicating and serving; transfers in flight are dropped (the peer keeps nothing partial)."""
        if self.replicator is not None:
            self.replicator.close(0)
        for t in (self._data, self.control):
            if t is not None:
                t.close()
        if self.replicator is not None:
            self.replicator.close(timeout)
        self.server.close(10.0 if timeout is None else timeout)
