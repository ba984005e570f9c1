"""A Megatron save that waits too long for an earlier one says what a Megatron user is to do about it.

The store's next save waits until the previous save's write is done. With ``MemStoreSaveStrategy`` that
write is the ``async_fn`` of Megatron's ``AsyncRequest``; a request that is never scheduled (or never
finalized, where its error surfaces) makes the next save time out with ``StagingTimeoutError``. Its
advice must name Megatron's queue, not the futures of ``dcp.async_save``, which a Megatron user never
sees. There are two waits, each with its own message: for room among ``max_in_flight`` staging slots
(``max_in_flight=1``), and for the earlier save's turn (``max_in_flight=2``: staged, then waiting).

One rank (a real process group of one), so the timeout is raised at once rather than deferred to the
save's planning on every rank; real Megatron save, real store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

from megatron.core import dist_checkpointing as mdc  # noqa: E402

from dcp_memstore import MemStore, StagingTimeoutError  # noqa: E402
from dcp_memstore.megatron import MemStoreSaveStrategy  # noqa: E402
from tests.megatron import test_megatron_strategies as megatron_state  # noqa: E402
from tests.multiproc.mp_harness import JOB_ID, MultiProc  # noqa: E402

pytestmark = pytest.mark.slow

UNSCHEDULED, NEXT = "iter_0000001", "iter_0000002"  # checkpoint directories' names
WAITS = {"slot": 1, "turn": 2}  # which wait times out -> the store's max_in_flight that makes it the one


def timeout_job(rank: int, world: int, root: str, ckpts: str) -> dict[str, Any]:
    """One rank: an async save whose request is not scheduled, then the next save under each wait (times
    out); then the first request run and finalized. Report the errors and what was committed."""
    base = Path(ckpts)

    def state(seed: int) -> dict[str, Any]:
        values = megatron_state.local_values(rank, seed)
        obj = megatron_state.rank_object(rank, seed)
        return {**megatron_state.sharded(values, obj, rank, world), **megatron_state.common_state(seed)}

    first = MemStore(root, JOB_ID, stage_timeout_s=1)
    save = MemStoreSaveStrategy(first)
    request = mdc.save(state(1), str(base / UNSCHEDULED), sharded_strategy=save, async_sharded_save=True)
    out: dict[str, Any] = {}
    for wait, max_in_flight in WAITS.items():
        store = MemStore(root, JOB_ID, stage_timeout_s=1, max_in_flight=max_in_flight)
        try:
            mdc.save(state(2), str(base / NEXT), sharded_strategy=MemStoreSaveStrategy(store))
            out[wait] = None
        except StagingTimeoutError as e:
            out[wait] = str(e)
    request.execute_sync()  # the earlier save still commits once it is run and finalized
    out["committed"] = first.list_checkpoints()
    return out


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the one-rank job once; its report."""
    m = MultiProc()
    try:
        for name in (UNSCHEDULED, NEXT):
            (m.workdir / "ckpts" / name).mkdir(parents=True)
        yield m.run(timeout_job, 1, str(m.root), str(m.workdir / "ckpts"))[0]
    finally:
        m.close()


@pytest.mark.parametrize("wait", list(WAITS))
def test_timeout_names_megatrons_queue(job: dict[str, Any], wait: str) -> None:
    """The StagingTimeoutError tells a Megatron user to finalize earlier AsyncRequests (and to check that
    each was scheduled), and does not send them to the futures of dcp.async_save."""
    msg = job[wait]
    assert msg is not None, "the save did not time out"
    assert "waited 1s" in msg, msg
    assert "AsyncCallsQueue.maybe_finalize_async_calls" in msg, msg
    assert "schedule_async_request" in msg and "execute_sync" in msg, msg
    assert "dcp.async_save" not in msg and "futures" not in msg, msg
    assert job["committed"] == [UNSCHEDULED]
