"""The TCP transport: moves checkpoint files to and from peers' ``PeerServer``s with the wire format.

One connection per call, so a failed call leaves nothing behind to go stale and calls from several threads
run side by side on their own connections. Sent bytes are streamed from the file's mapping (the one the
writer already has, through the process's mapping cache) and received bytes land straight in the
destination file's mapping. A connection opens with the hellos (``wire``): the server's carries the
connection's challenge. Every request is signed, naming the server at the address its connection reached
and that challenge, and every reply's signature checked (``auth``). Nothing is retried here: the caller
decides.

Errors name the peer and what was being done: ConnectionError (unreachable, connection lost), TimeoutError
(the peer stayed silent for ``timeout_s``), ReplicationError (the peer refused, or answered nonsense).
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from dcp_memstore.replication import wire
from dcp_memstore.replication.auth import (
    AuthError,
    check_secret,
    destination,
    sign_request,
    verify_reply,
)
from dcp_memstore.replication.transport import (
    IncomingFile,
    OutgoingFile,
    PeerAddress,
    ReplicationError,
    Transport,
    checked_names,
    format_peer,
)
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import StoreLayout

DEFAULT_TIMEOUT_S = 60.0


class _Call:
    """One request's connection. ``run`` performs a socket operation and turns its failures into errors
    that name the peer and what was being done."""

    def __init__(
        self, transport: TcpTransport, peer: PeerAddress, what: str, deadline: float | None = None
    ) -> None:
        self.transport, self.peer, self.what = transport, (peer[0], int(peer[1])), what
        self.deadline = deadline  # time.monotonic() by which the whole call must end (a wait's); None: none
        self.sock: socket.socket | None = None
        self.to = ""  # the server's name in requests: its address as this connection reached it
        self.challenge = b""  # the server's challenge on this connection, which every request carries

    def _timeout(self) -> float:
        """Seconds the next socket operation may take: the transport's timeout, or the time left until the
        call's deadline if that is less (TimeoutError once it is past)."""
        if self.deadline is None:
            return self.transport.timeout_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(self._silent())
        return min(self.transport.timeout_s, left)

    def _silent(self, doing: str = "was silent") -> str:
        """What to say of a peer whose socket operation timed out: cut by the call's deadline, or silent
        for the transport's timeout."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"peer {format_peer(self.peer)} {doing} until the deadline of the wait ({self.what})"
        return f"peer {format_peer(self.peer)} {doing} for {self.transport.timeout_s} s ({self.what})"

    def connect(self) -> None:
        """Connect and exchange hellos: the server's says this connection's challenge."""
        try:
            self.sock = socket.create_connection(self.peer, timeout=self._timeout())
            self.to = destination(self.sock.getpeername())
        except TimeoutError as e:
            raise TimeoutError(self._silent("did not accept a connection")) from e
        except OSError as e:
            raise ConnectionError(
                f"cannot connect to peer {format_peer(self.peer)} ({self.what}): {e}. Is its replication "
                f"server running and reachable from this node?"
            ) from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.run(wire.send_header, wire.CLIENT_HELLO)
        hello = self.recv()
        try:
            if hello.get("ok") is False:  # refused in place of a hello (busy)
                self._refused(wire.validate_reply(hello, "hello"))
            self.challenge = wire.validate_server_hello(hello)
        except wire.ProtocolError as e:
            raise ReplicationError(self.peer, "protocol", f"sent a malformed hello ({self.what}): {e}") from e

    def recv(self) -> dict:
        """The peer's next header, all of it within the transport's timeout and by the call's deadline if
        it has one: a peer that trickles its bytes (anything that answers at a peer's address, before any
        authentication) does not stretch the call."""
        by = None if self.transport.timeout_s is None else time.monotonic() + self.transport.timeout_s
        if self.deadline is not None:
            by = self.deadline if by is None else min(self.deadline, by)
        try:
            return self.run(wire.recv_header, False, by)
        finally:  # recv_header leaves the socket the time that was left: what follows gets the whole timeout
            if self.deadline is None and self.sock is not None:
                with contextlib.suppress(OSError):  # closed meanwhile (close())
                    self.sock.settimeout(self.transport.timeout_s)

    def run(self, fn, *args):
        try:
            if self.deadline is not None:
                self.sock.settimeout(self._timeout())
            return fn(self.sock, *args)
        except TimeoutError as e:
            raise TimeoutError(self._silent()) from e
        except OSError as e:
            raise ConnectionError(
                f"lost the connection to peer {format_peer(self.peer)} ({self.what}): {e}"
            ) from e
        except wire.ProtocolError as e:
            raise ReplicationError(
                self.peer, "protocol", f"sent a malformed message ({self.what}): {e}"
            ) from e

    def request(self, op: str, fields: dict) -> tuple[bytes, dict]:
        """Send a signed ``op`` request; return its nonce and the peer's (verified) reply."""
        t = self.transport
        header = sign_request({"op": op, **fields}, t.secret, t.job_id, self.to, self.challenge)
        self.run(wire.send_header, header)
        return header["nonce"], self.reply(op, header["nonce"])

    def reply(self, op: str, nonce: bytes, index: int = 0) -> dict:
        """Receive and check the ``index``-th reply to the ``op`` request with ``nonce`` (``op`` names the
        reply's fields); raise ReplicationError if it is a refusal or is not signed by a peer of this
        job as that reply."""
        header = self.recv()
        try:
            reply = wire.validate_reply(header, op)
        except wire.ProtocolError as e:
            raise ReplicationError(self.peer, "protocol", f"sent a malformed reply ({self.what}): {e}") from e
        if not reply["ok"]:
            self._refused(reply)
        try:
            verify_reply(reply, self.transport.secret, nonce, index)
        except AuthError as e:
            raise ReplicationError(
                self.peer, "auth", f"its reply failed authentication ({self.what}): {e}"
            ) from e
        return reply

    def _refused(self, reply: dict) -> None:
        """Raise the ReplicationError that the error reply ``reply`` (validated) stands for."""
        hint = (
            f" Do both nodes run job {self.transport.job_id!r} with the same replication secret?"
            if reply["code"] == "auth"
            else ""
        )
        raise ReplicationError(self.peer, reply["code"], f"refused {self.what}: {reply['error']}.{hint}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


class TcpTransport(Transport):
    """Transport over TCP to peers' ``PeerServer``s of job ``job_id`` holding ``secret``.

    ``timeout_s`` bounds connecting and each header from the peer, and twice it each CHUNK of a payload
    (not a whole transfer), however slowly their bytes trickle in."""

    def __init__(self, job_id: str, secret: bytes, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.job_id = validate_name(job_id, "job id")
        self.secret = check_secret(secret)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._calls: set[_Call] = set()
        self._closed = False

    @contextlib.contextmanager
    def _call(self, peer: PeerAddress, what: str, deadline: float | None = None) -> Iterator[_Call]:
        """A connected ``_Call`` to ``peer`` (``deadline``: ``time.monotonic()`` by which it must end)."""
        call = _Call(self, peer, what, deadline)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the TCP transport of job {self.job_id!r} is closed")
            self._calls.add(call)
        try:
            call.connect()
            if self._closed:  # close() ran while connecting
                raise RuntimeError(f"the TCP transport of job {self.job_id!r} is closed")
            yield call
        finally:
            with self._lock:
                self._calls.discard(call)
            call.close()

    def ping(self, peer_addr: PeerAddress) -> float:
        """Check that the peer's server answers and belongs to this job; return the round trip in seconds."""
        start = time.perf_counter()
        with self._call(peer_addr, "ping") as call:
            call.request("ping", {})
        return time.perf_counter() - start

    def put_file(
        self, peer_addr: PeerAddress, source_node: str, checkpoint: str, file: str, path: Path
    ) -> None:
        checkpoint, file, source_node = checked_names(checkpoint, file, source_node)
        what = f"sending file {file} of checkpoint {checkpoint} of node {source_node}"
        with OutgoingFile(Path(path)) as source, self._call(peer_addr, what) as call:
            fields = {"source": source_node, "checkpoint": checkpoint, "file": file, "size": source.length}
            nonce, _ = call.request("put", fields)
            call.run(wire.send_trailer, call.run(wire.send_payload, source.view))
            call.reply("put", nonce, index=1)

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
        with self._get(peer_addr, checkpoint, file, source_node, 0, None) as (call, size):
            # refused here (no space): nothing is received
            incoming = IncomingFile(Path(dest_path), size, layout)
            with incoming:
                self._receive(call, incoming.view)
                incoming.commit()

    def read_range(
        self,
        peer_addr: PeerAddress,
        checkpoint: str,
        file: str,
        offset: int,
        out: memoryview,
        source_node: str | None = None,
    ) -> None:
        """Fetch ``len(out)`` bytes of file ``file`` of checkpoint ``checkpoint`` from ``offset`` straight
        into the writable buffer ``out`` (e.g. a tensor's memory), checksum verified."""
        out = memoryview(out).cast("B")
        with self._get(peer_addr, checkpoint, file, source_node, offset, len(out)) as (call, size):
            if size != len(out):
                raise ReplicationError(
                    call.peer, "protocol", f"announced {size} bytes for a {len(out)}-byte range"
                )
            self._receive(call, out)

    def commit(
        self, peer_addr: PeerAddress, checkpoint: str, phase: str, record: dict, manifest: bytes = b""
    ) -> int:
        """One phase of committing checkpoint ``checkpoint`` on the peer's node: ``prepare`` (sends the
        manifest; nothing becomes visible), ``commit`` (with the final ``record``: ``seq``,
        ``committed_at``, ``nbytes``) or ``abort``. Returns the sequence number the peer's node would give
        its next checkpoint."""
        checkpoint = validate_name(checkpoint, "checkpoint id")
        with self._call(peer_addr, f"{phase} of checkpoint {checkpoint}") as call:
            fields = {
                "checkpoint": checkpoint,
                "phase": phase,
                "seq": int(record["seq"]),
                "committed_at": float(record["committed_at"]),
                "nbytes": int(record["nbytes"]),
                "size": len(manifest),
                "digest": hashlib.sha256(manifest).digest() if manifest else b"",
            }
            nonce, reply = call.request("commit", fields)
            if manifest:
                call.run(wire.send_trailer, call.run(wire.send_payload, memoryview(manifest)))
                reply = call.reply("commit", nonce, index=1)
        return reply["next_seq"]

    def replicated(self, peer_addr: PeerAddress, checkpoint: str, node: str, committed_at: float) -> None:
        """Tell the peer's node that node ``node``'s files of the save of ``checkpoint`` committed at
        ``committed_at`` are all replicated (see ``safe_point``); returns once it recorded that."""
        checkpoint, node = validate_name(checkpoint, "checkpoint id"), validate_name(node, "node")
        with self._call(peer_addr, f"reporting checkpoint {checkpoint} replicated") as call:
            fields = {"checkpoint": checkpoint, "node": node, "committed_at": float(committed_at)}
            call.request("replicated", fields)

    def stat(
        self,
        peer_addr: PeerAddress,
        checkpoint: str,
        persist_to: str | None = None,
        deadline: float | None = None,
    ) -> dict:
        checkpoint = validate_name(checkpoint, "checkpoint id")
        with self._call(peer_addr, f"asking what it holds of checkpoint {checkpoint}", deadline) as call:
            _, reply = call.request("stat", {"checkpoint": checkpoint, "persist_to": persist_to})
        return {k: reply[k] for k in ("own", "committed", "replicas", "upload", "replication", "listed")}

    def close(self) -> None:
        """Refuse new calls and end those in flight (their sockets are shut down)."""
        with self._lock:
            self._closed = True
            calls = list(self._calls)
        for call in calls:
            if call.sock is not None:
                with contextlib.suppress(OSError):
                    call.sock.shutdown(socket.SHUT_RDWR)

    @contextlib.contextmanager
    def _get(
        self,
        peer: PeerAddress,
        checkpoint: str,
        file: str,
        source_node: str | None,
        offset: int,
        length: int | None,
    ) -> Iterator[tuple[_Call, int]]:
        checkpoint, file, source_node = checked_names(checkpoint, file, source_node)
        where = "its own copy" if source_node is None else f"its replica of node {source_node}"
        with self._call(peer, f"fetching file {file} of checkpoint {checkpoint} from {where}") as call:
            fields = {"checkpoint": checkpoint, "file": file, "source": source_node}
            _, reply = call.request("get", {**fields, "offset": offset, "length": length})
            yield call, reply["size"]

    @staticmethod
    def _receive(call: _Call, view: memoryview) -> None:
        actual = call.run(wire.recv_payload, view)
        expected = call.run(wire.recv_trailer)
        if actual != expected:
            raise ReplicationError(
                call.peer,
                "checksum",
                f"sent corrupt bytes ({call.what}): xxh3_64 {actual:#018x}, the peer computed "
                f"{expected:#018x}; nothing was kept, fetch it again",
            )
