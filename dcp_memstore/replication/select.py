"""Choosing the replication transport: TCP, RDMA, or whichever works here (``auto``)."""

from __future__ import annotations

import logging

from dcp_memstore.replication import rdma
from dcp_memstore.replication.tcp import DEFAULT_TIMEOUT_S, TcpTransport
from dcp_memstore.replication.transport import Transport

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "tcp", "rdma")


def choose_transport(
    job_id: str, secret: bytes, prefer: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S
) -> Transport:
    """The transport to replicate with for job ``job_id`` holding ``secret``.

    ``prefer``: ``"tcp"`` gives a ``TcpTransport``; ``"rdma"`` an ``RdmaTransport`` (RuntimeError saying
    what is missing if it cannot be opened); ``"auto"`` an ``RdmaTransport`` when pyverbs is installed and
    an RDMA device opens with an active port, else a ``TcpTransport``. Either way "auto" logs one INFO line
    saying which and, for TCP, why RDMA was not used: no pyverbs, no device, or the device does not open
    (with the cause). Raises ValueError for any other ``prefer``.

    An ``RdmaTransport`` still talks TCP to peers whose server has no RDMA (see ``rdma``); pass its
    ``endpoint()`` to this process's ``PeerServer`` so that peers can use RDMA towards it."""
    if not isinstance(prefer, str) or prefer.lower() not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {prefer!r}")
    prefer = prefer.lower()
    if prefer == "tcp":
        return TcpTransport(job_id, secret, timeout_s=timeout_s)
    if prefer == "rdma":
        return rdma.RdmaTransport(job_id, secret, timeout_s=timeout_s)
    # Build TCP first so a bad job id or secret raises before anything is probed or logged.
    tcp = TcpTransport(job_id, secret, timeout_s=timeout_s)
    if not rdma.pyverbs_available():
        reason = "pyverbs is not installed"
    elif not rdma.rdma_devices():
        reason = "no RDMA device found"
    else:
        try:
            transport = rdma.RdmaTransport(job_id, secret, timeout_s=timeout_s)
        except RuntimeError as e:
            cause = e.__cause__ if e.__cause__ is not None else e
            reason = f"opening the RDMA device failed: {cause}"
        else:
            tcp.close()
            log.info(
                "replication transport: RDMA on device %s port %d (TCP to peers without RDMA)",
                transport.device_name, transport.port,
            )  # fmt: skip
            return transport
    log.info("replication transport: TCP (RDMA not used: %s)", reason)
    return tcp
