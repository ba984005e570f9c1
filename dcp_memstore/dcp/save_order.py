"""Keeping a process's background saves of one job in submission order.

DCP's THREAD executor runs each ``async_save`` in its own thread. Two saves running at once would issue
their collectives on the same process group in an order that can differ between ranks, which hangs or
mixes them up. Each staged save gets a ticket in staging order; its background work starts (``begin``)
only when every earlier ticket's save is over there (``Ticket.finished``). With DCP's PROCESS executor the
ticket is bound to the executor thread that sends the save to DCP's checkpoint process (``bind``): that
thread ends once the checkpoint process has answered, and saves are sent in staging order
(``wait_sent_in_order``). Whether every save sent there has been answered (``sent_saves_answered``) tells
the trainer that the directories that process began and left uncommitted are failed saves' (it runs one
save at a time).
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.checkpoint import state_dict_saver

from dcp_memstore.errors import StagingTimeoutError
from dcp_memstore.store.threads import runs_code_of


def _executor_file(name: str) -> str | None:
    """The source file of DCP's executor class ``name``; None in a torch without it."""
    executor = getattr(state_dict_saver, name, None)
    return None if executor is None else inspect.getfile(executor)


# whose thread sends a save to DCP's checkpoint process and waits there for the answer
_PROCESS_EXECUTOR_FILE = _executor_file("_ProcessBasedAsyncCheckpointExecutor")
# whose thread runs one save (inside that file's code while it runs), then idles until it is shut down
_THREAD_EXECUTOR_FILE = _executor_file("_ThreadBasedAsyncCheckpointExecutor")


@dataclass
class Ticket:
    seq: int
    slot: str | None = None  # the staging slot this save's data is in
    thread: threading.Thread | None = None  # the thread running (or sending) the save, once it started
    sent: bool = False  # sent to DCP's checkpoint process (PROCESS executor), which runs it
    # the source file of the DCP executor whose code ``thread`` ran this save in (THREAD executor) or sent
    # it from (PROCESS executor): once the thread has left that code, the save is over there
    executor_file: str | None = None
    checkpoint_id: str | None = None  # once the save has begun (``begin``), for messages

    def describe(self) -> str:
        """This save, for messages: its checkpoint once it began, else its place in the order."""
        return repr(self.checkpoint_id) if self.checkpoint_id is not None else f"save {self.seq} (not begun)"

    def finished(self) -> bool:
        """True once this save can no longer issue collectives in this process: its thread has ended, or
        it is DCP's THREAD executor thread and has left that executor's code. That thread lives on a
        little after the save's future is set, and a store closed at that moment (``fut.result()``
        raised, then ``close()``) must still recycle the failed save's staging files."""
        if self.thread is None:
            return False
        if not self.thread.is_alive():
            return True
        return not self.sent and self.executor_file is not None and not self._in_executor()

    def _in_executor(self) -> bool:
        return self.thread is not None and runs_code_of(self.thread, self.executor_file)

    def answered(self) -> bool:
        """For a ``sent`` save: True once DCP's checkpoint process has answered, so it no longer runs it:
        the sending thread has ended, or has left DCP's executor, where it waits for the answer. A thread
        that sent it from elsewhere (another torch) counts only once it has ended."""
        if self.finished():
            return True
        return self.executor_file is not None and not self._in_executor()

    def over(self) -> bool:
        """Whether the save is over where it runs: here (``finished``), or in DCP's checkpoint process for a
        ``sent`` save (``answered``)."""
        return self.answered() if self.sent else self.finished()

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

    @classmethod
    def abandon_later(cls, job: str, seq: int, slot: str | None) -> None:
        """Note that ticket ``seq`` will never run. Takes no lock, so a garbage-collection finalizer may call
        it at any moment; the book forgets the ticket at its next use and hands out its slot to recycle."""
        book = cls._books.get(job)
        if book is not None:
            book._abandoned.append((seq, slot))

    @classmethod
    def _fresh_locks_in_child(cls) -> None:
        """A forked child has none of the parent's threads: locks they held at the fork are replaced."""
        cls._books_lock = threading.Lock()
        for book in cls._books.values():
            book._lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._tickets: dict[int, Ticket] = {}
        self._abandoned: deque[tuple[int, str | None]] = deque()
        self._sent = False  # a save of the job was sent to DCP's checkpoint process

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

    def take_abandoned(self) -> list[str]:
        """Forget the tickets noted by ``abandon_later`` (never started); return their slots to recycle."""
        slots = []
        with self._lock:
            while self._abandoned:
                seq, slot = self._abandoned.popleft()
                t = self._tickets.get(seq)
                if t is not None and t.thread is None:
                    del self._tickets[seq]
                    if slot is not None:
                        slots.append(slot)
        return slots

    def bind(self, seq: int | None, sent: bool = False, checkpoint_id: str | None = None) -> None:
        """Bind ticket ``seq`` (the save of ``checkpoint_id``, where known) to the calling thread: the save
        runs there, or with ``sent``, is sent from there to DCP's checkpoint process."""
        with self._lock:
            t = self._tickets.get(seq) if seq is not None else None
            if t is not None:
                t.thread = threading.current_thread()
                t.checkpoint_id = checkpoint_id or t.checkpoint_id
                if sent:
                    t.sent, self._sent = True, True
                executor = _PROCESS_EXECUTOR_FILE if sent else _THREAD_EXECUTOR_FILE
                t.executor_file = executor if executor and runs_code_of(t.thread, executor) else None

    def sent_saves_answered(self) -> bool:
        """Whether saves of the job were sent to DCP's checkpoint process and it has answered every one: it
        runs none of them now (it runs the saves sent to it one after another)."""
        with self._lock:
            return self._sent and all(t.answered() for t in self._tickets.values() if t.sent)

    def begin(
        self, seq: int | None, timeout_s: float, api: SaveApi, checkpoint_id: str | None = None
    ) -> None:
        """Bind ticket ``seq`` (the save of ``checkpoint_id``) to this thread and wait until every earlier
        save has ended here; ``api`` (how the user makes saves) is named in the StagingTimeoutError's
        advice.

        ``seq=None`` is a synchronous ``dcp.save``: it waits for every async save staged before it."""
        me = threading.current_thread()
        self.bind(seq, checkpoint_id=checkpoint_id)
        limit = self._next if seq is None else seq

        def blocking() -> list[Ticket]:
            return [t for t in self.tickets() if t.seq < limit and t.thread is not me and not t.finished()]

        self._wait(blocking, timeout_s, "to finish", api)

    def wait_sent_in_order(self, seq: int, timeout_s: float, api: SaveApi) -> None:
        """Before ticket ``seq`` goes to DCP's checkpoint process: wait until every earlier save has been
        answered there, so that process receives the saves in staging order."""
        me = threading.current_thread()

        def blocking() -> list[Ticket]:
            return [t for t in self.tickets() if t.seq < seq and t.thread is not me and not t.finished()]

        self._wait(blocking, timeout_s, "to be written", api)

    def cancel(self, seq: int) -> None:
        """Forget a ticket whose save will never run here (no thread ever bound to it)."""
        with self._lock:
            t = self._tickets.get(seq)
            if t is not None and t.thread is None:
                del self._tickets[seq]

    @staticmethod
    def _wait(blocking: Callable[[], list[Ticket]], timeout_s: float, what: str, api: SaveApi) -> None:
        waiting = wait_while(blocking, timeout_s)
        if waiting:
            raise StagingTimeoutError(
                f"a checkpoint save waited {timeout_s:.0f}s for {len(waiting)} earlier save(s) of this job "
                f"{what} ({', '.join(t.describe() for t in waiting)}); {timeout_advice(waiting, api)}"
            )


@dataclass(frozen=True)
class SaveApi:
    """How the user makes saves, for the advice of the errors they may meet: the call that stages a save,
    and what to check of earlier ones (where a failed save's error surfaces, what must have run), for a
    StagingTimeoutError; the other process a staged save may be sent to, and how to keep it in process
    instead, for a sharing strategy that cannot send it."""

    call: str
    check: str
    other_process: str
    in_process: str


DCP_ASYNC_SAVE = SaveApi(
    call="dcp.async_save",
    check="check the futures of earlier dcp.async_save calls for an error (fut.result())",
    other_process="DCP's checkpoint process",
    in_process="use the THREAD executor",
)


def timeout_advice(waiting: list[Ticket], api: SaveApi) -> str:
    """The end of a StagingTimeoutError's message: what to do about the earlier saves ``waiting``."""
    never = sum(t.thread is None for t in waiting)
    hint = f"{never} of them were staged but never started (did that {api.call} fail?); " if never else ""
    return f"{hint}{api.check}, or raise MemStore(stage_timeout_s=...)"


def wait_while(blocking: Callable[[], list[Ticket]], timeout_s: float) -> list[Ticket]:
    """Poll ``blocking()`` (with a short, growing sleep) until it returns nothing or ``timeout_s`` passes;
    return what still blocks (empty on success)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while (waiting := blocking()) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return waiting


os.register_at_fork(after_in_child=SaveOrder._fresh_locks_in_child)
