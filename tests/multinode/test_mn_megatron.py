"""Megatron-Core saves through ``MemStoreSaveStrategy`` on two real "nodes" (network namespaces, each with
its own tmpfs store root), one rank each, torchrun across them (see mn_megatron_worker.py).

Between a save's write, in Megatron's forked worker, and its finalize step, in the trainer, the
checkpoint's directory on each node holds what was written there, uncommitted. A process that opens the
store on a node clears the directories of saves whose process died; the directory of a save still on its
way to its finalize step is not one of them, while one whose trainer ended before finalizing it is.

A Megatron save leaves each rank's write results in a record in the checkpoint's directory in the store
until its finalize step. When an attempt is never finalized (the queue closed with ``abort=True``), a
later attempt at the same id finds that directory on every node but the coordinator's, whose planning
discards it on its own node only. The later attempt must not take the earlier attempt's record for its
own: where its own write died, that would commit the earlier attempt's files as this one's.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.multinode.test_mn_replication import JOB, REPO, finish, launch, of

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

from tests.multinode.mn_megatron_worker import OPEN_STORE, UNFINALIZED  # noqa: E402

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


def test_a_store_opened_on_a_node_keeps_a_save_waiting_for_finalize_and_clears_an_abandoned_one(
    cluster2, tmp_path
):
    """Another process opens the store on node 1 after Megatron's forked workers wrote a save and before
    it is finalized: the save's directory there stays, and the save commits and loads back bit for bit on
    both nodes (before, the directory was cleared as a dead process's and finalizing raised on every rank
    that rank 1 had no results). The directories of a save the job ended without finalizing are cleared
    by the next store opened on each node."""
    ckpts = tmp_path / "ckpts"
    for name in (CKPT, UNFINALIZED):
        (ckpts / name).mkdir(parents=True)
    nodes = finish(launch(cluster2, [0, 1], [ckpts, "opened"], tmp_path, script=WORKER), [0, 1], tmp_path)
    for evs in nodes:
        (finalized,) = of(evs, "finalized")
        assert finalized["error"] is None and finalized["committed"] == [CKPT], finalized
        (loaded,) = of(evs, "loaded")
        assert loaded["ok"] is True, loaded
        (unfinalized,) = of(evs, "unfinalized")
        assert any(f.startswith("megatron-results-r") for f in unfinalized["files"]), unfinalized
    (opened,) = of(nodes[1], "opened")  # what the finalize step found there
    assert any(f.startswith("megatron-results-r1") for f in opened["files"] or []), opened
    for i in (0, 1):
        node = cluster2.node(i)
        env = node.env({"PYTHONPATH": str(REPO), "DCP_MEMSTORE_JOB_ID": JOB})
        node.run([sys.executable, "-c", OPEN_STORE], timeout=60, env=env, check=True)
        assert sorted(os.listdir(node.root / JOB / "checkpoints")) == [CKPT], i
