"""Fixtures for the multi-process tests: a tmpfs store root plus spawned jobs that are always reaped."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # mp_harness, whatever pytest's import mode

from mp_harness import MultiProc  # noqa: E402


@pytest.fixture
def mp() -> Iterator[MultiProc]:
    """Jobs of one test and their store root under /dev/shm; every process is killed and every
    directory removed at teardown, whatever the test's outcome."""
    m = MultiProc()
    try:
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def module_mp() -> Iterator[MultiProc]:
    """Like ``mp``, shared by the tests of one module (a checkpoint saved once, loaded several ways)."""
    m = MultiProc()
    try:
        yield m
    finally:
        m.close()
