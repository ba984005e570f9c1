"""What a replication transport offers (``Transport``), and the file handling every transport shares.

A transport moves whole files between this process and a peer's server: pushes a node's checkpoint files to
the peer that keeps their replica, fetches them back to restore a node, and asks what a peer holds. It
retries nothing itself; the caller (the replicator) decides what to retry and when.

Received bytes land in an ``IncomingFile``: a hidden temporary file next to the final path, allocated to its
full size first (a full tmpfs is an error then, never a SIGBUS later), mapped, filled straight from the
network, and renamed into place only after its checksum matched. Readers never see a partial file, and a
failed transfer leaves nothing behind. A process killed mid-transfer leaves its temporary file, whose name
holds the process's liveness token in the store (``store/liveness.py``), not its pid: ``remove_stale_parts``
judges it by that token's lock, which holds across PID namespaces (containers sharing the tmpfs).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import stat
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from dcp_memstore.store import liveness
from dcp_memstore.store.checksum import memory_view
from dcp_memstore.store.ids import validate_file_name, validate_name
from dcp_memstore.store.layout import StoreLayout, part_name, part_owner
from dcp_memstore.store.mapping import MAPPINGS, MappedFile
from dcp_memstore.store.space import allocate_file, check_space

PeerAddress = tuple[str, int]
PAGE = os.sysconf("SC_PAGE_SIZE")
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def format_peer(peer: PeerAddress) -> str:
    """``host:port`` (``[host]:port`` for IPv6) for messages."""
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def checked_names(checkpoint: str, file: str, source_node: str | None) -> tuple[str, str, str | None]:
    """A transfer's names, validated before anything is sent: the checkpoint id, the file name and the node
    whose replica it is (None: the peer's own copy)."""
    source_node = None if source_node is None else validate_name(source_node, "source node")
    return validate_name(checkpoint, "checkpoint id"), validate_file_name(file), source_node


class ReplicationError(RuntimeError):
    """A peer refused or failed a request; ``code`` says what kind of failure (``auth``, ``not_found``,
    ``no_space``, ``checksum``, ``too_large``, ``bad_request``, ``busy``, ``io_error``, ``protocol``; RDMA:
    ``rdma`` (a work completion failed), ``rdma_unavailable`` (the peer has no RDMA endpoint),
    ``rdma_failed`` (setting up RDMA failed on the peer before any byte moved))."""

    def __init__(self, peer: PeerAddress, code: str, message: str) -> None:
        self.peer, self.code, self.message = peer, code, message
        super().__init__(f"peer {format_peer(peer)}: {message} [{code}]")

    def __reduce__(self) -> tuple:  # DCP sends a failed load's exception to the other ranks pickled
        return type(self), (self.peer, self.code, self.message)


class Transport(ABC):
    """Moves checkpoint files between this process and peers' servers. Methods raise ConnectionError or
    TimeoutError (naming the peer) when the peer cannot be reached or stops answering, and ReplicationError
    when it refuses a request. Implementations are safe to use from several threads at once."""

    @abstractmethod
    def put_file(
        self, peer_addr: PeerAddress, source_node: str, checkpoint: str, file: str, path: Path
    ) -> None:
        """Store the local file ``path`` on the peer as file ``file`` of its replica of checkpoint
        ``checkpoint`` from node ``source_node``; returns once the peer has verified and kept it."""

    @abstractmethod
    def get_file(
        self,
        peer_addr: PeerAddress,
        checkpoint: str,
        file: str,
        dest_path: Path,
        source_node: str | None = None,
        *,
        layout: StoreLayout,
    ) -> None:
        """Fetch file ``file`` of checkpoint ``checkpoint`` from the peer (its own copy, or with
        ``source_node`` its replica of that node's) to ``dest_path``, which appears only once verified.
        ``layout``: the store ``dest_path`` is in (see ``IncomingFile``)."""

    @abstractmethod
    def stat(
        self,
        peer_addr: PeerAddress,
        checkpoint: str,
        persist_to: str | None = None,
        deadline: float | None = None,
    ) -> dict:
        """What the peer holds of ``checkpoint``: ``{"own": {file: size}, "committed": bool,
        "replicas": {source_node: {file: size}}, "upload": {"state": str, "error": str | None} | None,
        "replication": {replica_node: state} | None, "listed": int}``. ``upload`` is the peer's upload
        state of its committed copy towards target URL ``persist_to`` (None without ``persist_to``);
        ``replication`` (the state of the peer's own files on its replica nodes) and ``listed`` (the data
        files its manifest lists) are also a committed copy's only (None and 0 elsewhere). ``deadline``:
        ``time.monotonic()`` by which the whole call must end (a wait's), on top of the transport's own
        timeout for each wait for the peer."""

    @abstractmethod
    def close(self) -> None:
        """Release the transport's resources; calls in flight end with an error."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class FileRange:
    """Bytes ``[offset, offset + length)`` of the open file ``fd``, mapped shared with their pages populated
    (one system call instead of a page fault per page), until ``close()``. Mapped with mmap(2) directly, so
    closing never waits for Python buffer exports to go away; the caller keeps views no longer than this."""

    def __init__(self, fd: int, offset: int, length: int, writable: bool) -> None:
        start = offset - offset % PAGE
        self._length = length + (offset - start)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        base = _libc.mmap(None, self._length, prot, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, start)
        if base is None or base == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {length} bytes of a file: {os.strerror(err)}")
        self._base: int | None = base
        self.address = base + (offset - start)

    def close(self) -> None:
        if self._base is not None:
            _libc.munmap(self._base, self._length)
            self._base = None


class IncomingFile:
    """A file being received into ``path``: a hidden temporary file of ``size`` bytes beside it, allocated
    in full and mapped for writing (``view``). ``commit()`` renames it into place; leaving the ``with`` block
    without a commit (or ``abort()``) deletes it. Either way the mapping is dropped (the process's mapping
    cache never holds received files, so they cost no descriptors once written).

    ``layout`` is the store ``path`` is in: the temporary file's name holds this process's liveness token
    there (``part_name`` in ``store/layout.py``), so that a cleanup in any process of the store can tell
    whether its writer still runs. Raises InsufficientSpaceError (and leaves nothing) if ``size`` bytes do
    not fit."""

    def __init__(self, path: Path, size: int, layout: StoreLayout) -> None:
        self.path, self.size = Path(path), size
        owner = liveness.own_token(layout)
        self.tmp = self.path.with_name(part_name(self.path.name, owner, uuid.uuid4().hex[:8]))
        self._range: FileRange | None = None
        self._done = False
        check_space(self.path.parent, size)
        fd = allocate_file(self.tmp, size)
        try:
            if size:
                self._range = FileRange(fd, 0, size, writable=True)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    @property
    def view(self) -> memoryview:
        """The file's bytes, writable, with no copy; valid until ``commit()`` or ``abort()``."""
        if self._range is None:
            return memoryview(bytearray())
        return memory_view(self._range.address, self.size).cast("B")

    def commit(self) -> None:
        """Make the file visible under its final name (atomic; replaces an older file of that name)."""
        self._unmap()
        os.rename(self.tmp, self.path)
        self._done = True

    def abort(self) -> None:
        """Delete the temporary file (no-op after ``commit``)."""
        self._unmap()
        if not self._done:
            self._done = True
            self.tmp.unlink(missing_ok=True)

    def _unmap(self) -> None:
        if self._range is not None:
            self._range.close()
            self._range = None

    def __enter__(self) -> IncomingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort()


class OutgoingFile:
    """Bytes ``[offset, offset + length)`` (default: to the end) of the file at ``path``, to send: ``view``.

    Seen through the process's cached mapping when the file is already mapped here (a file this process
    wrote: no new page faults), else through a mapping of just that range, dropped by ``close()``. Symlinks
    are not followed. Raises ValueError for a range outside the file."""

    def __init__(self, path: Path, offset: int = 0, length: int | None = None) -> None:
        self._range: FileRange | None = None
        self._cached: MappedFile | None = None
        self.address = 0
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            self.file_size = st.st_size
            self.length = max(0, st.st_size - offset) if length is None else length
            if offset + self.length > st.st_size:
                raise ValueError(
                    f"range [{offset}, {offset + self.length}) is outside {path} ({st.st_size} bytes)"
                )
            if self.length and MAPPINGS.is_mapped((st.st_dev, st.st_ino)):
                self._cached = MAPPINGS.map_fd(fd)  # takes the descriptor
                fd = -1
                self.address = self._cached.address + offset
            elif self.length:
                self._range = FileRange(fd, offset, self.length, writable=False)
                self.address = self._range.address
        finally:
            if fd >= 0:
                os.close(fd)

    @property
    def view(self) -> memoryview:
        """The range's bytes, read-only use, no copy; valid until ``close()``."""
        return memory_view(self.address, self.length) if self.length else memoryview(b"")

    def close(self) -> None:
        if self._range is not None:
            self._range.close()
            self._range = None
        self._cached = None

    def __enter__(self) -> OutgoingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def list_files(directory: Path | str) -> dict[str, int]:
    """Regular files with valid names directly in ``directory`` and their sizes (hidden temporaries,
    markers in subdirectories, symlinks and anything else left out); empty if it does not exist."""
    files = {}
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return files
    for e in entries:
        try:
            validate_file_name(e.name)
            st = e.stat(follow_symlinks=False)
        except (ValueError, FileNotFoundError):
            continue
        if stat.S_ISREG(st.st_mode):
            files[e.name] = st.st_size
    return files


def remove_stale_parts(layout: StoreLayout, directory: Path) -> int:
    """Delete temporary files of transfers whose receiving process is gone (a crash mid-transfer) anywhere
    under ``directory`` of store ``layout``; return how many. Files of live processes (another rank's
    server, in this container or another one) are kept: each is judged by the liveness token in its name."""
    removed = 0
    for dirpath, _, names in os.walk(directory):
        for name in names:
            owner = part_owner(name)
            if owner is not None and not liveness.alive(layout, owner):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
    return removed
