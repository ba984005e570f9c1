"""RDMA transfers end to end, up to the device boundary: a real ``PeerServer`` with an RDMA endpoint and a
real ``RdmaTransport`` on 127.0.0.1 and real tmpfs files, with a FAKE pyverbs (``fake_pyverbs``: a mock
standing in for RDMA hardware this machine does not have) in place of the real one.

The fake executes each RDMA write/read as a memmove between the registered ranges after checking keys,
bounds, access rights, protection domains and the queue pairs' connection, so these tests verify our
protocol and control flow (headers, registration order and rights, chunking, completion handling, cleanup,
fallback, authentication before registration); they do not verify pyverbs, an adapter or a fabric.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcp_memstore.replication import PeerServer, ReplicationError, TcpTransport, tcp, wire
from dcp_memstore.replication.auth import new_secret
from dcp_memstore.replication.rdma import RdmaEndpoint, RdmaTransport
from dcp_memstore.replication.rdma_verbs import SEND_WINDOW
from dcp_memstore.store.layout import COMMITTED, StoreLayout, shard_name
from tests.replication.fake_pyverbs import E, Fabric, install
from tests.replication.transfer_helpers import (
    JOB,
    RawClient,
    check_concurrent_puts,
    check_put_then_get,
    files_under,
    make_file,
    raw_connect,
)

KiB, MiB = 1 << 10, 1 << 20
PIECE = 256 * KiB  # the fake port's max message size: files of a few MiB take many pieces
RDMA_LOGGER = "dcp_memstore.replication.rdma"


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fabric]:
    """The FAKE pyverbs (a mock, not hardware), checked after the test for misuse the real stack punishes."""
    f = install(monkeypatch, Fabric(max_msg_sz=PIECE))
    yield f
    assert f.bugs == []


@pytest.fixture
def server(fabric, peer_root, secret) -> Iterator[PeerServer]:
    srv = PeerServer(peer_root, JOB, secret, "127.0.0.1", io_timeout_s=10, rdma=RdmaEndpoint.open())
    yield srv
    srv.close()


@pytest.fixture
def transport(fabric, secret) -> Iterator[RdmaTransport]:
    t = RdmaTransport(JOB, secret, timeout_s=10)
    yield t
    t.close()


@pytest.fixture
def released(fabric, server, transport) -> Iterator[None]:
    """After the test: every transfer's verbs objects are gone, and closing both ends closes the device."""
    yield
    wait_for(lambda: not fabric.live_of(fabric.classes.QP) and not fabric.live_of(fabric.classes.MR))
    assert not fabric.live_of(fabric.classes.CQ)
    server.close()
    transport.close()
    assert fabric.live == set() and fabric.bugs == []


@pytest.fixture
def rdma_proven(fabric, server, transport, local, peer_root) -> None:
    """One transfer to the server completed by RDMA first: error completions with this peer are errors
    from then on (with a peer RDMA never reached, the transport goes over TCP instead)."""
    src = make_file(local, "warm", "w", b"w" * 10)
    transport.put_file(server.address, "node0", "warm", "w", src)
    assert transport.tcp_peers() == {}
    shutil.rmtree(StoreLayout(peer_root, JOB).replicas_dir)


def fetched(local: StoreLayout) -> list[str]:
    """Files fetched into the job directory (where the tests fetch to), hidden temporaries included."""
    return sorted(e.name for e in os.scandir(local.job_dir) if e.is_file())


def no_replicas(peer_root: Path) -> bool:
    """No replica file, not even a temporary one, on the server."""
    return files_under(peer_root / JOB / "replicas") == []


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        time.sleep(0.01)


def ops(fabric: Fabric, kind: str) -> list[int]:
    return [n for op, n in fabric.ops if op == kind]


def tamper_replies(monkeypatch: pytest.MonkeyPatch, op: str, change) -> None:
    """Alter the (verified) reply to ``op`` requests before the transport uses it, as a buggy or hostile
    peer holding the secret could."""
    real = tcp._Call.request

    def request(self, req_op: str, fields: dict):
        nonce, reply = real(self, req_op, fields)
        if req_op == op:
            reply = change(dict(reply))
        return nonce, reply

    monkeypatch.setattr(tcp._Call, "request", request)


# --- round trips ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 17 * PIECE + 3], ids=["empty", "1-byte", "18-pieces"])
def test_put_then_get_round_trip_bit_exact(fabric, server, transport, local, peer_root, released, size):
    check_put_then_get(transport, server.address, local, peer_root, os.urandom(size))
    pieces = -(-size // PIECE)
    assert ops(fabric, "RDMA_WRITE") == [PIECE] * (pieces - 1) + [size - PIECE * (pieces - 1)] * (pieces > 0)
    assert ops(fabric, "RDMA_READ") == ops(fabric, "RDMA_WRITE")  # the bytes moved by RDMA, not TCP
    assert transport.tcp_peers() == {}
    # What the server exposed: only the transfer's file, with only the right the transfer needs.
    remote = [
        r
        for r in fabric.registrations
        if r["access"] & (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ)
    ]
    assert [(r["length"], r["access"]) for r in remote] == [
        (size, E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE),
        (size, E.IBV_ACCESS_REMOTE_READ),
    ] * (size > 0)
    local_regs = [r["access"] for r in fabric.registrations if r not in remote]
    assert local_regs == [0, E.IBV_ACCESS_LOCAL_WRITE] * (size > 0)  # sender: local read only


def test_large_file_in_64_mib_pieces(monkeypatch, shm_dir, secret, local):
    fabric = install(monkeypatch, Fabric())  # a port allowing 2 GiB messages: pieces of 64 MiB
    data = os.urandom(129 * MiB + 7)
    src = make_file(local, "s", "big", data)
    peer_root = shm_dir / "peer"
    with (
        PeerServer(peer_root, JOB, secret, "127.0.0.1", rdma=RdmaEndpoint.open()) as srv,
        RdmaTransport(JOB, secret) as t,
    ):
        t.put_file(srv.address, "node0", "s", "big", src)
        assert ops(fabric, "RDMA_WRITE") == [64 * MiB, 64 * MiB, MiB + 7]
        assert (StoreLayout(peer_root, JOB).replica_dir("node0", "s") / "big").read_bytes() == data
    assert fabric.bugs == []


def test_get_own_committed_copy_and_refusals_before_registration(fabric, server, transport, peer_root, local):
    peer = StoreLayout(peer_root, JOB)
    data = os.urandom(3 * PIECE + 5)
    make_file(peer, "step-7", shard_name(3, 1), data)
    with pytest.raises(ReplicationError, match="not committed") as e:
        transport.get_file(server.address, "step-7", shard_name(3, 1), local.job_dir / "a", layout=local)
    assert e.value.code == "not_found" and fabric.registrations == []
    with pytest.raises(ReplicationError, match="no file nope") as e:
        transport.get_file(
            server.address, "step-7", "nope", local.job_dir / "a", source_node="node0", layout=local
        )
    assert e.value.code == "not_found" and fabric.registrations == []
    make_file(peer, "step-7", COMMITTED, b"")
    transport.get_file(server.address, "step-7", shard_name(3, 1), local.job_dir / "a", layout=local)
    assert (local.job_dir / "a").read_bytes() == data
    assert fetched(local) == ["a"]


def test_put_replaces_an_older_replica_and_window_is_respected(fabric, server, transport, local, peer_root):
    fabric.max_per_poll = 1  # completions trickle in: the sender must keep at most SEND_WINDOW in flight
    src = make_file(local, "s", "f", os.urandom(2 * SEND_WINDOW * PIECE + 1))
    transport.put_file(server.address, "node0", "s", "f", src)
    new = os.urandom(5 * PIECE)
    src.write_bytes(new)
    transport.put_file(server.address, "node0", "s", "f", src)
    assert (StoreLayout(peer_root, JOB).replica_dir("node0", "s") / "f").read_bytes() == new


def test_concurrent_puts_from_several_threads(fabric, server, transport, local, peer_root, released):
    files = {f"f{i}": os.urandom(3 * PIECE + i * 1000) for i in range(6)}
    check_concurrent_puts(transport, server.address, local, peer_root, JOB, files)


def test_stat_and_ping_go_over_tcp(fabric, server, transport, local):
    src = make_file(local, "step-1", "f", b"abc")
    transport.put_file(server.address, "node0", "step-1", "f", src)
    assert transport.stat(server.address, "step-1")["replicas"] == {"node0": {"f": 3}}
    assert transport.ping(server.address) > 0


# --- failures -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["IBV_WC_RETRY_EXC_ERR", "IBV_WC_REM_ACCESS_ERR"])
def test_completion_error_on_put_leaves_no_file(
    fabric, server, transport, local, peer_root, released, rdma_proven, status
):
    fabric.fail_status, fabric.fail_after = getattr(E, status), 3 + len(fabric.ops)  # after the warm-up
    src = make_file(local, "step-1", "f", os.urandom(6 * PIECE))
    with pytest.raises(ReplicationError, match=rf"127\.0\.0\.1:{server.address[1]}.*{status}") as e:
        transport.put_file(server.address, "node0", "step-1", "f", src)
    assert e.value.code == "rdma" and "piece 4 of 6" in str(e.value)
    wait_for(lambda: files_under(peer_root) == [])  # the server dropped the temporary file
    fabric.fail_status = None
    transport.put_file(server.address, "node0", "step-1", "f", src)  # the server still serves
    assert (StoreLayout(peer_root, JOB).replica_dir("node0", "step-1") / "f").read_bytes() == src.read_bytes()


def test_completion_error_on_get_leaves_no_file(
    fabric, server, transport, local, peer_root, released, rdma_proven
):
    make_file(StoreLayout(peer_root, JOB), "step-1", "f", os.urandom(4 * PIECE))
    make_file(StoreLayout(peer_root, JOB), "step-1", COMMITTED, b"")
    fabric.fail_status = E.IBV_WC_RETRY_EXC_ERR
    with pytest.raises(ReplicationError, match="RDMA read failed.*IBV_WC_RETRY_EXC_ERR") as e:
        transport.get_file(server.address, "step-1", "f", local.job_dir / "x", layout=local)
    assert e.value.code == "rdma"
    assert fetched(local) == []


@pytest.mark.parametrize("op", ["put", "get"])
def test_peer_rdma_never_reaches_goes_over_tcp(fabric, server, transport, local, peer_root, op):
    """Both ends have RDMA but the first transfer ends in an error completion (the fabric does not reach
    the peer, while TCP does): it is redone over TCP, and that peer is served over TCP from then on."""
    fabric.fail_status, fabric.fail_after = E.IBV_WC_RETRY_EXC_ERR, 0
    data = os.urandom(3 * PIECE)
    make_file(StoreLayout(peer_root, JOB), "s", "f", data)
    make_file(StoreLayout(peer_root, JOB), "s", COMMITTED, b"")
    src = make_file(local, "s", "g", data)
    if op == "put":
        transport.put_file(server.address, "node0", "s", "g", src)
        assert (StoreLayout(peer_root, JOB).replica_dir("node0", "s") / "g").read_bytes() == data
    else:
        transport.get_file(server.address, "s", "f", local.job_dir / "x", layout=local)
        assert (local.job_dir / "x").read_bytes() == data
    assert "RDMA does not reach this peer" in transport.tcp_peers()[server.address]
    ops = len(fabric.ops)
    transport.put_file(server.address, "node0", "s", "again", src)  # TCP now: no RDMA work posted
    assert len(fabric.ops) == ops


@pytest.mark.parametrize("op", ["put", "get"])
def test_never_completing_work_times_out(fabric, secret, server, local, peer_root, op):
    fabric.hang = True
    make_file(StoreLayout(peer_root, JOB), "s", "f", b"x" * PIECE)
    make_file(StoreLayout(peer_root, JOB), "s", COMMITTED, b"")
    src = make_file(local, "s", "f", b"y" * PIECE)
    start = time.monotonic()
    with (
        RdmaTransport(JOB, secret, timeout_s=0.3) as t,
        pytest.raises(TimeoutError, match="no progress for 0.3 s"),
    ):
        if op == "put":
            t.put_file(server.address, "node0", "s", "f", src)
        else:
            t.get_file(server.address, "s", "f", local.job_dir / "x", layout=local)
    assert time.monotonic() - start < 5
    assert fetched(local) == []
    wait_for(lambda: not fabric.live_of(fabric.classes.MR))  # both sides deregistered
    wait_for(lambda: no_replicas(peer_root))


@pytest.mark.parametrize("op", ["rdma_put", "rdma_get"])
@pytest.mark.parametrize("change", ["rkey", "addr", "end"], ids=["wrong-rkey", "addr+1", "past-the-end"])
def test_wrong_rkey_or_range_refused_by_the_adapter(
    fabric, monkeypatch, server, transport, local, peer_root, released, rdma_proven, op, change
):
    ops_before = len(fabric.ops)
    size = 4 * PIECE
    alter = {
        "rkey": lambda r: {**r, "rkey": r["rkey"] ^ 0x40},
        "addr": lambda r: {**r, "addr": r["addr"] + 1},
        "end": lambda r: {**r, "addr": r["addr"] + PIECE},
    }[change]
    tamper_replies(monkeypatch, op, alter)
    make_file(StoreLayout(peer_root, JOB), "s", "f", os.urandom(size))
    make_file(StoreLayout(peer_root, JOB), "s", COMMITTED, b"")
    src = make_file(local, "s", "g", os.urandom(size))
    with pytest.raises(ReplicationError, match="IBV_WC_REM_ACCESS_ERR") as e:
        if op == "rdma_put":
            transport.put_file(server.address, "node0", "s", "g", src)
        else:
            transport.get_file(server.address, "s", "f", local.job_dir / "x", layout=local)
    assert e.value.code == "rdma"
    assert fetched(local) == []
    wait_for(lambda: no_replicas(peer_root))
    assert len(fabric.ops) - ops_before < 4  # the piece out of range (or all, with a wrong rkey) never moved


def test_corrupt_trailer_or_announced_checksum_keeps_nothing(
    fabric, monkeypatch, server, transport, local, peer_root
):
    src = make_file(local, "s", "f", os.urandom(2 * PIECE))
    real_trailer = wire.send_trailer
    monkeypatch.setattr(wire, "send_trailer", lambda sock, checksum: real_trailer(sock, checksum ^ 1))
    with pytest.raises(ReplicationError, match="arrived corrupt") as e:
        transport.put_file(server.address, "node0", "s", "f", src)
    assert e.value.code == "checksum"
    assert files_under(peer_root) == []
    monkeypatch.setattr(wire, "send_trailer", real_trailer)
    make_file(StoreLayout(peer_root, JOB), "s", COMMITTED, b"")
    make_file(StoreLayout(peer_root, JOB), "s", "g", os.urandom(PIECE))
    tamper_replies(monkeypatch, "rdma_get", lambda r: {**r, "checksum": r["checksum"] ^ 1})
    with pytest.raises(ReplicationError, match="do not match") as e:
        transport.get_file(server.address, "s", "g", local.job_dir / "x", layout=local)
    assert e.value.code == "checksum" and fetched(local) == []


def test_transport_close_ends_a_transfer_in_flight(fabric, server, secret, local, peer_root):
    fabric.hang = True
    src = make_file(local, "s", "f", b"z" * PIECE)
    t = RdmaTransport(JOB, secret, timeout_s=30)
    errors: list[BaseException] = []

    def push() -> None:
        try:
            t.put_file(server.address, "node0", "s", "f", src)
        except BaseException as e:  # checked below
            errors.append(e)

    thread = threading.Thread(target=push)
    thread.start()
    wait_for(lambda: fabric.ops or any(q.outstanding for q in fabric.live_of(fabric.classes.QP)))
    t.close()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ConnectionError) and "closed" in str(errors[0])
    wait_for(lambda: no_replicas(peer_root))


# --- fallback -------------------------------------------------------------------------------------------


def test_server_without_rdma_means_tcp_for_that_peer_logged_once(
    fabric, peer_root, secret, transport, local, caplog
):
    caplog.set_level(logging.INFO, logger=RDMA_LOGGER)
    data = os.urandom(3 * PIECE + 1)
    src = make_file(local, "s", "f", data)
    with PeerServer(peer_root, JOB, secret, "127.0.0.1") as plain:  # no RDMA endpoint
        transport.put_file(plain.address, "node0", "s", "f", src)
        transport.put_file(plain.address, "node0", "s", "f", src)
        transport.get_file(plain.address, "s", "f", local.job_dir / "back", source_node="node0", layout=local)
        peer = ("127.0.0.1", plain.address[1])
        assert set(transport.tcp_peers()) == {peer}
        assert "rdma_unavailable" in transport.tcp_peers()[peer]
    assert (StoreLayout(peer_root, JOB).replica_dir("node0", "s") / "f").read_bytes() == data
    assert (local.job_dir / "back").read_bytes() == data
    assert fabric.ops == [] and fabric.registrations == []
    lines = [r for r in caplog.records if r.name == RDMA_LOGGER and r.levelno >= logging.INFO]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "goes over TCP" in lines[0].getMessage() and f":{peer[1]}" in lines[0].getMessage()


def test_server_rdma_setup_failure_sends_that_transfer_over_tcp(
    fabric, server, transport, local, peer_root, caplog
):
    caplog.set_level(logging.INFO, logger=RDMA_LOGGER)
    fabric.fail_register = True  # the server cannot register (e.g. its locked-memory limit)
    data = os.urandom(2 * PIECE)
    src = make_file(local, "s", "f", data)
    transport.put_file(server.address, "node0", "s", "f", src)
    transport.put_file(server.address, "node0", "s", "f", src)
    assert (StoreLayout(peer_root, JOB).replica_dir("node0", "s") / "f").read_bytes() == data
    assert fabric.ops == [] and transport.tcp_peers() == {}  # not remembered: RDMA is tried each time
    warnings = [r for r in caplog.records if r.name == RDMA_LOGGER and r.levelno >= logging.INFO]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "rdma_failed" in warnings[0].getMessage() and "locked memory" in warnings[0].getMessage()
    fabric.fail_register = False
    transport.put_file(server.address, "node0", "s", "f", src)
    assert len(ops(fabric, "RDMA_WRITE")) == 2


# --- authentication and validation come before any registration -----------------------------------------


def test_auth_failures_refused_before_any_registration(fabric, server, local, peer_root):
    src = make_file(local, "s", "f", os.urandom(PIECE))
    make_file(StoreLayout(peer_root, JOB), "s", "f", os.urandom(PIECE))
    make_file(StoreLayout(peer_root, JOB), "s", COMMITTED, b"")
    with RdmaTransport(JOB, new_secret(), timeout_s=10) as intruder:
        with pytest.raises(ReplicationError, match="replication secret") as e:
            intruder.put_file(server.address, "node0", "s", "f", src)
        assert e.value.code == "auth"
        with pytest.raises(ReplicationError) as e:
            intruder.get_file(server.address, "s", "f", local.job_dir / "x", layout=local)
        assert e.value.code == "auth"
    assert fabric.registrations == []  # not the server, not even the intruder's own source
    assert fabric.qps_created == 2  # only the intruder's own queue pairs: the server made none
    assert fetched(local) == [] and not (peer_root / JOB / "replicas").exists()


def qp_fields(**over) -> dict:
    qp = {"qp_num": 77, "lid": 7, "gid": bytes(16), "psn": 5, "mtu": 3, "rd_atomic": 1}
    return {**qp, **over}


def rdma_put_header(s: RawClient, secret: bytes, size: int = PIECE, **over) -> dict:
    """An rdma_put request on connection ``s``, signed with ``secret``."""
    fields = {"source": "node0", "checkpoint": "s", "file": "f", "size": size, "qp": qp_fields(), **over}
    return s.signed(secret, "rdma_put", **fields)


def refused(s: socket.socket, header: dict, code: str) -> dict:
    """Send ``header`` on ``s``; check that it is refused with ``code`` and the connection closed."""
    wire.send_header(s, header)
    reply = wire.recv_header(s)
    assert reply is not None and reply["ok"] is False and reply["code"] == code, reply
    assert s.recv(1) == b""
    s.close()
    return reply


@pytest.mark.parametrize(
    ("over", "code"),
    [
        ({"file": "../x"}, "bad_request"),
        ({"source": ".."}, "bad_request"),
        ({"size": 2**40 + 1}, "too_large"),
        ({"qp": None}, "bad_request"),  # a non-empty file needs the sender's queue pair
        ({"qp": qp_fields(gid=b"short")}, "bad_request"),
        ({"qp": qp_fields(qp_num=0)}, "bad_request"),
        ({"qp": qp_fields(psn=1 << 24)}, "bad_request"),
        ({"qp": {**qp_fields(), "extra": 1}}, "bad_request"),
        ({"qp": {k: v for k, v in qp_fields().items() if k != "mtu"}}, "bad_request"),
    ],
)
def test_bad_rdma_requests_refused_before_any_registration(fabric, server, secret, peer_root, over, code):
    s = raw_connect(server.address)
    refused(s, rdma_put_header(s, secret, **over), code)
    assert fabric.registrations == [] and fabric.qps_created == 0
    assert no_replicas(peer_root)


def test_unauthenticated_and_replayed_rdma_requests_refused(fabric, server, secret, peer_root):
    s = raw_connect(server.address)
    refused(s, rdma_put_header(s, new_secret()), "auth")
    s = raw_connect(server.address)
    get = {"checkpoint": "s", "file": "f", "source": None, "qp": qp_fields()}
    refused(s, s.signed(new_secret(), "rdma_get", **get), "auth")
    assert fabric.registrations == [] and fabric.qps_created == 0
    s = raw_connect(server.address)
    h = rdma_put_header(s, secret)
    wire.send_header(s, h)
    reply = wire.recv_header(s)  # authenticated: the go-ahead, with the file exposed
    assert reply["ok"] is True and reply["qp"]["qp_num"] > 0
    assert [r["length"] for r in fabric.registrations] == [PIECE]
    s.close()  # the sender goes away without writing: the server deregisters and drops the file
    wait_for(lambda: not fabric.live_of(fabric.classes.MR) and not fabric.live_of(fabric.classes.QP))
    wait_for(lambda: files_under(peer_root / JOB / "replicas") == [])
    refused(raw_connect(server.address), h, "auth")  # the same request again: a replay
    assert len(fabric.registrations) == 1


def test_tcp_transport_and_tcp_ops_unchanged_with_an_rdma_server(fabric, server, secret, local, peer_root):
    """A TCP-only peer (another process choosing TCP) still replicates to a server that has RDMA."""
    data = os.urandom(PIECE + 3)
    src = make_file(local, "s", "f", data)
    with TcpTransport(JOB, secret) as t:
        t.put_file(server.address, "node0", "s", "f", src)
        t.get_file(server.address, "s", "f", local.job_dir / "b", source_node="node0", layout=local)
    assert (local.job_dir / "b").read_bytes() == data and fabric.ops == []
