"""Where persisted checkpoints go: an fsspec file system and a root path in it, from ``persist_to``.

``persist_to`` is an fsspec URL (``s3://bucket/prefix``, ``gs://…``, ``file:///…``) or a plain directory.
A checkpoint ``step-100`` lands in ``<root>/step-100/`` in the standard DCP layout, with our own manifest
and commit marker in ``<root>/step-100/.dcp_memstore/``. The file system is created lazily (and again in
each process: fsspec caches instances), so the target is cheap to build and safe to pickle.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs

from dcp_memstore.persist.bounded_calls import BoundedCalls
from dcp_memstore.store.records import atomic_file, clear_temporaries

if TYPE_CHECKING:
    from dcp_memstore.persist.open_uploads import OpenUploads

log = logging.getLogger(__name__)

OUR_DIR = ".dcp_memstore"
COMMITTED = f"{OUR_DIR}/COMMITTED"
PROBE = f"{OUR_DIR}-probe"  # the object written (and removed) under the root when a store opens
MANIFEST = f"{OUR_DIR}/manifest.msgpack"
PARTS = f"{OUR_DIR}/parts"
STOCK_METADATA = ".metadata"
PROBE_TIMEOUT_S = 15.0  # how long opening a store waits for the target to answer its write probe
_SCHEME_WITHOUT_SLASHES = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)")  # "s3:bucket", "s3:/bucket"
_PERMANENT = (
    PermissionError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,  # a file where a directory should be
    ValueError,
    TypeError,
)
_PERMANENT_BY_NAME = {"NoCredentialsError", "PartialCredentialsError", "NoRegionError"}  # botocore


def is_permanent(e: BaseException) -> bool:
    """Errors that retrying cannot fix: refused or missing credentials, a missing bucket or directory,
    an id taken by another checkpoint, a broken manifest."""
    return isinstance(e, _PERMANENT) or type(e).__name__ in _PERMANENT_BY_NAME


def literal(path: str) -> str:
    """``path`` as a pattern that matches only itself: fsspec's calls on several paths (``cat`` of a list,
    ``glob``) expand ``[``, ``*`` and ``?``, which a directory name or bucket prefix may contain."""
    return glob.escape(path)


def describe(e: BaseException) -> str:
    """``<type>: <message>`` of an error, as status and logs report it."""
    return f"{type(e).__name__}: {e}"


class TargetGoneError(FileNotFoundError):
    """The local ``persist_to`` directory, which this process made or saw, is gone (a file system
    unmounted, the directory removed). Uploads do not make it again: the checkpoints would land on whatever
    lies beneath (the local disk under a mount point) and be reported persisted. Permanent."""


class PersistTarget:
    """An fsspec location for persisted checkpoints (see module docstring)."""

    def __init__(self, persist_to: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(persist_to, str | os.PathLike) or not str(persist_to):
            raise ValueError(
                "persist_to must be a directory or an fsspec URL such as 's3://bucket/prefix', "
                f"got {persist_to!r}"
            )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        url = os.fspath(persist_to)
        if _mistyped_url(url):
            raise ValueError(
                f"persist_to={persist_to!r} is no URL with a path (nor a plain directory): "
                "write it as 's3://bucket/prefix' or give a directory"
            )
        self._directory = "://" not in url  # a plain directory, named as it is
        self._root_seen = False  # a local root this process made or wrote in: never made again
        if self._directory:
            url = os.path.abspath(os.path.expanduser(url))
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as e:
            extra = " (pip install s3fs: the s3 extra)" if protocol in ("s3", "s3a") else ""
            raise ValueError(f"persist_to={persist_to!r}: no usable fsspec file system{extra}: {e}") from e

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The file system (fsspec caches instances per process and thread)."""
        return self._resolve()[0]

    @property
    def root(self) -> str:
        """The root path inside ``fs`` (no protocol)."""
        return self._resolve()[1]

    def _resolve(self) -> tuple[fsspec.AbstractFileSystem, str]:
        if self._directory:  # not through url_to_fs, which takes "::" in a path for a chain of URLs
            return fsspec.filesystem("file", **self.storage_options), self.url
        fs, root = url_to_fs(self.url, **self.storage_options)
        return fs, root.rstrip("/")

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    def path(self, checkpoint_id: str, *parts: str) -> str:
        """Path of ``parts`` inside checkpoint ``checkpoint_id``'s directory."""
        return "/".join((self.root, checkpoint_id, *parts))

    def url_of(self, checkpoint_id: str) -> str:
        """The URL of a persisted checkpoint, as stock ``dcp.load(checkpoint_id=...)`` takes it."""
        return f"{self.url}/{checkpoint_id}"

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write a small object so that it appears whole or not at all, durably (object stores: one PUT;
        local file systems: a hidden temporary name, fsync, rename, fsync of the directory)."""
        if self.is_local:
            with self.open_whole(path, len(data)) as out:
                out.write(data)
        else:
            self.fs.pipe_file(path, data)

    @contextlib.contextmanager
    def open_whole(
        self, path: str, block_size: int, uploads: OpenUploads | None = None
    ) -> Iterator[BinaryIO]:
        """A writer for a large file that appears at ``path`` whole, durably, when the block ends without
        an error, and never in part: a failed or killed upload leaves the file that was there before
        as it was. So two nodes uploading the same file (one that took it over, and its writer's node
        back with it) never leave a torn one, even once it is published. Local file systems: written
        under a hidden temporary name beside it (left behind only by a killed process, until
        ``clear_leftovers``), fsynced, renamed over it (``records.atomic_file``), then the directory
        fsynced; object stores: one PUT or multipart upload, aborted on an error (completing it
        included) instead of completed with what was written so far (``_abandon``). With ``uploads``, a
        multipart upload is recorded there from before its first part until it is completed or aborted,
        so that one this process leaves open (killed, or its abort failed) is aborted later."""
        if self.is_local:
            self._local_root()
            directory = Path(path).parent
            directory.mkdir(parents=True, exist_ok=True)
            with atomic_file(Path(path)) as out:
                yield out
            sync_directory(directory)
            return
        out = self.fs.open(path, "wb", block_size=block_size)
        records: list[Path] = []
        if uploads is not None:
            _when_named(out, lambda upload_id: records.append(uploads.opened(path, upload_id)))
        try:
            yield out
            out.close()  # completes the upload
        except BaseException:
            aborted = _abandon(out, path)
            for r in records:
                (uploads.closed if aborted else uploads.given_up)(r)
            raise
        for r in records:
            uploads.closed(r)

    def clear_leftovers(self, checkpoint_id: str) -> list[str]:
        """Remove from checkpoint ``checkpoint_id``'s directory (and our records in it) the temporary
        files that uploads killed while writing left (``records.clear_temporaries``: never one a live
        writer holds locked); their paths. Only local file systems have them: on an object store, the
        multipart uploads that killed processes left open are aborted (``OpenUploads``)."""
        if not self.is_local:
            return []
        removed = []
        for d in (
            self.path(checkpoint_id),
            self.path(checkpoint_id, OUR_DIR),
            self.path(checkpoint_id, PARTS),
        ):
            removed += [f"{d}/{name}" for name in clear_temporaries(Path(d))]
        return removed

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything below it; FileNotFoundError if nothing is there. A local directory
        is removed as named. On an object store the keys below ``path`` are listed (a listing by prefix
        takes no pattern) and deleted each as a pattern of itself alone: fsspec's ``rm`` there expands
        ``*``, ``?`` and ``[`` as patterns, which a bucket prefix may contain, so removing ``run[1]/c``
        would remove ``run1/c``."""
        if self.is_local:
            self.fs.rm(path, recursive=True)
            return
        self.forget_listings()
        keys = self.fs.find(path)
        if not keys:
            raise FileNotFoundError(path)
        self.fs.rm([literal(key) for key in keys])  # each a pattern of itself alone; deleted in batches

    def forget_listings(self) -> None:
        """Drop the file system's cached directory listings of the root, its parents and everything below
        it, so the next listing asks the server. s3fs's ``invalidate_cache`` drops a path and its parents
        only: a checkpoint's directory listed while it uploaded stayed listed without its commit marker
        for the life of the process, and ``latest_checkpoint`` never saw it published."""
        self.fs.invalidate_cache(self.root)
        cache = getattr(self.fs, "dircache", None)
        if cache is not None:
            for key in [k for k in list(cache) if k.startswith(f"{self.root}/")]:
                cache.pop(key, None)

    def check_apart_from(self, root: Path, job_dir: Path) -> None:
        """ValueError if this is a local directory inside the store's own job directory ``job_dir``, or
        its ``root`` (where a checkpoint named as the job would be persisted into the job's directory):
        retention would delete the "persisted" copies with the checkpoints they copy, and the uploads
        would mix with the store's files. ``root`` and ``job_dir`` are resolved paths."""
        if not self.is_local:
            return
        persisted = Path(self.root).resolve()
        if persisted == root or persisted.is_relative_to(job_dir):
            raise ValueError(
                f"persist_to={self.url!r} is {'the MemStore root' if persisted == root else 'inside'} "
                f"the store's own directory {job_dir}: its copies would be evicted with the checkpoints "
                f"in memory. Persist to a directory outside {root}, on durable storage"
            )

    def check_writable(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """Write (and remove) a small object under the root, so that a target no upload can ever reach (a
        missing bucket, a directory that cannot be made or written, refused or missing credentials) is a
        ValueError when the store opens, not a failed upload hours into the job. A target that fails
        otherwise (server down) or does not answer within ``timeout_s`` is logged only: uploads retry."""
        try:
            error = BoundedCalls().call("probe", self._probe, timeout_s)
        except TimeoutError as e:
            error = e
        if error is None:
            return
        if is_permanent(error):
            raise ValueError(f"persist_to={self.url!r} cannot be written: {describe(error)}") from error
        log.warning("cannot reach persist_to=%r now (%s); uploads will retry", self.url, describe(error))

    def _probe(self) -> BaseException | None:
        """Write and remove an empty object under the root; the error it raised, if any. Removal is best
        effort: uploads never delete, so a target that refuses deletes is still usable. Every store writes
        the same name (stores opening at once may remove each other's: the write is what is probed), so a
        process killed between the two, or a target refusing deletes, leaves one such object, not one per
        start."""
        try:
            if self.is_local:
                self._local_root()
            path = f"{self.root}/{PROBE}"
            self.fs.pipe_file(path, b"")
        except Exception as e:  # noqa: BLE001 - classified by the caller
            return e
        with contextlib.suppress(Exception):
            self.fs.rm_file(path)
        return None

    def _local_root(self) -> None:
        """Make the local root the first time (when the store opens); TargetGoneError if it has gone since."""
        if not self._root_seen:
            os.makedirs(self.root, exist_ok=True)
            self._root_seen = True
            return
        try:
            os.stat(self.root)  # another error (ESTALE, EIO on a network file system) is passed on
        except (FileNotFoundError, NotADirectoryError):
            raise TargetGoneError(
                errno.ENOENT,
                f"persist_to directory {self.root} is gone (a file system unmounted, or the directory "
                "removed); it is not made again, lest checkpoints land on what lies beneath. Make it "
                "available again, then call store.persist(id)",
                self.root,
            ) from None

    def __repr__(self) -> str:
        return f"PersistTarget({self.url!r})"


def _when_named(out: Any, named: Callable[[str], None]) -> None:
    """Call ``named(upload_id)`` as soon as the object store names the multipart upload of writer ``out``,
    before its first part is sent (s3fs: the writer's ``mpu``, made by ``_initiate_upload``, which
    ``flush`` calls right before it sends the first part). If ``named`` raises, the writer is closed
    with the error and ``_abandon`` aborts the upload. Writers of other file systems are left as they
    are."""
    initiate = getattr(out, "_initiate_upload", None)
    if initiate is None or not hasattr(out, "mpu"):
        return

    def initiate_and_name() -> None:
        initiate()
        if out.mpu:  # None for a small file's single PUT
            named(out.mpu["UploadId"])

    out._initiate_upload = initiate_and_name


def _abandon(out: Any, path: str) -> bool:
    """Give up the object store writer ``out`` of ``path`` after an error: mark it closed first, so that
    neither a later close nor its finalizer completes the upload with what was written so far (a torn
    object replacing a whole one), then abort its multipart upload (s3fs, gcsfs: ``discard``), also when
    completing it was what failed; whether it was aborted. An abort that fails is logged, not raised:
    the upload's own error is the one that tells what went wrong."""
    out.closed = True
    discard = getattr(out, "discard", None)
    if discard is None:
        return True
    try:
        discard()
    except Exception as e:  # noqa: BLE001 - the caller raises the upload's own error
        log.warning(
            "could not abort the failed upload of %s (%s): its parts stay in the bucket until it is "
            "aborted (the persister tries again later)",
            path,
            describe(e),
        )
        return False
    return True


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mistyped_url(url: str) -> bool:
    """Whether ``url`` is a URL of a known protocol without ``//`` (``s3:/bucket``, which would otherwise
    be taken for a local directory named ``s3:``) or without a path (``s3://``)."""
    m = _SCHEME_WITHOUT_SLASHES.match(url)
    if m is not None and m.group(1) in fsspec.available_protocols():
        return True
    return "://" in url and url.split("://", 1)[1].strip("/") == ""


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
