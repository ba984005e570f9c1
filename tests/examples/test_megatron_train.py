"""examples/megatron_train.py as its docstring runs it: 20 steps, then a new job resumed from the store to
30, ends with the loss and weights of 30 steps in one go; a run resumed at its last step trains nothing.
The 20 steps save through Megatron's persistent worker (``--persistent-worker``), the other runs through
its forked worker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "megatron.core.dist_checkpointing",
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_train.py"


@pytest.fixture
def root() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dcpms-megatron-example-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(root: str, save: Path, job_id: str, steps: int, *options: str) -> list[str]:
    """One torchrun job of the example (2 ranks, a free port); its stdout lines (fails if it fails)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLE), "--steps", str(steps), "--save-every", "5", "--root", root]
    cmd += ["--save", str(save), "--job-id", job_id, *options]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "DCP_MEMSTORE_CRASH_AT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    report = f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    return proc.stdout.splitlines()


@pytest.mark.timeout(600)  # four torchrun jobs, each importing Megatron on 2 ranks: minutes on a busy machine
def test_resumed_run_ends_like_an_uninterrupted_one(root: str, tmp_path: Path) -> None:
    """The resumed job starts at step 20, from the checkpoint the persistent worker wrote, and its last line
    (loss, weights digest) equals the one of 30 steps in one go; run again, it resumes at step 30 and
    reports the same weights and no loss (before, it printed 'loss nan', as if training had diverged)."""
    whole = _run(root, tmp_path / "whole", "whole", 30)
    assert not [line for line in whole if "persistent worker" in line], whole
    split = _run(root, tmp_path / "split", "split", 20, "--persistent-worker")
    workers = {line.rsplit("(pid ", 1)[1] for line in split if "to the persistent worker (pid " in line}
    assert len(workers) == 1 and sum(" on its way" in line for line in split) == 4, split
    resumed = _run(root, tmp_path / "split", "split", 30)
    assert f"resumed from {tmp_path / 'split' / 'iter_0000020'} (step 20)" in resumed, resumed
    assert resumed[-1].startswith("done at step 30: loss ") and resumed[-1] == whole[-1], (resumed, whole)
    again = _run(root, tmp_path / "split", "split", 30)
    assert again[-2:] == [
        f"resumed from {tmp_path / 'split' / 'iter_0000030'} (step 30)",
        "done at step 30: no step left to train (--steps 30), weights digest "
        + whole[-1].rsplit("weights digest ", 1)[1],
    ], again
