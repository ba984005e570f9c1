"""The replicator: one background thread per process that sends this node's committed checkpoint files to
the nodes keeping their replicas (``Peers.targets``), and what it has done, for ``store.status``.

Each checkpoint committed on a node with replication on carries the retention hold ``replicate`` from
before it is visible; it is released once every file of the checkpoint on this node is acknowledged by
every target (the target verified the checksum and renamed the file into place). So a checkpoint is never
evicted while a replica is owed, and training is never blocked: a dead or slow peer only leaves the
checkpoint under-replicated (state ``retrying`` with the error), retried with exponential backoff.

Work is split by file: the local rank equal to the file's writer rank modulo the ranks per node sends it,
to the server of the same local rank on the target node. Records (``TierProgress``, tier ``replicate``):
``done`` group ``to-node<t>`` per target, state ``<rank>-node<t>`` per process and target.

Once every file is acknowledged, the checkpoint takes the ``awaiting-peers`` hold before ``replicate`` is
released, and local rank 0's replicator tells every other node that this node's files of it are
replicated (``safe_point``), retried with the same backoff until each peer acknowledged. A report
received, or this node's own, may move the job's safe point, which evicts what it no longer keeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from dcp_memstore.replication import safe_point
from dcp_memstore.replication.peers import Peers, node_name
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import Transport
from dcp_memstore.store import catalog, events
from dcp_memstore.store.layout import MANIFEST, StoreLayout, file_rank
from dcp_memstore.store.manifest import Manifest
from dcp_memstore.store.threads import yield_cpu_to_training
from dcp_memstore.store.tier_progress import TierProgress

log = logging.getLogger(__name__)

REPLICA_HOLD = "replicate"
POLL_S = 0.2
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
_manifest_files: dict[tuple[str, str, float], dict[str, int]] = {}  # (job dir, checkpoint, committed_at)


def to(target: int) -> str:
    """The records group of files acknowledged by node ``target``."""
    return f"to-{node_name(target)}"


class ReplicaRecords(TierProgress):
    """What has been replicated of checkpoint ``checkpoint_id`` of this node, and to which nodes."""

    def __init__(self, layout: StoreLayout, checkpoint_id: str) -> None:
        super().__init__(layout, checkpoint_id, "replicate")

    def owed(self) -> bool:
        return REPLICA_HOLD in catalog.holds(self.layout, self.checkpoint_id)

    def hold(self) -> None:
        catalog.hold(self.layout, self.checkpoint_id, REPLICA_HOLD, {"at": time.time()})

    def missing(self, files: dict[str, int], target: int) -> set[str]:
        return set(files) - self.done_files(to(target))

    def settle(self, files: dict[str, int], targets: list[int], node: str, committed_at: float) -> bool:
        """Release the hold if every file reached every target, once this node (``node``) awaits its
        peers' replicas of the save committed at ``committed_at`` (see ``safe_point``); return whether it
        released one."""
        if not self.owed() or any(self.missing(files, t) for t in targets):
            return False
        try:
            safe_point.await_peers(self.layout, self.checkpoint_id, node, committed_at)
        except FileNotFoundError:
            return False  # deleted meanwhile
        catalog.release(self.layout, self.checkpoint_id, REPLICA_HOLD)
        return True

    def peer_states(self, files: dict[str, int], targets: list[int]) -> dict[str, str]:
        """Per target node: ``replicated``, ``pending`` or ``retrying: <error>``."""
        retrying = {s.get("target"): s.get("error") for s in self.states() if s.get("state") == "retrying"}
        out = {}
        for t in targets:
            if not self.missing(files, t):
                out[node_name(t)] = "replicated"
            elif t in retrying:
                out[node_name(t)] = f"retrying: {retrying[t]}"
            else:
                out[node_name(t)] = "pending"
        return out


def manifest_files(layout: StoreLayout, checkpoint_id: str) -> dict[str, int]:
    """Every data file committed checkpoint ``checkpoint_id`` lists (on all nodes), with the bytes of it
    that hold data; empty if the checkpoint is gone. Cached per save."""
    rec = catalog.read_commit(layout, checkpoint_id)
    if rec is None:
        return {}
    key = (str(layout.job_dir), checkpoint_id, rec.committed_at)
    listed = _manifest_files.get(key)
    if listed is None:
        try:
            listed = Manifest.read(layout.checkpoint_dir(checkpoint_id) / MANIFEST).files
        except (FileNotFoundError, ValueError):
            return {}
        if len(_manifest_files) > 256:
            _manifest_files.clear()
        _manifest_files[key] = listed
    return listed


def node_files(layout: StoreLayout, checkpoint_id: str) -> dict[str, int]:
    """The data files of committed checkpoint ``checkpoint_id`` present on this node (those its manifest
    lists; other nodes hold the rest), with their sizes. Empty if the checkpoint is gone."""
    d = layout.checkpoint_dir(checkpoint_id)
    out = {}
    for name in manifest_files(layout, checkpoint_id):
        try:
            out[name] = os.stat(d / name).st_size
        except FileNotFoundError:
            continue
    return out


class Replicator:
    """Sends this node's files of every committed checkpoint that owes replicas (see module docstring).

    ``peers`` is called (in the thread) to get the job's ``Peers``; it may block until every rank has
    announced its server. ``transport`` moves files; ``control`` carries the reports (``safe_point``)."""

    def __init__(
        self,
        layout: StoreLayout,
        peers: Callable[[], Peers],
        transport: Transport,
        keep: int,
        control: TcpTransport,
    ) -> None:
        self.layout, self._peers, self.transport, self.keep = layout, peers, transport, keep
        self.control = control
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._learned = threading.Event()  # set once ``peers`` returned (or failed)
        self._retry_at: dict[int, tuple[float, float]] = {}  # target -> (next attempt, current backoff)
        self._report_retry_at: dict[int, tuple[float, float]] = {}  # peer node -> the same, for reports
        self._thread = threading.Thread(target=self._run, name="dcp_memstore_replicate", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look for owed replicas now instead of at the next poll (a commit, a lost replica)."""
        self._wake.set()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread; a transfer in flight ends when the transport is closed (by the caller). A
        thread still learning the peers (a rank that never announced its server makes that wait up to
        the lookup's timeout) is not waited for: it has sent nothing, and sends nothing once it learns
        them (a daemon, it ends then, or with the process)."""
        self._stop.set()
        self._wake.set()
        if self._learned.is_set():
            self._thread.join(timeout)

    def _run(self) -> None:
        yield_cpu_to_training()
        try:
            peers = self._peers()
        except Exception:  # noqa: BLE001 - no peers, no replication; saves go on
            if not self._stop.is_set():  # closed meanwhile: nothing is off that was wanted
                log.exception("replicator: cannot learn the job's peers; replication is off in this process")
            return
        finally:
            self._learned.set()
        while not self._stop.is_set():
            for rec in catalog.committed(self.layout):
                if self._stop.is_set():
                    break
                try:
                    self._replicate(peers, rec)
                    self._report(peers, rec)
                except Exception:  # noqa: BLE001 - e.g. deleted under us; the thread must go on
                    log.exception("replicator: checkpoint %r", rec.checkpoint_id)
            self._wake.wait(POLL_S)
            self._wake.clear()

    def _replicate(self, peers: Peers, rec: catalog.CommitRecord) -> None:
        """Send what this process owes of save ``rec`` and record what its targets acknowledged. Records
        live in the checkpoint's directory, by id: once the checkpoint is deleted (and perhaps saved again
        under its id) during a transfer, the bytes sent may be the old save's, or a file its pool gave to a
        new save, so nothing more is recorded; the next pass sends the new save's files."""
        cid = rec.checkpoint_id
        records = ReplicaRecords(self.layout, cid)
        if not records.owed() or not catalog.same_save(self.layout, rec):
            return
        files = node_files(self.layout, cid)
        targets = peers.targets()
        sent: dict[int, tuple[int, float]] = {}  # target -> bytes sent, seconds spent
        for t in targets:
            if self._stop.is_set() or time.monotonic() < self._retry_at.get(t, (0.0, 0.0))[0]:
                continue
            mine = sorted(f for f in records.missing(files, t) if peers.pushes(file_rank(f)))
            nbytes, seconds = 0, 0.0
            for f in mine:
                start = time.perf_counter()
                try:
                    self.transport.put_file(
                        peers.server(t), peers.name, cid, f, self.layout.checkpoint_dir(cid) / f
                    )
                except FileNotFoundError:
                    return  # evicted or deleted meanwhile
                except Exception as e:  # noqa: BLE001 - any failure: this peer is retried later
                    if not catalog.same_save(self.layout, rec):
                        return
                    seconds += time.perf_counter() - start
                    self._failed(records, peers, t, cid, f, e, nbytes, seconds)
                    break
                if not catalog.same_save(self.layout, rec):
                    return
                records.mark_done(f, to(t))
                self._retry_at.pop(t, None)
                nbytes, seconds = nbytes + files[f], seconds + time.perf_counter() - start
            else:
                if mine:
                    records.report(f"{peers.node.rank}-{node_name(t)}", "replicated", target=t)
                    sent[t] = (nbytes, seconds)
        if records.settle(files, targets, peers.name, rec.committed_at):
            # this report may complete a newer safe point; it may have been kept past its turn for this
            safe_point.advance(self.layout, peers.node.nnodes, self.keep)
        if sent:
            ids = (r.checkpoint_id for r in catalog.committed(self.layout))
            owed = tuple(c for c in ids if ReplicaRecords(self.layout, c).owed())  # for the events
            for t, (nbytes, seconds) in sent.items():
                events.emit(
                    self.layout, "replicate", cid, peers.node.rank, seconds,
                    nbytes=nbytes, target=node_name(t), owed=owed,
                )  # fmt: skip

    def _report(self, peers: Peers, rec: catalog.CommitRecord) -> None:
        """Tell every other node that hasn't acknowledged it yet that this node's files of save ``rec``
        are replicated (local rank 0 only; a peer that fails is retried with backoff)."""
        if peers.node.local_rank != 0:
            return
        reports = safe_point.Reports(self.layout, rec.checkpoint_id)
        if peers.name not in reports.reporters(rec.committed_at):
            return
        told = reports.done_files("told")
        for n in peers.other_nodes():
            if node_name(n) in told or time.monotonic() < self._report_retry_at.get(n, (0.0, 0.0))[0]:
                continue
            try:
                self.control.replicated(peers.server(n, 0), rec.checkpoint_id, peers.name, rec.committed_at)
            except Exception as e:  # noqa: BLE001 - any failure: this peer is told later
                delay = _backoff(self._report_retry_at, n)
                log.warning(
                    "telling %s that checkpoint %r is replicated failed, retrying in %.1f s: %s",
                    node_name(n), rec.checkpoint_id, delay, e,
                )  # fmt: skip
                continue
            self._report_retry_at.pop(n, None)
            if not catalog.same_save(self.layout, rec):
                return
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                reports.mark_done(node_name(n), "told")

    def _failed(
        self,
        records: ReplicaRecords,
        peers: Peers,
        t: int,
        cid: str,
        f: str,
        e: Exception,
        nbytes: int,
        seconds: float,
    ) -> None:
        """Sending file ``f`` of ``cid`` to node ``t`` failed after ``nbytes`` of its other files went in
        ``seconds``: recorded, logged and reported, and the node put off (backoff)."""
        delay = _backoff(self._retry_at, t)
        records.report(f"{peers.node.rank}-{node_name(t)}", "retrying", str(e), target=t)
        log.warning(
            "replicating checkpoint %r (file %s) to %s failed, retrying in %.1f s: %s",
            cid, f, node_name(t), delay, e,
        )  # fmt: skip
        events.emit(
            self.layout, "replicate", cid, peers.node.rank, seconds,
            nbytes=nbytes, target=node_name(t), ok=False, error=str(e), retry_s=delay,
        )  # fmt: skip


def _backoff(retry_at: dict[int, tuple[float, float]], node: int) -> float:
    """Put off the next attempt towards ``node`` in ``retry_at`` (doubling from BACKOFF_START_S up to
    BACKOFF_MAX_S); return the delay."""
    _, delay = retry_at.get(node, (0.0, BACKOFF_START_S / 2))
    delay = min(BACKOFF_MAX_S, delay * 2)
    retry_at[node] = (time.monotonic() + delay, delay)
    return delay
