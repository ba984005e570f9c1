"""The one module that calls pyverbs: an opened RDMA device (``Device``) and one transfer's verbs resources
(``Session``: completion queue, reliable-connected queue pair, memory region), with plain Python values in and
out, so the rest of the replication code never sees a pyverbs object and the tests can put a fake ``pyverbs``
in ``sys.modules`` in place of the real one.

Calls used (rdma-core's pyverbs): ``device.get_device_list()``, ``device.Context(name=)``,
``Context.query_port``, ``Context.query_device``, ``Context.query_gid`` (and ``query_gid_type`` where it
exists), ``pd.PD``, ``cq.CQ(ctx, cqe, None, None, 0)`` and ``CQ.poll(n)``, ``qp.QPCap``, ``qp.QPInitAttr``,
``qp.QP(pd, init)``, ``qp.QPAttr`` with ``QP.to_rtr``/``QP.to_rts``, ``addr.GID``, ``addr.GlobalRoute``,
``addr.AHAttr``, ``mr.MR(pd, length, access, address=)``, ``wr.SGE``, ``wr.SendWR`` with ``set_wr_rdma``,
``QP.post_send``, and the ``IBV_*`` constants of ``pyverbs.enums``; every object is released with ``close()``.
These follow rdma-core's pyverbs sources; they have run only against the fake in the tests, never against real
pyverbs.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import secrets
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # bytes per RDMA work request (lowered to the port's max message size)
SEND_WINDOW = 16  # work requests in flight per queue pair (its send queue depth)
CQ_DEPTH = 2 * SEND_WINDOW
MAX_RD_ATOMIC = 16  # RDMA reads in flight per queue pair (capped by the device)
MAX_GIDS_SCANNED = 64
# Queue pair timing (ibv_modify_qp): ACK timeout 4.096 us * 2^14 (~67 ms), 7 retries, RNR as in the
# verbs examples (unused: no SEND is ever posted).
_ACK_TIMEOUT, _RETRY_CNT, _RNR_RETRY, _MIN_RNR_TIMER = 14, 7, 7, 12

# What a memory region or a queue pair lets happen, by name (mapped to IBV_ACCESS_* flags).
LOCAL_READ = "local_read"  # the source of RDMA writes: the adapter reads it, nothing else
LOCAL_WRITE = "local_write"  # the target of RDMA reads posted here
REMOTE_WRITE = "remote_write"  # the peer may RDMA-write into it
REMOTE_READ = "remote_read"  # the peer may RDMA-read it
NO_REMOTE = "none"  # a queue pair that only sends (no remote access to anything through it)


class VerbsError(RuntimeError):
    """A verbs call failed (the device, a registration, a queue pair), with what was being done."""


def import_pyverbs() -> SimpleNamespace:
    """The pyverbs modules used here; raises ImportError when pyverbs is not installed."""
    names = ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums")
    return SimpleNamespace(**{n: importlib.import_module(f"pyverbs.{n}") for n in names})


def list_devices() -> list[str]:
    """Names of the RDMA devices (``[]`` if none); raises ImportError without pyverbs and whatever pyverbs
    raises when the verbs library cannot list them."""
    device = importlib.import_module("pyverbs.device")
    out = []
    for d in device.get_device_list():
        name = getattr(d, "name", d)
        out.append(name.decode() if isinstance(name, bytes) else str(name))
    return out


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of the writable buffer ``view`` (a file mapping), to register it."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def gid_to_bytes(gid: str) -> bytes:
    """pyverbs' GID text (``"fe80:0000:...:0001"``, 8 groups of 4 hex digits) as its 16 raw bytes."""
    raw = bytes.fromhex(gid.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"not a GID: {gid!r}")
    return raw


def gid_to_text(raw: bytes) -> str:
    """16 raw GID bytes as pyverbs' GID text."""
    return ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))


@dataclass(frozen=True)
class QPInfo:
    """What a peer needs to connect a reliable-connected queue pair to this one; travels inside signed
    headers (``wire``: field ``qp``). ``mtu`` is an IBV_MTU_* value; ``rd_atomic`` the RDMA reads this side
    takes (or issues) in flight."""

    qp_num: int
    lid: int
    gid: bytes
    psn: int
    mtu: int
    rd_atomic: int

    def to_wire(self) -> dict:
        return {
            "qp_num": self.qp_num,
            "lid": self.lid,
            "gid": self.gid,
            "psn": self.psn,
            "mtu": self.mtu,
            "rd_atomic": self.rd_atomic,
        }

    @classmethod
    def from_wire(cls, fields: dict) -> QPInfo:
        """From a header field already checked by ``wire`` (exact keys, types, ranges)."""
        return cls(**{k: fields[k] for k in ("qp_num", "lid", "gid", "psn", "mtu", "rd_atomic")})


@dataclass(frozen=True)
class Completion:
    """One polled work completion: its ``wr_id``, ``status`` (IBV_WC_*), the status's name and whether it
    succeeded."""

    wr_id: int
    status: int
    status_name: str
    vendor_err: int

    @property
    def ok(self) -> bool:
        return self.status_name == "IBV_WC_SUCCESS"


class Device:
    """An opened RDMA device: context, a protection domain, and the port's addressing (``lid``, ``gid``,
    ``mtu``). ``port`` is the device port to use; ``gid_index`` its GID table entry (default: chosen here,
    preferring a RoCE v2 IPv4 entry on Ethernet ports, else the first valid one).

    Shared by a transport and a server: each holder calls ``acquire()`` once and ``release()`` when done;
    the device closes when the last holder releases it. Raises ImportError without pyverbs and VerbsError
    (saying what failed) when the device does not open or its port is not usable."""

    def __init__(self, name: str, port: int = 1, gid_index: int | None = None) -> None:
        self.pv = import_pyverbs()
        self.e = self.pv.enums
        self.name, self.port = name, port
        self.ctx: Any = None
        self.pd: Any = None
        self._refs = 1
        self._lock = threading.Lock()
        self._status_names = {
            getattr(self.e, n): n
            for n in dir(self.e)
            if n.startswith("IBV_WC_") and (n.endswith("_ERR") or n == "IBV_WC_SUCCESS")
        }
        try:
            self.ctx = self.pv.device.Context(name=name)
            self.pd = self.pv.pd.PD(self.ctx)
        except Exception as e:  # pyverbs raises PyverbsRDMAError/PyverbsError, not a common base here
            self._close()
            raise VerbsError(f"cannot open RDMA device {name!r} or allocate a protection domain: {e}") from e
        try:
            port_attr = self.ctx.query_port(port)
            dev_attr = self.ctx.query_device()
            if port_attr.state != self.e.IBV_PORT_ACTIVE:
                raise VerbsError(
                    f"port {port} of RDMA device {name!r} is not active (state {port_attr.state})"
                )
            self.lid = int(port_attr.lid)
            self.mtu = int(port_attr.active_mtu)
            self.chunk_bytes = max(1, min(CHUNK_BYTES, int(port_attr.max_msg_sz)))
            self.rd_atomic = max(
                1, min(MAX_RD_ATOMIC, int(dev_attr.max_qp_rd_atom), int(dev_attr.max_qp_init_rd_atom))
            )
            self.ethernet = port_attr.link_layer == self.e.IBV_LINK_LAYER_ETHERNET
            self.gid_index, self.gid = self._choose_gid(port_attr, gid_index)
        except VerbsError:
            self._close()
            raise
        except Exception as e:
            self._close()
            raise VerbsError(f"cannot query port {port} of RDMA device {name!r}: {e}") from e

    def _choose_gid(self, port_attr: Any, wanted: int | None) -> tuple[int, bytes]:
        """(index, raw GID) to address this port with. An InfiniBand port may have none (LID routing)."""
        if wanted is not None:
            raw = gid_to_bytes(self.ctx.query_gid(self.port, wanted).gid)
            if not any(raw):
                raise VerbsError(f"GID {wanted} of port {self.port} of {self.name!r} is empty")
            return wanted, raw
        valid = []
        for idx in range(min(int(port_attr.gid_tbl_len), MAX_GIDS_SCANNED)):
            try:
                raw = gid_to_bytes(self.ctx.query_gid(self.port, idx).gid)
            except Exception:  # unpopulated entries may fail to query
                continue
            if any(raw[8:]):
                valid.append((idx, raw))
        if self.ethernet and hasattr(self.ctx, "query_gid_type"):
            v2 = getattr(self.e, "IBV_GID_TYPE_SYSFS_ROCE_V2", None)
            roce_v2 = [
                (i, g) for i, g in valid if v2 is not None and self.ctx.query_gid_type(self.port, i) == v2
            ]
            ipv4 = [(i, g) for i, g in roce_v2 if g[:12] == b"\0" * 10 + b"\xff\xff"]
            valid = ipv4 + roce_v2 + valid
        if valid:
            return valid[0]
        if self.ethernet:
            raise VerbsError(f"port {self.port} of RDMA device {self.name!r} (RoCE) has no valid GID")
        return 0, bytes(16)

    def status_name(self, status: int) -> str:
        return self._status_names.get(status, f"status {status}")

    def acquire(self) -> Device:
        """Take one more reference (a server sharing the transport's device)."""
        with self._lock:
            if self._refs <= 0:
                raise VerbsError(f"RDMA device {self.name!r} is closed")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop one reference; the last one closes the device (protection domain, then context)."""
        with self._lock:
            if self._refs <= 0:
                return
            self._refs -= 1
            last = self._refs == 0
        if last:
            self._close()

    def _close(self) -> None:
        _close_all([self.pd, self.ctx])
        self.pd = self.ctx = None

    def session(self, *, own_pd: bool) -> Session:
        """A new transfer's resources (see ``Session``); ``own_pd``: in a protection domain of its own, so
        its memory region is reachable only through its own queue pair (what a server exposes)."""
        return Session(self, own_pd)


class Session:
    """One transfer's verbs resources: a completion queue, a reliable-connected queue pair (created in
    RESET; ``info`` is what the peer needs to connect to it) and at most one memory region. ``close()``
    destroys the queue pair first (the adapter stops touching memory through it), then deregisters the
    memory region: after it, the registered range may be unmapped. Raises VerbsError."""

    def __init__(self, device: Device, own_pd: bool) -> None:
        self.device = device.acquire()  # the device stays open until this session is closed
        pv, e = device.pv, device.e
        self._own_pd = own_pd
        self._open = True
        self.pd: Any = None
        self.cq: Any = None
        self.qp: Any = None
        self.mr: Any = None
        try:
            self.pd = pv.pd.PD(device.ctx) if own_pd else device.pd
            self.cq = pv.cq.CQ(device.ctx, CQ_DEPTH, None, None, 0)
            cap = pv.qp.QPCap(max_send_wr=SEND_WINDOW, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1)
            self.qp = pv.qp.QP(self.pd, init)
        except Exception as ex:
            self.close()
            raise VerbsError(f"cannot create a queue pair on RDMA device {device.name!r}: {ex}") from ex
        self.psn = secrets.randbits(24)
        self.info = QPInfo(self.qp.qp_num, device.lid, device.gid, self.psn, device.mtu, device.rd_atomic)

    def _access(self, access: str) -> int:
        e = self.device.e
        flags = {
            LOCAL_READ: 0,
            LOCAL_WRITE: e.IBV_ACCESS_LOCAL_WRITE,
            REMOTE_WRITE: e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE,  # verbs requires LOCAL_WRITE
            REMOTE_READ: e.IBV_ACCESS_REMOTE_READ,
        }
        return flags[access]

    def register(self, address: int, length: int, access: str) -> tuple[int, int]:
        """Register ``length`` bytes at ``address`` (memory this process keeps mapped until ``close()``) as
        this session's memory region with ``access``; return its ``(lkey, rkey)``."""
        if self.mr is not None:
            raise VerbsError("this RDMA session already has a memory region")
        try:
            self.mr = self.device.pv.mr.MR(self.pd, length, self._access(access), address=address)
        except Exception as ex:
            raise VerbsError(
                f"cannot register {length} bytes for RDMA on {self.device.name!r} ({access}): "
                f"{ex}. A limit on "
                f"locked memory (ulimit -l) is the usual cause"
            ) from ex
        return int(self.mr.lkey), int(self.mr.rkey)

    def connect(self, remote: QPInfo, *, remote_access: str, send: bool) -> None:
        """Connect the queue pair to the peer's ``remote``: to RTR (it accepts the peer's requests that
        ``remote_access`` allows), then with ``send`` to RTS (it posts RDMA writes/reads itself)."""
        pv, e, dev = self.device.pv, self.device.e, self.device
        try:
            attr = pv.qp.QPAttr(port_num=dev.port, path_mtu=min(dev.mtu, remote.mtu))
            attr.pkey_index = 0
            attr.qp_access_flags = {
                NO_REMOTE: 0,
                REMOTE_WRITE: e.IBV_ACCESS_REMOTE_WRITE,
                REMOTE_READ: e.IBV_ACCESS_REMOTE_READ,
            }[remote_access]
            attr.dest_qp_num = remote.qp_num
            attr.rq_psn = remote.psn
            attr.max_dest_rd_atomic = dev.rd_atomic
            attr.min_rnr_timer = _MIN_RNR_TIMER
            routed = any(remote.gid[8:])
            gr = (
                pv.addr.GlobalRoute(dgid=pv.addr.GID(gid_to_text(remote.gid)), sgid_index=dev.gid_index)
                if routed
                else None
            )
            attr.ah_attr = pv.addr.AHAttr(port_num=dev.port, dlid=remote.lid, is_global=int(routed), gr=gr)
            self.qp.to_rtr(attr)
            if send:
                attr.sq_psn = self.psn
                attr.timeout = _ACK_TIMEOUT
                attr.retry_cnt = _RETRY_CNT
                attr.rnr_retry = _RNR_RETRY
                attr.max_rd_atomic = max(1, min(dev.rd_atomic, remote.rd_atomic))
                self.qp.to_rts(attr)
        except Exception as ex:
            raise VerbsError(
                f"cannot connect an RDMA queue pair on {dev.name!r} to the peer's queue pair {remote.qp_num} "
                f"(lid {remote.lid}, gid {gid_to_text(remote.gid)}): {ex}"
            ) from ex

    def post(self, op: str, wr_id: int, local: int, length: int, remote: int, rkey: int) -> None:
        """Post one signaled RDMA ``op`` (``"write"``: local -> remote, ``"read"``: remote -> local) of
        ``length`` bytes between ``local`` (in this session's memory region) and the peer's ``remote``."""
        pv, e = self.device.pv, self.device.e
        opcode = e.IBV_WR_RDMA_WRITE if op == "write" else e.IBV_WR_RDMA_READ
        sge = pv.wr.SGE(local, length, self.mr.lkey)
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, remote)
        try:
            self.qp.post_send(wr)
        except Exception as ex:
            raise VerbsError(f"cannot post an RDMA {op} on {self.device.name!r}: {ex}") from ex

    def poll(self, max_entries: int) -> list[Completion]:
        """Up to ``max_entries`` completions that are ready now (never waits)."""
        try:
            _, wcs = self.cq.poll(max_entries)
        except Exception as ex:
            raise VerbsError(
                f"polling the RDMA completion queue on {self.device.name!r} failed: {ex}"
            ) from ex
        name = self.device.status_name
        return [Completion(int(w.wr_id), int(w.status), name(w.status), int(w.vendor_err)) for w in wcs]

    def close(self) -> None:
        """Destroy the queue pair, deregister the memory region, destroy the completion queue (and the
        session's own protection domain). Idempotent; failures are swallowed (the objects are gone either
        way once the device closes)."""
        objs = [self.qp, self.mr, self.cq, self.pd if self._own_pd else None]
        self.qp = self.mr = self.cq = None
        self.pd = None
        _close_all(objs)
        if self._open:
            self._open = False
            self.device.release()


def _close_all(objs: list[Any]) -> None:
    for obj in objs:
        if obj is not None:
            try:
                obj.close()
            except Exception as e:  # closing must not mask the error that led here
                log.debug("closing RDMA resource %r failed: %s", obj, e)
