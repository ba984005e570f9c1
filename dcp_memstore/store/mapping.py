"""Shard files mapped into the process as torch storages, cached for the life of the process.

A shard file is mapped once (MAP_SHARED, through torch's fd-backed shared storage) and the mapping is kept
while the file exists, so a file reused by a later checkpoint costs no new page faults and, on a GPU
machine, no new ``cudaHostRegister``. Tensors made from a mapping are views of the file: a device-to-host
copy into them lands in tmpfs directly, a read from them copies nothing. Because the storage is an fd-backed
shared storage, tensors staged in the trainer process reach DCP's checkpoint subprocess (PROCESS executor)
as the same file mapping instead of a copy, and the subprocess can tell which file holds them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dcp_memstore.store.threads import in_own_thread

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_POPULATE_READ = 22
_libc = ctypes.CDLL(None, use_errno=True)
_CUDA_HOST_REGISTER_PORTABLE = 1
_pin_warned = False


def cuda_index(device: torch.device | int) -> int:
    """The index of GPU ``device`` (``cuda`` without one: the current device)."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return torch.cuda.current_device() if d.index is None else d.index


def _cudart_call(device: int, name: str, *args: int) -> int:
    """The error code of cudart function ``name(*args)``, called with ``device`` current on a thread of its
    own (see ``MappedFile.pin_for_cuda``)."""

    def call() -> int:
        with torch.cuda.device(device):
            err = getattr(torch.cuda.cudart(), name)(*args)
        return int(getattr(err, "value", err))

    return in_own_thread(call)


def _populate(address: int, nbytes: int) -> None:
    """Fault the whole range in with one call (Linux >= 5.14); a no-op where the kernel lacks it.

    Read faults, also for mappings that will be written: on a shared tmpfs mapping they install writable
    page-table entries and map up to 16 already-written pages per fault (fault-around), where a write fault
    maps one. Measured on the development VM, 1 GiB of a file written before (a reused shard file): 0.12 to
    0.14 s, against 0.25 to 0.30 s with MADV_POPULATE_WRITE, and the copy into it afterwards costs the same.
    Pages allocated but never written cost the same either way (each is zeroed in its own fault)."""
    _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_int(_MADV_POPULATE_READ))


@dataclass(eq=False)
class MappedFile:
    """One shard file mapped into this process."""

    key: tuple[int, int]  # (st_dev, st_ino): identity that survives renames
    fd: int
    size: int
    storage: torch.UntypedStorage
    host_registered: bool = False
    pin_refused: bool = False  # the driver refused to page-lock the mapping: not asked again
    cuda_device: int = 0  # the GPU current when the mapping was registered, and when it is unregistered
    released: bool = False  # unpinned for good: the mapping is going away, nothing registers it again
    mapped_by: int = field(default_factory=os.getpid)  # the process that mapped it (a forked child did not)
    lock: threading.Lock = field(default_factory=threading.Lock)
    address: int = 0  # where the file is mapped; set from the storage at creation

    def __post_init__(self) -> None:
        self.address = self.storage.data_ptr()

    def intact(self) -> bool:
        """False if torch moved the storage's data elsewhere (pickling a storage with the 'file_system'
        sharing strategy does that), so writes through it would no longer reach the file."""
        return self.storage.data_ptr() == self.address

    @property
    def path(self) -> str:
        """The file's current path (follows renames)."""
        return os.readlink(f"/proc/self/fd/{self.fd}")

    def pin_for_cuda(self, device: torch.device | int) -> bool:
        """Page-lock the mapping for CUDA (``cudaHostRegister``, once per mapping), so device-to-host copies
        are DMA straight into tmpfs pages. Returns whether it is pinned; without CUDA, or where the driver
        refuses (then it is not asked again for this mapping), copies still work through pageable memory
        (one warning says why).

        The call runs on a thread of its own with ``device`` (the GPU of the tensors copied) current: the
        calling thread may be an I/O thread whose current device is GPU 0, where it would create a CUDA
        context on GPU 0 in every rank's process, and a refusal leaves an error in the calling thread's CUDA
        state that its next kernel launch would raise as its own."""
        global _pin_warned
        if self.host_registered or self.pin_refused or not torch.cuda.is_available():
            return self.host_registered and self.mapped_by == os.getpid()
        if self.mapped_by != os.getpid():  # a forked child, which cannot use CUDA
            return False
        with self.lock:
            if not (self.host_registered or self.pin_refused or self.released):
                index = cuda_index(device)
                err = _cudart_call(
                    index, "cudaHostRegister", self.address, self.size, _CUDA_HOST_REGISTER_PORTABLE
                )
                if err == 0:
                    self.cuda_device = index
                    self.host_registered = True
                else:
                    self.pin_refused = True
                    if not _pin_warned:
                        _pin_warned = True
                        log.warning(
                            "cudaHostRegister of a tmpfs mapping failed (CUDA error %d); "
                            "GPU copies use pageable memory",
                            err,
                        )
        return self.host_registered

    def unpin(self) -> None:
        """Undo ``pin_for_cuda`` for good, before the mapping goes away: under the mapping's lock, so a
        ``pin_for_cuda`` running meanwhile either registered it before (and it is unregistered here) or
        registers nothing. In a forked child (Megatron's async writer) the registration is the parent's,
        and the child cannot use CUDA: there it is only forgotten (without the lock, which a thread of
        the parent may have held at the fork)."""
        if self.mapped_by != os.getpid():
            self.released, self.host_registered = True, False
            return
        with self.lock:
            self.released = True
            if not self.host_registered:
                return
            self.host_registered = False
            err = _cudart_call(self.cuda_device, "cudaHostUnregister", self.address)
        if err != 0:
            log.warning("cudaHostUnregister of %s failed (CUDA error %d)", self.path, err)

    def populate(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Fault in ``nbytes`` bytes of the mapping from ``offset`` (default: all of it) in one call."""
        n = self.size - offset if nbytes is None else min(nbytes, self.size - offset)
        if n > 0:
            _populate(self.address + offset, n)

    def exists(self) -> bool:
        """False once the file has been deleted from every directory."""
        return os.fstat(self.fd).st_nlink > 0

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` viewing the file's bytes from ``offset`` (no copy)."""
        itemsize = dtype.itemsize
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not aligned to {dtype} ({itemsize} bytes)")
        numel = 1
        for s in shape:
            numel *= s
        if offset + numel * itemsize > self.size:
            raise ValueError(
                f"range [{offset}, {offset + numel * itemsize}) is outside {self.path} ({self.size} bytes)"
            )
        return torch.empty(0, dtype=dtype).set_(self.storage, offset // itemsize, tuple(shape))

    def contains(self, t: torch.Tensor) -> int | None:
        """Byte offset of contiguous tensor ``t`` inside this file, or None if ``t`` is not a view of it."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        try:
            if t.untyped_storage().data_ptr() != self.address:
                return None
        except RuntimeError:
            return None
        offset = t.data_ptr() - self.address
        return offset if offset >= 0 and offset + t.numel() * t.element_size() <= self.size else None


class _MappingCache:
    """Process-wide registry of mapped shard files, by file identity and by mapping address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[int, int], MappedFile] = {}
        self._by_address: dict[int, MappedFile] = {}

    def map_fd(self, fd: int, populate: bool = True) -> MappedFile:
        """Map the file open as ``fd`` (the cache takes ownership of ``fd``), its pages faulted in unless
        ``populate`` is False (the caller then faults them in, see ``MappedFile.populate``)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            cached = self._by_key.get(key)
            if cached is not None and cached.size == st.st_size and cached.intact():
                os.close(fd)
                return cached
            if cached is not None:
                self._forget(cached)
        try:
            if st.st_size == 0:
                raise ValueError(f"cannot map {os.readlink(f'/proc/self/fd/{fd}')}: the file is empty")
            # torch maps a duplicate of fd; where mapping fails (ENOMEM), fd is still ours to close
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, st.st_size)
            mf = MappedFile(key=key, fd=fd, size=st.st_size, storage=storage)
            if populate:
                mf.populate()
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._by_key[key] = mf
            self._by_address[mf.address] = mf
        return mf

    def map_path(self, path: Path | str) -> MappedFile:
        """Map the file at ``path`` (cached by identity: a renamed file keeps its mapping)."""
        return self.map_fd(os.open(path, os.O_RDWR | os.O_CLOEXEC))

    def find(self, t: torch.Tensor) -> MappedFile | None:
        """The mapped shard file ``t`` is a view of, or None.

        Also recognises a mapping that arrived from another process (a tensor pickled by DCP's PROCESS
        executor carries the file's descriptor), and adopts it into the cache.
        """
        if t.device.type != "cpu":
            return None
        try:
            storage = t.untyped_storage()
        except RuntimeError:
            return None
        # under the lock from look-up to adoption: two threads adopting the same storage would each keep
        # a descriptor of the file, and the one not kept in the cache would never be closed
        with self._lock:
            mf = self._by_address.get(storage.data_ptr())
            if mf is not None or not storage.is_shared():
                return mf
            try:
                fd, size = storage._share_fd_cpu_()
            except RuntimeError:
                return None
            st = os.fstat(fd)
            if st.st_size != size:
                return None
            mf = MappedFile(key=(st.st_dev, st.st_ino), fd=os.dup(fd), size=size, storage=storage)
            self._by_key.setdefault(mf.key, mf)  # an own mapping of the same file stays the one reused
            self._by_address[mf.address] = mf
            return mf

    def is_mapped(self, key: tuple[int, int]) -> bool:
        with self._lock:
            return key in self._by_key

    def prune(self) -> None:
        """Drop mappings of files that no longer exist anywhere, so their memory can be freed."""
        with self._lock:
            every = {id(mf): mf for mf in [*self._by_key.values(), *self._by_address.values()]}
            for mf in every.values():
                if not mf.exists() or not mf.intact():
                    self._forget(mf)

    def _forget(self, mf: MappedFile) -> None:
        if self._by_key.get(mf.key) is mf:
            del self._by_key[mf.key]
        if self._by_address.get(mf.address) is mf:
            del self._by_address[mf.address]
        try:
            mf.unpin()
        finally:
            os.close(mf.fd)


MAPPINGS = _MappingCache()


def _fresh_lock_in_child() -> None:
    """A forked child has none of the parent's threads: a lock one of them held at the fork would never be
    released there. (The mappings themselves are inherited and stay valid.)"""
    MAPPINGS._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)
