"""Liveness tokens (``store/liveness.py``) of processes that ran and exited, for tests of what a dead
process left behind."""

from __future__ import annotations

import os

from dcp_memstore.store import liveness
from dcp_memstore.store.layout import StoreLayout


def dead_token(layout: StoreLayout) -> str:
    """The liveness token in ``layout`` of a process that took one and exited."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, liveness.own_token(layout).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as r:
        return r.read().decode()
