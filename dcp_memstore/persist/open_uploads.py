"""Multipart uploads that this node's processes started and have not completed or aborted, recorded on
tmpfs, so that those a killed process left open are aborted.

An object store keeps the parts of a multipart upload that was neither completed nor aborted, and bills
them, until a bucket lifecycle rule removes them. A persister killed while uploading a file leaves such an
upload, and the restarted job uploads the file again under a new upload: nothing would ever abort the old
one. So each upload is recorded as soon as the object store has named it, before its first part is sent
(``PersistTarget.open_whole``):

``<job>/uploads/<target key>/<token>-<hex>``  ``{"path", "upload_id", "lock"}``: the upload named
                                              ``upload_id`` of ``path`` (bucket/key), by the process
                                              whose liveness token is ``lock`` (see ``store.liveness``)

and the record is removed once the upload is completed or aborted. ``abort_orphans`` aborts the uploads
whose process is dead, and those their process gave up (their abort failed: ``lock`` is None).

An upload id belongs to one upload of one process: only that process and, once it is dead, processes of
its node (which see its liveness lock) ever abort it. So a live upload is never aborted, neither one of
this node nor one of another node that uploads the same file (after a take-over). What another node's
killed processes left open, that node aborts when its job starts there again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from pathlib import Path

from dcp_memstore.persist.progress import target_key
from dcp_memstore.persist.target import PersistTarget, describe
from dcp_memstore.store import liveness
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import read_record, write_record

log = logging.getLogger(__name__)

_DIR = "uploads"


class OpenUploads:
    """The records of the open multipart uploads of ``layout``'s job to ``target`` (see module docstring)."""

    def __init__(self, layout: StoreLayout, target: PersistTarget) -> None:
        self.layout, self.target = layout, target
        self.dir = layout.job_dir / _DIR / target_key(target.url)

    def opened(self, path: str, upload_id: str) -> Path:
        """Record that this process started the multipart upload ``upload_id`` of ``path``; the record."""
        token = liveness.own_token(self.layout)
        record = self.dir / f"{token}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        write_record(record, {"path": path, "upload_id": upload_id, "lock": token, "at": time.time()})
        return record

    def closed(self, record: Path) -> None:
        """The upload of ``record`` was completed or aborted: nothing is left to abort."""
        record.unlink(missing_ok=True)

    def given_up(self, record: Path) -> None:
        """The upload of ``record`` failed and its abort failed too: ``abort_orphans`` aborts it later."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            write_record(record, {**read_record(record), "lock": None})

    def abort_orphans(self) -> list[str]:
        """Abort the uploads of processes that are dead, and those given up; the paths whose uploads were
        aborted. An abort that fails (the target unreachable) is logged and its record kept, to be tried
        again."""
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []
        aborted = []
        for name in names:
            record = self.dir / name
            try:
                r = read_record(record)
                path, upload_id, lock = r["path"], r["upload_id"], r.get("lock")
            except FileNotFoundError:  # another local process aborted it first
                continue
            except (ValueError, KeyError, TypeError) as e:  # damaged: nothing to tell which upload it was
                log.warning("removing the unreadable upload record %s: %s", record, e)
                record.unlink(missing_ok=True)
                continue
            if liveness.is_token(lock) and liveness.alive(self.layout, lock):
                continue
            if self._abort(path, upload_id):
                record.unlink(missing_ok=True)
                aborted.append(path)
        return aborted

    def _abort(self, path: str, upload_id: str) -> bool:
        """Abort the multipart upload ``upload_id`` of ``path``; whether it is gone (also when it was
        gone already: completed or aborted by another process)."""
        try:
            fs = self.target.fs
            bucket, key, _ = fs.split_path(path)
            fs.abort_mpu(bucket, key, upload_id)
        except FileNotFoundError:
            return True
        except Exception as e:  # noqa: BLE001 - kept, and tried again at the next clean-up
            log.warning(
                "cannot abort the multipart upload of %s a killed upload left open (%s); will try again",
                path,
                describe(e),
            )
            return False
        return True
