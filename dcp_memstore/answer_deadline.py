"""Timeouts of waits, and the deadline of the wait running in this context for its looks at other machines.

A wait with a timeout (``wait_persisted``, ``wait_replicated``, ``close``) asks the persistent target
whether a checkpoint is published and the job's other nodes what they hold. A target or a node that does not
answer (a frozen server, a hung process, a link that drops packets) would hold each look for its own
timeout: minutes of s3fs's retries, or ``replication_timeout_s`` per node. Within ``answer_by(deadline)``
those looks end by ``look_deadline()`` instead. A context variable, not an argument, because the looks sit
several calls below the waits, behind the status queries they share with callers that have no deadline;
it is read in the waiting thread and passed on explicitly to the threads that ask in parallel.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Iterator

from dcp_memstore.errors import NodesUnansweredError

# A timeout option at or above this (math.inf included) means no limit. It is taken as this many seconds
# (over three years): socket and lock timeouts, and torch.distributed store waits, refuse infinity, and
# sockets and thread waits refuse anything from about 9.2e9 s.
NO_LIMIT_S = 1e8
MIN_ANSWER_S = 0.5  # the least time a look gets, also once the deadline is past (its answer is wanted)
MAX_POLL_S = 0.5  # the longest pause between two polls of a wait that asks other machines
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "dcp_memstore_deadline", default=None
)


def optional_timeout(name: str, value: object) -> float | None:
    """``value`` as a number of seconds to wait, None for no limit (also for ``math.inf`` and anything from
    ``NO_LIMIT_S`` up); a ValueError naming the argument for anything else: a str, a bool, a negative
    number, NaN (with which a wait would never time out)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be None (no limit) or a number of seconds >= 0, got {value!r}")
    return None if math.isinf(value) or value >= NO_LIMIT_S else float(value)


@contextlib.contextmanager
def answer_by(deadline: float | None) -> Iterator[None]:
    """Within the block, looks at other machines give up at ``deadline`` (``time.monotonic()``; None: no
    limit but their own), or ``MIN_ANSWER_S`` after they start once it is past."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def sooner(deadline: float) -> float:
    """``deadline``, or the deadline of the enclosing ``answer_by`` if that comes first: a call that
    bounds its own looks (``persist``) inside a wait with a timeout (``close``) keeps the wait's."""
    outer = _DEADLINE.get()
    return deadline if outer is None else min(deadline, outer)


def look_deadline() -> float | None:
    """When a look started now must end under the deadline of ``answer_by`` (``time.monotonic()``); None
    outside one."""
    deadline = _DEADLINE.get()
    return None if deadline is None else max(deadline, time.monotonic() + MIN_ANSWER_S)


def answer_limit() -> float | None:
    """Seconds a look started now may take under the deadline of ``answer_by``; None outside one."""
    deadline = look_deadline()
    return None if deadline is None else deadline - time.monotonic()


def poll_pause(pause: float, deadline: float | None) -> float:
    """Sleep ``pause`` seconds, less where ``deadline`` (``time.monotonic()``) comes first; the pause for
    the next poll: doubled, up to ``MAX_POLL_S`` (a wait that asks other machines asks them less often
    the longer it waits)."""
    time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
    return min(2 * pause, MAX_POLL_S)


def unanswered_since(
    error: NodesUnansweredError,
    since: float | None,
    patience_s: float,
    deadline: float | None,
    what: str,
) -> float:
    """In a wait whose look raised ``error`` (no node that answered holds the checkpoint, some did not
    answer): when they first went unanswered in a row (``since``, now if None), to ask again. Raises
    TimeoutError (``what``: "checkpoint 'x' not persisted after 2.0 s") once ``deadline`` is past, and
    ``error`` itself once they have gone unanswered for ``patience_s`` (the store's
    ``replication_timeout_s``): a node whose server is gone (ended, or closed its store) never answers,
    and nothing else would end a wait without a timeout."""
    now = time.monotonic()
    if deadline is not None and now >= deadline:
        raise TimeoutError(f"{what}: {error}") from error
    if since is not None and now - since >= patience_s:
        raise error
    return now if since is None else since
