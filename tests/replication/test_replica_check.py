"""The replicas a node's records call replicated, checked against what the replica node keeps now, with real
peer servers on 127.0.0.1: a node restarted with an empty store, a replica of the wrong size, a node that
does not answer or has not announced its server."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from dcp_memstore.replication.replica_check import confirm
from dcp_memstore.replication.replicator import node_files
from dcp_memstore.replication.server import PeerServer
from dcp_memstore.replication.tcp import TcpTransport
from tests.replication.test_cluster_status import closed_port, committed, kept, layout
from tests.replication.test_recovery import SECRET

FILES = ["__0_0.shard", "__1_0.shard"]


@pytest.fixture
def transport():
    with TcpTransport("job", SECRET, timeout_s=5) as t:
        yield t


def check(shm_dir, transport, servers, states=None) -> dict[str, str]:
    """Node 0's replication of ``s1`` (its records: ``states``, default node 1 replicated), confirmed."""
    files = node_files(layout(shm_dir, 0), "s1")
    assert files == {"__0_0.shard": 1}
    return confirm(states or {"node1": "replicated"}, files, servers, "node0", transport, "s1")


@pytest.fixture
def holder(shm_dir):
    """Node 0 holds ``s1`` (its file ``__0_0.shard``); node 1 keeps the replica of it."""
    committed(layout(shm_dir, 0), "s1", FILES, ["__0_0.shard"])
    committed(layout(shm_dir, 1), "s1", FILES, ["__1_0.shard"])
    kept(layout(shm_dir, 1), "node0", "s1", "__0_0.shard")


def test_a_replica_node_restarted_empty_has_lost_it(shm_dir, transport, holder):
    """Replicated while node 1 keeps the replica; once node 1's store is wiped and its server restarted
    (a replaced machine), the same records are ``lost``."""
    with PeerServer(layout(shm_dir, 1), "job", SECRET, "127.0.0.1") as server:
        assert check(shm_dir, transport, {"node1": server.address}) == {"node1": "replicated"}
    shutil.rmtree(shm_dir / "node1")
    with PeerServer(layout(shm_dir, 1), "job", SECRET, "127.0.0.1") as server:
        assert check(shm_dir, transport, {"node1": server.address}) == {"node1": "lost"}


def test_a_replica_of_another_size_is_lost(shm_dir, transport, holder):
    """A file of the replica that is not the size of node 0's is not a replica of it."""
    (layout(shm_dir, 1).replica_dir("node0", "s1") / "__0_0.shard").write_bytes(b"xx")
    with PeerServer(layout(shm_dir, 1), "job", SECRET, "127.0.0.1") as server:
        assert check(shm_dir, transport, {"node1": server.address}) == {"node1": "lost"}


@pytest.mark.parametrize("announced", [False, True], ids=["not_announced", "not_answering"])
def test_a_replica_node_that_cannot_be_asked_is_unreachable(shm_dir, transport, holder, announced):
    """A replica node whose server has not announced itself, or does not answer, cannot confirm that it
    keeps the replica: ``unreachable`` (which waiting may change), not ``replicated``."""
    servers = {"node1": ("127.0.0.1", closed_port())} if announced else {}
    assert check(shm_dir, transport, servers) == {"node1": "unreachable"}


def test_only_replicated_entries_are_asked(shm_dir, transport, holder):
    """``pending`` and ``retrying`` entries stay as recorded (no replica node to ask is given for them,
    which would make them ``unreachable`` if asked); a replicated one beside them is confirmed."""
    states = {"node1": "replicated", "node2": "pending", "node3": "retrying: ConnectionError: down"}
    with PeerServer(layout(shm_dir, 1), "job", SECRET, "127.0.0.1") as server:
        assert check(shm_dir, transport, {"node1": server.address}, states) == states


def test_a_replica_node_silent_past_the_limit_of_a_wait_is_unreachable_at_that_limit(shm_dir, holder):
    """A node whose server accepts connections but never answers (a hung process: the kernel still
    completes the handshake) is ``unreachable`` at the deadline of the wait that asks, not after the
    transport's timeout for each wait for a peer (30 s here); the transport's error says so."""
    with socket.create_server(("127.0.0.1", 0)) as silent, TcpTransport("job", SECRET, timeout_s=30) as slow:
        addr = silent.getsockname()
        start = time.monotonic()
        files, servers = {"__0_0.shard": 1}, {"node1": addr}
        states = confirm({"node1": "replicated"}, files, servers, "node0", slow, "s1", start + 0.5)
        assert states == {"node1": "unreachable"}
        assert time.monotonic() - start < 3
        with pytest.raises(TimeoutError, match=r"silent until the deadline of the wait \(asking what it"):
            slow.stat(addr, "s1", deadline=time.monotonic() + 0.5)
