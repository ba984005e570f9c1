"""Crash points for tests: a real SIGKILL of this process at a named step of a save.

Set ``DCP_MEMSTORE_CRASH_AT`` to one of ``CRASH_POINTS`` (optionally ``POINT:RANK`` to crash only that
rank, ``POINT:RANK:N`` to crash the Nth time the point is reached on that rank) and the process kills
itself with SIGKILL when it gets there. It exists so tests can prove that a crash at each step of the
commit protocol (and of publication to persistent storage) leaves a consistent state; with the
variable unset it does nothing.
"""

from __future__ import annotations

import os
import signal

ENV = "DCP_MEMSTORE_CRASH_AT"
CRASH_POINTS = (
    "stage-slot",  # in stage(), the staging slot made, its owner record not written yet
    "stage-copy",  # in stage(), after some tensors were copied into the staging slot
    "write-data",  # in write_data(), after checksums, before the files are named into the checkpoint
    "before-commit",  # in finish(), manifest written, COMMITTED marker not yet
    "after-commit",  # in finish(), right after the COMMITTED marker, before eviction
    "persist-write",  # in the persister, one file's bytes sent to the target, the file not complete
    "persist-upload",  # in the persister, after one file is uploaded and recorded
    "persist-publish",  # in the persister, manifest and .metadata published, COMMITTED marker not yet
    "take-over",  # in latest_checkpoint(), one file of a rank that left the job moved from its replica
)
_hits: dict[str, int] = {}


def crash_point(name: str, rank: int) -> None:
    """SIGKILL this process if ``DCP_MEMSTORE_CRASH_AT`` names this point (and rank, and hit count)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, rest = spec.partition(":")
    if point != name:
        return
    want_rank, _, nth = rest.partition(":")
    if want_rank and int(want_rank) != rank:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if nth and _hits[name] != int(nth):
        return
    os.kill(os.getpid(), signal.SIGKILL)
