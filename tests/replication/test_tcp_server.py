"""The peer server and the TCP transport over real sockets on 127.0.0.1 and real tmpfs directories:
round trips, refusals (authentication, path tricks, sizes, malformed frames, corrupt payloads, a full tmpfs)
that leave nothing behind, concurrency, and errors that name the peer."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import psutil
import pytest
import torch.distributed as dist

from dcp_memstore import MemStore
from dcp_memstore.errors import InsufficientSpaceError
from dcp_memstore.persist.progress import Progress
from dcp_memstore.replication import PeerServer, ReplicationError, TcpTransport, tcp, wire
from dcp_memstore.replication import server as server_module
from dcp_memstore.replication.auth import destination, new_secret
from dcp_memstore.replication.placement import NodeInfo
from dcp_memstore.replication.service import ReplicationService
from dcp_memstore.store import catalog, liveness
from dcp_memstore.store.checksum import checksum_bytes
from dcp_memstore.store.ids import MAX_ID_LENGTH
from dcp_memstore.store.layout import COMMITTED, StoreLayout, part_name, shard_name
from tests.liveness_tokens import dead_token
from tests.replication.transfer_helpers import (
    JOB,
    RawClient,
    check_concurrent_puts,
    check_put_then_get,
    files_under,
    make_file,
    raw_connect,
)

MiB = 1 << 20


@pytest.fixture
def server(peer_root, secret):
    srv = PeerServer(peer_root, JOB, secret, "127.0.0.1", io_timeout_s=10)
    yield srv
    srv.close()


@pytest.fixture
def transport(secret):
    t = TcpTransport(JOB, secret, timeout_s=10)
    yield t
    t.close()


# --- a raw client, for what TcpTransport would never send ------------------------------------------


def put_header(s: RawClient, secret: bytes, size: int, **over) -> dict:
    """A put request on connection ``s`` (node0's replica of step-1's first shard), signed with ``secret``."""
    fields = {"source": "node0", "checkpoint": "step-1", "file": shard_name(0, 0), "size": size, **over}
    return s.signed(secret, "put", **fields)


def refused(sock: socket.socket, code: str) -> dict:
    """Read the error reply, check its code, and check that the server then closed the connection."""
    reply = wire.recv_header(sock)
    assert reply is not None and reply["ok"] is False, reply
    assert reply["code"] == code, reply
    assert sock.recv(1) == b""  # closed after the error reply
    sock.close()
    return reply


def send_raw(server: PeerServer, secret: bytes, op: str, job: str = JOB, **fields) -> RawClient:
    """A new connection to ``server`` on which an ``op`` request of job ``job`` signed with ``secret`` was
    sent."""
    s = raw_connect(server.address)
    wire.send_header(s, s.signed(secret, op, job, **fields))
    return s


def send_put(server: PeerServer, secret: bytes, size: int, **over) -> RawClient:
    """A new connection to ``server`` on which a ``put_header`` request was sent."""
    s = raw_connect(server.address)
    wire.send_header(s, put_header(s, secret, size, **over))
    return s


# --- round trips ------------------------------------------------------------------------------------


def test_put_then_get_multi_mib_bit_exact(server, transport, local, peer_root):
    data = os.urandom(12 * MiB + 4321)  # several payload chunks and a ragged end
    check_put_then_get(transport, server.address, local, peer_root, data)

    out = bytearray(3 * MiB)  # a range, straight into a caller's buffer
    transport.read_range(server.address, "step-1", shard_name(0, 0), 5 * MiB + 7, memoryview(out), "node0")
    assert bytes(out) == data[5 * MiB + 7 : 8 * MiB + 7]


def test_get_from_own_checkpoint_dir_and_empty_file(server, transport, peer_root, local):
    peer = StoreLayout(peer_root, JOB)
    data = os.urandom(MiB + 1)
    make_file(peer, "step-7", shard_name(3, 1), data)
    make_file(peer, "step-7", "empty.bin", b"")
    with pytest.raises(ReplicationError, match="not committed") as e:  # a save still in progress there
        transport.get_file(server.address, "step-7", shard_name(3, 1), local.job_dir / "a", layout=local)
    assert e.value.code == "not_found" and not (local.job_dir / "a").exists()
    make_file(peer, "step-7", COMMITTED, b"")
    transport.get_file(server.address, "step-7", shard_name(3, 1), local.job_dir / "a", layout=local)
    assert (local.job_dir / "a").read_bytes() == data
    transport.get_file(server.address, "step-7", "empty.bin", local.job_dir / "b", layout=local)
    assert (local.job_dir / "b").read_bytes() == b""
    empty = make_file(local, "step-7", "e", b"")
    transport.put_file(server.address, "node0", "step-7", "e", empty)
    assert (peer.replica_dir("node0", "step-7") / "e").read_bytes() == b""


def test_a_checkpoint_is_not_evicted_while_a_peer_gets_its_file(
    server, transport, peer_root, local, monkeypatch
):
    """Eviction hands a checkpoint's files to the pool, where the next save writes into them: a peer
    getting one meanwhile would receive a mix of two saves under a matching transit checksum."""
    peer = StoreLayout(peer_root, JOB)
    data = os.urandom(64 * MiB)  # more than the sockets buffer: the server is still sending below
    make_file(peer, "step-1", shard_name(0, 0), data)
    catalog.commit(peer, "step-1", len(data))
    receive, evicted = wire.recv_payload, []

    def evict_then_receive(sock: socket.socket, view: memoryview) -> int:
        evicted.extend(catalog.evict(peer, keep=0))  # retention on the serving node, mid-transfer
        return receive(sock, view)

    monkeypatch.setattr(wire, "recv_payload", evict_then_receive)
    transport.get_file(server.address, "step-1", shard_name(0, 0), local.job_dir / "a", layout=local)
    assert evicted == [] and (local.job_dir / "a").read_bytes() == data
    deadline = time.monotonic() + 5
    while catalog.holds(peer, "step-1") and time.monotonic() < deadline:  # released once sent
        time.sleep(0.01)
    assert catalog.evict(peer, keep=0) == ["step-1"]


def test_a_replica_dropped_while_it_arrives_is_an_io_error_reply(
    server, transport, local, peer_root, monkeypatch
):
    """The receiving node drops its copies of the checkpoint (it evicted it) while a replica arrives: the
    sender is told why, not left with a connection that just ended."""
    src = make_file(local, "step-1", shard_name(0, 0), os.urandom(MiB))
    send = wire.send_payload

    def drop_then_send(sock: socket.socket, view: memoryview) -> int:
        catalog.drop_copies(StoreLayout(peer_root, JOB), "step-1")
        return send(sock, view)

    monkeypatch.setattr(wire, "send_payload", drop_then_send)
    with pytest.raises(
        ReplicationError, match=f"cannot keep file {shard_name(0, 0)} of checkpoint step-1"
    ) as e:
        transport.put_file(server.address, "node0", "step-1", shard_name(0, 0), src)
    assert e.value.code == "io_error"
    assert [f for f in files_under(peer_root) if "step-1" in f] == []


def test_put_replaces_an_older_replica_file(server, transport, local, peer_root):
    src = make_file(local, "s", "f", b"old" * 1000)
    transport.put_file(server.address, "node0", "s", "f", src)
    src.write_bytes(b"new!" * 999)
    transport.put_file(server.address, "node0", "s", "f", src)
    assert (StoreLayout(peer_root, JOB).replica_dir("node0", "s") / "f").read_bytes() == b"new!" * 999


def test_stat_lists_own_and_replica_files(server, transport, local, peer_root):
    peer = StoreLayout(peer_root, JOB)
    make_file(peer, "step-1", shard_name(0, 0), b"x" * 10)
    make_file(peer, "step-1", COMMITTED, b"")
    (peer.checkpoint_dir("step-1") / "holds").mkdir()  # a directory: not listed
    (peer.checkpoint_dir("step-1") / ".tmp-file").write_bytes(b"zz")  # hidden: not listed
    for node, size in (("node2", 5), ("node3", 7)):
        src = make_file(local, "step-1", f"{node}.bin", b"y" * size)
        transport.put_file(server.address, node, "step-1", shard_name(1, 0), src)
    src = make_file(local, "step-2", "z", b"z")
    transport.put_file(server.address, "node2", "step-2", "z", src)

    assert transport.stat(server.address, "step-1") == {
        "own": {shard_name(0, 0): 10, COMMITTED: 0},
        "committed": True,
        "replicas": {"node2": {shard_name(1, 0): 5}, "node3": {shard_name(1, 0): 7}},
        "upload": None,
        "replication": None,
        "listed": 0,
    }
    assert transport.stat(server.address, "step-2") == {
        "own": {},
        "committed": False,
        "replicas": {"node2": {"z": 1}},
        "upload": None,
        "replication": None,
        "listed": 0,
    }
    nothing = {
        "own": {},
        "committed": False,
        "replicas": {},
        "upload": None,
        "replication": None,
        "listed": 0,
    }
    assert transport.stat(server.address, "nothing") == nothing


def test_stat_says_the_upload_state_of_a_committed_copy_towards_the_named_target(
    server, transport, peer_root
):
    """A node that lacks a checkpoint asks the nodes holding it whether it is being persisted: each says
    its own upload state towards the requester's target, from its records (those of another target say
    nothing about this one); a copy not committed there says nothing."""
    peer, url = StoreLayout(peer_root, JOB), "s3://bucket/run"
    make_file(peer, "step-1", shard_name(0, 0), b"x")

    def upload(target: str = url) -> dict | None:
        return transport.stat(server.address, "step-1", target)["upload"]

    assert upload() is None  # not committed
    make_file(peer, "step-1", COMMITTED, b"")
    assert upload() == {"state": "not requested", "error": None}
    progress = Progress(peer, "step-1", url)
    progress.request("on demand")
    assert upload() == {"state": "queued", "error": None}
    assert upload("s3://bucket/other") == {"state": "not requested", "error": None}  # a hold per target
    progress.report(0, "retrying", "ConnectionError: down")  # by this (live) process
    assert upload() == {"state": "retrying", "error": "ConnectionError: down"}
    progress.report(1, "failed", "PermissionError: denied")
    assert upload() == {"state": "failed", "error": "PermissionError: denied"}
    progress.mark_persisted()
    assert upload() == {"state": "persisted", "error": None}
    assert upload("s3://bucket/other") == {"state": "not requested", "error": None}
    assert transport.stat(server.address, "step-1")["upload"] is None  # no target named


def test_stat_says_the_replication_state_of_a_committed_copy(peer_root, secret, transport):
    """A node that lacks a checkpoint asks the nodes holding it whether their files of it are replicated:
    each says what its store's ``replication_state`` says of a copy committed there, nothing of one that
    is not (its records would describe a copy no peer can read) or whose commit marker is corrupt (its
    files are still listed)."""
    peer = StoreLayout(peer_root, JOB)
    make_file(peer, "step-1", shard_name(0, 0), b"x")
    states = {"node1": "replicated", "node2": "retrying: ConnectionError: down"}
    with PeerServer(peer_root, JOB, secret, "127.0.0.1", replication_state=lambda c: states) as srv:
        assert transport.stat(srv.address, "step-1")["replication"] is None  # not committed
        catalog.commit(peer, "step-1", 1)
        assert transport.stat(srv.address, "step-1")["replication"] == states
        (peer.checkpoint_dir("step-1") / COMMITTED).write_bytes(b"")  # corrupt
        corrupt = transport.stat(srv.address, "step-1")
        assert corrupt["replication"] is None and corrupt["own"] == {shard_name(0, 0): 1, COMMITTED: 0}


def test_concurrent_puts_from_several_threads(server, secret, local, peer_root):
    transport = TcpTransport(JOB, secret, timeout_s=10)
    files = {f"f{i}": os.urandom(MiB + i * 1000) for i in range(8)}
    check_concurrent_puts(transport, server.address, local, peer_root, JOB, files)


def test_ping_and_several_requests_on_one_connection(server, secret):
    s = raw_connect(server.address)
    for _ in range(3):
        h = s.signed(secret, "ping")
        wire.send_header(s, h)
        reply = wire.recv_header(s)
        assert reply["ok"] is True and reply["re"] == h["nonce"]
    s.close()


# --- refusals ---------------------------------------------------------------------------------------


def test_corrupt_payload_refused_and_nothing_kept(server, secret, peer_root):
    data = os.urandom(3 * MiB)
    s = send_put(server, secret, len(data))
    assert wire.recv_header(s)["ok"] is True  # go-ahead
    checksum = wire.send_payload(s, memoryview(data))
    wire.send_trailer(s, checksum ^ 1)  # as if a bit flipped on the way
    reply = refused(s, "checksum")
    assert "arrived corrupt" in reply["error"]
    assert files_under(peer_root) == []  # not the file, not its temporary


def test_payload_cut_short_leaves_nothing(server, secret, peer_root, transport):
    s = send_put(server, secret, 2 * MiB)
    assert wire.recv_header(s)["ok"] is True
    s.sendall(b"x" * MiB)
    s.close()
    deadline = time.monotonic() + 5
    while files_under(peer_root) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert files_under(peer_root) == []
    transport.ping(server.address)  # still serving


def test_wrong_secret_refused_and_nothing_written(server, local, peer_root):
    src = make_file(local, "step-1", "f", b"x" * 100)
    with TcpTransport(JOB, new_secret(), timeout_s=10) as intruder:
        with pytest.raises(ReplicationError, match="replication secret") as e:
            intruder.put_file(server.address, "node0", "step-1", "f", src)
        assert e.value.code == "auth"
        with pytest.raises(ReplicationError) as e:
            intruder.stat(server.address, "step-1")
        assert e.value.code == "auth"
    s = send_put(server, new_secret(), 10)
    s.sendall(b"y" * 10)  # an intruder that does not wait for the go-ahead
    refused(s, "auth")
    assert files_under(peer_root) == []


def test_other_job_refused(server, secret):
    s = send_raw(server, secret, "ping", job="other-job")
    assert "other-job" in refused(s, "auth")["error"]


def test_missing_mac_refused(server, secret, peer_root):
    s = raw_connect(server.address)
    h = put_header(s, secret, 10)
    del h["mac"]
    wire.send_header(s, h)
    refused(s, "bad_request")
    s = raw_connect(server.address)
    wire.send_header(s, {**put_header(s, secret, 10), "mac": b""})
    refused(s, "auth")
    assert files_under(peer_root) == []


def test_replayed_request_refused(server, secret, peer_root):
    """A request sent again on its own connection is refused by its nonce, and on a new connection by the
    challenge it carries (the first connection's); neither stores anything."""
    data = b"r" * 1000
    s = raw_connect(server.address)
    h = put_header(s, secret, len(data))
    wire.send_header(s, h)
    assert wire.recv_header(s)["ok"] is True
    wire.send_trailer(s, wire.send_payload(s, memoryview(data)))
    assert wire.recv_header(s)["ok"] is True
    stored = StoreLayout(peer_root, JOB).replica_dir("node0", "step-1") / shard_name(0, 0)
    stored.unlink()
    wire.send_header(s, h)  # the captured request, sent again on its connection
    assert "replays" in refused(s, "auth")["error"]
    s = raw_connect(server.address)
    wire.send_header(s, h)  # and on a connection of its own
    assert "signed for another connection" in refused(s, "auth")["error"]
    assert files_under(peer_root) == []


def test_a_request_captured_before_its_server_restarted_is_refused_by_the_restarted_server(
    peer_root, local, secret, monkeypatch
):
    """A put and a commit abort captured on their way to a server, replayed to that server restarted on
    the same address with the same secret (its memory of nonces empty, the requests well inside the time
    window), are refused there: nothing is stored, nothing aborted. The restarted server still serves the
    job. (The capture is taken where the client signs: this machine cannot sniff the connection.)"""
    captured = []
    real_sign = tcp.sign_request
    monkeypatch.setattr(tcp, "sign_request", lambda *a: captured.append(real_sign(*a)) or captured[-1])
    data = os.urandom(1000)
    src = make_file(local, "step-1", shard_name(0, 0), data)
    commits = []
    with (
        PeerServer(peer_root, JOB, secret, "127.0.0.1", on_commit=lambda *a: commits.append(a) or 1) as old,
        TcpTransport(JOB, secret, timeout_s=10) as transport,
    ):
        address = old.address
        transport.put_file(address, "node0", "step-1", shard_name(0, 0), src)
        transport.commit(address, "step-1", "abort", {"seq": 1, "committed_at": 1.0, "nbytes": 0})
    put, abort = captured
    (StoreLayout(peer_root, JOB).replica_dir("node0", "step-1") / shard_name(0, 0)).unlink()
    commits.clear()
    trailer = wire.pack_frame({"op": "end", "checksum": checksum_bytes(data)})
    with PeerServer(
        peer_root, JOB, secret, "127.0.0.1", port=address[1], on_commit=lambda *a: commits.append(a) or 1
    ) as restarted:
        assert restarted.address == address
        for request, rest in ((put, data + trailer), (abort, b"")):
            s = raw_connect(restarted.address)
            s.sendall(wire.pack_frame(request) + rest)  # an intruder that does not wait for the go-ahead
            assert "signed for another connection" in refused(s, "auth")["error"]
        with TcpTransport(JOB, secret, timeout_s=10) as transport:
            transport.ping(restarted.address)
    assert files_under(peer_root / JOB / "replicas") == [] and commits == []


def test_a_request_captured_on_its_way_to_one_server_is_refused_by_another(
    server, transport, local, shm_dir, secret, monkeypatch
):
    """A put captured on its way to one node's server and replayed to another node's server of the same
    job (which has not seen its nonce) is refused there, and writes nothing."""
    captured = []
    real_sign = tcp.sign_request
    monkeypatch.setattr(tcp, "sign_request", lambda *a: captured.append(real_sign(*a)) or captured[-1])
    data = os.urandom(1000)
    src = make_file(local, "step-1", shard_name(0, 0), data)
    transport.put_file(server.address, "node0", "step-1", shard_name(0, 0), src)
    with PeerServer(shm_dir / "other", JOB, secret, "127.0.0.1") as other:
        s = raw_connect(other.address)
        wire.send_header(s, captured[0])
        s.sendall(data)  # an intruder that does not wait for the go-ahead
        error = refused(s, "auth")["error"]
        assert f"is for the replication server at 127.0.0.1:{server.address[1]}; " in error
        assert f"this is the one at 127.0.0.1:{other.address[1]}" in error
    assert files_under(shm_dir / "other") == []


def test_a_node_of_another_release_gets_a_version_error(server, secret, monkeypatch):
    """Nodes running releases with different wire versions get a version error, instead of an
    authentication error or a wait: the server refuses the previous release's hello by its version, the
    previous release reads this server's hello as another version, and a client of this release reading
    the previous release's refusal of its hello says the same."""
    s = raw_connect(server.address, hello=False)
    body = msgpack.packb(wire.CLIENT_HELLO)
    s.sendall(b"DCPM\x04\x00\x00\x00" + struct.pack(">I", len(body)) + body)  # framed as that release did
    error = refused(s, "bad_request")["error"]
    assert "wire version 4 is not supported (this build speaks version 5)" in error
    with socket.create_connection(server.address, timeout=10) as s, monkeypatch.context() as m:
        m.setattr(wire, "VERSION", 4)  # reading as that release does
        with pytest.raises(
            wire.ProtocolError, match=r"version 5 is not supported \(this build speaks version 4"
        ):
            wire.recv_header(s)

    old = socket.create_server(("127.0.0.1", 0))  # answers as the previous release's server does
    got = []

    def answer() -> None:
        conn, _ = old.accept()
        with conn:
            got.append(conn.recv(8))  # the prefix of the client's first frame, its hello
            reply = msgpack.packb({"ok": False, "code": "bad_request", "error": "wire version 5 ..."})
            conn.sendall(b"DCPM\x04\x00\x00\x00" + struct.pack(">I", len(reply)) + reply)

    t = threading.Thread(target=answer)
    t.start()
    try:
        with TcpTransport(JOB, secret) as tr, pytest.raises(ReplicationError) as e:
            tr.ping(old.getsockname())
        assert e.value.code == "protocol"
        assert "every node of a job must run the same dcp_memstore release" in str(e.value)
        assert got == [wire.PREFIX]
    finally:
        t.join(5)
        old.close()


def test_stale_timestamp_refused(server, secret, monkeypatch, peer_root):
    from dcp_memstore.replication import auth

    monkeypatch.setattr(auth, "_now_ms", lambda: time.time_ns() // 1_000_000 - 600_000)
    s = send_put(server, secret, 10)
    assert "off this node's clock" in refused(s, "auth")["error"]
    assert files_under(peer_root) == []


BAD_NAMES = ["..", "../x", "a/b", "/etc/passwd", "", "x" * 129, ".hidden", "a\\b", "a b", "é", "a..b"]


@pytest.mark.parametrize("field", ["source", "checkpoint", "file"])
@pytest.mark.parametrize("name", BAD_NAMES)
def test_path_tricks_refused_by_server(server, secret, shm_dir, field, name):
    before = files_under(shm_dir)
    s = send_put(server, secret, 10, **{field: name})
    refused(s, "bad_request")
    assert files_under(shm_dir) == before
    assert not (shm_dir / "peer" / JOB / "replicas").exists()


@pytest.mark.parametrize("name", ["..", "../../etc/passwd", "/etc/passwd", ""])
def test_path_tricks_refused_on_get_and_stat(server, secret, name):
    for field in ("checkpoint", "file", "source"):
        fields = {"checkpoint": "step-1", "file": "f", "source": "node0", "offset": 0, "length": None}
        refused(send_raw(server, secret, "get", **{**fields, field: name}), "bad_request")
    refused(send_raw(server, secret, "stat", checkpoint=name, persist_to=None), "bad_request")


def test_path_tricks_refused_by_client_before_sending(transport, server, local):
    src = make_file(local, "step-1", "f", b"x")
    for bad in ("..", "a/b", "/abs"):
        with pytest.raises(ValueError):
            transport.put_file(server.address, bad, "step-1", "f", src)
        with pytest.raises(ValueError):
            transport.put_file(server.address, "node0", bad, "f", src)
        with pytest.raises(ValueError):
            transport.get_file(server.address, "step-1", bad, local.job_dir / "x", layout=local)


def test_symlink_in_checkpoint_dir_not_followed(server, transport, peer_root, local):
    peer = StoreLayout(peer_root, JOB)
    peer.checkpoint_dir("step-1").mkdir(parents=True)
    outside = peer_root.parent / "secret.txt"
    outside.write_bytes(b"not for peers")
    (peer.checkpoint_dir("step-1") / "link").symlink_to(outside)
    make_file(peer, "step-1", COMMITTED, b"")
    with pytest.raises(ReplicationError) as e:
        transport.get_file(server.address, "step-1", "link", local.job_dir / "x", layout=local)
    assert e.value.code == "io_error"
    assert not (local.job_dir / "x").exists()


def test_get_missing_file_and_bad_range(server, transport, peer_root, local):
    make_file(StoreLayout(peer_root, JOB), "step-1", "f", b"0123456789")
    make_file(StoreLayout(peer_root, JOB), "step-1", COMMITTED, b"")
    with pytest.raises(ReplicationError, match="no file nope") as e:
        transport.get_file(server.address, "step-1", "nope", local.job_dir / "x", layout=local)
    assert e.value.code == "not_found"
    with pytest.raises(ReplicationError) as e:
        transport.get_file(
            server.address, "step-1", "f", local.job_dir / "x", source_node="node9", layout=local
        )
    assert e.value.code == "not_found"
    with pytest.raises(ReplicationError, match="outside") as e:
        transport.read_range(server.address, "step-1", "f", 8, memoryview(bytearray(3)))
    assert e.value.code == "bad_request"
    assert files_under(local.job_dir) == []


def test_oversized_header_refused(server):
    s = raw_connect(server.address)
    s.sendall(wire.PREFIX + struct.pack(">I", wire.MAX_HEADER_BYTES + 1))
    assert "header length" in refused(s, "bad_request")["error"]
    s = raw_connect(
        server.address
    )  # the whole oversized header sent anyway: still refused, the reply still arrives
    s.sendall(wire.PREFIX + struct.pack(">I", 100_000) + b"\x80" * 100_000)
    refused(s, "bad_request")


def test_oversized_payload_refused(peer_root, secret, local):
    with PeerServer(peer_root, JOB, secret, "127.0.0.1", max_file_bytes=MiB) as server:
        s = send_put(server, secret, MiB + 1)
        assert "max_file_bytes" in refused(s, "too_large")["error"]
        s = send_put(server, secret, 2**64 - 1)
        refused(s, "too_large")
        src = make_file(local, "step-1", "big", os.urandom(MiB + 1))
        with TcpTransport(JOB, secret) as t, pytest.raises(ReplicationError) as e:
            t.put_file(server.address, "node0", "step-1", "big", src)
        assert e.value.code == "too_large"
    assert files_under(peer_root) == []


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"XXXX\x01\x00\x00\x00\x00\x00\x00\x01\x80",
        b"DCPM\x09\x00\x00\x00\x00\x00\x00\x01\x80",
    ],
)
@pytest.mark.parametrize("hello", [True, False], ids=["as-request", "as-hello"])
def test_wrong_magic_or_version_refused(server, raw, hello):
    s = raw_connect(server.address, hello=hello)
    s.sendall(raw)
    refused(s, "bad_request")


def test_malformed_and_unknown_requests_refused(server, secret, peer_root):
    refused(send_raw(server, secret, "delete", checkpoint="step-1"), "bad_request")
    fields = {"source": "n", "checkpoint": "c", "file": "f", "size": True}
    refused(send_raw(server, secret, "put", **fields), "bad_request")
    s = raw_connect(server.address)
    wire.send_header(s, {"op": "ping"})
    refused(s, "bad_request")
    s = raw_connect(server.address)
    body = b"\x81\xa2op\xc7\x01\x05x"  # {"op": ExtType(5, b"x")}: never turned into an object
    s.sendall(wire.PREFIX + struct.pack(">I", len(body)) + body)
    refused(s, "bad_request")
    assert files_under(peer_root) == []


def test_the_longest_file_name_is_received_both_ways(server, transport, local, peer_root):
    """A received file's temporary name is longer than the file's (it names the receiving process): it
    still fits the file system's limit for the longest name a checkpoint file may have."""
    name = "f" * MAX_ID_LENGTH
    transport.put_file(server.address, "node0", "step-1", name, make_file(local, "step-1", name, b"x"))
    transport.get_file(server.address, "step-1", name, local.job_dir / name, "node0", layout=local)
    assert (local.job_dir / name).read_bytes() == b"x"


def test_full_tmpfs_gives_a_clean_error_and_the_server_keeps_serving(small_tmpfs, shm_dir, secret):
    local = StoreLayout(shm_dir / "local", JOB)
    six = make_file(local, "step-1", "six", os.urandom(6 * MiB))
    big = make_file(local, "step-1", "big", os.urandom(16 * MiB))
    small = make_file(local, "step-1", "small", os.urandom(100_000))
    with PeerServer(small_tmpfs, JOB, secret, "127.0.0.1") as server, TcpTransport(JOB, secret) as t:
        with pytest.raises(ReplicationError, match="not enough space") as e:
            t.put_file(server.address, "node0", "step-1", "big", big)
        assert e.value.code == "no_space"
        t.put_file(server.address, "node0", "step-1", "six", six)
        with pytest.raises(ReplicationError) as e:
            t.put_file(server.address, "node0", "step-2", "six", six)
        assert e.value.code == "no_space"
        t.ping(server.address)
        t.put_file(server.address, "node0", "step-2", "small", small)
        assert t.stat(server.address, "step-2")["replicas"] == {"node0": {"small": 100_000}}
        # And a full destination on the fetching side: an error before any byte lands, nothing left.
        with pytest.raises(InsufficientSpaceError):
            t.get_file(
                server.address,
                "step-1",
                "six",
                small_tmpfs / "fetched",
                source_node="node0",
                layout=StoreLayout(small_tmpfs, JOB),
            )
        assert sorted(files_under(small_tmpfs)) == [
            f"{JOB}/replicas/node0/step-1/six",
            f"{JOB}/replicas/node0/step-2/small",
        ]


# --- errors that name the peer, lifecycle -------------------------------------------------------------


def test_unreachable_peer_is_a_connection_error(transport, server):
    addr = server.address
    server.close()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{addr[1]}"):
        transport.stat(addr, "step-1")


def test_silent_peer_is_a_timeout(secret):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) and never answers
    try:
        with (
            TcpTransport(JOB, secret, timeout_s=0.3) as t,
            pytest.raises(TimeoutError, match="silent for 0.3 s"),
        ):
            t.stat(silent.getsockname(), "step-1")
    finally:
        silent.close()


def trickling_server(frame: bytes, gap_s: float) -> socket.socket:
    """A listening socket whose first connection gets ``frame`` one byte every ``gap_s`` seconds."""
    listener = socket.create_server(("127.0.0.1", 0))

    def drip() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            for b in frame:
                conn.sendall(bytes([b]))
                time.sleep(gap_s)

    threading.Thread(target=drip, daemon=True).start()
    return listener


def test_a_peer_trickling_its_hello_does_not_stretch_a_call_past_the_timeout(secret, local):
    """Anything answering at a peer's address, unauthenticated, sending a byte each 0.2 s (never silent for
    the 0.5 s timeout) must not hold the call (and the replicator thread) for the hello's length."""
    listener = trickling_server(wire.pack_frame(wire.server_hello(b"x" * 4000)), 0.2)
    src = make_file(local, "step-1", shard_name(0, 0), b"abc")
    start = time.monotonic()
    try:
        with TcpTransport(JOB, secret, timeout_s=0.5) as t, pytest.raises(TimeoutError):
            t.put_file(listener.getsockname(), "node0", "step-1", shard_name(0, 0), src)
    finally:
        listener.close()
    assert time.monotonic() - start < 5


def test_a_peer_trickling_a_payload_does_not_stretch_a_get_past_the_timeout(
    server, secret, local, peer_root, monkeypatch
):
    peer = StoreLayout(peer_root, JOB)
    make_file(peer, "step-1", shard_name(0, 0), os.urandom(MiB))
    catalog.commit(peer, "step-1", MiB)

    def trickle(sock: socket.socket, view: memoryview) -> int:
        for i in range(len(view)):
            sock.sendall(view[i : i + 1])
            time.sleep(0.2)
        return 0

    monkeypatch.setattr(wire, "send_payload", trickle)  # the server's side of a get
    start = time.monotonic()
    with TcpTransport(JOB, secret, timeout_s=0.5) as t, pytest.raises(TimeoutError):
        t.get_file(server.address, "step-1", shard_name(0, 0), local.job_dir / "a", layout=local)
    assert time.monotonic() - start < 5 and not (local.job_dir / "a").exists()


def test_a_late_reply_leaves_the_payload_after_it_the_whole_timeout(
    server, secret, local, peer_root, monkeypatch
):
    """The reply to a get comes late but in time (a busy node), then the payload at a steady pace (1 MiB
    each 0.5 s, against a 1 s timeout): each chunk has the whole timeout, not what the reply left of it."""
    peer = StoreLayout(peer_root, JOB)
    data = os.urandom(3 * MiB)
    make_file(peer, "step-1", shard_name(0, 0), data)
    catalog.commit(peer, "step-1", len(data))
    served = server_module.PeerServer._served_file

    def late(self, *args):
        time.sleep(0.8)
        return served(self, *args)

    def steady(sock: socket.socket, view: memoryview) -> int:
        for off in range(0, len(view), MiB):
            sock.sendall(view[off : off + MiB])
            time.sleep(0.5)
        return checksum_bytes(view)

    monkeypatch.setattr(server_module.PeerServer, "_served_file", late)
    monkeypatch.setattr(wire, "send_payload", steady)  # the server's side of a get
    with TcpTransport(JOB, secret, timeout_s=1.0) as t:
        t.get_file(server.address, "step-1", shard_name(0, 0), local.job_dir / "a", layout=local)
    assert (local.job_dir / "a").read_bytes() == data


def test_unsigned_ok_reply_is_not_trusted(secret):
    """A fake server (without the secret) cannot make a client believe its file was stored."""
    fake = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = fake.accept()
        wire.recv_header(conn)  # the client's hello
        wire.send_header(conn, wire.server_hello(b"c" * 16))
        wire.recv_header(conn)  # its request
        wire.send_header(conn, {"ok": True, "re": b"x" * 16, "mac": b"y" * 32})
        conn.recv(1)
        conn.close()

    t = threading.Thread(target=answer)
    t.start()
    try:
        with TcpTransport(JOB, secret) as tr, pytest.raises(ReplicationError) as e:
            tr.ping(fake.getsockname())
        assert e.value.code == "auth"
    finally:
        t.join(5)
        fake.close()


def test_go_ahead_replayed_as_the_stored_reply_is_not_trusted(
    server, transport, local, peer_root, monkeypatch
):
    """A man in the middle (a real TCP relay that lacks the secret) passes the put request and the
    server's signed go-ahead on, keeps the file's bytes from the server, and answers the sender with the
    go-ahead again. The sender must not count the file as stored: nothing was kept.

    The sender names the server as the destination of its request, as it would through a man in the
    middle that takes over the server's address on the network (mocked: this machine cannot route the
    server's address to the relay), so the server accepts the relayed request."""
    relay = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(tcp, "destination", lambda _: destination(server.address))
    relayed = []

    def intercept() -> None:
        client, _ = relay.accept()
        with client, socket.create_connection(server.address, timeout=10) as upstream:
            wire.send_header(upstream, wire.recv_header(client))  # the client's hello
            wire.send_header(client, wire.recv_header(upstream))  # the server's, with its challenge
            wire.send_header(upstream, wire.recv_header(client))  # the signed put request
            go_ahead = wire.recv_header(upstream)
            relayed.append(go_ahead)
            wire.send_header(client, go_ahead)
            wire.recv_payload(client, memoryview(bytearray(MiB)))  # the bytes never reach the server
            wire.recv_trailer(client)
            wire.send_header(client, go_ahead)

    t = threading.Thread(target=intercept)
    t.start()
    try:
        src = make_file(local, "step-1", shard_name(0, 0), os.urandom(MiB))
        with pytest.raises(ReplicationError, match="not reply 1 to this request") as e:
            transport.put_file(relay.getsockname(), "node0", "step-1", shard_name(0, 0), src)
        assert e.value.code == "auth"
    finally:
        t.join(10)
        relay.close()
    assert relayed[0]["ok"] is True  # the server accepted the relayed request
    assert not (StoreLayout(peer_root, JOB).replica_dir("node0", "step-1") / shard_name(0, 0)).exists()


def test_a_newcomer_is_refused_as_busy_only_when_every_slot_is_authenticated(peer_root, secret):
    with PeerServer(peer_root, JOB, secret, "127.0.0.1", max_connections=1) as server:
        held = raw_connect(server.address)
        wire.send_header(held, held.signed(secret, "ping"))
        assert wire.recv_header(held)["ok"] is True  # authenticated, and kept open for more requests
        s = socket.create_connection(server.address, timeout=10)
        reply = wire.recv_header(s)  # in place of the server's hello
        assert reply["code"] == "busy"
        s.close()
        held.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with TcpTransport(JOB, secret) as t:
                    t.ping(server.address)
                break
            except (ReplicationError, ConnectionError):
                time.sleep(0.05)
        else:
            pytest.fail("the server did not free the connection slot")


NO_LIMIT_S = 1e8  # a replication timeout that says "no limit"


def idle_connections(server: PeerServer, sources: list[str], n: int) -> list[socket.socket]:
    """``n`` connections to ``server`` that never send a byte, from the ``sources`` addresses in turn."""
    return [
        socket.create_connection(server.address, timeout=10, source_address=(sources[i % len(sources)], 0))
        for i in range(n)
    ]


def closed_by_server(s: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``s`` (which sent nothing, or its hello) within ``within_s`` seconds
    (once it sent its hello)."""
    s.settimeout(within_s)
    try:
        while s.recv(1 << 16):  # the server's hello, unless read already
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "sources", [["127.0.0.1"], [f"127.0.0.{i}" for i in range(2, 10)]], ids=["one-host", "eight-hosts"]
)
def test_idle_connections_filling_every_slot_do_not_keep_a_peer_out(peer_root, secret, local, sources):
    """Whoever can reach the port opens as many connections as the server has slots and sends nothing
    (from the peer's own host, or from several others): the job's put and stat still go through at once,
    long before those connections' time to authenticate is up."""
    with (
        PeerServer(peer_root, JOB, secret, "127.0.0.1", io_timeout_s=NO_LIMIT_S) as server,
        TcpTransport(JOB, secret, timeout_s=10) as transport,
    ):
        idle = idle_connections(server, sources, 64)
        start = time.monotonic()
        src = make_file(local, "step-1", shard_name(0, 0), b"p" * 1000)
        transport.put_file(server.address, "node0", "step-1", shard_name(0, 0), src)
        assert transport.stat(server.address, "step-1")["replicas"] == {"node0": {shard_name(0, 0): 1000}}
        assert time.monotonic() - start < server.auth_timeout_s
        for s in idle:
            s.close()


def test_one_host_keeps_at_most_its_share_of_unauthenticated_connections(peer_root, secret):
    """A host's connections beyond MAX_UNAUTHENTICATED_PER_SOURCE that have not authenticated push out
    its own oldest, not other hosts' connections."""
    with PeerServer(peer_root, JOB, secret, "127.0.0.1", io_timeout_s=NO_LIMIT_S) as server:
        other = idle_connections(server, ["127.0.0.3"], 1)[0]
        share = server_module.MAX_UNAUTHENTICATED_PER_SOURCE
        flood = idle_connections(server, ["127.0.0.2"], share + 4)
        assert all(closed_by_server(s, 5) for s in flood[:4])
        assert not any(closed_by_server(s, 0.01) for s in flood[4:] + [other])
        for s in flood + [other]:
            s.close()


def test_a_connection_must_authenticate_within_auth_timeout_s(peer_root, secret):
    """A connection that sends nothing, or trickles its request in slower than the deadline allows, is
    closed after auth_timeout_s even where io_timeout_s says no limit; an authenticated one may then stay
    silent longer between requests."""
    with PeerServer(
        peer_root, JOB, secret, "127.0.0.1", io_timeout_s=NO_LIMIT_S, auth_timeout_s=0.5
    ) as server:
        silent = raw_connect(server.address)
        trickle = raw_connect(server.address)
        authenticated = raw_connect(server.address)
        wire.send_header(authenticated, authenticated.signed(secret, "ping"))
        assert wire.recv_header(authenticated)["ok"] is True
        start = time.monotonic()
        frame = wire.pack_frame(trickle.signed(secret, "ping"))
        with contextlib.suppress(OSError):  # the server closes it before the frame is complete
            for i in range(len(frame)):
                trickle.sendall(frame[i : i + 1])
                time.sleep(0.05)
        assert closed_by_server(trickle, 5)
        assert closed_by_server(silent, 5)
        assert time.monotonic() - start < 5
        time.sleep(0.5)
        wire.send_header(authenticated, authenticated.signed(secret, "ping"))
        assert wire.recv_header(authenticated)["ok"] is True
        for s in (silent, trickle, authenticated):
            s.close()


def test_close_ends_transfers_in_flight_and_leaves_nothing(peer_root, secret):
    server = PeerServer(peer_root, JOB, secret, "127.0.0.1")
    s = send_put(server, secret, 4 * MiB)
    assert wire.recv_header(s)["ok"] is True
    s.sendall(b"x" * MiB)  # and then stalls
    time.sleep(0.1)
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 5
    assert files_under(peer_root) == []
    assert all(t.name != "dcp_memstore-peer-conn" for t in threading.enumerate())
    s.close()


def test_stale_temporaries_of_dead_processes_removed_at_start(peer_root, secret):
    peer = StoreLayout(peer_root, JOB)
    d = peer.replica_dir("node0", "step-1")
    d.mkdir(parents=True)
    dead = part_name("f", dead_token(peer), "0123abcd")
    live = part_name("g", liveness.own_token(peer), "0123abcd")  # a live transfer of this process
    for name in (dead, live, "kept"):
        (d / name).write_bytes(b"x")
    with PeerServer(peer_root, JOB, secret, "127.0.0.1"):
        assert sorted(os.listdir(d)) == [live, "kept"]


# A reader fetching a file of another node into this node's fetched/<checkpoint>/: it holds the temporary
# file that the fetch (``TcpTransport.get_file``) fills, prints its name, and waits to be killed.
_FETCHING = """
import sys
from pathlib import Path
from dcp_memstore.replication.transport import IncomingFile
from dcp_memstore.store.layout import StoreLayout, shard_name
layout = StoreLayout(Path(sys.argv[1]), sys.argv[2])
layout.fetched_dir("step-1").mkdir(parents=True)
incoming = IncomingFile(layout.fetched_dir("step-1") / shard_name(1, 0), 1 << 20, layout)
print(incoming.tmp.name, flush=True)
sys.stdin.read()
"""


def test_fetch_temporaries_of_a_killed_reader_removed_at_start(peer_root, secret):
    """A reader SIGKILLed while it fetched a file from another node's memory left the fetch's temporary
    file (a whole file's memory) in fetched/<checkpoint>/; it stayed until the checkpoint went. A server of
    the job starting here removes it, as it removes dead transfers' replica temporaries; a live fetch's
    temporary is kept."""
    layout = StoreLayout(peer_root, JOB)
    reader = subprocess.Popen(
        [sys.executable, "-c", _FETCHING, str(peer_root), JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    dead = reader.stdout.readline().decode().strip()
    reader.kill()
    assert reader.wait(timeout=30) == -signal.SIGKILL
    reader.stdout.close()
    reader.stdin.close()
    fetched = layout.fetched_dir("step-1")
    live = part_name(shard_name(2, 0), liveness.own_token(layout), "0123abcd")  # a fetch of this process
    (fetched / live).write_bytes(b"x")
    assert sorted(os.listdir(fetched)) == sorted([dead, live])
    with PeerServer(peer_root, JOB, secret, "127.0.0.1"):
        assert os.listdir(fetched) == [live]


# A peer server of the job in a PID namespace of its own (a container sharing this node's tmpfs): prints
# its pid there and its port, then serves until killed.
_SERVER_ELSEWHERE = """
import os, sys, time
from dcp_memstore.replication import PeerServer
server = PeerServer(sys.argv[1], "job", bytes.fromhex(sys.argv[2]), "127.0.0.1", io_timeout_s=120)
print(os.getpid(), server.address[1], flush=True)
time.sleep(600)
"""
needs_unshare = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root"
)


@contextlib.contextmanager
def server_elsewhere(root: Path, secret: bytes, pid: int) -> Iterator[tuple[subprocess.Popen, int, int]]:
    """Run a ``PeerServer`` on ``root`` in a new PID namespace, as pid ``pid`` there; yields the namespace
    (the ``unshare`` process: it exits with the server's status), the server's pid here and its port."""
    box = subprocess.Popen(
        # a shell as the namespace's pid 1 (which ignores its own SIGKILL) makes the server's pid the
        # next after the one it writes, and reports how the server ended
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c"]
        + ['echo "$1" > /proc/sys/kernel/ns_last_pid; shift; "$@"; exit $?', "sh", str(pid - 1)]
        + [sys.executable, "-c", _SERVER_ELSEWHERE, str(root), secret.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        there, port = map(int, box.stdout.readline().split())
        assert there == pid, f"the server is pid {there} in its namespace, not {pid}"
        (here,) = [p.pid for p in psutil.Process(box.pid).children(recursive=True) if p.name() != "sh"]
        yield box, here, port
    finally:
        box.kill()  # and, by --kill-child, the namespace
        box.wait()
        box.stdout.close()


def _put_half(address: tuple[str, int], secret: bytes, data: bytes) -> RawClient:
    """Start a put of ``data`` as node0's replica of ``step-1``'s first shard and send its first half; the
    connection, to finish it on."""
    s = raw_connect(address)
    wire.send_header(s, put_header(s, secret, len(data)))
    assert wire.recv_header(s)["ok"] is True  # the temporary file is made
    s.sendall(data[: len(data) // 2])
    return s


@needs_unshare
def test_a_transfer_killed_in_another_container_leaves_a_temporary_that_is_removed(peer_root, secret):
    """A server killed mid-transfer in another PID namespace left a temporary file judged by its pid there:
    that pid is a live process here (this test's own pid), so the file, and its memory, were kept until the
    checkpoint's replicas went. Its name holds the server's lock token now, released by its death."""
    d = StoreLayout(peer_root, JOB).replica_dir("node0", "step-1")
    with (
        server_elsewhere(peer_root, secret, os.getpid()) as (box, writer, port),
        _put_half(("127.0.0.1", port), secret, os.urandom(2 * MiB)),
    ):
        os.kill(writer, signal.SIGKILL)
        assert box.wait(timeout=30) == 128 + signal.SIGKILL
    (left,) = os.listdir(d)
    assert ".part-" in left
    with PeerServer(peer_root, JOB, secret, "127.0.0.1"):  # a server of the job starts here
        assert os.listdir(d) == []


@needs_unshare
def test_a_transfer_running_in_another_container_keeps_its_temporary(peer_root, secret):
    """A server starting here removes the temporaries of dead transfers only: one of a server in another
    PID namespace, whose pid there is no process here, was taken for dead and removed, and that transfer
    failed. It is judged by its lock token now, and completes."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    free = next(p for p in range(pid_max - 1, 300, -1) if not psutil.pid_exists(p))
    d = StoreLayout(peer_root, JOB).replica_dir("node0", "step-1")
    data = os.urandom(2 * MiB)
    with (
        server_elsewhere(peer_root, secret, free) as (_, _, port),
        _put_half(("127.0.0.1", port), secret, data) as s,
    ):
        (part,) = os.listdir(d)
        with PeerServer(peer_root, JOB, secret, "127.0.0.1"):  # a server of the job starts here
            assert os.listdir(d) == [part]
        s.sendall(data[len(data) // 2 :])
        wire.send_trailer(s, checksum_bytes(data))
        reply = wire.recv_header(s)
    assert reply["ok"] is True, reply
    assert os.listdir(d) == [shard_name(0, 0)] and (d / shard_name(0, 0)).read_bytes() == data


def test_bind_address_and_layout_argument(peer_root, secret):
    with PeerServer(StoreLayout(peer_root, JOB), JOB, secret, "localhost") as server:
        assert server.address[0] in ("127.0.0.1", "::1")
        assert server.address[1] > 0
    with pytest.raises(ValueError, match="job"):
        PeerServer(StoreLayout(peer_root, "other"), JOB, secret, "127.0.0.1")
    with pytest.raises(OSError, match="cannot resolve"):
        PeerServer(peer_root, JOB, secret, "no-such-host.invalid")


def test_commit_phases_hand_manifest_and_record_to_the_store(peer_root, secret, transport):
    got = []

    def on_commit(*args):
        got.append(args)
        return 42

    with PeerServer(peer_root, JOB, secret, "127.0.0.1", on_commit=on_commit) as srv:
        manifest = os.urandom(3 * MiB + 5)  # more than one payload piece
        record = {"seq": 7, "committed_at": 1234.5, "nbytes": len(manifest)}
        assert transport.commit(srv.address, "step-7", "prepare", record, manifest) == 42
        assert transport.commit(srv.address, "step-7", "commit", record) == 42
        assert transport.commit(srv.address, "step-7", "abort", record) == 42
        with pytest.raises(ReplicationError, match="unknown commit phase") as e:
            transport.commit(srv.address, "step-7", "publish", record)
        assert e.value.code == "bad_request"
    assert got == [
        ("step-7", "prepare", record, manifest),
        ("step-7", "commit", record, b""),
        ("step-7", "abort", record, b""),
    ]


def test_commit_manifest_swapped_in_transit_is_refused(peer_root, secret, transport, monkeypatch):
    """The manifest's SHA-256 is in the signed header: different bytes with a valid transfer checksum
    (what an attacker on the path without the secret could send) are refused."""
    got = []
    real_send = wire.send_payload
    monkeypatch.setattr(
        wire, "send_payload", lambda sock, view: real_send(sock, memoryview(b"X" * len(view)))
    )
    srv = PeerServer(peer_root, JOB, secret, "127.0.0.1", on_commit=lambda *a: got.append(a) or 1)
    with srv, pytest.raises(ReplicationError, match="corrupt or altered") as e:
        transport.commit(srv.address, "s", "prepare", {"seq": 1, "committed_at": 1.0, "nbytes": 0}, b"m" * 9)
    assert e.value.code == "checksum" and got == []


def test_commit_refused_without_a_store_or_when_the_store_fails(server, peer_root, secret, transport):
    rec = {"seq": 1, "committed_at": 1.0, "nbytes": 0}
    with pytest.raises(ReplicationError, match="does not take commits") as e:
        transport.commit(server.address, "step-1", "prepare", rec, b"m")
    assert e.value.code == "bad_request"

    def failing(*_):
        raise OSError("disk on fire")

    with PeerServer(peer_root, JOB, secret, "127.0.0.1", on_commit=failing) as srv:
        with pytest.raises(ReplicationError, match="disk on fire") as e:
            transport.commit(srv.address, "step-1", "prepare", rec, b"m")
        assert e.value.code == "io_error"
        with pytest.raises(ValueError, match="checkpoint id"):  # refused before anything is sent
            transport.commit(srv.address, "../x", "prepare", rec, b"m")


def test_a_replication_report_reaches_the_store_and_is_refused_without_one(
    server, peer_root, secret, transport
):
    with pytest.raises(ReplicationError, match="takes no replication reports") as e:
        transport.replicated(server.address, "step-1", "node1", 1.5)
    assert e.value.code == "bad_request"
    got = []
    with PeerServer(peer_root, JOB, secret, "127.0.0.1", on_replicated=lambda *a: got.append(a)) as srv:
        transport.replicated(srv.address, "step-1", "node1", 1.5)
        with pytest.raises(ValueError, match="node"):  # refused before anything is sent
            transport.replicated(srv.address, "step-1", "../node1", 1.5)
    assert got == [("step-1", "node1", 1.5)]


@contextlib.contextmanager
def one_rank_service(layout: StoreLayout, pg_dir: Path, timeout_s: float, io_timeout_s: float) -> Iterator:
    """The replication service of a job of one rank (a process group of its own), closed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{pg_dir / 'pg'}", rank=0, world_size=1)
    service = None
    try:
        service = ReplicationService(
            layout,
            NodeInfo(node_rank=0, nnodes=1, local_rank=0, local_world_size=1, rank=0, world_size=1),
            k=0,
            bind_host="127.0.0.1",
            secret=None,
            transport="tcp",
            on_commit=lambda *a: None,
            on_replicated=lambda *a: None,
            replication_state=lambda checkpoint: None,
            timeout_s=timeout_s,
            io_timeout_s=io_timeout_s,
            keep=2,
        )
        yield service
    finally:
        if service is not None:
            service.close()
        dist.destroy_process_group()


def test_the_servers_of_a_job_give_up_on_a_silent_peer_after_replication_timeout_s(local, tmp_path):
    """replication_timeout_s bounds how long a silent peer is waited for on both ends: a connection that
    sends nothing (a peer whose link went down mid-transfer) is closed after it, not after a fixed minute,
    and its partial file and connection slot freed."""
    with (
        one_rank_service(local, tmp_path, timeout_s=10, io_timeout_s=1.0) as service,
        socket.create_connection(service.server.address, timeout=15) as silent,
    ):
        t0 = time.monotonic()
        assert closed_by_server(silent, 10)
        assert time.monotonic() - t0 < 10


def test_a_store_whose_timeouts_say_no_limit_replicates(local, tmp_path, shm_dir):
    """``stage_timeout_s=math.inf`` and ``replication_timeout_s=math.inf`` (no limit) reach the replication
    service as the store passes them: the wait for the ranks' announcements, the server's socket timeouts
    and a transfer work (sockets, locks and torch.distributed store waits refuse infinity itself)."""
    no_limit = {"stage_timeout_s": math.inf, "replication_timeout_s": math.inf}
    store = MemStore(root=shm_dir / "opts", job_id="j", **no_limit)
    try:
        with one_rank_service(local, tmp_path, store.stage_timeout_s, store.replication_timeout_s) as service:
            assert service.peers().server(0) == service.server.address
            sender = StoreLayout(shm_dir / "sender", JOB)
            sender.ensure()
            with TcpTransport(JOB, service.secret, store.replication_timeout_s) as transport:
                check_put_then_get(transport, service.server.address, sender, local.root, os.urandom(1 << 20))
    finally:
        store.close()
