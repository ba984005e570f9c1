"""dcp_memstore demo: SIGKILL a 2-rank training job, restart it, and resume bit for bit from memory.

    python examples/demo.py                 # or: nox -s demo
    python examples/demo.py --steps 30 --every 5 --fail-at-step 17 --keep

Three torchrun jobs of ``examples/demo_train.py`` (2 ranks each, CPU, gloo) share a temporary store root
under /dev/shm:

1. a reference run that trains ``--steps`` steps without failure (its own job id);
2. run 1, which checkpoints with ``dcp.async_save`` into the store every ``--every`` steps and is killed
   at step ``--fail-at-step``: this script SIGKILLs one rank, torchrun tears the rest of the job down;
3. run 2, a new torchrun with the same store root and job id, which loads
   ``store.latest_checkpoint()`` with ``dcp.load`` and trains to the end.

Then it checks that run 1 and run 2 together reproduce the reference run exactly: every step's loss (same
float bits) and every final parameter (``torch.equal``). Exit code 0 only if everything matches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn, TypeVar

import psutil
import torch
from demo_train import EVENT_PREFIX, STACKS_ENV

from dcp_memstore import MemStore

HERE = Path(__file__).resolve().parent
TRAIN_SCRIPT = HERE / "demo_train.py"
NPROC = 2
FAIL_RANK = 1
JOB_ID = "demo"
REFERENCE_JOB_ID = "demo-reference"
RUN_TIMEOUT_S = 120.0
STACK_DUMP_WAIT_S = 1.0
# torchrun (``python -m torch.distributed.run``) that writes every thread's Python stack on SIGUSR1, as the
# training processes do (``demo_train.stacks_on_sigusr1``): a job that hangs shows where in its log.
TORCHRUN_WITH_STACKS = (
    f"import sys; sys.path.insert(0, {str(HERE)!r}); from demo_train import stacks_on_sigusr1; "
    "stacks_on_sigusr1(); from torch.distributed.run import main; sys.exit(main())"
)


@dataclass
class RunResult:
    """What one torchrun job did, as seen from this script."""

    label: str
    returncode: int | None = None
    losses: dict[int, str] = field(default_factory=dict)  # step -> loss as float.hex()
    worker_pids: list[int] = field(default_factory=list)
    killed_pid: int | None = None
    killed_at_step: int | None = None
    killed_at: float | None = None  # time.monotonic() of the SIGKILL
    exited_at: float | None = None  # time.monotonic() when torchrun had exited
    resumed_from: str | None = None
    first_step: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    log: Path | None = None
    final_params: Path | None = None


R = TypeVar("R", bound=RunResult)  # torchrun_job fills in and returns the caller's own kind of result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's options."""
    p = argparse.ArgumentParser(
        description="Train on 2 ranks with async in-memory checkpoints, SIGKILL a rank, resume, and "
        "compare with an uninterrupted run bit for bit."
    )
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    p.add_argument("--fail-at-step", type=int, default=14, help="SIGKILL rank 1 at this step (default 14)")
    p.add_argument("--keep", action="store_true", help="keep the store and logs (printed at the end)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.every < 1:
        p.error("need --steps >= 2 and --every >= 1")
    if not args.every < args.fail_at_step <= args.steps:
        p.error(
            f"need --every < --fail-at-step <= --steps (got every={args.every}, "
            f"fail-at-step={args.fail_at_step}, steps={args.steps}), so that a checkpoint exists before "
            "the crash and the crash happens during training"
        )
    return args


def loss_text(hexed: str) -> str:
    """A loss for people: 9 significant digits, enough to tell any two float32 values apart."""
    return f"{float.fromhex(hexed):.9f}"


def steps_text(span: range) -> str:
    """'step 7' or 'steps 7-12'."""
    return f"step {span[0]}" if len(span) == 1 else f"steps {span[0]}-{span[-1]}"


def run_job(
    label: str,
    job_id: str,
    args: argparse.Namespace,
    work: Path,
    fail_at_step: int,
    reference: dict[int, str] | None,
    marker: str = "",
    quiet: bool = False,
) -> RunResult:
    """Launch one torchrun job of ``demo_train.py``, print its steps as they happen, kill a rank on request.

    ``reference`` (step -> loss hex) annotates each step with whether it matches; ``marker`` tags this
    run's step lines (the resumed run's); ``quiet`` prints nothing per step.
    """
    name = label.replace(" ", "_")
    res = RunResult(label, log=work / f"{name}.log", final_params=work / f"{name}.params.pt")
    script_args = ["--root", work / "store", "--job-id", job_id, "--steps", args.steps, "--every", args.every]
    script_args += ["--fail-at-step", fail_at_step, "--fail-rank", FAIL_RANK]
    script_args += ["--final-params", res.final_params]
    return torchrun_job(
        TRAIN_SCRIPT, script_args, NPROC, res, lambda ev: _handle_event(ev, res, reference, marker, quiet)
    )


def torchrun_job(
    script: Path,
    script_args: Sequence[object],
    nproc: int,
    res: R,
    on_event: Callable[[dict[str, Any]], None],
    timeout_s: float | None = None,
) -> R:
    """Run ``script`` under torchrun on ``nproc`` local ranks and wait until torchrun and every worker have
    exited; fill in ``res`` (returncode, exited_at, timed_out, seconds) and return it.

    Each stdout line ``EVENT_PREFIX`` + JSON goes to ``on_event`` as it arrives; every other stdout line, and
    all of stderr, goes to ``res.log``. After ``timeout_s`` (default ``RUN_TIMEOUT_S``) a watchdog SIGKILLs
    torchrun, its descendants and ``res.worker_pids`` (the workers ``on_event`` has recorded), and sets
    ``res.timed_out``; an exception here (Ctrl-C) kills them the same way before it propagates."""
    assert res.log is not None
    cmd = [
        *(sys.executable, "-c", TORCHRUN_WITH_STACKS, "--nproc-per-node", str(nproc)),
        # the rendezvous store binds a port of its own choosing: no port picked here that another
        # process could take before torchrun binds it
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", uuid.uuid4().hex),
        *("--local-addr", "127.0.0.1"),  # the workers' MASTER_ADDR, not whatever the host name resolves to
        *("--max-restarts", "0", "--monitor-interval", "0.1", str(script)),
        *map(str, script_args),
    ]
    stacks = f"{res.log}.stacks"  # each process's stack file on a hang: <stacks>-<pid>.txt
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env[STACKS_ENV] = stacks
    env.pop("DCP_MEMSTORE_CRASH_AT", None)  # the jobs' crash is their own SIGKILL, not a test crash point
    t0 = time.monotonic()
    with open(res.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True)

        def on_timeout() -> None:
            res.timed_out = True
            dump_stacks(proc.pid, log, stacks)
            kill_tree(proc.pid, res.worker_pids)

        watchdog = threading.Timer(RUN_TIMEOUT_S if timeout_s is None else timeout_s, on_timeout)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # ends when torchrun and every worker have exited
                try:
                    event = json.loads(line[len(EVENT_PREFIX) :]) if line.startswith(EVENT_PREFIX) else None
                except json.JSONDecodeError:
                    event = None
                if event is None:
                    log.write(line)
                else:
                    on_event(event)
            res.returncode = proc.wait()
            res.exited_at = time.monotonic()
        finally:
            watchdog.cancel()
            if proc.poll() is None:  # interrupted (Ctrl-C) or an error here: leave nothing running
                kill_tree(proc.pid, res.worker_pids)
                proc.wait()
            for path in Path(stacks).parent.glob(f"{Path(stacks).name}-*.txt"):
                path.unlink(missing_ok=True)
    res.seconds = time.monotonic() - t0
    return res


def _handle_event(
    ev: dict[str, Any], res: RunResult, reference: dict[int, str] | None, marker: str, quiet: bool
) -> None:
    """React to one event of a training process: record it, print it, kill the process that asks for it."""
    kind = ev["event"]
    if kind == "hello":
        res.worker_pids.append(ev["pid"])
    elif kind == "start":
        res.resumed_from, res.first_step = ev["resumed_from"], ev["first_step"]
        if quiet:
            return
        if res.resumed_from is None:
            print("    store.latest_checkpoint() = None: start from scratch", flush=True)
        else:
            print(
                f"    store.latest_checkpoint() = '{res.resumed_from}': dcp.load restores model, optimizer, "
                f"RNG state and step {res.first_step - 1}; resumed steps are marked {marker}",
                flush=True,
            )
    elif kind == "step":
        step, hexed = ev["step"], ev["loss"]
        res.losses[step] = hexed
        if quiet:
            return
        check = ""
        if reference is not None:
            want = reference.get(step)
            check = (
                "= reference" if want == hexed else f"!= reference {loss_text(want) if want else '(none)'}"
            )
        save = ev.get("save")
        note = ""
        if save:
            note = (
                f"   async_save '{save['id']}' (training paused {save['wait_ms'] + save['stage_ms']:.1f} ms)"
            )
        print(
            f"    step {step:3d}{marker:1s} loss {loss_text(hexed)}  {check:<13s}{note}".rstrip(), flush=True
        )
    elif kind == "kill-me":
        os.kill(ev["pid"], signal.SIGKILL)
        res.killed_pid, res.killed_at_step, res.killed_at = ev["pid"], ev["step"], time.monotonic()
        print(
            f"    step {ev['step']:3d}  ** SIGKILL rank {ev['rank']} (pid {ev['pid']}) "
            "in the middle of training **",
            flush=True,
        )


def process_tree(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and its descendants (none if it is gone)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def dump_stacks(pid: int, log: IO[str], stacks: str) -> None:
    """Have torchrun ``pid`` and its workers write their Python stacks (SIGUSR1, each process into
    ``<stacks>-<pid>.txt``, see ``demo_train.stacks_on_sigusr1``), all at once, and append them to the
    job's log, one process after the other."""
    log.write("\n--- the job did not end in time: the Python stacks of torchrun and its workers ---\n")
    procs: list[tuple[int, str]] = []
    for p in process_tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append((p.pid, " ".join(p.cmdline()[-4:])))
            p.send_signal(signal.SIGUSR1)
    time.sleep(STACK_DUMP_WAIT_S)
    for p_pid, cmdline in procs:
        path = Path(f"{stacks}-{p_pid}.txt")
        text = path.read_text() if path.exists() else ""
        log.write(f"--- pid {p_pid}: {cmdline}\n{text or '(no stack: it had not set up its handler)'}\n")
    log.flush()


def kill_tree(pid: int, extra: list[int]) -> None:
    """SIGKILL process ``pid``, its descendants and the processes ``extra`` (torchrun puts each worker in a
    session of its own, so killing torchrun's process group would miss them)."""
    for p in process_tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    for other in extra:
        with contextlib.suppress(ProcessLookupError):
            os.kill(other, signal.SIGKILL)


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (zombies count as dead)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` runs; return those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def fail(msg: str, res: RunResult | None = None) -> NoReturn:
    """Stop the demo with a clear message (and the tail of the job's log) and exit code 1."""
    print(f"\nFAIL: {msg}", flush=True)
    if res is not None and res.log is not None and res.log.exists():
        tail = res.log.read_text().splitlines()[-(300 if res.timed_out else 25) :]  # stacks of a hang
        print(f"--- last lines of {res.label}'s log ({res.log}) ---")
        print("\n".join(tail))
    sys.exit(1)


def compare_params(a: Path, b: Path) -> tuple[int, int, list[str]]:
    """(equal tensors, all tensors, names that differ) of two saved parameter dicts."""
    pa = torch.load(a, weights_only=True)
    pb = torch.load(b, weights_only=True)
    names = sorted(set(pa) | set(pb))
    differ = [n for n in names if n not in pa or n not in pb or not torch.equal(pa[n], pb[n])]
    return len(names) - len(differ), len(names), differ


def main(argv: list[str] | None = None) -> int:
    """Run the three jobs, print what happens, and return 0 only if the resumed run matches bit for bit."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (jobs, store) on SIGTERM too
    t_start = time.monotonic()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # tmpfs on Linux; elsewhere MemStore warns
    work = Path(tempfile.mkdtemp(prefix="dcp_memstore_demo-", dir=shm))
    try:
        return _demo(args, work, t_start)
    except KeyboardInterrupt:
        print("\ninterrupted: the training jobs were stopped", flush=True)
        return 130
    finally:
        if args.keep:
            print(f"\nkept: store under {work / 'store'}, logs and final parameters in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _demo(args: argparse.Namespace, work: Path, t_start: float) -> int:
    """The three runs, with the store and logs under ``work``; then the verdict."""
    steps, every, fail_at = args.steps, args.every, args.fail_at_step
    print("dcp_memstore demo: kill a training job with SIGKILL, restart it, resume from the in-memory store")
    print(
        f"  {NPROC} ranks (torchrun, CPU, gloo), a small MLP, {steps} steps, "
        f"dcp.async_save every {every} steps"
    )
    print(f"  store: MemStore(root='{work / 'store'}', job_id=...)  (tmpfs, removed at the end)")
    print("  '= reference': this step's loss has exactly the same float bits as in an uninterrupted run")
    print()

    print(f"[1/3] reference run: {steps} steps, no failure (job '{REFERENCE_JOB_ID}')")
    ref = run_job("reference run", REFERENCE_JOB_ID, args, work, 0, None, quiet=True)
    if ref.returncode != 0 or sorted(ref.losses) != list(range(1, steps + 1)):
        fail(f"the reference run failed (exit code {ref.returncode})", ref)
    print(f"      done in {ref.seconds:.1f} s, final loss {loss_text(ref.losses[steps])}")
    print()

    print(f"[2/3] run 1: train from scratch, SIGKILL rank {FAIL_RANK} at step {fail_at} (job '{JOB_ID}')")
    run1 = run_job("run 1", JOB_ID, args, work, fail_at, ref.losses)
    if run1.timed_out:
        fail(f"run 1 did not end within {RUN_TIMEOUT_S:.0f} s of the kill; killed it", run1)
    if run1.killed_pid is None:
        fail(
            f"run 1 ended (exit code {run1.returncode}) before rank {FAIL_RANK} reached step {fail_at}", run1
        )
    survivors = wait_gone(run1.worker_pids)
    if run1.returncode == 0 or survivors:
        fail(
            f"after the SIGKILL torchrun exited with code {run1.returncode} "
            f"and workers {survivors} still run; "
            "expected a failed job and no process left",
            run1,
        )
    on_disk = MemStore(root=work / "store", job_id=JOB_ID).list_checkpoints()
    assert run1.killed_at is not None and run1.exited_at is not None
    print(
        f"      torchrun noticed, stopped the other rank and exited (code {run1.returncode}) "
        f"{run1.exited_at - run1.killed_at:.1f} s after the kill; no worker process left"
    )
    print(f"      committed checkpoints left in the store: {', '.join(on_disk) or 'none'}")
    print()

    print(f"[3/3] run 2: restart (new torchrun, same store root and job id '{JOB_ID}')")
    run2 = run_job("run 2", JOB_ID, args, work, 0, ref.losses, marker="*")
    if run2.returncode != 0:
        fail(f"run 2 failed (exit code {run2.returncode})", run2)
    print()
    return _verdict(args, ref, run1, run2, t_start)


def _verdict(
    args: argparse.Namespace, ref: RunResult, run1: RunResult, run2: RunResult, t_start: float
) -> int:
    """Compare the crashed-and-resumed training with the reference run, print the table, return the exit
    code."""
    steps, every, fail_at = args.steps, args.every, args.fail_at_step
    expected_resume = ((fail_at - 1) // every) * every  # the newest checkpoint saved before the kill
    rows: list[tuple[str, str, bool]] = []

    def same(a: RunResult, b: RunResult, span: range) -> tuple[str, bool]:
        n = sum(1 for s in span if s in a.losses and a.losses.get(s) == b.losses.get(s))
        return f"{n}/{len(span)} bit-identical", n == len(span)

    first2 = run2.first_step or 0
    span1 = range(1, fail_at)
    rows.append((f"run 1 losses, {steps_text(span1)}, vs reference", *same(run1, ref, span1)))
    rows.append(
        (
            f"run 1 killed at step {fail_at}, whole job gone",
            f"SIGKILL pid {run1.killed_pid}, exit {run1.returncode}",
            run1.killed_at_step == fail_at,
        )
    )
    rows.append(
        (
            "run 2 resumed from store.latest_checkpoint()",
            f"'{run2.resumed_from}' (step {first2 - 1})",
            run2.resumed_from == f"step-{expected_resume}" and first2 - 1 == expected_resume,
        )
    )
    replayed = range(first2, fail_at)
    if len(replayed):
        rows.append(
            (
                f"{steps_text(replayed)} redone by run 2, vs run 1",
                *same(run2, run1, replayed),
            )
        )
    span2 = range(first2, steps + 1)
    rows.append((f"run 2 losses, {steps_text(span2)}, vs reference", *same(run2, ref, span2)))
    assert run2.final_params is not None and ref.final_params is not None
    n_eq, n_all, differ = compare_params(run2.final_params, ref.final_params)
    params_text = f"{n_eq}/{n_all} torch.equal" + (f" (differ: {', '.join(differ)})" if differ else "")
    rows.append(("final parameters, run 2 vs reference", params_text, not differ and n_all > 0))

    width = max(len(r[0]) for r in rows)
    print("verdict")
    print(f"  {'check':<{width}}  {'result':<32}  ok")
    for what, result, ok in rows:
        print(f"  {what:<{width}}  {result:<32}  {'yes' if ok else 'NO'}")
    print()
    elapsed = time.monotonic() - t_start
    if all(ok for _, _, ok in rows):
        print(
            f"PASS: killed at step {fail_at}, resumed from '{run2.resumed_from}', "
            "and the result is bit for bit "
            f"the uninterrupted run's ({elapsed:.0f} s)"
        )
        return 0
    print(f"FAIL: the interrupted and resumed training does not match the reference run ({elapsed:.0f} s)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
