"""Authentication of replication messages: HMAC-SHA256 with a per-job secret, per-connection challenges,
timestamps, one-time nonces.

A peer server accepts a request only if it carries a MAC made with this job's secret over the request's
canonical encoding (msgpack, map keys sorted, without the ``mac`` field), which covers the ``job``, the
``op``, every argument, the server it is for (``to``: the server's address as the client's connection
reached it, see ``destination``), the ``challenge`` that server sent when the connection opened (random,
fresh for every connection, see ``wire``), a timestamp ``ts`` (Unix milliseconds) and a random ``nonce``.
A request is thus good on its own connection only: a capture replayed on another connection, to the same
server, to another node's server, or to a server restarted on the same address (whose memory of nonces
starts empty), names another connection's challenge and is refused, however soon it is replayed. Requests
for another server (``to``: a man in the middle relaying a request meant for one server to another),
outside the time window (clock skew or a stale capture) and nonces already seen (a replay on the same
connection) are refused too. Replies are signed too, bound to the request by echoing its nonce (``re``),
so a client also knows it talks to a peer of its own job, and to their place among that request's replies
(a ``put``'s go-ahead is reply 0, its "stored" reply 1), so a go-ahead replayed by a man in the middle
never passes for the answer that the bytes were kept. Request and reply MACs use different domain
prefixes, so one can never pass for the other.

The secret is 32 random bytes per job, shared through the torch.distributed store (rank 0 creates it under
``dcp_memstore/<job>/secret``; the others wait for it) or given by the user. It is as secret as that store:
anyone who can read the rendezvous store can read it. Payload bytes are not MACed; they are checked by their
xxh3-64 checksum, which guards against corruption, not against a man in the middle.
"""

from __future__ import annotations

import heapq
import hmac
import ipaddress
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from hashlib import sha256
from typing import Any

import msgpack

from dcp_memstore.store.ids import validate_name

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
NONCE_BYTES = 16
CHALLENGE_BYTES = 16
MAC_BYTES = 32
DEFAULT_WINDOW_S = 300.0
DEFAULT_MAX_NONCES = 1 << 16
_REQUEST_DOMAIN = b"dcp_memstore replication request v1\0"
_REPLY_DOMAIN = b"dcp_memstore replication reply v1\0"


class AuthError(PermissionError):
    """A message failed authentication (bad MAC, wrong job, another connection's challenge, stale timestamp,
    replayed nonce)."""


def new_challenge() -> bytes:
    """A fresh random challenge for one connection (see the module docstring)."""
    return secrets.token_bytes(CHALLENGE_BYTES)


def new_secret() -> bytes:
    """A fresh random per-job secret."""
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret: object) -> bytes:
    """``secret`` as bytes if it is usable (bytes, or a str taken as UTF-8, of at least 16 bytes)."""
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError(f"the replication secret must be bytes or a str, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the replication secret is {len(secret)} bytes long; use at least {MIN_SECRET_BYTES} random "
            f"bytes (e.g. secrets.token_hex(32)), or leave it unset to have one generated per job"
        )
    return bytes(secret)


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_sorted(v) for v in value]
    return value


def canonical(header: Mapping) -> bytes:
    """The bytes a MAC covers: ``header`` without ``mac``, map keys sorted, as msgpack."""
    return msgpack.packb(_sorted({k: v for k, v in header.items() if k != "mac"}), use_bin_type=True)


def _mac(secret: bytes, domain: bytes, header: Mapping) -> bytes:
    return hmac.new(secret, domain + canonical(header), sha256).digest()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def destination(sockaddr: tuple) -> str:
    """The name of a server in the requests sent to it (field ``to``): ``host:port`` (``[host]:port`` for
    IPv6) of the TCP endpoint ``sockaddr``, the host in its canonical form and an IPv4-mapped IPv6 address
    as IPv4, so that the client (its connection's ``getpeername()``) and the server (``getsockname()``)
    name it alike."""
    host, port = sockaddr[0], sockaddr[1]
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def sign_request(header: Mapping, secret: bytes, job_id: str, to: str, challenge: bytes) -> dict:
    """``header`` (with its ``op``) for the server named ``to`` (``destination``) on the connection where
    that server sent ``challenge``, plus ``job``, ``ts``, a fresh ``nonce`` and the ``mac`` over all of it."""
    signed = {
        **header,
        "job": job_id,
        "to": to,
        "challenge": challenge,
        "ts": _now_ms(),
        "nonce": secrets.token_bytes(NONCE_BYTES),
    }
    signed["mac"] = _mac(secret, _REQUEST_DOMAIN, signed)
    return signed


def _reply_domain(index: int) -> bytes:
    """The MAC domain of the ``index``-th reply to one request (0: the first)."""
    return _REPLY_DOMAIN + index.to_bytes(4, "big")


def sign_reply(reply: Mapping, secret: bytes, request_nonce: bytes, index: int = 0) -> dict:
    """``reply``, the ``index``-th reply to the request with nonce ``request_nonce``, bound to it (field
    ``re``, and ``index`` in the MAC) and signed (``mac``)."""
    signed = {**reply, "re": request_nonce}
    signed["mac"] = _mac(secret, _reply_domain(index), signed)
    return signed


def verify_reply(reply: Mapping, secret: bytes, request_nonce: bytes, index: int = 0) -> None:
    """Raise AuthError unless ``reply`` is the ``index``-th reply to the request with nonce
    ``request_nonce`` and is signed with ``secret``."""
    mac = reply.get("mac")
    if not isinstance(mac, bytes) or len(mac) != MAC_BYTES:
        raise AuthError("the reply carries no valid MAC")
    if reply.get("re") != request_nonce:
        raise AuthError("the reply answers another request (its 're' is not this request's nonce)")
    if not hmac.compare_digest(mac, _mac(secret, _reply_domain(index), reply)):
        raise AuthError(
            f"the reply's MAC is wrong: the peer does not hold this job's replication secret, or the reply "
            f"is not reply {index} to this request (e.g. an earlier one replayed)"
        )


class RequestVerifier:
    """Checks requests for one job: MAC, job, server, connection challenge, timestamp window and nonce
    reuse. Thread-safe.

    A request's nonce is remembered while its timestamp is inside the time window (later, the window
    refuses the request anyway), at most ``max_nonces`` of them. When that many are remembered, the nonce
    with the oldest timestamp is forgotten and the window shrinks: from then on a request signed at or
    before that timestamp is refused too. So a replay inside the window is always refused, however many
    requests arrive, and a fresh request is never refused for lack of room; only one signed before the
    ``max_nonces`` newest accepted ones (a replay, a long-delayed request, or a clock far behind) is.
    """

    def __init__(
        self,
        secret: bytes,
        job_id: str,
        window_s: float = DEFAULT_WINDOW_S,
        max_nonces: int = DEFAULT_MAX_NONCES,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self.secret = check_secret(secret)
        self.job_id = job_id
        self.window_ms = int(window_s * 1000)
        self.max_nonces = max_nonces
        self._clock_ms = clock_ms
        self._seen: set[bytes] = set()
        self._by_ts: list[tuple[int, bytes]] = []  # a heap of (ts, nonce) of the nonces in _seen
        self._floor = -1  # the newest timestamp whose nonce was forgotten before its window ended
        self._lock = threading.Lock()

    def verify(self, header: Mapping, to: str, challenge: bytes) -> None:
        """Raise AuthError unless ``header`` is a fresh request signed with this job's secret for the server
        named ``to`` (``destination`` of the server's end of the connection it came on), on the connection
        where that server sent ``challenge``."""
        mac, nonce, ts, job = (header.get(k) for k in ("mac", "nonce", "ts", "job"))
        if not isinstance(mac, bytes) or len(mac) != MAC_BYTES:
            raise AuthError("the request carries no valid MAC (32 bytes in field 'mac')")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise AuthError(f"the request carries no valid nonce ({NONCE_BYTES} bytes in field 'nonce')")
        if type(ts) is not int:
            raise AuthError("the request carries no timestamp (Unix milliseconds in field 'ts')")
        if not hmac.compare_digest(mac, _mac(self.secret, _REQUEST_DOMAIN, header)):
            raise AuthError(
                "the request's MAC is wrong: the sender does not hold this job's replication secret"
            )
        if job != self.job_id:
            raise AuthError(f"the request is for job {job!r}; this server serves job {self.job_id!r}")
        if header.get("to") != to:
            raise AuthError(
                f"the request is for the replication server at {header.get('to')}; this is the one at {to}: "
                f"it is a request replayed to another server, or the nodes reach each other through address "
                f"translation (NAT, a proxy), which replication does not support"
            )
        if header.get("challenge") != challenge:  # sent in the clear: no secret to compare in constant time
            raise AuthError(
                "the request was signed for another connection (it carries another connection's challenge): "
                "it is a request captured earlier and replayed, to this server or to one that has since "
                "restarted"
            )
        now = self._clock_ms()
        if abs(now - ts) > self.window_ms:
            raise AuthError(
                f"the request's timestamp is {(now - ts) / 1000:+.1f} s off this node's clock (allowed: "
                f"{self.window_ms / 1000:.0f} s): synchronise the nodes' clocks, or it is a replayed request"
            )
        with self._lock:
            while self._by_ts and self._by_ts[0][0] < now - self.window_ms:
                self._seen.discard(heapq.heappop(self._by_ts)[1])  # the window refuses its request now
            if nonce in self._seen:
                raise AuthError("the request replays an earlier one (its nonce was already used)")
            if ts <= self._floor:
                raise AuthError(
                    f"the request was signed {(now - ts) / 1000:.1f} s ago, before the {self.max_nonces} "
                    f"newest requests this server accepted, and it remembers no older ones: it is a "
                    f"replayed request, or it was delayed that long, or its node's clock is behind"
                )
            self._seen.add(nonce)
            heapq.heappush(self._by_ts, (ts, nonce))
            if len(self._seen) > self.max_nonces:
                oldest, forgotten = heapq.heappop(self._by_ts)
                self._seen.discard(forgotten)
                self._floor = max(self._floor, oldest)


def secret_store_key(job_id: str) -> str:
    """The torch.distributed store key under which job ``job_id``'s replication secret is shared."""
    return f"dcp_memstore/{validate_name(job_id, 'job id')}/secret"


def shared_secret(store: Any, job_id: str, rank: int, secret: bytes | str | None = None) -> bytes:
    """Job ``job_id``'s replication secret, the same on every rank.

    ``secret`` given (by the user, identically on every rank): that one, checked, and the store is not used.
    Otherwise rank 0 creates a random one in ``store`` (a ``torch.distributed.Store``: TCPStore, HashStore,
    FileStore, PrefixStore) with ``compare_set``, so a restarted rank 0 keeps the one already shared, and the
    other ranks wait for it with ``get`` (up to the store's timeout).
    """
    if secret is not None:
        return check_secret(secret)
    key = secret_store_key(job_id)
    try:
        value = store.compare_set(key, "", new_secret()) if rank == 0 else store.get(key)
    except RuntimeError as e:  # c10d's DistStoreError (a timeout, a lost store) subclasses RuntimeError
        raise RuntimeError(
            f"rank {rank} could not get job {job_id!r}'s replication secret from the torch.distributed store "
            f"(key {key!r}, created by rank 0): {e}. Check that rank 0 started replication, or give the "
            f"secret explicitly on every rank."
        ) from e
    try:
        return check_secret(bytes(value))
    except ValueError as e:
        raise ValueError(f"store key {key!r} holds no usable replication secret: {e}") from e
