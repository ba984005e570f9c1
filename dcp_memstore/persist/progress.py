"""What the persister has done for one checkpoint, kept on tmpfs beside the checkpoint.

``<checkpoint>/holds/persist``      the checkpoint is owed to persistent storage (a retention hold)
``<checkpoint>/persist/done/<f>``   local file ``f`` is uploaded (its part record is in the bucket)
``<checkpoint>/persist/state-<r>``  the last state rank ``r``'s persister reported (uploading, retrying,
                                    failed)
``<checkpoint>/persist/PERSISTED``  published; the hold is gone
``<checkpoint>/persist/<f>.lock``   flock held while a process uploads ``f`` (or publishes: ``publish``)
"""

from __future__ import annotations

import contextlib
import time

from dcp_memstore.store import catalog
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import read_record, write_record
from dcp_memstore.store.tier_progress import TierProgress

PERSIST_HOLD = "persist"


class Progress(TierProgress):
    """Upload progress records of checkpoint ``checkpoint_id`` in ``layout``."""

    def __init__(self, layout: StoreLayout, checkpoint_id: str) -> None:
        super().__init__(layout, checkpoint_id, "persist")

    def owed(self) -> bool:
        return PERSIST_HOLD in catalog.holds(self.layout, self.checkpoint_id)

    def request(self, reason: str) -> None:
        """Owe this checkpoint to persistent storage (idempotent); clears a failure so uploads retry."""
        if self.persisted():
            return
        catalog.hold(self.layout, self.checkpoint_id, PERSIST_HOLD, {"reason": reason, "at": time.time()})
        if self.persisted():  # published meanwhile: the hold would never be released
            catalog.release(self.layout, self.checkpoint_id, PERSIST_HOLD)
        for r in self.state_files():
            with contextlib.suppress(FileNotFoundError):
                if (read_record(r) or {}).get("state") == "failed":
                    r.unlink()

    def persisted(self) -> bool:
        return (self.dir / "PERSISTED").exists()

    def mark_persisted(self) -> None:
        """Published: record it and drop the retention hold."""
        self.prepare()
        write_record(self.dir / "PERSISTED", {"at": time.time()})
        catalog.release(self.layout, self.checkpoint_id, PERSIST_HOLD)
