"""Which persistence targets a live process of the job has open: a retention hold for another store's
target keeps a checkpoint in memory only while one does.

Each upload holds its checkpoint under the name of its target (``progress.target_key``), so two stores of
one job with different ``persist_to`` each keep it until their own upload is published. A store's own
target's hold always binds it: a restarted job uploads what the run before it owed. Another target's hold
binds only while a process that opened a store with that target lives. Otherwise a hold left by an earlier
run with another ``persist_to`` (the job restarted with a new one, or without one) would pin its
checkpoint in memory for good, since no process uploads it there any more.

A store with ``persist_to`` registers its process under ``<job>/targets/<target key>/<token>``, the token
of the process's liveness lock (``store.liveness``, which the kernel drops when the process dies), until
the process closes its last store with that target. The registration holds the target's URL, so that
another store's errors can name the target whose holds keep memory (the key is a hash of it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from dcp_memstore.persist.progress import target_key
from dcp_memstore.store import liveness
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import write_atomic

_DIR = "targets"
_open: dict[Path, int] = {}  # this process's registrations -> how many of its stores hold each open
_guard = threading.Lock()


def register(layout: StoreLayout, url: str) -> Path:
    """Record that this process has a store of ``layout``'s job open with the target at ``url``; the
    registration, for ``unregister``."""
    path = layout.job_dir / _DIR / target_key(url) / liveness.own_token(layout)
    with _guard:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, url.encode())
        _open[path] = _open.get(path, 0) + 1
    return path


def unregister(path: Path) -> None:
    """A store that ``register`` recorded as ``path`` was closed: once this process has none open with
    that target, its holds for it bind other stores no more. (Nothing is made again where the store's
    directory was removed meanwhile.)"""
    with _guard:
        left = _open.pop(path, 0) - 1
        if left > 0:
            _open[path] = left
        else:
            path.unlink(missing_ok=True)


def url_of(layout: StoreLayout, key: str) -> str | None:
    """The URL of the target named ``key`` as a live process of the job that has it open registered it;
    None if none did (or registered it without one, as earlier versions did)."""
    for registration in _live_registrations(layout, key, tidy=False):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if url := registration.read_text():
                return url
    return None


def in_use(layout: StoreLayout, key: str) -> bool:
    """Whether a live process of the job has a store open with the target named ``key``; the
    registrations of dead processes are removed on the way."""
    return any(True for _ in _live_registrations(layout, key, tidy=True))


def _live_registrations(layout: StoreLayout, key: str, tidy: bool) -> Iterator[Path]:
    """The registration files of the target named ``key`` by live processes of the job (``tidy``: the
    other files met on the way are removed)."""
    d = layout.job_dir / _DIR / key
    try:
        tokens = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return
    for token in tokens:
        if liveness.is_token(token) and liveness.alive(layout, token):
            yield d / token
        elif tidy:
            with contextlib.suppress(FileNotFoundError):
                (d / token).unlink()
    for token in tokens:
        if liveness.is_token(token) and liveness.alive(layout, token):
            return True
        with contextlib.suppress(FileNotFoundError):
            (d / token).unlink()
    return False
