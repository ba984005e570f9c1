"""The replicator against a real peer server on 127.0.0.1: what it records as replicated is what the
peer holds of the save that is committed now."""

from __future__ import annotations

import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import Event, MemoryStorageWriter
from dcp_memstore.replication.replicator import ReplicaRecords, Replicator
from dcp_memstore.replication.server import PeerServer
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.store import events
from dcp_memstore.store.layout import StoreLayout
from tests.replication.test_recovery import SECRET, two_node_peers


def save(store, cid: str, value: float) -> None:
    """A checkpoint of two shard files (the store has two io threads) whose bytes depend on ``value``."""
    sd = {"a": torch.full((64 * 1024,), value), "b": torch.full((32 * 1024,), -value)}
    dcp.save(sd, checkpoint_id=cid, storage_writer=MemoryStorageWriter(store), no_dist=True)


def test_a_transfer_that_ends_after_its_checkpoint_was_saved_again_does_not_count_for_the_new_save(
    store, shm_dir
):
    """Step-1 is deleted and saved again under its id (other values) while the replicator is sending one
    of the first save's files: that file must be sent again for the new save, which is replicated only
    once the peer holds the new save's bytes of every file."""
    layout, cid = store.layout, "step-1"
    save(store, cid, 1.0)
    ReplicaRecords(layout, cid).hold()  # as a commit on a node of a multi-node job places it

    sent: list[str] = []

    class SavedAgainDuringTheFirstTransfer(TcpTransport):
        """A real TCP transport. The interleaving is forced (fault injection): right after the peer has
        stored the first file, the user deletes step-1 and saves it again (with real processes the
        transfer only has to be in flight across the delete and the new save, which timing decides)."""

        def put_file(self, *args, **kwargs) -> None:
            super().put_file(*args, **kwargs)
            sent.append(args[3])
            if len(sent) == 1:
                store.delete(cid)
                save(store, cid, 2.0)
                ReplicaRecords(layout, cid).hold()

    with (
        PeerServer(shm_dir / "node1", "job", SECRET, "127.0.0.1", io_timeout_s=10) as server,
        SavedAgainDuringTheFirstTransfer("job", SECRET, timeout_s=10) as transport,
    ):
        peers = two_node_peers(server.address[1])
        replicator = Replicator(layout, lambda: peers, transport, keep=2, control=transport)
        try:
            # Until the new save's files are sent: between the delete and the new save's hold nothing is
            # owed. The replicator runs at a lower CPU priority and makes the new save in its own thread,
            # which a machine busy with other work slows down.
            deadline = time.monotonic() + 120
            while (len(sent) < 3 or ReplicaRecords(layout, cid).owed()) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            replicator.close(10)
        assert not ReplicaRecords(layout, cid).owed(), "the new save was never replicated"
        own = {p.name: p.read_bytes() for p in layout.checkpoint_dir(cid).glob("__*")}
        replica = StoreLayout(shm_dir / "node1", "job").replica_dir("node0", cid)
        held = {p.name: p.read_bytes() for p in replica.glob("__*")}
        assert {f: held.get(f) == data for f, data in own.items()} == dict.fromkeys(own, True)
        assert sorted(own) == ["__0_0.shard", "__0_1.shard"] and len(sent) == 3  # one sent twice


def test_replication_reports_the_bytes_sent_to_each_peer_and_failures_with_the_retry(store, shm_dir):
    """A ``replicate`` event per checkpoint and peer node: the bytes of this node's files, and what is
    still owed. A peer that refuses connections (its server stopped) is a failed event with the delay
    before the next attempt."""
    seen: list[Event] = []
    events.listen(store.layout, seen.append)
    try:
        with PeerServer(shm_dir / "node1", "job", SECRET, "127.0.0.1", io_timeout_s=10) as server:
            port = server.address[1]
            with TcpTransport("job", SECRET, timeout_s=10) as transport:
                save(store, "step-1", 1.0)
                ReplicaRecords(store.layout, "step-1").hold()
                peers = two_node_peers(port)
                replicator = Replicator(store.layout, lambda: peers, transport, keep=2, control=transport)
                try:
                    _wait_until(lambda: any(e.phase == "replicate" for e in seen))
                finally:
                    replicator.close(10)
        files = store.layout.checkpoint_dir("step-1").glob("__*")
        (sent,) = [e for e in seen if e.phase == "replicate"]
        assert (sent.checkpoint_id, sent.ok, sent.target, sent.owed) == ("step-1", True, "node1", ())
        assert sent.nbytes == sum(f.stat().st_size for f in files) > 0

        seen.clear()  # the server is stopped now: its port refuses connections
        save(store, "step-2", 2.0)
        ReplicaRecords(store.layout, "step-2").hold()
        with TcpTransport("job", SECRET, timeout_s=10) as transport:
            replicator = Replicator(store.layout, lambda: peers, transport, keep=2, control=transport)
            try:
                _wait_until(lambda: any(e.phase == "replicate" for e in seen))
            finally:
                replicator.close(10)
        failed = next(e for e in seen if e.phase == "replicate")
        assert (failed.checkpoint_id, failed.ok, failed.target, failed.nbytes) == (
            "step-2",
            False,
            "node1",
            0,
        )
        assert failed.retry_s > 0 and failed.error
    finally:
        events.unlisten(store.layout, seen.append)


def _wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
