"""Train a small GPT with in-memory DCP checkpoints, SIGKILL a rank, resume,
and prove the loss curve is unchanged.

    python examples/train_gpt.py   # the whole experiment (driver), about 35 s on 2 CPU cores
    python examples/train_gpt.py --steps 60 --every 10 --fail-at-step 37 --out /tmp/gpt
    torchrun --nproc-per-node 2 examples/train_gpt.py --root /dev/shm/gpt --job-id run1   # one training job

Two modes in one file:

**Training (under torchrun, one process per rank).** A small GPT (``examples/gpt_model.py``) learns
next-character prediction on a built-in text, data parallel (DDP; gloo on CPU, nccl on GPUs). Every
``--every`` steps the training state goes to a ``MemStore`` with ``dcp.async_save`` and a
``MemoryStorageWriter``: model, optimizer (AdamW moments and learning rate), the step, the data stream's
position and each rank's RNG state (dropout). At start-up ``store.latest_checkpoint()`` names the newest
checkpoint every rank can read, and ``dcp.load`` with a ``MemoryStorageReader`` restores it. With
``--fail-at-step K``, rank ``--fail-rank`` sends itself SIGKILL in the middle of step K (after its
forward pass, while the other ranks wait in the gradient all-reduce, and possibly while an async save is
still writing): a real crash, nothing is flushed or cleaned up. torchrun then stops the other ranks.
Rank 0 reports progress on stdout as JSON lines prefixed ``@@demo`` (``examples/demo_train.py``'s events).

**Driver (plain ``python``, no torchrun).** Runs three torchrun jobs on a fresh store root under
/dev/shm: (1) a reference run without checkpoints or failure; (2) a run that checkpoints and is killed at
``--fail-at-step``; (3) a new torchrun on the same store and job id that resumes from the newest
committed checkpoint and trains to the end. It writes ``losses.csv`` (each step's reference loss and the
loss of the failed-and-resumed training, exactly: ``repr`` and ``float.hex``) and ``losses.png`` (both
curves on one plot, the failure marked), and exits 0 only if the two curves are bit-identical at every
step and the final parameters are equal.

Determinism: weights from a fixed seed, each rank's dropout from its own seeded stream (saved in the
checkpoint), ``torch.use_deterministic_algorithms(True)``, one intra-op thread, a learning rate computed
from the step, and data that depends only on the step.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from demo import RUN_TIMEOUT_S, RunResult, compare_params, fail, loss_text, torchrun_job, wait_gone
from demo_train import checkpoint, emit, stacks_on_sigusr1
from gpt_model import CORPUS, GPT, GPTConfig, TextBatches
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from dcp_memstore import MemoryStorageReader, MemStore

REFERENCE_JOB_ID = "gpt-reference"
JOB_ID = "gpt"
DEFAULT_OUT = Path(tempfile.gettempdir()) / "dcp_memstore_train_gpt"
DRIVER_FAIL_AT_STEP = 23
CSV_NAME = "losses.csv"
PNG_NAME = "losses.png"
CSV_FIELDS = (
    "step",
    "reference_loss",
    "resumed_loss",
    "resumed_run",
    "reference_loss_hex",
    "resumed_loss_hex",
)


# -- options -----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Options of both modes (the driver passes the training ones on to every rank)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    train = p.add_argument_group("training (both modes)")
    train.add_argument(
        "--steps",
        type=int,
        default=40,
        help="train until this step (1-based, inclusive; default %(default)s)",
    )
    train.add_argument(
        "--every",
        type=int,
        default=5,
        help="checkpoint after every N-th step, 0: never (default %(default)s)",
    )
    train.add_argument(
        "--fail-at-step",
        type=int,
        help=f"SIGKILL a rank in this step, 0: never (default: {DRIVER_FAIL_AT_STEP} in the driver, "
        "0 under torchrun)",
    )
    train.add_argument(
        "--fail-rank", type=int, default=1, help="the rank that kills itself (default %(default)s)"
    )
    train.add_argument("--seed", type=int, default=1234, help="default %(default)s")
    train.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (the default): cuda if there is a GPU per rank, else cpu",
    )
    train.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak learning rate, linear warm-up then cosine decay (default %(default)s)",
    )
    train.add_argument(
        "--global-batch",
        type=int,
        default=16,
        help="sequences per step, over all ranks (default %(default)s)",
    )
    train.add_argument(
        "--block-size", type=int, default=32, help="context length in characters (default %(default)s)"
    )
    train.add_argument("--n-layer", type=int, default=2, help="transformer blocks (default %(default)s)")
    train.add_argument("--n-head", type=int, default=4, help="attention heads (default %(default)s)")
    train.add_argument("--n-embd", type=int, default=64, help="model width (default %(default)s)")
    worker = p.add_argument_group("training process (under torchrun)")
    worker.add_argument("--root", help="MemStore root (default: $DCP_MEMSTORE_ROOT or /dev/shm/dcp_memstore)")
    worker.add_argument(
        "--job-id",
        help="MemStore job id (default: $DCP_MEMSTORE_JOB_ID, else torchrun's run id, which is new at every "
        "launch on one node without --master-port: give one to resume)",
    )
    worker.add_argument("--final-params", help="rank 0 writes the final parameters here (torch.save)")
    driver = p.add_argument_group("driver (plain python)")
    driver.add_argument("--nproc", type=int, default=2, help="ranks per run (default %(default)s)")
    driver.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="where losses.csv and losses.png go (default %(default)s)",
    )
    driver.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    driver.add_argument(
        "--verbose", action="store_true", help="print every step of the failing and resumed runs"
    )
    driver.add_argument(
        "--keep", action="store_true", help="keep the store and the logs (path printed at the end)"
    )
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, driver: bool) -> None:
    """Fill in the mode's default failure step and reject options that cannot work. The experiment
    (``driver``) needs a checkpoint before the failure and the failure during training."""
    if args.fail_at_step is None:
        args.fail_at_step = DRIVER_FAIL_AT_STEP if driver else 0
    if args.steps < 1 or args.every < 0 or args.fail_at_step < 0:
        p.error("need --steps >= 1, --every >= 0 and --fail-at-step >= 0")
    if not driver:
        return
    if not 1 <= args.every < args.fail_at_step <= args.steps:
        p.error(
            f"need 1 <= --every < --fail-at-step <= --steps (got every={args.every}, fail-at-step="
            f"{args.fail_at_step}, steps={args.steps}): a checkpoint must exist before the crash"
        )
    if not 0 <= args.fail_rank < args.nproc:
        p.error(f"--fail-rank {args.fail_rank} is not one of the {args.nproc} ranks")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        p.error(
            f"--device cuda needs a GPU per rank: {torch.cuda.device_count()} GPU(s) for {args.nproc} ranks"
        )


# -- training (one rank, under torchrun) -----------------------------------------------------------------


def make_deterministic() -> None:
    """Same inputs, same bits: deterministic kernels, no autotuning, one intra-op thread (a fixed reduction
    order on CPU). Must run before the first CUDA call (cuBLAS reads its workspace setting then)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(1)


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators (torch.manual_seed covers every CUDA device too)."""
    random.seed(seed)
    torch.manual_seed(seed)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """The learning rate of ``step`` (1-based): linear warm-up over 10% of the steps, cosine decay to 10%.
    A function of the step alone, so a resumed run needs no scheduler state."""
    warmup = max(1, args.steps // 10)
    if step <= warmup:
        return args.lr * step / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generator states: the CPU one and, on a GPU, the device's (dropout draws from it)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TextBatches,
    step: int,
    rank: int,
    device: torch.device,
) -> dict[str, Any]:
    """What a checkpoint holds: model, optimizer, the last finished step, the data stream's position, and
    this rank's RNG state. Model, optimizer, step and data position are the same on every rank (DCP writes
    them once); each rank's RNG state is its own, so it goes under a per-rank key."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "step": step,
        "data": data.state_dict(),
        "rng": {f"rank{rank}": rng_state(device)},
    }


def resume(
    store: MemStore,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TextBatches,
    rank: int,
    device: torch.device,
    group: dist.ProcessGroup,
) -> tuple[str | None, int]:
    """Restore the newest checkpoint every rank can read; return its id and the step it finished (0: none)."""
    latest = store.latest_checkpoint(group)  # a collective: every rank gets the same answer
    if latest is None:
        return None, 0
    state = training_state(model, optimizer, data, 0, rank, device)
    dcp.load(state, checkpoint_id=latest, storage_reader=MemoryStorageReader(store), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    set_rng_state(state["rng"][f"rank{rank}"], device)
    data.load_state_dict(state["data"])
    step = int(state["step"])
    if data.position != step * data.global_batch:  # the data order is a function of the step
        raise RuntimeError(f"{latest}: data position {data.position} does not match step {step}")
    return latest, step


def pick_device(choice: str, nproc: int) -> str:
    """'cuda' if asked for or (auto) if there is one GPU per rank, else 'cpu'."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "cpu"
    return choice


def train(args: argparse.Namespace) -> None:
    """One rank: build, resume if the store has a checkpoint, train, checkpoint asynchronously, maybe
    crash."""
    stacks_on_sigusr1()
    make_deterministic()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(pick_device(args.device, int(os.environ["LOCAL_WORLD_SIZE"])))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    emit(event="hello", rank=rank, pid=os.getpid())

    data = TextBatches(CORPUS, args.block_size, args.global_batch, args.seed, rank, world)
    cfg = GPTConfig(len(data.vocab), args.block_size, args.n_layer, args.n_head, args.n_embd)
    seed_everything(args.seed)  # identical initial weights on every rank
    model = GPT(cfg).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    seed_everything(args.seed + 1 + rank)  # each rank's own dropout stream

    store = MemStore(root=args.root, job_id=args.job_id)
    # Checkpoint collectives run on a gloo group of their own: off the GPU, and never interleaved with
    # DDP's all-reduces when a background save talks while training goes on.
    ckpt_group = dist.new_group(backend="gloo")
    resumed_from, done = resume(store, ddp, optimizer, data, rank, device, ckpt_group)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        emit(
            event="start",
            resumed_from=resumed_from,
            first_step=done + 1,
            device=str(device.type),
            world=world,
            params=n_params,
            vocab=cfg.vocab_size,
        )

    pending = None
    for step in range(done + 1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        x, y = (t.to(device) for t in data.next_batch())
        ddp.train()
        loss = ddp(x, y)
        if step == args.fail_at_step and rank == args.fail_rank:
            # A real crash: no exception, no cleanup, no flush. The other ranks are about to block in
            # the backward all-reduce; a save started at an earlier step may still be writing.
            emit(event="crash", rank=rank, pid=os.getpid(), step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks here
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world

        saved = None
        if args.every and step % args.every == 0:
            state = training_state(ddp, optimizer, data, step, rank, device)
            pending, saved = checkpoint(pending, state, f"step-{step}", store, ckpt_group)
        if rank == 0:
            emit(event="step", step=step, loss=float(global_loss).hex(), save=saved)

    if pending is not None:
        pending.result()
    if rank == 0:
        if args.final_params:
            torch.save(
                {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, args.final_params
            )
        emit(event="done")
    store.close()
    dist.barrier()
    dist.destroy_process_group()


# -- driver (plain python) ------------------------------------------------------------------------------


@dataclass
class GPTRun(RunResult):
    """One torchrun job as the driver saw it (``demo.RunResult``), plus rank 0's start-up report, the saves
    it started, and whether to print each step."""

    start: dict[str, Any] = field(default_factory=dict)  # device, world size, parameter count, vocabulary
    saves: list[str] = field(default_factory=list)  # checkpoint ids whose async_save was started
    verbose: bool = False  # print every step as it is reported


def launch(
    label: str,
    job_id: str,
    args: argparse.Namespace,
    work: Path,
    every: int,
    fail_at: int,
    device: str,
    verbose: bool = False,
) -> GPTRun:
    """Run one torchrun job of this script and collect what its ranks report (see ``train``)."""
    name = label.replace(" ", "_")
    res = GPTRun(label, log=work / f"{name}.log", final_params=work / f"{name}.params.pt", verbose=verbose)
    training = ["--steps", args.steps, "--fail-rank", args.fail_rank, "--seed", args.seed, "--lr", args.lr]
    training += ["--global-batch", args.global_batch, "--block-size", args.block_size]
    training += ["--n-layer", args.n_layer, "--n-head", args.n_head, "--n-embd", args.n_embd]
    training += ["--root", work / "store", "--job-id", job_id, "--final-params", res.final_params]
    training += ["--every", every, "--fail-at-step", fail_at, "--device", device]
    return torchrun_job(Path(__file__).resolve(), training, args.nproc, res, lambda ev: record_event(ev, res))


def record_event(ev: dict[str, Any], res: GPTRun) -> None:
    """Keep what one rank reports in ``res``; say when it resumes or crashes (and print steps if asked)."""
    kind = ev["event"]
    if kind == "hello":
        res.worker_pids.append(ev["pid"])
    elif kind == "start":
        res.resumed_from, res.first_step = ev["resumed_from"], ev["first_step"]
        res.start = ev
        if res.resumed_from is not None:
            print(
                f"      store.latest_checkpoint() = '{res.resumed_from}': "
                "dcp.load restores model, optimizer, "
                f"RNG state, data position and step {res.first_step - 1}",
                flush=True,
            )
    elif kind == "step":
        res.losses[ev["step"]] = ev["loss"]
        if ev["save"]:
            res.saves.append(ev["save"]["id"])
        if res.verbose:
            save = (
                f"   async_save '{ev['save']['id']}' ({ev['save']['stage_ms']:.1f} ms)" if ev["save"] else ""
            )
            print(f"      step {ev['step']:3d}  loss {loss_text(ev['loss'])}{save}", flush=True)
    elif kind == "crash":
        res.killed_pid, res.killed_at_step, res.killed_at = ev["pid"], ev["step"], time.monotonic()
        print(
            f"      step {ev['step']:3d}  rank {ev['rank']} (pid {ev['pid']}) sends itself SIGKILL",
            flush=True,
        )


def fail_run(msg: str, res: GPTRun) -> NoReturn:
    """Stop with ``demo.fail`` (message, log tail, exit code 1), first showing the log's first traceback:
    usually a rank's error, which torchrun's own report at the end of the log would push out of the tail."""
    lines = res.log.read_text().splitlines() if res.log is not None and res.log.exists() else []
    first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    if first is not None:
        print(f"--- first traceback in {res.label}'s log ---")
        print("\n".join(lines[first : first + 40]))
    fail(msg, res)


def combined_curve(failed: RunResult, resumed: RunResult) -> dict[int, tuple[str, str]]:
    """step -> (run, loss hex) of the training that actually happened: the failed run up to the step its
    checkpoint restored, the resumed run from there on (steps the failed run did after that checkpoint
    were lost with it)."""
    restored = (resumed.first_step or 1) - 1
    curve = {s: ("failed", h) for s, h in failed.losses.items() if s <= restored}
    curve.update((s, ("resumed", h)) for s, h in resumed.losses.items())
    return dict(sorted(curve.items()))


def write_csv(path: Path, steps: int, reference: dict[int, str], curve: dict[int, tuple[str, str]]) -> None:
    """One row per step: both losses as ``repr`` (shortest exact decimal) and ``float.hex``."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for step in range(1, steps + 1):
            ref = reference.get(step)
            run, got = curve.get(step, ("", None))
            w.writerow(
                [
                    step,
                    repr(float.fromhex(ref)) if ref else "",
                    repr(float.fromhex(got)) if got else "",
                    run,
                    ref or "",
                    got or "",
                ]
            )


def plot(
    path: Path,
    reference: dict[int, str],
    curve: dict[int, tuple[str, str]],
    lost: dict[int, str],
    fail_at: int,
    resumed_from: str | None,
    restored: int,
    identical: bool,
    nproc: int,
) -> None:
    """Both loss curves over each other, the failure and the restored checkpoint marked, and below them the
    per-step difference (all zero when the resume is exact). ``lost``: steps the failed run did after its
    last checkpoint (redone by the resumed run), drawn hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(reference)
    ref = [float.fromhex(reference[s]) for s in steps]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}, constrained_layout=True
    )
    top.plot(steps, ref, color="0.55", linewidth=4, alpha=0.6, label="reference (uninterrupted)")
    for run, style in (
        ("failed", dict(marker="o", color="tab:blue")),
        ("resumed", dict(marker="x", color="tab:orange")),
    ):
        xs = [s for s, (r, _) in curve.items() if r == run]
        ys = [float.fromhex(curve[s][1]) for s in xs]
        label = f"run killed at step {fail_at}" if run == "failed" else f"resumed from '{resumed_from}'"
        top.plot(xs, ys, linestyle="none", markersize=5, label=label, **style)
    if lost:
        top.plot(
            sorted(lost),
            [float.fromhex(lost[s]) for s in sorted(lost)],
            linestyle="none",
            marker="o",
            markersize=9,
            markerfacecolor="none",
            color="tab:blue",
            label="killed run's steps after its last checkpoint (lost, redone)",
        )
    top.axvline(fail_at, color="tab:red", linestyle="--", linewidth=1.2, label=f"SIGKILL (step {fail_at})")
    top.axvline(
        restored + 0.5,
        color="tab:green",
        linestyle=":",
        linewidth=1.2,
        label=f"resume point (after step {restored})",
    )
    top.set_ylabel("training loss (mean over ranks)")
    verdict = "bit-identical at every step" if identical else "NOT identical"
    top.set_title(f"GPT on {nproc} ranks, killed and resumed from the in-memory store: {verdict}")
    top.legend(loc="upper right", fontsize=8)
    diffs = [
        float.fromhex(curve[s][1]) - r if s in curve else float("nan")
        for s, r in zip(steps, ref, strict=True)
    ]
    bottom.plot(steps, diffs, marker=".", color="tab:purple")
    bottom.axhline(0.0, color="0.7", linewidth=0.8)
    bottom.axvline(fail_at, color="tab:red", linestyle="--", linewidth=1.2)
    bottom.set_ylabel("resumed - reference")
    bottom.set_xlabel("step")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(
    args: argparse.Namespace,
    ref: RunResult,
    failed: RunResult,
    resumed: RunResult,
    curve: dict[int, tuple[str, str]],
) -> list[tuple[str, str, bool]]:
    """The checks, as (what, result, ok) rows."""
    steps, fail_at = args.steps, args.fail_at_step
    restored = (resumed.first_step or 1) - 1
    rows = []
    same = sum(1 for s in range(1, fail_at) if failed.losses.get(s) == ref.losses.get(s))
    rows.append(
        (
            f"failed run, steps 1-{fail_at - 1}, vs reference",
            f"{same}/{fail_at - 1} bit-identical",
            same == fail_at - 1,
        )
    )
    rows.append(
        (
            f"rank {args.fail_rank} killed itself at step {fail_at}",
            f"SIGKILL pid {failed.killed_pid}, torchrun exit {failed.returncode}",
            failed.killed_at_step == fail_at and failed.returncode != 0 and fail_at not in failed.losses,
        )
    )
    rows.append(
        (
            "resumed from store.latest_checkpoint()",
            f"'{resumed.resumed_from}' (step {restored})",
            resumed.resumed_from == f"step-{restored}"
            and 0 < restored < fail_at
            and restored % args.every == 0,
        )
    )
    replayed = list(range(restored + 1, fail_at))
    if replayed:
        n = sum(1 for s in replayed if resumed.losses.get(s) == failed.losses.get(s))
        rows.append(
            (
                f"steps {replayed[0]}-{replayed[-1]} redone, vs failed run",
                f"{n}/{len(replayed)} bit-identical",
                n == len(replayed),
            )
        )
    n = sum(1 for s in range(1, steps + 1) if s in curve and curve[s][1] == ref.losses.get(s))
    rows.append(("loss curve (CSV), vs reference", f"{n}/{steps} bit-identical", n == steps))
    assert resumed.final_params is not None and ref.final_params is not None
    n_eq, n_all, differ = compare_params(resumed.final_params, ref.final_params)
    rows.append(("final parameters, vs reference", f"{n_eq}/{n_all} torch.equal", not differ and n_all > 0))
    return rows


def drive(args: argparse.Namespace) -> int:
    """The three runs, the CSV and PNG, the verdict; 0 only if the curves coincide exactly."""
    t_start = time.monotonic()
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("train_gpt: the plot needs matplotlib: pip install matplotlib (or pass --no-plot)")
            return 2
    device = pick_device(args.device, args.nproc)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # tmpfs on Linux; elsewhere MemStore warns
    work = Path(tempfile.mkdtemp(prefix="dcp_memstore_train_gpt-", dir=shm))
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (jobs, store) on SIGTERM too
    try:
        return _experiment(args, work, device, t_start)
    except KeyboardInterrupt:
        print("\ninterrupted: the training jobs were stopped", flush=True)
        return 130
    finally:
        if args.keep:
            print(f"kept: store under {work / 'store'}, logs and final parameters in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _experiment(args: argparse.Namespace, work: Path, device: str, t_start: float) -> int:
    steps, every, fail_at = args.steps, args.every, args.fail_at_step
    backend = "nccl" if device == "cuda" else "gloo"
    print("dcp_memstore GPT example: SIGKILL a rank of a training job, resume from the in-memory store")
    print(
        f"  {args.nproc} ranks (torchrun, DDP, {device}, {backend}), {steps} steps, "
        f"global batch {args.global_batch}"
    )
    print(f"  store: MemStore(root='{work / 'store'}')  (tmpfs, removed at the end)")
    print()

    print(f"[1/3] reference run: {steps} steps, no checkpoints, no failure (job '{REFERENCE_JOB_ID}')")
    ref = launch("reference run", REFERENCE_JOB_ID, args, work, 0, 0, device)
    if ref.returncode != 0 or sorted(ref.losses) != list(range(1, steps + 1)):
        fail_run(f"the reference run failed (exit code {ref.returncode})", ref)
    info = ref.start
    print(
        f"      GPT: {args.n_layer} layers, {args.n_head} heads, width {args.n_embd}, "
        f"context {args.block_size}, "
        f"vocabulary {info.get('vocab')}, {info.get('params')} parameters"
    )
    print(
        f"      done in {ref.seconds:.1f} s, "
        f"loss {loss_text(ref.losses[1])} -> {loss_text(ref.losses[steps])}"
    )
    print()

    print(
        f"[2/3] failing run: dcp.async_save every {every} steps "
        "(model, optimizer, RNG, step, data position); "
        f"rank {args.fail_rank} SIGKILLs itself at step {fail_at} (job '{JOB_ID}')"
    )
    failed = launch("failing run", JOB_ID, args, work, every, fail_at, device, args.verbose)
    if failed.timed_out:
        fail_run(f"the failing run did not end within {RUN_TIMEOUT_S:.0f} s; killed it", failed)
    if failed.killed_pid is None:
        fail_run(
            f"the failing run ended (exit code {failed.returncode}) without reaching step {fail_at}", failed
        )
    survivors = wait_gone(failed.worker_pids)
    if failed.returncode == 0 or survivors:
        fail_run(
            f"after the SIGKILL torchrun exited {failed.returncode}, workers {survivors} still run", failed
        )
    committed = MemStore(root=work / "store", job_id=JOB_ID).list_checkpoints()
    assert failed.killed_at is not None and failed.exited_at is not None
    print(
        f"      torchrun stopped the job (exit code {failed.returncode}) "
        f"{failed.exited_at - failed.killed_at:.1f} s "
        "after the kill; no worker process left"
    )
    newest = failed.saves.index(committed[-1]) if committed and committed[-1] in failed.saves else -1
    unfinished = failed.saves[newest + 1 :]  # started after the newest commit: cut short by the crash
    print(
        f"      saves started: {', '.join(failed.saves)}; committed and kept (keep_in_memory=2): "
        f"{', '.join(committed) or 'none'}"
    )
    if unfinished:
        print(f"      {', '.join(unfinished)} was still being written when the rank died: never a checkpoint")
    print()

    print(f"[3/3] resumed run: new torchrun, same store and job id '{JOB_ID}'")
    resumed = launch("resumed run", JOB_ID, args, work, every, 0, device, args.verbose)
    if resumed.returncode != 0:
        fail_run(f"the resumed run failed (exit code {resumed.returncode})", resumed)
    restored = (resumed.first_step or 1) - 1
    print(f"      trained steps {restored + 1}-{steps} in {resumed.seconds:.1f} s")
    print()

    curve = combined_curve(failed, resumed)
    rows = verdict(args, ref, failed, resumed, curve)
    identical = all(ok for _, _, ok in rows)
    csv_path, png_path = args.out / CSV_NAME, args.out / PNG_NAME
    write_csv(csv_path, steps, ref.losses, curve)
    if not args.no_plot:
        lost = {s: h for s, h in failed.losses.items() if s > restored}
        plot(
            png_path, ref.losses, curve, lost, fail_at, resumed.resumed_from, restored, identical, args.nproc
        )
    width = max(len(r[0]) for r in rows)
    print("verdict")
    for what, result, ok in rows:
        print(f"  {what:<{width}}  {result:<40}  {'yes' if ok else 'NO'}")
    print(f"  wrote {csv_path}" + ("" if args.no_plot else f" and {png_path}"))
    elapsed = time.monotonic() - t_start
    if identical:
        print(
            f"PASS: killed at step {fail_at}, resumed from '{resumed.resumed_from}', "
            f"loss curve bit-identical ({elapsed:.0f} s)"
        )
        return 0
    print(f"FAIL: the killed-and-resumed training differs from the reference run ({elapsed:.0f} s)")
    return 1


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: train one rank. Otherwise: run the experiment."""
    parser = build_parser()
    args = parser.parse_args(argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    check_args(parser, args, driver=not under_torchrun)
    if under_torchrun:
        train(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
