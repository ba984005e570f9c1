"""Megatron-Core saves through ``MemStoreSaveStrategy`` on two real "nodes" (network namespaces, each with
its own tmpfs store root), one rank each, torchrun across them (see mn_megatron_worker.py).

A Megatron save leaves each rank's write results in a record in the checkpoint's directory in the store
until its finalize step. When an attempt is never finalized (the queue closed with ``abort=True``), a
later attempt at the same id finds that directory on every node but the coordinator's, whose planning
discards it on its own node only. The later attempt must not take the earlier attempt's record for its
own: where its own write died, that would commit the earlier attempt's files as this one's.
"""

from __future__ import annotations

import pytest

from tests.multinode.test_mn_replication import REPO, finish, launch, of

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "multinode" / "mn_megatron_worker.py"
CKPT = "iter_0000010"


def test_retry_after_an_unfinalized_attempt_uses_only_its_own_results(cluster2, tmp_path):
    """Attempt 1 is written on both nodes and never finalized; attempt 2 at the same id, whose writer on
    node 1 is SIGKILLed before it leaves its results, fails on every rank and commits nothing (before,
    node 1 read attempt 1's record as attempt 2's and the coordinator committed it); attempt 3 commits and
    loads back bit for bit on both nodes."""
    ckpts = tmp_path / "ckpts"
    (ckpts / CKPT).mkdir(parents=True)
    procs = launch(cluster2, [0, 1], [ckpts], tmp_path, script=WORKER)
    nodes = finish(procs, [0, 1], tmp_path)
    (aborted,) = of(nodes[1], "aborted")  # what the first attempt left where nothing discards it
    assert any(f.startswith("megatron-results-r1") for f in aborted["files"]), aborted
    for evs in nodes:
        (retried,) = of(evs, "retried")
        assert retried["error"] is not None and "did not run to its end" in retried["error"], retried
        assert "rank 1 has no results" in retried["error"], retried
        assert retried["committed"] == [], retried
        (loaded,) = of(evs, "loaded")
        assert loaded["ok"] is True, loaded
