"""kill -9 of a training rank at a random moment of a run of async saves: the newest checkpoint is intact."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_harness import JOB_ID, MultiProc, assert_bit_equal, blank_like, digest, make_tensor, write_record
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore

pytestmark = pytest.mark.slow

RUN_LIMIT_S = 90.0  # the training loop ends by itself if nobody kills it (the test then fails)


def state(step: int, rank: int) -> dict:
    seed = step * 100
    return {
        f"rank{rank}": {
            "w": make_tensor(seed + rank * 10 + 1, (256, 256), torch.float32),
            "b": make_tensor(seed + rank * 10 + 2, (512, 128), torch.bfloat16),
            "ids": make_tensor(seed + rank * 10 + 3, (4096,), torch.int64),
        },
        "shared": {"emb": make_tensor(seed + 91, (128, 64), torch.float16)},
        "extra": {"step": step},
    }


def step_of(ckpt: str) -> int:
    return int(ckpt.removeprefix("step-"))


def train_and_save(rank: int, world: int, root: str, records: str, executor: str) -> str:
    """Each step: update the live state in place, record its digest under the checkpoint id, async-save
    it, scribble over the live tensors while the save runs, wait for the save, note it as done."""
    store = MemStore(root, JOB_ID, keep_in_memory=2)
    writer = MemoryStorageWriter(store)
    kind = AsyncCheckpointerType(executor)
    live = state(0, rank)
    deadline = time.monotonic() + RUN_LIMIT_S
    step = 0
    while time.monotonic() < deadline:
        step += 1
        for key, values in state(step, rank).items():
            if key == "extra":
                live[key] = values
            else:
                for name, t in values.items():
                    live[key][name].copy_(t)
        ckpt = f"step-{step}"
        write_record(Path(records) / f"{ckpt}.rank{rank}", digest(live))
        fut = dcp.async_save(live, checkpoint_id=ckpt, storage_writer=writer, async_checkpointer_type=kind)
        for key in (f"rank{rank}", "shared"):
            for t in live[key].values():
                t.fill_(3)
        fut.result(timeout=120)
        write_record(Path(records) / f"done.rank{rank}", ckpt)
    return "never killed"


def load_every_checkpoint(rank: int, world: int, root: str, records: str) -> dict:
    """A new job: every committed checkpoint must load bit-identical to what was saved under its id."""
    store = MemStore(root, JOB_ID)
    listed = store.list_checkpoints()
    latest = store.latest_checkpoint()
    for ckpt in listed:
        expected = state(step_of(ckpt), rank)
        target = blank_like(expected)
        dcp.load(target, checkpoint_id=ckpt, storage_reader=MemoryStorageReader(store))
        recorded = (Path(records) / f"{ckpt}.rank{rank}").read_text()
        assert digest(target) == recorded, f"{ckpt} on rank {rank}: loaded data differs from what was saved"
        assert_bit_equal(target, expected, f"{ckpt} on rank {rank}")
    return {
        "listed": listed,
        "latest": latest,
        "checkpoint_dirs": sorted(os.listdir(store.layout.checkpoints_dir)),
        "staging": sorted(os.listdir(store.layout.staging_dir)),
    }


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_kill_9_during_async_saves(mp: MultiProc, tmp_path: Path, executor: str) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    victim = rng.randrange(2)
    delay = rng.uniform(0.0, 1.5)
    about = f"seed {seed}: kill -9 of rank {victim} {delay:.2f}s after the first save finished"

    job = mp.start(train_and_save, 2, str(mp.root), str(tmp_path), executor)
    deadline = time.monotonic() + 120
    while not (tmp_path / "done.rank0").exists():  # let at least one checkpoint commit first
        assert job.exitcodes() == [None, None], (
            f"{about}: the job ended early {job.exitcodes()}\n{job.errors()}"
        )
        assert time.monotonic() < deadline, f"{about}: no save finished in time"
        time.sleep(0.02)
    time.sleep(delay)
    os.kill(job.pids[victim], signal.SIGKILL)
    assert job.wait(30, ranks=[victim]) and job.exitcodes()[victim] == -signal.SIGKILL, about
    time.sleep(
        rng.uniform(0.0, 0.3)
    )  # the other rank runs on a little, as it would until the job is torn down
    job.kill()
    job.assert_gone()
    done = (tmp_path / "done.rank0").read_text()  # the newest save that rank 0 saw complete

    found = mp.run(load_every_checkpoint, 2, str(mp.root), str(tmp_path))

    for r, f in enumerate(found):
        assert f["listed"], f"{about}: rank {r}: no checkpoint survived"
        assert f["latest"] == f["listed"][-1], f"{about}: rank {r}: {f}"
        assert step_of(f["latest"]) >= step_of(done), (
            f"{about}: {done} had completed, newest is {f['latest']}"
        )
        assert f["checkpoint_dirs"] == sorted(f["listed"]), (
            f"{about}: rank {r}: leftovers of the killed save: {f}"
        )
        assert f["staging"] == [], f"{about}: rank {r}: staging slots left: {f}"
