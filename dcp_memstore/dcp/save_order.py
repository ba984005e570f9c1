"""Keeping a process's background saves of one job in submission order.

DCP's THREAD executor runs each ``async_save`` in its own thread. Two saves running at once would issue
their collectives on the same process group in an order that can differ between ranks, which hangs or
mixes them up. Each staged save gets a ticket in staging order; its background work starts (``begin``)
only when every earlier ticket's thread has ended. A ticket sent to another process (DCP's PROCESS
executor pickles the writer) is that process's to order: its own saves there run one after another; here
it only has to be sent after the earlier ones (``wait_sent_in_order``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dcp_memstore.errors import StagingTimeoutError


@dataclass
class Ticket:
    seq: int
    slot: str | None = None  # the staging slot this save's data is in
    thread: threading.Thread | None = None
    remote: bool = False

    def finished(self) -> bool:
        """True once this save can no longer issue collectives in this process."""
        return self.remote or (self.thread is not None and not self.thread.is_alive())

    def running(self, me: threading.Thread) -> bool:
        return self.thread is not None and self.thread is not me and self.thread.is_alive()

    def slot_left(self) -> bool:
        """Whether the ticket's staging slot is still on disk (not yet written into a checkpoint)."""
        return self.slot is not None and os.path.isdir(self.slot)


class SaveOrder:
    """Ticket book of one job in this process."""

    _books: dict[str, SaveOrder] = {}
    _books_lock = threading.Lock()

    @classmethod
    def of(cls, job: str) -> SaveOrder:
        with cls._books_lock:
            return cls._books.setdefault(job, cls())

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._tickets: dict[int, Ticket] = {}

    def issue(self) -> Ticket:
        with self._lock:
            t = Ticket(self._next)
            self._tickets[t.seq] = t
            self._next += 1
            return t

    def tickets(self) -> list[Ticket]:
        """Live tickets; finished ones whose slot is gone are dropped on the way."""
        with self._lock:
            for t in [t for t in self._tickets.values() if t.finished() and not t.slot_left()]:
                del self._tickets[t.seq]
            return list(self._tickets.values())

    def begin(self, seq: int | None, timeout_s: float) -> None:
        """Bind ticket ``seq`` to this thread and wait until every earlier save has ended here.

        ``seq=None`` is a synchronous ``dcp.save``: it waits for the async saves already running."""
        me = threading.current_thread()
        with self._lock:
            mine = self._tickets.get(seq) if seq is not None else None
            if mine is not None:
                mine.thread = me

        def blocking() -> list[Ticket]:
            if seq is None:
                return [t for t in self.tickets() if t.running(me)]
            return [t for t in self.tickets() if t.seq < seq and t.thread is not me and not t.finished()]

        self._wait(blocking, timeout_s, "to finish")

    def wait_sent_in_order(self, seq: int, timeout_s: float) -> None:
        """Before ticket ``seq`` goes to another process: wait until every earlier save there has written
        its slot, so that process receives the saves in staging order."""

        def blocking() -> list[Ticket]:
            return [t for t in self.tickets() if t.seq < seq and (t.slot_left() or not t.finished())]

        self._wait(blocking, timeout_s, "to be written")

    def cancel(self, seq: int) -> None:
        """Forget a ticket whose save will never run here (no thread ever bound to it)."""
        with self._lock:
            t = self._tickets.get(seq)
            if t is not None and t.thread is None:
                del self._tickets[seq]

    def mark_remote(self, seq: int) -> None:
        with self._lock:
            t = self._tickets.get(seq)
            if t is not None:
                t.remote = True

    @staticmethod
    def _wait(blocking: Callable[[], list[Ticket]], timeout_s: float, what: str) -> None:
        waiting = wait_while(blocking, timeout_s)
        if waiting:
            never = [t for t in waiting if t.thread is None and not t.remote]
            hint = (
                f"{len(never)} of them were staged but never started (did that dcp.async_save fail?); "
                if never
                else ""
            )
            raise StagingTimeoutError(
                f"a checkpoint save waited {timeout_s:.0f}s for {len(waiting)} earlier save(s) of this job "
                f"{what}; {hint}wait on the futures dcp.async_save returns, or raise MemStore(stage_timeout_s=...)"
            )


def wait_while(blocking: Callable[[], list[Ticket]], timeout_s: float) -> list[Ticket]:
    """Poll ``blocking()`` (with a short, growing sleep) until it returns nothing or ``timeout_s`` passes;
    return what still blocks (empty on success)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while (waiting := blocking()) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return waiting
