"""The rules of a wait that asks other nodes: when it asks again, when it gives up on nodes that do not
answer (at its deadline: TimeoutError; after ``replication_timeout_s`` in a row: their error), how long
it pauses between looks, and how often a node that cannot be asked is warned about."""

from __future__ import annotations

import logging
import time

import pytest

from dcp_memstore.answer_deadline import MAX_POLL_S, optional_timeout, poll_pause, unanswered_since
from dcp_memstore.errors import NodesUnansweredError
from dcp_memstore.replication.asking import warn_unanswered

WHAT = "checkpoint 'c' not persisted after 2.0 s"


def test_nodes_that_do_not_answer_are_asked_again_until_the_deadline_then_a_timeout_names_them():
    error = NodesUnansweredError("node 1 (10.0.0.2:5) did not answer")
    since = unanswered_since(error, None, 30.0, time.monotonic() + 60, WHAT)
    assert unanswered_since(error, since, 30.0, time.monotonic() + 60, WHAT) == since  # ask again
    with pytest.raises(TimeoutError, match=r"^checkpoint 'c' not persisted after 2\.0 s: node 1 .* did not"):
        unanswered_since(error, since, 30.0, time.monotonic() - 0.01, WHAT)


def test_nodes_unanswered_for_replication_timeout_s_in_a_row_end_a_wait_even_without_a_timeout():
    """A node whose server is gone never answers: a wait without a timeout raises its error after the
    store's replication_timeout_s of unanswered looks, instead of asking for ever."""
    error = NodesUnansweredError("node 1 (10.0.0.2:5) did not answer")
    since = unanswered_since(error, None, 0.2, None, WHAT)
    assert unanswered_since(error, since, 0.2, None, WHAT) == since
    time.sleep(0.25)
    with pytest.raises(NodesUnansweredError) as e:
        unanswered_since(error, since, 0.2, None, WHAT)
    assert e.value is error


def test_the_pause_between_looks_doubles_up_to_its_cap_and_never_passes_the_deadline():
    start = time.monotonic()
    assert poll_pause(0.05, None) == 0.1
    assert poll_pause(0.4, time.monotonic() + 0.01) == MAX_POLL_S
    assert time.monotonic() - start < 0.05 + 0.01 + 0.2  # the second slept to the deadline, not 0.4 s


def test_timeouts_of_years_are_no_limit():
    assert optional_timeout("timeout", 1e8) is None and optional_timeout("timeout", float("inf")) is None
    assert optional_timeout("timeout", 9.9e7) == 9.9e7


def test_a_node_that_cannot_be_asked_is_warned_about_once_a_minute_for_each_kind_of_error(caplog):
    log = logging.getLogger("dcp_memstore.test_asking")
    peer = ("10.0.0.99", 4242)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for _ in range(3):
            warn_unanswered(log, peer, ConnectionRefusedError(), "cannot ask %s", "node 9")
        warn_unanswered(log, peer, TimeoutError(), "cannot ask %s", "node 9")
    levels = [r.levelname for r in caplog.records]
    assert levels == ["WARNING", "DEBUG", "DEBUG", "WARNING"], levels
