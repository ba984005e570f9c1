"""``MemStore``: one job's node-local checkpoint store and its user-facing queries."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dcp_memstore.answer_deadline import NO_LIMIT_S, answer_by, optional_timeout
from dcp_memstore.errors import InsufficientSpaceError, NodesUnansweredError, PersistError
from dcp_memstore.persist import target_users
from dcp_memstore.persist.persister import Persister
from dcp_memstore.persist.progress import Progress, adopt_unnamed_holds, is_persist_hold
from dcp_memstore.persist.publish import remote_committed
from dcp_memstore.persist.remote_read import RemoteCheckpoint
from dcp_memstore.persist.target import PersistTarget
from dcp_memstore.persisting import PersistingStore
from dcp_memstore.replicating import ReplicatingStore
from dcp_memstore.replication import safe_point
from dcp_memstore.replication.auth import check_secret
from dcp_memstore.replication.cluster_read import ClusterCheckpoint
from dcp_memstore.replication.peers import Peers
from dcp_memstore.replication.recovery import inventory, readable
from dcp_memstore.replication.replicator import REPLICA_HOLD, ReplicaRecords
from dcp_memstore.replication.select import TRANSPORTS
from dcp_memstore.replication.service import ReplicationService
from dcp_memstore.replication.tcp import TcpTransport
from dcp_memstore.status import CheckpointStatus
from dcp_memstore.store import catalog, events, liveness, space
from dcp_memstore.store.collective import all_gather_records, dist_active
from dcp_memstore.store.environment import LOCAL_WORLD_SIZE_MEANING, env_int
from dcp_memstore.store.events import Event
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import COMMITTED, StoreLayout
from dcp_memstore.store.mapping import MAPPINGS
from dcp_memstore.store.pool import FilePool
from dcp_memstore.store.reserve import stop_reservations

log = logging.getLogger(__name__)
_REPLICATION_HOLDS = (REPLICA_HOLD, *safe_point.HOLDS)  # retention holds that replication places

DEFAULT_ROOT = "/dev/shm/dcp_memstore"
ENV_ROOT = "DCP_MEMSTORE_ROOT"
ENV_JOB_ID = "DCP_MEMSTORE_JOB_ID"
ENV_REPLICAS = "DCP_MEMSTORE_REPLICAS"


def resolve_root(root: str | os.PathLike | None) -> Path:
    """``root``, else ``$DCP_MEMSTORE_ROOT``, else /dev/shm/dcp_memstore. An empty value counts as unset, as
    for the job id: an empty string is no place for a store (it would be the current directory)."""
    given = "" if root is None else os.fspath(root) if isinstance(root, str | os.PathLike) else None
    if not isinstance(given, str):  # an int, bytes, a path of bytes: Path() would fail saying nothing of root
        raise TypeError(
            f"root must be a directory path (a str or os.PathLike), got {type(root).__name__}: {root!r}"
        )
    return Path(given or os.environ.get(ENV_ROOT) or DEFAULT_ROOT).expanduser()


def resolve_job_id(job_id: str | None) -> str:
    """``job_id``, else ``$DCP_MEMSTORE_JOB_ID``, else torchrun's run id, else "default" (validated; an
    invalid one from the environment is named with its variable, which the user may not know is read)."""
    if job_id is not None:
        return validate_name(job_id, "job id")
    for var in (ENV_JOB_ID, "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(var)
        if value and value != "none":
            try:
                return validate_name(value, "job id")
            except ValueError as e:
                raise ValueError(f"{e} It was read from ${var}; give a job id to use another") from None
    return "default"


def _default_io_threads() -> int:
    local_world = env_int("LOCAL_WORLD_SIZE", 1, LOCAL_WORLD_SIZE_MEANING)
    return max(1, min(4, (os.cpu_count() or 1) // max(1, local_world)))


@dataclass
class CheckpointSource:
    """Where a checkpoint can be read: this node's tmpfs (``local_dir``), the replicas this node keeps
    for other nodes (``replicas_dir``, see ``kept_replicas``), the other nodes' memory (``cluster``) and
    persistent storage (``remote``); the last two looked up on first use, None where the checkpoint is
    not (or there is no such tier). ``fetch_dir``: where files fetched from other nodes go on this node."""

    checkpoint_id: str
    local_dir: Path | None
    _find_remote: Any = field(repr=False, default=None)
    _find_cluster: Any = field(repr=False, default=None)
    fetch_dir: Path | None = None
    replicas_dir: Path | None = None

    def kept_replicas(self, file: str) -> list[Path]:
        """The directories of this checkpoint's replicas on this node that hold ``file`` (another node's
        file: e.g. the job now runs without that node). Only for a checkpoint committed here, whose
        replicas are dropped only with it, so the load's hold on it keeps them too."""
        if self.local_dir is None or self.replicas_dir is None:
            return []
        with contextlib.suppress(FileNotFoundError):
            sources = sorted(os.scandir(self.replicas_dir), key=lambda e: e.name)
            return [d for e in sources if (d := Path(e.path) / self.checkpoint_id).joinpath(file).is_file()]
        return []

    @functools.cached_property
    def remote(self) -> RemoteCheckpoint | None:
        return self._find_remote() if self._find_remote is not None else None

    @functools.cached_property
    def cluster(self) -> ClusterCheckpoint | None:
        return self._find_cluster() if self._find_cluster is not None else None


MAX_IO_THREADS = 256


def _positive_int(name: str, value: object, at_most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if at_most is not None and value > at_most:
        raise ValueError(f"{name} must be an int from 1 to {at_most}, got {value!r}")
    return value


def _positive_seconds(name: str, value: object) -> float:
    """``value`` as a float if it is a number > 0, else a ValueError naming the option (not the TypeError
    a comparison of a str or None would raise). ``math.inf`` or any value from NO_LIMIT_S up (no limit)
    is NO_LIMIT_S."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r} (a number of seconds; math.inf: no limit)")
    return min(float(value), NO_LIMIT_S)


def _flag(name: str, value: object) -> bool:
    """``value`` if it is True or False (or the int 1 or 0); a ValueError naming the option for anything
    else: ``bool("false")`` is True, so a str from a config or command line would turn it on silently."""
    if isinstance(value, int) and value in (0, 1):  # bool is an int
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


class MemStore(PersistingStore, ReplicatingStore):
    """A job's checkpoints in node-local memory (tmpfs).

    Args:
        root: directory on a memory file system. Default: ``$DCP_MEMSTORE_ROOT`` or ``/dev/shm/dcp_memstore``.
        job_id: name of the job inside ``root``. Default: ``$DCP_MEMSTORE_JOB_ID``, else torchrun's run id
            (``$TORCHELASTIC_RUN_ID``), else ``"default"``.
        keep_in_memory: committed checkpoints kept; older ones are evicted at each commit. Default 2.
        max_in_flight: async saves staged but not yet written; the next ``stage`` waits. Default 1.
        io_threads: writer/reader threads per rank, and so shard files per rank (1 to 256).
            Default: cores per local rank, at most 4.
        verify_checksums: verify every item's xxh3-64 checksum when loading. Default True.
        stage_timeout_s: how long an async save waits for an earlier one before raising. Default 600;
            ``math.inf``: no limit.
        persist_to: where to persist checkpoints: an fsspec URL (``s3://bucket/prefix``) or a directory, in
            the standard DCP layout. Default None: memory only. One that can never be written (refused
            credentials, missing bucket, mistyped URL) is a ValueError here.
        persist_every: persist every Nth committed checkpoint (by commit sequence number). Default None:
            only on demand (``persist(id)``) and at ``close()``.
        storage_options: passed to fsspec for ``persist_to`` (for s3fs: key, secret, client_kwargs, ...).
        persist_on_close: at ``close()``, persist the newest checkpoint and wait for owed uploads.
            Default True.
        persist_backlog: what a save does when memory is full of checkpoints still owed to persistent
            storage: ``"error"`` (default: raise InsufficientSpaceError saying so) or ``"wait"`` (wait up to
            ``stage_timeout_s`` for uploads to free memory).
        replicas: when the job spans several nodes, how many other nodes keep a copy of each node's files
            (ring by node rank: node i's go to nodes i+1 .. i+k). Default 1 (``$DCP_MEMSTORE_REPLICAS``);
            0 turns replication off (commits still reach every node). A single node replicates nowhere.
        replication_bind: the address this rank's peer server listens on. Default:
            ``$DCP_MEMSTORE_BIND``, else the local address that reaches ``$MASTER_ADDR``.
        replication_secret: the job's replication secret (>= 16 bytes, the same on every rank). Default:
            a random one shared through the torch.distributed store.
        transport: ``"auto"`` (default: RDMA through pyverbs where a device opens with an active port,
            else TCP, saying why), ``"tcp"`` or ``"rdma"`` (RuntimeError when replication starts on a node
            where no RDMA device opens).
        replication_timeout_s: how long a peer may stay silent before a transfer to or from it is given up
            (and retried later). Default 30; ``math.inf``: no limit.
        on_event: called with an ``Event`` each time a phase of a checkpoint ends (stage, write, commit,
            replicate, restore, upload, persist; failures too), in the thread that did the work: keep it
            quick. One that raises is logged, never propagated. Default None: the events are only logged
            (logger ``dcp_memstore.events``, INFO).

    The store object is picklable (DCP's PROCESS executor sends it to its checkpoint process with the
    writer); the persister and replication threads and the peer server stay with the original.
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        job_id: str | None = None,
        *,
        keep_in_memory: int = 2,
        max_in_flight: int = 1,
        io_threads: int | None = None,
        verify_checksums: bool = True,
        stage_timeout_s: float = 600.0,
        persist_to: str | os.PathLike | None = None,
        persist_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        persist_on_close: bool = True,
        persist_backlog: str = "error",
        replicas: int | None = None,
        replication_bind: str | None = None,
        replication_secret: bytes | str | None = None,
        transport: str = "auto",
        replication_timeout_s: float = 30.0,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        if on_event is not None and not callable(on_event):
            raise TypeError(
                f"on_event must be a callable taking one Event, got {type(on_event).__name__}: {on_event!r}"
            )
        self.keep_in_memory = _positive_int("keep_in_memory", keep_in_memory)
        self.max_in_flight = _positive_int("max_in_flight", max_in_flight)
        self.io_threads = _positive_int(
            "io_threads", io_threads if io_threads is not None else _default_io_threads(), MAX_IO_THREADS
        )
        self.verify_checksums = _flag("verify_checksums", verify_checksums)
        self.stage_timeout_s = _positive_seconds("stage_timeout_s", stage_timeout_s)
        self.persist_every = None if persist_every is None else _positive_int("persist_every", persist_every)
        if persist_backlog not in ("error", "wait"):
            raise ValueError(f"persist_backlog must be 'error' or 'wait', got {persist_backlog!r}")
        self.persist_backlog = persist_backlog
        self.persist_on_close = _flag("persist_on_close", persist_on_close)
        self.target = PersistTarget(persist_to, storage_options) if persist_to is not None else None
        if self.target is None and (persist_every is not None or storage_options is not None):
            raise ValueError("persist_every and storage_options need persist_to (a URL or directory)")
        source = ""
        if replicas is None:
            replicas = env_int(ENV_REPLICAS, 1, "replicas per node, 0: off")
            source = f" (read from ${ENV_REPLICAS})"
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(
                f"replicas must be an int >= 0 (0 turns replication off), got {replicas!r}{source}"
            )
        self.replicas = replicas
        if not isinstance(transport, str) or transport.lower() not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
        self.transport = transport.lower()
        self._secret = None if replication_secret is None else check_secret(replication_secret)
        if replication_bind is not None and (not isinstance(replication_bind, str) or not replication_bind):
            raise ValueError(
                f"replication_bind must be a host name or IP address (a str), got {replication_bind!r}"
            )
        self.replication_bind = replication_bind
        self.replication_timeout_s = _positive_seconds("replication_timeout_s", replication_timeout_s)
        root = resolve_root(root)
        self.job_id = resolve_job_id(job_id)
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(
                f"MemStore root {root} exists and is not a directory; pass a directory on tmpfs"
            )
        # resolved also where it does not exist yet: every store of the job, the first included, has the
        # same job_dir (saves are ordered and told apart per job_dir), whatever '..' or symlinks root has
        self.layout = StoreLayout(root.resolve(), self.job_id)
        # last of the checks: the probe writes (and removes) an object, and may make the directory
        if self.target is not None:
            self.target.check_apart_from(self.layout.root, self.layout.job_dir)
            self.target.check_writable()
        try:
            self.layout.ensure()
        except OSError as e:  # the same type (PermissionError, NotADirectoryError, ...), saying what to do
            raise type(e)(
                e.errno,
                f"cannot create the directories of job {self.job_id!r} under MemStore root {root}: "
                f"{e.strerror} ({e.filename}); pass a writable directory on tmpfs as root "
                f"(or ${ENV_ROOT})",
            ) from e
        if not space.is_memory_backed(self.layout.root):
            warnings.warn(
                f"MemStore root {self.layout.root} is not on a memory file system (tmpfs); "
                "checkpoints will go "
                "to disk at disk speed. Use a directory under /dev/shm or another tmpfs mount.",
                stacklevel=2,
            )
        self._closed = False
        self._close_hooks: list[Callable[[], None]] = []
        liveness.own_token(self.layout)  # this process's lock: its saves and loads record it as owner
        cleared = catalog.clear_abandoned(self.layout, keep_prepared=True)
        if cleared:
            log.info("cleared uncommitted leftovers of dead saves: %s", cleared)
        self._registration: Path | None = None  # of this store's target (``target_users``)
        if self.target is not None:
            self._registration = target_users.register(self.layout, self.target.url)
            if adopted := adopt_unnamed_holds(self.layout, self.target.url):
                log.info("owed to %s, as an earlier version held them: %s", self.target.url, adopted)
        if owed := self._owed(binding=False):
            mine = "no persist_to" if self.target is None else f"persist_to {self.target.url}"
            warnings.warn(
                f"checkpoints {owed} in {self.layout.job_dir} are still owed to persistent storage, to a "
                f"target that no running process of the job has open, and this MemStore has {mine}: it "
                "does not upload them and evicts them like any other. To persist them, open a store with "
                "their persist_to before they are evicted",
                stacklevel=2,
            )
        self._persister = (
            Persister.acquire(self.layout, self.target, self.io_threads, self.keep_in_memory)
            if self.target is not None
            else None
        )
        self._service: ReplicationService | None = None
        self._control_transport: TcpTransport | None = None
        self._peers: Peers | None = None  # what a copy of this store in DCP's checkpoint process knows
        self._single_node = False
        # the newest commit time latest_checkpoint saw in any tier (persisted, other nodes): the next
        # commit comes after it, also where this node's tmpfs holds none of them (catalog.next_commit)
        self.newest_commit_seen = 0.0
        self._is_copy = False  # a copy in DCP's checkpoint process: never starts replication services
        self.replication()
        self._on_event = on_event
        if on_event is not None:
            events.listen(self.layout, on_event)

    # -- queries ---------------------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        return self.layout.root

    def list_checkpoints(self) -> list[str]:
        """Committed checkpoints in this node's store, oldest first."""
        self.check_open()
        return [r.checkpoint_id for r in catalog.committed(self.layout)]

    def latest_checkpoint(self, process_group: dist.ProcessGroup | None = None) -> str | None:
        """The newest checkpoint that every rank can load, from its tmpfs, from the other nodes' memory
        (their copies and the replicas they keep) or from persistent storage; None if there is none.

        A collective when torch.distributed is initialized: call it on every rank of ``process_group``.
        In a multi-node job it also repairs: a node that lost the chosen checkpoint (an empty tmpfs after
        a replacement) restores its files from the peers holding them, and replicas lost with a node are
        sent again. After a restart on fewer nodes (one included), the files of checkpoints owed to
        persistent storage that a node which left the job wrote are uploaded from the replicas kept of
        them."""
        self.check_open()
        mine = {
            r.checkpoint_id: [r.checkpoint_id, r.committed_at, r.seq] for r in catalog.committed(self.layout)
        }
        if self.target is not None:
            try:
                for r in remote_committed(self.target):
                    mine.setdefault(r.checkpoint_id, [r.checkpoint_id, r.committed_at, r.seq])
            except Exception as e:  # noqa: BLE001 - an unreachable store leaves the local tier
                log.warning("cannot list persisted checkpoints in %s: %s", self.target.url, e)
        service = self.replication()
        node = None if service is None else service.node
        reports_node = node is not None and node.local_rank == 0
        view = [
            list(mine.values()),
            node.node_rank if node else None,
            inventory(self.layout, self.target.url if self.target else None) if reports_node else None,
        ]
        views = all_gather_records(view, process_group) if dist_active() else [view]
        inventories = {v[1]: v[2] for v in views if v[2] is not None}
        in_memory = readable(list(inventories.values()))
        known = {cid: (at, seq) for cid, (at, seq, _) in in_memory.items()}
        for v in views:
            known.update({cid: (at, seq) for cid, at, seq in v[0] if cid not in known})
        self.newest_commit_seen = max([self.newest_commit_seen, *(at for at, _ in known.values())])
        common = set.intersection(*({rec[0] for rec in v[0]} | set(in_memory) for v in views))
        newest = max(((*known[cid], cid) for cid in common), default=None)
        if service is not None:
            try:
                if reports_node:
                    self._repair(service, newest[2] if newest else None, in_memory, inventories)
            except Exception:  # noqa: BLE001 - the other ranks wait in the barrier; reads fetch per file
                log.exception("repairing this node's copy of %r failed", newest[2] if newest else None)
            finally:
                dist.barrier(process_group)  # the node's other ranks load only once it is restored
        elif self._single_node and self.target is not None:
            self._take_over_alone(process_group)
        return newest[2] if newest else None

    def require_checkpoint(self, checkpoint_id: str) -> Path:
        """The directory of committed checkpoint ``checkpoint_id``;
        FileNotFoundError naming those that exist."""
        self.check_open()
        return catalog.require_committed(self.layout, validate_name(checkpoint_id))

    def open_checkpoint(self, checkpoint_id: str) -> CheckpointSource:
        """Where committed checkpoint ``checkpoint_id`` can be read from; FileNotFoundError naming the
        checkpoints that exist (in memory and persisted) if it is in no tier (NodesUnansweredError, one,
        where some nodes did not answer and may hold it). A local copy whose commit
        marker is corrupt is passed over for another tier's copy, else its ValueError is raised; so is
        the error that keeps a persisted-only copy from being read (a corrupt manifest)."""
        self.check_open()
        cid = validate_name(checkpoint_id)
        try:
            local = catalog.read_commit(self.layout, cid)
            if local is not None:  # its files missing here are read from a persisted copy of this save only
                tiers = {
                    **self._tiers(cid),
                    "_find_remote": functools.partial(self._remote_of_local, cid, local),
                }
                directory = self.layout.checkpoint_dir(cid)
                return CheckpointSource(cid, directory, **tiers, replicas_dir=self.layout.replicas_dir)
        except ValueError as e:
            return self.instead_of_local(cid, e)
        look = self._cluster_look(cid)
        src = self._other_tier(cid, look)
        if src is not None:
            return src
        persisted = ""
        if self.target is not None:
            try:
                names = [r.checkpoint_id for r in remote_committed(self.target)]
                persisted = f"; persisted in {self.target.url}: {names or 'none'}"
            except Exception as e:  # noqa: BLE001 - say why the persistent tier was not searched
                names, persisted = [], f"; persistent storage {self.target.url} unreachable: {e}"
            if cid in names:  # persisted, but its copy cannot be read: raise why (a corrupt manifest)
                remote = RemoteCheckpoint(self.target, cid, self.io_threads)
                return CheckpointSource(cid, None, lambda: remote)  # readable now: it was a passing failure
        elsewhere = " or in the memory of the job's other nodes" if look is not None else ""
        unanswered = self._unanswered(look)
        raise (NodesUnansweredError if unanswered else FileNotFoundError)(
            f"checkpoint {cid!r} not found in store {self.layout.job_dir}{elsewhere}; "
            f"committed checkpoints: {self.list_checkpoints() or 'none'}{persisted}{unanswered}"
        )

    def instead_of_local(self, checkpoint_id: str, damage: Exception) -> CheckpointSource:
        """Another tier's copy of ``checkpoint_id``, whose copy on this node is damaged (``damage`` says
        how: a corrupt commit marker or manifest), with a warning naming both; ``damage`` is raised if
        no other tier has it."""
        try:
            save = catalog.read_commit(self.layout, checkpoint_id)
        except ValueError:
            save = None  # the commit marker is what is damaged: no record to match a persisted copy with
        src = self._other_tier(checkpoint_id, self._cluster_look(checkpoint_id), save)
        if src is None:
            raise damage
        where = (
            "the memory of the job's other nodes"
            if src.cluster is not None
            else self.target.url_of(checkpoint_id)
        )
        log.warning("%s; reading it from %s instead", damage, where)
        return src

    def _tiers(self, cid: str) -> dict[str, Any]:
        """The lookups of ``cid`` in the other tiers, for a ``CheckpointSource``."""
        return {
            "_find_remote": functools.partial(self._remote, cid),
            "_find_cluster": functools.partial(self._cluster_copy, cid),
            "fetch_dir": self.layout.fetched_dir(cid),
        }

    def _other_tier(
        self, cid: str, cluster: ClusterCheckpoint | None, save: catalog.CommitRecord | None = None
    ) -> CheckpointSource | None:
        """``cid`` in the other nodes' memory (``cluster``: a look at it, ``_cluster_look``), else in
        persistent storage (of save ``save`` only, if given); None if in neither."""
        if cluster is not None and cluster.available:
            return CheckpointSource(cid, None, **{**self._tiers(cid), "_find_cluster": lambda: cluster})
        remote = self._remote(cid, save)
        return CheckpointSource(cid, None, lambda: remote) if remote is not None else None

    # -- persistence -----------------------------------------------------------------------------------

    def prepare_commit(self, checkpoint_id: str, seq: int) -> None:
        """Called on each node before checkpoint number ``seq`` is committed there: owe it to persistent
        storage if ``persist_every`` says so, and to the replica nodes (the holds are in place before the
        checkpoint is visible)."""
        if self.target is not None and self.persist_every is not None and seq % self.persist_every == 0:
            progress = Progress(self.layout, checkpoint_id, self.target.url)
            progress.request(f"persist_every={self.persist_every}")
        if self._replicating():
            ReplicaRecords(self.layout, checkpoint_id).hold()

    def status(self, checkpoint_id: str) -> CheckpointStatus:
        """Where ``checkpoint_id`` is: in this node's memory, its replicas on other nodes, and its upload
        state (see CheckpointStatus). On a node whose memory does not hold it, the other nodes' memory
        is asked (once) what they hold of it, and where it does, each replica node it was replicated to
        whether it still keeps it; FileNotFoundError if no tier holds it."""
        self.check_open()
        cid = validate_name(checkpoint_id)
        cluster = functools.cache(functools.partial(self._cluster_copy, cid))
        return self._with_replication(self._persist_status(cid, cluster), cluster)

    def after_commit(self) -> None:
        """Retention after a commit on this node: evict beyond ``keep_in_memory`` (with the replicas and
        fetched files of evicted checkpoints, and those of checkpoints this node no longer has), trim the
        pools of reusable files, wake the replicator."""
        self.evict_beyond_keep()
        if self.target is None:
            catalog.drop_superseded(self.layout, self.keep_in_memory)
        catalog.drop_stale_copies(self.layout)
        self._trim_pools()
        if self._service is not None:
            self._service.wake()

    def evict_beyond_keep(self) -> list[str]:
        """Evict the committed checkpoints of this node beyond the newest ``keep_in_memory`` that nothing
        holds; the ids evicted. Run after each commit, and by a save short of space: a job killed right
        after a commit, before its eviction, or reopened with a lower ``keep_in_memory``, has more."""
        # an upload hold for a target no running process has open (one left by an earlier run) will
        # never be released (``_binding``); without replication, no replica is sent and no report moves
        # the safe point: the replication holds a multi-node run left (its processes killed while
        # replicating) would pin their checkpoints for good in a job restarted on one node
        no_reports = not self._replicating()

        def ignored(hold: str) -> bool:
            return (is_persist_hold(hold) and not self._binding(hold)) or (
                no_reports and hold in _REPLICATION_HOLDS
            )

        return catalog.evict(self.layout, self.keep_in_memory, ignored)

    def _trim_pools(self) -> None:
        """Free the memory of pooled shard files beyond those the next saves reuse (``max_in_flight`` x
        ``io_threads`` per rank, and as many files that saves staged and did not keep: ``FilePool.trim``):
        eviction and deletion move a checkpoint's files into the pools. The pools of ranks with no file
        in the newest checkpoint on this node are emptied, unless a live process stages that rank's saves
        here (DCP gave the rank no value to write: its staged files serve its next save): no save of
        theirs comes to reuse them (a job restarted with fewer ranks, or with other ranks on this node)."""
        newest = catalog.committed(self.layout)[-1:]
        # None: no checkpoint to tell (or it was evicted meanwhile), every rank keeps its files
        saving = (
            catalog.ranks_with_files(self.layout.checkpoint_dir(newest[0].checkpoint_id)) if newest else None
        ) or None
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.layout.pools_dir):
                if e.name.startswith("rank") and e.name[4:].isdigit():
                    rank = int(e.name[4:])
                    used = saving is None or rank in saving or catalog.pool_in_use(self.layout, rank)
                    FilePool(self.layout, rank).trim(keep=self.max_in_flight * self.io_threads if used else 0)

    def check_space(self, needed: int, rank: int, files: list[int] | None = None) -> None:
        """Raise InsufficientSpaceError unless ``needed`` bytes fit in free space plus what rank ``rank``'s
        pool of reusable files provides for shard files of ``files`` bytes (``FilePool.reusable_bytes``;
        ``needed`` includes them). When checkpoints owed to persistent storage fill memory, say so, or
        wait for their uploads to free it (persist_backlog)."""
        deadline = time.monotonic() + self.stage_timeout_s
        while True:
            try:
                reusable = FilePool(self.layout, rank).reusable_bytes(files)
                space.check_space(self.layout.root, needed, reusable)
                return
            except InsufficientSpaceError as e:
                if not self._owed():
                    self._full_of_owed_to_no_one(e)
                    self._full_of_replication(e)
                    raise
                uploading, detail = self._held_for_uploads()
                waits = self.target is not None and self.persist_backlog == "wait"
                if waits and uploading and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise InsufficientSpaceError(e.root, e.needed, e.free, detail) from None

    def _full_of_owed_to_no_one(self, e: InsufficientSpaceError) -> None:
        """Raise ``e`` again, naming the checkpoints owed to a target no running process has open, if any:
        they are evicted like any other beyond ``keep_in_memory`` (a save short of space evicts those
        first), and these are not, or not yet."""
        if unbound := self._owed(binding=False):
            raise InsufficientSpaceError(
                e.root,
                e.needed,
                e.free,
                f"{len(unbound)} checkpoint(s) owed to persistent storage that no running process of this "
                f"job has open: {unbound}; evicted like any other beyond keep_in_memory "
                f"({self.keep_in_memory}): free memory with store.delete(id), lower keep_in_memory, or open "
                "a store with their persist_to to upload them",
            ) from None

    def _full_of_replication(self, e: InsufficientSpaceError) -> None:
        """Raise ``e`` again, naming the checkpoints that replication keeps in memory, if there are any."""
        kept = {}
        for r in catalog.committed(self.layout):
            reasons = [h for h in catalog.holds(self.layout, r.checkpoint_id) if h in _REPLICATION_HOLDS]
            if reasons:
                kept[r.checkpoint_id] = reasons
        if kept:
            raise InsufficientSpaceError(
                e.root,
                e.needed,
                e.free,
                f"{len(kept)} checkpoint(s) kept in memory for replication: {kept} (replicate: this node's "
                "files are not yet on their replica nodes; awaiting-peers: other nodes' files are not yet "
                "replicated; safe-point: the newest checkpoint replicated on every node, kept until a newer "
                "one is). A peer is slow or unreachable (see store.status(id).replicas and the WARNING lines "
                "of the replicator), or memory is sized for no checkpoint beyond keep_in_memory: see Sizing "
                "in docs/operations.md",
            ) from None

    def delete(self, checkpoint_id: str) -> None:
        """Remove a committed checkpoint from this node's store and free its memory, except the shard files
        the pools keep for the next saves (a persisted copy stays where it is). Also one whose commit marker
        is corrupt: the way to free that one's memory. ``CheckpointInUseError`` while a load (in any
        process on this node) reads it. One owed to ``persist_to`` and not published there yet: in a job on
        one node, what its upload left there is removed in the background (``_drop_upload``)."""
        self.check_open()
        cid = validate_name(checkpoint_id)
        if not (self.layout.checkpoint_dir(cid) / COMMITTED).is_file():
            self.require_checkpoint(cid)  # FileNotFoundError naming the checkpoints that exist
        unpublished = self._unpublished(cid)
        catalog.delete(self.layout, cid)
        catalog.drop_copies(self.layout, cid)
        self._trim_pools()
        if unpublished:
            self._drop_upload(cid)

    # -- lifecycle -------------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Finish with the store. With persistence: owe the newest checkpoint (``persist_on_close``) and
        wait up to ``timeout`` seconds (None: until done or failed) for owed uploads, then up to
        ``timeout`` more for the persister to stop; uploads not finished resume when the job starts
        again. Committed checkpoints stay on tmpfs. Leaving a ``with`` block on an exception does not
        wait for uploads."""
        timeout = optional_timeout("timeout", timeout)  # before anything is stopped: a bad one closes nothing
        if self._closed:
            return
        stop_reservations(self)  # started by saves through this store
        try:
            if self._persister is not None:
                self._drain(timeout)
        finally:
            if self._service is not None:
                self._service.close(timeout)
                self._service = None
            if self._control_transport is not None:
                self._control_transport.close()
            if self._persister is not None:
                self._persister.release(timeout)
                self._persister = None
            if self._registration is not None and not self._is_copy:
                target_users.unregister(self._registration)
            if self._on_event is not None:
                events.unlisten(self.layout, self._on_event)
            for hook in self._close_hooks:
                try:
                    hook()
                except Exception as e:  # noqa: BLE001 - tidying up; closing goes on
                    log.warning("while closing store %s: %s", self.layout.job_dir, e)
            MAPPINGS.prune()
            self._closed = True

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run: a closed store neither saves nor loads."""
        return self._closed

    def on_close(self, hook: Callable[[], None]) -> None:
        """Have ``close()`` call ``hook`` (once per hook: the layers above tidy up what they hold)."""
        if hook not in self._close_hooks:
            self._close_hooks.append(hook)

    def _drain(self, timeout: float | None) -> None:
        recs = catalog.committed(self.layout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.persist_on_close and recs:
            with answer_by(deadline):  # it looks whether the copy is still there
                self.persist(recs[-1].checkpoint_id)
        for rec in recs:
            if not Progress(self.layout, rec.checkpoint_id, self.target.url).owed():
                continue
            left = None if deadline is None else round(max(0.0, deadline - time.monotonic()), 3)
            try:
                self._wait_uploaded(rec.checkpoint_id, left)
            except (PersistError, OSError, ValueError) as e:  # also: damaged in memory (status raises)
                log.warning(
                    "closing with checkpoint %r not persisted (resumes at next start): %s",
                    rec.checkpoint_id,
                    e,
                )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_persister"] = None  # the persister thread stays in the process that made the store
        # so do the replication threads and server; the copy commits and reads with what they learned
        service = self.replication()  # in the training process: the copy must not start its own
        state["_peers"] = service.peers() if service is not None else self._peers
        state["_service"] = None
        state["_is_copy"] = True
        state["_control_transport"] = None
        state["_close_hooks"] = []  # they tidy up this process's state
        state["_on_event"] = None  # called in this process only (and it may not pickle)
        return state

    def check_open(self) -> None:
        """RuntimeError if ``close()`` was called: a closed store neither saves nor loads."""
        if self._closed:
            raise RuntimeError(
                f"MemStore {self.layout.job_dir} is closed; make a new MemStore(root=..., job_id=...) "
                "to save or load again"
            )

    def __enter__(self) -> MemStore:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(timeout=0 if exc_type is not None else None)

    def __repr__(self) -> str:
        return (
            f"MemStore(root={str(self.layout.root)!r}, job_id={self.job_id!r}, "
            f"keep_in_memory={self.keep_in_memory})"
        )
