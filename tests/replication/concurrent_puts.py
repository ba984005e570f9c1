"""Shared check for transports: many files pushed at once from several threads, to two source nodes,
all arriving intact and with no temporaries left."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dcp_memstore.replication.transport import Transport
from dcp_memstore.store.layout import StoreLayout

NODES = ("node0", "node1")


def check_concurrent_puts(
    transport: Transport,
    address: tuple,
    local: StoreLayout,
    peer_root: Path,
    job: str,
    files: dict[str, bytes],
) -> None:
    """Write ``files`` under ``local``'s checkpoint ``step-1``, push each as a replica of both NODES from
    its own thread, and assert the peer holds exactly those bytes and nothing else."""
    paths = {}
    for name, data in files.items():
        d = local.checkpoint_dir("step-1")
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
        paths[name] = d / name
    errors: list[BaseException] = []

    def push(name: str, node: str) -> None:
        try:
            transport.put_file(address, node, "step-1", name, paths[name])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=push, args=(n, node)) for n in files for node in NODES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    peer = StoreLayout(peer_root, job)
    for node in NODES:
        for name, data in files.items():
            assert (peer.replica_dir(node, "step-1") / name).read_bytes() == data
    held = [os.path.join(dp, n) for dp, _, names in os.walk(peer_root) for n in names]
    assert len(held) == len(files) * len(NODES), held  # no temporaries left
