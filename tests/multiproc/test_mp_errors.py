"""Errors across gloo ranks: DCP pickles a failing rank's exception and raises it on every rank, so each
of our exceptions has to survive pickling with its message."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mp_harness import make_tensor

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore

pytestmark = pytest.mark.slow


def load_corrupt(rank: int, world: int, root: str) -> str:
    """Save on every rank, flip the first byte of rank 1's shard files, load: what every rank raises."""
    store = MemStore(root, "job")
    state = {f"rank{rank}": make_tensor(rank + 1, (64, 64), torch.float32)}
    dcp.save(state, checkpoint_id="c", storage_writer=MemoryStorageWriter(store))
    dist.barrier()
    if rank == 0:
        for shard in store.layout.checkpoint_dir("c").glob("__1_*.shard"):
            with open(shard, "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 0xFF]))
    dist.barrier()
    try:
        dcp.load(
            {f"rank{rank}": torch.zeros(64, 64)}, checkpoint_id="c", storage_reader=MemoryStorageReader(store)
        )
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_checksum_mismatch_on_one_rank_reaches_every_rank_with_its_message(mp) -> None:
    for rank, error in enumerate(mp.run(load_corrupt, 2, str(mp.root))):
        assert "checksum mismatch in" in error and "__1_" in error and "rank1" in error, (rank, error)
        assert "TypeError" not in error, (rank, error)
