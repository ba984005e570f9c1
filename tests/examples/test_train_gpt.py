"""examples/train_gpt.py end to end: a GPT trained on 2 ranks, one rank SIGKILLed, the job resumed from the
in-memory store, and the loss curve of the killed-and-resumed training equal bit for bit to an
uninterrupted run's (the example's own check, and this test's reading of the CSV it writes)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
STEPS, EVERY, FAIL_AT = 12, 3, 8  # checkpoints after steps 3 and 6; rank 1 dies in step 8
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_killed_and_resumed_loss_curve_equals_the_reference(tmp_path: Path) -> None:
    """Exit code 0, both CSV curves equal at every step (hex and repr), the curve made of the killed run up
    to its restored checkpoint and of the resumed run after it, and a readable PNG."""
    pytest.importorskip(
        "matplotlib", reason="examples/train_gpt.py plots with matplotlib: pip install matplotlib"
    )
    import matplotlib.image

    out = tmp_path / "out"
    cmd = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--every", str(EVERY)]
    cmd += ["--fail-at-step", str(FAIL_AT), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "DCP_MEMSTORE_CRASH_AT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    report = f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert "rank 1 (pid" in proc.stdout and "sends itself SIGKILL" in proc.stdout, report

    with open(out / "losses.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["reference_loss_hex"] and r["reference_loss_hex"] == r["resumed_loss_hex"], r
        ref, got = float(r["reference_loss"]), float(r["resumed_loss"])
        assert ref == got == float.fromhex(r["resumed_loss_hex"]), r  # repr is exact too

    # The compared curve really is the killed run's, then the resumed run's: the resume started from a
    # checkpoint saved before the crash, so the switch is at a checkpoint step before FAIL_AT.
    runs = [r["resumed_run"] for r in rows]
    restored = runs.index("resumed")
    assert set(runs[:restored]) == {"failed"} and set(runs[restored:]) == {"resumed"}, runs
    assert 0 < restored < FAIL_AT and restored % EVERY == 0, runs

    png = out / "losses.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
