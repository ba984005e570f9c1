"""``MemStore``: one job's node-local checkpoint store and its user-facing queries."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch.distributed as dist

from dcp_memstore.store import catalog
from dcp_memstore.store.collective import all_gather_records, dist_active
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.mapping import MAPPINGS
from dcp_memstore.store.space import is_memory_backed

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm/dcp_memstore"
ENV_ROOT = "DCP_MEMSTORE_ROOT"
ENV_JOB_ID = "DCP_MEMSTORE_JOB_ID"


def resolve_root(root: str | os.PathLike | None) -> Path:
    """``root``, else ``$DCP_MEMSTORE_ROOT``, else /dev/shm/dcp_memstore."""
    return Path(root if root is not None else os.environ.get(ENV_ROOT, DEFAULT_ROOT)).expanduser()


def resolve_job_id(job_id: str | None) -> str:
    """``job_id``, else ``$DCP_MEMSTORE_JOB_ID``, else torchrun's run id, else "default" (validated)."""
    if job_id is None:
        job_id = "default"
        for var in (ENV_JOB_ID, "TORCHELASTIC_RUN_ID"):
            value = os.environ.get(var)
            if value and value != "none":
                job_id = value
                break
    return validate_name(job_id, "job id")


def _default_io_threads() -> int:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(4, (os.cpu_count() or 1) // max(1, local_world)))


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class MemStore:
    """A job's checkpoints in node-local memory (tmpfs).

    Args:
        root: directory on a memory file system. Default: ``$DCP_MEMSTORE_ROOT`` or ``/dev/shm/dcp_memstore``.
        job_id: name of the job inside ``root``. Default: ``$DCP_MEMSTORE_JOB_ID``, else torchrun's run id
            (``$TORCHELASTIC_RUN_ID``), else ``"default"``.
        keep_in_memory: committed checkpoints kept; older ones are evicted at each commit. Default 2.
        max_in_flight: async saves staged but not yet written; the next ``stage`` waits. Default 1.
        io_threads: writer/reader threads per rank, and so shard files per rank. Default: cores per local rank, at most 4.
        verify_checksums: verify every item's xxh3-64 checksum when loading. Default True.
        stage_timeout_s: how long an async save waits for an earlier one before raising. Default 600.

    The store object holds no open resources of its own and is picklable (DCP's PROCESS executor sends it
    to its checkpoint process with the writer).
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
    ) -> None:
        self.keep_in_memory = _positive_int("keep_in_memory", keep_in_memory)
        self.max_in_flight = _positive_int("max_in_flight", max_in_flight)
        self.io_threads = _positive_int(
            "io_threads", io_threads if io_threads is not None else _default_io_threads()
        )
        self.verify_checksums = bool(verify_checksums)
        if not stage_timeout_s > 0:
            raise ValueError(f"stage_timeout_s must be > 0, got {stage_timeout_s!r}")
        self.stage_timeout_s = float(stage_timeout_s)
        root = resolve_root(root)
        self.job_id = resolve_job_id(job_id)
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(
                f"MemStore root {root} exists and is not a directory; pass a directory on tmpfs"
            )
        self.layout = StoreLayout(root.resolve() if root.exists() else root.absolute(), self.job_id)
        self.layout.ensure()
        if not is_memory_backed(self.layout.root):
            warnings.warn(
                f"MemStore root {self.layout.root} is not on a memory file system (tmpfs); checkpoints will go "
                "to disk at disk speed. Use a directory under /dev/shm or another tmpfs mount.",
                stacklevel=2,
            )
        self._closed = False
        cleared = catalog.clear_abandoned(self.layout)
        if cleared:
            log.info("cleared uncommitted leftovers of dead saves: %s", cleared)

    # -- queries ---------------------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        return self.layout.root

    def list_checkpoints(self) -> list[str]:
        """Committed checkpoints in this node's store, oldest first."""
        self._check_open()
        return [r.checkpoint_id for r in catalog.committed(self.layout)]

    def latest_checkpoint(self, process_group: dist.ProcessGroup | None = None) -> str | None:
        """The newest checkpoint that every rank can load, or None.

        A collective when torch.distributed is initialized: call it on every rank of ``process_group``.
        """
        self._check_open()
        mine = [[r.checkpoint_id, r.seq] for r in catalog.committed(self.layout)]
        views = all_gather_records(mine, process_group) if dist_active() else [mine]
        common = set.intersection(*({cid for cid, _ in v} for v in views))
        newest = [(seq, cid) for cid, seq in mine if cid in common]
        return max(newest)[1] if newest else None

    def require_checkpoint(self, checkpoint_id: str) -> Path:
        """The directory of committed checkpoint ``checkpoint_id``; FileNotFoundError naming those that exist."""
        cid = validate_name(checkpoint_id)
        if catalog.read_commit(self.layout, cid) is None:
            raise FileNotFoundError(
                f"checkpoint {cid!r} not found in store {self.layout.job_dir}; "
                f"committed checkpoints: {self.list_checkpoints() or 'none'}"
            )
        return self.layout.checkpoint_dir(cid)

    def delete(self, checkpoint_id: str) -> None:
        """Remove a committed checkpoint from this node's store."""
        catalog.discard(self.layout, self.require_checkpoint(checkpoint_id))

    # -- lifecycle -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release this process's mappings of files that are gone. Committed checkpoints stay on tmpfs."""
        if not self._closed:
            MAPPINGS.prune()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MemStore {self.layout.job_dir} is closed")

    def __enter__(self) -> MemStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemStore(root={str(self.layout.root)!r}, job_id={self.job_id!r}, keep_in_memory={self.keep_in_memory})"
