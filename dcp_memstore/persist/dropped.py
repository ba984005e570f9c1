"""What the upload of a checkpoint deleted from memory before it was published left in the target: its
partial directory, removed where that is safe.

A checkpoint deleted from memory (``store.delete(id)``, for example one whose upload failed for good)
while it was owed to the target and not published there leaves what was uploaded of it in
``<url>/<id>/``: data files and part records, never listed nor loaded (no COMMITTED marker, and no stock
``.metadata`` either: both are written only once every file is uploaded), but stored, and billed, for
good. Removing that directory is safe only if no process uploads into it or publishes it, which holds:

- for other nodes, only in a job on one node: another node of the job may hold the checkpoint as its
  own copy (after a take-over) and upload the same id, and an object store offers nothing that would
  fence its publication against a removal (the store decides this; see ``PersistingStore``);
- for the processes of this node: each holds ``<job>/persist-dirs/<target key>/<id>.lock`` shared
  while it writes into the directory (a file and its part record, or the publication), and the removal
  takes it exclusive (``remove_partial``);
- if the id is not published there (a published checkpoint is never removed), and no save of the id is
  in memory again (its upload takes the directory over).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from dcp_memstore.persist.progress import target_key
from dcp_memstore.persist.publish import remote_commit
from dcp_memstore.persist.target import PersistTarget
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import same_file

_DIR = "persist-dirs"


def _lock_path(layout: StoreLayout, target: PersistTarget, checkpoint_id: str) -> Path:
    return layout.job_dir / _DIR / target_key(target.url) / f"{checkpoint_id}.lock"


@contextlib.contextmanager
def writing_into(layout: StoreLayout, target: PersistTarget, checkpoint_id: str) -> Iterator[None]:
    """Hold off removals of ``checkpoint_id``'s directory in ``target`` while the block writes into it
    (waits for one under way to end)."""
    with _locked(_lock_path(layout, target, checkpoint_id), fcntl.LOCK_SH):
        yield


def forget_lock(layout: StoreLayout, target: PersistTarget, checkpoint_id: str) -> None:
    """``checkpoint_id`` is published: remove its lock file unless a process holds it, so that the lock
    files do not pile up, one per checkpoint id, for the life of the job."""
    path = _lock_path(layout, target, checkpoint_id)
    with _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
        if held:
            path.unlink(missing_ok=True)


def remove_partial(layout: StoreLayout, target: PersistTarget, checkpoint_id: str) -> bool | None:
    """Remove ``checkpoint_id``'s directory from ``target`` unless it is published there or a save of the
    id is in memory again (see module docstring): whether it removed it; None if a process of this node
    is writing into it (try again later). Raises what the target raises (unreachable: try again)."""
    path = _lock_path(layout, target, checkpoint_id)
    with _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
        if not held:
            return None
        if catalog.read_commit(layout, checkpoint_id) is not None:
            return False  # saved again: its upload takes the directory over
        if remote_commit(target, checkpoint_id) is not None:
            return False
        try:
            target.remove_tree(target.path(checkpoint_id))
        except FileNotFoundError:
            return False
        finally:
            target.forget_listings()
        path.unlink(missing_ok=True)  # still locked: a process that opened it takes a new one (_locked)
        return True


@contextlib.contextmanager
def _locked(path: Path, operation: int) -> Iterator[bool]:
    """Lock file ``path`` (made if missing) with ``flock(operation)`` for the block; yields whether it was
    taken (a non-blocking one may not be). A file removed by a holder of the exclusive lock before this
    process locked it is opened again, so that every holder locks the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, operation)
            except BlockingIOError:
                yield False
                return
            if same_file(fd, path):
                yield True
                return
        finally:
            os.close(fd)
