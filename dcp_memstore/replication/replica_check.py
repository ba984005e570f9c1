"""Whether the replicas that this node's records call ``replicated`` still exist, as ``MemStore.status``
reports them where this node's memory holds the checkpoint.

The records say what a replica node acknowledged once; that node may have lost the files since (a machine
replaced and restarted empty, its tmpfs wiped, or its copy deleted or evicted there), and nothing corrects
the records before the next ``latest_checkpoint()`` (``recovery.resync``). So each replica node whose
records say ``replicated`` is asked (one ``stat`` round trip, all of them in parallel) what it keeps of
this node's files: ``lost`` where it lacks one of them at its size, ``unreachable`` where it does not
answer or has not announced its server yet (its copy cannot be read now; waiting may change that).
Targets still ``pending`` or ``retrying`` are not asked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from dcp_memstore.replication.asking import asking_pool, warn_unanswered
from dcp_memstore.replication.cluster_status import LOST, UNREACHABLE
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import PeerAddress, format_peer
from dcp_memstore.store.threads import run_parallel

log = logging.getLogger(__name__)


def confirm(
    states: dict[str, str],
    files: dict[str, int],
    servers: Mapping[str, PeerAddress],
    source: str,
    transport: TcpTransport,
    checkpoint_id: str,
    deadline: float | None = None,
) -> dict[str, str]:
    """``states`` (per replica node of node ``source``, this one, as ``ReplicaRecords.peer_states`` gives
    them) with each ``replicated`` checked against what that node answers it keeps of ``files`` ({file:
    size}, this node's files of checkpoint ``checkpoint_id``), asking it at its server in ``servers`` (by
    node name; one not there has not announced it): ``lost`` or ``unreachable`` where it does not keep them
    (see the module docstring). ``deadline``: ``time.monotonic()`` by which each must have answered (a
    wait's; None: the transport's timeout for each wait for it)."""
    asked = [name for name, state in states.items() if state == "replicated"]

    def check(name: str) -> str:
        addr = servers.get(name)
        if addr is None:
            return UNREACHABLE
        try:
            reply = transport.stat(addr, checkpoint_id, deadline=deadline)
        except (ConnectionError, TimeoutError, OSError, RuntimeError) as e:
            warn_unanswered(
                log, addr, e, "cannot ask %s whether it still keeps the replica of checkpoint %r: %s",
                format_peer(addr), checkpoint_id, e,
            )  # fmt: skip
            return UNREACHABLE
        there = reply["replicas"].get(source, {})
        return "replicated" if all(there.get(f) == size for f, size in files.items()) else LOST

    answers = run_parallel(check, asked, len(asked), pool=asking_pool(deadline))
    return {**states, **dict(zip(asked, answers, strict=True))}
