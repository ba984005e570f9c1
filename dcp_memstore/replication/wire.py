"""The replication wire format: framed msgpack headers and raw payloads; nothing is ever unpickled.

A frame is::

    b"DCPM" | version (1 byte) | 3 reserved zero bytes | header length (4 bytes, big-endian) | header

where the header is a msgpack map of at most ``MAX_HEADER_BYTES``; a longer one is refused before it is read.
A message that announces a payload (a ``put`` request, a ``get`` reply: field ``size``) is followed by exactly
``size`` raw bytes and then a trailer frame ``{"op": "end", "checksum": <xxh3-64>}``. The checksum comes after
the bytes, not in the header, so each end hashes every chunk while it is still in cache from the socket copy
(one pass over memory; a separate hashing pass before sending would cost a second one).

A connection opens with a hello each way, sent at once, neither waiting for the other's: the client's
``{"op": "hello"}`` (so a server of another release refuses the client's frame by its wire version, instead
of waiting for a request it cannot read) and the server's ``{"op": "hello", "challenge": <16 random
bytes>}``, fresh for each connection; every request on the connection carries that challenge under its MAC
(``auth``), so no request is good on any other connection. A server that refuses the connection (``busy``)
sends that error reply in place of its hello.

Conversations (one or more per connection, after the hellos; every request is authenticated, see
``auth``)::

    ping: request                                         -> reply
    stat: request {checkpoint, persist_to}
          -> reply {own, committed, replicas, upload, replication, listed}
          ``upload``: the node's upload state of its committed copy towards target URL ``persist_to``
          ({state, error}; nil without ``persist_to`` or where it is not committed); ``replication``:
          the replication state of the node's own files of its committed copy, per replica node
          ({node<i>: replicated | pending | retrying: <error>}; nil where it is not committed or the
          node does not replicate); ``listed``: how many data files (all nodes') the manifest of its
          committed copy lists (0 where it is not committed)
    put:  request {source, checkpoint, file, size}        -> reply (go-ahead or refusal)
          payload, trailer                                -> reply (stored, or refused: checksum, ...)
    get:  request {checkpoint, file, source, offset, length} -> reply {size}, payload, trailer
    commit: request {checkpoint, phase, seq, committed_at, nbytes, size, digest}, payload, trailer
                                                          -> reply {next_seq}
            phase "prepare" carries the manifest (``digest``: its SHA-256, covered by the request's MAC);
            "commit" and "abort" carry no payload (size 0).
    replicated: request {checkpoint, node, committed_at}     -> reply
            node ``node``'s files of the save of ``checkpoint`` committed at ``committed_at`` are all
            replicated (``safe_point``); the receiver records it if it has that save, and acknowledges
            either way.
    rdma_put: request {source, checkpoint, file, size, qp}  -> reply {addr, rkey, qp} (go-ahead or refusal)
          (the sender RDMA-writes the bytes), trailer     -> reply (stored, or refused: checksum, ...)
    rdma_get: request {checkpoint, file, source, qp}      -> reply {size, addr, rkey, qp, checksum}
          (the receiver RDMA-reads the bytes), trailer (its checksum: done, the file is released)

``qp`` is a queue pair's connection details (``QP_INFO``: qp_num, lid, gid, psn, mtu, rd_atomic), nil when
no byte moves (size 0). Only payload bytes move by RDMA (``rdma``); these headers stay on the authenticated
TCP connection. A server without RDMA refuses both ops with code ``rdma_unavailable``.

The ``put`` go-ahead costs one round trip per file, and in exchange a refused file (no space, too large,
bad name, unauthenticated) is refused before any of its bytes travel.

Every header is validated strictly: exact field sets, exact types (a bool is not an int), unknown ops refused.
Payloads move without copies in this process: ``sendall`` of memoryview slices of the file's mapping, and
``recv_into`` straight into the destination file's mapping.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import xxhash

MAGIC = b"DCPM"
VERSION = 5  # 2: requests name their server (field "to", see auth); 3: hellos, requests carry a challenge;
# 4: the replicated op; 5: stat replies carry the node's replication state
PREFIX = MAGIC + bytes([VERSION]) + b"\0\0\0"
_FRAME = struct.Struct(">8sI")  # prefix, header length
MAX_HEADER_BYTES = 64 << 10
CHUNK = 1 << 20  # payload piece: one send/recv-and-hash step, small enough to stay in L2
U64 = 1 << 64


class ProtocolError(ValueError):
    """A frame or header that breaks the wire format (wrong magic, bad field, oversized header, ...)."""


# --- field validators -----------------------------------------------------------------------------


def _uint(v: Any) -> bool:
    return type(v) is int and 0 <= v < U64


def _str(v: Any) -> bool:
    return type(v) is str


def _bytes(v: Any) -> bool:
    return type(v) is bytes


def _bool(v: Any) -> bool:
    return type(v) is bool


def _float(v: Any) -> bool:
    return type(v) is float


def _u32(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 32


# A queue pair's connection details (rdma_verbs.QPInfo): exact keys and ranges.
QP_INFO: dict[str, Callable[[Any], bool]] = {
    "qp_num": lambda v: type(v) is int and 0 < v < 1 << 24,
    "lid": lambda v: type(v) is int and 0 <= v < 1 << 16,
    "gid": lambda v: type(v) is bytes and len(v) == 16,
    "psn": lambda v: type(v) is int and 0 <= v < 1 << 24,
    "mtu": lambda v: type(v) is int and 1 <= v <= 5,  # IBV_MTU_256 .. IBV_MTU_4096
    "rd_atomic": lambda v: type(v) is int and 1 <= v <= 255,
}


def _qp_info(v: Any) -> bool:
    return type(v) is dict and v.keys() == QP_INFO.keys() and all(QP_INFO[k](v[k]) for k in QP_INFO)


def _file_sizes(v: Any) -> bool:
    return type(v) is dict and all(_str(k) and _uint(s) for k, s in v.items())


def _replica_files(v: Any) -> bool:
    return type(v) is dict and all(_str(k) and _file_sizes(f) for k, f in v.items())


def _peer_states(v: Any) -> bool:
    return type(v) is dict and all(_str(k) and _str(s) for k, s in v.items())


def _upload_state(v: Any) -> bool:
    return (
        type(v) is dict
        and v.keys() == {"state", "error"}
        and _str(v["state"])
        and (v["error"] is None or _str(v["error"]))
    )


_TYPE_NAMES = {
    _uint: "an unsigned 64-bit int",
    _u32: "an unsigned 32-bit int",
    _qp_info: "a map of queue pair details (qp_num, lid, gid, psn, mtu, rd_atomic) in range",
    _str: "a str",
    _bytes: "bytes",
    _bool: "a bool",
    _float: "a float",
    _file_sizes: "a map of file name to size",
    _replica_files: "a map of source node to a map of file name to size",
    _upload_state: "a map of an upload state and its error (a str or nil)",
    _peer_states: "a map of node name to replication state",
}


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def optional(v: Any) -> bool:
        return v is None or check(v)

    _TYPE_NAMES[optional] = f"{_TYPE_NAMES[check]} or nil"
    return optional


# Fields every request carries (values checked by auth.RequestVerifier).
AUTH_FIELDS: dict[str, Callable[[Any], bool]] = {
    "op": _str,
    "job": _str,
    "to": _str,
    "challenge": _bytes,
    "ts": _uint,
    "nonce": _bytes,
    "mac": _bytes,
}

# Request fields by op, besides AUTH_FIELDS. Every field is required; no other field is allowed.
REQUESTS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "ping": {},
    "stat": {"checkpoint": _str, "persist_to": _optional(_str)},
    "put": {"source": _str, "checkpoint": _str, "file": _str, "size": _uint},
    "get": {
        "checkpoint": _str,
        "file": _str,
        "source": _optional(_str),
        "offset": _uint,
        "length": _optional(_uint),
    },
    "commit": {
        "checkpoint": _str,
        "phase": _str,
        "seq": _uint,
        "committed_at": _float,
        "nbytes": _uint,
        "size": _uint,
        "digest": _bytes,
    },
    "replicated": {"checkpoint": _str, "node": _str, "committed_at": _float},
    "rdma_put": {"source": _str, "checkpoint": _str, "file": _str, "size": _uint, "qp": _optional(_qp_info)},
    "rdma_get": {"checkpoint": _str, "file": _str, "source": _optional(_str), "qp": _qp_info},
}

# Fields of a successful reply, by op, besides "ok", "re" (the request's nonce) and "mac".
REPLIES: dict[str, dict[str, Callable[[Any], bool]]] = {
    "ping": {},
    "stat": {
        "own": _file_sizes,
        "committed": _bool,
        "replicas": _replica_files,
        "upload": _optional(_upload_state),
        "replication": _optional(_peer_states),
        "listed": _uint,
    },
    "put": {},
    "get": {"size": _uint},
    "commit": {"next_seq": _uint},
    "replicated": {},
    "rdma_put": {"addr": _uint, "rkey": _u32, "qp": _optional(_qp_info)},  # the go-ahead
    "rdma_put_stored": {},  # the second reply to rdma_put: verified and kept
    "rdma_get": {"size": _uint, "addr": _uint, "rkey": _u32, "qp": _optional(_qp_info), "checksum": _uint},
}

_TRAILER = {"op": _str, "checksum": _uint}


def _check_fields(header: Mapping, fields: Mapping[str, Callable[[Any], bool]], what: str) -> None:
    missing = [k for k in fields if k not in header]
    extra = [k for k in header if k not in fields]
    if missing or extra:
        raise ProtocolError(
            f"{what} has the wrong fields (missing {sorted(missing)}, unexpected {sorted(map(repr, extra))})"
        )
    for k, check in fields.items():
        if not check(header[k]):
            expected = _TYPE_NAMES.get(check, "a valid value")
            raise ProtocolError(f"{what} field {k!r} must be {expected}, got {type(header[k]).__name__}")


_CLIENT_HELLO = {"op": _str}
_SERVER_HELLO = {"op": _str, "challenge": _bytes}
CLIENT_HELLO = {"op": "hello"}


def server_hello(challenge: bytes) -> dict:
    """The server's hello on a new connection: the ``challenge`` that its requests must carry."""
    return {"op": "hello", "challenge": challenge}


def _check_hello(header: Mapping, fields: Mapping[str, Callable[[Any], bool]], what: str) -> None:
    if header.get("op") != "hello":
        raise ProtocolError(f"the connection must open with the {what}, got op {header.get('op')!r}")
    _check_fields(header, fields, what)


def validate_client_hello(header: Mapping) -> None:
    """Check the client's hello, the first frame a server receives on a connection. Raises ProtocolError."""
    _check_hello(header, _CLIENT_HELLO, "client's hello")


def validate_server_hello(header: Mapping) -> bytes:
    """Check the server's hello, the first frame a client receives on a connection; return its challenge.
    Raises ProtocolError."""
    _check_hello(header, _SERVER_HELLO, "server's hello")
    return header["challenge"]


def validate_request(header: Mapping) -> str:
    """Check a request header's fields and types; return its op. Raises ProtocolError."""
    op = header.get("op")
    if op not in REQUESTS:
        raise ProtocolError(f"unknown op {op!r}; this server knows {sorted(REQUESTS)}")
    _check_fields(header, {**AUTH_FIELDS, **REQUESTS[op]}, f"{op} request")
    return op


def validate_reply(header: Mapping, op: str) -> dict:
    """Check a reply to an ``op`` request. An error reply (``ok`` false) must have ``code`` and ``error``
    and may be unsigned (a refused request gets no MAC); a success reply must be signed."""
    ok = header.get("ok")
    if ok is False:
        signed = {"re": _bytes, "mac": _bytes} if "mac" in header else {}
        _check_fields(header, {"ok": _bool, "code": _str, "error": _str, **signed}, f"{op} error reply")
    elif ok is True:
        _check_fields(header, {"ok": _bool, "re": _bytes, "mac": _bytes, **REPLIES[op]}, f"{op} reply")
    else:
        raise ProtocolError(f"{op} reply field 'ok' must be a bool, got {type(ok).__name__}")
    return dict(header)


# --- frames ---------------------------------------------------------------------------------------


def pack_frame(header: Mapping) -> bytes:
    """Encode ``header`` as one frame. Raises ProtocolError if its encoding exceeds MAX_HEADER_BYTES."""
    body = msgpack.packb(header, use_bin_type=True)
    if len(body) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(body)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    return _FRAME.pack(PREFIX, len(body)) + body


def send_header(sock: socket.socket, header: Mapping) -> None:
    """Send ``header`` as one frame."""
    sock.sendall(pack_frame(header))


def _await(sock: socket.socket, deadline: float | None, what: str) -> None:
    """Before a receive: give it the time left until ``deadline`` (a ``time.monotonic()`` value; None: no
    deadline, the socket's own timeout applies), or raise TimeoutError if none is left."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what} did not arrive in time")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, what: str, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        _await(sock, deadline, what)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes of {what}")
        got += k
    return buf


def recv_header(sock: socket.socket, eof_ok: bool = False, deadline: float | None = None) -> dict | None:
    """Receive one frame and return its header (a dict with str keys).

    Returns None if the peer closed the connection cleanly before the frame's first byte and ``eof_ok``;
    raises ConnectionError if it closes mid-frame and ProtocolError for anything malformed. An oversized
    header is refused from its length field, before its body is read. With a ``deadline`` (a
    ``time.monotonic()`` value) the whole frame must arrive by then, however slowly it trickles in, else
    TimeoutError; the socket's timeout is left at what remained."""
    _await(sock, deadline, "a frame prefix")
    first = sock.recv(_FRAME.size)
    if not first:
        if eof_ok:
            return None
        raise ConnectionError("the peer closed the connection instead of answering")
    if len(first) < _FRAME.size:
        first += _recv_exact(sock, _FRAME.size - len(first), "a frame prefix", deadline)
    prefix, length = _FRAME.unpack(first)
    if prefix[:4] != MAGIC:
        raise ProtocolError(
            f"not a dcp_memstore replication frame (magic {bytes(prefix[:4])!r}, want {MAGIC!r})"
        )
    if prefix[4] != VERSION:
        raise ProtocolError(
            f"wire version {prefix[4]} is not supported (this build speaks version {VERSION}): every "
            f"node of a job must run the same dcp_memstore release"
        )
    if prefix[5:] != b"\0\0\0":
        raise ProtocolError("reserved bytes of the frame prefix are not zero")
    if length == 0 or length > MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {length} is outside 1..{MAX_HEADER_BYTES} bytes")
    body = _recv_exact(sock, length, "a header", deadline)
    try:
        header = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from e
    if type(header) is not dict:
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


# --- payloads -------------------------------------------------------------------------------------


def send_payload(sock: socket.socket, view: memoryview) -> int:
    """Send the bytes of ``view`` in CHUNK-sized slices (no copies here); return their xxh3-64."""
    view = view.cast("B") if view.format != "B" else view
    h = xxhash.xxh3_64()
    for off in range(0, len(view), CHUNK):
        piece = view[off : off + CHUNK]
        h.update(piece)  # hash first: the kernel's copy then reads the piece from cache
        sock.sendall(piece)
    return h.intdigest()


def recv_payload(sock: socket.socket, view: memoryview) -> int:
    """Receive exactly ``len(view)`` bytes straight into the writable ``view``; return their xxh3-64.
    Raises ConnectionError if the peer closes first. With a socket timeout, each CHUNK must arrive within
    about it (a receive that started in time may end up to one timeout later), however its bytes trickle
    in (TimeoutError): a peer that sends a byte now and then does not keep a transfer, and the thread
    waiting on it, going for good."""
    view = view.cast("B") if view.format != "B" else view
    h = xxhash.xxh3_64()
    n = len(view)
    per_chunk = sock.gettimeout()
    for off in range(0, n, CHUNK):
        piece = view[off : off + CHUNK]
        deadline = None if per_chunk is None else time.monotonic() + per_chunk
        got = 0
        while got < len(piece):
            k = sock.recv_into(piece[got:])
            if k == 0:
                raise ConnectionError(
                    f"the peer closed the connection after {off + got} of {n} payload bytes"
                )
            got += k
            if got < len(piece) and deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"payload bytes {off}..{off + len(piece)} of {n} did not arrive within {per_chunk} s"
                )
        h.update(piece)
    return h.intdigest()


def send_trailer(sock: socket.socket, checksum: int) -> None:
    """Send the frame that ends a payload: its xxh3-64 checksum."""
    send_header(sock, {"op": "end", "checksum": checksum})


def recv_trailer(sock: socket.socket) -> int:
    """Receive the frame that ends a payload and return the checksum it announces."""
    header = recv_header(sock)
    assert header is not None
    _check_fields(header, _TRAILER, "payload trailer")
    if header["op"] != "end":
        raise ProtocolError(f"expected the payload trailer (op 'end'), got op {header['op']!r}")
    return header["checksum"]
