"""Asking the job's nodes what they hold, all at once: the thread pool the questions run on, and the warning
about a node that does not answer.

Looks made under a wait's deadline (``answer_deadline``) run on a pool of their own: a look without one (a
``status``, a load) held for ``replication_timeout_s`` by a node that does not answer must not keep a wait
with a timeout from starting its own. A wait asks again and again, so a node that cannot be asked is
warned about once a minute for each kind of error (any look's), and at DEBUG in between.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from dcp_memstore.replication.transport import PeerAddress

WARN_EVERY_S = 60.0
_warned: dict[tuple[str, int, str], float] = {}  # (peer, error type) -> when last warned about
_warned_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    """A forked child (DCP's checkpoint process, Megatron's writer) has none of the parent's threads: a
    lock one of them held at the fork would never be released there."""
    global _warned_lock
    _warned_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def asking_pool(deadline: float | None) -> str:
    """The name of the thread pool (``run_parallel``) for questions to the nodes with ``deadline``."""
    return "cluster" if deadline is None else "cluster_waits"


def warn_unanswered(
    log: logging.Logger, peer: PeerAddress, error: BaseException, msg: str, *args: Any
) -> None:
    """Log ``msg % args`` about ``peer``, which could not be asked for ``error``, at WARNING, or at DEBUG
    if one about the same peer and type of error was logged less than ``WARN_EVERY_S`` ago."""
    now, key = time.monotonic(), (peer[0], int(peer[1]), type(error).__name__)
    with _warned_lock:
        quiet = now - _warned.get(key, -WARN_EVERY_S) < WARN_EVERY_S
        if not quiet:
            _warned[key] = now
    log.log(logging.DEBUG if quiet else logging.WARNING, msg, *args)
