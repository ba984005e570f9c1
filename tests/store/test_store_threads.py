"""Thread helpers: a call on a thread of its own (for per-thread CUDA state) returns and raises as inline."""

from __future__ import annotations

import threading

import pytest

from dcp_memstore.store.threads import in_own_thread, run_parallel


def test_in_own_thread_runs_elsewhere_and_returns_the_value() -> None:
    here = threading.get_ident()
    ran_on, value = in_own_thread(lambda: (threading.get_ident(), 42))
    assert value == 42
    assert ran_on != here


def test_in_own_thread_raises_the_callee_exception_here() -> None:
    def fail() -> None:
        raise KeyError("from the other thread")

    with pytest.raises(KeyError, match="from the other thread"):
        in_own_thread(fail)


def test_run_parallel_keeps_the_order_of_items() -> None:
    assert run_parallel(lambda x: x * x, range(7), threads=3) == [x * x for x in range(7)]
