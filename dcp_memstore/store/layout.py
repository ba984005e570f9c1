"""Where everything lives under the store root.

    <root>/<job_id>/checkpoints/<checkpoint_id>/   one checkpoint: shard files, manifest, markers
    <root>/<job_id>/checkpoints/<checkpoint_id>/holds/<reason>   retention holds (owed uploads, replicas,
                                                   running loads)
    <root>/<job_id>/retention.lock                 flock: placing a hold against evicting
    <root>/<job_id>/commit.lock                    flock: one commit at a time takes a sequence number
    <root>/<job_id>/procs/<token>.lock             flock held by each live process that writes owner
                                                   records (see ``liveness``)
    <root>/<job_id>/staging/<slot>/                async-save staging areas (become checkpoint files)
    <root>/<job_id>/pool/rank<r>/                  shard files of evicted checkpoints, reused by rank r
    <root>/<job_id>/pool/rank<r>/reserve-<...>/    files being allocated ahead of rank r's next save
    <root>/<job_id>/trash/                         checkpoints being evicted or cleared
    <root>/<job_id>/replicas/<node>/<checkpoint_id>/   replicas of other nodes' shard files
    <root>/<job_id>/fetched/<checkpoint_id>/       files fetched from other nodes to read them here
    .../.<file>.part-<token>-<hex>                 a file being received (see ``part_name``)

A checkpoint directory is visible to readers only once its COMMITTED marker exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

INPROGRESS = "INPROGRESS"
COMMITTED = "COMMITTED"
PREPARED = "PREPARED"  # on a node other than the coordinator's: the save it prepared (see replicating.py)
MANIFEST = "manifest.msgpack"
OWNER = "OWNER"
HOLDS = "holds"
SHARD_SUFFIX = ".shard"
_SHARD_RE = re.compile(r"__(\d+)_(\d+)\.shard")
_FILE_RANK_RE = re.compile(r"__(\d+)_(?:\d+\.shard|objects\.bin)")
# the liveness token of a process (see liveness.py): names the lock file it holds for its life
OWNER_TOKEN = r"p\d+-[0-9a-f]{12}"
_SLOT_RE = re.compile(rf"r(\d+)-({OWNER_TOKEN})-s(\d+)-[0-9a-f]+")
_NEW_RE = re.compile(rf"\.new-({OWNER_TOKEN})-[0-9a-f]+")
_RESERVE_RE = re.compile(rf"reserve-r\d+-({OWNER_TOKEN})-[0-9a-f]+")
_PART_RE = re.compile(rf"\..+\.part-({OWNER_TOKEN})-[0-9a-f]{{8}}")


def shard_name(rank: int, index: int) -> str:
    """File name of rank ``rank``'s ``index``-th shard file inside a checkpoint directory."""
    return f"__{rank}_{index}{SHARD_SUFFIX}"


def objects_name(rank: int) -> str:
    """File name of rank ``rank``'s serialized non-tensor values inside a checkpoint directory."""
    return f"__{rank}_objects.bin"


def shard_rank(name: str) -> int | None:
    """The rank that wrote shard file ``name``, or None if ``name`` is not a shard file."""
    m = _SHARD_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def file_rank(name: str) -> int | None:
    """The rank that wrote checkpoint data file ``name`` (shard or objects file), or None."""
    m = _FILE_RANK_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def slot_name(rank: int, owner: str, seq: int, token: str) -> str:
    """Name of the staging slot of rank ``rank``'s ``seq``-th staged save in the process whose liveness
    token is ``owner``."""
    return f"r{rank}-{owner}-s{seq}-{token}"


def reserve_name(rank: int, owner: str, token: str) -> str:
    """Name of the directory inside rank ``rank``'s pool where the process whose liveness token is
    ``owner`` allocates files ahead of its next save (see ``reserve.py``)."""
    return f"reserve-r{rank}-{owner}-{token}"


def new_dir_name(owner: str, token: str) -> str:
    """Name of a checkpoint directory being made (renamed to its id once it holds its INPROGRESS marker)
    by the process whose liveness token is ``owner``."""
    return f".new-{owner}-{token}"


def parse_slot(name: str) -> tuple[int, str, int] | None:
    """(rank, owner's liveness token, seq) of staging slot ``name``, or None if ``name`` is not one."""
    m = _SLOT_RE.fullmatch(name)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def name_owner(name: str) -> str | None:
    """The liveness token in the name of a staging slot, a checkpoint directory being made or a
    reservation area: whose they are until their owner record is written."""
    slot = parse_slot(name)
    if slot is not None:
        return slot[1]
    m = _NEW_RE.fullmatch(name) or _RESERVE_RE.fullmatch(name)
    return m.group(1) if m else None


def part_name(name: str, owner: str, token: str) -> str:
    """Name of the hidden temporary file that a transfer into file ``name`` fills before renaming it into
    place, made by the process whose liveness token is ``owner``; ``token``: 8 hex digits. At most 37
    characters longer than ``name`` (store names are at most 128), so within a file name's 255."""
    return f".{name}.part-{owner}-{token}"


def part_owner(name: str) -> str | None:
    """The liveness token in the name of a transfer's temporary file (``part_name``), or None if ``name``
    is not one."""
    m = _PART_RE.fullmatch(name)
    return m.group(1) if m else None


@dataclass(frozen=True)
class StoreLayout:
    """Paths of one job's store; pure path arithmetic, no I/O."""

    root: Path
    job_id: str

    @property
    def job_dir(self) -> Path:
        return self.root / self.job_id

    @property
    def checkpoints_dir(self) -> Path:
        return self.job_dir / "checkpoints"

    @property
    def staging_dir(self) -> Path:
        return self.job_dir / "staging"

    @property
    def trash_dir(self) -> Path:
        return self.job_dir / "trash"

    @property
    def retention_lock(self) -> Path:
        """The lock file that serialises placing a retention hold against eviction (see ``catalog``)."""
        return self.job_dir / "retention.lock"

    @property
    def commit_lock(self) -> Path:
        """The lock file that gives one commit at a time the next sequence number (see ``catalog``)."""
        return self.job_dir / "commit.lock"

    @property
    def procs_dir(self) -> Path:
        """The lock files that tell whether the processes named in owner records live (``liveness``)."""
        return self.job_dir / "procs"

    def checkpoint_dir(self, checkpoint_id: str) -> Path:
        return self.checkpoints_dir / checkpoint_id

    @property
    def replicas_dir(self) -> Path:
        """Where a node keeps the replicas of other nodes' checkpoints."""
        return self.job_dir / "replicas"

    def replica_dir(self, source_node: str, checkpoint_id: str) -> Path:
        """This node's replica of checkpoint ``checkpoint_id`` of node ``source_node``."""
        return self.replicas_dir / source_node / checkpoint_id

    @property
    def fetches_dir(self) -> Path:
        return self.job_dir / "fetched"

    def fetched_dir(self, checkpoint_id: str) -> Path:
        """Files of checkpoint ``checkpoint_id`` fetched from other nodes' memory to be read on this one."""
        return self.fetches_dir / checkpoint_id

    def pool_dir(self, rank: int) -> Path:
        return self.job_dir / "pool" / f"rank{rank}"

    @property
    def pools_dir(self) -> Path:
        return self.job_dir / "pool"

    def ensure(self) -> None:
        """Create the job's directories (idempotent, safe to race between ranks)."""
        for d in (self.checkpoints_dir, self.staging_dir, self.trash_dir, self.pools_dir):
            d.mkdir(parents=True, exist_ok=True)
