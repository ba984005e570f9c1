"""Asking the job's nodes what they hold, all at once: the thread pool the questions run on, and the warning
about a node that does not answer.

Looks made under a wait's deadline (``answer_deadline``) run on a pool of their own: a look without one (a
``status``, a load) held for ``replication_timeout_s`` by a node that does not answer must not keep a wait
with a timeout from starting its own. A wait asks again and again until its deadline, so a node that does
not answer is warned about once a minute, and at DEBUG in between.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from dcp_memstore.replication.transport import PeerAddress

WARN_EVERY_S = 60.0
_warned: dict[tuple[str, int], float] = {}  # peer -> when a warning about it was last logged
_warned_lock = threading.Lock()


def asking_pool(deadline: float | None) -> str:
    """The name of the thread pool (``run_parallel``) for questions to the nodes with ``deadline``."""
    return "cluster" if deadline is None else "cluster_waits"


def warn_unanswered(log: logging.Logger, peer: PeerAddress, msg: str, *args: Any) -> None:
    """Log ``msg % args`` about ``peer`` at WARNING, or at DEBUG if one was logged less than
    ``WARN_EVERY_S`` ago."""
    now, key = time.monotonic(), (peer[0], int(peer[1]))
    with _warned_lock:
        quiet = now - _warned.get(key, -WARN_EVERY_S) < WARN_EVERY_S
        if not quiet:
            _warned[key] = now
    log.log(logging.DEBUG if quiet else logging.WARNING, msg, *args)
