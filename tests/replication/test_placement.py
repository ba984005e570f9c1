"""Ring placement and node identity: targets, their inverses, one node, and bad input."""

from __future__ import annotations

import pytest

from dcp_memstore.replication.placement import (
    NodeInfo,
    holders_of,
    node_of,
    nodes_in,
    peer_rank,
    replica_targets,
    replicas_held_by,
)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("k_of_n", [lambda n: 1, lambda n: 2, lambda n: n - 1, lambda n: n + 3])
def test_ring_targets_and_inverses(n: int, k_of_n) -> None:
    k = k_of_n(n)
    eff = min(k, n - 1)
    for i in range(n):
        targets = replica_targets(i, n, k)
        assert targets == [(i + d) % n for d in range(1, eff + 1)]
        assert i not in targets and len(set(targets)) == eff
        assert holders_of(i, n, k) == targets
        held = replicas_held_by(i, n, k)
        assert len(set(held)) == eff and i not in held
        # inverse: i holds j's replica exactly when j replicates to i
        assert sorted(held) == sorted(j for j in range(n) if i in replica_targets(j, n, k))
    # every node's files are held by exactly eff others, and every node holds exactly eff replicas
    for i in range(n):
        assert sum(i in replica_targets(j, n, k) for j in range(n)) == eff


def test_ring_examples() -> None:
    assert replica_targets(0, 2) == [1] and replica_targets(1, 2) == [0]
    assert replica_targets(2, 3) == [0]
    assert replica_targets(4, 5, k=2) == [0, 1]
    assert replicas_held_by(0, 5, k=2) == [4, 3]
    assert replica_targets(1, 3, k=10) == [2, 0]


def test_single_node_replicates_nowhere() -> None:
    for k in (1, 2, 5):
        assert replica_targets(0, 1, k) == []
        assert holders_of(0, 1, k) == []
        assert replicas_held_by(0, 1, k) == []


@pytest.mark.parametrize(
    "call",
    [
        lambda: replica_targets(0, 3, 0),
        lambda: replica_targets(0, 3, -1),
        lambda: replica_targets(3, 3),
        lambda: replica_targets(-1, 3),
        lambda: replica_targets(0, 0),
        lambda: replicas_held_by(0, 3, 0),
        lambda: holders_of(5, 2),
        lambda: replica_targets(0, 3, 1.5),
        lambda: replica_targets(0, True),
    ],
)
def test_bad_placement_input(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_node_of_nodes_in_peer_rank() -> None:
    assert [node_of(r, 4) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert nodes_in(8, 4) == 2 and nodes_in(3, 1) == 3 and nodes_in(4, 4) == 1
    assert peer_rank(1, 2, 4) == 6
    for r in range(12):
        assert peer_rank(node_of(r, 4), r % 4, 4) == r
    with pytest.raises(ValueError, match="multiple"):
        nodes_in(6, 4)
    for bad in (lambda: nodes_in(0, 1), lambda: nodes_in(4, 0), lambda: nodes_in(4.0, 2)):
        with pytest.raises(ValueError, match="positive int"):
            bad()
    with pytest.raises(ValueError):
        node_of(-1, 4)
    with pytest.raises(ValueError):
        node_of(1, 0)
    with pytest.raises(ValueError):
        peer_rank(0, 4, 4)


def test_node_info_from_env() -> None:
    env = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    info = NodeInfo.from_env(env)
    assert info == NodeInfo(node_rank=1, nnodes=2, local_rank=2, local_world_size=4, rank=6, world_size=8)
    assert info.multi_node
    with pytest.raises(AttributeError):
        info.rank = 0  # type: ignore[misc]


def test_node_info_defaults_to_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = NodeInfo.from_env()
    assert info == NodeInfo(node_rank=0, nnodes=1, local_rank=0, local_world_size=1, rank=0, world_size=1)
    assert not info.multi_node
    # torch.distributed-style env without torchrun's node variables: all ranks on one node
    assert NodeInfo.from_env({"RANK": "3", "WORLD_SIZE": "4"}) == NodeInfo(0, 1, 3, 4, 3, 4)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "x", "WORLD_SIZE": "2"},
        {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"},
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"},
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"},
    ],
)
def test_node_info_bad_env(env: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        NodeInfo.from_env(env)


def test_node_info_names_the_variable_that_is_no_int() -> None:
    expected = r"\$GROUP_RANK='one' is not an int \(torchrun's rank of this node\)"
    with pytest.raises(ValueError, match=expected):
        NodeInfo.from_env({"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "one"})
