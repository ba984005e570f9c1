"""Reading files from other nodes' memory, with real peer servers on 127.0.0.1: what a load says when no
node's copy of a file is intact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_memstore import MemoryStorageReader
from dcp_memstore.replication.peers import Peers
from dcp_memstore.replication.placement import NodeInfo
from dcp_memstore.replication.server import PeerServer
from dcp_memstore.store.layout import StoreLayout
from tests.replication.test_recovery import SECRET, save


def flipped(data: bytes, offset: int = 100) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x10]) + data[offset + 1 :]


def test_a_file_corrupt_here_and_in_every_other_copy_is_reported_corrupt_not_missing(store, shm_dir):
    """This node's copy of a shard file fails its checksum, and so does the replica node 1 keeps of it
    (fetched, then checked): the load fails naming the checksum mismatch of this node's copy, not saying
    the file is in no tier (which sends the user looking for a deleted file)."""
    save(store, "s1")
    shard = store.layout.checkpoint_dir("s1") / "__0_0.shard"
    damaged = flipped(shard.read_bytes())
    shard.write_bytes(damaged)
    node1 = StoreLayout(shm_dir / "node1", "job")
    node1.replica_dir("node0", "s1").mkdir(parents=True)
    (node1.replica_dir("node0", "s1") / shard.name).write_bytes(damaged)
    with (
        PeerServer(store.layout, "job", SECRET, "127.0.0.1") as server0,
        PeerServer(node1, "job", SECRET, "127.0.0.1") as server1,
    ):
        # Fault injection: this single-process store is told it is node 0 of a 2-node job whose node 1
        # runs the second server (one process cannot be two nodes of a torchrun job).
        node = NodeInfo(node_rank=0, nnodes=2, local_rank=0, local_world_size=1, rank=0, world_size=2)
        store._peers = Peers("job", node, 1, SECRET, {0: server0.address, 1: server1.address})
        sd = {"a": torch.zeros(4096), "b": torch.zeros(3, 5), "n": 0}
        with pytest.raises(CheckpointException) as e:
            dcp.load(sd, checkpoint_id="s1", storage_reader=MemoryStorageReader(store), no_dist=True)
        store._peers = None
    msg = str(e.value)
    fetched = store.layout.fetched_dir("s1") / shard.name  # node 1's replica, checked here
    assert "CorruptShardError: no intact copy of file __0_0.shard of checkpoint 's1': " in msg
    assert f"checksum mismatch in {shard} for item a" in msg
    assert f"checksum mismatch in {fetched} for item a" in msg
    assert "in no tier" not in msg
