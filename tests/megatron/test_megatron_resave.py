"""A second Megatron save into the directory of a committed checkpoint, on 2 gloo ranks.

Megatron writes ``common.pt`` into ``checkpoint_dir`` before it calls the sharded strategy, so by the time
``MemStoreSaveStrategy`` refuses the save (the id already exists), the committed checkpoint's common
state has been replaced by the refused save's. A load of that directory must not hand back the old
tensors with the new common state. This happens when training resumes from an older checkpoint than the
newest committed one and reaches the same iteration again.

Real Megatron save and load, real store; no CUDA is needed on this synchronous path.
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
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from dcp_memstore import MemStore  # noqa: E402
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy  # noqa: E402
from tests.megatron import test_megatron_strategies as megatron_state  # noqa: E402
from tests.multiproc.mp_harness import JOB_ID, assert_bit_equal  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
RESAVED, KEPT = "iter_0000100", "iter_0000200"  # checkpoint directories' names


def resave_job(rank: int, world: int, root: str, ckpts: str) -> dict[str, Any]:
    """Each rank: save two checkpoints, load the first, save its directory again (refused), load both with
    the same load strategy; report."""
    store = MemStore(root, JOB_ID, keep_in_memory=3, io_threads=2)
    save, load = MemStoreSaveStrategy(store), MemStoreLoadStrategy(store)
    base = Path(ckpts)
    out: dict[str, Any] = {}

    def state(seed: int) -> dict[str, Any]:
        return {
            **megatron_state.sharded(
                megatron_state.local_values(rank, seed), megatron_state.rank_object(rank, seed), rank, world
            ),
            **megatron_state.common_state(seed),
        }

    mdc.save(state(1), str(base / RESAVED), sharded_strategy=save)
    mdc.save(state(2), str(base / KEPT), sharded_strategy=save)
    out["before"] = mdc.load(megatron_state.template(rank, world), str(base / RESAVED), sharded_strategy=load)
    try:
        mdc.save(state(3), str(base / RESAVED), sharded_strategy=save)
        out["resave"] = None
    except CheckpointException as e:  # DCP's, a BaseException: raised on every rank
        out["resave"] = str(e)
    try:
        out["loaded"] = mdc.load(
            megatron_state.template(rank, world), str(base / RESAVED), sharded_strategy=load
        )
    except CheckpointingException as e:
        out["loaded"] = f"{type(e).__name__}: {e}"
    out["kept"] = mdc.load(megatron_state.template(rank, world), str(base / KEPT), sharded_strategy=load)
    store.close()
    return out


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the 2-rank job once; its ranks' reports."""
    yield from megatron_state.run_megatron_job(resave_job, (RESAVED, KEPT))


def test_load_refuses_common_state_replaced_by_a_refused_save(job: list[dict]) -> None:
    """The second save into the directory is refused, and loading the directory then fails saying that its
    common.pt is not the one saved with its tensors (before, it returned the tensors of the first save with
    the common state of the refused one); also with the load strategy that verified the first common.pt
    (it checks a file only once while it is unchanged)."""
    for rank, rep in enumerate(job):
        assert_bit_equal(rep["before"], megatron_state.expected_loaded(rank, 1), f"rank {rank} before")
        assert rep["resave"] is not None and "already exists" in rep["resave"]
        loaded = rep["loaded"]
        assert isinstance(loaded, str), f"loaded a mixed checkpoint: {loaded.get('iteration')=}"
        assert "common.pt" in loaded and "changed" in loaded, loaded


def test_other_checkpoints_still_load(job: list[dict]) -> None:
    """Checkpoints whose common.pt is the one committed with them load bit for bit."""
    for rank, rep in enumerate(job):
        assert_bit_equal(rep["kept"], megatron_state.expected_loaded(rank, 2), f"rank {rank} kept")
