"""Async-save blocking time in a job that checkpoints only with ``dcp.async_save``, save by save.

``bench_core.py`` times every operation in one store, so its async saves also claim files that its
synchronous saves wrote (and never mapped). A training job that only uses ``async_save`` reaches its
steady state once evicted checkpoints' files come back from the pool (from the 4th save with
``keep_in_memory=2``): this prints the blocking time of each save against a plain memcpy of the same
tensors with the same threads, measured just before it. ``--gap`` is the training time between saves (the
process sleeps, as a trainer whose steps run on the GPU leaves the CPU idle): the first saves have the
next saves' files allocated in the background meanwhile. ``--sync`` times ``dcp.save`` instead (training
waits for the whole save), which has the next save's files allocated ahead in the same way. ``--log``
also prints the DEBUG lines of each save (docs/troubleshooting.md): the time of the copy into the shard
files alone, and whether those files were staged, reused or new.

    python benchmarks/bench_async.py [--size-gib 1] [--tensors 64] [--saves 8] [--gap 0] [--sync] [--log]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_memstore import MemoryStorageWriter, MemStore
from dcp_memstore.store.threads import run_parallel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--gap", type=float, default=0.0, help="seconds of 'training' between saves")
    p.add_argument("--sync", action="store_true", help="time dcp.save instead of dcp.async_save")
    p.add_argument("--log", action="store_true", help="print the DEBUG lines of each save")
    args = p.parse_args()
    if args.log:
        logging.basicConfig(stream=sys.stdout, format="    %(message)s")
        logging.getLogger("dcp_memstore.dcp").setLevel(logging.DEBUG)
    warnings.simplefilter("ignore")  # dcp warns that no process group is initialised
    numel = int(args.size_gib * (1 << 30)) // 4 // args.tensors
    sd = {f"t{i}": torch.randn(numel) for i in range(args.tensors)}
    src = list(sd.values())
    dst = [torch.empty_like(t) for t in src]
    root = tempfile.mkdtemp(prefix="dcpms-bench-async-", dir="/dev/shm")
    try:
        store = MemStore(root=root, job_id="bench", keep_in_memory=2)
        bins = [range(b, len(src), store.io_threads) for b in range(store.io_threads)]

        def memcpy() -> None:
            run_parallel(lambda idx: [dst[k].copy_(src[k]) for k in idx], bins, store.io_threads)

        print(
            f"{args.size_gib:g} GiB in {args.tensors} tensors, "
            f"io_threads={store.io_threads}, keep_in_memory=2, "
            f"{args.gap:g} s between saves"
        )
        print(f"| save | memcpy s | {'save' if args.sync else 'async_save'} blocking s | ratio |")
        print("|---|---|---|---|")
        for i in range(args.saves):
            time.sleep(args.gap if i else 0.0)
            t0 = time.perf_counter()
            memcpy()
            t1 = time.perf_counter()
            save = dcp.save if args.sync else dcp.async_save
            done = save(
                sd, checkpoint_id=f"step-{i}", storage_writer=MemoryStorageWriter(store), no_dist=True
            )
            t2 = time.perf_counter()
            if not args.sync:
                done.result()
            print(f"| {i + 1} | {t1 - t0:.3f} | {t2 - t1:.3f} | {(t2 - t1) / (t1 - t0):.2f} |")
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
