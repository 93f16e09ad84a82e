"""The transport contract over RDMA verbs (pyverbs RC queue pairs).

Control calls and the connection bootstrap travel over the TCP transport, after its HMAC
handshake, so no rkey is handed out before the peer proved the token. Data never does: READ and
WRITE are posted as RDMA_READ / RDMA_WRITE work requests on a reliable-connected QP and the NIC
serves them without the remote CPU.

- Bootstrap: the connecting side creates a QP and sends (qpn, psn, lid, gid) in a
  ``__verbs_qp`` call; the serving side creates its QP, moves it to RTS against those values and
  answers with its own; the connecting side moves its QP to RTS.
- Regions: every region is an MR registered once, when it is allocated (a stripe, a staging
  area), never per operation. Peers resolve a region key to (rkey, addr, length) once with
  ``__verbs_region`` and cache it. Freeing a region deregisters its MR, so a stale key fails at
  the NIC (remote access error -> AccessError) instead of reading reused memory.
- Local buffers: user buffers are not registered; operations go through a pool of bounce buffers
  registered once at start (``BOUNCE_SLOTS`` x ``BOUNCE_SIZE``), in chunks, many in flight.
- Completions: one task per transport polls the CQ, yielding to trio between polls (sleep(0)
  while work is outstanding, a short sleep when idle), so it never blocks the event loop; every
  ``wc.status`` is checked; every wait is bounded by the operation timeout.

Chosen by ``select.choose`` when pyverbs imports and a device has an active port. Nothing here runs
on a machine without an RDMA device: the conformance suite runs over it wherever one exists, and
``tests/transport/test_verbs_api.py`` checks every pyverbs name used here against the real pyverbs.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import random
from functools import partial
from typing import Any

import trio

from .base import Access, BufferList, Connection, Handler, ImmHandler, Region, as_buffers, notify_by_call, page_aligned, serve_imm_call
from ..errors import AccessError, ConnectError, PeerLost, RemoteError, TimeoutError
from .probes import StatusBoard
from .tcp import TcpConnection, TcpTransport

log = logging.getLogger(__name__)

BOUNCE_SIZE = 4 << 20
BOUNCE_SLOTS = 16
MAX_SEND_WR = 256
PORT = 1
GID_INDEX = 0


def first_active_device() -> str | None:
    """Name of the first RDMA device with an active port, or None."""
    import pyverbs.device as d
    import pyverbs.enums as e

    for dev in d.get_device_list():
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        try:
            with d.Context(name=name) as ctx:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    if ctx.query_port(port).state == e.IBV_PORT_ACTIVE:
                        return name
        except Exception:  # a device we cannot open is not usable
            continue
    return None


def unusable_reason() -> str | None:
    """Why verbs cannot run here (None when it can)."""
    try:
        import pyverbs.device  # noqa: F401
    except ImportError as exc:
        return f"pyverbs does not import ({exc})"
    try:
        if first_active_device() is None:
            return "no RDMA device with an active port"
    except Exception as exc:
        return f"cannot list RDMA devices ({exc})"
    return None


def _view(address: int, length: int) -> memoryview:
    """A writable memoryview over registered memory (an MR's buffer)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class _Device:
    """Context, protection domain, completion queue and port facts, opened once."""

    def __init__(self, name: str):
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.e = e
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 4 * MAX_SEND_WR, None, None, 0)
        self.port_attr = self.ctx.query_port(PORT)
        self.gid = self.ctx.query_gid(PORT, GID_INDEX)

    def register(self, length: int, remote: int, address: int | None = None):
        """An MR of ``length`` bytes; at ``address`` (memory this process owns and keeps
        alive), or over a buffer pyverbs allocates and frees with it."""
        from pyverbs.mr import MR

        if address is None:
            return MR(self.pd, length, self.e.IBV_ACCESS_LOCAL_WRITE | remote)
        return MR(self.pd, length, self.e.IBV_ACCESS_LOCAL_WRITE | remote, address=address)

    def new_qp(self):
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = self.e
        cap = QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1)
        attr = QPAttr(port_num=PORT)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return QP(self.pd, init, attr)  # with an attr, pyverbs moves it to INIT

    def local_endpoint(self, qp, psn: int) -> dict:
        return {"qpn": qp.qp_num, "psn": psn, "lid": self.port_attr.lid, "gid": self.gid.gid}

    def connect_qp(self, qp, psn: int, remote: dict) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=PORT)
        attr.path_mtu = self.port_attr.active_mtu
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=GID(val=remote["gid"]), sgid_index=GID_INDEX)
        attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, dlid=remote["lid"])
        attr.dest_qp_num = remote["qpn"]
        attr.rq_psn = remote["psn"]
        attr.sq_psn = psn
        qp.to_rts(attr)


class _Completions:
    """wr_id -> waiter; one poller task reaps the shared CQ."""

    def __init__(self, device: _Device):
        self.device = device
        self.waiting: dict[int, list] = {}
        self.ids = itertools.count(1)
        self.running = False

    def expect(self) -> tuple[int, list]:
        wr_id = next(self.ids)
        slot = [trio.Event(), None]
        self.waiting[wr_id] = slot
        return wr_id, slot

    async def poll_forever(self) -> None:
        self.running = True
        try:
            while True:
                n, wcs = self.device.cq.poll(num_entries=32)
                for wc in wcs[:n]:
                    slot = self.waiting.pop(wc.wr_id, None)
                    if slot is not None:
                        slot[1] = wc.status
                        slot[0].set()
                # Yield every round; sleep briefly only when nothing is outstanding.
                await trio.sleep(0 if self.waiting else 0.0005)
        finally:
            self.running = False


class _BouncePool:
    """Registered local buffers for the data path; one per operation chunk in flight."""

    def __init__(self, device: _Device):
        e = device.e
        self.mrs = [device.register(BOUNCE_SIZE, e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE) for _ in range(BOUNCE_SLOTS)]
        self.free = list(range(BOUNCE_SLOTS))
        self.sem = trio.Semaphore(BOUNCE_SLOTS)

    async def take(self):
        await self.sem.acquire()
        return self.mrs[self.free.pop()]

    def give(self, mr) -> None:
        self.free.append(self.mrs.index(mr))
        self.sem.release()


class VerbsConnection(Connection):
    def __init__(self, transport: "VerbsTransport", control: TcpConnection, qp, op_timeout: float):
        self.transport = transport
        self.control = control
        self.qp = qp
        self.peer = control.peer
        self.incarnation = control.incarnation
        self.op_timeout = op_timeout
        self._regions: dict[int, tuple[int, int, int, int]] = {}
        self._broken: str | None = None

    async def _remote(self, key: int, offset: int, length: int, access: Access) -> tuple[int, int]:
        """(rkey, address) of [offset, offset+length) in the peer's region ``key``; checked here
        first so a bad request fails fast, and again by the peer's NIC."""
        if key not in self._regions:
            try:
                d = await self.control.call("__verbs_region", {"key": key})
            except RemoteError as exc:
                raise AccessError(exc.message) from None
            self._regions[key] = (d["rkey"], d["addr"], d["length"], d["access"])
        rkey, addr, size, allowed = self._regions[key]
        if not allowed & access:
            raise AccessError(f"region {key} does not allow {access.name}")
        if offset < 0 or length < 0 or offset + length > size:
            raise AccessError(f"range {offset}+{length} outside region {key} of {size} bytes")
        return rkey, addr + offset

    async def _post(self, opcode: int, mr, length: int, rkey: int, raddr: int) -> None:
        from pyverbs.wr import SGE, SendWR

        e = self.transport.device.e
        if self._broken:
            raise PeerLost(f"{self.peer}: {self._broken}")
        wr_id, slot = self.transport.completions.expect()
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(mr.buf, length, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, raddr)
        self.qp.post_send(wr)
        try:
            with trio.fail_after(self.op_timeout):
                await slot[0].wait()
        except trio.TooSlowError:
            self.transport.completions.waiting.pop(wr_id, None)
            raise TimeoutError(f"{self.peer}: RDMA operation not completed in {self.op_timeout}s") from None
        status = slot[1]
        if status == e.IBV_WC_SUCCESS:
            return
        if status in (e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_LOC_PROT_ERR):
            self._regions.clear()  # the peer freed or replaced a region
            raise AccessError(f"{self.peer}: remote access error (status {status})")
        self._broken = f"work completion status {status}"  # the QP is in the error state now
        raise PeerLost(f"{self.peer}: {self._broken}")

    async def _chunks(self, key: int, offset: int, bufs: list[memoryview], access: Access, opcode: int) -> None:
        total = sum(map(len, bufs))
        rkey, raddr = await self._remote(key, offset, total, access)
        flat = _Concat(bufs)

        async def one(pos: int, n: int) -> None:
            mr = await self.transport.bounce.take()
            try:
                local = _view(mr.buf, n)
                if opcode == self.transport.device.e.IBV_WR_RDMA_WRITE:
                    flat.copy_out(pos, local)
                await self._post(opcode, mr, n, rkey, raddr + pos)
                if opcode == self.transport.device.e.IBV_WR_RDMA_READ:
                    flat.copy_in(pos, local)
            finally:
                self.transport.bounce.give(mr)

        async with trio.open_nursery() as nursery:
            for pos in range(0, total, BOUNCE_SIZE):
                nursery.start_soon(one, pos, min(BOUNCE_SIZE, total - pos))

    async def read(self, rkey: int, offset: int, into: BufferList) -> None:
        await self._chunks(rkey, offset, as_buffers(into), Access.READ, self.transport.device.e.IBV_WR_RDMA_READ)

    async def read_many(self, ops) -> None:
        # An RC responder executes READs in the order they were posted; awaiting them in turn
        # keeps the version-word reads around the data read.
        for rkey, offset, into in ops:
            await self.read(rkey, offset, into)

    async def write(self, rkey: int, offset: int, data: BufferList) -> None:
        await self._chunks(rkey, offset, as_buffers(data), Access.WRITE, self.transport.device.e.IBV_WR_RDMA_WRITE)

    async def write_imm(self, rkey: int, offset: int, data: BufferList, imm: int) -> dict:
        # The data moves as RDMA WRITEs; the notification follows on the control connection
        # (ordered after the WRITE completions).
        await self.write(rkey, offset, data)
        return await notify_by_call(self.control, rkey, offset, data, imm)

    async def call(self, method: str, args: dict[str, Any] | None = None, *, timeout: float | None = None, probe: bool = False) -> dict:
        return await self.control.call(method, args, timeout=timeout, probe=probe)

    def waits(self) -> str:
        return self.control.waits()  # its calls (a heartbeat) go over the TCP control connection

    async def aclose(self) -> None:
        self.qp.close()
        await self.control.aclose()


class _Concat:
    """Copy between a scatter-gather list and one contiguous chunk at a flat position."""

    def __init__(self, bufs: list[memoryview]):
        self.bufs = bufs

    def _spans(self, pos: int, n: int):
        start = 0
        for b in self.bufs:
            end = start + len(b)
            lo, hi = max(pos, start), min(pos + n, end)
            if lo < hi:
                yield b[lo - start : hi - start], lo - pos
            start = end

    def copy_out(self, pos: int, chunk: memoryview) -> None:
        for part, at in self._spans(pos, len(chunk)):
            chunk[at : at + len(part)] = part

    def copy_in(self, pos: int, chunk: memoryview) -> None:
        for part, at in self._spans(pos, len(chunk)):
            part[:] = chunk[at : at + len(part)]


class VerbsTransport(TcpTransport):
    name = "verbs"

    def __init__(self, token: bytes, *, op_timeout: float = 30.0, device: str | None = None):
        # its control connections stay on the Python data plane: the NIC moves its bytes, and
        # memory registered with it is not the engine's to serve
        super().__init__(token, op_timeout=op_timeout, engine="python")
        name = device or first_active_device()
        if name is None:
            raise ConnectError("no RDMA device with an active port")
        self.device = _Device(name)
        self.completions = _Completions(self.device)
        self.bounce = _BouncePool(self.device)
        self._mrs: dict[int, Any] = {}
        self._qps: list = []

    # -- regions -------------------------------------------------------------------------------
    def alloc_region(self, nbytes: int, access: Access) -> Region:
        """Memory this process owns (an anonymous mapping, page-aligned), registered: the
        memory outlives the MR while an alias (``alias_region``) still uses it."""
        buf = page_aligned(max(nbytes, 1))
        return self._register(buf[:nbytes], access)

    def alias_region(self, region: Region) -> Region:
        """A second MR over the same memory (RDMA allows several registrations of one range):
        its own rkey, deregistered on its own."""
        return self._register(region.buf, region.access)

    def _register(self, buf: memoryview, access: Access) -> Region:
        e = self.device.e
        remote = (e.IBV_ACCESS_REMOTE_READ if access & Access.READ else 0) | (e.IBV_ACCESS_REMOTE_WRITE if access & Access.WRITE else 0)
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        mr = self.device.register(max(len(buf), 1), remote, address)
        region = self.regions.add(buf, access)
        self._mrs[region.rkey] = mr
        return region

    def free_region(self, region: Region) -> bool:
        super().free_region(region)
        mr = self._mrs.pop(region.rkey, None)
        if mr is not None:
            mr.close()  # deregistered: the NIC refuses the key from here on
        return True

    # -- serving side ------------------------------------------------------------------------
    async def serve(
        self, host: str, port: int, handler: Handler, *, on_imm: ImmHandler | None = None, board: StatusBoard | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def verbs_handler(method: str, args: dict) -> dict:
            if method == "__imm":
                return await serve_imm_call(self.regions, on_imm, args)
            if method == "__verbs_qp":
                qp = self.device.new_qp()
                psn = random.getrandbits(24)
                self.device.connect_qp(qp, psn, args)
                self._qps.append(qp)
                return self.device.local_endpoint(qp, psn)
            if method == "__verbs_region":
                mr = self._mrs.get(args["key"])
                region = self.regions.get(args["key"])
                if mr is None or region is None:
                    raise RemoteError("EINVAL", f"unknown region {args['key']}")
                return {"rkey": mr.rkey, "addr": mr.buf, "length": region.length, "access": int(region.access)}
            return await handler(method, args)

        async with trio.open_nursery() as nursery:
            if not self.completions.running:
                nursery.start_soon(self.completions.poll_forever)
            address = await nursery.start(partial(super().serve, host, port, verbs_handler, board=board))
            task_status.started(address)

    # -- calling side ------------------------------------------------------------------------
    async def connect(self, host: str, port: int, *, nursery: trio.Nursery) -> VerbsConnection:
        control = await super().connect(host, port, nursery=nursery)
        if not self.completions.running:
            nursery.start_soon(self.completions.poll_forever)
        qp = self.device.new_qp()
        psn = random.getrandbits(24)
        try:
            remote = await control.call("__verbs_qp", self.device.local_endpoint(qp, psn))
            self.device.connect_qp(qp, psn, remote)
        except Exception as exc:
            qp.close()
            await control.aclose()
            raise ConnectError(f"{host}:{port}: RDMA connection setup failed: {exc}") from None
        return VerbsConnection(self, control, qp, self.op_timeout)
