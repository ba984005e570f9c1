"""Request and reply authentication (HMAC-SHA256, time window, nonce replay) and sharing the per-job
secret through a real torch.distributed store."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from dcp_memstore.replication import auth

SECRET = auth.new_secret()
TO = "10.0.0.1:40001"  # the server the requests are for
CHALLENGE = auth.new_challenge()  # the one that server sent on the requests' connection


def _signed(**fields) -> dict:
    return auth.sign_request({"op": "stat", "checkpoint": "step-1", **fields}, SECRET, "job", TO, CHALLENGE)


def test_signed_request_verifies_once():
    v = auth.RequestVerifier(SECRET, "job")
    h = _signed()
    assert set(h) == {"op", "checkpoint", "job", "to", "challenge", "ts", "nonce", "mac"}
    v.verify(h, TO, CHALLENGE)
    with pytest.raises(auth.AuthError, match="replays"):
        v.verify(h, TO, CHALLENGE)


def test_every_field_is_covered_by_the_mac():
    v = auth.RequestVerifier(SECRET, "job")
    h = _signed()
    for key, other in [
        ("checkpoint", "step-2"),
        ("op", "ping"),
        ("job", "job2"),
        ("to", "10.0.0.2:40001"),
        ("challenge", auth.new_challenge()),
        ("ts", h["ts"] + 1),
    ]:
        with pytest.raises(auth.AuthError, match="MAC is wrong"):
            v.verify({**h, key: other}, TO, CHALLENGE)
    with pytest.raises(auth.AuthError, match="MAC is wrong"):
        v.verify({**h, "nonce": b"x" * 16}, TO, CHALLENGE)
    with pytest.raises(auth.AuthError, match="MAC is wrong"):
        v.verify({**h, "extra": 1}, TO, CHALLENGE)


def test_wrong_secret_and_missing_fields():
    v = auth.RequestVerifier(SECRET, "job")
    with pytest.raises(auth.AuthError, match="does not hold this job's replication secret"):
        v.verify(auth.sign_request({"op": "ping"}, auth.new_secret(), "job", TO, CHALLENGE), TO, CHALLENGE)
    h = _signed()
    with pytest.raises(auth.AuthError, match="no valid MAC"):
        v.verify({k: x for k, x in h.items() if k != "mac"}, TO, CHALLENGE)
    with pytest.raises(auth.AuthError, match="no valid MAC"):
        v.verify({**h, "mac": h["mac"][:16]}, TO, CHALLENGE)
    with pytest.raises(auth.AuthError, match="no valid nonce"):
        v.verify({k: x for k, x in h.items() if k != "nonce"}, TO, CHALLENGE)
    with pytest.raises(auth.AuthError, match="no timestamp"):
        v.verify({k: x for k, x in h.items() if k != "ts"}, TO, CHALLENGE)


def test_same_secret_other_job_refused():
    v = auth.RequestVerifier(SECRET, "job")
    with pytest.raises(auth.AuthError, match="for job 'other'"):
        v.verify(auth.sign_request({"op": "ping"}, SECRET, "other", TO, CHALLENGE), TO, CHALLENGE)


def test_a_request_for_another_server_is_refused():
    h = _signed()
    v = auth.RequestVerifier(SECRET, "job")
    with pytest.raises(auth.AuthError, match="for the replication server at 10.0.0.1:40001; this is the one"):
        v.verify(h, "10.0.0.1:40002", CHALLENGE)
    v.verify(h, TO, CHALLENGE)  # refused before its nonce was remembered: its own server still takes it


def test_a_request_for_another_connection_is_refused():
    """A request carrying another connection's challenge (a capture replayed on a new connection, to the
    same server or to one restarted on its address, whose nonce memory is empty) is refused."""
    h = _signed()
    v = auth.RequestVerifier(SECRET, "job")
    with pytest.raises(auth.AuthError, match="signed for another connection"):
        v.verify(h, TO, auth.new_challenge())
    v.verify(h, TO, CHALLENGE)  # refused before its nonce was remembered: its own connection still takes it


@pytest.mark.parametrize(
    ("sockaddr", "name"),
    [
        (("10.1.2.3", 80), "10.1.2.3:80"),
        (("::ffff:10.1.2.3", 80, 0, 0), "10.1.2.3:80"),  # an IPv4 client of a dual-stack server
        (("fe80:0:0::1", 80, 0, 2), "[fe80::1]:80"),
        (("fe80::1%eth0", 80, 0, 2), "[fe80::1]:80"),
    ],
)
def test_destination_names_an_endpoint_alike_from_both_ends(sockaddr, name):
    assert auth.destination(sockaddr) == name


@pytest.mark.parametrize("skew_s", [-301, 301, -3600])
def test_timestamp_outside_window_refused(skew_s):
    h = _signed()
    v = auth.RequestVerifier(SECRET, "job", window_s=300, clock_ms=lambda: h["ts"] - skew_s * 1000)
    with pytest.raises(auth.AuthError, match="off this node's clock"):
        v.verify(h, TO, CHALLENGE)


def test_timestamp_inside_window_accepted():
    h = _signed()
    auth.RequestVerifier(SECRET, "job", window_s=300, clock_ms=lambda: h["ts"] + 299_000).verify(
        h, TO, CHALLENGE
    )


def test_nonce_memory_is_bounded_and_expires(monkeypatch):
    now = [1_000_000]
    monkeypatch.setattr(auth, "_now_ms", lambda: now[0])  # the signer's clock
    v = auth.RequestVerifier(SECRET, "job", window_s=10, max_nonces=4, clock_ms=lambda: now[0])
    for _ in range(6):
        now[0] += 1
        v.verify(_signed(), TO, CHALLENGE)
    assert len(v._seen) == 4  # the two oldest were forgotten to stay within max_nonces
    now[0] += 11_000  # past the window: the remembered nonces are dropped, their requests are stale anyway
    late = _signed()
    v.verify(late, TO, CHALLENGE)
    assert len(v._seen) == 1
    now[0] += 11_000
    with pytest.raises(auth.AuthError, match="off this node's clock"):
        v.verify(late, TO, CHALLENGE)


def test_a_replay_inside_the_window_is_refused_after_a_flood_of_fresh_requests(monkeypatch):
    """A captured request replayed after more fresh requests than the verifier remembers (so its nonce was
    forgotten) is still refused; the fresh requests all pass, whatever order their timestamps come in."""
    now = [1_000_000]
    monkeypatch.setattr(auth, "_now_ms", lambda: now[0])
    v = auth.RequestVerifier(SECRET, "job", window_s=300, max_nonces=8, clock_ms=lambda: now[0])
    captured = _signed()
    v.verify(captured, TO, CHALLENGE)
    behind = []  # requests of a node whose clock is 2 ms behind, arriving among the others
    for _ in range(20):
        now[0] += 3
        v.verify(_signed(), TO, CHALLENGE)
        now[0] -= 2
        behind.append(_signed())
        now[0] += 2
        v.verify(behind[-1], TO, CHALLENGE)
    assert len(v._seen) == 8
    for replay in (captured, behind[0], behind[-1]):
        with pytest.raises(auth.AuthError, match="replay"):
            v.verify(replay, TO, CHALLENGE)
    v.verify(_signed(), TO, CHALLENGE)  # a fresh request still passes


def test_canonical_encoding_ignores_key_order_and_mac():
    a = {"op": "ping", "job": "j", "ts": 1, "nonce": b"n", "mac": b"x"}
    b = {"nonce": b"n", "ts": 1, "job": "j", "op": "ping", "mac": b"y"}
    assert auth.canonical(a) == auth.canonical(b)


def test_reply_signature():
    nonce = b"n" * 16
    reply = auth.sign_reply({"ok": True, "size": 3}, SECRET, nonce)
    auth.verify_reply(reply, SECRET, nonce)
    with pytest.raises(auth.AuthError, match="answers another request"):
        auth.verify_reply(reply, SECRET, b"o" * 16)
    with pytest.raises(auth.AuthError, match="MAC is wrong"):
        auth.verify_reply({**reply, "size": 4}, SECRET, nonce)
    with pytest.raises(auth.AuthError, match="MAC is wrong"):
        auth.verify_reply(reply, auth.new_secret(), nonce)
    with pytest.raises(auth.AuthError, match="no valid MAC"):
        auth.verify_reply({"ok": True, "re": nonce}, SECRET, nonce)


def test_request_mac_never_passes_as_reply_mac():
    """Domain separation: a signed request replayed back to its sender is not a valid reply."""
    h = auth.sign_request({"op": "ping"}, SECRET, "job", TO, CHALLENGE)
    fake = {**h, "re": h["nonce"]}
    with pytest.raises(auth.AuthError):
        auth.verify_reply(fake, SECRET, h["nonce"])


def test_check_secret():
    assert auth.check_secret("x" * 16) == b"x" * 16
    assert len(auth.new_secret()) == 32
    with pytest.raises(ValueError, match="at least 16"):
        auth.check_secret(b"short")
    with pytest.raises(ValueError, match="bytes or a str"):
        auth.check_secret(12345678901234567890)


def test_shared_secret_rank0_creates_others_wait():
    store = dist.HashStore()
    got: dict[int, bytes] = {}

    def rank(r: int) -> None:
        got[r] = auth.shared_secret(store, "job-1", r)

    waiters = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3)]
    for t in waiters:  # they block in store.get until rank 0 publishes
        t.start()
    rank(0)
    for t in waiters:
        t.join(10)
    assert len(got) == 4 and len(set(got.values())) == 1 and len(got[0]) == 32
    assert store.get("dcp_memstore/job-1/secret") == got[0]
    assert auth.shared_secret(store, "job-1", 0) == got[0]  # a restarted rank 0 keeps the shared one
    assert auth.shared_secret(store, "job-2", 0) != got[0]  # one secret per job


def test_shared_secret_given_by_user_skips_the_store():
    store = dist.HashStore()
    assert auth.shared_secret(store, "job", 1, secret="a" * 32) == b"a" * 32
    assert not store.check(["dcp_memstore/job/secret"])


def test_shared_secret_errors():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(RuntimeError, match="created by rank 0"):
        auth.shared_secret(store, "job", 1)
    store.set("dcp_memstore/job/secret", b"tiny")
    with pytest.raises(ValueError, match="no usable replication secret"):
        auth.shared_secret(store, "job", 1)
    with pytest.raises(ValueError, match="job id"):
        auth.secret_store_key("../job")
