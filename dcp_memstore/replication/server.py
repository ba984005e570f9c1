"""The peer server: receives other nodes' checkpoint files (replicas) and serves this node's files to peers.

One server per rank, bound to the address the user configures, on a port from the OS. It serves only
authenticated peers of its own job (``auth``), speaks only the wire format (``wire``: msgpack headers, raw
payloads; nothing unpickled), and only touches paths under its own root and job:

    <root>/<job>/checkpoints/<checkpoint>/<file>                 this node's files (served by ``get``)
    <root>/<job>/replicas/<source-node>/<checkpoint>/<file>       replicas it keeps for other nodes

Starting, it removes the temporary files of transfers whose receiving process died (``remove_stale_parts``)
under ``replicas/`` and ``fetched/`` (files a reader fetched from a peer). A node's own files are served
only once their checkpoint is committed there, and held from eviction meanwhile (``_served_file``).
``stat`` also says this node's upload state of a committed checkpoint towards the target the peer names
(its records on tmpfs, ``persist.progress``) and, from the store's ``replication_state`` callback, the
replication state of the node's own files of it, and how many data files its manifest lists: a node
that lacks the checkpoint tells from them whether it is being persisted and replicated.
The ``commit`` op (the coordinator preparing, committing or aborting a checkpoint on this node; a prepare
carries the manifest, whose SHA-256 the signed header names) is handed to the store's ``on_commit``
callback; a server without one refuses it. Likewise ``replicated`` (a node's files of a checkpoint are
all replicated, see ``safe_point``) goes to ``on_replicated``.

where every component a peer names is checked with ``validate_name`` (no separators, no '..', no hidden
names). A received file is size-capped, checked against the free memory, allocated in full before its
bytes arrive (so a full tmpfs is an error reply, never a SIGBUS), filled straight from the socket into its
mapping, and renamed into place only after its checksum matched.

With an RDMA endpoint (``rdma``, see ``rdma``), ``rdma_put`` and ``rdma_get`` move the same files by RDMA
after the same checks (the request authenticated, names, size and space accepted) and before anything is
registered; the exposed mapping is deregistered before a received file is hashed and renamed. Without one,
both are refused with code ``rdma_unavailable`` (the peer then uses ``put``/``get``).

A thread per connection (daemon, at most ``max_connections`` at once). It opens with the hellos
(``wire``: the server's carries the connection's fresh challenge, which binds every request on it, see
``auth``). A new connection must deliver its hello and its first request, authenticated, within
``auth_timeout_s`` of connecting (whole frames, however slowly they trickle in), else it is closed; from
then on a peer may stay silent for ``io_timeout_s``. Connections that have not authenticated yet never
keep out one that may: when every slot is taken, the oldest of them is closed to make room for the
newcomer, and one source address holds at most ``MAX_UNAUTHENTICATED_PER_SOURCE`` of them (its oldest is
closed for its newest), so idle or trickling sockets from whoever can reach the port cannot stop
replication, and one host flooding it only pushes out its own. A newcomer is refused as busy only when
every slot holds an authenticated connection. Any error reply closes the connection; a refused request
has touched nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from dcp_memstore.errors import InsufficientSpaceError
from dcp_memstore.persist.progress import Progress
from dcp_memstore.replication import wire
from dcp_memstore.replication.auth import (
    DEFAULT_WINDOW_S,
    AuthError,
    RequestVerifier,
    destination,
    new_challenge,
    sign_reply,
)
from dcp_memstore.replication.rdma_verbs import VerbsError, buffer_address
from dcp_memstore.replication.replicator import manifest_files
from dcp_memstore.replication.transport import (
    IncomingFile,
    OutgoingFile,
    list_files,
    remove_stale_parts,
)
from dcp_memstore.store import catalog
from dcp_memstore.store.checksum import checksum_bytes
from dcp_memstore.store.ids import validate_file_name, validate_name
from dcp_memstore.store.layout import COMMITTED, StoreLayout
from dcp_memstore.store.space import FULL_ERRNOS

if TYPE_CHECKING:
    from dcp_memstore.replication.rdma import RdmaEndpoint

log = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 1 << 40
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_IO_TIMEOUT_S = 60.0
DEFAULT_AUTH_TIMEOUT_S = 5.0
MAX_UNAUTHENTICATED_PER_SOURCE = 16
_EVICTION_WAIT_S = 1.0  # for a closed unauthenticated connection's thread to free its slot
MAX_MANIFEST_BYTES = 1 << 30
COMMIT_PHASES = ("prepare", "commit", "abort")
# on_commit(checkpoint, phase, {"seq", "committed_at", "nbytes"}, manifest bytes) -> this node's next seq
CommitHandler = Callable[[str, str, dict, bytes], int]
# on_replicated(checkpoint, node, committed_at): node's files of that save are replicated
ReplicatedHandler = Callable[[str, str, float], None]
# replication_state(checkpoint): per replica node, the state of this node's files of it (None: not held
# here, or this node does not replicate)
ReplicationState = Callable[[str], dict[str, str] | None]
# The slowest RDMA rate a server waits for: after an rdma_put/rdma_get go-ahead the TCP connection is idle
# while the peer moves the bytes, so the trailer may take io_timeout_s + size / this. A peer that dies
# closes its connection, which ends the wait at once.
RDMA_MIN_BYTES_PER_S = 100e6
_DRAIN_BYTES = 1 << 20  # read at most this much of a refused request's leftovers, so the reply is not lost
_DRAIN_S = 1.0


class _Refusal(Exception):
    """A request this server refuses: an error reply with ``code``, then the connection is closed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _name(value: str, what: str) -> str:
    """``value`` if it is a valid store name (a node, a checkpoint), else a refusal saying why."""
    try:
        return validate_name(value, what)
    except ValueError as e:
        raise _Refusal("bad_request", str(e)) from None


def _file_name(value: str) -> str:
    """``value`` if it is a valid name of a file in a checkpoint directory, else a refusal saying why."""
    try:
        return validate_file_name(value)
    except ValueError as e:
        raise _Refusal("bad_request", str(e)) from None


class PeerServer:
    """Serves one job's checkpoint files to its peers and keeps their replicas (see the module docstring).

    ``root`` is the store root (or its ``StoreLayout``); ``secret`` the job's replication secret
    (``auth.shared_secret``). ``rdma``: an ``rdma.RdmaEndpoint`` to serve ``rdma_put``/``rdma_get`` with
    (the server owns it from then on and closes it in ``close()``), or None (those ops are refused with
    code ``rdma_unavailable``). ``auth_timeout_s``: how long a new connection has to deliver its hello
    and its first authenticated request (``io_timeout_s`` if that is shorter). The server runs from
    construction until ``close()``."""

    def __init__(
        self,
        root: Path | str | StoreLayout,
        job_id: str,
        secret: bytes,
        bind_host: str,
        port: int = 0,
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
        auth_timeout_s: float = DEFAULT_AUTH_TIMEOUT_S,
        window_s: float = DEFAULT_WINDOW_S,
        on_commit: CommitHandler | None = None,
        on_replicated: ReplicatedHandler | None = None,
        replication_state: ReplicationState | None = None,
        rdma: RdmaEndpoint | None = None,
    ) -> None:
        job_id = validate_name(job_id, "job id")
        if isinstance(root, StoreLayout):
            if root.job_id != job_id:
                raise ValueError(f"the layout is for job {root.job_id!r}, the server for job {job_id!r}")
            self.layout = root
        else:
            self.layout = StoreLayout(Path(root), job_id)
        self.job_id = job_id
        self.verifier = RequestVerifier(secret, job_id, window_s)
        self.max_file_bytes = max_file_bytes
        self.io_timeout_s = io_timeout_s
        self.auth_timeout_s = min(auth_timeout_s, io_timeout_s)
        self.on_commit, self.on_replicated = on_commit, on_replicated
        self.replication_state = replication_state
        self.rdma = rdma
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified when a connection ends
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._unauthenticated: dict[socket.socket, str] = {}  # of _conns: source host, oldest first
        self._closing = False
        # received files of processes killed mid-transfer: replicas, and files a reader fetched from a peer
        removed = sum(
            remove_stale_parts(self.layout, d) for d in (self.layout.replicas_dir, self.layout.fetches_dir)
        )
        if removed:
            log.info("removed %d partial files left by crashed transfers", removed)
        self._listener = _listen(bind_host, port)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="dcp_memstore-peer-accept", daemon=True
        )
        self._accept_thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, end every connection (transfers in flight are dropped and leave no file), and
        join the server's threads (up to ``timeout`` seconds)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            conns = list(self._conns.items())
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv/send
        deadline = time.monotonic() + timeout
        self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        for _, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.rdma is not None:
            self.rdma.close()  # the device closes once transfers still ending have released it too

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- connections -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                log.exception("peer server of job %s: accept failed", self.job_id)
                time.sleep(0.1)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.auth_timeout_s)
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name="dcp_memstore-peer-conn", daemon=True
            )
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                admitted = self._make_room(peer[0])
                if admitted:
                    self._conns[conn] = thread
                    self._unauthenticated[conn] = peer[0]
            if not admitted:
                log.warning("peer server of job %s: refusing %s, too many connections", self.job_id, peer)
                _refuse(conn, "busy", "the server has too many connections; retry later", drain=False)
                conn.close()
                continue
            try:
                thread.start()
            except RuntimeError as e:  # the process is out of threads: refuse this one, keep serving
                self._forget(conn)
                _refuse(conn, "busy", f"the server cannot start a thread ({e}); retry later", drain=False)
                conn.close()

    def _make_room(self, source: str) -> bool:
        """Whether a new connection from ``source`` may have a slot, closing connections that have not
        authenticated to make room (see the module docstring). Called with the lock held."""
        own = [conn for conn, host in self._unauthenticated.items() if host == source]
        full = len(self._conns) >= self.max_connections
        if len(own) >= MAX_UNAUTHENTICATED_PER_SOURCE:
            victim = own[0]
        elif full and self._unauthenticated:
            victim = next(iter(self._unauthenticated))
        else:
            return not full
        log.info(
            "peer server of job %s: closing a connection from %s that has not authenticated, to admit one "
            "from %s", self.job_id, self._unauthenticated[victim], source,
        )  # fmt: skip
        del self._unauthenticated[victim]
        with contextlib.suppress(OSError):
            victim.shutdown(socket.SHUT_RDWR)  # its thread wakes, closes it and frees its slot
        return self._freed.wait_for(lambda: len(self._conns) < self.max_connections, _EVICTION_WAIT_S)

    def _forget(self, conn: socket.socket) -> None:
        """Free ``conn``'s slot (before it is closed, so no other thread shuts a reused descriptor down)."""
        with self._lock:
            self._conns.pop(conn, None)
            self._unauthenticated.pop(conn, None)
            self._freed.notify_all()

    def _authenticated(self, conn: socket.socket) -> bool:
        """Mark ``conn`` as authenticated; False if it was closed to make room meanwhile."""
        with self._lock:
            return self._unauthenticated.pop(conn, None) is not None

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        nonce: bytes | None = None
        deadline: float | None = time.monotonic() + self.auth_timeout_s  # None once authenticated
        try:
            to = destination(conn.getsockname())  # this server's name in requests that came this way
            challenge = new_challenge()  # this connection's: a request from any other is refused
            wire.send_header(conn, wire.server_hello(challenge))
            if self._receive(conn, peer, deadline, wire.validate_client_hello) is None:
                return

            def authentic(header: dict) -> None:
                wire.validate_request(header)
                self.verifier.verify(header, to, challenge)

            while not self._closing:
                nonce = None
                header = self._receive(conn, peer, deadline, authentic)
                if header is None:
                    return
                if deadline is not None:
                    if not self._authenticated(conn):
                        return
                    deadline = None
                    conn.settimeout(self.io_timeout_s)
                nonce = header["nonce"]
                op = header["op"]
                handler = {
                    "ping": self._op_ping,
                    "stat": self._op_stat,
                    "put": self._op_put,
                    "get": self._op_get,
                    "commit": self._op_commit,
                    "replicated": self._op_replicated,
                    "rdma_put": self._op_rdma_put,
                    "rdma_get": self._op_rdma_get,
                }
                try:
                    handler[op](conn, header, nonce)
                except _Refusal as e:
                    log.info(
                        "peer server of job %s: %s request from %s refused: %s", self.job_id, op, peer, e
                    )
                    _refuse(conn, e.code, str(e), self.verifier.secret, nonce)
                    return
                except wire.ProtocolError as e:
                    _refuse(conn, "bad_request", str(e), self.verifier.secret, nonce)
                    return
        except OSError as e:  # the peer went away, timed out, or close() ended it
            if not self._closing:
                log.info("peer server of job %s: connection from %s ended: %s", self.job_id, peer, e)
        except Exception as e:
            log.exception("peer server of job %s: error serving %s", self.job_id, peer)
            _refuse(conn, "internal", f"internal error: {type(e).__name__}: {e}", self.verifier.secret, nonce)
        finally:
            self._forget(conn)
            conn.close()

    def _receive(
        self, conn: socket.socket, peer: tuple, deadline: float | None, check: Callable[[dict], object]
    ) -> dict | None:
        """The next frame on ``conn``, once ``check`` (which raises ProtocolError or AuthError) accepted it;
        None when the connection is to end: the peer closed it, or the frame was refused (an unsigned error
        reply was sent), or it did not arrive by ``deadline`` (the time to authenticate; None: none)."""
        try:
            header = wire.recv_header(conn, eof_ok=True, deadline=deadline)
            if header is not None:
                check(header)
            return header
        except (wire.ProtocolError, AuthError) as e:
            code = "auth" if isinstance(e, AuthError) else "bad_request"
            log.warning("peer server of job %s: refused a request from %s: %s", self.job_id, peer, e)
            _refuse(conn, code, str(e))
            return None
        except TimeoutError:
            if deadline is None:
                raise
            log.warning(
                "peer server of job %s: closing the connection from %s: no authenticated request "
                "within %s s of connecting", self.job_id, peer, self.auth_timeout_s,
            )  # fmt: skip
            return None

    def _reply(self, conn: socket.socket, nonce: bytes, fields: dict, index: int = 0) -> None:
        """Send the ``index``-th (signed) success reply to the request with ``nonce``."""
        try:
            frame = wire.pack_frame(sign_reply({"ok": True, **fields}, self.verifier.secret, nonce, index))
        except wire.ProtocolError as e:
            raise _Refusal("too_large", f"the reply does not fit in one header: {e}") from e
        conn.sendall(frame)

    # --- ops ---------------------------------------------------------------------------------------

    def _op_ping(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        self._reply(conn, nonce, {})

    def _op_stat(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        checkpoint = _name(header["checkpoint"], "checkpoint id")
        own_dir = self.layout.checkpoint_dir(checkpoint)
        # read before the listing: eviction renames the directory away at once, so if the checkpoint is
        # still committed after, these records were its own (a publication does not look unrequested)
        upload = None
        if header["persist_to"] is not None:
            state, error = Progress(self.layout, checkpoint, header["persist_to"]).upload_state()
            upload = {"state": state, "error": error}
        replication, listed = self._replication_of(checkpoint)
        replicas = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for e in os.scandir(self.layout.replicas_dir):
                with contextlib.suppress(ValueError):
                    validate_name(e.name, "source node")
                    files = list_files(Path(e.path) / checkpoint)
                    if files:
                        replicas[e.name] = files
        own = list_files(own_dir)
        committed = COMMITTED in own
        if committed and replication is None:  # maybe committed since the read above: read it again
            replication, listed = self._replication_of(checkpoint)
        fields = {
            "own": own,
            "committed": committed,
            "replicas": replicas,
            "upload": upload if committed else None,
            "replication": replication if committed else None,
            "listed": listed if committed else 0,
        }
        self._reply(conn, nonce, fields)

    def _replication_of(self, checkpoint: str) -> tuple[dict[str, str] | None, int]:
        """For ``stat``: the replication state of this node's files of ``checkpoint`` (``replication_state``)
        and how many data files its manifest lists; (None, 0) where its commit marker is corrupt (its
        files are served as they are, but it says nothing of the save)."""
        try:
            replication = None if self.replication_state is None else self.replication_state(checkpoint)
            return replication, len(manifest_files(self.layout, checkpoint))
        except ValueError:
            return None, 0

    def _incoming_replica(self, header: dict) -> tuple[IncomingFile, str]:
        """The checks of a ``put`` (names, size limit, space) and, if they pass, the preallocated temporary
        file for it, with a description for messages; a refusal otherwise, which creates no file (the
        checkpoint's replica directory may stay, empty: another put may be about to fill it, and retention
        drops it with the stale copies)."""
        source = _name(header["source"], "source node")
        checkpoint = _name(header["checkpoint"], "checkpoint id")
        file = _file_name(header["file"])
        size = header["size"]
        if size > self.max_file_bytes:
            raise _Refusal(
                "too_large",
                f"file {file} of {size} bytes exceeds this server's limit of {self.max_file_bytes} bytes "
                f"(PeerServer max_file_bytes)",
            )
        dest = self.layout.replica_dir(source, checkpoint)
        try:
            dest.mkdir(parents=True, exist_ok=True)
            incoming = IncomingFile(dest / file, size, self.layout)
        except InsufficientSpaceError as e:
            raise _Refusal("no_space", str(e)) from None
        except OSError as e:
            raise _Refusal("io_error", f"cannot create {dest / file}: {e}") from None
        return incoming, f"file {file} of checkpoint {checkpoint} from node {source}"

    def _stored(self, what: str, size: int, start: float) -> None:
        seconds = time.perf_counter() - start
        log.debug(
            "peer server of job %s: stored %s (%d bytes, %.3f s, %.2f GB/s)",
            self.job_id, what, size, seconds, size / max(seconds, 1e-9) / 1e9,
        )  # fmt: skip

    @staticmethod
    def _check_arrived(what: str, actual: int, expected: int) -> None:
        if actual != expected:
            raise _Refusal(
                "checksum",
                f"{what} arrived corrupt (xxh3_64 {actual:#018x}, sender computed {expected:#018x}); "
                f"nothing was kept, send it again",
            )

    @staticmethod
    def _keep(incoming: IncomingFile, what: str) -> None:
        """Rename a received file into place; a failure (its replica directory removed meanwhile, when this
        node dropped the checkpoint) is an ``io_error`` reply, not a connection that just ends."""
        try:
            incoming.commit()
        except OSError as e:
            raise _Refusal("io_error", f"cannot keep {what} on this node: {e}") from None

    def _op_put(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        incoming, what = self._incoming_replica(header)
        start = time.perf_counter()
        with incoming:
            self._reply(conn, nonce, {})  # go ahead: the file has room
            actual = wire.recv_payload(conn, incoming.view)
            self._check_arrived(what, actual, wire.recv_trailer(conn))
            self._keep(incoming, what)
        self._reply(conn, nonce, {}, index=1)
        self._stored(what, header["size"], start)

    @contextlib.contextmanager
    def _served_file(self, header: dict, offset: int, length: int | None) -> Iterator[OutgoingFile]:
        """The checks of a ``get`` (names; this node's own files only once committed; replicas; no
        symlinks; the range inside the file) and, if they pass, the open range; a refusal otherwise.

        This node's own committed files are held from eviction while they are served
        (``catalog.process_hold``): eviction hands a checkpoint's files to the pool, where the next save
        writes into them, and the peer would get a mix of two saves whose checksum matches what was sent.
        (Replicas need no hold: dropping one unlinks it, and a new one replaces it by rename, so the open
        file keeps its bytes.)"""
        checkpoint = _name(header["checkpoint"], "checkpoint id")
        file = _file_name(header["file"])
        source = header["source"]
        held: str | None = None
        if source is None:
            path, what = self.layout.checkpoint_dir(checkpoint) / file, "this node's copy"
            held = self._hold_own(checkpoint)
        else:
            source = _name(source, "source node")
            path, what = self.layout.replica_dir(source, checkpoint) / file, f"the replica of node {source}"
        try:
            try:
                served = OutgoingFile(path, offset, length)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                raise _Refusal("not_found", f"no file {file} of checkpoint {checkpoint} in {what}") from None
            except ValueError as e:
                raise _Refusal(
                    "bad_request", f"file {file} of checkpoint {checkpoint} in {what}: {e}"
                ) from None
            except OSError as e:
                raise _Refusal(
                    "io_error", f"cannot open file {file} of checkpoint {checkpoint} in {what}: {e}"
                ) from None
            with served:
                yield served
        finally:
            if held:
                catalog.release(self.layout, checkpoint, held)

    def _hold_own(self, checkpoint: str) -> str:
        """Hold this node's committed ``checkpoint`` while a peer gets a file of it; return the hold's
        name ("" if the tmpfs had no room for its record: served unheld, with a warning, as a load is;
        "" for a checkpoint whose commit marker is damaged, which retention never evicts). A refusal if
        it is not committed here."""
        try:
            held = catalog.process_hold(self.layout, checkpoint, "serve")
        except ValueError:  # a damaged commit marker (catalog.read_commit)
            return ""
        except OSError as e:
            if e.errno not in FULL_ERRNOS:
                raise _Refusal("io_error", f"cannot hold checkpoint {checkpoint} on this node: {e}") from None
            log.warning(
                "peer server of job %s: no room for the record that holds checkpoint %s while a peer "
                "gets its files (%s); serving it unheld: evicted meanwhile, the peer may get a mix of two "
                "saves, which only the per-item checksums of a load catch",
                self.job_id, checkpoint, e,
            )  # fmt: skip
            return ""
        if held is None:
            raise _Refusal("not_found", f"checkpoint {checkpoint} is not committed on this node")
        return held

    def _op_get(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        with self._served_file(header, header["offset"], header["length"]) as source_file:
            self._reply(conn, nonce, {"size": source_file.length})
            wire.send_trailer(conn, wire.send_payload(conn, source_file.view))

    # --- RDMA ops (payload by RDMA, headers and trailers here) -------------------------------------------

    def _endpoint(self, op: str) -> RdmaEndpoint:
        if self.rdma is None:
            raise _Refusal(
                "rdma_unavailable", f"this server has no RDMA endpoint for {op}; use the TCP ops (put, get)"
            )
        return self.rdma

    @staticmethod
    @contextlib.contextmanager
    def _exposed(
        rdma: RdmaEndpoint, address: int, size: int, writable: bool, peer: dict | None
    ) -> Iterator[dict]:
        """The reply fields through which ``peer``'s queue pair reaches the ``size`` bytes at ``address``
        (writable for an ``rdma_put``, readable for an ``rdma_get``; nothing to reach in an empty file).
        The region is withdrawn on exit: no RDMA operation reaches the file from there on."""
        if not size:
            yield {"addr": 0, "rkey": 0, "qp": None}
            return
        try:
            exposure = rdma.expose(address, size, writable=writable, peer=peer)
        except VerbsError as e:
            raise _Refusal("rdma_failed", f"RDMA setup failed on this node: {e}") from None
        try:
            yield exposure.fields
        finally:
            exposure.close()

    def _await_trailer(self, conn: socket.socket, size: int) -> int:
        """The trailer that ends an RDMA transfer of ``size`` bytes; the connection is idle until then, so
        the wait is io_timeout_s plus the time ``size`` bytes take at RDMA_MIN_BYTES_PER_S."""
        conn.settimeout(self.io_timeout_s + size / RDMA_MIN_BYTES_PER_S)
        try:
            return wire.recv_trailer(conn)
        finally:
            conn.settimeout(self.io_timeout_s)

    def _op_rdma_put(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        rdma = self._endpoint("rdma_put")
        size, peer_qp = header["size"], header["qp"]
        if size and peer_qp is None:
            raise _Refusal(
                "bad_request", "an rdma_put of a non-empty file needs the sender's queue pair (qp)"
            )
        incoming, what = self._incoming_replica(header)
        start = time.perf_counter()
        with incoming:
            address = buffer_address(incoming.view) if size else 0
            with self._exposed(rdma, address, size, True, peer_qp) as fields:
                self._reply(conn, nonce, fields)  # go ahead: write the bytes, then send the trailer
                expected = self._await_trailer(conn, size)
            self._check_arrived(what, checksum_bytes(incoming.view), expected)
            self._keep(incoming, what)
        self._reply(conn, nonce, {}, index=1)
        self._stored(f"{what} by RDMA", size, start)

    def _op_rdma_get(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        rdma = self._endpoint("rdma_get")
        with self._served_file(header, 0, None) as source_file:
            size = source_file.length
            checksum = checksum_bytes(source_file.view)
            address = source_file.address if size else 0
            with self._exposed(rdma, address, size, False, header["qp"]) as fields:
                self._reply(conn, nonce, {"size": size, "checksum": checksum, **fields})
                reported = self._await_trailer(conn, size)  # the reader is done with the file
        if reported != checksum:
            log.info(
                "peer server of job %s: a peer read %s of checkpoint %s by RDMA and got other bytes "
                "(it keeps nothing)", self.job_id, header["file"], header["checkpoint"],
            )  # fmt: skip

    def _op_commit(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        checkpoint = _name(header["checkpoint"], "checkpoint id")
        phase, size = header["phase"], header["size"]
        if self.on_commit is None:
            raise _Refusal("bad_request", "this server does not take commits (it serves no store)")
        if phase not in COMMIT_PHASES:
            raise _Refusal("bad_request", f"unknown commit phase {phase!r}; expected one of {COMMIT_PHASES}")
        if size > min(self.max_file_bytes, MAX_MANIFEST_BYTES) or (size and phase != "prepare"):
            raise _Refusal("too_large", f"a {phase} request with {size} bytes of payload is not accepted")
        manifest = bytearray(size)
        if size:
            self._reply(conn, nonce, {"next_seq": 0})  # go ahead: send the manifest
            actual = wire.recv_payload(conn, memoryview(manifest))
            if actual != wire.recv_trailer(conn) or hashlib.sha256(manifest).digest() != header["digest"]:
                raise _Refusal(
                    "checksum", f"the manifest of checkpoint {checkpoint} arrived corrupt or altered"
                )
        record = {k: header[k] for k in ("seq", "committed_at", "nbytes")}
        try:
            next_seq = self.on_commit(checkpoint, phase, record, bytes(manifest))
        except (OSError, ValueError) as e:
            raise _Refusal("io_error", f"cannot {phase} checkpoint {checkpoint} on this node: {e}") from None
        self._reply(conn, nonce, {"next_seq": next_seq}, index=1 if size else 0)

    def _op_replicated(self, conn: socket.socket, header: dict, nonce: bytes) -> None:
        checkpoint = _name(header["checkpoint"], "checkpoint id")
        node = _name(header["node"], "node")
        if self.on_replicated is None:
            raise _Refusal("bad_request", "this server takes no replication reports (it serves no store)")
        try:
            self.on_replicated(checkpoint, node, header["committed_at"])
        except OSError as e:
            why = f"cannot record {node}'s report on checkpoint {checkpoint}: {e}"
            raise _Refusal("io_error", why) from None
        self._reply(conn, nonce, {})


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (a name or address, IPv4 or IPv6) and ``port`` (0: any)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve the replication bind address {host!r}: {e}") from e
    family, _, _, _, sockaddr = infos[0]
    try:
        return socket.create_server(sockaddr, family=family, backlog=128)
    except OSError as e:
        raise OSError(
            e.errno, f"cannot listen for replication peers on {host!r} port {port}: {e.strerror or e}"
        ) from e


def _refuse(
    conn: socket.socket,
    code: str,
    message: str,
    secret: bytes | None = None,
    nonce: bytes | None = None,
    drain: bool = True,
) -> None:
    """Send an error reply (signed if the request was authenticated) and make sure closing the connection
    then (the caller's part) does not lose it: stop sending, read what the peer had already sent (bounded,
    so closing with unread data does not reset the connection before the peer reads the reply).
    ``drain=False`` (the accept thread, which must not wait) only sends."""
    reply = {"ok": False, "code": code, "error": message}
    if secret is not None and nonce is not None:
        reply = sign_reply(reply, secret, nonce)
    try:
        with contextlib.suppress(wire.ProtocolError):
            conn.sendall(wire.pack_frame(reply))
        if not drain:
            return
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(_DRAIN_S)
        deadline, drained = time.monotonic() + _DRAIN_S, 0
        while drained < _DRAIN_BYTES and time.monotonic() < deadline:
            chunk = conn.recv(64 << 10)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
