"""Reading a checkpoint from the cluster's memory: which node holds each file (its own copy, or a replica
it keeps for another node), and fetching files from there.

Used when this node lacks files of a checkpoint: a node replaced with an empty tmpfs, a file lost or
corrupt here, or a load with another number of nodes or ranks than the save (then files another node's
ranks wrote are needed here). Fetched files are checksum-verified in transit, then every item again
against the manifest when read.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

from dcp_memstore.replication.asking import asking_pool, warn_unanswered
from dcp_memstore.replication.peers import Peers
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import format_peer
from dcp_memstore.store.layout import COMMITTED, MANIFEST, StoreLayout
from dcp_memstore.store.manifest import Manifest
from dcp_memstore.store.threads import run_parallel

log = logging.getLogger(__name__)


class ClusterCheckpoint:
    """Where the files of checkpoint ``checkpoint_id`` are in the job's memory, from asking every node's
    server once (nodes that do not answer are left out, with a warning, and listed in ``unreachable``).
    Files are fetched into this node's store ``layout``. With ``persist_to`` (a target's URL), also each
    node's upload state of its copy towards that target. ``deadline``: ``time.monotonic()`` by which every
    node must have answered (a wait's; None: the transport's timeout for each wait for a node)."""

    def __init__(
        self,
        layout: StoreLayout,
        peers: Peers,
        transport: TcpTransport,
        checkpoint_id: str,
        persist_to: str | None = None,
        deadline: float | None = None,
    ) -> None:
        self.layout, self.peers, self.transport = layout, peers, transport
        self.checkpoint_id, self.persist_to, self.deadline = checkpoint_id, persist_to, deadline
        # file -> [(node, replica source node name, or None for the node's own copy)], nearest node first
        self.holders: dict[str, list[tuple[int, str | None]]] = {}
        self.committed_on: list[int] = []
        # node where it is committed -> (its upload state, its error), with persist_to (Progress.upload_state)
        self.uploads: dict[int, tuple[str, str | None]] = {}
        # node where it is committed -> the replication state of its own files per replica node, or None
        # where that node does not replicate (``stat``)
        self.replication: dict[int, dict[str, str] | None] = {}
        self.unreachable: list[int] = []
        self.listed = 0  # how many data files (all nodes') the checkpoint's manifest lists
        me = peers.node.node_rank
        order = [(me + d) % peers.node.nnodes for d in range(peers.node.nnodes)]
        answers = run_parallel(self._stat, order, len(order), pool=asking_pool(deadline))
        for node, st in zip(order, answers, strict=True):
            if st is None:
                self.unreachable.append(node)
                continue
            if st["committed"]:
                self.committed_on.append(node)
                self.replication[node] = st["replication"]
                self.listed = max(self.listed, st["listed"])
                if st["upload"] is not None:
                    self.uploads[node] = (st["upload"]["state"], st["upload"]["error"])
                for f in st["own"]:
                    if f != COMMITTED:
                        self.holders.setdefault(f, []).append((node, None))
            for source, files in st["replicas"].items():
                for f in files:
                    self.holders.setdefault(f, []).append((node, source))

    def _stat(self, node: int) -> dict | None:
        addr = self.peers.server(node)
        try:
            return self.transport.stat(addr, self.checkpoint_id, self.persist_to, self.deadline)
        except (ConnectionError, TimeoutError, OSError, RuntimeError) as e:
            warn_unanswered(
                log, addr, e, "cannot ask %s what it holds of checkpoint %r: %s", format_peer(addr),
                self.checkpoint_id, e,
            )  # fmt: skip
            return None

    @property
    def available(self) -> bool:
        return bool(self.committed_on)

    def manifest(self, dest_dir: Path) -> Manifest:
        """The checkpoint's manifest, fetched from a node where it is committed into ``dest_dir``."""
        errors = []
        for node in self.committed_on:
            addr = self.peers.server(node)
            try:
                self.transport.get_file(
                    addr, self.checkpoint_id, MANIFEST, dest_dir / MANIFEST, layout=self.layout
                )
                return Manifest.read(dest_dir / MANIFEST, self.checkpoint_id)
            except (ConnectionError, TimeoutError, OSError, RuntimeError, ValueError) as e:
                errors.append(f"{format_peer(addr)}: {e}")
        raise FileNotFoundError(
            f"checkpoint {self.checkpoint_id!r} is committed on no reachable node"
            + (f" ({'; '.join(errors)})" if errors else "")
        )

    def has(self, file: str) -> bool:
        return file in self.holders

    @property
    def own_copy(self) -> tuple[int, None]:
        """The holder entry of this node's own copy (to skip when that copy is the one that failed)."""
        return (self.peers.node.node_rank, None)

    def fetch(
        self, file: str, dest: Path, exclude: Collection[tuple[int, str | None]] = ()
    ) -> tuple[int, str | None]:
        """Fetch ``file`` into ``dest`` (it appears once its transfer checksum matched) from the nearest
        node that holds it, skipping the holders in ``exclude``; return the holder used."""
        errors = []
        for node, source in self.holders.get(file, []):
            if (node, source) in exclude:
                continue
            addr = self.peers.server(node)
            try:
                self.transport.get_file(addr, self.checkpoint_id, file, dest, source, layout=self.layout)
                return (node, source)
            except (ConnectionError, TimeoutError, OSError, RuntimeError) as e:
                errors.append(f"{format_peer(addr)}: {e}")
        raise FileNotFoundError(
            f"file {file} of checkpoint {self.checkpoint_id!r} is held by no reachable node"
            + (f" ({'; '.join(errors)})" if errors else "")
        )
