"""SaveOrder's view of saves sent to DCP's checkpoint process (PROCESS executor): answered or still running
there, which decides whether the directories that process began may be reclaimed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dcp_memstore.dcp import save_order
from dcp_memstore.dcp.save_order import SaveOrder


def _send(order: SaveOrder, seq: int, answer: threading.Event) -> None:
    """What DCP's executor thread does: bind the ticket (pickling the writer), then wait for the answer."""
    order.bind(seq, sent=True)
    assert answer.wait(30)


@pytest.mark.parametrize("sent_from_executor", [True, False])
def test_a_sent_save_is_answered_once_its_thread_has_left_the_executor_or_ended(
    monkeypatch, sent_from_executor
):
    """DCP's executor thread outlives the answer a little (it returns to its thread pool, then ends): once it
    has left the executor's code the save no longer runs in the checkpoint process. A thread that did not
    send from the executor's code counts only once it has ended."""
    # stands in for DCP's executor file: _send, in this file, plays the part of its sending code
    monkeypatch.setattr(
        save_order, "_PROCESS_EXECUTOR_FILE", __file__ if sent_from_executor else "elsewhere.py"
    )
    order = SaveOrder()
    assert not order.sent_saves_answered()  # nothing was sent
    ticket = order.issue()
    answer = threading.Event()
    pool = ThreadPoolExecutor(1)
    try:
        sending = pool.submit(_send, order, ticket.seq, answer)
        while ticket.thread is None:
            time.sleep(0.001)
        assert not order.sent_saves_answered()  # waiting for the answer
        answer.set()
        sending.result(timeout=30)
        assert ticket.thread.is_alive()  # the pool's thread, idle now
        assert order.sent_saves_answered() is sent_from_executor
    finally:
        pool.shutdown(wait=True)
    assert order.sent_saves_answered()  # the thread has ended
