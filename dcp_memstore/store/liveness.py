"""Whether the process that wrote an owner record still runs, judged by a lock it holds for its life.

Every process that writes owner records into a job's store (in-progress markers, staging slots,
reservation areas, load holds) first takes an exclusive ``flock`` on a file of its own under
``<job>/procs/`` and keeps it until it exits; the kernel drops the lock when the process dies, however it
dies. Another process tries that lock to learn whether the owner lives. Unlike a pid with its start time,
this holds across PID namespaces and hostnames: containers that share a node's ``/dev/shm``, or a job
restarted in a new container with a new hostname, whose dead saves would otherwise never be cleared.
Processes that share a tmpfs share a kernel, so the lock is seen by all of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import uuid
from pathlib import Path

from dcp_memstore.store.layout import OWNER_TOKEN, StoreLayout
from dcp_memstore.store.records import same_file

_TOKEN_RE = re.compile(OWNER_TOKEN)
_SUFFIX = ".lock"
_held: dict[Path, tuple[str, int]] = {}  # procs directory -> (token, fd holding the lock) of this process
_guard = threading.Lock()


def own_token(layout: StoreLayout) -> str:
    """The token naming this process's lock file in ``layout``'s job, taken on first use and taken again
    if the file was removed under the process (the job directory deleted by hand)."""
    procs = layout.procs_dir
    with _guard:
        held = _held.get(procs)
        if held is not None and same_file(held[1], procs / f"{held[0]}{_SUFFIX}"):
            return held[0]
        if held is not None:
            os.close(held[1])
        _held[procs] = _take(procs)
        return _held[procs][0]


def is_token(value: object) -> bool:
    """Whether ``value`` (read from an owner record) is a token ``own_token`` makes."""
    return isinstance(value, str) and _TOKEN_RE.fullmatch(value) is not None


def alive(layout: StoreLayout, token: str) -> bool:
    """Whether the process whose token is ``token`` still runs. A dead one's lock file is removed. A lock
    file this process may not open (another user's, made unreadable by an older release) cannot be
    judged: its process is taken to run, so nothing it owned is cleared."""
    path = layout.procs_dir / f"{token}{_SUFFIX}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # its process died and another process found it so first
    except PermissionError:
        return True
    try:
        try:  # shared: two processes judging the same owner at once must not see each other's lock
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        if same_file(fd, path):
            path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)


def sweep(layout: StoreLayout) -> None:
    """Remove the lock files of processes that exited (their lock is gone, the empty file stays)."""
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(layout.procs_dir):
            if e.name.endswith(_SUFFIX) and is_token(e.name[: -len(_SUFFIX)]):
                alive(layout, e.name[: -len(_SUFFIX)])


def _take(procs: Path) -> tuple[str, int]:
    """Create and lock a new lock file in ``procs``. A process judging the new, not yet locked file in
    between finds it dead and removes it; then the file is made again under another token."""
    procs.mkdir(parents=True, exist_ok=True)
    while True:
        token = f"p{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = procs / f"{token}{_SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        os.fchmod(fd, 0o644)  # whatever the umask: every user of the store must be able to try the lock
        try:  # not blocking: another process trying the new file's lock holds it for a moment (or for good)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if same_file(fd, path):
            return token, fd
        os.close(fd)


def _forget_after_fork() -> None:
    """A forked child has its own life: it must not keep (or answer for) its parent's locks. Closing the
    inherited descriptors leaves the parent's locks held by the parent."""
    global _guard
    _guard = threading.Lock()  # another thread of the parent may have held it at the fork
    for _, fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
