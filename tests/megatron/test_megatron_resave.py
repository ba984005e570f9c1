"""A second Megatron save into the directory of a committed checkpoint, or of one not yet finalized, and a
directory whose checkpoint id was saved again from another directory, on 2 gloo ranks.

Megatron writes ``common.pt`` into ``checkpoint_dir`` before it calls the sharded strategy, so by the time
``MemStoreSaveStrategy`` refuses the save (the id already exists, or is being saved), the checkpoint's
common state has been replaced by the refused save's. A load of that directory must not hand back the old
tensors with the new common state, nor may the unfinalized save commit them. This happens when training
resumes from an older checkpoint than the newest committed one and reaches the same iteration again, or
saves an iteration twice (a regular save, then one on exit).

Real Megatron save and load, real store; no CUDA is needed on this synchronous path.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

import torch  # noqa: E402
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
UNFINALIZED, AFTER = "iter_0000300", "iter_0000301"
REUSED = "iter_0000400"  # saved, deleted, then saved again from another directory
LET_GO = "iter_0000500"  # an unfinalized save's request let go in a reference cycle, then saved again


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

    # a second save of a directory whose save is written but not finalized
    request = mdc.save(state(4), str(base / UNFINALIZED), sharded_strategy=save, async_sharded_save=True)
    request.async_fn(*request.async_fn_args)  # the write, as Megatron's async worker runs it
    out["second_of_unfinalized"] = _error_of(
        lambda: mdc.save(state(5), str(base / UNFINALIZED), sharded_strategy=save, async_sharded_save=True)
    )
    out["unfinalized"] = _error_of(lambda: [fn() for fn in request.finalize_fns])
    mdc.save(state(6), str(base / AFTER), sharded_strategy=save)
    out["after"] = mdc.load(megatron_state.template(rank, world), str(base / AFTER), sharded_strategy=load)
    out["committed"] = store.list_checkpoints()

    # a directory whose checkpoint id was deleted, then saved again from another directory
    mdc.save(state(7), str(base / "first" / REUSED), sharded_strategy=save)
    if rank == 0:  # the store is per node: one process of the node deletes
        store.delete(REUSED)
    torch.distributed.barrier()
    mdc.save(state(8), str(base / "second" / REUSED), sharded_strategy=save)
    out["reused"] = _error_of(
        lambda: mdc.load(
            megatron_state.template(rank, world), str(base / "first" / REUSED), sharded_strategy=load
        )
    )
    out["reused_metadata"] = _error_of(lambda: load.load_tensors_metadata(str(base / "first" / REUSED)))
    out["second"] = mdc.load(
        megatron_state.template(rank, world), str(base / "second" / REUSED), sharded_strategy=load
    )

    # an unfinalized save let go (as a queue closed with abort=True lets its requests go), held by a
    # reference cycle that no automatic collection reaches here; then its directory is saved again
    gc.disable()
    try:
        let_go = mdc.save(state(9), str(base / LET_GO), sharded_strategy=save, async_sharded_save=True)
        let_go.async_fn(*let_go.async_fn_args)
        cycle: list[Any] = [let_go]
        cycle.append(cycle)
        del let_go, cycle
        out["let_go_resave"] = _error_of(
            lambda: mdc.save(state(10), str(base / LET_GO), sharded_strategy=save)
        )
    finally:
        gc.enable()
    out["let_go"] = mdc.load(megatron_state.template(rank, world), str(base / LET_GO), sharded_strategy=load)
    store.close()
    return out


def _error_of(call: Callable[[], Any]) -> str | None:
    """The error ``call`` raised, as text, or None."""
    try:
        call()
    except (CheckpointException, CheckpointingException) as e:  # DCP's is a BaseException
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def job() -> Any:
    """Run the 2-rank job once; its ranks' reports."""
    dirs = (RESAVED, KEPT, UNFINALIZED, AFTER, f"first/{REUSED}", f"second/{REUSED}", LET_GO)
    yield from megatron_state.run_megatron_job(resave_job, dirs)


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


def test_a_second_save_of_a_directory_not_yet_finalized_is_refused_and_neither_commits(job: list[dict]):
    """The second save is refused on every rank (its id is being saved); the first, written, then fails
    at finalize on every rank, since its common.pt is now the refused save's, and commits nothing (before,
    the second save discarded the first's files, whose finalize then blamed its async worker). The next
    save of another directory commits and loads bit for bit."""
    for rank, rep in enumerate(job):
        second = rep["second_of_unfinalized"]
        assert second is not None and f"checkpoint '{UNFINALIZED}' is being saved right now" in second, second
        first = rep["unfinalized"]
        assert first is not None and "common.pt was replaced after this save" in first, first
        assert "async_fn did not run" not in first, first
        assert UNFINALIZED not in rep["committed"] and AFTER in rep["committed"], rep["committed"]
        assert_bit_equal(rep["after"], megatron_state.expected_loaded(rank, 6), f"rank {rank} after")


def test_a_directory_whose_id_was_saved_again_from_another_directory_is_refused(job: list[dict]) -> None:
    """Loading a directory whose checkpoint was deleted, its id then saved again from another directory,
    is refused on every rank, naming why (before, it loaded the other save's tensors with this directory's
    common state); so is its tensors' metadata. The other directory loads bit for bit."""
    for rank, rep in enumerate(job):
        for key in ("reused", "reused_metadata"):
            error = rep[key]
            assert error is not None and "the checkpoint under that id here is another save" in error, error
        assert_bit_equal(rep["second"], megatron_state.expected_loaded(rank, 8), f"rank {rank} second")


def test_a_directory_whose_unfinalized_save_was_let_go_can_be_saved_again(job: list[dict]) -> None:
    """A save that is not finalized counts as running while its request lives; one let go (a queue closed
    with abort=True) may live on in a reference cycle until the garbage collector's next pass. A new save
    of its directory collects it first instead of being refused, and commits."""
    for rank, rep in enumerate(job):
        assert rep["let_go_resave"] is None, rep["let_go_resave"]
        assert_bit_equal(rep["let_go"], megatron_state.expected_loaded(rank, 10), f"rank {rank} let go")
