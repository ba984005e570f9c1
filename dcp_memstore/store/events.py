"""Structured events: what each phase of a checkpoint did, how many bytes it moved and how long it took.

Every phase reports one ``Event`` when it ends, so that users see the stall training pays (``stage``, and
``write`` and ``commit`` of a synchronous save), the bandwidth of each tier (``write``, ``replicate``,
``upload``) and what is still owed (``persist``, ``replicate``):

- ``stage``: a rank's tensors copied off the device for ``dcp.async_save`` (training waits for this).
- ``write``: a rank's shard files written (or, staged by ``async_save``, checksummed and moved in).
- ``commit``: the coordinator made the checkpoint visible; ``nbytes`` is the whole checkpoint's.
- ``replicate``: this process's files of a checkpoint sent to one peer node (``target``).
- ``restore``: a checkpoint this node lost, fetched back from its peers (``latest_checkpoint``).
- ``upload``: this process's share of a checkpoint uploaded to persistent storage (``target``).
- ``persist``: the checkpoint published there; ``seconds`` counts from its commit, the time it took to
  become durable.

A failure of a background phase is an event too (``ok`` False, ``error``, and ``retry_s``: the delay
before the next attempt, None where it was given up). ``owed`` lists, after a successful
``persist`` or ``replicate`` event, the checkpoints of the job this node still owes to that tier.

``emit`` logs each event on the ``dcp_memstore.events`` logger (INFO; the ``Event`` is the log record's
``dcp_memstore_event`` attribute, for a structured handler) and calls the ``on_event`` callbacks of the
job's stores open in this process (``listen``). Callbacks run in the thread that did the work, a
background thread for all but synchronous saves and staging, so they should be quick; one that raises is
logged and never propagated: reporting never fails a save. A forked child (Megatron's async worker) or
DCP's checkpoint process (PROCESS executor) logs its events but calls no callback: those belong to the
process that opened the store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dcp_memstore.store.layout import StoreLayout

log = logging.getLogger("dcp_memstore.events")  # a name of its own: users route or silence it
PHASES = ("stage", "write", "commit", "replicate", "restore", "upload", "persist")


@dataclasses.dataclass(frozen=True)
class Event:
    """One phase of one checkpoint, as it ended (see the module docstring for the phases)."""

    phase: str
    checkpoint_id: str | None  # None: the staging of a save sent to DCP's checkpoint process (see writer)
    job_id: str
    rank: int
    seconds: float
    nbytes: int = 0
    ok: bool = True
    target: str | None = None  # replicate: the peer node; upload/persist: the checkpoint's URL
    error: str | None = None
    retry_s: float | None = None  # a failure: the delay before the next attempt; None: given up
    owed: tuple[str, ...] | None = None  # persist/replicate: checkpoints this node still owes that tier
    at: float = dataclasses.field(default_factory=time.time)  # wall-clock time it ended

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1 GB = 1e9 bytes); 0 where no time was measured. Not a bandwidth for
        ``commit`` (which moves no data: its ``nbytes`` is the checkpoint's size)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """The fields as a plain dict (for JSON or a metrics logger), with ``gb_per_s``."""
        return {**dataclasses.asdict(self), "gb_per_s": self.gb_per_s}

    def __str__(self) -> str:
        where = f" to {self.target}" if self.target else ""
        rate = "" if self.phase == "commit" else f" ({self.gb_per_s:.2f} GB/s)"  # a commit moves no data
        text = f"{self.phase} {self.checkpoint_id!r} rank {self.rank}: {self.nbytes} bytes in "
        text += f"{self.seconds:.3f} s{rate}{where}"
        if not self.ok:
            then = "given up" if self.retry_s is None else f"retrying in {self.retry_s:.1f} s"
            text += f" FAILED ({then}): {self.error}"
        if self.owed is not None:
            text += f"; still owed: {list(self.owed)}"
        return text


Callback = Callable[[Event], None]
_listeners: dict[Path, list[Callback]] = {}  # job directory -> callbacks of this process's open stores
_guard = threading.Lock()


def listen(layout: StoreLayout, callback: Callback) -> None:
    """Call ``callback`` with every event of ``layout``'s job emitted in this process, until ``unlisten``."""
    with _guard:
        _listeners.setdefault(layout.job_dir, []).append(callback)


def unlisten(layout: StoreLayout, callback: Callback) -> None:
    """Stop calling ``callback`` (a store closed); nothing if it was not listening."""
    with _guard:
        callbacks = _listeners.get(layout.job_dir, [])
        if callback in callbacks:
            callbacks.remove(callback)
        if not callbacks:
            _listeners.pop(layout.job_dir, None)


def emit(
    layout: StoreLayout, phase: str, checkpoint_id: str | None, rank: int, seconds: float, **fields
) -> Event:
    """Report that ``phase`` of ``checkpoint_id`` ended (``fields``: the other ``Event`` fields): logged,
    and passed to the job's callbacks in this process. Returns the event."""
    event = Event(phase, checkpoint_id, layout.job_id, rank, seconds, **fields)
    log.info("%s", event, extra={"dcp_memstore_event": event})
    with _guard:
        callbacks = list(_listeners.get(layout.job_dir, ()))
    for callback in callbacks:
        try:
            callback(event)
        except (Exception, SystemExit):  # noqa: BLE001 - a user's callback (sys.exit() on a failure too):
            # reporting never fails the work reported, nor ends the background thread that reports it
            log.exception("on_event callback %r failed on %s", callback, event)
    return event


def _forget_in_child() -> None:
    """A forked child runs no callback of its parent's stores (see the module docstring)."""
    global _guard
    _guard = threading.Lock()
    _listeners.clear()


os.register_at_fork(after_in_child=_forget_in_child)
