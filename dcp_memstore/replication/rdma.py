"""The RDMA transport, through pyverbs (the ``rdma`` extra): written up to the device boundary only.

What exists: finding RDMA devices (``rdma_devices``) and, in ``RdmaTransport``, opening the first device
(``pyverbs.device.Context``) and allocating a protection domain (``pyverbs.pd.PD``) on it, with clear errors
when pyverbs or a device is missing. What does not: moving data. Registering the file mappings as memory
regions, connecting queue pairs to the peer and posting RDMA writes/reads is not implemented in this
release; the transfer methods raise NotImplementedError, and replication runs over TCP
(``TcpTransport``). ``select.choose_transport`` therefore only picks RDMA when asked to or when a device
opens, and callers that need to move data must use TCP until this is implemented.

Verification: this code was written on machines without RDMA hardware or pyverbs; it was exercised only
against a stand-in ``pyverbs`` module in the tests. Its pyverbs calls follow rdma-core's pyverbs
documentation (``get_device_list()``, ``Device.name`` as bytes, ``Context(name=...)``, ``PD(ctx)``,
``close()``), but have never run against a real device.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

from dcp_memstore.replication.auth import check_secret
from dcp_memstore.replication.transport import PeerAddress, Transport
from dcp_memstore.store.ids import validate_name

log = logging.getLogger(__name__)

_NOT_IMPLEMENTED = (
    "RDMA data transfer is not implemented in this release (only opening the device is); replication "
    "uses the TCP transport. Use choose_transport(prefer='tcp') or 'auto'."
)


def _import_pyverbs() -> tuple[Any, Any]:
    """``(pyverbs.device, pyverbs.pd)``; raises ImportError when pyverbs is not installed."""
    device = importlib.import_module("pyverbs.device")
    pd = importlib.import_module("pyverbs.pd")
    return device, pd


def _device_name(dev: Any) -> str:
    name = getattr(dev, "name", dev)
    return name.decode() if isinstance(name, bytes) else str(name)


def pyverbs_available() -> bool:
    """Whether pyverbs can be imported."""
    try:
        _import_pyverbs()
    except ImportError:
        return False
    return True


def rdma_devices() -> list[str]:
    """Names of the RDMA devices pyverbs lists (e.g. ``["mlx5_0"]``); ``[]`` when pyverbs is not installed,
    no device exists, or listing them fails (logged at DEBUG)."""
    try:
        device, _ = _import_pyverbs()
    except ImportError:
        return []
    try:
        return [_device_name(d) for d in device.get_device_list()]
    except Exception as e:  # pyverbs raises its own error types when the verbs library finds nothing
        log.debug("listing RDMA devices failed: %s", e)
        return []


class RdmaTransport(Transport):
    """Transport over RDMA verbs for job ``job_id`` holding ``secret``; ``device`` names the RDMA device to
    open (default: the first one listed).

    The constructor opens the device and allocates a protection domain, and raises RuntimeError naming what
    is missing (pyverbs not installed, no RDMA device, the named device absent, or the open failing). Data
    transfer is NOT implemented in this release: ``put_file``, ``get_file`` and ``stat`` raise
    NotImplementedError, and replication uses ``TcpTransport``."""

    def __init__(
        self, job_id: str, secret: bytes, timeout_s: float = 60.0, device: str | None = None
    ) -> None:
        self.job_id = validate_name(job_id, "job id")
        self.secret = check_secret(secret)
        self.timeout_s = timeout_s
        self.context: Any = None
        self.pd: Any = None
        try:
            pv_device, pv_pd = _import_pyverbs()
        except ImportError as e:
            raise RuntimeError(
                f"RDMA transport unavailable: pyverbs is not installed ({e}). Install the 'rdma' extra "
                f"(pip install 'dcp_memstore[rdma]', which needs rdma-core) or use the TCP transport."
            ) from e
        names = rdma_devices()
        if not names:
            raise RuntimeError(
                "RDMA transport unavailable: pyverbs is installed but lists no RDMA device on this node "
                "(see `ibv_devices`). Use the TCP transport."
            )
        if device is not None and device not in names:
            raise RuntimeError(
                f"RDMA transport unavailable: device {device!r} not found (devices: {', '.join(names)})"
            )
        self.device_name = device if device is not None else names[0]
        try:
            self.context = pv_device.Context(name=self.device_name)
            self.pd = pv_pd.PD(self.context)
        except Exception as e:
            self.close()
            raise RuntimeError(
                f"RDMA transport unavailable: cannot open RDMA device {self.device_name!r} or allocate a "
                f"protection domain on it: {e}"
            ) from e
        log.debug("opened RDMA device %s", self.device_name)

    def put_file(
        self, peer_addr: PeerAddress, source_node: str, checkpoint: str, file: str, path: Path
    ) -> None:
        raise NotImplementedError(_NOT_IMPLEMENTED)

    def get_file(
        self,
        peer_addr: PeerAddress,
        checkpoint: str,
        file: str,
        dest_path: Path,
        source_node: str | None = None,
    ) -> None:
        raise NotImplementedError(_NOT_IMPLEMENTED)

    def stat(self, peer_addr: PeerAddress, checkpoint: str) -> dict:
        raise NotImplementedError(_NOT_IMPLEMENTED)

    def close(self) -> None:
        """Release the protection domain and close the device (idempotent)."""
        pd, self.pd = self.pd, None
        ctx, self.context = self.context, None
        for obj in (pd, ctx):
            if obj is not None:
                try:
                    obj.close()
                except Exception as e:  # closing must not mask the error that led here
                    log.debug("closing RDMA resource %r failed: %s", obj, e)
