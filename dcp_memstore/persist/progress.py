"""What the persister has done for one checkpoint, kept on tmpfs beside the checkpoint.

``<checkpoint>/holds/persist-<t>``  the checkpoint is owed to the target whose URL hashes to ``t`` (a
                                     retention hold per target: two stores of a job that persist to
                                     different places each keep it in memory until their own upload)
``<checkpoint>/persist-<t>/``        what was done for that target (records of another ``persist_to``
                                     say nothing about this one):
``    done/<f>``                     local file ``f`` is uploaded (its part record is in the target)
``    state-<r>``                    the last state rank ``r``'s persister reported (uploading, retrying,
                                     failed)
``    PERSISTED``                    published there; the hold is gone
``    RETRY``                        when failures were last cleared (``persist(id)``, a take-over): an
                                     attempt begun before that which fails is not a failure
``    <f>.lock``                     flock held while a process uploads ``f`` (or publishes: ``publish``)
"""

from __future__ import annotations

import contextlib
import hashlib
import time

from dcp_memstore.store import catalog
from dcp_memstore.store.layout import StoreLayout
from dcp_memstore.store.records import read_record, write_record
from dcp_memstore.store.tier_progress import TierProgress

PERSIST_HOLD_PREFIX = "persist-"  # of the retention holds, one per target (``target_key``)
# the one upload hold of stores before holds were per target: ``adopt_unnamed_holds`` names it
UNNAMED_PERSIST_HOLD = "persist"
# Upload states short of published, the most pressing first: the state of a checkpoint whose processes (or
# nodes) report different ones is the first of theirs here.
PRESSING = ("failed", "retrying", "uploading", "queued", "not requested")


def target_key(target_url: str) -> str:
    """The name of the target at ``target_url`` beside a checkpoint: of its retention hold and of the
    directory of its upload records."""
    return PERSIST_HOLD_PREFIX + hashlib.sha256(target_url.encode()).hexdigest()[:16]


def is_persist_hold(hold: str) -> bool:
    """Whether retention hold ``hold`` is an upload's (to any target)."""
    return hold.startswith(PERSIST_HOLD_PREFIX) or hold == UNNAMED_PERSIST_HOLD


def adopt_unnamed_holds(layout: StoreLayout, target_url: str) -> list[str]:
    """Owe to the target at ``target_url`` the checkpoints that a store of an earlier version held for its
    upload under the one name every target shared (a job upgraded and restarted on the same tmpfs), so
    that this store uploads them instead of no store ever releasing them; their ids."""
    adopted = []
    for r in catalog.committed(layout):
        if UNNAMED_PERSIST_HOLD in catalog.hold_names(layout, r.checkpoint_id):
            Progress(layout, r.checkpoint_id, target_url).request("held for upload by an earlier version")
            catalog.release(layout, r.checkpoint_id, UNNAMED_PERSIST_HOLD)
            adopted.append(r.checkpoint_id)
    return adopted


def is_owed(layout: StoreLayout, checkpoint_id: str, target_url: str | None = None) -> bool:
    """Whether ``checkpoint_id`` is owed to the target at ``target_url`` (None: to any), i.e. held in
    memory until it is uploaded there."""
    held = catalog.holds(layout, checkpoint_id)
    if target_url is None:
        return any(is_persist_hold(h) for h in held)
    return target_key(target_url) in held


class Progress(TierProgress):
    """Upload progress records of checkpoint ``checkpoint_id`` in ``layout`` towards ``target_url``."""

    def __init__(self, layout: StoreLayout, checkpoint_id: str, target_url: str) -> None:
        super().__init__(layout, checkpoint_id, target_key(target_url))
        self.hold = target_key(target_url)

    def owed(self) -> bool:
        """Whether the checkpoint is owed to this target (see ``is_owed``)."""
        return self.hold in catalog.holds(self.layout, self.checkpoint_id)

    def request(self, reason: str) -> None:
        """Owe this checkpoint to this target (idempotent); clears a failure so uploads retry."""
        if self.persisted():
            return
        catalog.hold(self.layout, self.checkpoint_id, self.hold, {"reason": reason, "at": time.time()})
        if self.persisted():  # published meanwhile: the hold would never be released
            self.release()
        self.clear_failures()

    def clear_failures(self) -> None:
        """Forget the uploads that failed for good, so that the persisters try again; also a failure that
        an attempt begun before this reports after it (``states``)."""
        self.prepare()
        with contextlib.suppress(FileNotFoundError):
            write_record(self.dir / "RETRY", {"at": time.time()})
        for r in self.state_files():
            with contextlib.suppress(FileNotFoundError):
                if (read_record(r) or {}).get("state") == "failed":
                    r.unlink()

    def states(self) -> list[dict]:
        """The states live processes reported, less failures of attempts begun before the last
        ``clear_failures`` (``since``: when the attempt began; else when it was reported)."""
        try:
            cleared = float(read_record(self.dir / "RETRY")["at"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            cleared = 0.0
        return [
            s
            for s in super().states()
            if s.get("state") != "failed" or float(s.get("since", s.get("at", 0.0))) >= cleared
        ]

    def persisted(self) -> bool:
        return (self.dir / "PERSISTED").exists()

    def upload_state(self) -> tuple[str, str | None]:
        """This node's upload state of the checkpoint and its error: ``persisted`` (published),
        ``not requested`` (not owed), else the most pressing state a live uploading process reported
        (``failed``, ``retrying``, ``uploading``; see ``PRESSING``), else ``queued``."""
        owed = self.owed()  # before persisted(): publication writes PERSISTED, then drops the hold
        if self.persisted():
            return "persisted", None
        if not owed:
            return "not requested", None
        reported = {s.get("state"): s.get("error") for s in self.states()}
        state = next((s for s in PRESSING if s in reported), "queued")
        return state, reported.get(state)

    def mark_persisted(self) -> None:
        """Published: record it and drop the retention hold."""
        self.prepare()
        write_record(self.dir / "PERSISTED", {"at": time.time()})
        self.release()

    def forget_published(self) -> None:
        """Record it as not published (its copy was deleted from the target): ``request`` owes it again,
        and the persister uploads again the files whose part records are gone there."""
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "PERSISTED").unlink()

    def release(self) -> None:
        """Drop this target's retention hold (the holds for other targets stay)."""
        catalog.release(self.layout, self.checkpoint_id, self.hold)
