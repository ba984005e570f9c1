"""The RDMA device handling up to the device boundary, and transport selection.

This machine has no RDMA hardware and no pyverbs: the real-environment tests check that RDMA is reported
absent and TCP is chosen, with the reason logged once. The rest inject a FAKE ``pyverbs`` module
(``fake_pyverbs``: a mock standing in for hardware we do not have) to exercise what a real device would
take: listing, opening, port and GID choice, closing, and the fallback order; they verify our control flow,
not pyverbs or any device. Data transfers are in ``test_rdma_transfer.py``."""

from __future__ import annotations

import logging
import sys

import pytest

from dcp_memstore.replication import rdma
from dcp_memstore.replication.rdma import RdmaTransport, rdma_devices
from dcp_memstore.replication.rdma_verbs import gid_to_bytes, gid_to_text
from dcp_memstore.replication.select import choose_transport
from dcp_memstore.replication.tcp import TcpTransport
from tests.replication.fake_pyverbs import ROCE_GIDS, ZERO_GID, E, Fabric, install
from tests.replication.transfer_helpers import JOB

SELECT_LOGGER = "dcp_memstore.replication.select"


def _pyverbs_really_missing() -> bool:
    return not rdma.pyverbs_available()


# ---------------------------------------------------------------------------------------------------------
# This machine as it is (no pyverbs, no device)
# ---------------------------------------------------------------------------------------------------------

real_env = pytest.mark.skipif(
    not _pyverbs_really_missing() and bool(rdma_devices()),
    reason="this node has pyverbs and an RDMA device; these tests describe a node without RDMA",
)


@real_env
def test_no_rdma_devices_here() -> None:
    assert rdma_devices() == []


@real_env
def test_auto_picks_tcp_and_says_why_once(secret: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    t = choose_transport(JOB, secret)
    try:
        assert isinstance(t, TcpTransport)
    finally:
        t.close()
    lines = [r for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    msg = lines[0].getMessage()
    assert "TCP" in msg
    assert ("pyverbs is not installed" in msg) or ("no RDMA device" in msg)


@real_env
def test_prefer_rdma_raises_clearly(secret: bytes) -> None:
    with pytest.raises(
        RuntimeError, match=r"RDMA transport unavailable: (pyverbs is not installed|.*no RDMA)"
    ):
        choose_transport(JOB, secret, prefer="rdma")


def test_prefer_tcp_and_validation(secret: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    t = choose_transport(JOB, secret, prefer="tcp", timeout_s=5.0)
    assert isinstance(t, TcpTransport) and t.timeout_s == 5.0
    t.close()
    assert not [r for r in caplog.records if r.name == SELECT_LOGGER]  # an explicit choice logs nothing
    for bad in ("ib", "", None, "rdma ", 1):
        with pytest.raises(ValueError, match="transport must be one of"):
            choose_transport(JOB, secret, prefer=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        choose_transport(JOB, b"short")


def test_pyverbs_missing_is_reported(monkeypatch: pytest.MonkeyPatch, secret: bytes) -> None:
    # Make pyverbs unimportable even on a node that has it (None in sys.modules makes import fail).
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    monkeypatch.setitem(sys.modules, "pyverbs.pd", None)
    assert rdma_devices() == []
    with pytest.raises(RuntimeError, match="pyverbs is not installed.*'rdma' extra"):
        RdmaTransport(JOB, secret)


# ---------------------------------------------------------------------------------------------------------
# MOCK: a fake pyverbs (tests/replication/fake_pyverbs.py), standing in for RDMA hardware this machine does
# not have. These check our device handling and selection against it, not pyverbs or any device.
# ---------------------------------------------------------------------------------------------------------


def test_fake_device_auto_picks_rdma_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = install(monkeypatch, Fabric((b"mlx5_0", b"mlx5_1")))
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    assert rdma_devices() == ["mlx5_0", "mlx5_1"]
    auto = choose_transport(JOB, secret, timeout_s=7.0)
    assert isinstance(auto, RdmaTransport)
    assert auto.device_name == "mlx5_0" and auto.timeout_s == 7.0 and auto.tcp.timeout_s == 7.0
    assert fabric.opened == ["ctx:mlx5_0", "pd:mlx5_0"] and fabric.closed == []
    lines = [r for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "RDMA" in lines[0].getMessage() and "mlx5_0" in lines[0].getMessage()
    endpoint = auto.endpoint()  # a server sharing the device keeps it open
    auto.close()
    auto.close()  # idempotent
    assert fabric.closed == []
    endpoint.close()
    assert fabric.closed == ["pd:mlx5_0", "ctx:mlx5_0"] and fabric.bugs == []
    t = choose_transport(JOB, secret, prefer="rdma")
    assert isinstance(t, RdmaTransport)
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.stat(("127.0.0.1", 1), "step-1")


def test_fake_device_named(monkeypatch: pytest.MonkeyPatch, secret: bytes) -> None:
    install(monkeypatch, Fabric((b"mlx5_0", b"mlx5_1")))
    with RdmaTransport(JOB, secret, device="mlx5_1") as t:
        assert t.device_name == "mlx5_1"
    with pytest.raises(RuntimeError, match="device 'mlx5_9' not found"):
        RdmaTransport(JOB, secret, device="mlx5_9")


def test_fake_open_failure_falls_back_to_tcp(
    monkeypatch: pytest.MonkeyPatch, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    install(monkeypatch, Fabric(open_error=OSError("Failed to open device mlx5_0: EPERM")))
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    t = choose_transport(JOB, secret)
    assert isinstance(t, TcpTransport)
    t.close()
    lines = [r.getMessage() for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1
    assert "opening the RDMA device failed" in lines[0] and "EPERM" in lines[0]
    with pytest.raises(RuntimeError, match="cannot open RDMA device 'mlx5_0'.*EPERM"):
        choose_transport(JOB, secret, prefer="rdma")


def test_fake_port_down_falls_back_to_tcp(
    monkeypatch: pytest.MonkeyPatch, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = install(monkeypatch, Fabric(port_state=1))
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    t = choose_transport(JOB, secret)
    assert isinstance(t, TcpTransport)
    lines = [r.getMessage() for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1 and "port 1 of RDMA device 'mlx5_0' is not active" in lines[0]
    assert fabric.opened == ["ctx:mlx5_0", "pd:mlx5_0"] and fabric.closed == ["pd:mlx5_0", "ctx:mlx5_0"]


def test_fake_pyverbs_without_devices(
    monkeypatch: pytest.MonkeyPatch, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    install(monkeypatch, Fabric(()))
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    assert rdma_devices() == []
    assert isinstance(choose_transport(JOB, secret), TcpTransport)
    lines = [r.getMessage() for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1 and "no RDMA device found" in lines[0]
    with pytest.raises(RuntimeError, match="lists no RDMA device"):
        RdmaTransport(JOB, secret)


@pytest.mark.parametrize(
    ("link_layer", "gids", "wanted", "index"),
    [
        (E.IBV_LINK_LAYER_INFINIBAND, None, None, 0),  # IB: the port GID
        (E.IBV_LINK_LAYER_ETHERNET, None, None, 3),  # RoCE: the v2 IPv4-mapped entry first
        (E.IBV_LINK_LAYER_ETHERNET, ROCE_GIDS[:2], None, 1),  # RoCE without IPv4: the v2 entry
        (E.IBV_LINK_LAYER_ETHERNET, None, 2, 2),  # as configured
        (E.IBV_LINK_LAYER_INFINIBAND, [], None, 0),  # IB without GIDs: LID routing (zero GID)
    ],
)
def test_fake_gid_choice(
    monkeypatch: pytest.MonkeyPatch,
    secret: bytes,
    link_layer: int,
    gids: list | None,
    wanted: int | None,
    index: int,
) -> None:
    fabric = install(monkeypatch, Fabric(link_layer=link_layer, gids=gids))
    with RdmaTransport(JOB, secret, gid_index=wanted) as t:
        assert t.device.gid_index == index
        expected = gid_to_bytes(fabric.gids[index][0]) if fabric.gids[index][0] != ZERO_GID else bytes(16)
        assert t.device.gid == expected
        assert gid_to_text(t.device.gid) == fabric.gids[index][0]


def test_fake_roce_without_gid_or_empty_gid_refused(monkeypatch: pytest.MonkeyPatch, secret: bytes) -> None:
    install(monkeypatch, Fabric(link_layer=E.IBV_LINK_LAYER_ETHERNET, gids=[]))
    with pytest.raises(RuntimeError, match="has no valid GID"):
        RdmaTransport(JOB, secret)
    install(monkeypatch, Fabric(link_layer=E.IBV_LINK_LAYER_ETHERNET))
    with pytest.raises(RuntimeError, match="GID 5 of port 1 .* is empty"):
        RdmaTransport(JOB, secret, gid_index=5)
