"""The replication face of ``MemStore``: starting this process's replication service in a multi-node job,
committing a checkpoint on every node (the coordinator's side and each node's), repairing a node's copy
in ``latest_checkpoint()``, reading from other nodes' memory, and waiting for replicas.

A mixin of ``MemStore`` (it uses the store's layout and options), kept apart so that ``memstore.py`` holds
the node-local store (``persisting.py`` the persistence face), and everything that talks to other nodes
is here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from dcp_memstore.answer_deadline import (
    answer_by,
    look_deadline,
    optional_timeout,
    poll_pause,
    unanswered_since,
)
from dcp_memstore.errors import CommitError, NodesUnansweredError
from dcp_memstore.persist.persister import local_rank_and_size
from dcp_memstore.persist.progress import Progress
from dcp_memstore.replication import safe_point
from dcp_memstore.replication.cluster_read import ClusterCheckpoint
from dcp_memstore.replication.cluster_status import cluster_replicas
from dcp_memstore.replication.peers import Peers, default_bind_host, node_name
from dcp_memstore.replication.placement import NodeInfo, replica_targets
from dcp_memstore.replication.recovery import inventory, orphans, restore, resync, take_over, unheld
from dcp_memstore.replication.replica_check import confirm
from dcp_memstore.replication.replicator import ReplicaRecords, node_files
from dcp_memstore.replication.service import ReplicationService, job_node_info
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.replication.transport import format_peer
from dcp_memstore.status import NOT_IN_MEMORY, CheckpointStatus, replication_of
from dcp_memstore.store import catalog, events
from dcp_memstore.store.collective import dist_active
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import MANIFEST, PREPARED
from dcp_memstore.store.manifest import Manifest
from dcp_memstore.store.records import write_atomic, write_record
from dcp_memstore.store.threads import run_parallel

log = logging.getLogger("dcp_memstore.memstore")
_service_lock = threading.Lock()


def _on_other_nodes(
    transport: TcpTransport, peers: Peers, phase: str, record: Any, manifest: bytes = b""
) -> list[int | str]:
    """One commit phase on every other node (local rank 0's server), in parallel: per node its next
    sequence number, or why it failed."""

    def request(node: int) -> int | str:
        addr = peers.server(node, 0)
        try:
            return transport.commit(addr, record.checkpoint_id, phase, record.to_record(), manifest)
        except (ConnectionError, TimeoutError, OSError, RuntimeError) as e:
            return f"node {node} ({format_peer(addr)}): {str(e).rstrip('.')}"

    others = peers.other_nodes()
    return run_parallel(request, others, len(others), pool="commit")


def _committed(look: Callable[[], ClusterCheckpoint | None]) -> Callable[[], ClusterCheckpoint | None]:
    """What ``look`` (a cached ``_cluster_look``) gives where the checkpoint is committed on some node that
    answered, else None: the ``cluster`` argument of the status queries."""

    def committed() -> ClusterCheckpoint | None:
        cluster = look()
        return cluster if cluster is not None and cluster.available else None

    return committed


class ReplicatingStore:
    """Replication methods of ``MemStore`` (see the module docstring)."""

    def _repair(
        self,
        service: ReplicationService,
        newest: str | None,
        in_memory: dict[str, tuple[float, int, int]],
        inventories: dict[int, dict],
    ) -> None:
        """Commit here what this node prepared and another node committed (see ``_finish_prepared``).
        Restore on this node, from the copies and replicas other nodes hold, ``newest`` and every
        checkpoint some node still owes to persistent storage (so that this node uploads its share of it),
        if readable from the cluster but not committed here; owe here what another node owes; take over
        the files of an owed checkpoint whose node left the job from the replicas kept here (see
        ``recovery.orphans``); report an owed checkpoint whose files no node holds. Then owe again the
        replicas other nodes lost (see ``recovery``). Failures are logged: reads then fetch per file."""
        self._finish_prepared(inventories)
        peers = service.peers()
        owed = set() if self.target is None else {c for inv in inventories.values() for c in inv["owed"]}
        restorable = sorted(owed & in_memory.keys(), key=lambda cid: in_memory[cid][1])
        for cid in dict.fromkeys([newest, *restorable]):  # the one the job loads first, then the oldest
            if cid in in_memory and catalog.read_commit(self.layout, cid) is None:
                self._restore(service, cid, in_memory[cid], owe=cid in owed)
        for cid in sorted(owed):
            if catalog.read_commit(self.layout, cid) is None:
                continue
            progress = Progress(self.layout, cid, self.target.url)
            if cid in in_memory and not progress.owed():
                progress.request("owed by another node")
            if not progress.owed():
                continue
            restoring = {  # the nodes that restored it above (every node does the same)
                node: peers.node_ranks(node)
                for node, inv in inventories.items()
                if cid in in_memory and cid not in (c for c, *_ in inv["committed"])
            }
            self._take_over(cid, inventories, peers.node.node_rank, restoring)
            if cid not in in_memory:
                self._report_unheld(cid, unheld(list(inventories.values()))[cid][1])
        if self.replicas:
            resync(self.layout, peers, inventories)
        service.wake()
        if owed and self._persister is not None:
            self._persister.wake()

    def _finish_prepared(self, inventories: dict[int, dict]) -> None:
        """Commit here each checkpoint this node prepared whose commit never reached it (the coordinator was
        killed between the two phases, or the message was lost) and that another node of the job has
        committed as the same save (its ``committed_at``), with that node's record (logged)."""
        saves = {(c[0], c[1]): c for inv in inventories.values() for c in inv["committed"]}
        for cid, prepared in catalog.prepared(self.layout).items():
            save = saves.get((cid, prepared.get("committed_at")))
            if save is not None:
                _, at, seq, nbytes, _ = save
                self._commit_here(cid, "commit", {"seq": seq, "committed_at": at, "nbytes": nbytes}, b"")
                log.info("checkpoint %r: committed here, as on the nodes its commit reached", cid)

    def _take_over(
        self, cid: str, inventories: dict[int, dict], node: int, restoring: dict[int, range]
    ) -> None:
        """Move into this node's copy of owed checkpoint ``cid`` the files of ranks no node of the job
        holds any more that ``recovery.orphans`` gives node ``node`` (this one) from its replicas, so that
        they are uploaded (``restoring``: the nodes that restored ``cid`` in this repair, with their
        ranks); logged."""
        moved = take_over(self.layout, cid, orphans(cid, inventories, restoring).get(node, {}))
        if moved:  # an upload that failed on one of them missing (a take-over cut short) tries again
            Progress(self.layout, cid, self.target.url).clear_failures()
            log.info(
                "checkpoint %r: uploading files %s of ranks that left the job, from the replicas kept here",
                cid,
                moved,
            )

    def _take_over_alone(self, process_group: Any) -> None:
        """In a job of one node (``latest_checkpoint``), take over the files of owed checkpoints whose
        nodes left the job from the replicas kept here: no other node will upload them. Local rank 0
        does it; the node's other ranks wait in a barrier (their loads read those files)."""
        try:
            if local_rank_and_size()[0] == 0:
                inventories = {0: inventory(self.layout, self.target.url if self.target else None)}
                for cid in self._owed():
                    self._take_over(cid, inventories, 0, {})
        except Exception:  # noqa: BLE001 - the other ranks wait in the barrier; the upload waits (queued)
            log.exception("taking over the files of ranks that left the job failed")
        finally:
            if dist_active():
                dist.barrier(process_group)

    def _restore(
        self, service: ReplicationService, cid: str, record: tuple[float, int, int], owe: bool
    ) -> None:
        """Restore ``cid`` on this node from its peers (``owe``: owed to persistent storage here too, from
        before it is visible); a failure is logged."""
        peers = service.peers()
        progress = Progress(self.layout, cid, self.target.url) if owe else None
        start = time.perf_counter()
        try:
            nbytes = restore(
                self.layout, peers, service.control, cid, record, self.io_threads,
                functools.partial(progress.request, "owed by another node") if progress else None,
            )  # fmt: skip
            events.emit(
                self.layout, "restore", cid, peers.node.rank, time.perf_counter() - start,
                nbytes=nbytes,
            )  # fmt: skip
        except (FileNotFoundError, ConnectionError, TimeoutError, OSError, RuntimeError, ValueError) as e:
            log.warning(
                "cannot restore checkpoint %r on %s from its peers (reads fetch per file%s): %s",
                cid,
                peers.name,
                "; its upload waits for this node's share" if owe else "",
                e,
            )
            events.emit(
                self.layout, "restore", cid, peers.node.rank, time.perf_counter() - start,
                ok=False, error=str(e),
            )  # fmt: skip

    def _cluster_copy(self, cid: str) -> ClusterCheckpoint | None:
        """``cid`` as the other nodes' memory holds it (with their upload states towards this store's
        ``persist_to``), or None (single node, or committed on no node that answered)."""
        return _committed(functools.partial(self._cluster_look, cid))()

    def _cluster_look(self, cid: str) -> ClusterCheckpoint | None:
        """What every node's memory holds of ``cid``, committed there or not, and which nodes did not
        answer (under a wait's deadline, ``answer_by``, each gets until then); None on a single node."""
        control = self._control()
        if control is None:
            return None
        url = self.target.url if self.target is not None else None
        return ClusterCheckpoint(self.layout, *control, cid, url, deadline=look_deadline())

    @staticmethod
    def _unanswered(cluster: ClusterCheckpoint | None) -> str:
        """What to add to an error saying that no node's memory holds a checkpoint, after the look at it
        ``cluster`` (``_cluster_look``): the nodes that did not answer, which may hold it ("" if all did,
        and then the error is a FileNotFoundError, else a NodesUnansweredError)."""
        if cluster is None or not cluster.unreachable:
            return ""
        peers, one = cluster.peers, len(cluster.unreachable) == 1
        nodes = ", ".join(f"{n} ({format_peer(peers.server(n))})" for n in cluster.unreachable)
        return (
            f"; {'node' if one else 'nodes'} {nodes} did not answer (down, hung or cut off), so whether "
            f"{'it holds' if one else 'they hold'} the checkpoint cannot be told"
        )

    def replication(self) -> ReplicationService | None:
        """This process's replication service: started on the first call after ``init_process_group`` in
        a job that spans several nodes (the constructor, a save or ``latest_checkpoint`` make that call);
        None on a single node, before the process group exists, and in DCP's checkpoint process."""
        if self._service is not None or self._single_node or self._is_copy or self._closed:
            return self._service
        with _service_lock:
            node = job_node_info()
            if self._service is not None:
                pass
            elif node is not None and not node.multi_node:
                self._single_node = True
            elif node is not None:
                self._service = ReplicationService(
                    self.layout,
                    node,
                    k=self.replicas,
                    bind_host=self.replication_bind or default_bind_host(),
                    secret=self._secret,
                    transport=self.transport,
                    on_commit=self._commit_here,
                    on_replicated=functools.partial(self._replicated_elsewhere, nnodes=node.nnodes),
                    replication_state=functools.partial(self._replication_state, node=node),
                    timeout_s=self.stage_timeout_s,
                    io_timeout_s=self.replication_timeout_s,
                    keep=self.keep_in_memory,
                )
        return self._service

    def _control(self) -> tuple[Peers, TcpTransport] | None:
        """The job's peers and a transport for control requests, in a multi-node job (else None)."""
        service = self.replication()
        if service is not None:
            return service.peers(), service.control
        if self._peers is None:
            return None
        if self._control_transport is None:
            self._control_transport = TcpTransport(
                self.job_id, self._peers.secret, self.replication_timeout_s
            )
        return self._peers, self._control_transport

    def _node(self) -> NodeInfo | None:
        """This process's place in a multi-node job: its replication service's (in DCP's checkpoint
        process, the training process's peers'); None before either exists."""
        return self._service.node if self._service is not None else self._peers.node if self._peers else None

    def _replicating(self, node: NodeInfo | None = None) -> bool:
        """Whether this node's checkpoints are replicated (several nodes and ``replicas`` >= 1), this
        process's place in the job being ``node`` (default: ``_node()``)."""
        node = node if node is not None else self._node()
        return bool(self.replicas) and node is not None and node.multi_node

    def _replica_targets(self, node: NodeInfo | None = None) -> list[int]:
        """The nodes this node's files are replicated to (where ``_replicating``), from this process's
        place in the job alone (``node``, default ``_node()``): not waiting for the peers' server
        addresses, which a rank that never announced its server makes last ``stage_timeout_s``."""
        node = node if node is not None else self._node()
        return replica_targets(node.node_rank, node.nnodes, self.replicas)

    def prepare_everywhere(self, record: catalog.CommitRecord, manifest: bytes) -> catalog.CommitRecord:
        """Called by the coordinator before it commits: hand the checkpoint's manifest to every other node
        (nothing becomes visible there yet) and return ``record`` with the sequence number every node
        agrees on (the highest any node would give next). If a node does not take it, abort it on all
        and raise CommitError naming the nodes."""
        control = self._control()
        if control is None:
            return record
        peers, transport = control
        replies = _on_other_nodes(transport, peers, "prepare", record, manifest)
        errors = [r for r in replies if isinstance(r, str)]
        if errors:
            _on_other_nodes(transport, peers, "abort", record)
            raise CommitError(
                f"checkpoint {record.checkpoint_id!r} was not committed: {len(errors)} of {len(replies)} "
                f"other node(s) did not take it: {'; '.join(errors)}. The previous checkpoint stays the "
                "newest; save again once every node is reachable"
            )
        return dataclasses.replace(record, seq=max([record.seq, *replies]))

    def commit_everywhere(self, record: catalog.CommitRecord) -> None:
        """Called by the coordinator once it committed: commit on every other node (prepared before).
        A node that misses it keeps its part uncommitted (logged); that node then cannot serve it."""
        control = self._control()
        if control is None:
            return
        peers, transport = control
        for err in _on_other_nodes(transport, peers, "commit", record):
            if isinstance(err, str):
                log.warning("checkpoint %r committed, but not on %s", record.checkpoint_id, err)

    def _commit_here(self, checkpoint_id: str, phase: str, record: dict, manifest: bytes) -> int:
        """The peer server's commit handler, on a node other than the coordinator's: ``prepare`` checks
        and stores the manifest of a checkpoint this node's ranks wrote part of, ``commit`` makes it
        visible with the coordinator's record and applies retention, ``abort`` discards it. Returns this
        node's next sequence number."""
        cid = validate_name(checkpoint_id)
        directory = self.layout.checkpoint_dir(cid)
        done = catalog.read_commit(self.layout, cid)
        if phase == "abort":
            if done is None:
                catalog.discard(self.layout, directory)
        elif done is not None:
            if (done.seq, done.committed_at) != (record["seq"], record["committed_at"]):
                raise ValueError(f"checkpoint {cid!r} is already committed on this node by another save")
        elif phase == "prepare":
            if not directory.is_dir():
                raise ValueError(f"no rank of this node wrote checkpoint {cid!r}")
            # refuses a damaged or malformed one, or one naming files outside the checkpoint
            Manifest.decode(manifest, f"the manifest of checkpoint {cid!r} from the coordinator", cid)
            write_atomic(directory / MANIFEST, manifest)
            # which save this is, should the commit never arrive: a restart finishes it (``_repair``);
            # and this node's next sequence number, after which newer commits supersede it (``evict``)
            saved = {k: record[k] for k in ("committed_at", "nbytes")}
            write_record(directory / PREPARED, {**saved, "next_seq": catalog.next_seq(self.layout)})
        else:  # commit
            if not (directory / MANIFEST).exists():
                raise ValueError(f"checkpoint {cid!r} was not prepared on this node")
            with catalog.commit_lock(self.layout):  # not while retention discards it as superseded
                self.prepare_commit(cid, record["seq"])
                catalog.commit(
                    self.layout, cid, record["nbytes"], seq=record["seq"], committed_at=record["committed_at"]
                )
                (directory / PREPARED).unlink(missing_ok=True)
            self.after_commit()
        return catalog.next_seq(self.layout)

    def _replicated_elsewhere(self, checkpoint_id: str, node: str, committed_at: float, nnodes: int) -> None:
        """The peer server's handler of a report from node ``node``: its files of the save of
        ``checkpoint_id`` committed at ``committed_at`` are replicated. Recorded if this node has that
        save (committed, or prepared and its commit on the way), which may move the safe point
        (``safe_point``, over the job's ``nnodes`` nodes: given, as the server answers before the service
        that runs it is this store's); a report on a save this node no longer has (evicted, deleted,
        saved again) is dropped: its copy here cannot serve a restore."""
        cid = validate_name(checkpoint_id)
        done = catalog.read_commit(self.layout, cid)
        if done is not None:
            ours = done.committed_at == committed_at
        else:
            ours = catalog.prepared(self.layout).get(cid, {}).get("committed_at") == committed_at
        if ours and safe_point.Reports(self.layout, cid).record(node, committed_at):
            safe_point.advance(self.layout, nnodes, self.keep_in_memory)

    def _replication_state(self, checkpoint_id: str, node: NodeInfo | None = None) -> dict[str, str] | None:
        """Per replica node, the replication state of this node's files of ``checkpoint_id``
        (``replicated``, ``pending`` or ``retrying: <error>``); None if this node's memory does not hold
        it or its checkpoints are not replicated. Also what this node's server tells peers (``stat``),
        with its ``node``: the server answers before the service that runs it is this store's."""
        cid = validate_name(checkpoint_id)
        if not self._replicating(node) or catalog.read_commit(self.layout, cid) is None:
            return None
        return ReplicaRecords(self.layout, cid).peer_states(
            node_files(self.layout, cid), self._replica_targets(node)
        )

    def _with_replication(
        self, st: CheckpointStatus, cluster: Callable[[], ClusterCheckpoint | None]
    ) -> CheckpointStatus:
        """``st`` with its replication (see CheckpointStatus): from this node's records where its memory
        holds the checkpoint, else from what the other nodes' memory holds of it (``cluster``)."""
        if not self._replicating():
            return st
        replicas = self._replication_state(st.checkpoint_id) if st.in_memory else None
        if replicas is not None:
            replicas = self._confirmed(st.checkpoint_id, replicas)
        else:
            held = cluster()
            if held is None:
                return dataclasses.replace(st, replication=NOT_IN_MEMORY)
            replicas = cluster_replicas(held)
        return dataclasses.replace(st, replication=replication_of(replicas), replicas=replicas)

    def _confirmed(self, cid: str, replicas: dict[str, str]) -> dict[str, str]:
        """This node's replication ``replicas`` of ``cid`` with each ``replicated`` checked against what
        its replica node keeps now (``replica_check``); not waiting for a replica node's rank that has
        not announced its server (that one is ``unreachable``)."""
        node = self._node()
        targets = self._replica_targets(node)
        if self._service is not None:
            servers, control = self._service.servers_now(targets), self._service.control
        else:  # DCP's checkpoint process: the training process's peers
            peers, control = self._control()
            servers = {t: peers.server(t) for t in targets}
        servers_by_name = {node_name(t): addr for t, addr in servers.items()}
        files, me = node_files(self.layout, cid), node_name(node.node_rank)
        return confirm(replicas, files, servers_by_name, me, control, cid, look_deadline())

    def _not_in_memory(self, cid: str, cluster: ClusterCheckpoint | None) -> NoReturn:
        """Raise that no node's memory holds ``cid`` (after the look ``cluster``), so none of its files is
        replicated: NodesUnansweredError naming the nodes that did not answer, if some did not."""
        unanswered = self._unanswered(cluster)
        if unanswered:
            raise NodesUnansweredError(
                f"checkpoint {cid!r} is in the memory of no node that answered, so none of its files is "
                f"known to be replicated{unanswered}"
            )
        here = self.list_checkpoints() or "none"
        raise FileNotFoundError(
            f"checkpoint {cid!r} is in no node's memory (committed here: {here}; persisted: "
            f"{self._upload_status(cid).persist}), so none of its files is replicated"
        )

    def wait_replicated(self, checkpoint_id: str, timeout: float | None = None) -> CheckpointStatus:
        """Block until ``checkpoint_id`` is replicated (see CheckpointStatus): where this node's memory
        holds it, until every replica node acknowledged this node's files; where it does not, until every
        file of it is kept by its node and that node's replica nodes. Returns at once when replication is
        off (one node, or ``replicas=0``). FileNotFoundError if no node's memory holds it (where some
        nodes did not answer, they are asked again for ``replication_timeout_s``, or until the timeout
        ends), or if some files will stay under-replicated whatever the wait (``stalled``: a replica
        acknowledged and lost since, a node's files that only replicas keep); TimeoutError after
        ``timeout`` seconds (None or ``math.inf``: no limit), saying which replicas are missing and why.
        Polls only the replication (not the persistent copy), at most a few times a second."""
        timeout = optional_timeout("timeout", timeout)
        cid = validate_name(checkpoint_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause, silent = 0.05, None  # silent: since when nodes have gone unanswered in a row
        while True:
            self.check_open()
            in_memory = catalog.read_commit(self.layout, cid) is not None
            look = functools.cache(functools.partial(self._cluster_look, cid))
            try:
                with answer_by(deadline):  # a node that does not answer holds a look until then at most
                    st = self._with_replication(CheckpointStatus(cid, in_memory, "off"), _committed(look))
                    if st.replication in ("off", "replicated"):  # the replica nodes are not asked again
                        up = self._persist_status(cid, _committed(look))
                        return dataclasses.replace(up, replication=st.replication, replicas=st.replicas)
                    if st.replication == NOT_IN_MEMORY:
                        self._not_in_memory(cid, look())
            except NodesUnansweredError as e:  # one of them may hold it: asked again for a while
                what = f"checkpoint {cid!r} not replicated after {timeout} s"
                silent = unanswered_since(e, silent, self.replication_timeout_s, deadline, what)
            else:
                silent = None
                if st.stalled:
                    raise FileNotFoundError(
                        f"checkpoint {st.checkpoint_id!r} is not replicated, and waiting does not make it "
                        f"replicated: {st.stalled} (all: {st.replicas}). Nothing sends a lost replica "
                        "again (acknowledged, but its node no longer keeps it: that node was replaced or "
                        "wiped, or deleted or evicted its copy), nor replicates the files of a node that "
                        "does not hold the checkpoint (kept only as replicas): latest_checkpoint() on every "
                        "rank restores the newest checkpoint on the nodes that lack it and sends lost "
                        "replicas again; persist an older one (store.persist(id))"
                    )
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"checkpoint {st.checkpoint_id!r} not replicated after {timeout} s: {st.replicas}"
                    )
            pause = poll_pause(pause, deadline)
