"""The RDMA transport, through pyverbs (the ``rdma`` extra): payload bytes move by RDMA, everything else stays
on the authenticated TCP connection of the TCP transport.

How a file moves (one reliable-connected queue pair per transfer, set up inside signed headers):

- ``put_file`` (``rdma_put``): the sender creates a queue pair and sends its details (``qp``) with the file's
  name and size. The server checks names, size and space exactly as for ``put`` and refuses before touching
  anything; else it allocates the hidden temporary file, registers its mapping as a memory region the peer
  may write (``REMOTE_WRITE``, in a protection domain of its own), connects its queue pair to the sender's
  (RTR) and replies with its queue pair, the address and the rkey. The sender registers its source mapping
  (local read only), connects (RTS), posts RDMA writes of at most 64 MiB each (fewer if the port's maximum
  message is smaller), at most 16 in flight, hashes each piece (xxh3-64) while the adapter reads it, and
  once every piece completed sends the checksum in the trailer over TCP. The server then destroys its queue
  pair and deregisters the region (no RDMA write reaches the file after that), hashes what arrived and
  renames the file into place only if the checksums match. A failed transfer leaves no file.
- ``get_file`` (``rdma_get``): the server opens the file by the same rules as ``get`` (its own committed copy
  or a replica, no symlinks), hashes it, registers it readable by the peer (``REMOTE_READ``), connects
  (RTS) and replies with size, address, rkey, queue pair and checksum. The receiver RDMA-reads into its
  preallocated temporary file's mapping, hashes it, sends its checksum (which tells the server to release
  the file) and keeps the file only if the checksums match.
- A work completion with an error status is a ReplicationError (code ``rdma``) naming the peer and the
  status; no completion for ``timeout_s`` is a TimeoutError. A server without RDMA refuses both ops with
  code ``rdma_unavailable``: that peer is then served over TCP (logged once per peer). If the verbs setup
  fails on either side before a byte moved (code ``rdma_failed`` from the server, or a failure here), that
  transfer goes over TCP. ``stat`` and ``ping`` always go over TCP.

Security: the queue pair details, address and rkey travel only in HMAC-signed headers; a server registers
nothing before the request's MAC, job, connection challenge, timestamp and nonce checked out and the
names, size and space were accepted; each exposed region is the one file's mapping, with the one access
right the transfer needs, in a protection domain shared with nothing but that transfer's queue pair,
connected to the requester's queue pair only, and deregistered when the transfer ends (or the connection
drops). The sender's own region is local-read only. Payload integrity: xxh3-64 end to end, as over TCP.

What was verified, and how. This machine has no RDMA hardware and no pyverbs: here "auto" picks TCP and
logs why, once. Everything else was run against a FAKE pyverbs module (a mock standing in for the device,
``tests/replication/fake_pyverbs.py``): its memory regions are addresses in the test process, and an RDMA
write/read is a ``ctypes.memmove`` between registered ranges after checking lkey/rkey, bounds, access
flags of region and queue pair, protection domains, and that the two queue pairs are connected to each
other with matching PSNs and a valid address vector; it queues completions and can inject error
completions, work that never completes and registration failures. Against it (``test_rdma_transfer.py``,
``test_rdma_boundary.py``), a real ``PeerServer`` with an ``RdmaEndpoint`` and this transport on 127.0.0.1
with real tmpfs files: moved files bit-exact both ways (empty, 1 byte, 18 pieces, 129 MiB in 64 MiB
pieces; replicas and committed own copies; 12 threads at once; at most 16 requests in flight when
completions trickle in); the server registered only the file, with only REMOTE_WRITE (put) or REMOTE_READ
(get), the sender only local access; a wrong rkey, an address off by one or a range past the end was
refused by the (fake) adapter; error completions became ReplicationError naming the peer and the status,
silence a TimeoutError, closing the transport ended a transfer in flight, a bad trailer or announced
checksum kept nothing, and none of these left a file or a live verbs object; a server without RDMA meant
TCP for that peer (logged once), a failed registration on the server TCP for that transfer;
unauthenticated, replayed and malformed requests were refused before any registration or queue pair;
device handling: pyverbs missing, no device, a failed open, a port down, the GID choice on IB and RoCE.
NOT verified: real pyverbs (the calls follow rdma-core's pyverbs sources, see ``rdma_verbs``), real
adapters and fabrics (InfiniBand or RoCE addressing, GID choice, MTU, whether a write target in RTR
behaves as assumed, registering tmpfs and read-only mappings, locked-memory limits, fork), two real
nodes, throughput, and behaviour under real link failures.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import xxhash

from dcp_memstore.replication import wire
from dcp_memstore.replication.auth import check_secret
from dcp_memstore.replication.rdma_verbs import (
    LOCAL_READ,
    LOCAL_WRITE,
    NO_REMOTE,
    REMOTE_READ,
    REMOTE_WRITE,
    SEND_WINDOW,
    Device,
    QPInfo,
    Session,
    VerbsError,
    buffer_address,
    import_pyverbs,
    list_devices,
)
from dcp_memstore.replication.tcp import DEFAULT_TIMEOUT_S, TcpTransport, _Call
from dcp_memstore.replication.transport import (
    IncomingFile,
    OutgoingFile,
    PeerAddress,
    ReplicationError,
    Transport,
    checked_names,
    format_peer,
)
from dcp_memstore.store.checksum import checksum_bytes
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import StoreLayout

log = logging.getLogger(__name__)

_POLL_PAUSE_MAX_S = 1e-3


def pyverbs_available() -> bool:
    """Whether pyverbs can be imported."""
    try:
        import_pyverbs()
    except ImportError:
        return False
    return True


def rdma_devices() -> list[str]:
    """Names of the RDMA devices pyverbs lists (e.g. ``["mlx5_0"]``); ``[]`` when pyverbs is not installed,
    no device exists, or listing them fails (logged at DEBUG)."""
    try:
        return list_devices()
    except ImportError:
        return []
    except Exception as e:  # pyverbs raises its own error types when the verbs library finds nothing
        log.debug("listing RDMA devices failed: %s", e)
        return []


def open_device(device: str | None = None, port: int = 1, gid_index: int | None = None) -> Device:
    """Open RDMA device ``device`` (default: the first listed) on ``port``. Raises RuntimeError saying
    what is missing: pyverbs, any device, the named device, or a working open (the cause is chained)."""
    try:
        import_pyverbs()
    except ImportError as e:
        raise RuntimeError(
            f"RDMA transport unavailable: pyverbs is not installed ({e}). Install the 'rdma' extra "
            f"(pip install pyverbs, which needs rdma-core) or use the TCP transport."
        ) from e
    names = rdma_devices()
    if not names:
        raise RuntimeError(
            "RDMA transport unavailable: pyverbs is installed but lists no RDMA device on this node "
            "(see `ibv_devices`). Use the TCP transport."
        )
    if device is not None and device not in names:
        raise RuntimeError(
            f"RDMA transport unavailable: device {device!r} not found (devices: {', '.join(names)})"
        )
    name = device if device is not None else names[0]
    try:
        opened = Device(name, port, gid_index)
    except (VerbsError, ImportError) as e:
        raise RuntimeError(f"RDMA transport unavailable: {e}") from e
    log.debug(
        "opened RDMA device %s port %d (lid %d, gid index %d)", name, port, opened.lid, opened.gid_index
    )
    return opened


class Exposure:
    """One file mapping a server exposes to one peer's queue pair; ``fields`` go into the reply
    (``addr``, ``rkey``, ``qp``). ``close()`` destroys the queue pair and deregisters the mapping."""

    def __init__(self, session: Session, fields: dict) -> None:
        self.session, self.fields = session, fields

    def close(self) -> None:
        self.session.close()


class RdmaEndpoint:
    """The RDMA side of a ``PeerServer``: exposes file mappings to peers' queue pairs. Holds one reference
    to ``device`` (released by ``close()``, which the server calls when it closes)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._closed = False

    @classmethod
    def open(cls, device: str | None = None, port: int = 1, gid_index: int | None = None) -> RdmaEndpoint:
        """An endpoint on its own device (RuntimeError as for ``open_device``)."""
        return cls(open_device(device, port, gid_index))

    def expose(self, address: int, length: int, *, writable: bool, peer: dict) -> Exposure:
        """Register ``length`` bytes at ``address`` for the peer whose queue pair is ``peer`` (wire form):
        writable by it (an ``rdma_put``) or readable (an ``rdma_get``), in a protection domain of their
        own, and connect a queue pair to it. Raises VerbsError."""
        access = REMOTE_WRITE if writable else REMOTE_READ
        session = self.device.session(own_pd=True)
        try:
            _, rkey = session.register(address, length, access)
            # A write target only has to accept requests (RTR); a read target sends the read responses.
            session.connect(QPInfo.from_wire(peer), remote_access=access, send=not writable)
        except BaseException:
            session.close()
            raise
        return Exposure(session, {"addr": address, "rkey": rkey, "qp": session.info.to_wire()})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.device.release()


SETUP_FAILURES_FOR_TCP = 3  # RDMA setup failures with a peer before it is served over TCP for good


class _UseTcp:
    """Set by ``RdmaTransport._fallback_to_tcp`` when the transfer must be redone over TCP."""

    value = False

    def __bool__(self) -> bool:
        return self.value


class _Fallback(Exception):
    """This transfer goes over TCP: ``reason`` says why; ``peer_lacks_rdma``: for every later one too."""

    def __init__(self, reason: str, peer_lacks_rdma: bool) -> None:
        super().__init__(reason)
        self.reason, self.peer_lacks_rdma = reason, peer_lacks_rdma


class RdmaTransport(Transport):
    """Transport moving payloads by RDMA verbs for job ``job_id`` holding ``secret`` (see the module
    docstring); control requests, ``stat`` and peers without RDMA use an inner ``TcpTransport``
    (``tcp``). ``device`` names the RDMA device (default: the first listed), ``port`` its port,
    ``gid_index`` its GID entry (default: chosen, see ``rdma_verbs.Device``). ``timeout_s`` bounds each wait
    for the peer: a TCP reply, or the next RDMA completion.

    The constructor opens the device and raises RuntimeError naming what is missing (pyverbs not installed,
    no RDMA device, the named device absent, or the open failing). ``endpoint()`` gives the matching server
    side, sharing the device."""

    def __init__(
        self,
        job_id: str,
        secret: bytes,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: str | None = None,
        port: int = 1,
        gid_index: int | None = None,
    ) -> None:
        self.job_id = validate_name(job_id, "job id")
        self.secret = check_secret(secret)
        self.timeout_s = timeout_s
        self.tcp = TcpTransport(self.job_id, self.secret, timeout_s)
        self.device = open_device(device, port, gid_index)
        self.device_name, self.port = self.device.name, port
        self._lock = threading.Lock()
        self._tcp_peers: dict[PeerAddress, str] = {}
        self._rdma_worked: set[PeerAddress] = set()  # peers that completed a transfer by RDMA
        self._setup_failures: dict[PeerAddress, int] = {}
        self._local_failure_logged = False
        self._closed = False

    def endpoint(self) -> RdmaEndpoint:
        """A server-side endpoint on this transport's device (for ``PeerServer(rdma=...)``)."""
        return RdmaEndpoint(self.device.acquire())

    def tcp_peers(self) -> dict[PeerAddress, str]:
        """Peers served over TCP because they have no RDMA, with the reason each gave."""
        with self._lock:
            return dict(self._tcp_peers)

    # --- control over TCP ----------------------------------------------------------------------------

    def ping(self, peer_addr: PeerAddress) -> float:
        """Round trip to the peer's server over TCP, in seconds."""
        return self.tcp.ping(peer_addr)

    def stat(
        self,
        peer_addr: PeerAddress,
        checkpoint: str,
        persist_to: str | None = None,
        deadline: float | None = None,
    ) -> dict:
        return self.tcp.stat(peer_addr, checkpoint, persist_to, deadline)

    # --- data ------------------------------------------------------------------------------------------

    def put_file(
        self, peer_addr: PeerAddress, source_node: str, checkpoint: str, file: str, path: Path
    ) -> None:
        checkpoint, file, source_node = checked_names(checkpoint, file, source_node)
        peer = (peer_addr[0], int(peer_addr[1]))
        if not self._peer_over_tcp(peer):
            with self._fallback_to_tcp(peer) as use_tcp:
                self._put(peer, source_node, checkpoint, file, Path(path))
            if not use_tcp:
                return
        self.tcp.put_file(peer, source_node, checkpoint, file, path)

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
        checkpoint, file, source_node = checked_names(checkpoint, file, source_node)
        peer = (peer_addr[0], int(peer_addr[1]))
        if not self._peer_over_tcp(peer):
            with self._fallback_to_tcp(peer) as use_tcp:
                self._get(peer, checkpoint, file, Path(dest_path), source_node, layout)
            if not use_tcp:
                return
        self.tcp.get_file(peer, checkpoint, file, dest_path, source_node, layout=layout)

    def close(self) -> None:
        """Refuse new calls, end those in flight (their TCP connections are shut down and their completion
        polling stops), and release the device (closed once no transfer and no endpoint uses it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.tcp.close()
        self.device.release()

    # --- internals -------------------------------------------------------------------------------------

    def _put(self, peer: PeerAddress, source_node: str, checkpoint: str, file: str, path: Path) -> None:
        what = f"sending file {file} of checkpoint {checkpoint} of node {source_node} by RDMA"
        with OutgoingFile(path) as source:
            size = source.length
            session = self._session() if size else None
            try:
                with self._call(peer, what) as call:
                    fields = {"source": source_node, "checkpoint": checkpoint, "file": file, "size": size}
                    qp = session.info.to_wire() if session is not None else None
                    nonce, reply = self._request(call, "rdma_put", {**fields, "qp": qp})
                    if session is None:
                        checksum = checksum_bytes(source.view)
                    else:
                        remote = self._remote_qp(call, reply)
                        self._setup(session, source.address, size, LOCAL_READ, remote)
                        checksum = self._move(
                            call, session, "write", source.address, size, reply, source.view
                        )
                        session.close()  # every piece completed: nothing more goes through it
                    call.run(wire.send_trailer, checksum)
                    call.reply("rdma_put_stored", nonce, index=1)
            finally:
                if session is not None:
                    session.close()  # before the source mapping goes

    def _get(
        self,
        peer: PeerAddress,
        checkpoint: str,
        file: str,
        dest: Path,
        source_node: str | None,
        layout: StoreLayout,
    ) -> None:
        where = "its own copy" if source_node is None else f"its replica of node {source_node}"
        what = f"fetching file {file} of checkpoint {checkpoint} from {where} by RDMA"
        session = self._session()
        try:
            with self._call(peer, what) as call:
                fields = {"checkpoint": checkpoint, "file": file, "source": source_node}
                _, reply = self._request(call, "rdma_get", {**fields, "qp": session.info.to_wire()})
                size = reply["size"]
                with IncomingFile(dest, size, layout) as incoming:  # refused here (no space): nothing is read
                    try:
                        if size:
                            remote = self._remote_qp(call, reply)
                            address = buffer_address(incoming.view)
                            self._setup(session, address, size, LOCAL_WRITE, remote)
                            self._move(call, session, "read", address, size, reply, None)
                    finally:
                        session.close()  # before the destination mapping goes, whatever happened
                    actual = checksum_bytes(incoming.view)
                    call.run(wire.send_trailer, actual)  # done: the peer releases the file
                    if actual != reply["checksum"]:
                        raise ReplicationError(
                            call.peer,
                            "checksum",
                            f"RDMA-read bytes do not match ({what}): xxh3_64 {actual:#018x}, the peer "
                            f"computed {reply['checksum']:#018x}; nothing was kept, fetch it again",
                        )
                    incoming.commit()
        finally:
            session.close()

    @contextlib.contextmanager
    def _call(self, peer: PeerAddress, what: str) -> Iterator[_Call]:
        if self._closed:
            raise RuntimeError(f"the RDMA transport of job {self.job_id!r} is closed")
        with self.tcp._call(peer, what) as call:
            yield call

    def _session(self) -> Session:
        """A new queue pair for one transfer; a local verbs failure sends this transfer over TCP."""
        try:
            return self.device.session(own_pd=False)
        except VerbsError as e:
            raise _Fallback(f"RDMA setup failed on this node: {e}", peer_lacks_rdma=False) from e

    @staticmethod
    def _request(call: _Call, op: str, fields: dict) -> tuple[bytes, dict]:
        try:
            return call.request(op, fields)
        except ReplicationError as e:
            if e.code == "rdma_unavailable":
                raise _Fallback(f"its server has no RDMA: {e}", peer_lacks_rdma=True) from e
            if e.code == "rdma_failed":
                raise _Fallback(f"RDMA setup failed on the peer: {e}", peer_lacks_rdma=False) from e
            raise

    @staticmethod
    def _remote_qp(call: _Call, reply: dict) -> QPInfo:
        if reply["qp"] is None:
            raise ReplicationError(
                call.peer, "protocol", f"sent no queue pair for a non-empty file ({call.what})"
            )
        return QPInfo.from_wire(reply["qp"])

    @staticmethod
    def _setup(session: Session, address: int, size: int, access: str, remote: QPInfo) -> None:
        """Register this side's mapping and connect to the peer's queue pair (RTS); a failure here, before
        any byte moved, sends the transfer over TCP."""
        try:
            session.register(address, size, access)
            session.connect(remote, remote_access=NO_REMOTE, send=True)
        except VerbsError as e:
            raise _Fallback(f"RDMA setup failed on this node: {e}", peer_lacks_rdma=False) from e

    def _move(
        self,
        call: _Call,
        session: Session,
        op: str,
        local: int,
        size: int,
        reply: dict,
        source: memoryview | None,
    ) -> int:
        """Post RDMA ``op`` pieces covering ``size`` bytes (at most SEND_WINDOW in flight) between ``local``
        and the peer's ``reply["addr"]``/``reply["rkey"]`` and wait for all of them. With ``source`` (a
        write), hash each piece while the adapter reads it and return the xxh3-64 of all; else 0."""
        peer, remote, rkey = call.peer, reply["addr"], reply["rkey"]
        if source is not None and source.format != "B":
            source = source.cast("B")
        chunk = self.device.chunk_bytes
        pieces = -(-size // chunk)
        h = xxhash.xxh3_64() if source is not None else None
        posted = done = 0
        last_progress, pause = time.monotonic(), 0.0
        while done < pieces:
            while posted < pieces and posted - done < SEND_WINDOW:
                off = posted * chunk
                length = min(chunk, size - off)
                try:
                    session.post(op, posted, local + off, length, remote + off, rkey)
                except VerbsError as e:
                    raise ReplicationError(
                        peer, "rdma", f"RDMA {op} could not be posted ({call.what}): {e}"
                    ) from e
                if h is not None:
                    assert source is not None
                    h.update(source[off : off + length])
                posted += 1
            try:
                completions = session.poll(SEND_WINDOW)
            except VerbsError as e:
                raise ReplicationError(peer, "rdma", f"RDMA {op} failed ({call.what}): {e}") from e
            for c in completions:
                if not c.ok:
                    raise ReplicationError(
                        peer,
                        "rdma",
                        f"RDMA {op} failed ({call.what}): work completion {c.status_name} (vendor error "
                        f"{c.vendor_err:#x}) for piece {c.wr_id + 1} of {pieces}; nothing was kept",
                    )
            done += len(completions)
            now = time.monotonic()
            if completions:
                last_progress, pause = now, 0.0
                continue
            if self._closed:
                raise ConnectionError(f"the RDMA transport was closed ({call.what} to {format_peer(peer)})")
            if now - last_progress > self.timeout_s:
                raise TimeoutError(
                    f"peer {format_peer(peer)}: RDMA {op} made no progress for {self.timeout_s} s "
                    f"({call.what}; "
                    f"{done} of {pieces} pieces completed)"
                )
            time.sleep(pause)
            pause = min(_POLL_PAUSE_MAX_S, pause * 2 or 2e-5)
        return h.intdigest() if h is not None else 0

    @contextlib.contextmanager
    def _fallback_to_tcp(self, peer: PeerAddress) -> Iterator[_UseTcp]:
        """Run one RDMA transfer; the yielded flag turns true if it must be redone over TCP: a fallback
        (the peer has no RDMA, or setup failed before any byte moved), or an error completion with a peer
        that never completed an RDMA transfer (the RDMA fabric does not reach it, though TCP does; that
        peer then gets TCP for good)."""
        use_tcp = _UseTcp()
        try:
            yield use_tcp
        except _Fallback as f:
            self._fell_back(peer, f)
            use_tcp.value = True
            return
        except ReplicationError as e:
            with self._lock:
                worked = peer in self._rdma_worked
            if e.code != "rdma" or worked:
                raise
            self._fell_back(peer, _Fallback(f"RDMA does not reach this peer ({e})", peer_lacks_rdma=True))
            use_tcp.value = True
            return
        with self._lock:
            self._rdma_worked.add(peer)
            self._setup_failures.pop(peer, None)

    def _peer_over_tcp(self, peer: PeerAddress) -> bool:
        with self._lock:
            return peer in self._tcp_peers

    def _fell_back(self, peer: PeerAddress, f: _Fallback) -> None:
        """Log why a transfer goes over TCP: once per peer that has no RDMA, once per transport for setup
        failures (then at DEBUG)."""
        with self._lock:
            if not f.peer_lacks_rdma:  # a setup failure; repeated ones make the peer TCP-only
                failures = self._setup_failures[peer] = self._setup_failures.get(peer, 0) + 1
                if failures >= SETUP_FAILURES_FOR_TCP and peer not in self._rdma_worked:
                    f = _Fallback(
                        f"RDMA setup failed {failures} times, last: {f.reason}", peer_lacks_rdma=True
                    )
            if f.peer_lacks_rdma:
                first = peer not in self._tcp_peers
                self._tcp_peers[peer] = f.reason
            else:
                first = not self._local_failure_logged
                self._local_failure_logged = True
        if f.peer_lacks_rdma and first:
            log.info("replication with peer %s goes over TCP (%s)", format_peer(peer), f.reason)
        elif first:
            log.warning(
                "an RDMA transfer with peer %s goes over TCP instead: %s", format_peer(peer), f.reason
            )
        else:
            log.debug("an RDMA transfer with peer %s goes over TCP instead: %s", format_peer(peer), f.reason)
