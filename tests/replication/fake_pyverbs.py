"""A FAKE ``pyverbs``: a mock standing in for RDMA hardware (and rdma-core's pyverbs) that this machine does
not have. It is NOT the real library and proves nothing about it or about any adapter; it lets the tests
run our RDMA code (``dcp_memstore.replication.rdma_verbs`` and everything above it) up to the device
boundary.

It implements only the calls ``rdma_verbs`` makes, with the signatures of rdma-core's pyverbs
(``device.get_device_list/Context``, ``pd.PD``, ``cq.CQ/poll``, ``qp.QPCap/QPInitAttr/QPAttr/QP`` with
``to_rtr/to_rts/post_send``, ``addr.GID/GlobalRoute/AHAttr``, ``mr.MR(address=)``, ``wr.SGE/SendWR`` with
``set_wr_rdma``, ``enums``), and models what the tests need the hardware to enforce:

- Memory regions are address ranges of this process; a posted RDMA WRITE/READ is executed at once with
  ``ctypes.memmove`` between the two registered ranges, after checking the local lkey (its region in the
  queue pair's protection domain, the range inside it, LOCAL_WRITE for a read target), the peer: the two
  queue pairs connected to each other (dest_qp_num both ways, PSNs agreeing, the address vector naming a
  GID or LID of the port), the rkey (its region in the peer queue pair's protection domain, REMOTE_WRITE
  or REMOTE_READ on both the region and the queue pair, the range inside it) and the port's max message
  size. A violation gives the error completion real hardware gives (LOC_PROT_ERR, REM_ACCESS_ERR,
  RETRY_EXC_ERR, LOC_LEN_ERR) and moves the queue pair to the error state (later work: WR_FLUSH_ERR).
- Completions queue on the send CQ; posting beyond the send queue depth fails like ``ibv_post_send``.
- Knobs on ``Fabric``: ``fail_status``/``fail_after`` (the next work request after ``fail_after`` good ones
  completes with ``fail_status``), ``hang`` (work is accepted and never completes), ``max_per_poll``
  (completions handed out per poll), ``fail_register`` (registrations with remote access fail, as with a
  locked-memory limit), port state, link layer, GID table and max message size.
- Bookkeeping the tests assert on: every registration, every executed operation, live objects, and
  ``bugs``: misuse the real stack would punish (closing a protection domain or context that still has
  objects, deregistering memory that work not yet executed still refers to, overrunning a CQ).
"""

from __future__ import annotations

import ctypes
import itertools
import random
import sys
import types
from collections import deque
from typing import Any

import pytest

# Values as in rdma-core's libibverbs enums (only their names matter to the code under test).
ENUMS = {
    "IBV_QPT_RC": 2,
    "IBV_QPS_RESET": 0,
    "IBV_QPS_INIT": 1,
    "IBV_QPS_RTR": 2,
    "IBV_QPS_RTS": 3,
    "IBV_QPS_ERR": 6,
    "IBV_MTU_1024": 3,
    "IBV_MTU_4096": 5,
    "IBV_PORT_DOWN": 1,
    "IBV_PORT_ACTIVE": 4,
    "IBV_LINK_LAYER_INFINIBAND": 1,
    "IBV_LINK_LAYER_ETHERNET": 2,
    "IBV_GID_TYPE_SYSFS_IB_ROCE_V1": 0,
    "IBV_GID_TYPE_SYSFS_ROCE_V2": 1,
    "IBV_ACCESS_LOCAL_WRITE": 1,
    "IBV_ACCESS_REMOTE_WRITE": 2,
    "IBV_ACCESS_REMOTE_READ": 4,
    "IBV_WR_RDMA_WRITE": 0,
    "IBV_WR_RDMA_READ": 4,
    "IBV_SEND_SIGNALED": 2,
    "IBV_WC_SUCCESS": 0,
    "IBV_WC_LOC_LEN_ERR": 1,
    "IBV_WC_LOC_PROT_ERR": 4,
    "IBV_WC_WR_FLUSH_ERR": 5,
    "IBV_WC_REM_ACCESS_ERR": 10,
    "IBV_WC_RETRY_EXC_ERR": 12,
    "IBV_WC_RDMA_WRITE": 1,  # a completion opcode: must not be taken for a status
    "IBV_WC_RDMA_READ": 2,
}
E = types.SimpleNamespace(**ENUMS)

IB_GIDS = ["fe80:0000:0000:0000:0002:c903:00f1:0001"]
ROCE_GIDS = [  # (gid text, type): link-local v1 and v2, then IPv4-mapped v1 and v2 (as mlx5 lists them)
    ("fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f", 0),
    ("fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f", 1),
    ("0000:0000:0000:0000:0000:ffff:0a00:0001", 0),
    ("0000:0000:0000:0000:0000:ffff:0a00:0001", 1),
]
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


class FakePyverbsError(Exception):
    """What the fake raises where pyverbs raises PyverbsRDMAError / PyverbsError."""


class Fabric:
    """The fake's whole world: one port's properties, every live object, knobs and records."""

    def __init__(
        self,
        devices: tuple[bytes, ...] = (b"mlx5_0",),
        *,
        open_error: Exception | None = None,
        link_layer: int = E.IBV_LINK_LAYER_INFINIBAND,
        port_state: int = E.IBV_PORT_ACTIVE,
        max_msg_sz: int = 1 << 31,
        gids: list[tuple[str, int]] | None = None,
        lid: int = 7,
    ) -> None:
        self.devices, self.open_error = list(devices), open_error
        self.link_layer, self.port_state, self.max_msg_sz, self.lid = link_layer, port_state, max_msg_sz, lid
        if gids is None:
            gids = [(g, 0) for g in IB_GIDS] if link_layer == E.IBV_LINK_LAYER_INFINIBAND else list(ROCE_GIDS)
        self.gids = gids + [(ZERO_GID, 0)] * 4  # unpopulated entries
        # knobs
        self.fail_status: int | None = None
        self.fail_after = 0
        self.hang = False
        self.max_per_poll: int | None = None
        self.fail_register = False
        # records
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.registrations: list[dict] = []
        self.ops: list[tuple[str, int]] = []  # (opcode name, bytes) of each executed RDMA operation
        self.qps_created = 0
        self.bugs: list[str] = []
        self.live: set[Any] = set()
        self.qps: dict[int, Any] = {}  # live queue pairs by number
        self.mrs: dict[int, Any] = {}  # live memory regions by lkey and by rkey (the same object twice)
        self._executed_ok = 0
        self._keys = itertools.count(0x1000, 0x101)

    def new_key(self) -> int:
        return next(self._keys) & 0xFFFFFFFF

    def live_of(self, kind: type) -> list[Any]:
        return [o for o in list(self.live) if isinstance(o, kind)]

    def valid_gid(self, text: str) -> bool:
        return text != ZERO_GID and any(text == g for g, _ in self.gids)


# --- the pyverbs classes, bound to one Fabric by install() ---------------------------------------------


def build_modules(fabric: Fabric) -> dict[str, types.ModuleType]:
    """The fake pyverbs package and submodules, sharing ``fabric``."""

    class Device:
        def __init__(self, name: bytes) -> None:
            self.name = name

    class PortAttr:
        def __init__(self) -> None:
            self.state = fabric.port_state
            self.lid = fabric.lid
            self.active_mtu = E.IBV_MTU_4096 if fabric.link_layer == E.IBV_LINK_LAYER_INFINIBAND else 3
            self.max_msg_sz = fabric.max_msg_sz
            self.gid_tbl_len = len(fabric.gids)
            self.link_layer = fabric.link_layer

    class DeviceAttr:
        max_qp_rd_atom = 16
        max_qp_init_rd_atom = 16

    class GID:
        def __init__(self, val: str | None = None) -> None:
            self.gid = val if val is not None else ZERO_GID

    class Context:
        def __init__(self, **kwargs: Any) -> None:
            if fabric.open_error is not None:
                raise fabric.open_error
            name = kwargs["name"]
            if name.encode() not in fabric.devices:
                raise FakePyverbsError(f"Failed to find device {name}")
            self.name = name
            self.children: set[Any] = set()
            self.is_open = True
            fabric.opened.append(f"ctx:{name}")
            fabric.live.add(self)

        def query_port(self, port: int) -> PortAttr:
            if port != 1:
                raise FakePyverbsError(f"Failed to query port {port}")
            return PortAttr()

        def query_device(self) -> DeviceAttr:
            return DeviceAttr()

        def query_gid(self, port: int, index: int) -> GID:
            if not 0 <= index < len(fabric.gids):
                raise FakePyverbsError(f"Failed to query gid {index} of port {port}")
            return GID(fabric.gids[index][0])

        def query_gid_type(self, port: int, index: int) -> int:
            return fabric.gids[index][1]

        def close(self) -> None:
            if self.is_open:
                if self.children:
                    fabric.bugs.append(f"context {self.name} closed with live objects {self.children}")
                self.is_open = False
                fabric.closed.append(f"ctx:{self.name}")
                fabric.live.discard(self)

    class PD:
        def __init__(self, ctx: Context) -> None:
            assert isinstance(ctx, Context) and ctx.is_open
            self.ctx, self.children, self.is_open = ctx, set(), True
            ctx.children.add(self)
            fabric.opened.append(f"pd:{ctx.name}")
            fabric.live.add(self)

        def close(self) -> None:
            if self.is_open:
                if self.children:
                    fabric.bugs.append(f"protection domain closed with live objects {self.children}")
                self.is_open = False
                self.ctx.children.discard(self)
                fabric.closed.append(f"pd:{self.ctx.name}")
                fabric.live.discard(self)

    class WC:
        def __init__(self, wr_id: int, status: int, opcode: int, byte_len: int) -> None:
            self.wr_id, self.status, self.opcode, self.byte_len = wr_id, status, opcode, byte_len
            self.vendor_err = 0 if status == E.IBV_WC_SUCCESS else 0x81

    class CQ:
        def __init__(self, ctx: Context, cqe: int, cq_context: Any, channel: Any, comp_vector: int) -> None:
            assert isinstance(ctx, Context) and ctx.is_open and channel is None
            self.ctx, self.cqe, self.entries, self.is_open = ctx, cqe, deque(), True
            ctx.children.add(self)
            fabric.live.add(self)

        def push(self, wc: WC) -> None:
            if len(self.entries) >= self.cqe:
                fabric.bugs.append("completion queue overrun")
            self.entries.append(wc)

        def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
            n = num_entries if fabric.max_per_poll is None else min(num_entries, fabric.max_per_poll)
            out = [self.entries.popleft() for _ in range(min(n, len(self.entries)))]
            for qp in fabric.qps.values():
                if qp.scq is self:
                    qp.outstanding -= len(out)  # a polled completion frees its send queue slot
            return len(out), out

        def close(self) -> None:
            if self.is_open:
                self.is_open = False
                self.ctx.children.discard(self)
                fabric.live.discard(self)

    class QPCap:
        def __init__(
            self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1, max_recv_sge: int = 1
        ) -> None:
            self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
            self.max_send_sge, self.max_recv_sge = max_send_sge, max_recv_sge

    class QPInitAttr:
        def __init__(
            self,
            qp_type: int = 4,
            qp_context: Any = None,
            scq: Any = None,
            rcq: Any = None,
            srq: Any = None,
            cap: QPCap | None = None,
            sq_sig_all: int = 1,
        ) -> None:
            self.qp_type, self.send_cq, self.recv_cq, self.cap, self.sq_sig_all = (
                qp_type,
                scq,
                rcq,
                cap,
                sq_sig_all,
            )

    class QPAttr:
        def __init__(
            self, qp_state: int = 1, cur_qp_state: int = 0, port_num: int = 1, path_mtu: int = 3
        ) -> None:
            self.qp_state, self.port_num, self.path_mtu = qp_state, port_num, path_mtu
            self.pkey_index = 0
            self.qp_access_flags = 0
            self.dest_qp_num = self.rq_psn = self.sq_psn = 0
            self.max_dest_rd_atomic = self.max_rd_atomic = 0
            self.min_rnr_timer = self.timeout = self.retry_cnt = self.rnr_retry = 0
            self.ah_attr: Any = None

    class GlobalRoute:
        def __init__(
            self, dgid: GID | None = None, flow_label: int = 0, sgid_index: int = 0, **_: Any
        ) -> None:
            assert isinstance(dgid, GID)
            self.dgid, self.sgid_index = dgid.gid, sgid_index

    class AHAttr:
        def __init__(
            self, dlid: int = 0, sl: int = 0, src_path_bits: int = 0, static_rate: int = 0,
            is_global: int = 0, port_num: int = 1, gr: GlobalRoute | None = None,
        ) -> None:  # fmt: skip
            if is_global and gr is None:
                raise FakePyverbsError("Global AH Attr is created but gr parameter is None")
            self.dlid, self.is_global, self.port_num, self.gr = dlid, is_global, port_num, gr

    class QP:
        def __init__(self, creator: Any, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
            assert isinstance(creator, PD) and creator.is_open, "QP(pd, QPInitAttr)"
            assert init_attr.qp_type == E.IBV_QPT_RC and isinstance(init_attr.send_cq, CQ)
            self.pd, self.scq, self.cap = creator, init_attr.send_cq, init_attr.cap
            self.qp_num = random.randrange(1, 1 << 24)
            while self.qp_num in fabric.qps:
                self.qp_num = random.randrange(1, 1 << 24)
            self.qp_state = E.IBV_QPS_RESET
            self.attr: QPAttr | None = None
            self.outstanding = 0
            self.pending: list[int] = []  # lkeys of work the adapter has not executed yet
            self.is_open = True
            creator.children.add(self)
            fabric.qps[self.qp_num] = self
            fabric.live.add(self)
            fabric.qps_created += 1
            if qp_attr is not None:
                self.to_init(qp_attr)

        def to_init(self, attr: QPAttr) -> None:
            if attr.port_num != 1:
                raise FakePyverbsError("Failed to modify QP state to init")
            self.qp_access = attr.qp_access_flags
            self.qp_state = E.IBV_QPS_INIT

        def to_rtr(self, attr: QPAttr) -> None:
            if self.qp_state != E.IBV_QPS_INIT:
                self.to_init(attr)
            ah = attr.ah_attr
            ok = (
                isinstance(ah, AHAttr)
                and ah.port_num == 1
                and 1 <= attr.path_mtu <= 5
                and attr.dest_qp_num > 0
                and attr.max_dest_rd_atomic >= 1
                and (
                    fabric.valid_gid(ah.gr.dgid) and fabric.gids[ah.gr.sgid_index][0] != ZERO_GID
                    if ah.is_global
                    else ah.dlid == fabric.lid and fabric.link_layer == E.IBV_LINK_LAYER_INFINIBAND
                )
            )
            if not ok:
                raise FakePyverbsError("Failed to modify QP state to RTR")
            self.attr, self.qp_state = attr, E.IBV_QPS_RTR
            self.dest, self.rq_psn = attr.dest_qp_num, attr.rq_psn

        def to_rts(self, attr: QPAttr) -> None:
            if self.qp_state != E.IBV_QPS_RTR:
                self.to_rtr(attr)
            if not (attr.timeout and attr.retry_cnt and attr.max_rd_atomic >= 1):
                raise FakePyverbsError("Failed to modify QP state to RTS")
            self.sq_psn, self.qp_state = attr.sq_psn, E.IBV_QPS_RTS

        def post_send(self, wr: SendWR, bad_wr: Any = None) -> None:
            if not self.is_open or self.qp_state not in (E.IBV_QPS_RTS, E.IBV_QPS_ERR):
                raise FakePyverbsError("Failed to post send (EINVAL: the queue pair is not ready to send)")
            if self.outstanding >= self.cap.max_send_wr:
                raise FakePyverbsError("Failed to post send (ENOMEM: the send queue is full)")
            if (
                wr.num_sge != 1
                or len(wr.sg) != 1
                or wr.opcode not in (E.IBV_WR_RDMA_WRITE, E.IBV_WR_RDMA_READ)
            ):
                raise FakePyverbsError("Failed to post send (EINVAL: bad work request)")
            self.outstanding += 1
            if fabric.hang:
                self.pending.append(wr.sg[0].lkey)  # accepted, never executed nor completed
                return
            status = self._execute(wr)
            if status != E.IBV_WC_SUCCESS:
                self.qp_state = E.IBV_QPS_ERR
            read = wr.opcode == E.IBV_WR_RDMA_READ
            opcode = ENUMS["IBV_WC_RDMA_READ"] if read else ENUMS["IBV_WC_RDMA_WRITE"]
            self.scq.push(WC(wr.wr_id, status, opcode, wr.sg[0].length))

        def _execute(self, wr: SendWR) -> int:
            if self.qp_state == E.IBV_QPS_ERR:
                return E.IBV_WC_WR_FLUSH_ERR
            if fabric.fail_status is not None and fabric._executed_ok >= fabric.fail_after:
                return fabric.fail_status
            sge, read = wr.sg[0], wr.opcode == E.IBV_WR_RDMA_READ
            if sge.length > fabric.max_msg_sz:
                return E.IBV_WC_LOC_LEN_ERR
            local = fabric.mrs.get(sge.lkey)
            if (
                local is None
                or local.lkey != sge.lkey
                or local.pd is not self.pd
                or not local.contains(sge.addr, sge.length)
                or (read and not local.access & E.IBV_ACCESS_LOCAL_WRITE)
            ):
                return E.IBV_WC_LOC_PROT_ERR
            peer = fabric.qps.get(self.dest)
            if (
                peer is None
                or not peer.is_open
                or peer.qp_state not in (E.IBV_QPS_RTR, E.IBV_QPS_RTS)
                or peer.dest != self.qp_num
                or peer.rq_psn != self.sq_psn
                or (peer.qp_state == E.IBV_QPS_RTS and self.rq_psn != peer.sq_psn)
            ):
                return E.IBV_WC_RETRY_EXC_ERR  # nobody answers: transport retries exhausted
            need = E.IBV_ACCESS_REMOTE_READ if read else E.IBV_ACCESS_REMOTE_WRITE
            remote = fabric.mrs.get(wr.rkey)
            if (
                remote is None
                or remote.rkey != wr.rkey
                or remote.pd is not peer.pd
                or not remote.access & need
                or not peer.qp_access & need
                or not remote.contains(wr.remote_addr, sge.length)
            ):
                return E.IBV_WC_REM_ACCESS_ERR
            src, dst = (wr.remote_addr, sge.addr) if read else (sge.addr, wr.remote_addr)
            ctypes.memmove(dst, src, sge.length)
            fabric.ops.append(("RDMA_READ" if read else "RDMA_WRITE", sge.length))
            fabric._executed_ok += 1
            return E.IBV_WC_SUCCESS

        def close(self) -> None:
            if self.is_open:
                self.is_open = False
                self.outstanding, self.pending = 0, []  # destroying a queue pair discards its work
                self.pd.children.discard(self)
                fabric.qps.pop(self.qp_num, None)
                fabric.live.discard(self)

    class MR:
        def __init__(
            self, pd: PD, length: int = 0, access: int = 0, address: int | None = None, implicit: bool = False
        ) -> None:
            assert isinstance(pd, PD) and pd.is_open
            if not address:
                raise FakePyverbsError("the code under test must register its own mappings (address=)")
            remote = access & (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ)
            if access & E.IBV_ACCESS_REMOTE_WRITE and not access & E.IBV_ACCESS_LOCAL_WRITE:
                raise FakePyverbsError("Failed to register a MR (EINVAL: REMOTE_WRITE needs LOCAL_WRITE)")
            if remote and fabric.fail_register:
                raise FakePyverbsError(f"Failed to register a MR. length: {length} (ENOMEM: locked memory)")
            self.pd, self.buf, self.length, self.access = pd, address, length, access
            self.lkey, self.rkey = fabric.new_key(), fabric.new_key()
            self.is_open = True
            pd.children.add(self)
            fabric.mrs[self.lkey] = fabric.mrs[self.rkey] = self
            fabric.live.add(self)
            fabric.registrations.append({"length": length, "access": access, "pd": pd})

        def contains(self, addr: int, length: int) -> bool:
            return self.buf <= addr and addr + length <= self.buf + self.length

        def close(self) -> None:
            if self.is_open:
                busy = [q for q in self.pd.children if isinstance(q, QP) and self.lkey in q.pending]
                if busy:
                    fabric.bugs.append("memory region deregistered while a queue pair still had work on it")
                self.is_open = False
                self.pd.children.discard(self)
                fabric.mrs.pop(self.lkey, None)
                fabric.mrs.pop(self.rkey, None)
                fabric.live.discard(self)

    class SGE:
        def __init__(self, addr: int, length: int, lkey: int) -> None:
            self.addr, self.length, self.lkey = addr, length, lkey

    class SendWR:
        def __init__(
            self, wr_id: int = 0, opcode: int = 0, num_sge: int = 0, imm_data: int = 0, sg: Any = None,
            send_flags: int = E.IBV_SEND_SIGNALED, next_wr: Any = None,
        ) -> None:  # fmt: skip
            if num_sge < 1 or sg is None:
                raise FakePyverbsError("A WR needs at least one SGE")
            self.wr_id, self.opcode, self.num_sge, self.sg = wr_id, opcode, num_sge, list(sg)
            self.send_flags, self.rkey, self.remote_addr = send_flags, None, None

        def set_wr_rdma(self, rkey: int, addr: int) -> None:
            self.rkey, self.remote_addr = rkey, addr

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    pkg = module("pyverbs")
    pkg.__path__ = []  # a package, so submodule imports resolve through sys.modules
    mods = {
        "pyverbs": pkg,
        "pyverbs.device": module(
            "pyverbs.device",
            get_device_list=lambda: [Device(n) for n in fabric.devices],
            Context=Context,
        ),
        "pyverbs.pd": module("pyverbs.pd", PD=PD),
        "pyverbs.cq": module("pyverbs.cq", CQ=CQ, WC=WC),
        "pyverbs.qp": module("pyverbs.qp", QPCap=QPCap, QPInitAttr=QPInitAttr, QPAttr=QPAttr, QP=QP),
        "pyverbs.mr": module("pyverbs.mr", MR=MR),
        "pyverbs.wr": module("pyverbs.wr", SGE=SGE, SendWR=SendWR),
        "pyverbs.addr": module("pyverbs.addr", GID=GID, GlobalRoute=GlobalRoute, AHAttr=AHAttr),
        "pyverbs.enums": module("pyverbs.enums", **ENUMS),
    }
    for name, m in mods.items():
        if name != "pyverbs":
            setattr(pkg, name.split(".")[1], m)
    fabric.classes = types.SimpleNamespace(QP=QP, MR=MR, CQ=CQ, PD=PD, Context=Context)
    return mods


def install(monkeypatch: pytest.MonkeyPatch, fabric: Fabric) -> Fabric:
    """Put the fake pyverbs for ``fabric`` in ``sys.modules`` for the rest of the test."""
    for name, m in build_modules(fabric).items():
        monkeypatch.setitem(sys.modules, name, m)
    return fabric
