"""The safe point across real "nodes" (network namespaces, each with its own tmpfs root): with
``keep_in_memory=1``, the newest checkpoint replicated on every node stays in every node's memory while a
newer one still lacks replicas, so losing a node then still leaves a checkpoint to resume from; once the
newer one is replicated everywhere, the old one goes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multinode.test_mn_replication import (
    JOB,
    TIMEOUT_S,
    checkpoint_files,
    finish,
    launch,
    of,
    replica_files,
    run_job,
    wait_line,
)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _throttled(node) -> Iterator[None]:
    """``node``'s uplink at 8 Mbit/s for the block: replication slow enough to be cut off midway."""
    node.run(["tc", "qdisc", "replace", "dev", node.ifname, "root", "tbf", "rate", "8mbit", "burst", "32kbit",
              "latency", "400ms"], timeout=10, check=True)  # fmt: skip
    try:
        yield
    finally:
        node.run(["tc", "qdisc", "del", "dev", node.ifname, "root"], timeout=10)


def _cut_off_and_kill(cluster, hanging_logs: list[Path]) -> None:
    """Once each of ``hanging_logs`` says its node's save hangs, take node 1's link down and SIGKILL every
    process of both nodes (the link comes up again after)."""
    n0, n1 = cluster.node(0), cluster.node(1)
    try:
        for log in hanging_logs:
            wait_line(log, '"hanging"', TIMEOUT_S)
        n1.link_down()
        for n in (n0, n1):
            n.kill()
    finally:
        n1.link_up()


def test_a_node_lost_while_the_newest_checkpoint_lacks_its_replicas_resumes_from_the_safe_point(
    cluster2, tmp_path
):
    """keep_in_memory=1. Step 1 is replicated on both nodes; node 1's uplink is throttled, step 2 commits
    and node 1's files of it are still on their way to node 0 when node 1's link goes down and every
    process is SIGKILLed; node 1 comes back with an empty tmpfs. Step 1 was kept on both nodes (it is the
    last checkpoint every node's files are replicated of), so the restarted job resumes from it, restored
    on node 1 from node 0's memory, bit for bit."""
    n0, n1 = cluster2.node(0), cluster2.node(1)
    args = ["save", "--steps", 2, "--keep", 1, "--mib", 24, "--gate", 1, "--hang", "--tmp", tmp_path]
    procs = launch(cluster2, [0, 1], args, tmp_path)
    for i in (0, 1):
        wait_line(tmp_path / f"node{i}.log", '"gate"', TIMEOUT_S)
    step1 = [checkpoint_files(n.root, "step-1") for n in (n0, n1)]
    with _throttled(n1):
        (tmp_path / "go").write_text("")
        _cut_off_and_kill(cluster2, [tmp_path / f"node{i}.log" for i in (0, 1)])  # step 2 of node 1 half sent
    for p in procs:
        p.wait(10)
    step2_of_node1 = checkpoint_files(n1.root, "step-2")
    assert step2_of_node1 and replica_files(n0.root, "node1", "step-2") != step2_of_node1
    for n, files in zip((n0, n1), step1, strict=True):  # kept past keep_in_memory=1
        assert checkpoint_files(n.root, "step-1") == files
    assert replica_files(n0.root, "node1", "step-1") == step1[1]

    n1.wipe_root()  # node 1 is replaced by an empty machine
    loaded = run_job(cluster2, [0, 1], ["load", "--keep", 1, "--mib", 24], tmp_path)
    for evs in loaded:
        assert of(evs, "latest")[0]["checkpoint"] == "step-1"
        assert of(evs, "loaded")[0] == {**of(evs, "loaded")[0], "checkpoint": "step-1", "ok": True}
    assert checkpoint_files(n1.root, "step-1") == step1[1]


def test_the_old_safe_point_is_evicted_once_a_newer_checkpoint_is_replicated_on_every_node(
    cluster3, tmp_path
):
    """keep_in_memory=1 on three nodes (node i's files go to node i+1, so a node learns that node i+1's
    files are replicated only from node i+1's report): once the newest step is replicated on every
    node, every node keeps that step alone, held as the safe point, and the replicas of the older steps
    are gone with them: memory stays bounded."""
    args = ["save", "--steps", 3, "--keep", 1, "--wait-replicated", "--settle", "--tmp", tmp_path]
    saved = finish(launch(cluster3, [0, 1, 2], args, tmp_path), [0, 1, 2], tmp_path)
    for evs in saved:
        (settled,) = of(evs, "settled")
        assert settled["listed"] == ["step-3"] and settled["holds"] == {"step-3": ["safe-point"]}, settled
    for i in range(3):
        kept = cluster3.node((i + 1) % 3).root / JOB / "replicas" / f"node{i}"
        assert sorted(p.name for p in kept.iterdir()) == ["step-3"]


def test_replication_holds_of_a_killed_multi_node_run_do_not_pin_checkpoints_on_one_node(cluster2, tmp_path):
    """Every process of a two-node job is SIGKILLed while step 1 is still being replicated: it keeps
    its replication hold on node 0. The job restarts on node 0 alone, where nothing replicates and no
    peer will ever acknowledge step 1: retention evicts it like any other checkpoint beyond
    keep_in_memory instead of keeping it in memory for good."""
    n0 = cluster2.node(0)
    with _throttled(n0):
        procs = launch(
            cluster2, [0, 1], ["save", "--steps", 1, "--mib", 24, "--hang", "--tmp", tmp_path], tmp_path
        )
        _cut_off_and_kill(cluster2, [tmp_path / "node0.log"])  # node 0's files of step 1 never reach node 1
    for p in procs:
        p.wait(10)
    step1 = n0.root / JOB / "checkpoints" / "step-1"
    assert "replicate" in [p.name for p in (step1 / "holds").iterdir()]

    (evs,) = run_job(cluster2, [0], ["save", "--first", 2, "--steps", 2, "--keep", 1, "--settle"], tmp_path)
    (settled,) = of(evs, "settled")
    assert settled == {**settled, "listed": ["step-3"], "holds": {"step-3": []}}, settled
    assert not step1.exists()
