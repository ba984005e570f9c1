"""Calls that a caller waits for only so long: reads of a persistent target for a status or a wait.

A target that does not answer (a frozen server, packets dropped on the way) makes s3fs wait out its
timeouts and retries: minutes. A ``wait_persisted(timeout=2)`` or ``close(timeout=2)`` must not wait that
long for a look at a commit marker. ``BoundedCalls.call`` runs the call in a daemon thread and waits for it
at most the given time; a call that has not returned by then goes on in its thread, and a later call with
the same key waits for that one instead of starting another, so a hung target holds one thread per key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")


class BoundedCalls:
    """Runs calls in daemon threads, one at a time per key, and waits for each at most a given time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Hashable, Future] = {}

    def call(self, key: Hashable, fn: Callable[[], T], limit_s: float) -> T:
        """``fn()``'s result, or what it raised; TimeoutError if it has not returned within ``limit_s``
        seconds. Where a call with ``key`` is still running, its outcome is waited for instead."""
        with self._lock:
            future = self._running.get(key)
            if future is None:
                future = Future()
                threading.Thread(
                    target=self._run, args=(key, future, fn), name="dcp_memstore-bounded-call", daemon=True
                ).start()  # before it is entered: a thread that could not start leaves no call behind
                self._running[key] = future
        try:
            return future.result(timeout=limit_s)
        except FutureTimeout:
            raise TimeoutError(f"no answer within {limit_s:.1f} s") from None

    def forget(self) -> None:
        """Forget the calls running now (in a forked child, whose copy of their threads does not run)."""
        self._lock = threading.Lock()
        self._running = {}

    def _run(self, key: Hashable, future: Future, fn: Callable[[], T]) -> None:
        try:
            outcome = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._end(key, future)
            future.set_exception(e)
        else:
            self._end(key, future)
            future.set_result(outcome)

    def _end(self, key: Hashable, future: Future) -> None:
        """The call of ``future`` has returned: a later call with ``key`` starts anew (one that waits for
        a hung call sees, once it returns, an outcome as old as that call)."""
        with self._lock:
            if self._running.get(key) is future:
                del self._running[key]
