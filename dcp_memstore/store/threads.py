"""Process-wide I/O thread pools, so a save or load does not pay for starting threads each time; and what
another thread is running now (``runs_code_of``)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")
_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()
_niced = threading.local()
BACKGROUND_NICE = 10


def run_parallel(fn: Callable[[Any], T], items: Iterable[Any], threads: int, pool: str = "io") -> list[T]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads (inline for one item or one thread).

    If a call raises, the calls not yet started are dropped and the first error (in item order) is raised
    once the running ones have ended: a caller that cleans up after a failed save (its files go back to
    the pool, to be claimed by the next save) must not do so while another thread still writes into them.
    ``pool`` names the thread pool: staging (which stalls training) has its own, so it never queues behind
    a background save's work."""
    items = list(items)
    threads = min(threads, len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    with _lock:
        executor = _pools.get((pool, threads))
        if executor is None:
            executor = _pools[pool, threads] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"dcp_memstore_{pool}"
            )
    futures = [executor.submit(fn, x) for x in items]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()  # not started: pointless once one call failed
    wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


def in_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on a new thread of its own, which ends with it; its exception is raised here.

    For calls that leave per-thread state behind: CUDA's last-error state, for one, which a failed
    ``cudaHostRegister`` sets and the next kernel launch of that thread would report as its own failure."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            out.append((False, e))

    t = threading.Thread(target=run, name="dcp_memstore_own")
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def runs_code_of(thread: threading.Thread, filename: str) -> bool:
    """Whether ``thread`` is inside code of the source file ``filename`` now (some frame of its stack is):
    to tell what another thread is doing, e.g. whether it is still inside one of DCP's calls."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return True
        frame = frame.f_back
    return False


def _start_child_without_pools() -> None:
    """In a forked child (Megatron's async writer forks the trainer) none of the parent's threads exist:
    its pools would never run work, and a lock a parent thread held at the fork would never be released."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_start_child_without_pools)


def yield_cpu_to_training() -> None:
    """Lower this thread's CPU priority (nice +10, Linux: per thread), once: background work (uploads,
    replication) uses the CPU that training leaves, instead of competing with it."""
    if getattr(_niced, "done", False):
        return
    _niced.done = True
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()  # threads it starts inherit the value: set it, do not add to it
        os.setpriority(os.PRIO_PROCESS, tid, max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
