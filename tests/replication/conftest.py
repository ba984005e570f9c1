"""Fixtures of the transport tests: the job's secret, this node's store (the sender) and the peer's root."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_memstore.replication.auth import new_secret
from dcp_memstore.store.layout import StoreLayout
from tests.replication.transfer_helpers import JOB


@pytest.fixture
def secret() -> bytes:
    return new_secret()


@pytest.fixture
def local(shm_dir) -> StoreLayout:
    """This node's store (the sender)."""
    lay = StoreLayout(shm_dir / "local", JOB)
    lay.ensure()
    return lay


@pytest.fixture
def peer_root(shm_dir) -> Path:
    return shm_dir / "peer"
