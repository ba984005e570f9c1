"""Which node a rank is on, and where each node's replicas go (ring placement).

Nodes are numbered ``0 .. N-1`` by torchrun's node rank (``GROUP_RANK``); every node runs the same number
of ranks (``LOCAL_WORLD_SIZE``), so global rank ``r`` is on node ``r // local_world_size``. Node ``i``'s
checkpoint files are replicated to the next ``k`` nodes of the ring, ``(i + 1) % N, ..., (i + k) % N``, each
file going to the rank with the same local rank there. Any ``N >= 2`` works; a single node replicates
nowhere. Everything here is a pure function of its arguments (``NodeInfo.from_env`` reads the environment).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dcp_memstore.store.environment import (
    GROUP_RANK_MEANING,
    LOCAL_RANK_MEANING,
    LOCAL_WORLD_SIZE_MEANING,
    RANK_MEANING,
    WORLD_SIZE_MEANING,
    env_int,
)


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _non_negative_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _check_node(node: object, nnodes: object) -> tuple[int, int]:
    n = _positive_int(nnodes, "nnodes")
    i = _non_negative_int(node, "node")
    if i >= n:
        raise ValueError(f"node {i} is out of range for {n} node(s) (0 .. {n - 1})")
    return i, n


def _check_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"replication factor k must be an int >= 1, got {k!r}")
    return k


def node_of(rank: int, local_world_size: int) -> int:
    """The node (0-based) that global rank ``rank`` runs on, with ``local_world_size`` ranks per node."""
    lws = _positive_int(local_world_size, "local_world_size")
    return _non_negative_int(rank, "rank") // lws


def nodes_in(world_size: int, local_world_size: int) -> int:
    """How many nodes ``world_size`` ranks span with ``local_world_size`` ranks per node.

    Raises ValueError unless both are positive ints and ``world_size`` is a multiple of
    ``local_world_size`` (every node must run the same number of ranks)."""
    ws = _positive_int(world_size, "world_size")
    lws = _positive_int(local_world_size, "local_world_size")
    if ws % lws:
        raise ValueError(
            f"world_size {ws} is not a multiple of local_world_size {lws}: every node must run the same "
            f"number of ranks"
        )
    return ws // lws


def replica_targets(node: int, nnodes: int, k: int = 1) -> list[int]:
    """The nodes that keep replicas of ``node``'s files: ``(node + 1) % N, ..., (node + k) % N``, nearest
    first. ``k`` is capped at ``N - 1`` (a node never replicates to itself, and there are only ``N - 1``
    others), so one node gives ``[]``. Raises ValueError for ``k < 1`` or a node outside ``0 .. N-1``."""
    i, n = _check_node(node, nnodes)
    k = min(_check_k(k), n - 1)
    return [(i + d) % n for d in range(1, k + 1)]


def holders_of(node: int, nnodes: int, k: int = 1) -> list[int]:
    """The nodes holding replicas of ``node``'s files, where to restore it from (nearest first); the same
    nodes as ``replica_targets``, named for the restore side."""
    return replica_targets(node, nnodes, k)


def replicas_held_by(node: int, nnodes: int, k: int = 1) -> list[int]:
    """The nodes whose replicas ``node`` keeps: every ``j`` with ``node in replica_targets(j, N, k)``, i.e.
    ``(node - 1) % N, ..., (node - k) % N`` (nearest first, ``k`` capped at ``N - 1``). A replacement node
    receives these again after it is restored."""
    i, n = _check_node(node, nnodes)
    k = min(_check_k(k), n - 1)
    return [(i - d) % n for d in range(1, k + 1)]


def peer_rank(target_node: int, local_rank: int, local_world_size: int) -> int:
    """Global rank of the process with local rank ``local_rank`` on node ``target_node``."""
    lws = _positive_int(local_world_size, "local_world_size")
    lr = _non_negative_int(local_rank, "local_rank")
    if lr >= lws:
        raise ValueError(f"local_rank {lr} is out of range for local_world_size {lws}")
    return _non_negative_int(target_node, "target_node") * lws + lr


@dataclass(frozen=True)
class NodeInfo:
    """Where this process sits in the job: its node and rank, and the job's shape."""

    node_rank: int
    nnodes: int
    local_rank: int
    local_world_size: int
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        n = nodes_in(self.world_size, self.local_world_size)
        if n != self.nnodes:
            raise ValueError(
                f"nnodes {self.nnodes} does not match world_size {self.world_size} / local_world_size "
                f"{self.local_world_size} = {n}"
            )
        _check_node(self.node_rank, self.nnodes)
        if peer_rank(self.node_rank, self.local_rank, self.local_world_size) != self.rank:
            raise ValueError(
                f"rank {self.rank} is not local rank {self.local_rank} of node {self.node_rank} with "
                f"{self.local_world_size} ranks per node"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeInfo:
        """Read torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
        (from ``os.environ`` unless ``env`` is given). Missing variables mean a single node: rank 0 of 1,
        ``LOCAL_WORLD_SIZE`` defaulting to ``WORLD_SIZE``, ``LOCAL_RANK`` to ``RANK``, and ``GROUP_RANK`` to
        ``RANK // LOCAL_WORLD_SIZE``. Raises ValueError for values that are not ints or do not fit."""

        def read(name: str, default: int, meaning: str) -> int:
            return env_int(name, default, meaning, env)

        rank = read("RANK", 0, RANK_MEANING)
        world_size = read("WORLD_SIZE", 1, WORLD_SIZE_MEANING)
        local_world_size = read("LOCAL_WORLD_SIZE", world_size, LOCAL_WORLD_SIZE_MEANING)
        local_rank = read(
            "LOCAL_RANK", rank % local_world_size if local_world_size > 0 else rank, LOCAL_RANK_MEANING
        )
        node_rank = read(
            "GROUP_RANK", node_of(rank, local_world_size) if local_world_size > 0 else 0, GROUP_RANK_MEANING
        )
        return cls(
            node_rank=node_rank,
            nnodes=nodes_in(world_size, local_world_size),
            local_rank=local_rank,
            local_world_size=local_world_size,
            rank=rank,
            world_size=world_size,
        )

    @property
    def multi_node(self) -> bool:
        """Whether the job spans more than one node (replication is on by default then)."""
        return self.nnodes > 1
