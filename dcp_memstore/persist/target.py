"""Where persisted checkpoints go: an fsspec file system and a root path in it, from ``persist_to``.

``persist_to`` is an fsspec URL (``s3://bucket/prefix``, ``gs://…``, ``file:///…``) or a plain directory.
A checkpoint ``step-100`` lands in ``<root>/step-100/`` in the standard DCP layout, with our own manifest
and commit marker in ``<root>/step-100/.dcp_memstore/``. The file system is created lazily (and again in
each process: fsspec caches instances), so the target is cheap to build and safe to pickle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from dcp_memstore.store.records import write_atomic

OUR_DIR = ".dcp_memstore"
COMMITTED = f"{OUR_DIR}/COMMITTED"
MANIFEST = f"{OUR_DIR}/manifest.msgpack"
PARTS = f"{OUR_DIR}/parts"
STOCK_METADATA = ".metadata"


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
        if "://" not in url:
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
            directory = Path(path).parent
            directory.mkdir(parents=True, exist_ok=True)
            write_atomic(Path(path), data)
            sync_directory(directory)
        else:
            self.fs.pipe_file(path, data)

    def make_durable(self, path: str) -> None:
        """Flush a written file to stable storage (local file systems; object stores are durable on PUT)."""
        if self.is_local:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            sync_directory(Path(path).parent)

    def forget_listings(self) -> None:
        """Drop the file system's cached directory listings, so the next listing asks the server."""
        self.fs.invalidate_cache(self.root)

    def __repr__(self) -> str:
        return f"PersistTarget({self.url!r})"


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
