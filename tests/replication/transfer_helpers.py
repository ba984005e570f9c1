"""What the transport tests (TCP and RDMA) share: the job name, a raw client connection to a server, making
and listing files, the round trip of one file (put as a replica, got back), and the check that many files
pushed at once from several threads arrive intact with no temporaries left."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from dcp_memstore.replication import wire
from dcp_memstore.replication.auth import destination, sign_request
from dcp_memstore.replication.transport import Transport
from dcp_memstore.store.layout import StoreLayout, shard_name

JOB = "job"
NODES = ("node0", "node1")


class RawClient(socket.socket):
    """A connection to a ``PeerServer`` for what ``TcpTransport`` would never send (see ``raw_connect``);
    ``signed`` makes requests for it."""

    challenge: bytes  # the server's, from its hello

    def signed(self, secret: bytes, op: str, job: str = JOB, **fields: object) -> dict:
        """A request of job ``job`` for this connection's server and challenge, signed with ``secret``."""
        to = destination(self.getpeername())
        return sign_request({"op": op, **fields}, secret, job, to, self.challenge)


def raw_connect(address: tuple, hello: bool = True) -> RawClient:
    """A connection to the server at ``address`` that has sent its hello (unless ``hello`` is False) and
    read the server's."""
    client = RawClient(fileno=socket.create_connection(address, timeout=10).detach())
    client.settimeout(10)
    if hello:
        wire.send_header(client, wire.CLIENT_HELLO)
    client.challenge = wire.validate_server_hello(wire.recv_header(client))
    return client


def make_file(layout: StoreLayout, checkpoint: str, name: str, data: bytes) -> Path:
    d = layout.checkpoint_dir(checkpoint)
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)
    return d / name


def files_under(root: Path) -> list[str]:
    """Every file below ``root`` (hidden temporaries included), relative to it, but the stores' process
    lock files (``<job>/procs/``: a process that received a file holds one for its life)."""
    paths = (os.path.relpath(os.path.join(dp, n), root) for dp, _, names in os.walk(root) for n in names)
    return sorted(p for p in paths if Path(p).parts[1:2] != ("procs",))


def check_put_then_get(
    transport: Transport, address: tuple, local: StoreLayout, peer_root: Path, data: bytes
) -> None:
    """Put ``data`` as node0's replica of ``step-1``'s first shard, assert the peer holds exactly those
    bytes (no temporaries), and get it back bit-exact."""
    src = make_file(local, "step-1", shard_name(0, 0), data)
    transport.put_file(address, "node0", "step-1", shard_name(0, 0), src)
    stored = StoreLayout(peer_root, JOB).replica_dir("node0", "step-1") / shard_name(0, 0)
    assert stored.read_bytes() == data
    assert files_under(peer_root) == [f"{JOB}/replicas/node0/step-1/{shard_name(0, 0)}"]  # no temporaries

    back = local.job_dir / "restored.shard"
    transport.get_file(address, "step-1", shard_name(0, 0), back, source_node="node0", layout=local)
    assert back.read_bytes() == data


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
    paths = {name: make_file(local, "step-1", name, data) for name, data in files.items()}
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
    held = files_under(peer_root)
    assert len(held) == len(files) * len(NODES), held  # no temporaries left
