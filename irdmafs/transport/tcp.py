"""The transport contract over TCP, with trio.

Serving side: one responder task per accepted connection serves READ and WRITE straight from the
registered regions (``sendmsg`` of the header plus a memoryview of the region; ``recv_into`` the
region for a WRITE), so no request copies data into Python ``bytes``. Control calls are started as
tasks of their own so a long call (a pull that waits for its clock) never delays data operations
behind it; every answer leaves through the connection's one writer (sender.py).

Calling side: a connection is three sockets, each authenticated to the same serving process:
WRITEs of BULK bytes or more go on one, control calls on another, READs and small WRITEs on the
third, so a read or a call never queues behind megabytes of pushes in a send lock, a kernel
buffer or a shaped link's queue (on a 500 Mbit/s link a step's pulls waited a second behind its
pushes), and a call (a heartbeat) never waits behind a burst of reads, which the node serves in
order (a 1 GiB pull held heartbeats a second and the mount counted working nodes down).
Requests from many tasks share each socket through its sender (sender.py: a heartbeat never
waits for a hundred senders' turns); one receiver task per socket
matches responses to requests by id and receives READ payloads straight into the caller's
buffers. That gives many operations in flight per peer, each socket's served in order; an
operation that must follow another (a commit after the WRITE of its data) is sent once the
first has been answered, as every caller does. READ answers on their way are bounded by a
window of bytes and count (window.py): a burst of any size goes out as earlier answers arrive,
so another read never waits behind more than the window, and every wait is bounded by silence
(op_timeout between answers), never by how much was asked.

Two data planes run this contract. Where the native engine loads (transport/engine.py,
native/engine/), each socket is handed to it once the handshake is done: its thread serves and
lands the one-sided operations, and Python sees only calls, notifications and completions
(``_Responder.serve_native``, ``engine.NativeConnection``). Otherwise, or with
``engine="python"``, this module's own tasks do it as described above: the reference the engine
is tested against. The wire is the same, so either serves the other.

Resource handling: a ``TcpConnection`` owns its three sockets, and a receiver task and a sender
for each in the nursery given to ``connect``; ``aclose()``, or any socket breaking, ends all of
them. The serving side's tasks live in ``serve``'s own nursery.

Error handling: ``OSError`` and trio's closed-resource errors (``base.SOCKET_ERRORS``) become
``ConnectError`` (before the handshake is done) or ``PeerLost`` (after), exactly once, here. A
serving connection that breaks the protocol is logged and closed; the listener and every other
connection go on.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import socket as _stdsocket
import weakref
from typing import Any

import trio

from . import engine as E
from . import protocol as P
from .base import SOCKET_ERRORS, Access, BufferList, Connection, Handler, ImmHandler, Transport, as_buffers, client_proof, new_nonce, server_proof
from ..errors import AccessError, AuthError, ConnectError, PeerLost, ProtocolError, RemoteError, TimeoutError, TransportError
from .base import NONCE as _NONCE
from .probes import StatusBoard
from .sender import Sender
from .window import Window

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
READ_WINDOW = 8 << 20  # READ answers on their way at once, per connection (window.py)
# what a READ counts in the window at least: the node serves each frame with a pass of its loop,
# so a burst of header reads (64 bytes each) is bounded by count too (256 in flight)
READ_COST = READ_WINDOW // 256
BULK = 64 << 10  # a WRITE of this many bytes or more goes on the connection's bulk socket
SOCKET_BUFFER = 4 << 20  # large kernel buffers: fewer, bigger recv_into calls per MiB
IOV_MAX = 1024
_SCRATCH = bytearray(1 << 20)  # where refused payloads are drained; never read back
LOWAT_MIN = 64 << 10  # a payload this large or more is received in wake-ups of ...
LOWAT_MAX = SOCKET_BUFFER  # ... this many bytes at least (_wake_at; the kernel caps it at half its buffer)
_LOWAT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # socket -> its SO_RCVLOWAT, where not 1


class _EOF(Exception):
    """The peer closed the connection at a frame boundary."""


def _tune(sock: trio.socket.SocketType) -> None:
    sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
    for opt in (_stdsocket.SO_SNDBUF, _stdsocket.SO_RCVBUF):
        try:
            sock.setsockopt(_stdsocket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:  # capped by net.core.*mem_max: the kernel's default still works
            pass


def _wake_at(sock: trio.socket.SocketType, left: int) -> None:
    """Have the kernel wake this socket's reader only once ``min(left, LOWAT_MAX)`` bytes wait
    (``SO_RCVLOWAT``), for a payload of ``LOWAT_MIN`` or more still to come; else at any byte.

    A payload arriving over a slow link (500 Mbit/s) otherwise wakes the loop for every few
    packets, 10-60 KB each: most of a node's and a mount's CPU on links went to those wake-ups.
    Never more than what is left of this payload, which the peer is sending (or closing: EOF
    wakes too), and the kernel caps it at half the receive buffer and wakes a reader whose
    window is full in any case, so no wait depends on bytes that may never come."""
    want = min(left, LOWAT_MAX) if left >= LOWAT_MIN else 1
    if _LOWAT.get(sock, 1) != want:
        try:
            sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_RCVLOWAT, want)
        except OSError:  # not a TCP socket (a test's socketpair): wake at any byte, as before
            want = 1
        _LOWAT[sock] = want


async def _recv_into(sock: trio.socket.SocketType, view: memoryview, *, at_boundary: bool = False) -> None:
    """Fill ``view`` completely. EOF before the first byte of a frame is ``_EOF``; anywhere else
    it is ``PeerLost`` (a truncated frame)."""
    got = 0
    total = len(view)
    while got < total:
        _wake_at(sock, total - got)
        n = await sock.recv_into(view[got:])
        if n == 0:
            if at_boundary and got == 0:
                raise _EOF
            raise PeerLost(f"connection closed mid-frame ({got} of {total} bytes)")
        got += n


async def _recv_bytes(sock: trio.socket.SocketType, n: int) -> bytearray:
    buf = bytearray(n)
    await _recv_into(sock, memoryview(buf))
    return buf


async def _drain(sock: trio.socket.SocketType, n: int) -> None:
    scratch = memoryview(_SCRATCH)
    while n:
        k = min(n, len(scratch))
        await _recv_into(sock, scratch[:k])
        n -= k


async def _sendv(sock: trio.socket.SocketType, buffers: list, sent: list[int] | None = None) -> None:
    """Send every buffer, in order, with as few syscalls as the kernel allows (scatter-gather);
    ``sent[0]`` counts the bytes gone so far (what a caller cancelled midway has put out)."""
    bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
    while bufs:
        n = await sock.sendmsg(bufs[:IOV_MAX])
        if sent is not None:
            sent[0] += n
        while n:
            first = bufs[0]
            if n >= len(first):
                n -= len(first)
                bufs.pop(0)
            else:
                bufs[0] = first[n:]
                n = 0


async def _send_all(sock: trio.socket.SocketType, buffers: list, sent: list[int] | None) -> None:
    """What a connection's sender sends with: ``_sendv`` as the module holds it (tests replace it)."""
    await _sendv(sock, buffers, sent)


_Frame = tuple[P.Header, list, "list[memoryview] | None"]  # a request: its header, payload, where its answer goes


class _Pending:
    __slots__ = ("into", "event", "error", "payload", "receiving", "held")

    def __init__(self, into: list[memoryview] | None, held: int = 0):
        self.into = into
        self.held = held  # bytes of the read window this request holds until it is answered
        self.event = trio.Event()
        self.error: TransportError | None = None
        self.payload: bytes | bytearray = b""
        self.receiving = False


class TcpConnection(Connection):
    def __init__(
        self,
        sock: trio.socket.SocketType,
        peer: str,
        op_timeout: float,
        bulk: trio.socket.SocketType | None = None,
        calls: trio.socket.SocketType | None = None,
    ):
        """``sock`` carries READs and small WRITEs, ``bulk`` large WRITEs and ``calls`` the
        control calls (``sock`` for either if None)."""
        self.sock = sock
        self.bulk = bulk if bulk is not None else sock
        self.calls = calls if calls is not None else sock
        self.peer = peer
        self.op_timeout = op_timeout
        # sender.py: one writer per socket
        self.sender = Sender(self.sock, _send_all, self._torn, op_timeout)
        self.bulk_sender = Sender(self.bulk, _send_all, self._torn, op_timeout) if bulk is not None else self.sender
        self.calls_sender = Sender(self.calls, _send_all, self._torn, op_timeout) if calls is not None else self.sender
        self._pending: dict[int, _Pending] = {}
        self.window = Window(READ_WINDOW)  # READ answers on their way (window.py)
        self._ids = itertools.count(1)
        self._broken: TransportError | None = None
        self._closed = trio.Event()
        self._heard: dict[trio.socket.SocketType, float] = {}  # a socket -> when an answer last began on it (``waits``)

    @property
    def lost(self) -> TransportError | None:
        """Why the connection broke, or None while it serves."""
        return self._broken

    # -- sending -----------------------------------------------------------------------------
    async def _submit(self, frames: list[_Frame], lane: Sender | None = None, held: list[int] | None = None) -> list[tuple[int, _Pending]]:
        """Send ``frames`` in one go; ``held``: the read window's bytes each one took (given
        back when its answer arrives or it is given up)."""
        held = held or [0] * len(frames)
        if self._broken:
            self.window.give(sum(held))
            raise PeerLost(f"{self.peer}: {self._broken}")
        pendings, wire = [], []
        for (h, payload, into), n in zip(frames, held):
            req_id = next(self._ids)
            p = _Pending(into, n)
            self._pending[req_id] = p
            pendings.append((req_id, p))
            wire.append(P.pack(h._replace(req_id=req_id)))
            wire.extend(payload)
        try:
            await (lane or self.sender).send(wire)
        except SOCKET_ERRORS as exc:
            for req_id, _ in pendings:
                self._forget(req_id)
            raise PeerLost(f"{self.peer}: {exc}") from None
        except BaseException:  # cancelled: the sender dropped the connection if it was midway
            for req_id, _ in pendings:
                self._forget(req_id)
            raise
        return pendings

    def _torn(self) -> None:
        """A frame was cut off midway (its sender cancelled) or a send failed: the peer would
        read the next frame from the middle of this one, so the connection is dropped."""
        self._fail_all(PeerLost("a send was cut off midway"))
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self.sock, self.bulk, self.calls):
            sock.close()

    def _forget(self, req_id: int) -> _Pending | None:
        """No longer wait for ``req_id``'s answer (it arrived, or it is given up): its window
        bytes are free again. The request, if it was still waited for."""
        p = self._pending.pop(req_id, None)
        if p is not None:
            self.window.give(p.held)
            p.held = 0
        return p

    async def _wait(self, pendings: list[tuple[int, _Pending]], timeout: float | None) -> list[_Pending]:
        """Each answer in turn, each within ``timeout`` of the one before (answers of a socket
        come in order: a deadline on silence, not on how many were asked)."""
        timeout = self.op_timeout if timeout is None else timeout
        try:
            for _, p in pendings:
                with trio.fail_after(timeout):
                    await p.event.wait()
        except BaseException as exc:
            await self._abandon(pendings)
            if isinstance(exc, trio.TooSlowError):
                raise TimeoutError(f"{self.peer}: no answer within {timeout}s") from None
            raise
        for _, p in pendings:
            if p.error is not None:
                raise p.error
        return [p for _, p in pendings]

    async def _abandon(self, pendings: list[tuple[int, _Pending]]) -> None:
        """Give up these requests; an answer already streaming into a caller's buffers is let
        finish first, so the caller can reuse them once this returns."""
        for req_id, p in pendings:
            if self._forget(req_id) is None and p.receiving and not p.event.is_set():
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await p.event.wait()

    # -- the interface -----------------------------------------------------------------------
    async def read(self, rkey: int, offset: int, into: BufferList) -> None:
        await self.read_many([(rkey, offset, into)])

    async def read_many(self, ops) -> None:
        """The READs sent in order as the read window lets them (window.py): as many at once as
        fit, the rest as earlier answers arrive; each answer within op_timeout of the last."""
        frames = []
        for rkey, offset, into in ops:
            bufs = as_buffers(into)
            frames.append((P.Header(P.Op.READ, rkey=rkey, offset=offset, length=sum(map(len, bufs))), [], bufs))
        submitted: list[tuple[int, _Pending]] = []
        try:
            i = 0
            cost = [max(h.length, READ_COST) for h, _, _ in frames]
            while i < len(frames):
                await self.window.take(cost[i], self.op_timeout)
                j = i + 1
                while j < len(frames) and self.window.try_take(cost[j]):
                    j += 1
                submitted += await self._submit(frames[i:j], held=cost[i:j])
                i = j
        except BaseException as exc:
            await self._abandon(submitted)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"{self.peer}: {exc}") from None
            raise
        await self._wait(submitted, None)

    async def write(self, rkey: int, offset: int, data: BufferList) -> None:
        bufs = as_buffers(data)
        h = P.Header(P.Op.WRITE, rkey=rkey, offset=offset, length=sum(map(len, bufs)))
        await self._wait(await self._submit([(h, bufs, None)], self._lane_of(h)), None)

    async def write_imm(self, rkey: int, offset: int, data: BufferList, imm: int) -> dict:
        bufs = as_buffers(data)
        h = P.Header(P.Op.WRITE_IMM, rkey=rkey, offset=offset, length=sum(map(len, bufs)), imm=imm)
        [p] = await self._wait(await self._submit([(h, bufs, None)], self._lane_of(h)), None)
        return P.decode_result(p.payload)

    async def call(self, method: str, args: dict[str, Any] | None = None, *, timeout: float | None = None, probe: bool = False) -> dict:
        doc = P.encode_call(method, args or {})
        h = P.Header(P.Op.CALL, length=len(doc), imm=P.CALL_PROBE if probe else 0)
        [p] = await self._wait(await self._submit([(h, [doc], None)], self.calls_sender), timeout)
        return P.decode_result(p.payload)

    def _lane_of(self, h: P.Header) -> Sender:
        return self.bulk_sender if h.length >= BULK else self.sender

    def waits(self) -> str:
        """Requests unanswered (one given up is no longer counted), and for each socket what a
        send waits behind and how long since an answer last began to arrive on it."""
        now = trio.current_time()
        lanes = {"calls": (self.calls, self.calls_sender), "data": (self.sock, self.sender), "bulk": (self.bulk, self.bulk_sender)}
        parts = [f"{len(self._pending)} requests unanswered"]
        for name, (sock, sender) in lanes.items():
            heard = self._heard.get(sock)
            ago = "never" if heard is None else f"{now - heard:.2f} s ago"
            parts.append(f"{name}: {sender.queued()}, last answer {ago}")
        return "; ".join(parts)

    async def aclose(self) -> None:
        self._fail_all(PeerLost("connection closed"))
        self._close_sockets()
        await trio.lowlevel.checkpoint()

    # -- receiving ---------------------------------------------------------------------------
    def _fail_all(self, error: TransportError) -> None:
        self._broken = self._broken or error
        for req_id, p in list(self._pending.items()):
            self._forget(req_id)
            p.error = PeerLost(f"{self.peer}: {error}")
            p.event.set()
        self.window.close(PeerLost(f"{self.peer}: {error}"))

    async def receiver(self, sock: trio.socket.SocketType | None = None, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Answers arriving on ``sock`` (the main socket if None), until it or the other breaks."""
        sock = self.sock if sock is None else sock
        task_status.started()
        hdr = memoryview(bytearray(P.HEADER.size))
        try:
            while True:
                await _recv_into(sock, hdr, at_boundary=True)
                self._heard[sock] = trio.current_time()
                h = P.unpack(hdr)
                size = P.payload_size(h)
                p = self._forget(h.req_id)  # its window room is free once its bytes are read off
                if p is None:  # its requester gave up (cancelled or timed out)
                    await _drain(sock, size)
                    continue
                p.receiving = True
                try:
                    if h.status != P.Status.OK:
                        p.error = P.status_error(h.status, await _recv_bytes(sock, size))
                    elif p.into is not None:
                        if size != sum(map(len, p.into)):
                            raise ProtocolError(f"READ answered with {size} bytes")
                        for view in p.into:
                            await _recv_into(sock, view)
                    else:
                        p.payload = await _recv_bytes(sock, size)
                except BaseException as exc:  # cut off mid-answer: never a success with part of it
                    p.error = p.error or PeerLost(f"{self.peer}: connection lost in an answer: {exc!r}")
                    raise
                finally:
                    p.event.set()
        except _EOF:
            self._fail_all(PeerLost("peer closed the connection"))
        except SOCKET_ERRORS as exc:
            self._fail_all(PeerLost(f"connection lost: {exc}"))
        except TransportError as exc:
            log.warning("%s: %s; closing the connection", self.peer, exc)
            self._fail_all(exc)
        finally:
            self._close_sockets()  # one socket broken breaks the connection: the others' receivers end too
            self._closed.set()


class _Responder:
    """The serving side of one connection: the handshake, then frame after frame, one method
    per frame kind. One-sided READ and WRITE are answered in line, in arrival order; calls and
    notifications run as tasks of the connection (their answers may come in any order, matched
    by the caller's request id). Any error ends this connection only, never the node."""

    def __init__(
        self, transport: "TcpTransport", sock: trio.socket.SocketType, peer: str, handler: Handler, on_imm: ImmHandler | None, board: StatusBoard | None
    ) -> None:
        self.transport, self.sock, self.peer = transport, sock, peer
        self.handler, self.on_imm, self.board = handler, on_imm, board
        self.regions = transport.regions
        self.sender = Sender(sock, _send_all, sock.close, transport.op_timeout)  # answers, READ data and calls' alike (sender.py)
        self.calls: trio.Nursery | None = None
        self.conn: int | None = None  # the engine's id for this connection, once handed over

    async def run(self) -> None:
        _tune(self.sock)
        async with trio.open_nursery() as calls:
            self.calls = calls
            # Errors are handled inside the nursery body so they end this connection only.
            try:
                with trio.fail_after(HANDSHAKE_TIMEOUT):
                    authenticated = await self.transport._authenticate(self.sock, self.peer)
                if authenticated and self.transport.native is not None:
                    await self.serve_native()
                elif authenticated:
                    await calls.start(self.sender.run)
                    await self.serve_frames()
            except _EOF:
                pass
            except trio.TooSlowError:
                log.warning("%s: handshake timed out", self.peer)
            except ProtocolError as exc:
                log.warning("%s: protocol error, closing the connection: %s", self.peer, exc)
            except PeerLost as exc:
                log.info("%s: %s", self.peer, exc)
            except SOCKET_ERRORS as exc:
                log.info("%s: connection lost: %s", self.peer, exc)
            finally:
                calls.cancel_scope.cancel()
                self.sock.close()

    async def serve_native(self) -> None:
        """Hand the authenticated socket to the engine (transport/engine.py), which serves
        READ, WRITE and WRITE_IMM itself; its calls and notifications come back here as tasks,
        answered through it. Until the engine closes the connection (or this task ends)."""
        engine = self.transport.native
        served = E.Served(self.on_native_request, self.calls, self.peer, None if self.board is None else self.board.heard)
        self.conn = engine.serve(self.sock.detach(), served, self.on_imm is not None)
        try:
            await served.closed.wait()
        finally:
            if not served.closed.is_set():
                engine.native.close(self.conn)
        if served.why.startswith("protocol error"):
            log.warning("%s: %s; closing the connection", self.peer, served.why)
        else:
            log.info("%s: %s", self.peer, served.why)

    async def on_native_request(self, conn: int, h: P.Header, doc: bytes | None) -> None:
        if h.opcode == P.Op.CALL:
            await self.run_call(h, doc or b"")
        else:
            await self.run_imm(h)

    async def serve_frames(self) -> None:
        kinds = {P.Op.READ: self.on_read, P.Op.WRITE: self.on_write, P.Op.WRITE_IMM: self.on_write_imm, P.Op.CALL: self.on_call}
        hdr = memoryview(bytearray(P.HEADER.size))
        while True:
            await _recv_into(self.sock, hdr, at_boundary=True)
            h = P.unpack(hdr)
            await kinds.get(h.opcode, self.on_unknown)(h)

    # -- one method per frame kind ---------------------------------------------------------------
    async def on_read(self, h: P.Header) -> None:
        try:
            view = self.regions.check(h.rkey, h.offset, h.length, Access.READ)
        except AccessError as exc:
            log.info("%s: READ refused: %s", self.peer, exc)
            await self.refuse(h, P.Status.ACCESS, str(exc))
        else:
            await self.respond(h, [view])
            self.transport.count_served("read", h.length)

    async def on_write(self, h: P.Header) -> None:
        if await self.land(h):
            await self.respond(h, [])
            self.transport.count_served("write", h.length)

    async def on_write_imm(self, h: P.Header) -> None:
        if not await self.land(h):
            return
        if self.on_imm is None:
            await self.refuse(h, P.Status.BAD_REQUEST, "this peer takes no notifications")
            return
        self.transport.count_served("write_imm", h.length)
        self.calls.start_soon(self.run_imm, h)

    async def on_call(self, h: P.Header) -> None:
        payload = await _recv_bytes(self.sock, h.length)
        status = self.board.answer() if h.imm == P.CALL_PROBE and self.board is not None else None
        if status is None:
            self.calls.start_soon(self.run_call, h, payload)
            return
        # a probe, while the board's copy is valid: answered here, ahead of what is queued (probes.py)
        resp = h._replace(opcode=h.opcode | P.RESPONSE, status=P.Status.OK, imm=0, length=len(status))
        await self.sender.send([P.pack(resp), status], urgent=True)
        self.board.heard(payload)

    async def on_unknown(self, h: P.Header) -> None:
        log.info("%s: unknown opcode %#x refused", self.peer, h.opcode)
        await _drain(self.sock, P.payload_size(h))
        await self.refuse(h, P.Status.BAD_REQUEST, f"unknown opcode {h.opcode:#x}")

    # -- what they share ---------------------------------------------------------------------------
    async def land(self, h: P.Header) -> bool:
        """Receive a write's payload straight into its region; False (and answered) if the
        region refuses it, after draining the payload so the stream stays in step."""
        try:
            view = self.regions.check(h.rkey, h.offset, h.length, Access.WRITE)
        except AccessError as exc:
            log.info("%s: WRITE refused: %s", self.peer, exc)
            await _drain(self.sock, h.length)
            await self.refuse(h, P.Status.ACCESS, str(exc))
            return False
        await _recv_into(self.sock, view)
        return True

    async def run_call(self, h: P.Header, payload: bytearray) -> None:
        try:
            method, args = P.decode_call(payload)
            result = await self.handler(method, args)
            await self.answer(h, [P.encode_result(result)])
        except RemoteError as exc:
            await self.answer(h, [P.encode_remote_error(exc.code, exc.message)], P.Status.REMOTE)
        except ProtocolError as exc:
            log.warning("%s: %s", self.peer, exc)
            await self.answer(h, [str(exc).encode()], P.Status.BAD_REQUEST)
        except Exception as exc:  # a bug in a handler must not take the node down
            log.exception("%s: control call failed", self.peer)
            await self.answer(h, [P.encode_remote_error("EIO", f"{type(exc).__name__}: {exc}")], P.Status.REMOTE)

    async def run_imm(self, h: P.Header) -> None:
        try:
            region = self.regions.get(h.rkey)
            if region is None:  # freed after the data landed (a staging slot given up): the
                # sender's slot is gone, it asks for a new one (runtime/slots.py staging_gone); the
                # handler never ran, so nothing of it happened (chaos --model-gib 2: EINVAL)
                raise RemoteError("EINVAL", f"unknown rkey {h.rkey}: freed since its WRITE landed")
            result = await self.on_imm(region, h.offset, h.length, h.imm)
            await self.answer(h, [P.encode_result(result)])
        except RemoteError as exc:
            await self.answer(h, [P.encode_remote_error(exc.code, exc.message)], P.Status.REMOTE)
        except Exception as exc:  # a bug in a handler must not take the node down
            log.exception("%s: notification handler failed", self.peer)
            await self.answer(h, [P.encode_remote_error("EIO", f"{type(exc).__name__}: {exc}")], P.Status.REMOTE)

    async def respond(self, h: P.Header, payload: list, status: int = P.Status.OK) -> None:
        resp = h._replace(opcode=h.opcode | P.RESPONSE, status=status, length=sum(map(len, payload)))
        await self.sender.send([P.pack(resp), *payload])

    async def refuse(self, h: P.Header, status: int, message: str) -> None:
        await self.respond(h, [message.encode()], status)

    async def answer(self, h: P.Header, payload: list, status: int = P.Status.OK) -> None:
        """The response of a call or notification, which may finish after its caller left:
        a peer gone by then ends nothing but this answer (never the node)."""
        if self.conn is not None:
            self.transport.native.answer(self.conn, h, payload, status)
            return
        try:
            await self.respond(h, payload, status)
        except SOCKET_ERRORS:
            pass


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, token: bytes, *, op_timeout: float = 30.0, engine: str | None = None):
        """``engine``: "native" (the engine, transport/engine.py), "python" (this module's
        data plane, the reference), or None: native where it loads (``engine.AVAILABLE``)."""
        self._served: dict[str, list[int]] = {}
        super().__init__(token)
        self.op_timeout = op_timeout
        if engine is None:
            engine = "native" if E.AVAILABLE else "python"
        if engine not in ("native", "python"):
            raise ValueError(f"engine must be native or python, not {engine!r}")
        if engine == "native" and not E.AVAILABLE:
            raise RuntimeError(f"the native engine is not available: {E.WHY}")
        self.engine = engine
        # "chosen": runtime/dataplane.py logs a data plane chosen at INFO, a failed build at WARNING
        self.engine_why = E.WHY if engine == "python" and not E.AVAILABLE else ("chosen" if engine == "python" else "built")
        self.native: E.Engine | None = E.Engine() if engine == "native" else None
        if self.native is not None:
            self.regions.mirror = self.native

    @property
    def served(self) -> dict[str, list[int]]:
        """One-sided operations served: op -> [count, bytes] (the engine's and this module's)."""
        if self.native is None:
            return self._served
        out = {op: list(v) for op, v in self._served.items()}
        stats = self.native.stats()
        for op in ("read", "write", "write_imm"):
            count, nbytes = stats[op]
            if count:
                mine = out.setdefault(op, [0, 0])
                mine[0] += count
                mine[1] += nbytes
        return out

    @served.setter
    def served(self, value: dict[str, list[int]]) -> None:
        self._served = value

    # -- serving side ------------------------------------------------------------------------
    async def serve(
        self, host: str, port: int, handler: Handler, *, on_imm: ImmHandler | None = None, board: StatusBoard | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listener = trio.socket.socket(_stdsocket.AF_INET, _stdsocket.SOCK_STREAM)
        listener.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_REUSEADDR, 1)
        with listener:
            await listener.bind((host, port))
            listener.listen(256)
            task_status.started(listener.getsockname()[:2])
            async with trio.open_nursery() as nursery:
                if self.native is not None:
                    self.native.ensure_pump(nursery)
                    if board is not None:
                        board.attach(self.native.publish)
                while True:
                    try:
                        sock, addr = await listener.accept()
                    except OSError as exc:  # EMFILE and friends: back off, keep listening
                        log.warning("accept failed: %s", exc)
                        await trio.sleep(0.1)
                        continue
                    nursery.start_soon(_Responder(self, sock, f"{addr[0]}:{addr[1]}", handler, on_imm, board).run)

    async def _authenticate(self, sock: trio.socket.SocketType, peer: str) -> bool:
        nonce = new_nonce()
        await _sendv(sock, [P.pack(P.Header(P.Op.CHALLENGE, length=len(nonce))), nonce])
        hdr = await _recv_bytes(sock, P.HEADER.size)
        h = P.unpack(hdr)
        if h.opcode != P.Op.AUTH or h.length != 2 * _NONCE:
            raise ProtocolError(f"expected AUTH of {2 * _NONCE} bytes, got opcode {h.opcode:#x}")
        payload = await _recv_bytes(sock, h.length)
        cnonce, proof = bytes(payload[:_NONCE]), bytes(payload[_NONCE:])
        if not hmac.compare_digest(proof, client_proof(self.token, nonce, cnonce)):
            log.warning("refused connection from %s: wrong cluster token", peer)
            msg = b"wrong cluster token"
            resp = P.Header(P.Op.AUTH | P.RESPONSE, status=P.Status.AUTH, length=len(msg))
            await _sendv(sock, [P.pack(resp), msg])
            return False
        proof = server_proof(self.token, nonce, cnonce)
        await _sendv(sock, [P.pack(P.Header(P.Op.AUTH | P.RESPONSE, length=len(proof), imm=self.incarnation)), proof])
        return True

    # -- calling side ------------------------------------------------------------------------
    async def connect(self, host: str, port: int, *, nursery: trio.Nursery) -> TcpConnection:
        peer = f"{host}:{port}"
        socks: list = []
        try:
            for _ in range(3):  # reads and small writes; large writes; calls
                socks.append(await self._open(host, port))
        except BaseException:
            for sock, _ in socks:
                sock.close()
            raise
        if len({inc for _, inc in socks}) > 1:  # it restarted meanwhile: what we learnt of it is mixed
            for sock, _ in socks:
                sock.close()
            raise ConnectError(f"{peer}: restarted while connecting")
        (sock, incarnation), (bulk, _), (calls, _) = socks
        if self.native is not None:
            self.native.ensure_pump(nursery)
            ids = [self.native.native.adopt(s.detach(), False, False) for s in (sock, bulk, calls)]
            native = E.NativeConnection(self.native, peer, self.op_timeout, *ids)
            native.incarnation = incarnation
            return native
        conn = TcpConnection(sock, peer, self.op_timeout, bulk, calls)
        conn.incarnation = incarnation
        for s in (sock, bulk, calls):
            await nursery.start(conn.receiver, s)
        for sender in (conn.sender, conn.bulk_sender, conn.calls_sender):
            await nursery.start(sender.run)
        return conn

    async def _open(self, host: str, port: int) -> tuple[trio.socket.SocketType, int]:
        """One socket to the node, authenticated, and the incarnation that answered."""
        peer = f"{host}:{port}"
        sock = trio.socket.socket(_stdsocket.AF_INET, _stdsocket.SOCK_STREAM)
        try:
            _tune(sock)
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                try:
                    await sock.connect((host, port))
                except OSError as exc:
                    raise ConnectError(f"cannot connect to {peer}: {exc.strerror or exc}") from None
                incarnation = await self._handshake(sock, peer)
        except trio.TooSlowError:
            sock.close()
            raise ConnectError(f"{peer}: handshake timed out") from None
        except SOCKET_ERRORS as exc:
            sock.close()
            raise ConnectError(f"{peer}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        return sock, incarnation

    async def _handshake(self, sock: trio.socket.SocketType, peer: str) -> int:
        """Prove the token both ways; returns the peer's incarnation (its AUTH reply's imm)."""
        try:
            h = P.unpack(await _recv_bytes(sock, P.HEADER.size))
            if h.opcode != P.Op.CHALLENGE or h.length != _NONCE:
                raise ConnectError(f"{peer}: not an irdmafs node (opcode {h.opcode:#x})")
            snonce = bytes(await _recv_bytes(sock, _NONCE))
            cnonce = new_nonce()
            proof = client_proof(self.token, snonce, cnonce)
            await _sendv(sock, [P.pack(P.Header(P.Op.AUTH, length=2 * _NONCE)), cnonce, proof])
            h = P.unpack(await _recv_bytes(sock, P.HEADER.size))
            payload = bytes(await _recv_bytes(sock, P.payload_size(h)))
        except (PeerLost, ProtocolError) as exc:
            raise ConnectError(f"{peer}: handshake failed: {exc}") from None
        if h.status == P.Status.AUTH:
            raise AuthError(f"{peer} refused our cluster token: {payload.decode('utf-8', 'replace')}")
        if h.status != P.Status.OK or not hmac.compare_digest(payload, server_proof(self.token, snonce, cnonce)):
            raise AuthError(f"{peer} could not prove it holds the cluster token")
        return h.imm

