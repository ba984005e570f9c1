"""A Megatron save that is written and waits for its finalize step is no failed save to reclaim for room.

Megatron's async save writes a checkpoint in its worker, and the trainer commits it later, in the finalize
step; in between, the trainer may start its next save. When that save finds too little room in the store,
the store discards what earlier failed saves of the process left, and tries again. A save waiting for its
finalize step is not one of them: it keeps its directory (the save that finds no room fails), and it
commits intact. A save whose request was dropped unfinalized (the queue closed with ``abort=True``) is a
failed save, and its directory is reclaimed.

One rank (a real process group of one) on a real 8 MiB tmpfs; real Megatron saves, written by Megatron's
forked worker. Megatron calls CUDA-only functions on its async path even for CPU tensors; ``cuda_shim``
stands them in for this CPU-only torch, in the job's process only (see its docstring).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

import torch  # noqa: E402
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from dcp_memstore import MemStore  # noqa: E402
from dcp_memstore.megatron import MemStoreLoadStrategy, MemStoreSaveStrategy  # noqa: E402
from tests.megatron.cuda_shim import shim_cuda_for_cpu  # noqa: E402
from tests.megatron.test_megatron_strategies import written_not_finalized  # noqa: E402
from tests.multiproc.mp_harness import JOB_ID, MultiProc, assert_bit_equal, make_tensor  # noqa: E402

pytestmark = pytest.mark.slow

DROPPED, WRITTEN, NO_ROOM = "iter_0000001", "iter_0000002", "iter_0000003"  # checkpoint directories' names


def sized(seed: int, mib: float) -> dict[str, Any]:
    """A sharded state dict of one float32 tensor of ``mib`` MiB (a rank's whole world here)."""
    return {
        "w": ShardedTensor.from_rank_offsets("w", make_tensor(seed, (int(mib * (1 << 18)),), torch.float32))
    }


def no_room_job(rank: int, world: int, root: str, ckpts: str) -> dict[str, Any]:
    """A 3 MiB save written and dropped unfinalized, a 3 MiB save written, then a 5.5 MiB save, which does
    not fit next to the written one, before that one is finalized; report what each left."""
    shim_cuda_for_cpu()  # Megatron's async path calls CUDA-only functions; see cuda_shim
    store = MemStore(root, JOB_ID, io_threads=1, keep_in_memory=1, stage_timeout_s=20)
    base, out = Path(ckpts), {}
    written_not_finalized(store, sized(1, 3), str(base / DROPPED)).close(abort=True)  # and dropped
    queue = written_not_finalized(store, sized(2, 3), str(base / WRITTEN))
    try:
        mdc.save(sized(3, 5.5), str(base / NO_ROOM), sharded_strategy=MemStoreSaveStrategy(store))
        out["no_room"] = None
    except Exception as e:  # the one rank raises at once (no collective waits for it)
        out["no_room"] = f"{type(e).__name__}: {e}"
    out["left"] = sorted(os.listdir(store.layout.checkpoints_dir))
    try:
        out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointException as e:  # DCP's, a BaseException
        out["finalized"] = str(e)
    out["committed"] = store.list_checkpoints()
    if WRITTEN in out["committed"]:
        template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3 << 18))}
        out["loaded"] = mdc.load(template, str(base / WRITTEN), sharded_strategy=MemStoreLoadStrategy(store))
    store.close()
    return out


def test_a_save_waiting_for_its_finalize_step_is_not_reclaimed_for_room(small_tmpfs: Path) -> None:
    """The save that finds no room fails, and the written one, finalized afterwards, commits and loads back
    bit for bit (before, the space check discarded its directory, and finalizing it raised that rank 0 had
    no results); the dropped save's directory was reclaimed."""
    m = MultiProc()
    try:
        for name in (DROPPED, WRITTEN, NO_ROOM):
            (m.workdir / "ckpts" / name).mkdir(parents=True)
        (rep,) = m.run(no_room_job, 1, str(small_tmpfs), str(m.workdir / "ckpts"))
    finally:
        m.close()
    assert rep["no_room"] is not None and "InsufficientSpaceError" in rep["no_room"], rep
    assert rep["finalized"] == [0], rep["finalized"]
    assert rep["left"] == [WRITTEN], rep
    assert rep["committed"] == [WRITTEN], rep
    assert_bit_equal(rep["loaded"], {"w": sized(2, 3)["w"].data}, WRITTEN)
