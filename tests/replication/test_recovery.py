"""Recovery bookkeeping without a network: which checkpoints the cluster can still read, how replica
records follow what targets hold, and a commit that cannot reach a node failing the save cleanly."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_memstore import CommitError, MemoryStorageWriter, MemStore
from dcp_memstore.persist.persister import node_share
from dcp_memstore.persist.progress import target_key
from dcp_memstore.replication.peers import Peers
from dcp_memstore.replication.placement import NodeInfo
from dcp_memstore.replication.recovery import inventory, orphans, readable, resync, take_over, unheld
from dcp_memstore.replication.replicator import REPLICA_HOLD, ReplicaRecords, node_files, to
from dcp_memstore.store import catalog, liveness
from dcp_memstore.store.layout import MANIFEST, part_name
from dcp_memstore.store.manifest import Manifest

SECRET = b"s" * 32


def two_node_peers(port: int = 9) -> Peers:
    """This process as node 0 of a 2-node job, replicating to node 1 (whose server is at ``port``)."""
    node = NodeInfo(node_rank=0, nnodes=2, local_rank=0, local_world_size=1, rank=0, world_size=2)
    return Peers("job", node, 1, SECRET, {0: ("127.0.0.1", port), 1: ("127.0.0.1", port)})


def save(store, cid: str) -> None:
    sd = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, 5), "n": 7}
    dcp.save(sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True)


def test_readable_needs_a_manifest_and_every_file_somewhere():
    listed = {"__0_0.shard": 100, "__1_0.shard": 50}
    node0 = {"committed": [["s1", 2.0, 1, 150, listed]], "own": {"s1": {"__0_0.shard": 100}}, "replicas": {}}
    node1_lost = {"committed": [], "own": {}, "replicas": {}}  # node 1 came back empty
    assert readable([node0, node1_lost]) == {}
    assert unheld([node0, node1_lost]) == {"s1": ((2.0, 1, 150), ["__1_0.shard"])}  # what is missing
    node2 = {"committed": [], "own": {}, "replicas": {"node1": {"s1": {"__1_0.shard": 50}}}}
    assert readable([node0, node1_lost, node2]) == {"s1": (2.0, 1, 150)}
    short = {"committed": [], "own": {}, "replicas": {"node1": {"s1": {"__1_0.shard": 49}}}}
    assert readable([node0, short]) == {}  # a truncated replica does not count
    assert readable([node1_lost, node2]) == {}  # no manifest anywhere


def test_a_copy_prepared_for_a_commit_counts_only_for_the_same_save():
    """Node 1 prepared s1 and its commit never arrived; node 0 committed it. Node 1's files count as
    held (the repair commits them) if they are of the save node 0 committed, by its commit time."""
    listed = {"__0_0.shard": 100, "__1_0.shard": 50}
    node0 = {"committed": [["s1", 2.0, 1, 150, listed]], "own": {"s1": {"__0_0.shard": 100}}, "replicas": {}}
    node1 = {"committed": [], "own": {}, "replicas": {}, "prepared": {"s1": [2.0, {"__1_0.shard": 50}]}}
    assert readable([node0, node1]) == {"s1": (2.0, 1, 150)}
    older = {**node1, "prepared": {"s1": [1.0, {"__1_0.shard": 50}]}}  # an earlier save under the id
    assert unheld([node0, older]) == {"s1": ((2.0, 1, 150), ["__1_0.shard"])}


def test_files_of_a_node_that_left_go_to_the_node_keeping_most_of_their_replicas():
    listed = {"__0_0.shard": 10, "__1_0.shard": 20, "__1_1.shard": 5, "__2_0.shard": 30}
    rec = ["s1", 2.0, 1, 65, listed]

    def node(own: dict, replicas: dict, committed: bool = True) -> dict:
        return {"committed": [rec] if committed else [], "own": {"s1": own}, "replicas": replicas}

    # rank 1's node left; rank 2's own copy is on node 2; node 1 keeps both of rank 1's files, node 0 one
    node0 = node({"__0_0.shard": 10}, {"node1": {"s1": {"__1_0.shard": 20}}})
    node1 = node({"__2_0.shard": 30}, {"node9": {"s1": {"__1_0.shard": 20, "__1_1.shard": 5}}})
    assert orphans("s1", {0: node0, 1: node1}, {}) == {1: {"__1_0.shard": "node9", "__1_1.shard": "node9"}}
    # equal counts: the lowest node; a truncated replica does not count
    node1 = node({"__2_0.shard": 30}, {"node9": {"s1": {"__1_0.shard": 20, "__1_1.shard": 4}}})
    assert orphans("s1", {0: node0, 1: node1}, {}) == {0: {"__1_0.shard": "node1"}}
    # a node about to restore its copy (ranks 1 and 2 in the new job) holds rank 1: nothing to take over
    assert orphans("s1", {0: node0, 1: node1}, {1: range(1, 3)}) == {}
    # node 2 left; node 0 lacks the checkpoint (deleted or evicted there) but keeps node 2's replicas
    # (received after that), node 1 keeps node 0's
    node0 = node({}, {"node2": {"s1": {"__2_0.shard": 30}}}, committed=False)
    node1 = node({"__1_0.shard": 20, "__1_1.shard": 5}, {"node0": {"s1": {"__0_0.shard": 10}}})
    # not restoring it: node 0 takes nothing over (node 1 takes rank 0's files, left by no one then)
    assert orphans("s1", {0: node0, 1: node1}, {}) == {1: {"__0_0.shard": "node0"}}
    # restoring it (rank 0): node 0 takes over rank 2's files once its restore commits the checkpoint
    assert orphans("s1", {0: node0, 1: node1}, {0: range(1)}) == {0: {"__2_0.shard": "node2"}}
    # a take-over killed midway: node 0 moved one of rank 1's files into its copy, not the other
    node0 = node({"__0_0.shard": 10, "__1_0.shard": 20}, {"node1": {"s1": {"__1_1.shard": 5}}})
    node1 = node({"__2_0.shard": 30}, {"node0": {"s1": {"__0_0.shard": 10}}})
    assert orphans("s1", {0: node0, 1: node1}, {}) == {0: {"__1_1.shard": "node1"}}


def test_take_over_moves_replicas_into_the_checkpoint_where_the_persister_uploads_them(store):
    save(store, "s1")
    rdir = store.layout.replica_dir("node1", "s1")
    rdir.mkdir(parents=True)
    (rdir / "__1_0.shard").write_bytes(b"x" * 10)
    moved = take_over(store.layout, "s1", {"__1_0.shard": "node1", "__1_1.shard": "node1"})
    assert moved == ["__1_0.shard"]  # one not kept here is skipped
    assert (store.layout.checkpoint_dir("s1") / "__1_0.shard").read_bytes() == b"x" * 10
    assert not (rdir / "__1_0.shard").exists()  # moved: no memory added
    assert node_share(store.layout.checkpoint_dir("s1"), ["__1_0.shard", "__1_1.shard"]) == {
        "__1_0.shard",
        "__1_1.shard",
    }
    store.delete("s1")  # with the replicas it kept of it
    rdir.mkdir(parents=True)
    (rdir / "__1_1.shard").write_bytes(b"y")
    assert take_over(store.layout, "s1", {"__1_1.shard": "node1"}) == []  # the checkpoint is gone


def test_inventory_lists_own_files_and_replicas(store):
    save(store, "s1")
    rdir = store.layout.replica_dir("node1", "s1")
    rdir.mkdir(parents=True)
    (rdir / "__1_0.shard").write_bytes(b"x" * 10)
    in_flight = part_name("__1_1.shard", liveness.own_token(store.layout), "abcdef12")
    (rdir / in_flight).write_bytes(b"partial")  # a transfer in flight: not held
    inv = inventory(store.layout, "s3://b/run")
    ((cid, _, seq, _, listed),) = inv["committed"]
    assert (cid, seq) == ("s1", 1) and set(listed) == set(inv["own"]["s1"])
    assert inv["replicas"] == {"node1": {"s1": {"__1_0.shard": 10}}}
    assert inv["owed"] == []
    catalog.hold(store.layout, "s1", target_key("s3://b/run"))  # owed to persistent storage: others learn it
    assert inventory(store.layout, "s3://b/run")["owed"] == ["s1"]
    # owed to another target (an earlier run's persist_to): not this job's to restore and upload
    assert inventory(store.layout, "s3://b/other")["owed"] == inventory(store.layout, None)["owed"] == []


def test_resync_acknowledges_what_the_target_holds_and_owes_what_it_lost(store):
    save(store, "s1")
    layout, peers = store.layout, two_node_peers()
    files = node_files(layout, "s1")
    assert files
    held = {1: {"committed": [], "own": {}, "replicas": {"node0": {"s1": dict(files)}}}}
    assert resync(layout, peers, held) == []
    records = ReplicaRecords(layout, "s1")
    assert records.done_files(to(1)) == set(files) and not records.owed()

    lost_one = dict(files)
    lost_name = sorted(lost_one)[0]
    del lost_one[lost_name]
    assert resync(
        layout, peers, {1: {"committed": [], "own": {}, "replicas": {"node0": {"s1": lost_one}}}}
    ) == ["s1"]
    assert records.missing(files, 1) == {lost_name}
    assert REPLICA_HOLD in catalog.holds(layout, "s1")  # kept in memory until sent again
    assert catalog.evict(layout, keep=0) == [] and store.list_checkpoints() == ["s1"]
    assert resync(layout, peers, {}) == []  # a target that reported nothing: records left alone
    assert records.missing(files, 1) == {lost_name}


def test_commit_that_cannot_reach_a_node_fails_the_save_and_keeps_the_previous(store):
    save(store, "s1")
    with socket.socket() as s:  # a port nothing listens on: the other node's server is unreachable
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Fault injection: this single-process store is told it is node 0 of a 2-node job whose node 1 is
    # unreachable (no real second node can be made unreachable at exactly the commit in one process).
    store._peers = two_node_peers(port)
    with pytest.raises(CheckpointException) as e:  # DCP wraps the coordinator's error
        save(store, "s2")
    (cause,) = [f[0] if isinstance(f, tuple) else f for f in e.value.failures.values()]
    assert isinstance(cause, CommitError)
    assert "'s2' was not committed: 1 of 1 other node(s) did not take it: node 1" in str(cause)
    store._peers = None
    assert store.list_checkpoints() == ["s1"] and store.latest_checkpoint() == "s1"
    assert not store.layout.checkpoint_dir("s2").exists()
    save(store, "s2")  # once the node is back, the same id saves
    assert store.list_checkpoints() == ["s1", "s2"]


def test_replication_options_checked_before_anything(shm_dir):
    with pytest.raises(ValueError, match="transport must be one of"):
        MemStore(shm_dir, "j", transport="udp")
    with pytest.raises(ValueError, match="replicas must be an int >= 0"):
        MemStore(shm_dir, "j", replicas=-1)
    with pytest.raises(ValueError, match="replication_timeout_s must be > 0"):
        MemStore(shm_dir, "j", replication_timeout_s=0)
    with pytest.raises(ValueError, match="at least 16"):
        MemStore(shm_dir, "j", replication_secret="short")
    assert not (shm_dir / "j").exists()


def test_a_node_refuses_to_prepare_a_commit_whose_manifest_arrived_damaged(store):
    """The peer server's commit handler on a node other than the coordinator's: a manifest damaged on
    the way (or by the coordinator's memory) is refused naming it, and nothing is stored."""
    save(store, "s1")
    manifest = Manifest.read(store.layout.checkpoint_dir("s1") / MANIFEST)
    manifest.checkpoint_id = "s2"
    catalog.begin(store.layout, "s2")  # a rank of this node wrote part of s2
    record = {"seq": 2, "committed_at": 1.0, "nbytes": manifest.nbytes}
    damaged = bytearray(manifest.encode())
    damaged[len(damaged) // 2] ^= 0x04
    with pytest.raises(
        ValueError, match="the manifest of checkpoint 's2' from the coordinator: the manifest is corrupt"
    ):
        store._commit_here("s2", "prepare", record, bytes(damaged))
    assert not (store.layout.checkpoint_dir("s2") / MANIFEST).exists()
    store._commit_here("s2", "prepare", record, manifest.encode())
    assert Manifest.read(store.layout.checkpoint_dir("s2") / MANIFEST) == manifest
