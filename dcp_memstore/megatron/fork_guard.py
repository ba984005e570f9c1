"""Making Megatron's forked async writer unlikely to hang in ``os.fork()`` on CPython 3.10 and 3.11.

Megatron's ``AsyncCallsQueue`` (with its default, non-persistent caller) forks the trainer to run each
save's write, right after the save's collectives. CPython before 3.12 has the child of a fork take the
lock of the interpreter's thread-state list once before it re-creates that lock (CPython issue
gh-112275): if any thread of the trainer held the lock at the fork, the child waits for it forever,
inside ``os.fork()``, before any of the writer's code runs. The save then never ends: Megatron's blocking
finalize waits for the writer for good, and the store's next save gives up after ``stage_timeout_s``.

Threads that are not Python's take that lock without the GIL whenever they make a Python thread state,
as a process group's threads do to free a finished collective's tensors (gloo's run loop makes one, and
drops it, per freed work), which happens right as Megatron forks.

``install`` has every later fork of this process first let go of the GIL for ``YIELD_S``, so that such a
thread waiting for the GIL can finish and drop its thread state, and then wait until no thread holds the
lock (``sys._current_frames()`` takes it; a holder needs no GIL to release it). This narrows the window
but cannot close it from Python: a thread may still take the lock between this hook and the fork.
Under Python 3.10.13 the writer-crash Megatron test hung in 5 of 71 runs without it, and in none of 71
runs with it (docs/compatibility.md). Python >= 3.12 rules the hang out, per the CPython issue.
"""

from __future__ import annotations

import os
import sys
import threading
import time

# CPython releases whose forked child takes the thread-state lock before re-creating it
AFFECTED = sys.version_info < (3, 12)
YIELD_S = 0.001  # the GIL is let go this long before each fork
_installed = False
_lock = threading.Lock()


def wait_for_thread_state_lock() -> None:
    """Let threads that wait for the GIL to drop a thread state do so, then return once no thread holds
    the interpreter's thread-state lock (``sys._current_frames()`` takes and releases it)."""
    time.sleep(YIELD_S)
    sys._current_frames()


def install() -> bool:
    """Register ``wait_for_thread_state_lock`` to run before every fork of this process, once, where the
    running CPython needs it; whether it is registered."""
    global _installed
    with _lock:
        if AFFECTED and not _installed:
            os.register_at_fork(before=wait_for_thread_state_lock)
            _installed = True
        return _installed
