"""A Megatron job killed right after the store commits a checkpoint, before Megatron writes its
``metadata.json``, on 2 gloo ranks.

``store.latest_checkpoint()`` names that checkpoint when the job restarts, so Megatron must be able to
load its directory. Megatron's last finalize step (writing ``metadata.json``) is where the trainers are
SIGKILLed, for real; a second job resumes from ``latest_checkpoint()``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

from megatron.core import dist_checkpointing as mdc  # noqa: E402

from dcp_memstore import MemStore  # noqa: E402
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy  # noqa: E402
from tests.megatron import test_megatron_strategies as megatron_state  # noqa: E402
from tests.multiproc.mp_harness import JOB_ID, MultiProc, assert_bit_equal  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
KEPT, KILLED = "iter_0000010", "iter_0000020"  # checkpoint directories' names
JOB_WAIT_S = 120.0


def killed_after_commit_job(rank: int, world: int, root: str, ckpts: str) -> None:
    """Each rank: one checkpoint saved in full, then a second one whose finalize is cut short by a SIGKILL
    of every trainer in place of Megatron's own last step, the write of ``metadata.json``."""
    store = MemStore(root, JOB_ID, keep_in_memory=2, io_threads=2)
    strategy = MemStoreSaveStrategy(store)
    for seed, name in ((1, KEPT), (2, KILLED)):
        values, obj = megatron_state.local_values(rank, seed), megatron_state.rank_object(rank, seed)
        state = {**megatron_state.sharded(values, obj, rank, world), **megatron_state.common_state(seed)}
        request = mdc.save(state, str(Path(ckpts) / name), sharded_strategy=strategy, async_sharded_save=True)
        if name == KILLED:
            assert len(request.finalize_fns) == 2  # the strategy's commit, then Megatron's metadata.json
            request.finalize_fns[1] = lambda: os.kill(os.getpid(), signal.SIGKILL)
        request.execute_sync()


def resume_job(rank: int, world: int, root: str, ckpts: str) -> dict[str, Any]:
    """Each rank: resume from ``latest_checkpoint()`` through Megatron's load."""
    with MemStore(root, JOB_ID, keep_in_memory=2, io_threads=2) as store:
        latest = store.latest_checkpoint()
        loaded = mdc.load(
            megatron_state.template(rank, world),
            str(Path(ckpts) / latest),
            sharded_strategy=MemStoreLoadStrategy(store),
        )
        return {"latest": latest, "loaded": loaded}


def test_a_job_killed_before_megatron_writes_metadata_resumes_from_its_newest_checkpoint() -> None:
    m = MultiProc()
    try:
        ckpts = m.workdir / "ckpts"
        for name in (KEPT, KILLED):
            (ckpts / name).mkdir(parents=True)
        killed = m.start(killed_after_commit_job, WORLD, str(m.root), str(ckpts))
        assert killed.wait(JOB_WAIT_S), f"the first job did not end\n{killed.errors()}"
        assert killed.exitcodes() == [-signal.SIGKILL] * WORLD, f"{killed.exitcodes()}\n{killed.errors()}"
        resumed = m.start(resume_job, WORLD, str(m.root), str(ckpts)).check(timeout=JOB_WAIT_S)
    finally:
        m.close()
    for rank, rep in enumerate(resumed):
        assert rep["latest"] == KILLED
        assert_bit_equal(
            rep["loaded"], megatron_state.expected_loaded(rank, 2), f"rank {rank} resumed from {KILLED}"
        )
