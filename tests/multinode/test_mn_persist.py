"""Persistence across real "nodes" (network namespaces, each with its own tmpfs root) to a directory all
of them share: each node uploads the files its ranks wrote, and the checkpoint is published once."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.multinode.mn_worker import global_weight, wait_for
from tests.multinode.test_mn_replication import (
    JOB,
    TIMEOUT_S,
    events,
    finish,
    launch,
    of,
    run_job,
    wait_line,
)

pytestmark = pytest.mark.slow


def target_down(shared: Path) -> None:
    """Make the shared directory unreadable: a symlink to itself, so every read fails with ELOOP, an error
    the persister retries (as a hung mount or an S3 endpoint that is down; the nodes cannot reach the
    tests' S3 server from their namespaces, and root reads a directory whatever its mode)."""
    shared.rename(shared.with_name(shared.name + ".away"))
    shared.symlink_to(shared)


def target_up(shared: Path) -> None:
    """Undo ``target_down``."""
    shared.unlink()
    shared.with_name(shared.name + ".away").rename(shared)


def loaded_and_persisted(evs: list[dict], latest: str | None = None) -> dict:
    """The ``persist`` event of one node's ``load`` run, after checking that it resumed from ``latest``
    (if given), loaded bit-exact, and saw the checkpoint persisted while it was in its memory."""
    if latest is not None:
        assert of(evs, "latest")[0]["checkpoint"] == latest
    assert of(evs, "loaded")[0]["ok"] is True
    (persist,) = of(evs, "persist")
    assert persist == {**persist, "outcome": "persisted", "in_memory": True}, persist
    return persist


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


def save_and_lose_node1_before_its_upload(cluster, tmp_path, shared, replicas: int, wiped: bool = True):
    """Steps 1 and 2 saved by every node of ``cluster`` (replicated, with ``replicas``); step 1 owed to
    ``shared``, node 0's share of it uploaded, the other nodes' not; then every node is SIGKILLed and
    (``wiped``) node 1 comes back with an empty tmpfs."""
    args = ["save", "--steps", 2, "--mib", 2, "--replicas", replicas, "--persist-to", shared,
            "--persist-every", 0, "--owe", 1, "--tmp", tmp_path, "--serve-until", "never"]  # fmt: skip
    nodes = list(range(cluster.n))
    procs = launch(cluster, nodes, args + (["--wait-replicated"] if replicas else []), tmp_path)
    wait_line(tmp_path / "node0.log", '"share-uploaded"', TIMEOUT_S)
    for i in nodes[1:]:
        wait_line(tmp_path / f"node{i}.log", '"serving"', TIMEOUT_S)
    for i in nodes:
        cluster.node(i).kill()
    for p in procs:
        p.wait(30)
    parts = shared / "step-1" / ".dcp_memstore" / "parts"
    names = [p.name for p in parts.iterdir()]
    assert names and all(n.startswith("__0_") for n in names), names  # node 0's files only
    if wiped:
        cluster.node(1).wipe_root()


def node1_report(log1: Path, phase: str) -> dict:
    """What node 1 reported of the checkpoint it does not hold at ``phase`` (waited for)."""
    wait_line(log1, f'"phase": "{phase}"', TIMEOUT_S)
    (persist,) = [e for e in of(events(log1.read_text(errors="replace")), "persist") if e["phase"] == phase]
    assert persist["in_memory"] is False and persist["files"] == [0, 0], persist
    return persist


@pytest.mark.parametrize("wiped", [True, False], ids=["node1-replaced", "node1-never-asked"])
def test_owed_checkpoint_older_than_the_newest_is_completed_after_a_restart(cluster2, tmp_path, wiped):
    """Step 1 is owed to persistent storage and node 1 never uploaded its share: it died and came back
    empty (its files of step 1 are in the replicas node 0 keeps), or it was never asked (persist(id) on
    node 0 only). The job resumes from step 2; step 1 is still completed: node 1 restores it from the
    replicas, owes it too, uploads its share, and the checkpoint is published."""
    shared = tmp_path / "persisted"
    save_and_lose_node1_before_its_upload(cluster2, tmp_path, shared, replicas=1, wiped=wiped)
    args = ["load", "--mib", 2, "--persist-to", shared, "--persist-every", 0, "--wait-persisted", 1]
    loaded = run_job(cluster2, [0, 1], args, tmp_path)
    for evs in loaded:
        persist = loaded_and_persisted(evs, "step-2")
        assert persist["files"][0] == persist["files"][1] > 0
    assert of(loaded[1], "latest")[0]["here"] == ["step-1", "step-2"]
    out = {"w": torch.zeros(2 * 256, 1024), "bias": torch.zeros(1000, dtype=torch.float64), "step": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shared / "step-1")), no_dist=True)
    assert torch.equal(out["w"], global_weight(1, 2)) and out["step"] == 1


def test_owed_checkpoint_whose_files_no_node_holds_is_reported(cluster2, tmp_path):
    """As above without replicas: node 1's files of step 1 are gone from the job's memory and were never
    uploaded, so step 1 can never be published. Node 0 says so (a WARNING naming the checkpoint and the
    files) and its status is failed with that reason, instead of holding it silently."""
    shared = tmp_path / "persisted"
    save_and_lose_node1_before_its_upload(cluster2, tmp_path, shared, replicas=0)
    args = ["load", "--mib", 2, "--replicas", 0, "--persist-to", shared, "--persist-every", 0,
            "--wait-persisted", 1]  # fmt: skip
    loaded = run_job(cluster2, [0, 1], args, tmp_path)
    (persist,) = of(loaded[0], "persist")
    assert persist["outcome"].startswith("PersistError") and persist["state"] == "failed", persist
    assert "__1_0.shard" in persist["error"] and "held by no node" in persist["error"], persist
    assert persist["in_memory"] is True  # still held: store.delete(id) drops it
    log0 = (tmp_path / "node0.log").read_text(errors="replace")
    warning = next(line for line in log0.splitlines() if "WARNING" in line and "'step-1'" in line)
    assert "__1_0.shard" in warning


@pytest.mark.parametrize("nnodes", [2, 3])
def test_owed_files_of_a_node_that_left_the_job_are_uploaded_from_its_replicas(request, tmp_path, nnodes):
    """Step 1 is owed and only node 0 uploaded its share; the job restarts on one node fewer. The node
    that left wrote files no node of the new job holds as its own, only as replicas on node 0 (the ring:
    the last node's go to node 0): node 0 takes them over and uploads them, and step 1 is published (it
    stayed queued forever). On one node (2 -> 1) no replication runs; on two (3 -> 2) the restart's
    repair does it."""
    cluster = request.getfixturevalue(f"cluster{nnodes}")
    shared = tmp_path / "persisted"
    save_and_lose_node1_before_its_upload(cluster, tmp_path, shared, replicas=1, wiped=False)
    args = ["load", "--mib", 2, "--persist-to", shared, "--persist-every", 0, "--wait-persisted", 1]
    loaded = run_job(cluster, list(range(nnodes - 1)), args, tmp_path)
    for evs in loaded:
        loaded_and_persisted(evs)
    out = {"w": torch.zeros(2 * 256, 1024), "bias": torch.zeros(1000, dtype=torch.float64), "step": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shared / "step-1")), no_dist=True)
    assert torch.equal(out["w"], global_weight(1, 2)) and out["step"] == 1


def test_a_take_over_killed_midway_is_completed_by_the_next_restart(cluster2, tmp_path):
    """As above (2 -> 1 nodes), but the restart is SIGKILLed after node 0 has moved the first of the
    files of the rank that left from its replicas into its copy, before the others. The next restart
    moves the rest and step 1 is published. (Before, the rank counted as held by node 0 from its one
    moved file: the others stayed in the replicas, and the upload failed for good on a missing file.)"""
    shared = tmp_path / "persisted"
    save_and_lose_node1_before_its_upload(cluster2, tmp_path, shared, replicas=1, wiped=False)
    kept = cluster2.node(0).root / JOB / "replicas" / "node1" / "step-1"
    copy = cluster2.node(0).root / JOB / "checkpoints" / "step-1"
    files = len(list(kept.glob("__1_*")))
    assert files > 1  # a kill between two of them leaves one moved
    args = ["load", "--mib", 2, "--persist-to", shared, "--persist-every", 0, "--wait-persisted", 1]
    (killed,) = launch(cluster2, [0], args, tmp_path, env={0: {"DCP_MEMSTORE_CRASH_AT": "take-over"}})
    assert killed.wait(TIMEOUT_S) != 0
    assert (len(list(copy.glob("__1_*"))), len(list(kept.glob("__1_*")))) == (1, files - 1)
    (loaded,) = run_job(cluster2, [0], args, tmp_path)
    loaded_and_persisted(loaded)
    out = {"w": torch.zeros(2 * 256, 1024), "bias": torch.zeros(1000, dtype=torch.float64), "step": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shared / "step-1")), no_dist=True)
    assert torch.equal(out["w"], global_weight(1, 2)) and out["step"] == 1


def test_owed_files_kept_only_by_a_node_that_restores_the_checkpoint_are_uploaded(cluster3, tmp_path):
    """Three nodes save step 1 (replicas: node 0 -> 1 -> 2 -> 0); node 1 alone asks for the upload and
    uploads its share. Every node is SIGKILLed, and node 0 is left as a crash between the two steps of
    ``store.delete`` (or of an eviction) leaves it: its copy of step 1 renamed into the trash, the
    replicas it keeps of node 2's files still there (the state is made by hand: a kill cannot be timed
    between two renames). The job restarts on nodes 0 and 1: node 2's files are kept only by node 0,
    which restores step 1 (its own files from node 1's replicas); it takes node 2's over too, and step 1
    is published (it stayed queued forever when only nodes that had it committed took files over)."""
    shared = tmp_path / "persisted"
    args = ["save", "--steps", 1, "--mib", 24, "--persist-to", shared, "--persist-every", 0, "--owe", 1,
            "--owe-rank", 1, "--wait-replicated", "--tmp", tmp_path, "--serve-until", "never"]  # fmt: skip
    procs = launch(cluster3, [0, 1, 2], args, tmp_path)
    wait_line(tmp_path / "node1.log", '"share-uploaded"', TIMEOUT_S)
    for i in (0, 2):  # every node's replicas acknowledged
        wait_line(tmp_path / f"node{i}.log", '"serving"', TIMEOUT_S)
    for i in range(3):
        cluster3.node(i).kill()
    for p in procs:
        p.wait(30)
    job0 = cluster3.node(0).root / JOB
    (job0 / "trash").mkdir(exist_ok=True)
    (job0 / "checkpoints" / "step-1").rename(job0 / "trash" / "step-1.crashed")
    kept = sorted(f.name for f in (job0 / "replicas" / "node2" / "step-1").glob("__*"))
    assert kept and all(n.startswith("__2_") for n in kept), kept
    parts = [p.name for p in (shared / "step-1" / ".dcp_memstore" / "parts").iterdir()]
    assert parts and all(n.startswith("__1_") for n in parts), parts  # node 1's files only

    args = ["load", "--mib", 24, "--persist-to", shared, "--persist-every", 0, "--wait-persisted", 1]
    loaded = run_job(cluster3, [0, 1], args, tmp_path)
    for evs in loaded:
        loaded_and_persisted(evs, "step-1")
    taken = sorted(f.name for f in (job0 / "checkpoints" / "step-1").glob("__2_*"))
    assert taken == kept and not list((job0 / "replicas" / "node2" / "step-1").glob("__*"))  # moved
    out = {"w": torch.zeros(24 * 256, 1024), "bias": torch.zeros(1000, dtype=torch.float64), "step": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shared / "step-1")), no_dist=True)
    assert torch.equal(out["w"], global_weight(1, 24)) and out["step"] == 1


def test_status_on_a_node_without_the_checkpoint_says_what_the_nodes_holding_it_do(cluster2, tmp_path):
    """Node 1 uploads its share of step 1 and deletes it from its memory; node 0 still holds it. Node 1's
    status and wait_persisted do not say persisted before it is published: first node 0 was not asked
    (not requested: ValueError), then its upload failed for good (a directory where its file goes:
    PersistError); once that is fixed and node 0 is asked again, node 1's wait_persisted returns when the
    checkpoint is published."""
    shared = tmp_path / "persisted"
    blocker = shared / "step-1" / "__0_0.distcp"
    blocker.mkdir(parents=True)
    args = ["save", "--steps", 1, "--mib", 2, "--persist-to", shared, "--persist-every", 0,
            "--elsewhere", 1, "--tmp", tmp_path]  # fmt: skip
    procs = launch(cluster2, [0, 1], args, tmp_path)
    report = functools.partial(node1_report, tmp_path / "node1.log")
    unrequested = report("unrequested")
    assert unrequested["state"] == "not requested", unrequested
    assert unrequested["outcome"].startswith("ValueError") and "nodes that hold it" in unrequested["outcome"]
    failed = report("failed")
    assert failed["state"] == "failed" and "IsADirectoryError" in failed["error"], failed
    assert failed["outcome"].startswith("PersistError"), failed
    assert not (shared / "step-1" / ".dcp_memstore" / "COMMITTED").exists()
    blocker.rmdir()
    (tmp_path / "fixed").write_text("ok")
    saved = finish(procs, [0, 1], tmp_path)
    (retried,) = [e for e in of(saved[1], "persist") if e["phase"] == "retried"]
    assert retried == {**retried, "outcome": "persisted", "url": f"{shared}/step-1"}, retried
    out = {"w": torch.zeros(2 * 256, 1024), "bias": torch.zeros(1000, dtype=torch.float64), "step": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shared / "step-1")), no_dist=True)
    assert torch.equal(out["w"], global_weight(1, 2)) and out["step"] == 1


def test_status_on_a_node_without_the_checkpoint_while_the_target_cannot_be_read(cluster2, tmp_path):
    """As above, but the shared directory cannot be read for a while (``target_down``). Node 1's status
    does not raise that error but says what node 0 does: not asked (ValueError), then retrying
    (wait_persisted waits, it does not raise); once the target is back, wait_persisted returns when the
    checkpoint is published. With the target unreadable again after that, node 1 does not say persisted
    (node 0 does: it saw the publication) without seeing the marker."""
    shared = tmp_path / "persisted"
    args = ["save", "--steps", 1, "--mib", 2, "--persist-to", shared, "--persist-every", 0,
            "--unreachable", 1, "--tmp", tmp_path]  # fmt: skip
    procs = launch(cluster2, [0, 1], args, tmp_path)
    report = functools.partial(node1_report, tmp_path / "node1.log")
    wait_for(tmp_path / "deleted", TIMEOUT_S)
    target_down(shared)
    (tmp_path / "broken").write_text("ok")
    unrequested = report("unrequested")
    assert unrequested["state"] == "not requested", unrequested
    assert unrequested["outcome"].startswith("ValueError") and "nodes that hold it" in unrequested["outcome"]
    down = report("down")  # node 0's upload is retrying
    assert down["outcome"].startswith("TimeoutError") and down["state"] == "retrying", down
    assert "Too many levels of symbolic links" in down["error"], down
    target_up(shared)
    restored = report("restored")
    assert restored == {**restored, "outcome": "persisted", "url": f"{shared}/step-1"}, restored
    target_down(shared)
    (tmp_path / "broken-again").write_text("ok")
    published = report("published")
    assert published["outcome"].startswith("TimeoutError") and published["state"] == "retrying", published
    assert "Too many levels of symbolic links" in published["error"] and published["url"] is None, published
    target_up(shared)
    finish(procs, [0, 1], tmp_path)
    out = {"w": torch.zeros(2 * 256, 1024), "bias": torch.zeros(1000, dtype=torch.float64), "step": -1}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shared / "step-1")), no_dist=True)
    assert torch.equal(out["w"], global_weight(1, 2)) and out["step"] == 1


def test_a_node_waiting_for_other_nodes_files_is_not_left_retrying_once_the_target_is_back(
    cluster2, tmp_path
):
    """Node 0 uploaded its share of step 1 and waits for node 1's (not asked yet). The target cannot be
    read for a moment: node 0 says retrying, with the error. Once it is back, node 0 says uploading with
    no error (it stayed retrying with the old error until publication); then node 1 is asked, and the
    checkpoint is published."""
    shared = tmp_path / "persisted"
    args = ["save", "--steps", 1, "--mib", 2, "--persist-to", shared, "--persist-every", 0,
            "--waiting", 1, "--tmp", tmp_path]  # fmt: skip
    procs = launch(cluster2, [0, 1], args, tmp_path)
    wait_for(tmp_path / "uploaded", TIMEOUT_S)
    target_down(shared)
    try:
        wait_for(tmp_path / "retrying", TIMEOUT_S)
    finally:
        target_up(shared)
    (tmp_path / "restored").write_text("ok")
    saved = finish(procs, [0, 1], tmp_path)
    (waiting,) = of(saved[0], "waiting")
    assert (waiting["state"], waiting["error"]) == ("uploading", None), waiting
    assert (shared / "step-1" / ".dcp_memstore" / "COMMITTED").exists()
