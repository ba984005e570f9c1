"""Replication: each node's checkpoint files are pushed to a peer node,
so losing a machine loses no checkpoint.

This package holds the transport layer: the wire format (``wire``), request authentication (``auth``), the
peer server that keeps replicas and serves files (``server``), and the transports that talk to it
(``transport``: the interface; ``tcp``: the TCP implementation).
"""

from dcp_memstore.replication.auth import AuthError, shared_secret
from dcp_memstore.replication.server import PeerServer
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import ReplicationError, Transport

__all__ = ["AuthError", "PeerServer", "ReplicationError", "TcpTransport", "Transport", "shared_secret"]
