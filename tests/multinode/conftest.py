"""Fixtures for the multi-node tests: clusters of network namespaces (see tests/netns.py), each node with
its own address and tmpfs store root. Skipped where namespaces cannot be built (not root, no iproute2)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.netns import Cluster, cleanup_stale, netns_unavailable


@pytest.fixture(scope="session", autouse=True)
def _stale_clusters_removed() -> None:
    """Before the first multi-node test: remove namespaces, mounts and directories left by runs that
    crashed or were killed (their creating process is gone; live runs in parallel are left alone)."""
    cleanup_stale()


def _cluster(n: int) -> Iterator[Cluster]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    c = Cluster(n).start()  # a failed start removes what it built before raising
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def cluster2() -> Iterator[Cluster]:
    """A started 2-node Cluster; closed (processes killed, namespaces and tmpfs removed) afterwards."""
    yield from _cluster(2)


@pytest.fixture
def cluster3() -> Iterator[Cluster]:
    """A started 3-node Cluster; closed (processes killed, namespaces and tmpfs removed) afterwards."""
    yield from _cluster(3)
