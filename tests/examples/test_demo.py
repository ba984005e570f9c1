"""examples/demo.py, the README's first command, end to end; and what its driver leaves in a job's log when
the job hangs (every process's Python stack), so that a hang in CI can be explained from the log alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_demo_kills_a_rank_and_resumes_bit_for_bit() -> None:
    """Exit code 0, a PASS line, and every row of the verdict table says yes."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "DCP_MEMSTORE_CRASH_AT")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py")], capture_output=True, text=True, timeout=300, env=env
    )
    report = f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert "\nPASS: killed at step 14, resumed from 'step-12'" in proc.stdout, report
    verdict = proc.stdout.split("\nverdict\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(verdict) == 6 and all(row.rstrip().endswith("yes") for row in verdict), report


def test_a_job_that_does_not_end_in_time_leaves_every_process_stack_in_its_log(tmp_path: Path) -> None:
    """torchrun_job's watchdog: the log names torchrun and both workers with their stacks (the function a
    worker is stuck in), no process of the job is left, and no stack file either."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from demo import RunResult, torchrun_job, wait_gone
    finally:
        sys.path.remove(str(EXAMPLES))
    worker = tmp_path / "stuck_worker.py"
    worker.write_text(
        textwrap.dedent(
            f"""
            import os, sys, time
            sys.path.insert(0, {str(EXAMPLES)!r})
            from demo_train import emit, stacks_on_sigusr1
            stacks_on_sigusr1()
            emit(event="hello", pid=os.getpid())
            def waits_for_ever():
                time.sleep(600)
            waits_for_ever()
            """
        )
    )
    res = RunResult("stuck", log=tmp_path / "stuck.log")
    torchrun_job(worker, [], 2, res, lambda ev: res.worker_pids.append(ev["pid"]), timeout_s=15)
    log = res.log.read_text()
    assert res.timed_out and res.returncode != 0, log
    assert len(res.worker_pids) == 2, log
    for pid in res.worker_pids:
        assert f"--- pid {pid}: " in log, log
    assert log.count("in waits_for_ever") == 2, log  # each worker's stack, not interleaved
    assert "torch/distributed/run.py" in log, log  # torchrun's own stack
    assert wait_gone(res.worker_pids) == []  # SIGKILLed: gone once the kernel has torn them down
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stuck.log", "stuck_worker.py"]
