"""The fork guard of ``dcp_memstore.megatron``: where it is installed, and that it is installed once.

That it makes Megatron's forked writer unlikely to hang was measured by running
``test_megatron_writer_crash.py`` in a loop under Python 3.10 (docs/compatibility.md): no test can hold
CPython's thread-state lock on purpose, and the hang it guards against is a race. Here
``os.register_at_fork`` is recorded, not called, since a registered fork handler cannot be removed from
the test process.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

from dcp_memstore.megatron import MemStoreSaveStrategy, fork_guard  # noqa: E402


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The fork handlers the guard registers from now on (recorded; the guard starts uninstalled)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(fork_guard.os, "register_at_fork", lambda **kw: calls.append(kw))
    monkeypatch.setattr(fork_guard, "_installed", False)
    return calls


@pytest.mark.parametrize("affected", [True, False])
def test_the_guard_is_registered_once_and_only_where_cpython_needs_it(
    registered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, affected: bool
) -> None:
    monkeypatch.setattr(fork_guard, "AFFECTED", affected)
    assert fork_guard.install() is affected
    assert fork_guard.install() is affected
    assert registered == ([{"before": fork_guard.wait_for_thread_state_lock}] if affected else [])


def test_cpython_before_3_12_is_affected() -> None:
    assert fork_guard.AFFECTED is (sys.version_info < (3, 12))


def test_a_save_strategy_installs_the_guard(registered: list[dict[str, Any]], store: Any) -> None:
    """Megatron forks the trainer for each write of a save made with the strategy."""
    MemStoreSaveStrategy(store)
    MemStoreSaveStrategy(store)
    expected = [{"before": fork_guard.wait_for_thread_state_lock}] if fork_guard.AFFECTED else []
    assert registered == expected


def test_a_fork_after_the_wait_runs_the_child() -> None:
    """The wait returns (no thread holds the lock here) and the process forks as before."""
    fork_guard.wait_for_thread_state_lock()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7
