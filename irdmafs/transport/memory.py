"""The transport contract inside one process, for fast unit tests.

A serving ``MemoryTransport`` registers itself under a (host, port) address in a process-wide
table; connections copy between buffers directly. It enforces the same rules as the network
transports (token, rkey, bounds, access, JSON-serialisable control documents) so code tested on it
behaves the same over TCP and verbs, which the shared conformance suite checks.

Links can fail: a transport made with an ``endpoint`` name consults ``LINKS`` (when set: the
fault simulator's, tests/sim) before every operation from it to another named endpoint, which
may delay it, hold it, or fail it as a network would (``PeerLost``, ``TimeoutError``,
``ConnectError``), on each side of the served call alike.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
from typing import Any, Protocol

import trio

from .base import Access, BufferList, Connection, Handler, ImmHandler, Transport, as_buffers
from .probes import StatusBoard
from ..errors import AuthError, ConnectError, PeerLost, ProtocolError, RemoteError, TimeoutError

log = logging.getLogger(__name__)

_listeners: dict[tuple[str, int], tuple["MemoryTransport", Handler, ImmHandler | None]] = {}
_ports = itertools.count(40000)


class Links(Protocol):
    """What decides the fate of one operation between two named endpoints (tests/sim)."""

    async def cross(self, src: str, dst: str, what: str) -> None: ...


LINKS: Links | None = None


class MemoryConnection(Connection):
    wire = False

    def __init__(
        self, server: "MemoryTransport", handler: Handler, address: tuple[str, int], on_imm: ImmHandler | None = None, src: str = "", op_timeout: float = 30.0
    ):
        self.server = server
        self.src = src  # the connecting endpoint's name ("": links never fail)
        self.handler = handler
        self.on_imm = on_imm
        self.address = address
        self.peer = f"{address[0]}:{address[1]}"
        self.incarnation = server.incarnation
        self.op_timeout = op_timeout  # the connecting side's, as a network transport's
        self._closed = False

    def _check_alive(self) -> None:
        if self._closed or _listeners.get(self.address, (None,))[0] is not self.server:
            raise PeerLost(f"{self.peer}: peer is gone")

    async def _cross(self, what: str) -> None:
        """The link's say (LINKS), then whether the peer is still there."""
        if LINKS is not None and self.src and self.server.endpoint:
            await LINKS.cross(self.src, self.server.endpoint, what)
        self._check_alive()

    async def _cross_within(self, what: str, seconds: float) -> None:
        """``_cross``, bounded as a network transport bounds an operation: a link that holds it
        past ``seconds`` is a TimeoutError (a READ's or WRITE's: ``op_timeout``, as tcp.py
        bounds silence between answers; a call's: its timeout)."""
        try:
            with trio.fail_after(seconds):
                await self._cross(what)
        except trio.TooSlowError:
            raise TimeoutError(f"{self.peer}: {what}: no answer within {seconds}s") from None

    async def read(self, rkey: int, offset: int, into: BufferList) -> None:
        await trio.lowlevel.checkpoint()
        await self._cross_within("read", self.op_timeout)
        bufs = as_buffers(into)
        view = self.server.regions.check(rkey, offset, sum(map(len, bufs)), Access.READ)
        pos = 0
        for b in bufs:
            b[:] = view[pos : pos + len(b)]
            pos += len(b)

    async def write(self, rkey: int, offset: int, data: BufferList) -> None:
        await trio.lowlevel.checkpoint()
        await self._cross_within("write", self.op_timeout)
        bufs = as_buffers(data)
        view = self.server.regions.check(rkey, offset, sum(map(len, bufs)), Access.WRITE)
        pos = 0
        for b in bufs:
            view[pos : pos + len(b)] = b
            pos += len(b)

    async def write_imm(self, rkey: int, offset: int, data: BufferList, imm: int) -> dict:
        await self.write(rkey, offset, data)
        if self.on_imm is None:
            raise ProtocolError(f"{self.peer}: this peer takes no notifications")
        length = sum(map(len, as_buffers(data)))
        result = await self._guarded(self.on_imm(self.server.regions.get(rkey), offset, length, imm), None)
        if LINKS is not None and self.src and self.server.endpoint:
            await LINKS.cross(self.server.endpoint, self.src, "imm answer")
        return result

    async def call(self, method: str, args: dict[str, Any] | None = None, *, timeout: float | None = None, probe: bool = False) -> dict:
        # in-process: no queue to jump, so a probe is the heartbeat call it stands for (probes.py)
        await self._cross_within(method, timeout if timeout is not None else 30.0)
        # The JSON round trip keeps the in-process path honest about what can cross a wire.
        args = json.loads(json.dumps(args or {}))
        result = await self._guarded(self.handler(method, args), timeout)
        if LINKS is not None and self.src and self.server.endpoint:
            await LINKS.cross(self.server.endpoint, self.src, f"{method} answer")  # the answer crosses back
        return result

    async def _guarded(self, coro, timeout: float | None) -> dict:
        """Run a serving-side coroutine as the network transports would: its errors become
        RemoteError, and its result must survive JSON."""
        try:
            with trio.fail_after(timeout if timeout is not None else 30.0):
                result = await coro
        except RemoteError:
            raise
        except trio.TooSlowError:
            raise TimeoutError(f"{self.peer}: no answer") from None
        except Exception as exc:
            log.exception("%s: control call failed", self.peer)
            raise RemoteError("EIO", f"{type(exc).__name__}: {exc}") from None
        return json.loads(json.dumps(result))

    async def aclose(self) -> None:
        self._closed = True
        await trio.lowlevel.checkpoint()


class MemoryTransport(Transport):
    name = "memory"

    def __init__(self, token: bytes, endpoint: str = "", *, op_timeout: float = 30.0):
        super().__init__(token)
        self.endpoint = endpoint  # its name on the simulator's links ("": links never fail)
        self.op_timeout = op_timeout  # what bounds a one-sided operation a link holds

    async def serve(
        self, host: str, port: int, handler: Handler, *, on_imm: ImmHandler | None = None, board: StatusBoard | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        address = (host, port or next(_ports))
        if address in _listeners:
            raise OSError(f"address {address} already in use")
        _listeners[address] = (self, handler, on_imm)
        try:
            task_status.started(address)
            await trio.sleep_forever()
        finally:
            _listeners.pop(address, None)

    async def connect(self, host: str, port: int, *, nursery: Any = None) -> MemoryConnection:
        await trio.lowlevel.checkpoint()
        entry = _listeners.get((host, port))
        if entry is not None and LINKS is not None and self.endpoint and entry[0].endpoint:
            try:
                await LINKS.cross(self.endpoint, entry[0].endpoint, "connect")
            except (PeerLost, TimeoutError) as exc:
                raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
            entry = _listeners.get((host, port))
        if entry is None:
            raise ConnectError(f"cannot connect to {host}:{port}: nothing listens there")
        server, handler, on_imm = entry
        if not hmac.compare_digest(server.token, self.token):
            log.warning("memory transport %s:%s refused a connection: wrong cluster token", host, port)
            raise AuthError(f"{host}:{port} refused our cluster token: wrong cluster token")
        return MemoryConnection(server, handler, (host, port), on_imm, src=self.endpoint, op_timeout=self.op_timeout)
