"""The dcp-memstore command: look at and tidy a node's checkpoint store.

dcp-memstore list   [--root DIR] [--job-id ID]              committed checkpoints, oldest first: MiB, holds
dcp-memstore show   ID [--items] [--root DIR] [--job-id ID]  one checkpoint's files (and every item)
dcp-memstore delete ID [--root DIR] [--job-id ID]           remove one committed checkpoint
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from dcp_memstore.errors import CheckpointInUseError
from dcp_memstore.memstore import MemStore, resolve_job_id, resolve_root
from dcp_memstore.store import catalog
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.layout import MANIFEST, StoreLayout
from dcp_memstore.store.manifest import Manifest


def _layout(args: argparse.Namespace) -> StoreLayout:
    """The store named by the arguments; an error (not a new empty store) if there is none. Looking needs
    no ``MemStore``: ``list`` and ``show`` change nothing, warn about nothing and work on a read-only
    mount of the store's tmpfs."""
    root, job = resolve_root(args.root), resolve_job_id(args.job_id)
    layout = StoreLayout(root, job)
    if not layout.checkpoints_dir.is_dir():
        jobs = _jobs_under(root)
        there = f"the jobs there are {', '.join(jobs)}" if jobs else "no job has a store there"
        raise FileNotFoundError(
            f"no dcp_memstore store for job {job!r} under {root} ({there}); check --root and --job-id"
        )
    return layout


def _jobs_under(root: Path) -> list[str]:
    """The ids of the jobs that have a store under ``root``, sorted (none if it cannot be read): what a
    mistyped or defaulted ``--job-id`` should have been."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    return sorted(e.name for e in entries if StoreLayout(root, e.name).checkpoints_dir.is_dir())


def _list(args: argparse.Namespace) -> int:
    layout = _layout(args)
    recs = catalog.committed(layout)
    print(f"store {layout.job_dir}: {len(recs)} committed checkpoint(s)")
    for r in recs:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.committed_at))
        held = catalog.hold_names(layout, r.checkpoint_id)
        note = f"  held for: {', '.join(held)}" if held else ""
        memory = _memory_used(layout.checkpoint_dir(r.checkpoint_id)) / 2**20
        print(
            f"  {r.checkpoint_id:<32} seq {r.seq:<6} {r.nbytes / 2**20:10.1f} MiB "
            f"({memory:.1f} MiB in memory)  {when}{note}"
        )
    return 0


def _memory_used(directory: Path) -> int:
    """Bytes of memory the files under ``directory`` take (their allocated blocks): more than the data
    they hold by the alignment of items and the slack of pooled files reused at a larger size. This, not
    the data, is what sizing the tmpfs needs."""
    total = 0
    for top, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


def _show(args: argparse.Namespace) -> int:
    layout = _layout(args)
    d = catalog.require_committed(layout, validate_name(args.checkpoint_id))
    m = Manifest.read(d / MANIFEST)
    print(
        f"checkpoint {m.checkpoint_id}: {len(m.items)} items, {m.nbytes} bytes, "
        f"written by {m.world_size} rank(s)"
    )
    held = catalog.hold_names(layout, m.checkpoint_id)
    if held:  # e.g. "persist-<hex>": owed to persistent storage, not evicted until uploaded
        print(f"  held in memory for: {', '.join(held)}")
    for name, size in sorted(m.files.items()):
        print(f"  {name:<24} {size:>14} bytes")
    if args.items:
        for it in m.items:
            loc = it.location
            print(
                f"  {it.fqn:<40} {loc.file:<20} @{loc.offset:<12} {loc.length:>12} B "
                f"{loc.dtype or 'bytes'} {loc.shape or ''}"
            )
    return 0


def _delete(args: argparse.Namespace) -> int:
    layout = _layout(args)
    try:
        with warnings.catch_warnings():
            # What opening a store warns a training job about (a root not on tmpfs, checkpoints owed to
            # persistent storage that a store without persist_to evicts) is not true of this command: it
            # evicts nothing and leaves every other checkpoint as it is.
            warnings.simplefilter("ignore")
            # one io thread: the command copies nothing, and the delete then keeps one pooled file per rank
            with (
                _as_owner_of(layout.job_dir),
                MemStore(root=layout.root, job_id=layout.job_id, io_threads=1) as store,
            ):
                store.delete(args.checkpoint_id)
    except OSError as e:
        if isinstance(e, FileNotFoundError):  # the checkpoint is not there: its message names those that are
            raise
        why = f"{e.strerror} ({e.filename})" if e.filename else e.strerror or str(e)
        raise type(e)(
            e.errno,
            f"cannot delete {args.checkpoint_id!r} from store {layout.job_dir}: {why}; deleting needs write "
            "access to the store (a read-only mount, or another user's store?)",
        ) from e
    print(f"deleted {args.checkpoint_id}")
    return 0


@contextlib.contextmanager
def _as_owner_of(directory: Path) -> Iterator[None]:
    """Run as the user and group that own ``directory`` when root runs the command (an operator's
    ``sudo dcp-memstore delete``): what the delete makes in the store (its pool directories, the files
    it recycles, its process lock) must be the job's, or the job's own user could not use them."""
    st = directory.stat()
    if os.geteuid() != 0 or st.st_uid == 0:
        yield
        return
    os.setegid(st.st_gid)
    os.seteuid(st.st_uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(  # the module docstring: what it is, and the three commands
        prog="dcp-memstore", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", help="store root (default: $DCP_MEMSTORE_ROOT or /dev/shm/dcp_memstore)")
    common.add_argument(
        "--job-id", help="job id (default: $DCP_MEMSTORE_JOB_ID, torchrun's run id, or 'default')"
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="list committed checkpoints").set_defaults(fn=_list)
    show = sub.add_parser("show", parents=[common], help="describe one checkpoint")
    show.add_argument("checkpoint_id")
    show.add_argument("--items", action="store_true", help="also list every stored item")
    show.set_defaults(fn=_show)
    delete = sub.add_parser("delete", parents=[common], help="remove one committed checkpoint")
    delete.add_argument("checkpoint_id")
    delete.set_defaults(fn=_delete)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError as e:
        if _output_cut_short():  # the reader of the output left (`| head`): not the store's error
            return 0
        print(f"dcp-memstore: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, CheckpointInUseError) as e:  # OSError: not found, read-only, ...
        print(f"dcp-memstore: {e}", file=sys.stderr)
        return 2


def _output_cut_short() -> bool:
    """Whether the standard output is a pipe whose reader has closed it (poll says POLLERR); it is then
    pointed at /dev/null, so that what is still buffered does not fail again at exit."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by something without a descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if not any(events & select.POLLERR for _, events in poller.poll(0)):
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


if __name__ == "__main__":
    sys.exit(main())
