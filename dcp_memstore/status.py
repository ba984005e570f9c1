"""``CheckpointStatus``: where one checkpoint is, tier by tier, as ``MemStore.status`` reports it."""

from __future__ import annotations

from dataclasses import dataclass, field

PERSIST_STATES = ("off", "not requested", "queued", "uploading", "retrying", "failed", "persisted")
NOT_IN_MEMORY = "not in memory"  # replication on, but this node's memory does not hold the checkpoint


@dataclass(frozen=True)
class CheckpointStatus:
    """The state of checkpoint ``checkpoint_id``.

    ``in_memory``: committed in this node's tmpfs. ``persist``: one of ``off`` (the store has no
    ``persist_to``), ``not requested`` (the policy did not pick it; ``store.persist(id)`` does),
    ``queued``, ``uploading``, ``retrying`` (a transient error; ``error`` says which), ``failed`` (a
    permanent error such as refused credentials or a missing bucket; ``store.persist(id)`` tries again) or
    ``persisted`` (published at ``persisted_url``). ``files_uploaded``/``files_total`` count this node's
    shard files of the checkpoint.

    For a checkpoint not in this node's memory (``in_memory`` False) but in the memory of the job's other
    nodes (this node was replaced and not yet restored, deleted its copy, or keeps fewer), ``persist`` is
    ``persisted`` only once it is published; until then the most pressing state those nodes report (each
    uploads its own files), and the file counts are 0. While persistent storage cannot be read, a node's
    ``persisted`` shows as ``retrying`` (``error``: the read error) until the commit marker is seen.

    ``replication``: ``off`` (one node, or ``replicas=0``), ``replicated`` (every replica node has
    acknowledged this node's files), ``under-replicated``, or ``not in memory`` (replication is on, but
    this node's memory does not hold the checkpoint: it replicates none of its files, whatever the nodes
    that hold it do; ``wait_replicated`` raises); ``replicas`` says it per peer node (``node<i>``:
    ``replicated``, ``pending`` or ``retrying: <error>``).
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
    def persisted(self) -> bool:
        return self.persist == "persisted"
