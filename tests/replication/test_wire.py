"""The replication wire format: frames round-trip, every malformed frame or header field is refused, and
payloads stream with their checksum (over a real socket pair)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import msgpack
import pytest
import xxhash

from dcp_memstore.replication import wire


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def _request(op: str = "put", **fields) -> dict:
    base = {"op": op, "job": "job", "to": "127.0.0.1:1", "challenge": b"c" * 16, "ts": 1}
    base.update(nonce=b"n" * 16, mac=b"m" * 32)
    args = {
        "ping": {},
        "stat": {"checkpoint": "step-1", "persist_to": None},
        "put": {"source": "node0", "checkpoint": "step-1", "file": "__0_0.shard", "size": 10},
        "get": {"checkpoint": "step-1", "file": "f", "source": None, "offset": 0, "length": None},
        "replicated": {"checkpoint": "step-1", "node": "node1", "committed_at": 1.5},
    }.get(op, {})
    return {**base, **args, **fields}


def test_header_round_trip(pair):
    a, b = pair
    header = _request("get", source="node1", length=5)
    wire.send_header(a, header)
    assert wire.recv_header(b) == header


def test_frame_layout_is_magic_version_reserved_length_msgpack():
    frame = wire.pack_frame({"op": "end", "checksum": 7})
    body = msgpack.packb({"op": "end", "checksum": 7}, use_bin_type=True)
    assert frame == b"DCPM\x05\x00\x00\x00" + struct.pack(">I", len(body)) + body


def test_clean_eof_between_frames(pair):
    a, b = pair
    a.close()
    assert wire.recv_header(b, eof_ok=True) is None
    with pytest.raises(ConnectionError):
        wire.recv_header(b)


def test_eof_mid_frame_is_a_connection_error(pair):
    a, b = pair
    a.sendall(wire.pack_frame({"op": "end", "checksum": 1})[:-3])
    a.close()
    with pytest.raises(ConnectionError, match="closed the connection"):
        wire.recv_header(b)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"HTTP/1.1 200 OK\r\n\r\n", "magic"),
        (b"DCPM\x01\x00\x00\x00" + struct.pack(">I", 1) + b"\x80", "version 1 is not supported .* same"),
        (b"DCPM\x02\x00\x00\x00" + struct.pack(">I", 1) + b"\x80", "version 2 is not supported"),
        (b"DCPM\x03\x00\x00\x00" + struct.pack(">I", 1) + b"\x80", "version 3 is not supported"),
        (b"DCPM\x04\x00\x00\x00" + struct.pack(">I", 1) + b"\x80", "version 4 is not supported"),
        (b"DCPM\x05\x00\x01\x00" + struct.pack(">I", 1) + b"\x80", "reserved"),
        (b"DCPM\x05\x00\x00\x00" + struct.pack(">I", 0), "header length 0"),
        (b"DCPM\x05\x00\x00\x00" + struct.pack(">I", wire.MAX_HEADER_BYTES + 1), "header length"),
        (b"DCPM\x05\x00\x00\x00" + struct.pack(">I", 1) + b"\xc1", "not valid msgpack"),  # 0xc1: never used
        (b"DCPM\x05\x00\x00\x00" + struct.pack(">I", 2) + b"\x80\x80", "not valid msgpack"),  # trailing data
        (b"DCPM\x05\x00\x00\x00" + struct.pack(">I", 1) + b"\x90", "must be a msgpack map"),
        (b"DCPM\x05\x00\x00\x00" + struct.pack(">I", 3) + b"\x81\x01\x02", "not valid msgpack"),  # int key
    ],
)
def test_malformed_frames_refused(pair, raw, match):
    a, b = pair
    a.sendall(raw)
    with pytest.raises(wire.ProtocolError, match=match):
        wire.recv_header(b)


def test_a_header_trickling_in_past_its_deadline_is_a_timeout(pair):
    """The deadline bounds the whole frame, not each receive: a sender dribbling a byte every 50 ms (well
    within the socket's own 5 s timeout) still runs out of time."""
    a, b = pair
    frame = wire.pack_frame(_request())
    stop = threading.Event()

    def dribble() -> None:
        for i in range(len(frame)):
            if stop.wait(0.05):
                return
            a.sendall(frame[i : i + 1])

    t = threading.Thread(target=dribble)
    t.start()
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            wire.recv_header(b, deadline=start + 0.3)
        assert time.monotonic() - start < 1.0
    finally:
        stop.set()
        t.join(5)


def test_oversized_header_refused_from_its_length_alone(pair):
    """The limit is checked before the body is read: a peer cannot make us buffer a huge header."""
    a, b = pair
    a.sendall(wire.PREFIX + struct.pack(">I", 1 << 31))  # announces 2 GiB, sends nothing more
    with pytest.raises(wire.ProtocolError, match="header length"):
        wire.recv_header(b)


def test_deeply_nested_header_refused(pair):
    a, b = pair
    body = b"\x91" * 10_000 + b"\x80"
    a.sendall(wire.PREFIX + struct.pack(">I", len(body)) + body)
    with pytest.raises(wire.ProtocolError):
        wire.recv_header(b)


def test_pack_frame_refuses_oversized_header():
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        wire.pack_frame({"op": "stat", "junk": "x" * (wire.MAX_HEADER_BYTES + 1)})


@pytest.mark.parametrize("op", ["ping", "stat", "put", "get", "replicated"])
def test_valid_requests_pass(op):
    assert wire.validate_request(_request(op)) == op


@pytest.mark.parametrize(
    "header, match",
    [
        (_request("delete"), "unknown op 'delete'"),
        (_request("__class__"), "unknown op"),
        ({**_request(), "op": 3}, "unknown op"),
        ({k: v for k, v in _request().items() if k != "mac"}, "missing \\['mac'\\]"),
        ({k: v for k, v in _request().items() if k != "to"}, "missing \\['to'\\]"),
        ({k: v for k, v in _request().items() if k != "challenge"}, "missing \\['challenge'\\]"),
        (_request(challenge="c" * 16), "'challenge' must be bytes"),
        ({k: v for k, v in _request().items() if k != "size"}, "missing \\['size'\\]"),
        (_request(extra=1), "unexpected"),
        (_request(size=True), "'size' must be an unsigned 64-bit int"),
        (_request(size=-1), "'size' must be an unsigned"),
        (_request(size=1.0), "'size' must be an unsigned"),
        (_request(size="10"), "'size' must be an unsigned"),
        (_request(file=b"f"), "'file' must be a str"),
        (_request(file=None), "'file' must be a str"),
        (_request(nonce="n" * 16), "'nonce' must be bytes"),
        (_request(ts=None), "'ts' must be"),
        (_request(job=["job"]), "'job' must be a str"),
        (_request("get", source=1), "'source' must be a str or nil"),
        (_request("get", length=-5), "'length' must be an unsigned 64-bit int or nil"),
        (_request("replicated", committed_at=1), "'committed_at' must be a float"),
        (_request(checkpoint=msgpack.ExtType(1, b"x")), "'checkpoint' must be a str"),
    ],
)
def test_invalid_requests_refused(header, match):
    with pytest.raises(wire.ProtocolError, match=match):
        wire.validate_request(header)


def test_hello_validation():
    """A connection opens with the client's hello and the server's (its challenge): anything else in
    their place is refused."""
    wire.validate_client_hello(wire.CLIENT_HELLO)
    assert wire.validate_server_hello(wire.server_hello(b"c" * 16)) == b"c" * 16
    for bad, match in [
        (_request("ping"), "must open with the client's hello, got op 'ping'"),
        ({"op": "hello", "challenge": b"c"}, "unexpected"),
    ]:
        with pytest.raises(wire.ProtocolError, match=match):
            wire.validate_client_hello(bad)
    for bad, match in [
        ({"ok": True, "re": b"", "mac": b""}, "must open with the server's hello, got op None"),
        ({"op": "hello"}, "missing \\['challenge'\\]"),
        ({"op": "hello", "challenge": "c"}, "'challenge' must be bytes"),
    ]:
        with pytest.raises(wire.ProtocolError, match=match):
            wire.validate_server_hello(bad)


def test_reply_validation():
    ok = {"ok": True, "re": b"n" * 16, "mac": b"m" * 32, "size": 3}
    assert wire.validate_reply(ok, "get") == ok
    with pytest.raises(wire.ProtocolError):
        wire.validate_reply({**ok, "size": -1}, "get")
    with pytest.raises(wire.ProtocolError):  # a success reply must be signed
        wire.validate_reply({"ok": True, "size": 3}, "get")
    with pytest.raises(wire.ProtocolError):
        wire.validate_reply({**ok, "ok": 1}, "get")
    err = {"ok": False, "code": "auth", "error": "no"}
    assert wire.validate_reply(err, "put") == err  # refusals of unauthenticated requests are unsigned
    with pytest.raises(wire.ProtocolError):
        wire.validate_reply({"ok": False, "code": "auth"}, "put")
    stat = {
        "ok": True,
        "re": b"",
        "mac": b"",
        "own": {"a": 1},
        "committed": False,
        "replicas": {"n": {"b": 2}},
        "upload": None,
        "replication": None,
        "listed": 0,
    }
    assert wire.validate_reply(stat, "stat") == stat
    uploading = {**stat, "upload": {"state": "retrying", "error": "ConnectionError: down"}}
    assert wire.validate_reply(uploading, "stat") == uploading
    replicating = {**stat, "replication": {"node1": "replicated", "node2": "retrying: down"}}
    assert wire.validate_reply(replicating, "stat") == replicating
    bad_fields = [
        ("replicas", {"n": {"b": "2"}}),
        ("upload", {"state": "queued"}),
        ("upload", {"state": "queued", "error": 1}),
        ("replication", {"node1": None}),
        ("replication", ["node1"]),
        ("listed", None),
        ("listed", -1),
    ]
    for field, bad in bad_fields:
        with pytest.raises(wire.ProtocolError):
            wire.validate_reply({**stat, field: bad}, "stat")


def test_payload_round_trip_with_checksum(pair):
    a, b = pair
    data = os.urandom(3 * wire.CHUNK + 12345)
    out = bytearray(len(data))
    sent: list[int] = []
    t = threading.Thread(target=lambda: sent.append(wire.send_payload(a, memoryview(data))))
    t.start()
    got = wire.recv_payload(b, memoryview(out))
    t.join()
    assert bytes(out) == data
    assert got == sent[0] == xxhash.xxh3_64_intdigest(data)


def test_payload_cut_short_is_a_connection_error(pair):
    a, b = pair
    a.sendall(b"x" * 100)
    a.close()
    with pytest.raises(ConnectionError, match="after 100 of 200 payload bytes"):
        wire.recv_payload(b, memoryview(bytearray(200)))


def test_trailer(pair):
    a, b = pair
    wire.send_trailer(a, 2**64 - 1)
    assert wire.recv_trailer(b) == 2**64 - 1
    wire.send_header(a, {"op": "put", "checksum": 1})
    with pytest.raises(wire.ProtocolError, match="expected the payload trailer"):
        wire.recv_trailer(b)
    wire.send_header(a, {"op": "end", "checksum": 1, "more": 2})
    with pytest.raises(wire.ProtocolError, match="unexpected"):
        wire.recv_trailer(b)
