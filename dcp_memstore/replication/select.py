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
    what is missing if it cannot be opened); ``"auto"`` a ``TcpTransport``, logging one INFO line saying
    why RDMA was not used: no pyverbs, no device, the device does not open, or (a device that opens) RDMA
    data transfer is not in this release. Raises ValueError for any other ``prefer``.

    ``RdmaTransport`` opens the device but does not move data in this release (see ``rdma``), so "auto"
    only probes it; once it moves data, "auto" returns it here."""
    if not isinstance(prefer, str) or prefer.lower() not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {prefer!r}")
    prefer = prefer.lower()
    if prefer == "tcp":
        return TcpTransport(job_id, secret, timeout_s=timeout_s)
    if prefer == "rdma":
        return rdma.RdmaTransport(job_id, secret, timeout_s=timeout_s)
    if not rdma.pyverbs_available():
        reason = "pyverbs is not installed"
    elif not rdma.rdma_devices():
        reason = "no RDMA device found"
    else:
        try:
            rdma.RdmaTransport(job_id, secret, timeout_s=timeout_s).close()
            reason = "an RDMA device opens, but RDMA data transfer is not implemented in this release"
        except RuntimeError as e:
            cause = e.__cause__ if e.__cause__ is not None else e
            reason = f"opening the RDMA device failed: {cause}"
    # Build TCP first so a bad job id or secret raises before anything is logged.
    transport = TcpTransport(job_id, secret, timeout_s=timeout_s)
    log.info("replication transport: TCP (RDMA not used: %s)", reason)
    return transport
