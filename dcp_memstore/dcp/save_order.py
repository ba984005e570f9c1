"""Keeping a process's background saves of one job in submission order.

DCP's THREAD executor runs each ``async_save`` in its own thread. Two saves running at once would issue
their collectives on the same process group in an order that can differ between ranks, which hangs or
mixes them up. Each staged save gets a ticket in staging order; its background work starts (``begin``)
only when every earlier ticket's thread has ended. A ticket sent to another process (DCP's PROCESS
executor pickles the writer) is that process's to order: its own saves there run one after another.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from dcp_memstore.errors import StagingTimeoutError


@dataclass
class Ticket:
    seq: int
    slot: str | None = None  # the staging slot this save's data is in
    thread: threading.Thread | None = None
    remote: bool = False
    issued: float = field(default_factory=time.monotonic)

    def finished(self) -> bool:
        """True once this save can no longer issue collectives in this process."""
        return self.remote or (self.thread is not None and not self.thread.is_alive())


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

    def issue(self, slot: str | None) -> Ticket:
        with self._lock:
            t = Ticket(self._next, slot)
            self._tickets[t.seq] = t
            self._next += 1
            return t

    def tickets(self) -> list[Ticket]:
        with self._lock:
            return list(self._tickets.values())

    def begin(self, seq: int | None, timeout_s: float) -> None:
        """Bind ticket ``seq`` (None: a synchronous save) to this thread and wait for all earlier saves."""
        me = threading.current_thread()
        with self._lock:
            mine = self._tickets.get(seq) if seq is not None else None
            if mine is not None:
                mine.thread = me
            limit = seq if seq is not None else self._next
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            with self._lock:
                waiting = [
                    t
                    for t in self._tickets.values()
                    if t.seq < limit and t.thread is not me and not t.finished()
                ]
                for t in [
                    t for t in self._tickets.values() if t.finished() and t.seq < limit and not _slot_left(t)
                ]:
                    del self._tickets[t.seq]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise StagingTimeoutError(
                    f"a checkpoint save waited {timeout_s:.0f}s for {len(waiting)} earlier save(s) of this job to "
                    "finish; wait on the futures dcp.async_save returns, or raise MemStore(stage_timeout_s=...)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

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


def _slot_left(t: Ticket) -> bool:
    """Whether the ticket's staging slot is still on disk (the stager still has to recycle it)."""
    return t.slot is not None and os.path.isdir(t.slot)
