"""The commit protocol on disk: in-progress and commit markers, the list of committed checkpoints,
retention holds, eviction, and clearing what dead processes left behind.

A checkpoint directory appears (atomic rename of a directory that already holds its INPROGRESS marker),
receives every rank's data, then the coordinator writes the manifest and last the COMMITTED marker, each by
an atomic rename. Only a directory with COMMITTED is a checkpoint. Eviction renames the directory out of
``checkpoints/`` first, so a checkpoint disappears at once and whole. Placing a hold and eviction's look at
the holds are serialised by a lock file of the job (``flock``), so a hold that was placed is never missed
by an eviction already under way.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from dcp_memstore.errors import CheckpointInUseError
from dcp_memstore.store import liveness
from dcp_memstore.store.layout import (
    COMMITTED,
    HOLDS,
    INPROGRESS,
    OWNER,
    PREPARED,
    StoreLayout,
    file_rank,
    name_owner,
    new_dir_name,
    shard_rank,
)
from dcp_memstore.store.pool import FilePool
from dcp_memstore.store.records import read_record, write_record

log = logging.getLogger(__name__)
_skipped: set[tuple[str, str]] = set()  # (directory, error) of corrupt checkpoints already logged
COMMIT_TIME_STEP_S = 1e-3  # a commit time is at least this much after the newest before it


@dataclass(frozen=True)
class CommitRecord:
    """What the COMMITTED marker of a checkpoint says."""

    checkpoint_id: str
    seq: int
    committed_at: float
    nbytes: int

    def to_record(self) -> dict:
        """The marker's content; it identifies one save (a later save under the same id differs)."""
        return {"seq": self.seq, "committed_at": self.committed_at, "nbytes": self.nbytes}

    @classmethod
    def from_record(cls, checkpoint_id: str, r: dict) -> CommitRecord:
        return cls(checkpoint_id, int(r["seq"]), float(r["committed_at"]), int(r["nbytes"]))


def _owner(layout: StoreLayout) -> dict:
    """The owner record of this process: its lock token (see ``liveness``), and pid, start time and host
    for messages and for the parent/child test of ``saving_process``."""
    p = psutil.Process()
    return {
        "lock": liveness.own_token(layout),
        "pid": p.pid,
        "create_time": p.create_time(),
        "host": socket.gethostname(),
        "started": time.time(),
    }


def _owner_alive(layout: StoreLayout, owner: dict) -> bool:
    """Whether the process of owner record ``owner`` still runs: by its lock; a record without one (an
    earlier version's) by pid and start time, and on another host it is not ours to judge."""
    if liveness.is_token(owner.get("lock")):
        return liveness.alive(layout, owner["lock"])
    if owner.get("host") != socket.gethostname():
        return True
    try:
        return abs(psutil.Process(owner["pid"]).create_time() - owner["create_time"]) < 1e-3
    except (psutil.NoSuchProcess, KeyError, TypeError):
        return False


def _is_self(owner: dict) -> bool:
    me = psutil.Process()
    return owner.get("pid") == me.pid and abs(owner.get("create_time", 0) - me.create_time()) < 1e-3


def begin(layout: StoreLayout, checkpoint_id: str) -> Path:
    """Create the checkpoint's directory, already holding its INPROGRESS marker (coordinator only)."""
    final = layout.checkpoint_dir(checkpoint_id)
    tmp = layout.checkpoints_dir / new_dir_name(liveness.own_token(layout), uuid.uuid4().hex)
    try:
        tmp.mkdir(parents=True)
        write_record(tmp / INPROGRESS, _owner(layout))
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # also where the marker did not fit (a full tmpfs)
        raise
    return final


def saving_process(layout: StoreLayout, checkpoint_id: str) -> dict | None:
    """The owner record (pid, host, start time) of the uncommitted save of ``checkpoint_id`` if another
    running process made it, one that is not this process's parent or child; None if there is none, or it
    is a dead process's. DCP's checkpoint process is the trainer's child and lives as long as the job: a
    directory that one of its saves left when it failed must not keep the trainer from saving that id."""
    owner = _safe_read(layout.checkpoint_dir(checkpoint_id) / INPROGRESS)
    if owner is None or _is_self(owner) or not _owner_alive(layout, owner):
        return None
    if owner.get("host") == socket.gethostname() and _related(owner.get("pid")):
        return None
    return owner


def _related(pid: object) -> bool:
    """Whether ``pid`` is this process's parent or one of its children."""
    return pid == os.getppid() or _child_pid(pid)


def _child_pid(pid: object) -> bool:
    """Whether ``pid`` is one of this process's children."""
    try:
        return psutil.Process(pid).ppid() == os.getpid()
    except (psutil.Error, TypeError, ValueError):
        return False


def _is_child(owner: dict) -> bool:
    """Whether owner record ``owner`` (of a live process) is a child process of this one."""
    return owner.get("host") == socket.gethostname() and _child_pid(owner.get("pid"))


def next_seq(layout: StoreLayout) -> int:
    """The sequence number the next commit gets (one more than the newest committed checkpoint's)."""
    return next_commit(layout)[0]


def next_commit(layout: StoreLayout, after: float = 0.0) -> tuple[int, float]:
    """The sequence number (``next_seq``) and the commit time the next commit gets, from one listing.
    The time is now, but after the newest committed checkpoint's and after ``after`` (the newest the
    caller saw in other tiers). Commit times order checkpoints across tiers and stores
    (``latest_checkpoint``), so a wall clock stepped back (NTP, a VM restored from a snapshot, a node
    whose clock is behind the one that saved the persisted checkpoints) must not make a new checkpoint
    look older than the ones before."""
    records = committed(layout)
    newest = max((r.committed_at for r in records), default=after)
    seq = max((r.seq for r in records), default=0) + 1
    return seq, max(time.time(), max(newest, after) + COMMIT_TIME_STEP_S)


def join(layout: StoreLayout, checkpoint_id: str) -> Path:
    """The checkpoint's directory on this node, begun here if the coordinator runs on another node (its
    ``begin`` made the directory on its own node only). Safe to race between the ranks of a node.

    A copy this node prepared for an earlier save under this id, whose commit never came (``PREPARED``: its
    coordinator was killed between the two phases and the job did not resume from it), is discarded first:
    a new save of the id means that one never commits, and its files and markers (its dead process's
    INPROGRESS, its manifest) must not mix with the new save's."""
    final = layout.checkpoint_dir(checkpoint_id)
    if (final / PREPARED).exists():
        with commit_lock(layout):  # one rank of the node discards it, not the new one another rank began
            if (final / PREPARED).exists() and not (final / COMMITTED).exists():
                discard(layout, final)
    if not final.is_dir():
        try:
            begin(layout, checkpoint_id)
        except OSError:
            if not final.is_dir():  # not a rank of this node that got there first
                raise
    return final


def commit(
    layout: StoreLayout,
    checkpoint_id: str,
    nbytes: int,
    seq: int | None = None,
    committed_at: float | None = None,
) -> CommitRecord:
    """Write the COMMITTED marker: from here on the checkpoint is visible (coordinator only, or on each
    node as the coordinator says). ``seq`` defaults to ``next_seq``; pass the one a caller already decided
    on (e.g. to place a hold first). ``committed_at`` defaults to ``next_commit``'s (other nodes take the
    coordinator's)."""
    d = layout.checkpoint_dir(checkpoint_id)
    if seq is None or committed_at is None:
        default_seq, default_at = next_commit(layout)
        seq = default_seq if seq is None else seq
        committed_at = default_at if committed_at is None else committed_at
    rec = CommitRecord(checkpoint_id, seq, committed_at, nbytes)
    write_record(d / COMMITTED, rec.to_record())
    (d / INPROGRESS).unlink(missing_ok=True)
    return rec


def read_commit(layout: StoreLayout, checkpoint_id: str) -> CommitRecord | None:
    """The COMMITTED marker of ``checkpoint_id``; None if it has none (not committed, or not there).
    ValueError naming the marker and saying what to do if the marker is corrupt."""
    path = layout.checkpoint_dir(checkpoint_id) / COMMITTED
    try:
        return CommitRecord.from_record(checkpoint_id, read_record(path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (KeyError, TypeError, ValueError) as e:
        problem = (
            str(e) if type(e) is ValueError else f"{path} is not a commit marker ({type(e).__name__}: {e})"
        )
        raise ValueError(
            f"{problem}. Checkpoint {checkpoint_id!r} has a corrupt commit marker: it is left out of "
            "list_checkpoints() and latest_checkpoint(), and retention never evicts it. Load another "
            f"checkpoint, and free its memory with store.delete({checkpoint_id!r}) or "
            f"`dcp-memstore delete {checkpoint_id}`"
        ) from e


def same_save(layout: StoreLayout, rec: CommitRecord) -> bool:
    """Whether checkpoint ``rec.checkpoint_id`` is still committed by the save ``rec`` records: not
    deleted or evicted, nor saved again under its id (which may even take the same sequence number).
    Work kept by checkpoint id (uploads, replicas) checks it before it records anything. ValueError if the
    commit marker is corrupt (``read_commit``)."""
    return read_commit(layout, rec.checkpoint_id) == rec


def _still_the_save(layout: StoreLayout, rec: CommitRecord) -> bool:
    """``same_save``, with a commit marker that became corrupt meanwhile taken for another save's."""
    try:
        return same_save(layout, rec)
    except ValueError:
        return False


def require_committed(layout: StoreLayout, checkpoint_id: str) -> Path:
    """The directory of committed checkpoint ``checkpoint_id`` (a valid name); FileNotFoundError naming
    the ones that exist."""
    if read_commit(layout, checkpoint_id) is None:
        raise FileNotFoundError(
            f"checkpoint {checkpoint_id!r} not found in store {layout.job_dir}; "
            f"committed checkpoints: {[r.checkpoint_id for r in committed(layout)] or 'none'}"
        )
    return layout.checkpoint_dir(checkpoint_id)


def committed(layout: StoreLayout) -> list[CommitRecord]:
    """Committed checkpoints, oldest first. One whose commit marker is corrupt is left out (logged once per
    process), so that one damaged checkpoint does not stop listings, resuming or saving; its directory
    stays as it is, never evicted or reused, until the user deletes it."""
    out = []
    try:
        names = [
            e.name for e in os.scandir(layout.checkpoints_dir) if e.is_dir() and not e.name.startswith(".")
        ]
    except FileNotFoundError:
        return []
    for name in names:
        try:
            rec = read_commit(layout, name)
        except ValueError as e:
            key = (str(layout.checkpoint_dir(name)), str(e))
            if key not in _skipped:
                _skipped.add(key)
                log.warning("skipping checkpoint directory %s: %s", key[0], e)
            continue
        if rec is not None:
            out.append(rec)
    return sorted(out, key=lambda r: r.seq)


def prepared(layout: StoreLayout) -> dict[str, dict]:
    """The checkpoints this node prepared for a commit that another node coordinates and has not
    committed, with the record of the save that the coordinator sent with it (``committed_at``, ``nbytes``)
    in their ``PREPARED`` file."""
    out = {}
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(layout.checkpoints_dir):
            d = Path(e.path)
            if e.is_dir() and not (d / COMMITTED).exists():
                record = _safe_read(d / PREPARED)
                if record is not None:
                    out[e.name] = record
    return out


def ranks_with_files(directory: Path) -> set[int]:
    """The ranks with a data file (shard or objects file) in checkpoint directory ``directory`` on this
    node (empty if it is gone): in a job of several nodes, the ranks of this node that wrote it."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    return {rank for name in names if (rank := file_rank(name)) is not None}


def discard(layout: StoreLayout, directory: Path) -> None:
    """Make ``directory`` invisible at once (rename into trash), return its shard files to their ranks'
    pools, and delete the rest. A trash directory removed under this process (``rm -rf`` of the job's
    directory) is made again: only a ``directory`` that is gone counts as discarded already."""
    trash = _to_trash(layout, directory)
    if trash is not None:
        recycle(layout, trash)


def delete(layout: StoreLayout, checkpoint_id: str) -> None:
    """``discard`` checkpoint ``checkpoint_id``, unless a live process is loading it: its files would go
    to the pools and the next save would write into them while the load reads them (wrong bytes, found
    only if checksums are verified). ``CheckpointInUseError`` naming the loading processes then."""
    with _retention_lock(layout, exclusive=True):  # no load hold is placed between the look and the rename
        loads = [n for n in holds(layout, checkpoint_id) if n.startswith("load-")]
        if loads:
            owners = [_safe_read(layout.checkpoint_dir(checkpoint_id) / HOLDS / n) or {} for n in loads]
            who = ", ".join(f"pid {o.get('pid', '?')} on host {o.get('host', '?')}" for o in owners)
            raise CheckpointInUseError(
                f"checkpoint {checkpoint_id!r} in store {layout.job_dir} is being loaded ({who}); "
                "delete it once the load has ended"
            )
        trash = _to_trash(layout, layout.checkpoint_dir(checkpoint_id))
    if trash is not None:
        recycle(layout, trash)


def _to_trash(layout: StoreLayout, directory: Path) -> Path | None:
    """Rename ``directory`` into the trash (made again if it was removed); its new path, or None if
    ``directory`` is gone (another process discarded it first)."""
    trash = layout.trash_dir / f"{directory.name}.{uuid.uuid4().hex[:8]}"
    try:
        os.rename(directory, trash)
    except FileNotFoundError:
        if not directory.exists():
            return None  # another process discarded it first
        layout.trash_dir.mkdir(exist_ok=True)
        try:
            os.rename(directory, trash)
        except FileNotFoundError:
            return None  # discarded by another process meanwhile
    return trash


def recycle(layout: StoreLayout, directory: Path, staged: bool = False) -> None:
    """Move the shard files under ``directory`` into their ranks' pools and delete the directory.
    ``staged``: they are files a save staged into and did not keep (see ``FilePool.release``)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return  # another process recycled it first
    for entry in entries:
        rank = shard_rank(entry.name) if entry.is_file() else None
        if rank is not None:
            with contextlib.suppress(FileNotFoundError):
                FilePool(layout, rank).release(Path(entry.path), staged)
    shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _flock(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold an ``flock`` on the lock file ``path`` (made if missing): a killed process drops it. Each call
    opens the file anew, so it also excludes other threads of this process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _retention_lock(layout: StoreLayout, exclusive: bool) -> contextlib.AbstractContextManager[None]:
    """The job's retention lock: shared while a hold is placed, exclusive while eviction picks and removes
    its victims. Without it an eviction could find no hold, a hold be placed, and the eviction still
    remove the checkpoint."""
    return _flock(layout.retention_lock, exclusive)


def safe_point_lock(layout: StoreLayout) -> contextlib.AbstractContextManager[None]:
    """The job's lock for moving the safe point (``replication.safe_point.advance``): two reports handled
    at once (the server's threads, this node's replicator, other processes of the node) could otherwise
    interleave, one releasing the older safe point's hold and the other, which chose it a moment before,
    placing it again, where nothing would release it."""
    return _flock(layout.job_dir / "safe-point.lock", exclusive=True)


def commit_lock(layout: StoreLayout) -> contextlib.AbstractContextManager[None]:
    """The job's commit lock, held from taking a checkpoint's sequence number (``next_seq``) until its
    COMMITTED marker is written. Two saves committing at once (``dcp.save`` in two threads) would otherwise
    take the same number, and retention, which evicts the lowest numbers, and the listing order could not
    tell which of them is the newer."""
    return _flock(layout.commit_lock, exclusive=True)


def hold(layout: StoreLayout, checkpoint_id: str, reason: str, record: dict | None = None) -> None:
    """Keep ``checkpoint_id`` from eviction until ``release(reason)``: something (an upload to persistent
    storage, a replica, a load) still needs its bytes. ``record`` is stored with the hold (idempotent).
    FileNotFoundError if the checkpoint's directory is gone (evicted or deleted)."""
    d = layout.checkpoint_dir(checkpoint_id) / HOLDS
    with _retention_lock(layout, exclusive=False):
        d.mkdir(exist_ok=True)
        write_record(d / reason, record or {})


# hold of one process, named <purpose>-p<pid>-<token>; its record is the owner (see process_hold)
_PROCESS_HOLD_RE = re.compile(r"[a-z]+-p\d+-[0-9a-f]+")


def process_hold(layout: StoreLayout, checkpoint_id: str, purpose: str) -> str | None:
    """Hold committed checkpoint ``checkpoint_id`` for this process (``purpose``: a lowercase word, e.g.
    "load") until ``release`` of the returned name. If the process dies first, the hold is dropped the next
    time ``holds`` looks at it (eviction, a store's start), so a killed process does not pin the checkpoint
    for good. Returns None, holding nothing, if the checkpoint is not committed (evicted or deleted)."""
    name = f"{purpose}-p{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        hold(layout, checkpoint_id, name, _owner(layout))
    except FileNotFoundError:
        return None
    # committed now and held: no eviction removes it before release. A directory without COMMITTED is a
    # save of the same id begun after an eviction, not a checkpoint (and a corrupt marker raises)
    held = False
    try:
        held = read_commit(layout, checkpoint_id) is not None
        return name if held else None
    finally:
        if not held:
            release(layout, checkpoint_id, name)


def release(layout: StoreLayout, checkpoint_id: str, reason: str) -> None:
    """Drop hold ``reason`` of ``checkpoint_id`` (no error if it had none)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        (layout.checkpoint_dir(checkpoint_id) / HOLDS / reason).unlink()


def hold_names(layout: StoreLayout, checkpoint_id: str) -> list[str]:
    """The holds of ``checkpoint_id`` as they are on disk, sorted: also those of dead processes, which
    ``holds`` drops (a look that changes nothing, e.g. on a read-only mount)."""
    try:
        # a dot name is a hold being written (records.write_atomic), or one whose writer was killed
        return sorted(
            e.name
            for e in os.scandir(layout.checkpoint_dir(checkpoint_id) / HOLDS)
            if not e.name.startswith(".")
        )
    except (FileNotFoundError, NotADirectoryError):
        return []


def holds(layout: StoreLayout, checkpoint_id: str) -> list[str]:
    """The reasons ``checkpoint_id`` is held in memory, sorted (empty: evictable). Holds of processes that
    died (see ``process_hold``) are dropped here and not listed; so are process holds whose record is
    damaged (written atomically, a record is whole unless something else wrote it), with a warning: no
    process would ever be found to release them, and the checkpoint could be neither evicted nor
    deleted."""
    live = []
    for name in hold_names(layout, checkpoint_id):
        if _PROCESS_HOLD_RE.fullmatch(name):
            path = layout.checkpoint_dir(checkpoint_id) / HOLDS / name
            owner = _safe_read(path)
            if owner is None and path.exists():
                log.warning(
                    "dropping hold %s of checkpoint %r: its record is damaged, so no process can be found "
                    "to own it", name, checkpoint_id,
                )  # fmt: skip
            if owner is None or not _owner_alive(layout, owner):
                release(layout, checkpoint_id, name)
                continue
        live.append(name)
    return live


def drop_copies(layout: StoreLayout, checkpoint_id: str) -> None:
    """Delete what this node keeps of ``checkpoint_id`` for others or from others: the replicas of other
    nodes' files and files fetched to read here."""
    try:
        sources = list(os.scandir(layout.replicas_dir))
    except FileNotFoundError:
        sources = []
    for src in sources:
        shutil.rmtree(os.path.join(src.path, checkpoint_id), ignore_errors=True)
    shutil.rmtree(layout.fetched_dir(checkpoint_id), ignore_errors=True)


STALE_COPY_S = 300.0


def drop_stale_copies(layout: StoreLayout, older_than_s: float = STALE_COPY_S) -> None:
    """Delete replicas and fetched files of checkpoints this node no longer has committed, once untouched
    for ``older_than_s`` (younger ones may belong to a save that is being committed right now)."""
    have = {r.checkpoint_id for r in committed(layout)}
    horizon = time.time() - older_than_s
    dirs = []
    with contextlib.suppress(FileNotFoundError):
        for src in os.scandir(layout.replicas_dir):
            dirs += list(os.scandir(src.path)) if src.is_dir() else []
    with contextlib.suppress(FileNotFoundError):
        dirs += list(os.scandir(layout.fetches_dir))
    for d in dirs:
        with contextlib.suppress(FileNotFoundError):
            if d.name not in have and d.stat().st_mtime < horizon:
                shutil.rmtree(d.path, ignore_errors=True)


def evict(
    layout: StoreLayout, keep: int, ignored_hold: Callable[[str], bool] = lambda reason: False
) -> list[str]:
    """Evict all but the ``keep`` newest committed checkpoints, except those held (see ``hold``) for a
    reason that ``ignored_hold`` does not accept (holds that nothing in this process will ever release).
    The checkpoints are listed before the retention lock is taken: one that another process evicted or
    deleted since, its id saved again, is left alone (``same_save``, under the lock, which every eviction
    and deletion takes)."""
    recs = committed(layout)
    candidates = recs[: max(0, len(recs) - keep)]
    if not candidates:
        return []
    victims, trashed = [], []
    with _retention_lock(layout, exclusive=True):
        for r in candidates:
            if not _still_the_save(layout, r):
                continue
            if all(ignored_hold(h) for h in holds(layout, r.checkpoint_id)):
                trash = _to_trash(layout, layout.checkpoint_dir(r.checkpoint_id))
                if trash is not None:
                    victims.append(r.checkpoint_id)
                    trashed.append(trash)
    for cid, trash in zip(victims, trashed, strict=True):
        recycle(layout, trash)
        drop_copies(layout, cid)
    return victims


def drop_superseded(layout: StoreLayout, keep: int) -> None:
    """Discard each copy this node prepared for a commit that never came (``prepared``) once ``keep`` of
    the checkpoints committed here were committed after it was prepared: had its commit come, retention
    would have evicted it by now, and the job resumes from a newer checkpoint. Otherwise it would stay
    until a save short of space or a new save of its id. Only for a store that persists nothing: where
    the other nodes owe the checkpoint to persistent storage, this copy is what a restart commits to
    finish the upload (the replicating store's ``_finish_prepared``). The count starts at the
    ``next_seq`` its ``PREPARED`` record keeps, this node's next sequence number then: a copy prepared
    after those commits (a save being committed now) is never superseded by them."""
    recs = committed(layout)
    for cid, record in prepared(layout).items():
        if not _superseded(record, recs, keep):
            continue
        d = layout.checkpoint_dir(cid)
        with commit_lock(layout):  # as in ``join``: never the directory a new save of the id began since
            record = _safe_read(d / PREPARED)
            if record is None or (d / COMMITTED).exists() or not _superseded(record, recs, keep):
                continue
            discard(layout, d)
        log.info(
            "discarded checkpoint %r prepared on this node: its commit never came, and %d checkpoint(s) "
            "were committed here since",
            cid,
            keep,
        )


def _superseded(prepared_record: dict, recs: list[CommitRecord], keep: int) -> bool:
    """Whether ``keep`` of ``recs`` were committed after the prepare that wrote ``prepared_record``."""
    since = prepared_record.get("next_seq")
    return isinstance(since, int) and sum(r.seq >= since for r in recs) >= keep


def clear_abandoned(
    layout: StoreLayout,
    before: float | None = None,
    running: Collection[str] = (),
    children: bool = False,
    keep_prepared: bool = False,
) -> list[str]:
    """Discard uncommitted checkpoint directories whose saving process is dead, and (with ``before``) those
    this process started before time ``before`` and never committed, except ``running``: the checkpoint
    ids whose saves in this process are still writing (another thread's save, begun earlier, is not an
    abandoned one). With ``children`` also those that child processes of this one started before
    ``before``: the caller knows that none of them is saving (DCP's checkpoint process, which has answered
    every save sent to it). With ``keep_prepared``, those this node prepared for a commit (``PREPARED``)
    stay: the coordinator may have committed them (``latest_checkpoint`` finishes them). Also recycles the
    staging slots and reservation areas of dead processes, drops their holds (see ``process_hold``) and
    empties the trash."""
    cleared = []
    try:
        entries = list(os.scandir(layout.checkpoints_dir))
    except FileNotFoundError:
        return cleared
    for e in entries:
        if not e.is_dir():
            continue
        d = Path(e.path)
        if e.name.startswith(".new-"):  # a checkpoint directory being made (layout.new_dir_name)
            if not _maker_alive(layout, d):
                shutil.rmtree(d, ignore_errors=True)
            continue
        if (d / COMMITTED).exists():
            holds(layout, e.name)  # drops the holds of dead processes
            continue
        if e.name in running or (keep_prepared and (d / PREPARED).exists()):
            continue
        owner = _safe_read(d / INPROGRESS)
        if owner is None:
            if (d / COMMITTED).exists():
                continue
            stale = True  # neither marker: a directory no save protocol step leaves behind
        else:
            stale = not _owner_alive(layout, owner) or (
                before is not None
                and owner.get("started", before) < before
                and (_is_self(owner) or (children and _is_child(owner)))
            )
        if stale:
            discard(layout, d)
            cleared.append(e.name)
    for s in list(os.scandir(layout.staging_dir)) if layout.staging_dir.exists() else []:
        if s.is_dir() and not _maker_alive(layout, Path(s.path)):
            recycle(layout, Path(s.path))  # staged by a process that died before its save used the slot
    for t in list(os.scandir(layout.trash_dir)) if layout.trash_dir.exists() else []:
        recycle(layout, Path(t.path))
    for area in layout.pools_dir.glob("rank*/reserve-*"):
        if area.is_dir() and not _maker_alive(layout, area):
            recycle(layout, area)  # files a dead process was allocating ahead of its next save
    liveness.sweep(layout)
    return cleared


def claim_owner(layout: StoreLayout, directory: Path) -> None:
    """Record this process as the owner of ``directory`` (a staging slot or reservation area of
    ``layout``'s job), for ``clear_abandoned``."""
    write_record(directory / OWNER, _owner(layout))


def use_pool(layout: StoreLayout, rank: int) -> None:
    """Record this process as the one staging rank ``rank``'s saves on this node (``pool_in_use``), unless
    it is already. Nothing where the store was deleted (its directories are not made again)."""
    directory = layout.pool_dir(rank)
    owner = _safe_read(directory / OWNER)
    if owner is not None and owner.get("lock") == liveness.own_token(layout):
        return
    with contextlib.suppress(FileNotFoundError):
        directory.mkdir(exist_ok=True)
        claim_owner(layout, directory)


def pool_in_use(layout: StoreLayout, rank: int) -> bool:
    """Whether a live process stages rank ``rank``'s saves on this node (``use_pool``): its next save
    reuses the rank's pool, even where the rank writes no file into the checkpoints (DCP gave it no value
    to write, and its pool holds the files it staged into, see ``FilePool.release``)."""
    return _maker_alive(layout, layout.pool_dir(rank))


def _maker_alive(layout: StoreLayout, directory: Path) -> bool:
    """Whether the process that made ``directory`` (its owner record, else the liveness token in its name:
    it is made before the record is written) still runs."""
    owner = _safe_read(directory / OWNER) or _safe_read(directory / INPROGRESS)
    if owner is not None:
        return _owner_alive(layout, owner)
    token = name_owner(directory.name)
    return token is not None and liveness.alive(layout, token)


def _safe_read(path: Path) -> dict | None:
    try:
        r = read_record(path)
        return r if isinstance(r, dict) else None
    except (FileNotFoundError, ValueError):
        return None
