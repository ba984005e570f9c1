"""The process-wide cache of shard file mappings: every descriptor it takes or makes is closed once the
file is gone, also where mapping fails or two threads adopt the same storage at once. A descriptor left
open keeps a deleted tmpfs file's memory taken for the life of the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

from dcp_memstore.store.mapping import MAPPINGS

REPO = Path(__file__).resolve().parents[2]


def _descriptors_of(inode: int) -> list[int]:
    """This process's open descriptors of the file with ``inode`` (also once it is deleted)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{name}").st_ino == inode:
                found.append(int(name))
        except FileNotFoundError:
            continue  # the descriptor listdir itself used
    return found


def test_a_file_that_cannot_be_mapped_is_closed(shm_dir):
    """Mapping a file can fail for real (ENOMEM: here the address-space limit of a child process, on a
    node the kernel's map count or memory); the descriptor the cache was given must be closed, not leaked.
    (torch leaks the duplicate it made of it there: not ours to close.)"""
    script = textwrap.dedent(
        """
        import fcntl, os, resource, sys
        from dcp_memstore.store.mapping import MAPPINGS
        path = sys.argv[1]
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse: takes no memory
        vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (256 << 20), hard))
        try:
            MAPPINGS.map_fd(fd)
        except RuntimeError as e:
            assert "Cannot allocate memory" in str(e), e
        else:
            sys.exit("mapping 1 GiB under a 256 MiB address-space margin succeeded")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        try:
            fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            print("closed")
        else:
            print("open")
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script, str(shm_dir / "big.shard")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "closed", "the descriptor of a file that failed to map was left open"


def _look_up_at_once(t: torch.Tensor) -> list:
    """``MAPPINGS.find(t)`` from two threads at once; what each found."""
    start = threading.Barrier(2)
    found = []

    def look_up() -> None:
        start.wait()
        found.append(MAPPINGS.find(t))

    threads = [threading.Thread(target=look_up) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return found


def test_two_threads_adopting_one_received_storage_leave_no_descriptor(shm_dir, monkeypatch):
    """A storage that arrived from another process (DCP's checkpoint process receives staged tensors so)
    of a file this process maps itself too: two threads that look it up at once must not each keep a
    descriptor of it. The window between the look-up and the adoption is widened with a slow ``os.dup``
    (a mock: a real scheduler interleaves there only now and then)."""
    path = shm_dir / "f.shard"
    path.write_bytes(bytes(range(256)) * 16)
    inode = path.stat().st_ino
    own = MAPPINGS.map_path(path)  # this process's own mapping of the file, kept as the one reused
    fd = os.open(path, os.O_RDWR)
    received = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared_fd_cpu(fd, 4096))
    os.close(fd)  # as when unpickled: the storage holds a descriptor of its own
    real_dup = os.dup

    def slow_dup(f: int) -> int:
        time.sleep(0.3)
        return real_dup(f)

    monkeypatch.setattr(os, "dup", slow_dup)
    found = _look_up_at_once(received)
    monkeypatch.undo()
    assert len(found) == 2 and all(mf is not None and mf.contains(received) == 0 for mf in found)
    del received, found, own
    path.unlink()
    MAPPINGS.prune()
    assert _descriptors_of(inode) == [], "a descriptor of the deleted file is still open"


def test_a_mapping_dropped_while_it_is_being_registered_is_left_unregistered(shm_dir, monkeypatch):
    """A mapping whose file is gone is dropped (and unregistered for CUDA) while another thread is still
    registering it: the drop waits for that registration and undoes it, and nothing registers the
    mapping again, so no page-locked range outlives its mapping (a later mapping at that address would
    be refused by the driver for good). The driver is a stand-in here (no GPU; said so): its register
    call takes 0.3 s, which widens the window a real scheduler hits only now and then."""
    from dcp_memstore.store import mapping

    calls: list[str] = []
    under_way = threading.Event()

    def cudart(device: int, name: str, *args: int) -> int:
        if name == "cudaHostRegister":
            under_way.set()
            time.sleep(0.3)
        calls.append(name)
        return 0

    monkeypatch.setattr(mapping, "_cudart_call", cudart)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = shm_dir / "f.shard"
    path.write_bytes(bytes(4096))
    mf = MAPPINGS.map_path(path)
    registering = threading.Thread(target=mf.pin_for_cuda, args=(0,))
    registering.start()
    assert under_way.wait(30)
    path.unlink()
    MAPPINGS.prune()  # drops the mapping of the deleted file
    registering.join()
    assert calls == ["cudaHostRegister", "cudaHostUnregister"]
    assert mf.pin_for_cuda(0) is False and calls == ["cudaHostRegister", "cudaHostUnregister"]
