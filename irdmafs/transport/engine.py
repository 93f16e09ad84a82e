"""The native data-plane engine's Python side: loading it, its event pump, its connections.

``irdmafs._engine`` (native/engine/) serves and lands the socket transports' one-sided
operations in a native I/O thread with the GIL released; docs/engine.md gives its design and
invariants. This module owns the Python half of that contract:

- **Loading.** ``AVAILABLE`` and ``WHY`` say whether the engine runs and why not (not built,
  failed to load, or ``IRDMAFS_ENGINE=0``); a transport built without it runs the Python data
  plane (tcp.py), which is also the reference the engine is tested against, and says so in the
  log and in its status (``Transport.engine``).
- **The pump** (``Engine.pump``): one trio task per process waits on the engine's eventfd and
  takes every event since the last wake-up at once: a request for Python (a control call, a
  WRITE_IMM's notification) is started as a task of its serving connection; a calling-side
  completion wakes its waiter; a closed connection fails what waited on it. Never one wake-up
  per payload. It runs in the nursery of the first ``serve`` or ``connect`` (a node's serving
  nursery, a mount's or Client's peers): if that nursery ends first, what still waits fails as
  lost and the next ``serve`` or ``connect`` starts the pump again.
- **Calling-side connections** (``NativeConnection``): the contract's ``Connection`` whose
  frames the engine sends and whose answers it lands straight into the caller's buffers. A
  caller that gives up (cancelled, or no answer within ``op_timeout``) asks the engine to
  abandon its request; while the engine may still touch its buffers (an answer arriving into
  them, a payload still leaving from them) it waits for the completion, shielded, and past
  ``op_timeout`` of silence closes the connection, whose completions then come at once. So a
  caller's buffers are never written after its call returned.

Timeouts stay here, on trio's clock; the engine has none.

Concurrency: one trio thread per process; the engine's own thread never runs Python.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Callable

import trio

from . import protocol as P
from .base import BufferList, Connection, as_buffers
from ..errors import PeerLost, ProtocolError, TimeoutError, TransportError
from .window import Window

log = logging.getLogger(__name__)

try:
    if os.environ.get("IRDMAFS_ENGINE", "1") == "0":
        raise ImportError("IRDMAFS_ENGINE=0")
    from .. import _engine
except ImportError as exc:  # not built (no C compiler at install time), failed to load, or turned off
    _engine = None
    WHY = str(exc)
else:
    WHY = "built"

AVAILABLE = _engine is not None

EV_CALL, EV_DONE, EV_CLOSED, EV_RELEASED, EV_LOG, EV_PROBED = 1, 2, 3, 4, 5, 6
LOST = -1  # a completion's status: the connection broke before its answer

READ_WINDOW = 8 << 20  # as tcp.py's: READ answers on their way at once, per connection
READ_COST = READ_WINDOW // 256
BULK = 64 << 10  # a WRITE of this many bytes or more goes on the connection's bulk socket


def describe() -> dict:
    """What runs the data plane of this process's socket transports, and why."""
    return {"name": "native" if AVAILABLE else "python", "why": WHY}


class _Waiter:
    __slots__ = ("event", "status", "payload", "held")

    def __init__(self, held: int = 0) -> None:
        self.event = trio.Event()
        self.status = LOST
        self.payload: bytes | None = None
        self.held = held  # read-window bytes it holds until answered


class Served:
    """What a serving connection's requests go to: ``on_request(opcode, header, document)`` is
    started as a task in ``nursery``; ``on_probed(document)``, if given, hears a probe the
    engine answered itself (probes.py); ``closed`` is set with ``why`` when the engine closed it."""

    def __init__(self, on_request: Callable[..., Any], nursery: trio.Nursery, peer: str = "", on_probed: Callable[[bytes], None] | None = None) -> None:
        self.on_request, self.nursery, self.peer, self.on_probed = on_request, nursery, peer, on_probed
        self.closed = trio.Event()
        self.why = ""


class Engine:
    """One per process: the native engine, its pump and its connections' bookkeeping."""

    def __init__(self) -> None:
        if _engine is None:
            raise RuntimeError(f"the data-plane engine is not available: {WHY}")
        self.native = _engine.Engine()
        self.served: dict[int, Served] = {}
        self.waiters: dict[tuple[int, int], _Waiter] = {}
        self.callers: dict[int, "NativeConnection"] = {}
        self.draining: set[int] = set()  # freed rkeys whose memory operations in flight still hold
        self._pumping = False
        self.wakeups = 0  # pump wake-ups, and the events they brought (the batching, in tests)
        self.events = 0

    def ensure_pump(self, nursery: trio.Nursery) -> None:
        """The pump runs in ``nursery`` unless it runs already (started by the first user)."""
        if not self._pumping:
            self._pumping = True
            nursery.start_soon(self.pump)

    async def pump(self) -> None:
        fd = self.native.fileno()
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                events = self.native.poll()
                self.wakeups += 1
                self.events += len(events)
                for ev in events:
                    self._dispatch(ev)
        finally:
            self._pumping = False
            for waiter in self.waiters.values():  # nobody would ever wake them
                waiter.event.set()

    def _dispatch(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == EV_DONE:
            _, conn, req_id, status, payload = ev
            waiter = self.waiters.pop((conn, req_id), None)
            if waiter is not None:
                waiter.status, waiter.payload = status, payload
                caller = self.callers.get(conn)
                if caller is not None and waiter.held:
                    caller.window.give(waiter.held)
                    waiter.held = 0
                waiter.event.set()
        elif kind == EV_CALL:
            _, conn, opcode, req_id, rkey, imm, offset, length, doc = ev
            served = self.served.get(conn)
            if served is not None:
                h = P.Header(opcode, req_id, rkey, offset, length, P.Status.OK, imm)
                served.nursery.start_soon(served.on_request, conn, h, doc)
        elif kind == EV_CLOSED:
            _, conn, why = ev
            served = self.served.pop(conn, None)
            if served is not None:
                served.why = why
                served.closed.set()
            caller = self.callers.pop(conn, None)
            if caller is not None:
                caller.closed(conn, why)
        elif kind == EV_RELEASED:
            self.draining.discard(ev[1])
        elif kind == EV_PROBED:  # a probe the engine answered from the status board (probes.py)
            _, conn, doc = ev
            served = self.served.get(conn)
            if served is not None and served.on_probed is not None:
                served.on_probed(doc)
        elif kind == EV_LOG:  # as tcp.py's responder logs a refused request
            _, conn, line = ev
            served = self.served.get(conn)
            log.info("%s: %s", served.peer if served is not None else f"connection {conn}", line)

    # -- serving side --------------------------------------------------------------------------
    def serve(self, fd: int, served: Served, notify: bool) -> int:
        conn = self.native.adopt(fd, True, notify)
        self.served[conn] = served
        return conn

    def answer(self, conn: int, h: P.Header, payload: list, status: int = P.Status.OK) -> None:
        """A request's answer, queued on its connection (nothing if it closed meanwhile)."""
        body = b"".join(bytes(p) for p in payload)
        resp = h._replace(opcode=h.opcode | P.RESPONSE, status=status, length=len(body))
        try:
            self.native.send(conn, P.pack(resp) + body)
        except _engine.EngineError:
            pass  # the peer left before its answer: that ends nothing but the answer

    # -- regions ---------------------------------------------------------------------------------
    def publish(self, status: bytes, valid_for: float) -> None:
        """What probes get for the next ``valid_for`` seconds (probes.py, ``StatusBoard.attach``);
        nothing once the engine stopped (it answers nothing then)."""
        try:
            self.native.publish_status(status, min(valid_for, 3599.0))  # the engine takes under an hour
        except _engine.EngineError:
            pass

    def add_region(self, rkey: int, gen: int, buf: memoryview, access: int) -> None:
        self.native.add_region(rkey, gen, buf, int(access))

    def free_region(self, rkey: int) -> bool:
        """Unlink ``rkey``; True if its memory was let go now, False if operations in flight
        hold it (``settled`` turns True when the engine says the last one ended)."""
        try:
            now = self.native.free_region(rkey)
        except KeyError:
            return True
        if not now:
            self.draining.add(rkey)
        return now

    def settled(self, rkey: int) -> bool:
        return rkey not in self.draining

    def stats(self) -> dict:
        return self.native.stats()


class NativeConnection(Connection):
    """The contract's Connection over three sockets handed to the engine: READs and small
    WRITEs on ``data``, large WRITEs on ``bulk``, control calls on ``calls`` (tcp.py says why
    three). The read window bounds READ answers on their way as tcp.py's does."""

    def __init__(self, engine: Engine, peer: str, op_timeout: float, data: int, bulk: int, calls: int) -> None:
        self.engine, self.peer, self.op_timeout = engine, peer, op_timeout
        self.data, self.bulk, self.calls = data, bulk, calls
        self.window = Window(READ_WINDOW)
        self._ids = itertools.count(1)
        self._broken: TransportError | None = None
        self._open = {data, bulk, calls}
        for conn in self._open:
            engine.callers[conn] = self

    @property
    def lost(self) -> TransportError | None:
        return self._broken

    def closed(self, conn: int, why: str) -> None:
        """The engine closed one of the sockets: the connection is broken, the others close."""
        self._open.discard(conn)
        if self._broken is None:
            if why.startswith("protocol error"):
                log.warning("%s: %s; closing the connection", self.peer, why)
                self._broken = ProtocolError(f"{self.peer}: {why}")
            else:
                self._broken = PeerLost(f"{self.peer}: {why}")
        self.window.close(PeerLost(f"{self.peer}: {self._broken}"))
        for other in self._open:
            self.engine.native.close(other)

    # -- requests --------------------------------------------------------------------------------
    def _post(self, conn: int, opcode: int, rkey: int, offset: int, imm: int, bufs: list, held: int = 0) -> tuple[int, int, _Waiter]:
        if self._broken is not None:
            self.window.give(held)
            raise PeerLost(f"{self.peer}: {self._broken}")
        req_id = next(self._ids)
        waiter = _Waiter(held)
        try:
            self.engine.native.submit(conn, req_id, opcode, rkey, offset, imm, bufs)
        except _engine.EngineError as exc:
            self.window.give(held)
            raise PeerLost(f"{self.peer}: {self._broken or exc}") from None
        self.engine.waiters[(conn, req_id)] = waiter
        return conn, req_id, waiter

    async def _wait(self, posted: list[tuple[int, int, _Waiter]], timeout: float | None = None) -> list[_Waiter]:
        """Each answer in turn, each within ``timeout`` of the one before (a deadline on
        silence, as tcp.py's); then the first failure raised."""
        timeout = self.op_timeout if timeout is None else timeout
        try:
            for _, _, waiter in posted:
                with trio.fail_after(timeout):
                    await waiter.event.wait()
        except BaseException as exc:
            await self._abandon(posted)
            if isinstance(exc, trio.TooSlowError):
                raise TimeoutError(f"{self.peer}: no answer within {timeout}s") from None
            raise
        for _, _, waiter in posted:
            error = self._error(waiter)
            if error is not None:
                raise error
        return [w for _, _, w in posted]

    def _error(self, waiter: _Waiter) -> TransportError | None:
        if waiter.status == P.Status.OK:
            return None
        if waiter.status == LOST:
            return PeerLost(f"{self.peer}: {self._broken or 'connection lost'}")
        return P.status_error(waiter.status, waiter.payload or b"")

    async def _abandon(self, posted: list[tuple[int, int, _Waiter]]) -> None:
        """Give these requests up. Where the engine may still touch a caller's buffers (an
        answer arriving into them, a payload leaving from them) wait for its completion,
        shielded; a connection silent for op_timeout is closed, which completes them."""
        native = self.engine.native
        for conn, req_id, waiter in posted:
            if waiter.event.is_set():
                continue
            state = native.cancel(conn, req_id)
            if state == 1:  # never touched again: forget it (the engine drains its answer)
                self.engine.waiters.pop((conn, req_id), None)
                self.window.give(waiter.held)
                waiter.held = 0
                continue
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.op_timeout):
                    await waiter.event.wait()
                if not waiter.event.is_set():
                    log.warning("%s: an abandoned request's bytes still moving after %ss; closing the connection", self.peer, self.op_timeout)
                    native.close(conn)
                    await waiter.event.wait()  # the close completes it at once

    # -- the interface -----------------------------------------------------------------------------
    async def read(self, rkey: int, offset: int, into: BufferList) -> None:
        await self.read_many([(rkey, offset, into)])

    async def read_many(self, ops) -> None:
        posted: list[tuple[int, int, _Waiter]] = []
        try:
            for rkey, offset, into in ops:
                bufs = as_buffers(into)
                cost = max(sum(map(len, bufs)), READ_COST)
                if not self.window.try_take(cost):
                    await self.window.take(cost, self.op_timeout)
                posted.append(self._post(self.data, P.Op.READ, rkey, offset, 0, bufs, cost))
        except BaseException as exc:
            await self._abandon(posted)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"{self.peer}: {exc}") from None
            raise
        await self._wait(posted)

    async def write(self, rkey: int, offset: int, data: BufferList) -> None:
        bufs = as_buffers(data)
        lane = self.bulk if sum(map(len, bufs)) >= BULK else self.data
        await self._wait([self._post(lane, P.Op.WRITE, rkey, offset, 0, bufs)])

    async def write_imm(self, rkey: int, offset: int, data: BufferList, imm: int) -> dict:
        bufs = as_buffers(data)
        lane = self.bulk if sum(map(len, bufs)) >= BULK else self.data
        [w] = await self._wait([self._post(lane, P.Op.WRITE_IMM, rkey, offset, imm, bufs)])
        return P.decode_result(w.payload or b"")

    async def call(self, method: str, args: dict[str, Any] | None = None, *, timeout: float | None = None, probe: bool = False) -> dict:
        doc = P.encode_call(method, args or {})
        [w] = await self._wait([self._post(self.calls, P.Op.CALL, 0, 0, P.CALL_PROBE if probe else 0, [doc])], timeout)
        return P.decode_result(w.payload or b"")

    def waits(self) -> str:
        """As tcp.py's: requests unanswered, and for each socket what waits to be sent and how
        long since an answer last began to arrive on it."""
        mine = sum(1 for conn, _ in self.engine.waiters if conn in (self.data, self.bulk, self.calls))
        parts = [f"{mine} requests unanswered"]
        for name, conn in (("calls", self.calls), ("data", self.data), ("bulk", self.bulk)):
            info = self.engine.native.conn_info(conn)
            if info is None:
                parts.append(f"{name}: closed")
                continue
            frames, nbytes, _, ago = info
            heard = "never" if ago < 0 else f"{ago:.2f} s ago"
            parts.append(f"{name}: {frames} frames ({nbytes} bytes) queued to send, last answer {heard}")
        return "; ".join(parts) + " (native engine)"

    async def aclose(self) -> None:
        if self._broken is None:
            self._broken = PeerLost("connection closed")
        for conn in list(self._open):
            self.engine.native.close(conn)
        await trio.lowlevel.checkpoint()
