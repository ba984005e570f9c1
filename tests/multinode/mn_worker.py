"""A multi-node job for the replication tests, run by torchrun on every node of a namespace cluster.

    save: checkpoint steps 1..N (``dcp.save``; ``--first F``: steps F..F+N-1), each a DTensor sharded
          over all ranks (``Shard(0)``), a replicated tensor and an int; optionally wait until replicated
          or persisted, wait for the test's go-ahead.
          With ``--owe N``, rank 0 (``--owe-rank``) alone asks for step N's upload after the saves and
          reports once its node's share is uploaded (the other nodes never upload theirs).
          With ``--elsewhere N`` (two nodes, one rank each), node 1 uploads its share of step N, deletes
          it from its memory and reports what it says of step N while node 0 is not asked to upload its
          share, once node 0's upload failed, and after the test's go-ahead, when node 0 is asked again.
          With ``--unreachable N`` (likewise), node 1 uploads its share of step N, deletes it and reports
          what it says of step N while the test keeps the target unreadable: before node 0 is asked,
          while node 0's upload retries, then (waiting) once the target is back, and once more after
          it is published, with the target unreadable again.
          With ``--gate N``, once every node's files of step N are replicated, wait for the test's
          go-ahead (file ``go``) before the next step. With ``--hang``, wait after the saves until the
          test kills the job. With ``--settle``, wait after the saves until this node keeps only the
          newest ``--keep`` checkpoints and report them with their retention holds.
          With ``--not-here N``, node 1 deletes step N from its memory and reports what ``status`` and
          ``wait_replicated`` say of it there (node 0 still holds it), and what ``status`` says of a
          step no node holds.
          With ``--waiting N`` (likewise), node 0 uploads its share of step N and waits for node 1's,
          which is not asked until node 0 reports the state it shows once the test made the target
          unreadable (node 0's upload retries) and readable again.
    load: ``latest_checkpoint()``, then ``dcp.load`` into fresh tensors and compare bit for bit with what
          that step saved (the world size may differ from the save's); with ``--wait-persisted N``, every
          rank then waits for step N's upload and reports how it ended. With ``--before-restore N``
          (one rank per node), every node first reports step N as ``--not-here`` does (before
          ``latest_checkpoint()`` restores a replaced node's copy and sends the replicas it lost again).

    close-alone: rank 0 creates its MemStore, waits (2 s at most) until each checkpoint its node holds
          is replicated, and closes it; rank 1 never creates one (as a rank that failed before), so rank
          0's replicator is still waiting for its server's address.
    dead-peer: rank 1 is SIGKILLed before it creates its MemStore; rank 0, once the test saw it die
          (file ``dead``), creates its MemStore (``stage_timeout_s`` of ``--grace`` seconds, 10 unless
          given; with ``--persist-to``) and reports how asking ``status`` of step N (not in its memory),
          then ``wait_persisted`` of it, ended and how long each took. With ``--late S``, rank 1
          instead creates its MemStore S seconds late, and rank 0 only asks ``status``, at once.
    silent-peer: (two nodes, one rank each, ``--persist-to``, ``replication_timeout_s`` left at its 30 s)
          step 1 is saved and replicated; once the test cut node 1 off (file ``cut``), node 0 reports how
          ``wait_replicated`` of it with a timeout of 2 s ended and how long it took, then deletes its
          copy and reports ``wait_persisted`` of it, timeout 2 s, the same way, then once more without
          a timeout, during which the test puts node 1 back; both ranks end once the test said so (file
          ``back``).

Every event is one line ``@@mn {json}`` on stdout (the test reads the node logs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.store import catalog

ROW = 1024  # floats per row: 4 KiB


def emit(**event: object) -> None:
    """One ``os.write`` per event: the ranks of a node share its log, and ``print`` writes the newline
    apart when stdout is unbuffered (``PYTHONUNBUFFERED``), so two events could share a line."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("@@mn " + json.dumps({"rank": dist.get_rank(), **event}) + "\n").encode())


def global_weight(step: int, mib: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(mib * 256, ROW, generator=g)


def sharded(full: torch.Tensor, mesh) -> torch.Tensor:
    """``full`` as a DTensor sharded over the ranks by rows. Every rank holds the same ``full`` (made from
    a seed), so each keeps its own rows: nothing is sent from rank 0 (``src_data_rank=None``)."""
    return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)


def state(step: int, mib: int, mesh) -> dict:
    bias = torch.arange(1000, dtype=torch.float64) * step
    return {"w": sharded(global_weight(step, mib), mesh), "bias": bias, "step": step}


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def save(args, store: MemStore, mesh) -> None:
    for step in range(args.first, args.first + args.steps):
        cid = f"step-{step}"
        dcp.save(state(step, args.mib, mesh), checkpoint_id=cid, storage_writer=MemoryStorageWriter(store))
        emit(event="saved", step=step)
        if args.watch:  # the link-down test: train on while replication struggles, report what status says
            watch(store, cid, Path(args.tmp))
        if args.wait_replicated:
            st = store.wait_replicated(cid, timeout=60)
            emit(event="replicated", step=step, replication=st.replication, replicas=st.replicas)
        if args.persist_to and args.persist_every:
            st = store.wait_persisted(cid, timeout=60)
            emit(
                event="persisted", step=step, url=st.persisted_url, files=[st.files_uploaded, st.files_total]
            )
        if step == args.gate:
            store.wait_replicated(cid, timeout=60)
            dist.barrier()
            emit(event="gate", step=step)
            wait_for(Path(args.tmp) / "go", 120)
    if args.hang:
        emit(event="hanging")
        wait_for(Path(args.tmp) / "never", 300)
    if args.settle:
        settle(store, args.keep)
    if args.owe and dist.get_rank() == args.owe_rank:
        owe(store, f"step-{args.owe}")
    if args.elsewhere:
        elsewhere(store, f"step-{args.elsewhere}", Path(args.tmp))
    if args.unreachable:
        unreachable(store, f"step-{args.unreachable}", Path(args.tmp))
    if args.waiting:
        waiting(store, f"step-{args.waiting}", Path(args.tmp))
    if args.not_here:
        dist.barrier()  # every rank's own wait_replicated has seen the replicas before rank 1 deletes its own
        if dist.get_rank() == 1:
            not_here(store, f"step-{args.not_here}")
    if args.serve_until:
        svc = store.replication()
        emit(event="serving", addr=list(svc.peers().server(svc.node.node_rank)))
        wait_for(Path(args.tmp) / args.serve_until, 120)
        st = store.status(f"step-{args.steps}")
        emit(event="after-probe", replication=st.replication, listed=store.list_checkpoints())


def settle(store: MemStore, keep: int, timeout: float = 60) -> None:
    """Wait until this node keeps only its newest ``keep`` checkpoints; report them with their holds."""
    deadline = time.monotonic() + timeout
    while len(listed := store.list_checkpoints()) > keep and time.monotonic() < deadline:
        time.sleep(0.05)
    holds = {c: catalog.hold_names(store.layout, c) for c in listed}
    emit(event="settled", listed=listed, holds=holds)


def owe(store: MemStore, cid: str) -> None:
    """Ask for ``cid``'s upload on this node only, and report once this node's share of it is uploaded."""
    store.persist(cid)
    deadline = time.monotonic() + 60
    while (st := store.status(cid)).files_uploaded < st.files_total or not st.files_total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"this node's share of {cid} not uploaded after 60 s: {st}")
        time.sleep(0.05)
    emit(event="share-uploaded", checkpoint=cid, files=[st.files_uploaded, st.files_total])


def wait_persisted(store: MemStore, cid: str, timeout: float = 20, phase: str = "") -> None:
    """Wait for ``cid``'s upload (``timeout`` s at most) and report how it ended and what status said
    (``phase`` tells the reports of one run apart)."""
    try:
        st = store.wait_persisted(cid, timeout=timeout)
        outcome = "persisted"
    except Exception as e:  # noqa: BLE001 - reported to the test
        st, outcome = store.status(cid), f"{type(e).__name__}: {e}"
    files = [st.files_uploaded, st.files_total]
    emit(event="persist", checkpoint=cid, outcome=outcome, state=st.persist, error=st.error,
         in_memory=st.in_memory, files=files, url=st.persisted_url, phase=phase)  # fmt: skip


def wait_state(store: MemStore, cid: str, state: str, timeout: float) -> None:
    """Wait until ``store.status(cid).persist`` is ``state``; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while store.status(cid).persist != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the upload of {cid} was not {state} within {timeout} s: {store.status(cid)}")
        time.sleep(0.05)


def elsewhere(store: MemStore, cid: str, tmp: Path) -> None:
    """See ``--elsewhere`` in the module docstring; the nodes take turns through files in ``tmp``."""
    if dist.get_rank() == 1:
        owe(store, cid)
        store.delete(cid)
        wait_persisted(store, cid, 5, "unrequested")
        (tmp / "deleted").write_text("ok")
        wait_for(tmp / "failed", 120)
        wait_persisted(store, cid, 5, "failed")
        wait_for(tmp / "retried", 120)
        wait_persisted(store, cid, 60, "retried")
        return
    wait_for(tmp / "deleted", 120)
    store.persist(cid)
    wait_state(store, cid, "failed", 60)
    (tmp / "failed").write_text("ok")
    wait_for(tmp / "fixed", 120)
    store.persist(cid)  # retries the failed upload
    (tmp / "retried").write_text("ok")
    store.wait_persisted(cid, timeout=60)


def unreachable(store: MemStore, cid: str, tmp: Path) -> None:
    """See ``--unreachable`` in the module docstring; the test and the nodes take turns through files in
    ``tmp`` (the test makes the target unreadable and readable again)."""
    if dist.get_rank() == 1:
        owe(store, cid)
        store.delete(cid)
        (tmp / "deleted").write_text("ok")
        wait_for(tmp / "broken", 120)
        wait_persisted(store, cid, 1, "unrequested")
        (tmp / "reported").write_text("ok")
        wait_for(tmp / "retrying", 120)
        wait_persisted(store, cid, 1, "down")
        wait_persisted(store, cid, 60, "restored")
        wait_for(tmp / "broken-again", 120)
        wait_persisted(store, cid, 1, "published")
        return
    wait_for(tmp / "reported", 120)
    store.persist(cid)
    wait_state(store, cid, "retrying", 60)
    (tmp / "retrying").write_text("ok")
    store.wait_persisted(cid, timeout=60)


def waiting(store: MemStore, cid: str, tmp: Path) -> None:
    """See ``--waiting`` in the module docstring; the test and the nodes take turns through files in
    ``tmp`` (the test makes the target unreadable and readable again)."""
    if dist.get_rank() == 1:
        wait_for(tmp / "waited", 120)
        store.persist(cid)
        store.wait_persisted(cid, timeout=60)
        return
    owe(store, cid)
    (tmp / "uploaded").write_text("ok")
    wait_state(store, cid, "retrying", 60)
    (tmp / "retrying").write_text("ok")
    wait_for(tmp / "restored", 120)
    deadline = time.monotonic() + 15  # the persister's next attempt, after its backoff
    while (st := store.status(cid)).persist == "retrying" and time.monotonic() < deadline:
        time.sleep(0.05)
    emit(event="waiting", checkpoint=cid, state=st.persist, error=st.error)
    (tmp / "waited").write_text("ok")
    store.wait_persisted(cid, timeout=60)


def not_here(store: MemStore, cid: str) -> None:
    """Delete ``cid`` from this node's memory, then report what this node says of it (``report_status``)."""
    store.delete(cid)
    report_status(store, cid, "not-here")


def report_status(store: MemStore, cid: str, event: str) -> None:
    """Report ``status(cid)``, how ``wait_replicated(cid)`` ends, and what ``status`` says of a checkpoint
    that no node holds."""
    st = store.status(cid)
    try:
        outcome = f"returned {store.wait_replicated(cid, timeout=5).replication}"
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e}"
    try:
        nowhere = f"returned {store.status('step-999')}"
    except Exception as e:  # noqa: BLE001 - reported to the test
        nowhere = f"{type(e).__name__}: {e}"
    emit(event=event, checkpoint=cid, in_memory=st.in_memory, persist=st.persist,
         replication=st.replication, replicas=st.replicas, outcome=outcome, nowhere=nowhere)  # fmt: skip


def watch(store: MemStore, cid: str, tmp: Path) -> None:
    """Rank 0 trains (a small matmul per step) and reports every change of ``status(cid)`` and of its
    ``replicate`` hold until it is replicated and the hold released, then tells the other ranks; they
    wait without collectives. (The replicator releases the hold just after it recorded the last
    acknowledgement, which ``status`` already reports as replicated.)"""
    done = tmp / "replicated"
    if dist.get_rank() != 0:
        wait_for(done, 120)
        return
    x, steps, last = torch.randn(256, 256), 0, None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x.T / 256)
        steps += 1
        st = store.status(cid)
        now = (
            st.replication,
            st.replicas,
            "replicate" in os.listdir(store.layout.checkpoint_dir(cid) / "holds"),
        )
        if now != last:
            emit(event="status", steps=steps, replication=now[0], replicas=now[1], held=now[2])
            last = now
        if st.replicated and not now[2]:
            break
        time.sleep(0.05)
    done.write_text("ok")


def load(args, store: MemStore, mesh) -> None:
    if args.before_restore:
        dist.barrier()  # every rank opened its store: its server is announced, its node can be asked
        report_status(store, f"step-{args.before_restore}", "before-restore")
    cid = store.latest_checkpoint()
    emit(event="latest", checkpoint=cid, here=store.list_checkpoints())
    if args.wait_persisted:
        wait_persisted(store, f"step-{args.wait_persisted}")
    if cid is None:
        return
    step = int(cid.split("-")[1])
    expected = state(step, args.mib, mesh)
    sd = {
        "w": sharded(torch.zeros(args.mib * 256, ROW), mesh),
        "bias": torch.zeros(1000, dtype=torch.float64),
        "step": -1,
    }
    dcp.load(sd, checkpoint_id=cid, storage_reader=MemoryStorageReader(store))
    ok = (
        torch.equal(sd["w"].to_local(), expected["w"].to_local())
        and torch.equal(sd["bias"], expected["bias"])
        and sd["step"] == step
    )
    emit(event="loaded", checkpoint=cid, ok=ok)
    if args.wait_replicated:
        for c in store.list_checkpoints():
            st = store.wait_replicated(c, timeout=60)
            emit(event="replicated", checkpoint=c, replication=st.replication, replicas=st.replicas)


def close_alone(args) -> None:
    """See ``close-alone`` in the module docstring: rank 0 reports how each ``wait_replicated`` ended and
    how long they and ``close()`` took."""
    if dist.get_rank() == 0:
        store = MemStore(job_id=args.job, replicas=args.replicas, stage_timeout_s=60, replication_timeout_s=3)
        time.sleep(1)  # its replicator is looking up the peers' servers
        start = time.monotonic()
        replication = []
        for c in store.list_checkpoints():
            try:
                replication.append(f"returned {store.wait_replicated(c, timeout=2).replication}")
            except Exception as e:  # noqa: BLE001 - reported to the test
                replication.append(f"{type(e).__name__}: {e}")
        asked = time.monotonic()
        store.close()
        emit(event="closed", replication=replication, wait_s=asked - start, close_s=time.monotonic() - asked)
    dist.barrier()


def report_attempts(
    event: str, attempts: dict[str, Callable[[], object]], since: float | None = None
) -> None:
    """Run each attempt in turn and emit ``event`` with how it ended (what it returned, or the error it
    raised) and the seconds it took; given ``since`` (``time.monotonic()``), also the seconds since then."""
    for name, attempt in attempts.items():
        start = time.monotonic()
        try:
            outcome = f"returned {attempt()}"
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcome = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        extra = {} if since is None else {"since_open": now - since}
        emit(event=event, attempt=name, outcome=outcome, seconds=now - start, **extra)


def dead_peer(args) -> None:
    """See ``dead-peer`` in the module docstring."""
    if dist.get_rank() != 0:
        if args.late is None:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.late)
        store = MemStore(job_id=args.job, stage_timeout_s=args.grace)
        dist.barrier()
        store.close()
        return
    if args.late is None:
        wait_for(Path(args.tmp) / "dead", 120)
    store = MemStore(
        job_id=args.job, persist_to=args.persist_to, stage_timeout_s=args.grace, replication_timeout_s=3
    )
    opened = time.monotonic()
    cid = f"step-{args.steps}"
    attempts = {"status": lambda: store.status(cid).persist}
    if args.late is None:
        attempts["wait_persisted"] = lambda: store.wait_persisted(cid, timeout=60).persist
    report_attempts("dead-peer", attempts, since=opened)
    if args.late is None:
        os._exit(0)  # the process group's other rank is dead: no barrier, no destroy, no close
    dist.barrier()
    store.close()


def silent_peer(args) -> None:
    """See ``silent-peer`` in the module docstring."""
    store = MemStore(job_id=args.job, persist_to=args.persist_to)
    rank, cid, tmp = dist.get_rank(), "step-1", Path(args.tmp)
    dcp.save({f"r{rank}": torch.full((1000,), float(rank))}, checkpoint_id=cid,
             storage_writer=MemoryStorageWriter(store))  # fmt: skip
    store.wait_replicated(cid, timeout=60)
    dist.barrier()
    if rank == 0:
        emit(event="ready")
        wait_for(tmp / "cut", 120)
        attempts = {"wait_replicated": lambda: store.wait_replicated(cid, timeout=2).replication}
        attempts["wait_persisted"] = lambda: (store.delete(cid), store.wait_persisted(cid, timeout=2).persist)
        report_attempts("silent-peer", attempts)
        emit(event="asking-again")  # node 1 is put back while this wait asks
        report_attempts("silent-peer", {"again": lambda: store.wait_persisted(cid).persist})
        wait_for(tmp / "back", 120)
    dist.barrier()
    # node 1 owes step 1 (persist_on_close), an upload that cannot end now that node 0 deleted its copy
    store.close(timeout=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "load", "close-alone", "dead-peer", "silent-peer"])
    p.add_argument("--job", default="mn")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--first", type=int, default=1, help="the step number of the first save")
    p.add_argument("--mib", type=int, default=4, help="size of the sharded tensor (all ranks)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--tmp", default="/tmp")
    p.add_argument("--wait-replicated", action="store_true")
    p.add_argument("--watch", action="store_true")
    p.add_argument("--persist-to", default=None, help="persist checkpoints there (a shared directory)")
    p.add_argument("--persist-every", type=int, default=1, help="0: only what is asked for (--owe)")
    p.add_argument("--owe", type=int, default=0, help="after saving, persist this step from one node only")
    p.add_argument("--owe-rank", type=int, default=0, help="the rank whose node --owe asks")
    p.add_argument("--wait-persisted", type=int, default=0, help="after loading, wait for it")
    p.add_argument("--elsewhere", type=int, default=0, help="after saving, this step's status off node 1")
    p.add_argument("--unreachable", type=int, default=0, help="as --elsewhere, the target unreadable")
    p.add_argument("--waiting", type=int, default=0, help="after saving, node 0 waits for node 1's share")
    p.add_argument("--not-here", type=int, default=0, help="after saving, delete this step on node 1")
    p.add_argument("--before-restore", type=int, default=0, help="every node reports this step, then loads")
    p.add_argument("--serve-until", default=None, help="after saving, serve until this file appears in --tmp")
    p.add_argument("--gate", type=int, default=0, help="after this step is replicated, wait for --tmp/go")
    p.add_argument("--late", type=float, default=None, help="dead-peer: rank 1 opens its store this late")
    p.add_argument("--grace", type=float, default=10, help="dead-peer: stage_timeout_s")
    p.add_argument("--hang", action="store_true", help="after saving, wait to be killed")
    p.add_argument("--settle", action="store_true", help="after saving, wait until --keep are left")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    if args.phase == "close-alone":
        close_alone(args)
        dist.destroy_process_group()
        return
    if args.phase in ("dead-peer", "silent-peer"):
        (dead_peer if args.phase == "dead-peer" else silent_peer)(args)
        dist.destroy_process_group()
        return
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    persist = {}
    if args.persist_to:
        every = args.persist_every or None
        persist = {"persist_to": args.persist_to, "persist_every": every, "persist_on_close": bool(every)}
    store = MemStore(
        job_id=args.job, replicas=args.replicas, keep_in_memory=args.keep, replication_timeout_s=3, **persist
    )
    try:
        (save if args.phase == "save" else load)(args, store, mesh)
        dist.barrier()
    finally:
        store.close(timeout=10 if args.persist_to else None)  # an upload that cannot end does not hang it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
