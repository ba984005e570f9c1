"""The safe point: the newest checkpoint whose files are replicated on every node of the job, kept in
memory on every node until a newer one is, so that losing any one node always leaves a checkpoint the job
can resume from memory.

A node knows only whether its own files of a checkpoint are replicated (the replicator's
acknowledgements). Once they are, it records that beside the checkpoint
(``<checkpoint>/safe-point/reports/node<i>``, with the save's ``committed_at``) and tells every other node
(the signed op ``replicated``), each of which records it the same way; the replicator retries until every
peer acknowledged (``safe-point/told/node<j>``), and nothing waits for it. A checkpoint is safe on a node
once the reports of every node of the job are recorded there.

Two retention holds keep what is needed, and at most that:

- ``awaiting-peers``: placed when this node's own files are replicated, before the ``replicate`` hold
  goes, on a checkpoint newer than the safe point. It must stay: another node may find it safe (all
  reports in) and let its older safe point go, and then this node's copy (and the replicas it keeps for
  others) is what a lost node is restored from.
- ``safe-point``: on the newest safe checkpoint. When a newer checkpoint becomes safe, it takes the hold
  and every older checkpoint loses both holds (and is evicted as usual).

Reports only ever add up, so ``advance`` needs no lock: two processes that run it on different snapshots
both hold a safe checkpoint and release only older ones; one that a slower process held after a newer one
became safe is released by the next ``advance``. Records live in the checkpoint's directory: eviction and
``store.delete`` remove them with it, and they survive a restart (tmpfs). With one node or ``replicas=0``
no report is sent and no hold placed.
"""

from __future__ import annotations

import contextlib
import os

from dcp_memstore.replication.peers import node_name
from dcp_memstore.store import catalog
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import read_record, write_record
from dcp_memstore.store.tier_progress import TierProgress

SAFE_HOLD = "safe-point"
AWAITING_HOLD = "awaiting-peers"
HOLDS = (SAFE_HOLD, AWAITING_HOLD)


class Reports(TierProgress):
    """Which nodes reported their files of checkpoint ``checkpoint_id`` replicated (group ``reports``),
    and which peers acknowledged this node's report (group ``told``)."""

    def __init__(self, layout: StoreLayout, checkpoint_id: str) -> None:
        super().__init__(layout, checkpoint_id, "safe-point")

    def record(self, node: str, committed_at: float) -> bool:
        """Record that ``node`` reported the save committed at ``committed_at`` replicated; False (nothing
        recorded) if the checkpoint's directory is gone."""
        self.prepare()
        try:
            (self.dir / "reports").mkdir(exist_ok=True)
            write_record(self.dir / "reports" / node, {"committed_at": committed_at})
        except FileNotFoundError:
            return False
        return True

    def reporters(self, committed_at: float) -> set[str]:
        """The nodes that reported the save committed at ``committed_at`` replicated (reports of an
        earlier save under the same id do not count)."""
        out = set()
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for e in os.scandir(self.dir / "reports"):
                with contextlib.suppress(FileNotFoundError, ValueError, TypeError, AttributeError):
                    if read_record(e.path).get("committed_at") == committed_at:
                        out.add(e.name)
        return out


def await_peers(layout: StoreLayout, checkpoint_id: str, node: str, committed_at: float) -> None:
    """This node's (``node``) own files of the save of ``checkpoint_id`` committed at ``committed_at``
    are replicated: hold it until a checkpoint as new or newer is safe, and record this node's report
    (called before the ``replicate`` hold is released, so it is never without a hold)."""
    catalog.hold(layout, checkpoint_id, AWAITING_HOLD, {"committed_at": committed_at})
    Reports(layout, checkpoint_id).record(node, committed_at)


def is_safe(layout: StoreLayout, rec: catalog.CommitRecord, nnodes: int) -> bool:
    """Whether every node of a job of ``nnodes`` nodes reported save ``rec`` replicated."""
    reported = Reports(layout, rec.checkpoint_id).reporters(rec.committed_at)
    return all(node_name(n) in reported for n in range(nnodes))


def advance(layout: StoreLayout, nnodes: int, keep: int) -> str | None:
    """Move the safe point to the newest checkpoint every node reported replicated, release the holds of
    the older ones, and evict beyond ``keep`` (``keep_in_memory``) what nothing holds. Returns the safe
    point (None: none yet). One advance at a time in the job (``catalog.safe_point_lock``)."""
    with catalog.safe_point_lock(layout):
        recs = catalog.committed(layout)
        safe = next((r for r in reversed(recs) if is_safe(layout, r, nnodes)), None)
        if safe is not None and _hold(layout, safe):
            for r in recs:
                if r.seq >= safe.seq:
                    break
                for reason in HOLDS:
                    catalog.release(layout, r.checkpoint_id, reason)
    catalog.evict(layout, keep)
    return None if safe is None else safe.checkpoint_id


def _hold(layout: StoreLayout, safe: catalog.CommitRecord) -> bool:
    """Hold ``safe`` as the safe point (it no longer awaits its peers); False if it was deleted meanwhile
    (the next report or commit looks again)."""
    try:
        catalog.hold(layout, safe.checkpoint_id, SAFE_HOLD, {"committed_at": safe.committed_at})
    except FileNotFoundError:
        return False
    catalog.release(layout, safe.checkpoint_id, AWAITING_HOLD)
    return True
