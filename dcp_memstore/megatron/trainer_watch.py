"""Ending Megatron's async worker together with the trainer it writes for.

Megatron's persistent worker (``AsyncCallsQueue(persistent=True)``) is a spawned process that waits for
requests for as long as it lives. When its trainer dies (SIGKILL, the OOM killer), nothing ends it: it
lives on, orphaned, and keeps the mappings of the shard files it wrote, whose memory then stays taken after
those checkpoints are deleted. So a process that writes a rank's part for a trainer other than itself
calls ``watch`` first: a daemon thread then kills the process once its parent is no longer that trainer.
(``PR_SET_PDEATHSIG`` would follow the thread that started the worker, not the trainer process.) A
forked writer, which ends after one save anyway, is watched the same way.
"""

from __future__ import annotations

import os
import signal
import threading
import time

POLL_S = 0.5  # how often the thread looks at its process's parent
_watched: int | None = None  # the trainer this process is watching for


def watch(trainer_pid: int) -> None:
    """End this process (SIGKILL) once its parent is no longer ``trainer_pid``; nothing if this process is
    the trainer. Idempotent: one thread per process."""
    global _watched
    if trainer_pid == os.getpid() or _watched == trainer_pid:
        return
    _watched = trainer_pid
    threading.Thread(
        target=_end_with, args=(trainer_pid,), name="dcp_memstore-trainer-watch", daemon=True
    ).start()


def _end_with(trainer_pid: int) -> None:
    while os.getppid() == trainer_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)  # no finalize will ever come for what this process writes
