"""Replication across real "nodes" (network namespaces joined by veth, each with its own tmpfs root),
torchrun with ``--nnodes`` across them: save, replicate, lose a node's memory, restore, reload with another
world size, a peer cut off mid-replication, and requests from outside the job refused."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp_memstore.answer_deadline import MIN_ANSWER_S
from tests.netns import Cluster, torchrun_argv

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("mn_worker.py")
REPO = WORKER.parents[2]
JOB = "mn"
TIMEOUT_S = 150.0

# torchrun's agents and their workers import torch (workers: DCP and dcp_memstore too) with the garbage
# collector off, then freeze what they imported into its permanent generation: the import skips the
# collections its 300k objects would trigger (some 0.4 s of CPU), and every later full collection skips
# them, the one at interpreter exit included (0.7-1.3 s on a busy 2-core machine, 0.2 s frozen).
AGENT = "import gc; gc.disable(); from torch.distributed.run import main; gc.enable(); gc.freeze(); main()"
WORKER_START = (
    "import gc, runpy, sys; gc.disable(); import torch.distributed.checkpoint, dcp_memstore; gc.enable(); "
    "gc.freeze(); sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
)

# Run from a namespace outside the job: requests signed with a wrong secret, and bytes that are no frame.
PROBE = """
import json, socket, sys
from pathlib import Path
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import ReplicationError
from dcp_memstore.replication import wire
from dcp_memstore.store.layout import StoreLayout
mine = StoreLayout(Path(sys.argv[3]).parent, "mn")  # where a fetched file would land (none does)
peer = (sys.argv[1], int(sys.argv[2]))
t = TcpTransport("mn", b"not the job's secret, 32 bytes!!", timeout_s=5)
src = Path(sys.argv[3]); src.write_bytes(b"evil" * 100)
attempts = {
    "ping": lambda: t.ping(peer),
    "stat": lambda: t.stat(peer, "step-2"),
    "get": lambda: t.get_file(peer, "step-2", "__0_0.shard", src.with_name("stolen"), layout=mine),
    "put": lambda: t.put_file(peer, "node9", "step-2", "__0_0.shard", src),
    "commit": lambda: t.commit(peer, "step-9", "prepare", {"seq": 9, "committed_at": 1.0, "nbytes": 0}, b"m"),
    "replicated": lambda: t.replicated(peer, "step-2", "node9", 1.0),
}
out = {}
for name, call in attempts.items():
    try:
        call()
        out[name] = "accepted"
    except ReplicationError as e:
        out[name] = e.code
s = socket.create_connection(peer, timeout=5)
s.sendall(b"GET /../../etc/passwd HTTP/1.0\\r\\n\\r\\n")
wire.validate_server_hello(wire.recv_header(s))  # sent as the connection opened
out["garbage"] = wire.recv_header(s).get("code")
print(json.dumps(out))
"""


def events(log: str) -> list[dict]:
    """The ``@@mn`` events in a node's log, one per line."""
    return [json.loads(line[5:]) for line in log.splitlines() if line.startswith("@@mn ")]


def launch(
    cluster: Cluster,
    nodes: list[int],
    args: list,
    log_dir: Path,
    nproc: int = 1,
    env: dict | None = None,
    script: Path = WORKER,
) -> list:
    """torchrun of ``script`` on ``nodes`` of the cluster (a job of len(nodes) nodes, the first one hosting
    the rendezvous); node i logs to ``log_dir/node<i>.log``; ``env``: more environment by node."""
    port = cluster.node(nodes[0]).free_port()
    procs = []
    for job_rank, i in enumerate(nodes):
        node = cluster.node(i)
        argv = torchrun_argv(
            job_rank, len(nodes), nproc, script, args, cluster.node(nodes[0]).addr, port,
            agent=["-c", AGENT], worker=[sys.executable, "-u", "-c", WORKER_START],
        )  # fmt: skip
        with open(log_dir / f"node{i}.log", "wb") as log:
            extra = {"PYTHONPATH": str(REPO), "DCP_MEMSTORE_JOB_ID": JOB, **(env or {}).get(i, {})}
            procs.append(node.popen(argv, env=node.env(extra), stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list, nodes: list[int], log_dir: Path) -> list[list[dict]]:
    """Wait for the job; assert every node succeeded; return each node's events."""
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(1.0, deadline - time.monotonic()))
    logs = [(log_dir / f"node{i}.log").read_text(errors="replace") for i in nodes]
    detail = "\n".join(
        f"--- node{i} (rc {p.returncode})\n{log[-5000:]}"
        for i, p, log in zip(nodes, procs, logs, strict=True)
    )
    assert [p.returncode for p in procs] == [0] * len(nodes), detail
    return [events(log) for log in logs]


def run_job(
    cluster: Cluster, nodes: list[int], args: list, log_dir: Path, nproc: int = 1
) -> list[list[dict]]:
    return finish(launch(cluster, nodes, args, log_dir, nproc), nodes, log_dir)


def of(evs: list[dict], kind: str) -> list[dict]:
    return [e for e in evs if e["event"] == kind]


def checkpoint_files(root: Path, ckpt: str) -> dict[str, bytes]:
    d = root / JOB / "checkpoints" / ckpt
    return {p.name: p.read_bytes() for p in d.glob("__*")}


def replica_files(root: Path, source: str, ckpt: str) -> dict[str, bytes]:
    d = root / JOB / "replicas" / source / ckpt
    return {p.name: p.read_bytes() for p in d.glob("__*")} if d.exists() else {}


def wait_line(path: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, (
            f"{needle!r} not in {path}:\n{path.read_text(errors='replace')[-4000:]}"
        )
        time.sleep(0.05)


def test_three_nodes_replicate_lose_a_node_restore_and_refuse_outsiders(cluster3, tmp_path):
    nodes = [0, 1, 2]
    args = ["save", "--steps", 2, "--tmp", tmp_path, "--wait-replicated", "--serve-until", "probed"]
    procs = launch(cluster3, nodes, args, tmp_path)
    wait_line(tmp_path / "node0.log", '"serving"', TIMEOUT_S)
    addr = next(e["addr"] for e in events((tmp_path / "node0.log").read_text()) if e["event"] == "serving")
    outsider = cluster3.node(2).run(
        [sys.executable, "-c", PROBE, addr[0], str(addr[1]), str(tmp_path / "evil")],
        timeout=60,
        env=cluster3.node(2).env({"PYTHONPATH": str(REPO)}),
    )
    (tmp_path / "probed").write_text("")
    saved = finish(procs, nodes, tmp_path)

    assert outsider.returncode == 0, outsider.stderr
    assert json.loads(outsider.stdout.strip().splitlines()[-1]) == {
        "ping": "auth", "stat": "auth", "get": "auth", "put": "auth", "commit": "auth", "replicated": "auth",
        "garbage": "bad_request",
    }, outsider.stderr  # fmt: skip
    for i, evs in enumerate(saved):
        assert [e["replicas"] for e in of(evs, "replicated")] == [{f"node{(i + 1) % 3}": "replicated"}] * 2
        (after,) = of(evs, "after-probe")  # the job saw nothing of the outsider
        assert after == {**after, "replication": "replicated", "listed": ["step-1", "step-2"]}
    assert not (cluster3.node(0).root / JOB / "replicas" / "node9").exists()
    roots = [cluster3.node(i).root for i in nodes]
    originals = [checkpoint_files(r, "step-2") for r in roots]
    for i in nodes:  # node i's files, bit for bit, on node i+1
        assert originals[i] and replica_files(roots[(i + 1) % 3], f"node{i}", "step-2") == originals[i]

    cluster3.node(1).wipe_root()  # node 1 is replaced by an empty machine
    args = ["load", "--tmp", tmp_path, "--wait-replicated", "--before-restore", 2]
    loaded = run_job(cluster3, nodes, args, tmp_path)
    # before latest_checkpoint() restores it, node 1 tells from the other nodes' memory that step 2
    # would not survive losing one more node: its files are only in the replica on node 2, and the one
    # node 0 was acknowledged for went with node 1's memory
    (before,) = of(loaded[1], "before-restore")
    assert before == {
        **before,
        "in_memory": False,
        "persist": "off",
        "replication": "under-replicated",
        "replicas": {
            "node0->node1": "lost",
            "node2->node0": "replicated",
            "node1": "not in memory; replicas on node2",
        },
    }, before
    assert "waiting does not make it replicated" in before["outcome"], before
    # node 0 holds step 2, and its records say node 1 acknowledged its files: node 1 answers that it no
    # longer keeps them, so they are lost, not replicated, and waiting for them raises at once (nothing
    # sends them again before latest_checkpoint()); node 2's replica on node 0 is still there
    (holder,) = of(loaded[0], "before-restore")
    assert holder == {**holder, "in_memory": True, "replication": "under-replicated"}, holder
    assert holder["replicas"] == {"node1": "lost"}, holder
    assert holder["outcome"].startswith("FileNotFoundError"), holder
    assert "waiting does not make it replicated" in holder["outcome"], holder
    assert "latest_checkpoint()" in holder["outcome"], holder
    (kept,) = of(loaded[2], "before-restore")
    assert kept == {**kept, "replication": "replicated", "replicas": {"node0": "replicated"}}, kept
    for evs in loaded:
        (latest,) = of(evs, "latest")
        assert latest["checkpoint"] == "step-2"
        assert of(evs, "loaded")[0]["ok"] is True
        assert all(e["replication"] == "replicated" for e in of(evs, "replicated"))
    assert of(loaded[1], "latest")[0]["here"] == ["step-2"]  # restored from node 2, then listed
    assert checkpoint_files(roots[1], "step-2") == originals[1]
    assert replica_files(roots[1], "node0", "step-2") == originals[0]  # what node 1 kept for node 0, again
    assert replica_files(roots[2], "node1", "step-2") == originals[1]


def test_reload_with_fewer_nodes_reads_from_other_nodes_memory(cluster3, tmp_path):
    """Saved by 3 nodes, loaded by a job of nodes 0 and 1: every rank needs rows that node 1 or node 2's
    rank wrote; node 2 is gone and its files are read from the replica node 0 keeps. Node 0's own file
    is corrupt (one flipped byte): its items are read from the replica node 1 keeps instead."""
    run_job(cluster3, [0, 1, 2], ["save", "--steps", 1, "--mib", 6, "--wait-replicated"], tmp_path)
    cluster3.node(2).wipe_root()
    shard = cluster3.node(0).root / JOB / "checkpoints" / "step-1" / "__0_0.shard"
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded = run_job(cluster3, [0, 1], ["load", "--mib", 6, "--wait-replicated"], tmp_path)
    for evs in loaded:
        assert of(evs, "latest")[0]["checkpoint"] == "step-1"
        assert of(evs, "loaded")[0]["ok"] is True


def test_peer_cut_off_during_replication_training_goes_on(cluster2, tmp_path):
    """Node 0's uplink is throttled (tbf, 20 Mbit/s) so its 12 MiB take seconds to replicate; node 1's
    link goes down in the middle and comes back. Node 0 keeps training, status says under-replicated
    and retrying, the checkpoint stays held, and the replica completes after the link returns."""
    n0, n1 = cluster2.node(0), cluster2.node(1)
    n0.run(["tc", "qdisc", "replace", "dev", n0.ifname, "root", "tbf", "rate", "20mbit", "burst", "32kbit",
            "latency", "400ms"], timeout=10, check=True)  # fmt: skip
    procs = launch(
        cluster2, [0, 1], ["save", "--steps", 1, "--mib", 24, "--tmp", tmp_path, "--watch"], tmp_path
    )
    wait_line(tmp_path / "node0.log", '"saved"', TIMEOUT_S)
    n1.link_down()
    wait_line(tmp_path / "node0.log", '"node1": "retrying', 30)  # status says so (not only the log)
    n1.link_up()
    n0.run(["tc", "qdisc", "del", "dev", n0.ifname, "root"], timeout=10)
    evs = finish(procs, [0, 1], tmp_path)[0]
    states = of(evs, "status")
    assert states[0]["replication"] == "under-replicated" and states[0]["held"]
    retrying = [s for s in states if s["replicas"]["node1"].startswith("retrying")]
    assert retrying and all(s["held"] for s in retrying), states
    assert states[-1]["replication"] == "replicated" and not states[-1]["held"], states
    assert states[-1]["steps"] > retrying[0]["steps"]  # training went on while the peer was away
    assert replica_files(n1.root, "node0", "step-1") == checkpoint_files(n0.root, "step-1")


def test_crash_between_the_commit_phases_resumes_from_the_checkpoint_the_coordinator_committed(
    cluster2, tmp_path
):
    """Rank 0 (the coordinator) is killed right after it committed step-2 on its node, before it told
    node 1, which had prepared it (manifest and files in place). The restarted job resumes from step-2:
    node 1 commits what it prepared with the coordinator's record, instead of discarding its files and
    leaving step-2 committed on node 0 alone (the job would resume from step-1 and fail to save step-2
    again, 'already exists' on node 0)."""
    crash = {0: {"DCP_MEMSTORE_CRASH_AT": "after-commit:0:2"}}
    procs = launch(cluster2, [0, 1], ["save", "--steps", 2], tmp_path, env=crash)
    for p in procs:
        p.wait(TIMEOUT_S)
    assert [p.returncode != 0 for p in procs] == [True, True]
    n0, n1 = (cluster2.node(i).root / JOB / "checkpoints" / "step-2" for i in (0, 1))
    assert (
        (n0 / "COMMITTED").exists() and not (n1 / "COMMITTED").exists() and (n1 / "manifest.msgpack").exists()
    )
    loaded = run_job(cluster2, [0, 1], ["load", "--wait-replicated"], tmp_path)
    for evs in loaded:
        (latest,) = of(evs, "latest")
        assert latest == {**latest, "checkpoint": "step-2", "here": ["step-1", "step-2"]}
        assert of(evs, "loaded")[0]["ok"] is True
        assert [e["replication"] for e in of(evs, "replicated")] == ["replicated", "replicated"]
    assert not (n1 / "PREPARED").exists()


def test_a_copy_prepared_for_a_commit_that_never_came_goes_once_newer_checkpoints_are_committed(
    cluster2, tmp_path
):
    """The coordinator is SIGKILLed between the commit phases of step 2: node 1 keeps its prepared copy.
    The job restarts and saves on without looking for the latest checkpoint (nothing commits step 2 on
    node 1). Once keep_in_memory=2 newer checkpoints are committed, step 2 could never be the one to
    resume from and retention would have evicted it on every node: node 1 discards its copy instead of
    keeping its memory until a save runs short of space."""
    crash = {0: {"DCP_MEMSTORE_CRASH_AT": "after-commit:0:2"}}
    procs = launch(cluster2, [0, 1], ["save", "--steps", 2], tmp_path, env=crash)
    for p in procs:
        p.wait(TIMEOUT_S)
    assert [p.returncode != 0 for p in procs] == [True, True]
    prepared = cluster2.node(1).root / JOB / "checkpoints" / "step-2"
    assert (prepared / "PREPARED").exists() and not (prepared / "COMMITTED").exists()
    saved = run_job(cluster2, [0, 1], ["save", "--first", 3, "--steps", 2, "--settle"], tmp_path)
    for evs in saved:
        (settled,) = of(evs, "settled")
        assert settled["listed"] == ["step-3", "step-4"], settled
    assert not prepared.exists()


def test_surviving_node_alone_loads_from_the_replicas_it_keeps(cluster2, tmp_path):
    """Node 1 is lost for good and the job goes on with node 0 only (a job of one node, two ranks). Node
    1's files of the newest checkpoint are in the replica node 0 keeps: the load reads them from there."""
    run_job(cluster2, [0, 1], ["save", "--steps", 2, "--wait-replicated"], tmp_path)
    cluster2.node(1).wipe_root()
    (evs,) = run_job(cluster2, [0], ["load"], tmp_path, nproc=2)
    assert [e["checkpoint"] for e in of(evs, "latest")] == ["step-2", "step-2"]
    assert [e["ok"] for e in of(evs, "loaded")] == [True, True]


def test_a_node_serving_on_loopback_fails_the_first_save_naming_it(cluster2, tmp_path):
    """Node 0 announces its replication servers on 127.0.0.1 (what happens when the rendezvous host's
    name resolves to a loopback address there, as with 127.0.1.1 in /etc/hosts): node 1 cannot reach
    them, so replication to node 0 could never succeed. The first save fails saying so, on every node."""
    env = {0: {"DCP_MEMSTORE_BIND": "127.0.0.1"}}
    procs = launch(cluster2, [0, 1], ["save", "--steps", 1], tmp_path, env=env)
    for p in procs:
        p.wait(TIMEOUT_S)
    assert [p.returncode != 0 for p in procs] == [True, True]
    log0 = (tmp_path / "node0.log").read_text(errors="replace")
    assert "announced their replication servers on loopback addresses" in log0
    assert "DCP_MEMSTORE_BIND" in log0


@pytest.mark.parametrize("persist", [True, False], ids=["persist_to", "no_persist_to"])
def test_a_node_without_the_checkpoint_reports_the_jobs_replication_of_it(cluster2, tmp_path, persist):
    """Node 1 deletes step 1 from its memory (and with it the replica of node 0's files it kept); node 0
    still holds it. Node 1's status reports it from node 0's memory, with or without persist_to: node
    0's files are acknowledged but their replica is lost, and node 1's own files are kept only as the
    replica on node 0, so the checkpoint is under-replicated, and wait_replicated raises at once saying
    that waiting does not change it and how to. A checkpoint that no node holds is not found."""
    to = ["--persist-to", tmp_path / "persisted", "--persist-every", 0] if persist else []
    (_, evs) = run_job(
        cluster2, [0, 1], ["save", "--steps", 1, "--wait-replicated", "--not-here", 1, *to], tmp_path
    )
    (report,) = of(evs, "not-here")
    assert report == {
        **report,
        "in_memory": False,
        "persist": "not requested" if persist else "off",
        "replication": "under-replicated",
        "replicas": {"node0->node1": "lost", "node1": "not in memory; replicas on node0"},
    }, report
    assert report["outcome"].startswith("FileNotFoundError"), report
    assert "waiting does not make it replicated" in report["outcome"], report
    assert "latest_checkpoint()" in report["outcome"], report
    assert report["nowhere"].startswith("FileNotFoundError: checkpoint 'step-999' not found"), report


def test_a_rank_that_never_announced_its_server_blocks_neither_status_nor_close(cluster2, tmp_path):
    """After a job saved step 1 (replicated), a new job starts where rank 1 never creates its MemStore
    (a job shutting down after a failure), so rank 0's replicator waits for its server's address (up to
    stage_timeout_s, 60 s here). Rank 0's wait_replicated of step 1 (status) and close() do not wait
    that long: node 1 acknowledged its files, but with no server there nothing can confirm that it
    still keeps them, so node 1 is unreachable until the wait's own timeout (2 s)."""
    run_job(cluster2, [0, 1], ["save", "--steps", 1, "--wait-replicated"], tmp_path)
    (evs, _) = run_job(cluster2, [0, 1], ["close-alone"], tmp_path)
    (closed,) = of(evs, "closed")
    (outcome,) = closed["replication"]
    assert outcome.startswith("TimeoutError: checkpoint 'step-1' not replicated after 2.0 s"), closed
    assert "{'node1': 'unreachable'}" in outcome, closed
    assert closed["wait_s"] < 10 and closed["close_s"] < 10, closed


def test_a_rank_killed_before_it_announced_its_server_fails_lookups_at_the_grace_then_at_once(
    cluster2, tmp_path
):
    """Step 1 is saved and replicated, then node 0 is replaced (empty memory). In a new job, rank 1 is
    SIGKILLed before it creates its MemStore. Rank 0 (stage_timeout_s=5, so a grace of 5 s for ranks
    that have not announced) asks the status of step 1, which needs the other nodes' servers: it fails
    at the end of the grace (not after stage_timeout_s more, queued behind the replicator's own wait),
    naming rank 1 and its node; wait_persisted of it, next, fails at once, naming them again."""
    run_job(cluster2, [0, 1], ["save", "--steps", 1, "--wait-replicated"], tmp_path)
    cluster2.node(0).wipe_root()
    (tmp_path / "persist").mkdir()
    args = ["dead-peer", "--steps", 1, "--grace", 5, "--tmp", tmp_path, "--persist-to", tmp_path / "persist"]
    procs = launch(cluster2, [0, 1], args, tmp_path)
    procs[1].wait(TIMEOUT_S)
    assert procs[1].returncode != 0
    (tmp_path / "dead").write_text("")
    wait_line(tmp_path / "node0.log", '"attempt": "wait_persisted"', TIMEOUT_S)
    status, again = of(events((tmp_path / "node0.log").read_text(errors="replace")), "dead-peer")
    for report in (status, again):
        assert report["outcome"].startswith("RuntimeError: rank 1 on node 1 of job 'mn' announced no"), report
        assert "killed before opening its MemStore" in report["outcome"], report
    assert 4 < status["since_open"] < 8, status  # queued behind the replicator's own wait: 10 s
    assert again["seconds"] < 2, again


def test_a_rank_slow_to_announce_its_server_is_waited_for(cluster2, tmp_path):
    """As above, but rank 1 is alive and creates its MemStore 2 s after rank 0: rank 0's status of step
    1 waits for its server and answers what node 1's records say."""
    run_job(cluster2, [0, 1], ["save", "--steps", 1, "--wait-replicated"], tmp_path)
    cluster2.node(0).wipe_root()
    (tmp_path / "persist").mkdir()
    args = ["dead-peer", "--steps", 1, "--late", 2, "--persist-to", tmp_path / "persist"]
    (evs, _) = run_job(cluster2, [0, 1], args, tmp_path)
    (status,) = of(evs, "dead-peer")
    assert status["outcome"] == "returned not requested", status  # node 1's answer: it was waited for


def test_waits_with_a_timeout_keep_it_while_a_node_that_holds_the_checkpoint_does_not_answer(
    cluster2, tmp_path
):
    """Step 1 is saved and replicated, then node 1 is cut off (its link down: packets dropped, so its
    server neither answers nor refuses). On node 0, ``wait_replicated(timeout=2)`` raises TimeoutError
    naming node 1 unreachable, and once node 0 deleted its copy, ``wait_persisted(timeout=2)`` raises
    TimeoutError saying that node 1, which may hold it, did not answer. Each within its timeout and a
    little more: before, each look at node 1 waited ``replication_timeout_s`` (30 s here, ``math.inf``
    allowed), and the second said the checkpoint was in no node's memory. A third ``wait_persisted``,
    without a timeout, asks node 1 again until it is back and answers what it holds (it would give up
    after ``replication_timeout_s``)."""
    (tmp_path / "persist").mkdir()
    args = ["silent-peer", "--tmp", tmp_path, "--persist-to", tmp_path / "persist"]
    procs = launch(cluster2, [0, 1], args, tmp_path)
    wait_line(tmp_path / "node0.log", '"event": "ready"', TIMEOUT_S)
    cluster2.node(1).link_down()
    try:
        (tmp_path / "cut").write_text("")
        wait_line(tmp_path / "node0.log", '"event": "asking-again"', TIMEOUT_S)
        time.sleep(1)
    finally:
        cluster2.node(1).link_up()
        (tmp_path / "back").write_text("")
    replicated, persisted, again = of(finish(procs, [0, 1], tmp_path)[0], "silent-peer")
    assert replicated["outcome"].startswith("TimeoutError: checkpoint 'step-1' not replicated after 2.0 s")
    assert "'node1': 'unreachable'" in replicated["outcome"], replicated
    assert replicated["seconds"] < 2 + 2, replicated
    assert persisted["outcome"].startswith("TimeoutError: checkpoint 'step-1' not persisted after 2.0 s"), (
        persisted
    )
    assert "; node 1 (" in persisted["outcome"] and ") did not answer" in persisted["outcome"], persisted
    assert persisted["seconds"] < 2 + MIN_ANSWER_S + 2, persisted
    # asked again until node 1 answered (put back after 1 s): it holds the checkpoint, not owed anywhere
    assert again["outcome"].startswith("ValueError: checkpoint 'step-1' is not being persisted"), again
    assert again["outcome"].endswith("on the nodes that hold it") and 1 < again["seconds"] < 30, again
