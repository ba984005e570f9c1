"""The RDMA transport up to the device boundary, and transport selection.

This machine has no RDMA hardware and no pyverbs: the real-environment tests check that RDMA is reported
absent and TCP is chosen. The rest inject a FAKE ``pyverbs`` module (a mock standing in for hardware we do
not have) to exercise the code paths that a real device would take; they verify our control flow, not
pyverbs or any device."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from dcp_memstore.replication import rdma
from dcp_memstore.replication.auth import new_secret
from dcp_memstore.replication.rdma import RdmaTransport, rdma_devices
from dcp_memstore.replication.select import choose_transport
from dcp_memstore.replication.tcp import TcpTransport

JOB = "job"
SELECT_LOGGER = "dcp_memstore.replication.select"


def _pyverbs_really_missing() -> bool:
    return not rdma.pyverbs_available()


@pytest.fixture
def secret() -> bytes:
    return new_secret()


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
# MOCK: a fake pyverbs, standing in for RDMA hardware this machine does not have.
# ---------------------------------------------------------------------------------------------------------


class FakeState:
    def __init__(self, devices: list[bytes], open_error: Exception | None = None) -> None:
        self.devices, self.open_error = devices, open_error
        self.opened: list[str] = []
        self.closed: list[str] = []


def install_fake_pyverbs(monkeypatch: pytest.MonkeyPatch, state: FakeState) -> None:
    """Inject a fake ``pyverbs`` package (MOCK, not the real library) mirroring the documented API:
    ``pyverbs.device.get_device_list()`` -> objects with a bytes ``name``; ``Context(name=...)``;
    ``pyverbs.pd.PD(ctx)``; ``close()`` on both."""

    class Device:
        def __init__(self, name: bytes) -> None:
            self.name = name

    class Context:
        def __init__(self, **kwargs: object) -> None:
            if state.open_error is not None:
                raise state.open_error
            self.name = kwargs["name"]
            state.opened.append(f"ctx:{self.name}")

        def close(self) -> None:
            state.closed.append(f"ctx:{self.name}")

    class PD:
        def __init__(self, ctx: Context) -> None:
            self.ctx = ctx
            state.opened.append(f"pd:{ctx.name}")

        def close(self) -> None:
            state.closed.append(f"pd:{self.ctx.name}")

    pkg = types.ModuleType("pyverbs")
    pkg.__path__ = []  # a package, so submodule imports resolve through sys.modules
    device = types.ModuleType("pyverbs.device")
    device.get_device_list = lambda: [Device(n) for n in state.devices]
    device.Context = Context
    pd = types.ModuleType("pyverbs.pd")
    pd.PD = PD
    pkg.device, pkg.pd = device, pd
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)
    monkeypatch.setitem(sys.modules, "pyverbs.pd", pd)


def test_fake_device_auto_probes_rdma_but_keeps_tcp_until_rdma_moves_data(
    monkeypatch: pytest.MonkeyPatch, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    state = FakeState([b"mlx5_0", b"mlx5_1"])
    install_fake_pyverbs(monkeypatch, state)
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    assert rdma_devices() == ["mlx5_0", "mlx5_1"]
    auto = choose_transport(JOB, secret)
    assert isinstance(auto, TcpTransport)
    assert state.opened == ["ctx:mlx5_0", "pd:mlx5_0"] and state.closed == ["pd:mlx5_0", "ctx:mlx5_0"]
    lines = [r.getMessage() for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1 and "not implemented in this release" in lines[0]
    auto.close()
    state.opened.clear()
    state.closed.clear()
    t = choose_transport(JOB, secret, prefer="rdma")
    assert isinstance(t, RdmaTransport)
    assert t.device_name == "mlx5_0" and state.opened == ["ctx:mlx5_0", "pd:mlx5_0"]
    # Data transfer is honestly not implemented.
    with pytest.raises(NotImplementedError, match="not implemented in this release.*TCP"):
        t.stat(("127.0.0.1", 1), "step-1")
    t.close()
    t.close()  # idempotent
    assert state.closed == ["pd:mlx5_0", "ctx:mlx5_0"]


def test_fake_device_named(monkeypatch: pytest.MonkeyPatch, secret: bytes) -> None:
    state = FakeState([b"mlx5_0", b"mlx5_1"])
    install_fake_pyverbs(monkeypatch, state)
    with RdmaTransport(JOB, secret, device="mlx5_1") as t:
        assert t.device_name == "mlx5_1"
    with pytest.raises(RuntimeError, match="device 'mlx5_9' not found"):
        RdmaTransport(JOB, secret, device="mlx5_9")


def test_fake_open_failure_falls_back_to_tcp(
    monkeypatch: pytest.MonkeyPatch, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    state = FakeState([b"mlx5_0"], open_error=OSError("Failed to open device mlx5_0: EPERM"))
    install_fake_pyverbs(monkeypatch, state)
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    t = choose_transport(JOB, secret)
    assert isinstance(t, TcpTransport)
    t.close()
    lines = [r.getMessage() for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1
    assert "opening the RDMA device failed" in lines[0] and "EPERM" in lines[0]
    with pytest.raises(RuntimeError, match="cannot open RDMA device 'mlx5_0'.*EPERM"):
        choose_transport(JOB, secret, prefer="rdma")


def test_fake_pyverbs_without_devices(
    monkeypatch: pytest.MonkeyPatch, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    install_fake_pyverbs(monkeypatch, FakeState([]))
    caplog.set_level(logging.INFO, logger=SELECT_LOGGER)
    assert rdma_devices() == []
    assert isinstance(choose_transport(JOB, secret), TcpTransport)
    lines = [r.getMessage() for r in caplog.records if r.name == SELECT_LOGGER]
    assert len(lines) == 1 and "no RDMA device found" in lines[0]
    with pytest.raises(RuntimeError, match="lists no RDMA device"):
        RdmaTransport(JOB, secret)
