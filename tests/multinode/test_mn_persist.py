"""Persistence across real "nodes" (network namespaces, each with its own tmpfs root) to a directory all
of them share: each node uploads the files its ranks wrote, and the checkpoint is published once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.multinode.mn_worker import global_weight
from tests.multinode.test_mn_replication import of, run_job

pytestmark = pytest.mark.slow


def test_two_nodes_persist_to_a_shared_directory_that_stock_dcp_loads(cluster2, tmp_path):
    shared = tmp_path / "persisted"
    saved = run_job(
        cluster2, [0, 1], ["save", "--steps", 1, "--mib", 2, "--persist-to", shared], tmp_path, nproc=2
    )
    for evs in saved:
        assert [e["url"] for e in of(evs, "persisted")] == [f"{shared}/step-1"] * 2  # one per rank
    # each node counts (and uploaded) its own files: together, every file of the checkpoint
    counts = [of(evs, "persisted")[0]["files"] for evs in saved]
    assert all(uploaded == total > 0 for uploaded, total in counts), counts
    assert sum(total for _, total in counts) == len(list((shared / "step-1").glob("*.distcp")))
    out = {"w": torch.zeros(2 * 256, 1024), "bias": torch.zeros(1000, dtype=torch.float64), "step": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shared / "step-1")), no_dist=True)
    assert torch.equal(out["w"], global_weight(1, 2))
    assert torch.equal(out["bias"], torch.arange(1000, dtype=torch.float64)) and out["step"] == 1
