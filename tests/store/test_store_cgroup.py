"""A memory cgroup's limit bounds what a save may write to tmpfs, also when an ancestor of the process's
cgroup sets it and its own cgroup does not (as Slurm limits a job, not the task below it).

The cgroups are real: each test makes a limited cgroup and an unlimited one inside it below this
process's memory cgroup, and runs a saving process in the inner one. Skipped where no memory cgroup can
be made (not root, or no writable memory controller)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

GiB = 1 << 30

# Joins the inner cgroup, then saves a state dict that fits in the memory the tightest limit leaves, but
# not twice (the state dict and its checkpoint).
_SAVER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    inner, tightest, root = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    limit_file, usage_file = sys.argv[4], sys.argv[5]
    (inner / "cgroup.procs").write_text(str(os.getpid()))
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from dcp_memstore import MemoryStorageWriter, MemStore
    from dcp_memstore.store.space import cgroup_headroom
    left = int((tightest / limit_file).read_text()) - int((tightest / usage_file).read_text())
    state = {"w": torch.ones(int(left * 0.6) // 4)}
    store = MemStore(root=root, job_id="cg")
    try:
        dcp.save(state, storage_writer=MemoryStorageWriter(store), checkpoint_id="s1", no_dist=True)
        outcome = "saved"
    except CheckpointException as e:  # DCP wraps the rank's error into its message
        outcome = f"refused: {e}" if "InsufficientSpaceError" in str(e) else f"failed: {e}"
    print(json.dumps({"headroom": cgroup_headroom(), "outcome": outcome,
                      "checkpoints": store.list_checkpoints()}))
    store.close()
    """
)


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and its version ('v1' or 'v2'), if it has one."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / rel.strip("/"), "v1"
        if controllers == "":
            d = Path("/sys/fs/cgroup") / rel.strip("/")
            if d.exists() and "memory" in (d / "cgroup.controllers").read_text().split():
                return d, "v2"
    return None


def _limit_files(version: str) -> tuple[str, str]:
    return (
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
        if version == "v1"
        else ("memory.max", "memory.current")
    )


def _make(d: Path, limit: int | None, version: str) -> None:
    d.mkdir()
    if version == "v2":
        (d.parent / "cgroup.subtree_control").write_text("+memory")
    if limit is not None:
        (d / _limit_files(version)[0]).write_text(str(limit))


@contextlib.contextmanager
def _nested_cgroups(outer_limit: int, inner_limit: int | None) -> Iterator[tuple[Path, Path, str]]:
    """(outer, inner, version): a cgroup limited to ``outer_limit`` bytes below this process's memory
    cgroup, and one inside it limited to ``inner_limit`` (None: no limit of its own)."""
    own = _own_memory_cgroup()
    if own is None or os.geteuid() != 0:
        pytest.skip("needs root and a memory cgroup")
    base, version = own
    outer = base / f"dcpms-test-{uuid.uuid4().hex[:8]}"
    inner = outer / "task"
    try:
        try:
            _make(outer, outer_limit, version)
            _make(inner, inner_limit, version)
        except OSError as e:
            pytest.skip(f"cannot make a memory cgroup under {base}: {e}")
        yield outer, inner, version
    finally:
        for d in (inner, outer):  # the saving process has exited; tmpfs charges move to the parent
            if d.exists():
                d.rmdir()


def _save(inner: Path, tightest: Path, root: Path, version: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SAVER, str(inner), str(tightest), str(root), *_limit_files(version)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0, f"saver exited with {out.returncode}: {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("inner_limit", [None, 4 * GiB], ids=["inner-unlimited", "inner-looser"])
def test_an_ancestors_limit_refuses_a_save_that_would_exceed_it(inner_limit, shm_dir):
    with _nested_cgroups(GiB, inner_limit) as (outer, inner, version):
        result = _save(inner, outer, shm_dir, version)
    assert result["headroom"] is not None and result["headroom"] < GiB
    assert result["outcome"].startswith("refused: ") and str(shm_dir) in result["outcome"]
    assert result["checkpoints"] == []


def test_the_process_own_limit_still_counts_under_a_looser_ancestor(shm_dir):
    with _nested_cgroups(4 * GiB, GiB) as (_, inner, version):
        result = _save(inner, inner, shm_dir, version)
    assert result["headroom"] is not None and result["headroom"] < GiB
    assert result["outcome"].startswith("refused: ")
    assert result["checkpoints"] == []
