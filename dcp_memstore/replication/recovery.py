"""Recovery from the cluster's memory: which checkpoints the job can still read when nodes lost their
tmpfs, restoring a replaced node's files from the peers that keep its replicas, and telling the
replicators which replicas were lost so they send them again.

``latest_checkpoint()`` gathers every node's ``inventory`` (one rank per node reports: the checkpoints
committed there with the files their manifests list, and the files it holds, its own and the replicas it
keeps for others, and the checkpoints it owes to persistent storage). A checkpoint is readable from memory
if some node still has its manifest and every file it lists is held somewhere. Every rank computes the
same answer from the same gathered views.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping

from dcp_memstore.persist.persister import global_rank
from dcp_memstore.persist.progress import is_owed
from dcp_memstore.replication.cluster_read import ClusterCheckpoint
from dcp_memstore.replication.peers import Peers, node_name
from dcp_memstore.replication.replicator import ReplicaRecords, manifest_files, node_files, to
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import list_files
from dcp_memstore.store import catalog
from dcp_memstore.store.faults import crash_point
from dcp_memstore.store.layout import StoreLayout, file_rank
from dcp_memstore.store.threads import run_parallel

log = logging.getLogger(__name__)


def inventory(layout: StoreLayout, target_url: str | None) -> dict:
    """What this node holds: ``committed`` [[id, committed_at, seq, nbytes, {file: size} listed]],
    ``own`` {id: {file: size}} present, ``replicas`` {source node: {id: {file: size}}}, ``owed`` [ids owed
    to the persistent storage at ``target_url``: not those an earlier run owed to another],
    ``prepared`` {id: [committed_at, {file: size}]} (prepared for a commit that never reached this node:
    the coordinator's record says which save)."""
    prepared = {
        cid: [record.get("committed_at"), list_files(layout.checkpoint_dir(cid))]
        for cid, record in catalog.prepared(layout).items()
    }
    committed, own, owed = [], {}, []
    for r in catalog.committed(layout):
        committed.append(
            [r.checkpoint_id, r.committed_at, r.seq, r.nbytes, manifest_files(layout, r.checkpoint_id)]
        )
        own[r.checkpoint_id] = node_files(layout, r.checkpoint_id)
        if target_url is not None and is_owed(layout, r.checkpoint_id, target_url):
            owed.append(r.checkpoint_id)
    replicas: dict[str, dict[str, dict[str, int]]] = {}
    try:
        sources = list(os.scandir(layout.replicas_dir))
    except FileNotFoundError:
        sources = []
    for src in sources:
        for ck in list(os.scandir(src.path)) if src.is_dir() else []:
            files = list_files(ck.path)
            if files:
                replicas.setdefault(src.name, {})[ck.name] = files
    return {"committed": committed, "own": own, "replicas": replicas, "owed": owed, "prepared": prepared}


def readable(inventories: list[dict]) -> dict[str, tuple[float, int, int]]:
    """The checkpoints the job can read from memory, with (committed_at, seq, nbytes): some node has the
    manifest and every file it lists is held by some node (own copy or replica) at the listed size."""
    return {cid: rec for cid, (rec, missing) in unheld(inventories).items() if not missing}


def unheld(inventories: list[dict]) -> dict[str, tuple[tuple[float, int, int], list[str]]]:
    """Every checkpoint some node has the manifest of, with its (committed_at, seq, nbytes) and the files
    it lists that no node holds (own copy or replica, or a copy prepared of the same save, which the
    repair commits) at the listed size, sorted."""
    listed: dict[str, tuple[tuple[float, int, int], dict[str, int]]] = {}
    held: dict[str, dict[str, int]] = {}
    prepared: list[tuple[str, float, dict[str, int]]] = []
    for inv in inventories:
        for cid, at, seq, nbytes, files in inv["committed"]:
            listed.setdefault(cid, ((at, seq, nbytes), files))
        for cid, files in inv["own"].items():
            held.setdefault(cid, {}).update(files)
        for by_id in inv["replicas"].values():
            for cid, files in by_id.items():
                held.setdefault(cid, {}).update(files)
        prepared += [(cid, at, files) for cid, (at, files) in inv.get("prepared", {}).items()]
    for cid, at, files in prepared:
        if cid in listed and listed[cid][0][0] == at:
            held.setdefault(cid, {}).update(files)
    out = {}
    for cid, (rec, files) in listed.items():
        have = held.get(cid, {})
        out[cid] = (rec, sorted(f for f, size in files.items() if have.get(f, -1) < size))
    return out


def orphans(
    cid: str, inventories: dict[int, dict], restoring: Mapping[int, Collection[int]]
) -> dict[int, dict[str, str]]:
    """The files of checkpoint ``cid`` that no node would upload: those its manifest lists of ranks with no
    file in any node's own copy (``inventories``, by node) and not of a node in ``restoring`` ({node: its
    ranks}, the nodes about to restore their copy), because the node that wrote them left the job (a
    restart on fewer nodes). Each such rank goes to one node that has ``cid`` committed, or restores it,
    and keeps replicas of its files: the one keeping the most of them at the listed size, the lowest node
    first. A restoring node counts: its replicas outlive its own copy (received after a delete or an
    eviction there), and its restore commits ``cid`` before it takes files over. A take-over cut short
    (its process killed between two moves) is completed: a node whose copy holds files of a rank and
    lacks others of it that no node's copy holds takes those from its replicas. Returns {node: {file:
    source node of the replica}}; every node computes the same from the same gathered views."""
    committed_on = {n: {c: files for c, *_, files in inv["committed"]} for n, inv in inventories.items()}
    listed = next((by_id[cid] for by_id in committed_on.values() if cid in by_id), {})
    in_copies = {n: set(inv["own"].get(cid, {})) for n, inv in inventories.items()}
    owned = {file_rank(f) for files in in_copies.values() for f in files}
    owned.update(rank for ranks in restoring.values() for rank in ranks)
    by_rank: dict[int | None, set[str]] = {}
    for f in listed:
        if file_rank(f) not in owned:
            by_rank.setdefault(file_rank(f), set()).add(f)
    out: dict[int, dict[str, str]] = {}
    for files in by_rank.values():
        kept_by = {}
        for node, inv in sorted(inventories.items()):
            if cid in committed_on[node] or node in restoring:
                kept_by[node] = {
                    f: source
                    for source, by_id in sorted(inv["replicas"].items())
                    for f, size in by_id.get(cid, {}).items()
                    if f in files and size >= listed[f]
                }
        node = max(kept_by, key=lambda n: (len(kept_by[n]), -n), default=None)
        if node is not None and kept_by[node]:
            out.setdefault(node, {}).update(kept_by[node])
    in_none = set(listed).difference(*in_copies.values())
    for node, inv in sorted(inventories.items()):
        ranks = {file_rank(f) for f in in_copies[node]}
        for source, by_id in sorted(inv["replicas"].items()):
            for f, size in by_id.get(cid, {}).items():
                if f in in_none and file_rank(f) in ranks and size >= listed[f]:
                    out.setdefault(node, {}).setdefault(f, source)
    return out


def take_over(layout: StoreLayout, cid: str, files: dict[str, str]) -> list[str]:
    """Move ``files`` ({file: source node}, see ``orphans``) of committed checkpoint ``cid`` from the
    replicas this node keeps into its own copy: the persister uploads them there (they join this node's
    share) and the replicator sends them to this node's replica targets. A move, not a copy: no memory is
    added. Returns the files moved (none once the checkpoint is evicted or deleted)."""
    moved = []
    for f, source in sorted(files.items()):
        try:
            os.rename(layout.replica_dir(source, cid) / f, layout.checkpoint_dir(cid) / f)
        except FileNotFoundError:
            continue
        moved.append(f)
        crash_point("take-over", global_rank())
    return moved


def restore(
    layout: StoreLayout,
    peers: Peers,
    transport: TcpTransport,
    checkpoint_id: str,
    record: tuple[float, int, int],
    threads: int,
    before_commit: Callable[[], None] | None = None,
) -> int:
    """Make committed checkpoint ``checkpoint_id`` whole again on this node: fetch its manifest and the
    files this node's ranks wrote from the nodes holding them, then commit it here with the job's
    ``record`` (committed_at, seq, nbytes), ``before_commit`` called first (holds placed there are in place
    when it becomes visible). Returns the bytes fetched. Raises FileNotFoundError if a file is held by no
    reachable node (nothing is committed then)."""
    cluster = ClusterCheckpoint(layout, peers, transport, checkpoint_id)
    stale = layout.checkpoint_dir(checkpoint_id)
    if stale.exists():
        catalog.discard(layout, stale)
    d = catalog.begin(layout, checkpoint_id)
    try:
        manifest = cluster.manifest(d)
        ranks = peers.node_ranks()
        mine = [f for f in manifest.files if file_rank(f) in ranks]
        run_parallel(lambda f: cluster.fetch(f, d / f), mine, threads, pool="fetch")
    except BaseException:
        catalog.discard(layout, d)
        raise
    at, seq, nbytes = record
    if peers.targets():
        ReplicaRecords(layout, checkpoint_id).hold()  # settled by ``resync`` and the replicator
    if before_commit is not None:
        before_commit()
    catalog.commit(layout, checkpoint_id, nbytes, seq=seq, committed_at=at)
    return sum(os.stat(d / f).st_size for f in mine)


def resync(layout: StoreLayout, peers: Peers, inventories: dict[int, dict]) -> list[str]:
    """Bring this node's replica records in line with what its targets hold (``inventories`` by node):
    files a target holds at the right size count as acknowledged (e.g. after a restore), files it lost
    (a replaced node) are owed again and their checkpoint held until they are sent. Returns the
    checkpoints that owe replicas again."""
    owed = []
    for r in catalog.committed(layout):
        cid = r.checkpoint_id
        files = node_files(layout, cid)
        records = ReplicaRecords(layout, cid)
        lost = False
        for t in peers.targets():
            inv = inventories.get(t)
            if inv is None:
                continue  # the target reported nothing (not in this job now): leave its records alone
            there = inv["replicas"].get(peers.name, {}).get(cid, {})
            gone = {f for f, size in files.items() if there.get(f) != size}
            for f in set(files) - gone:
                records.mark_done(f, to(t))
            if gone & records.done_files(to(t)) or (gone and not records.owed()):
                lost = True
            records.forget(gone, to(t))
        if lost:
            log.info(
                "checkpoint %r: replicas lost on %s; sending them again",
                cid,
                [node_name(t) for t in peers.targets()],
            )
            records.hold()
            owed.append(cid)
    return owed
