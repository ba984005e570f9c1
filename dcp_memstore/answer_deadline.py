"""The deadline of the wait running in this context, for the looks it makes at other machines.

A wait with a timeout (``wait_persisted``, ``wait_replicated``, ``close``) asks the persistent target
whether a checkpoint is published and the job's other nodes what they hold. A target or a node that does not
answer (a frozen server, a hung process, a link that drops packets) would hold each look for its own
timeout: minutes of s3fs's retries, or ``replication_timeout_s`` per node. Within ``answer_by(deadline)``
those looks take ``answer_limit()`` seconds at most instead. A context variable, not an argument, because
the looks sit several calls below the waits, behind the status queries they share with callers that have no
deadline; it is read in the waiting thread and passed on explicitly to the threads that ask in parallel.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

MIN_ANSWER_S = 0.5  # the least time a look gets, also once the deadline is past (its answer is wanted)
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "dcp_memstore_deadline", default=None
)


@contextlib.contextmanager
def answer_by(deadline: float | None) -> Iterator[None]:
    """Within the block, looks at other machines give up at ``deadline`` (``time.monotonic()``; None: no
    limit but their own), or after ``MIN_ANSWER_S`` once it is past."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def answer_limit() -> float | None:
    """Seconds a look started now may take under the deadline of ``answer_by``; None outside one."""
    deadline = _DEADLINE.get()
    return None if deadline is None else max(MIN_ANSWER_S, deadline - time.monotonic())
