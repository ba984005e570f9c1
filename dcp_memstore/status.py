"""``CheckpointStatus``: where one checkpoint is, tier by tier, as ``MemStore.status`` reports it."""

from __future__ import annotations

from dataclasses import dataclass, field

PERSIST_STATES = ("off", "not requested", "queued", "uploading", "retrying", "failed", "persisted")
NOT_IN_MEMORY = "not in memory"  # replication on, but no node's memory holds the checkpoint
# states of ``replicas`` entries that waiting may change: replication in progress, or a node away
IN_FLIGHT = ("pending", "retrying", "unreachable")


def replication_of(replicas: dict[str, str]) -> str:
    """The ``replication`` summary of the ``replicas`` entries: ``replicated`` if every entry is."""
    return "replicated" if all(v == "replicated" for v in replicas.values()) else "under-replicated"


@dataclass(frozen=True)
class CheckpointStatus:
    """The state of checkpoint ``checkpoint_id``.

    ``in_memory``: committed in this node's tmpfs. ``persist``: one of ``off`` (the store has no
    ``persist_to``), ``not requested`` (the policy did not pick it; ``store.persist(id)`` does),
    ``queued``, ``uploading``, ``retrying`` (a transient error; ``error`` says which), ``failed`` (a
    permanent error such as refused credentials or a missing bucket; ``store.persist(id)`` tries again) or
    ``persisted`` (published at ``persisted_url``, whose commit marker status read: a copy deleted from
    the target since is ``not requested`` again, ``error`` naming its URL, and ``retrying`` while the
    target cannot be read). ``files_uploaded``/``files_total`` count this node's data files (shard and
    objects files) of the checkpoint.

    For a checkpoint not in this node's memory (``in_memory`` False) but in the memory of the job's other
    nodes (this node was replaced and not yet restored, deleted its copy, or keeps fewer), ``persist`` is
    ``persisted`` only once it is published; until then the most pressing state those nodes report (each
    uploads its own files), and the file counts are 0. While persistent storage cannot be read, a node's
    ``persisted`` shows as ``retrying`` (``error``: the read error) until the commit marker is seen.

    ``replication``: ``off`` (one node, or ``replicas=0``), ``replicated``, ``under-replicated``, or
    ``not in memory`` (replication is on, but no node's memory holds the checkpoint: only persistent
    storage does; ``wait_replicated`` raises). ``replicas`` says why, per entry; ``replicated`` means
    every entry is ``replicated``.

    Where this node's memory holds the checkpoint, ``replicas`` has one entry per replica node of this
    node's files (``node<i>``: ``replicated``, ``pending`` or ``retrying: <error>``), each ``replicated``
    checked against what that node answers it keeps now (``replication.replica_check``): ``lost`` where
    it no longer keeps them (replaced or wiped, or it deleted or evicted its copy: nothing sends them
    again before the next ``latest_checkpoint()``, so ``wait_replicated`` raises), ``unreachable`` where
    it does not answer or has not announced its server yet (``wait_replicated`` waits).

    Where it does not (a node replaced and not restored yet, or one that deleted its copy) but other
    nodes' memory does, ``replicas`` is the job's view (``replication.cluster_status``): for each node
    that holds its copy, the replication of its files to each of its replica nodes (``node<i>->node<j>``:
    ``replicated``, ``pending``, ``retrying: <error>``, or ``lost``: acknowledged, but that node no
    longer holds them); for each node that does not but wrote files of it (this one, for instance),
    where they are kept (``node<i>``: ``not in memory; replicas on <nodes>``): nothing replicates those
    again until that node restores the checkpoint, so the checkpoint is ``under-replicated``; ``unheld``:
    ``<n> of <m> data files held by no node``; ``node<i>``: ``unreachable`` for a node that did not
    answer, and ``not replicating`` for one that holds its copy but does not replicate (``replicas=0``
    there).
    ``stalled`` lists the entries that waiting does not change (``wait_replicated`` raises on them).
    """

    checkpoint_id: str
    in_memory: bool
    persist: str
    error: str | None = None
    persisted_url: str | None = None
    files_uploaded: int = 0
    files_total: int = 0
    replication: str = "off"
    replicas: dict[str, str] = field(default_factory=dict)

    @property
    def replicated(self) -> bool:
        return self.replication == "replicated"

    @property
    def stalled(self) -> dict[str, str]:
        """The ``replicas`` entries that are not replicated and that no replication in progress changes."""
        return {k: v for k, v in self.replicas.items() if v != "replicated" and not v.startswith(IN_FLIGHT)}

    @property
    def persisted(self) -> bool:
        return self.persist == "persisted"
