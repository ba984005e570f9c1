"""The safe point's retention rules on one store (real checkpoints on /dev/shm, reports recorded as the
peer server records them): which checkpoints it keeps, that it lets the old one go, that a store without
replication ignores what a multi-node run left, and that a full memory says what replication keeps. The
rule across real nodes is in tests/multinode/test_mn_safe_point.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemoryStorageWriter, MemStore
from dcp_memstore.replication import safe_point
from dcp_memstore.replication.replicator import ReplicaRecords
from dcp_memstore.store import catalog
from tests.replication.test_replicator import save


def dcp_save(store: MemStore, sd: dict, cid: str) -> None:
    dcp.save(sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True)


def replicated_here(layout, cid: str) -> float:
    """What the replicator does once this node's (node0's) files of ``cid`` are acknowledged."""
    at = catalog.read_commit(layout, cid).committed_at
    safe_point.await_peers(layout, cid, "node0", at)
    return at


def test_the_newest_checkpoint_every_node_reported_is_kept_until_a_newer_one_is(shm_dir):
    with MemStore(root=shm_dir, job_id="job", io_threads=1, keep_in_memory=3) as store:
        layout = store.layout
        for cid in ("s1", "s2", "s3"):
            save(store, cid, 1.0)
        at = {cid: replicated_here(layout, cid) for cid in ("s1", "s2", "s3")}
        safe_point.Reports(layout, "s1").record("node1", at["s1"])
        assert safe_point.advance(layout, nnodes=2, keep=1) == "s1"
        # s2 and s3: node1's files not yet replicated; s1 is what a lost node resumes from
        assert {c: catalog.holds(layout, c) for c in store.list_checkpoints()} == {
            "s1": ["safe-point"], "s2": ["awaiting-peers"], "s3": ["awaiting-peers"],
        }  # fmt: skip

        safe_point.Reports(layout, "s2").record("node1", at["s2"] - 1)  # of an earlier save of s2
        assert safe_point.advance(layout, nnodes=2, keep=1) == "s1"
        safe_point.Reports(layout, "s3").record("node1", at["s3"])
        assert safe_point.advance(layout, nnodes=2, keep=1) == "s3"
        assert store.list_checkpoints() == ["s3"]  # s1 and s2 evicted: the old safe point is let go
        assert catalog.holds(layout, "s3") == ["safe-point"]

        store.delete("s3")  # the user can still delete it
        assert store.list_checkpoints() == [] and safe_point.advance(layout, nnodes=2, keep=1) is None


def test_a_store_without_replication_evicts_what_a_multi_node_run_held_as_its_safe_point(shm_dir):
    """A job restarted on one node: no report will ever move the safe point, so its holds don't count."""
    with MemStore(root=shm_dir, job_id="job", io_threads=1, keep_in_memory=1) as store:
        save(store, "s1", 1.0)
        catalog.hold(store.layout, "s1", "safe-point")  # as the multi-node run left it
        save(store, "s2", 2.0)
        assert store.list_checkpoints() == ["s2"]


def test_a_store_without_replication_evicts_what_a_multi_node_run_left_to_replicate(shm_dir):
    """A job restarted on one node after a multi-node run was killed while replicating s1: nothing will
    ever send s1's replicas, so its replicate hold does not count."""
    with MemStore(root=shm_dir, job_id="job", io_threads=1, keep_in_memory=1) as store:
        save(store, "s1", 1.0)
        ReplicaRecords(store.layout, "s1").hold()  # as the multi-node run left it
        save(store, "s2", 2.0)
        assert store.list_checkpoints() == ["s2"]


def test_memory_full_of_checkpoints_kept_for_replication_is_a_clear_error(small_tmpfs, monkeypatch):
    """Checkpoints kept for replication are never evicted to make room: the save fails naming them."""
    sd = {"w": torch.randn(512, 1024)}  # 2 MiB per checkpoint in an 8 MiB tmpfs
    with MemStore(root=small_tmpfs, job_id="job", io_threads=1, keep_in_memory=1) as store:
        # stands for a job of several nodes (one process here): a store that does not replicate ignores
        # replication holds
        monkeypatch.setattr(store, "_replicating", lambda: True)
        saved = []
        with pytest.raises(BaseException) as ei:  # noqa: B017 - DCP wraps it
            for i in range(5):
                dcp_save(store, sd, f"s{i}")
                ReplicaRecords(store.layout, f"s{i}").hold()  # a peer that does not take replicas
                saved.append(f"s{i}")
        assert "kept in memory for replication" in str(ei.value)
        assert f"{saved[0]!r}: ['replicate']" in str(ei.value)
        assert store.list_checkpoints() == saved and len(saved) >= 2


def test_a_report_that_arrives_before_the_service_is_the_stores_is_recorded(shm_dir):
    """A node's server answers once it has announced itself, which is before the service that runs it is
    the store's: a peer's ``replicated`` report landing in that gap was refused (the handler asked the
    store's service, None then, how many nodes the job has), and the peer only retried it later. The
    handler is called here as the server calls it in that gap (the gap itself cannot be timed from
    outside)."""
    with MemStore(root=shm_dir, job_id="job", io_threads=1, keep_in_memory=3) as store:
        save(store, "s1", 1.0)
        at = replicated_here(store.layout, "s1")
        assert store._service is None
        store._replicated_elsewhere("s1", "node1", at, nnodes=2)
        assert safe_point.Reports(store.layout, "s1").reporters(at) == {"node0", "node1"}
