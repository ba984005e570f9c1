"""Thread helpers: a call on a thread of its own (for per-thread CUDA state) returns and raises as inline."""

from __future__ import annotations

import threading
import time

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


def test_run_parallel_raises_only_once_every_running_call_has_ended() -> None:
    """A save whose copy fails on one I/O thread gives its files back to the pool: another thread still
    copying into one of them then would write into the next save's file. The first error (in item order)
    comes once the running calls have ended; calls not started yet are dropped."""
    ended, started = threading.Event(), []

    def task(x: int) -> int:
        started.append(x)
        if x == 0:
            raise OSError("no space left")
        time.sleep(0.5 if x == 1 else 0.05)  # item 1 is still copying when item 0 fails
        if x == 1:
            ended.set()
        return x

    with pytest.raises(OSError, match="no space left"):
        run_parallel(task, range(50), threads=2)
    assert ended.is_set()
    assert len(started) < 50
