"""The replication of a checkpoint as the job's nodes hold it, seen from a node without it, with real peer
servers on 127.0.0.1: which entries a user waits on and which waiting does not change."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from dcp_memstore.replication.cluster_read import ClusterCheckpoint
from dcp_memstore.replication.cluster_status import cluster_replicas
from dcp_memstore.replication.peers import Peers
from dcp_memstore.replication.placement import NodeInfo
from dcp_memstore.replication.server import PeerServer
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.status import CheckpointStatus, replication_of
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import MANIFEST, StoreLayout
from dcp_memstore.store.manifest import Manifest, ManifestItem, ShardLocation
from tests.replication.test_recovery import SECRET


def committed(layout: StoreLayout, cid: str, listed: list[str], own: list[str]) -> None:
    """``cid`` committed on ``layout``'s node with the files ``own``, its manifest listing ``listed``."""
    d = layout.checkpoint_dir(cid)
    d.mkdir(parents=True)
    items = [ManifestItem(f"x{i}", None, ShardLocation(f, 0, 1, 0)) for i, f in enumerate(listed)]
    Manifest(cid, 4, items, {}).write(d / MANIFEST)
    for name in own:
        (d / name).write_bytes(b"x")
    catalog.commit(layout, cid, len(own))


def kept(layout: StoreLayout, source: str, cid: str, *files: str) -> None:
    d = layout.replica_dir(source, cid)
    d.mkdir(parents=True)
    for name in files:
        (d / name).write_bytes(b"x")


def closed_port() -> int:
    """A port nothing listens on (a node that does not answer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answering(states: dict[str, str] | None) -> Callable[[str], dict[str, str] | None]:
    """A store's ``replication_state`` that says ``states`` of any checkpoint."""
    return lambda checkpoint: states


def view(root: Path, nnodes: int, states: dict[int, dict[str, str]], down: int | None = None) -> dict:
    """Checkpoint ``s1`` as node 0 sees it in a job of ``nnodes`` nodes (k=1) whose node ``i`` runs a
    server on ``root/node<i>`` answering ``states[i]`` for its replication, except node ``down``."""
    up = [i for i in range(nnodes) if i != down]
    with contextlib.ExitStack() as stack:
        servers = {}
        for i in up:
            server = PeerServer(
                layout(root, i), "job", SECRET, "127.0.0.1", replication_state=answering(states.get(i))
            )
            servers[i] = stack.enter_context(server)
        addresses = {i: s.address for i, s in servers.items()}
        if down is not None:
            addresses[down] = ("127.0.0.1", closed_port())
        node = NodeInfo(
            node_rank=0, nnodes=nnodes, local_rank=0, local_world_size=1, rank=0, world_size=nnodes
        )
        transport = stack.enter_context(TcpTransport("job", SECRET, timeout_s=5))
        peers = Peers("job", node, 1, SECRET, addresses)
        return cluster_replicas(ClusterCheckpoint(layout(root, 0), peers, transport, "s1"))


def layout(root: Path, node: int) -> StoreLayout:
    return StoreLayout(root / f"node{node}", "job")


def test_entries_waiting_changes_and_entries_it_does_not(shm_dir):
    """Node 1's files were acknowledged by node 2, which no longer keeps them (lost); node 2's are being
    retried towards node 3, which does not answer; node 0's own files (it holds no copy) are kept only
    in the replica on node 1. Only the retry and the node that is away are worth waiting for."""
    listed = ["__0_0.shard", "__1_0.shard", "__2_0.shard", "__3_0.shard"]
    committed(layout(shm_dir, 1), "s1", listed, ["__1_0.shard"])
    committed(layout(shm_dir, 2), "s1", listed, ["__2_0.shard"])
    kept(layout(shm_dir, 1), "node0", "s1", "__0_0.shard")
    states = {1: {"node2": "replicated"}, 2: {"node3": "retrying: ConnectionError: down"}}

    replicas = view(shm_dir, 4, states, down=3)

    assert replicas == {
        "node1->node2": "lost",
        "node2->node3": "retrying: ConnectionError: down",
        "node3": "unreachable",
        "node0": "not in memory; replicas on node1",
    }
    st = CheckpointStatus("s1", False, "off", replication=replication_of(replicas), replicas=replicas)
    assert st.replication == "under-replicated"
    assert st.stalled == {"node1->node2": "lost", "node0": "not in memory; replicas on node1"}


@pytest.mark.parametrize("unheld", [False, True])
def test_replicated_where_every_file_is_kept_by_its_node_and_its_replica_node(shm_dir, unheld):
    """Nodes 1 and 2 hold their copies, each acknowledged by its replica node, which keeps it; node 0
    wrote no file of the checkpoint (a node added since), so nothing of it is missing: replicated. Unless
    the manifest lists a file that no node holds (its node and replica node both lost it)."""
    listed = ["__1_0.shard", "__2_0.shard"] + (["__3_0.shard"] if unheld else [])
    committed(layout(shm_dir, 1), "s1", listed, ["__1_0.shard"])
    committed(layout(shm_dir, 2), "s1", listed, ["__2_0.shard"])
    kept(layout(shm_dir, 2), "node1", "s1", "__1_0.shard")
    kept(layout(shm_dir, 0), "node2", "s1", "__2_0.shard")

    replicas = view(shm_dir, 3, {1: {"node2": "replicated"}, 2: {"node0": "replicated"}})

    expected = {"node1->node2": "replicated", "node2->node0": "replicated"}
    if unheld:
        expected["unheld"] = "1 of 3 data files held by no node"
    assert replicas == expected
    assert replication_of(replicas) == ("under-replicated" if unheld else "replicated")
