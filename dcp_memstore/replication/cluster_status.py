"""The replication of a checkpoint that this node's memory does not hold, as the job's nodes hold it: what
``MemStore.status`` reports there (a node replaced and not restored yet, or one that deleted its copy).

Such a node replicates none of the checkpoint's files, but the job may still keep every file twice. The
view is per node whose files the checkpoint has (``ClusterCheckpoint``'s answers):

- a node that holds its committed copy: the replication of its own files to each of its replica nodes,
  as it records it (``replicated``, ``pending``, ``retrying: <error>``), under ``node<i>->node<j>``; a
  ``replicated`` whose replica node answered without those files is ``lost`` (that node was replaced,
  or deleted its copy, since: the next ``latest_checkpoint()`` sends them again);
- a node that does not hold its copy but whose replicas others keep (this node, say): ``not in memory;
  replicas on <nodes>``, under ``node<i>``: its files are kept only where replicated before, and nothing
  replicates them again until that node restores the checkpoint;
- files that the manifest lists but no node holds (the node that wrote them lost them, and so did its
  replica nodes): ``unheld``: ``<n> of <listed> data files held by no node`` (told only when every node
  answered: one that did not may hold them);
- a node that did not answer: ``unreachable``; one that holds its copy but does not replicate
  (``replicas=0`` there): ``not replicating``.

The checkpoint is ``replicated`` only when every entry is: then every file is held by its node and
its replica nodes, as on the nodes that hold it. A node that wrote no file of it (one added to the job
since) has no entry.
"""

from __future__ import annotations

from dcp_memstore.replication.cluster_read import ClusterCheckpoint
from dcp_memstore.replication.peers import node_name
from dcp_memstore.store.layout import file_rank

LOST = "lost"
UNREACHABLE = "unreachable"
NOT_REPLICATING = "not replicating"
UNHELD = "unheld"


def cluster_replicas(cluster: ClusterCheckpoint) -> dict[str, str]:
    """The replication of ``cluster``'s checkpoint per node of the job (see the module docstring)."""
    # data files per holder: (node, None) its own copy, (node, "node<i>") the replicas it keeps for node i
    held: dict[tuple[int, str | None], set[str]] = {}
    for f, holders in cluster.holders.items():
        if file_rank(f) is not None:
            for holder in holders:
                held.setdefault(holder, set()).add(f)
    replicas_of = {(node_name(n), s): fs for (n, s), fs in held.items() if s is not None}
    away = {node_name(n) for n in cluster.unreachable}
    out = {}
    for node in sorted(cluster.committed_on):
        states, name = cluster.replication[node], node_name(node)
        if states is None:
            out[name] = NOT_REPLICATING
            continue
        own = held.get((node, None), set())
        for target, state in states.items():
            if (
                state == "replicated"
                and target not in away
                and not own <= replicas_of.get((target, name), set())
            ):
                state = LOST
            out[f"{name}->{target}"] = state
    for node in cluster.unreachable:
        out[node_name(node)] = UNREACHABLE
    committed = {node_name(n) for n in cluster.committed_on}
    for source in sorted({s for _, s in held if s is not None} - committed - away):
        where = sorted({node_name(n) for n, s in held if s == source})
        out[source] = f"not in memory; replicas on {', '.join(where)}"
    unheld = cluster.listed - len(set().union(*held.values()))
    if unheld > 0 and not away:
        out[UNHELD] = f"{unheld} of {cluster.listed} data files held by no node"
    return out
