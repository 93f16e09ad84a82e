"""The transport contract between processes of one host: a one-sided READ or WRITE is a copy.

Serving side: every region is a ``memfd`` mapped by the serving process. Besides TCP (which it
serves exactly as ``tcp`` does, for peers on other hosts), it listens on an abstract Unix socket
whose random name it tells a TCP peer that asks (control call ``__shm``). A peer that can reach
that socket shares the host (and the network namespace: abstract names are per namespace); it
proves the cluster token again there (HMAC both ways, as over TCP), then asks for a region by
rkey and receives its file descriptor (``SCM_RIGHTS``), which it maps. From then on READ and WRITE
are a ``memcpy`` made by the caller with no CPU on the serving side: RDMA's contract.

What stays checked, and where:
- **token**: before the key table or any region's descriptor crosses the socket;
- **access**: a region not writable remotely is sealed with ``F_SEAL_FUTURE_WRITE`` after the
  serving process mapped it, so the kernel refuses any writable mapping of it in another process;
  a peer maps it read-only;
- **bounds**: the caller checks every range against the region's length before copying (it can
  only ever touch its own mapping of that one region);
- **rkeys and lifetimes**: a shared *key table* (one u32 per slot, read-only to peers) holds the
  rkey that owns each slot; freeing a region zeroes its slot. A copy checks the slot before and
  after, so a READ that raced a free, or any use of a freed key, fails with ``AccessError`` (a
  freed region's memory lives on, unreachable by anyone else, until the peer drops its mapping);
- **incarnation and liveness**: the TCP control connection carries the incarnation as for
  ``tcp``; when it breaks (the node died or closed) every operation fails with ``PeerLost``.

WRITE_IMM is the copy plus a ``__imm`` control call (as on verbs). Peers on another host, or a
serving process that is plain ``tcp``, get the TCP connection unchanged: the choice is made per
connection, automatically, and logged once per peer.

Concurrency: one trio thread per process. Copies run in line (they never block on the peer).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import socket as _stdsocket
import struct
from functools import partial
from typing import Any

import trio

from .base import (
    SOCKET_ERRORS, Access, BufferList, Connection, Handler, ImmHandler, Region, as_buffers, client_proof, new_nonce, notify_by_call, serve_imm_call,
    server_proof,
)
from ..errors import AccessError, AuthError, ConnectError, PeerLost, ProtocolError, RemoteError, TransportError
from .base import NONCE as _NONCE
from ..util import accept_forever, recv_with_fds, send_with_fd
from .probes import StatusBoard
from .tcp import HANDSHAKE_TIMEOUT, TcpConnection, TcpTransport

log = logging.getLogger(__name__)

F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE = 0x0002, 0x0004, 0x0010  # linux/fcntl.h
TABLE_SLOTS = 1 << 20  # regions one process can serve at once; slot 0 holds the incarnation
SWEEP_EVERY = 1024  # operations between two sweeps of a peer's mappings of freed regions
WELCOME = struct.Struct("<B32sII")  # status, server proof, incarnation, table slots (+ table fd)
ASK = struct.Struct("<I")  # rkey
REGION = struct.Struct("<BBxxIIxxxxQ")  # status, access, slot, rkey asked, length (+ its fd if status 0)
OK, REFUSED = 0, 1


def shm_unusable_reason() -> str | None:
    if not hasattr(os, "memfd_create") or not hasattr(_stdsocket, "SCM_RIGHTS"):
        return "no memfd_create or SCM_RIGHTS on this platform"
    try:  # F_SEAL_FUTURE_WRITE came with Linux 5.1: without it read-only could not be enforced
        fd, m = _memfd(1, "irdmafs-probe")
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        finally:
            m.close()
            os.close(fd)
    except OSError as exc:
        return f"memfd sealing unavailable: {exc}"
    _raise_fd_limit()
    return None


def _raise_fd_limit() -> None:
    """A serving process keeps a descriptor per region (a node: one per stripe and staging
    slot): raise the soft limit on open files to the hard one, as databases do."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("open-file limit stays %d (%s)", soft, exc)


def _memfd(nbytes: int, name: str) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        size = max(nbytes, 1)
        os.ftruncate(fd, (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
        return fd, mmap.mmap(fd, 0)
    except BaseException:
        os.close(fd)
        raise


async def _recv_exact(sock: trio.socket.SocketType, n: int) -> tuple[bytes, list[int]]:
    """n bytes of a small fixed message and the descriptors that came with it; PeerLost if the
    peer closed."""
    try:
        data, fds = await recv_with_fds(sock, n)
    except EOFError as exc:
        raise PeerLost(str(exc)) from None
    if data is None:
        raise PeerLost("connection closed")
    return data, fds


class _Mapped:
    """A peer's region as this process maps it."""

    __slots__ = ("map", "view", "slot", "access")

    def __init__(self, m: mmap.mmap, length: int, slot: int, access: Access):
        self.map, self.view, self.slot, self.access = m, memoryview(m)[:length], slot, access


class ShmConnection(Connection):
    """Copies to and from a same-host peer's regions; control calls over its TCP connection."""

    wire = False

    def __init__(self, tcp: TcpConnection, sock: trio.socket.SocketType, table: mmap.mmap, slots: int):
        self.tcp = tcp
        self.sock = sock
        self.peer = tcp.peer
        self.incarnation = tcp.incarnation
        self._table_map = table
        self._table = memoryview(table).cast("I")[:slots]
        self._maps: dict[int, _Mapped] = {}
        self._ask_lock = trio.Lock()
        self._broken: str | None = None  # why the Unix socket is out of step, if it is
        self._ops = 0

    def _alive(self) -> None:
        lost = self.tcp.lost
        if lost is not None:
            raise PeerLost(f"{self.peer}: {lost}")
        if self._broken is not None:
            raise PeerLost(f"{self.peer}: {self._broken}")

    async def _region(self, rkey: int, access: Access) -> _Mapped:
        self._alive()
        self._ops += 1
        if self._ops % SWEEP_EVERY == 0:
            self._sweep()
        m = self._maps.get(rkey)
        if m is not None and self._table[m.slot] != rkey:
            del self._maps[rkey]  # freed since: the mapping goes, the key is unknown now
            m = None
        if m is None:
            m = await self._ask(rkey)
        if not m.access & access:
            raise AccessError(f"rkey {rkey} does not allow {access.name}")
        return m

    async def _ask(self, rkey: int) -> _Mapped:
        # One question, one answer, never cut in between: a caller cancelled after sending
        # would leave its answer to the next asker (shielded, bounded by its own deadline; if
        # that passes, or the answer names another key, the socket is out of step for good).
        async with self._ask_lock:
            self._alive()
            try:
                with trio.CancelScope(shield=True), trio.fail_after(self.tcp.op_timeout):
                    await send_with_fd(self.sock, ASK.pack(rkey))
                    data, fds = await _recv_exact(self.sock, REGION.size)
            except trio.TooSlowError:
                self._broken = f"no answer for region {rkey} within {self.tcp.op_timeout}s"
                raise PeerLost(f"{self.peer}: {self._broken}") from None
            except SOCKET_ERRORS as exc:
                self._broken = f"same-host socket: {exc}"
                raise PeerLost(f"{self.peer}: {self._broken}") from None
        status, access, slot, asked, length = REGION.unpack(data)
        if asked != rkey:
            for fd in fds:
                os.close(fd)
            self._broken = f"answer for rkey {asked} when asking for {rkey}"
            raise PeerLost(f"{self.peer}: {self._broken}")
        if status != OK:
            for fd in fds:
                os.close(fd)
            raise AccessError(f"unknown rkey {rkey}")
        if len(fds) != 1 or not 0 < slot < len(self._table):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"{self.peer}: malformed region answer for rkey {rkey}")
        try:
            writable = bool(access & Access.WRITE)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            m = mmap.mmap(fds[0], 0, prot=prot)
        except (OSError, ValueError) as exc:
            raise AccessError(f"rkey {rkey}: cannot map it: {exc}") from None
        finally:
            os.close(fds[0])
        self._sweep()
        mapped = _Mapped(m, length, slot, Access(access))
        self._maps[rkey] = mapped
        return mapped

    def _sweep(self) -> None:
        """Drop the mappings of regions freed since (their memory is released with them)."""
        for rkey in [k for k, m in self._maps.items() if self._table[m.slot] != k]:
            del self._maps[rkey]

    def _slice(self, m: _Mapped, rkey: int, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > len(m.view):
            raise AccessError(f"range {offset}+{length} outside rkey {rkey} of {len(m.view)} bytes")
        return m.view[offset : offset + length]

    def _still(self, m: _Mapped, rkey: int) -> None:
        if self._table[m.slot] != rkey:
            self._maps.pop(rkey, None)
            raise AccessError(f"rkey {rkey} was freed during the operation")

    async def read(self, rkey: int, offset: int, into: BufferList) -> None:
        await trio.lowlevel.checkpoint()
        await self._copy_out(rkey, offset, into)

    async def read_many(self, ops) -> None:
        # In order, in line: the version-checked stripe read relies on it. One checkpoint for
        # the burst, not one per READ (a pull's burst of a thousand small stripes).
        await trio.lowlevel.checkpoint()
        for rkey, offset, into in ops:
            await self._copy_out(rkey, offset, into)

    async def _copy_out(self, rkey: int, offset: int, into: BufferList) -> None:
        """One READ's copy (no checkpoint unless it maps the region)."""
        bufs = as_buffers(into)
        m = await self._region(rkey, Access.READ)
        view = self._slice(m, rkey, offset, sum(map(len, bufs)))
        pos = 0
        for b in bufs:
            b[:] = view[pos : pos + len(b)]
            pos += len(b)
        self._still(m, rkey)

    async def write(self, rkey: int, offset: int, data: BufferList) -> None:
        await trio.lowlevel.checkpoint()
        bufs = as_buffers(data)
        m = await self._region(rkey, Access.WRITE)
        view = self._slice(m, rkey, offset, sum(map(len, bufs)))
        pos = 0
        for b in bufs:
            view[pos : pos + len(b)] = b
            pos += len(b)
        self._still(m, rkey)

    async def write_imm(self, rkey: int, offset: int, data: BufferList, imm: int) -> dict:
        await self.write(rkey, offset, data)
        return await notify_by_call(self.tcp, rkey, offset, data, imm)

    async def call(self, method: str, args: dict[str, Any] | None = None, *, timeout: float | None = None, probe: bool = False) -> dict:
        return await self.tcp.call(method, args, timeout=timeout, probe=probe)

    def waits(self) -> str:
        return self.tcp.waits()  # its calls (a heartbeat) go over TCP

    async def aclose(self) -> None:
        self._maps.clear()
        self.sock.close()
        await self.tcp.aclose()


class ShmTransport(TcpTransport):
    """TCP between hosts; shared memory with the peers of this host."""

    name = "shm"

    def __init__(self, token: bytes, *, op_timeout: float = 30.0, engine: str | None = None):
        super().__init__(token, op_timeout=op_timeout, engine=engine)
        self._fds: dict[int, int] = {}  # rkey -> memfd
        self._slot_of: dict[int, int] = {}  # rkey -> key-table slot
        self._free_slots: list[int] = []
        self._next_slot = 1
        self._table_fd, table = _memfd(4 * TABLE_SLOTS, "irdmafs-keys")
        self._table = memoryview(table).cast("I")
        fcntl.fcntl(self._table_fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SHRINK | F_SEAL_GROW)
        self.socket_name = f"irdmafs-shm-{secrets.token_hex(12)}"

    # -- regions -------------------------------------------------------------------------------
    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        if self._next_slot < TABLE_SLOTS:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
            return slot
        raise MemoryError(f"more than {TABLE_SLOTS - 1} regions")

    def alloc_region(self, nbytes: int, access: Access) -> Region:
        slot = self._take_slot()
        fd, m = _memfd(nbytes, "irdmafs-region")
        if not access & Access.WRITE:  # nobody else may ever map it writable
            seals = F_SEAL_FUTURE_WRITE | F_SEAL_SHRINK | F_SEAL_GROW
        else:
            seals = F_SEAL_SHRINK | F_SEAL_GROW
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        region = self.regions.add(memoryview(m)[:nbytes], access)
        self._fds[region.rkey] = fd
        self._slot_of[region.rkey] = slot
        self._table[slot] = region.rkey
        return region

    def alias_region(self, region: Region) -> Region:
        """A second key of the same memfd (a descriptor of its own, a slot of its own): peers
        map the same pages, and freeing either key zeroes only its slot."""
        slot = self._take_slot()
        alias = self.regions.add(region.buf, region.access)
        self._fds[alias.rkey] = os.dup(self._fds[region.rkey])
        self._slot_of[alias.rkey] = slot
        self._table[slot] = alias.rkey
        return alias

    def free_region(self, region: Region) -> bool:
        settled = super().free_region(region)  # the engine's, for peers on other hosts
        slot = self._slot_of.pop(region.rkey, None)
        if slot is not None:
            self._table[slot] = 0
            self._free_slots.append(slot)
        fd = self._fds.pop(region.rkey, None)
        if fd is not None:
            os.close(fd)
        return settled  # a peer here checks the slot after its copy: it fails from now on

    # -- serving side ------------------------------------------------------------------------
    async def serve(
        self, host: str, port: int, handler: Handler, *, on_imm: ImmHandler | None = None, board: StatusBoard | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def shm_handler(method: str, args: dict) -> dict:
            if method == "__shm":
                return {"socket": self.socket_name, "incarnation": self.incarnation}
            if method == "__imm":
                return await serve_imm_call(self.regions, on_imm, args)
            return await handler(method, args)

        listener = trio.socket.socket(_stdsocket.AF_UNIX, _stdsocket.SOCK_STREAM)
        with listener:
            await listener.bind("\0" + self.socket_name)
            listener.listen(64)
            self._table[0] = self.incarnation
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(accept_forever, listener, self._serve_peer, "shm")
                    tcp_serve = partial(TcpTransport.serve, self, host, port, shm_handler, on_imm=on_imm, board=board)
                    address = await nursery.start(lambda task_status: tcp_serve(task_status=task_status))
                    task_status.started(address)
            finally:
                self._table[0] = 0

    async def _serve_peer(self, sock: trio.socket.SocketType) -> None:
        """One same-host peer: the token, then region descriptors on request, until it leaves."""
        with sock:
            try:
                with trio.fail_after(HANDSHAKE_TIMEOUT):
                    nonce = new_nonce()
                    await send_with_fd(sock, nonce)
                    data, fds = await _recv_exact(sock, 2 * _NONCE)
                    for fd in fds:
                        os.close(fd)
                    cnonce, proof = data[:_NONCE], data[_NONCE:]
                    if not secrets.compare_digest(proof, client_proof(self.token, nonce, cnonce)):
                        log.warning("refused a same-host connection: wrong cluster token")
                        await send_with_fd(sock, WELCOME.pack(REFUSED, b"", 0, 0))
                        return
                    welcome = WELCOME.pack(OK, server_proof(self.token, nonce, cnonce), self.incarnation, TABLE_SLOTS)
                    await send_with_fd(sock, welcome, self._table_fd)
                while True:
                    data, fds = await _recv_exact(sock, ASK.size)
                    for fd in fds:  # a peer has no business sending descriptors
                        os.close(fd)
                    (rkey,) = ASK.unpack(data)
                    await self._give(sock, rkey)
            except trio.TooSlowError:
                log.warning("same-host handshake timed out")
            except (PeerLost, *SOCKET_ERRORS):
                pass
            except Exception:  # noqa: BLE001 -- a bug here must not take the node down
                log.exception("same-host peer connection failed")

    async def _give(self, sock: trio.socket.SocketType, rkey: int) -> None:
        region, fd = self.regions.get(rkey), self._fds.get(rkey)
        if region is None or fd is None:
            await send_with_fd(sock, REGION.pack(REFUSED, 0, 0, rkey, 0))
            return
        # our own copy of the descriptor: the region may be freed (and its number reused by
        # another file) while this send waits
        mine = os.dup(fd)
        try:
            await send_with_fd(sock, REGION.pack(OK, int(region.access), self._slot_of[rkey], rkey, region.length), mine)
        finally:
            os.close(mine)

    # -- calling side ------------------------------------------------------------------------
    async def connect(self, host: str, port: int, *, nursery: trio.Nursery) -> Connection:
        tcp = await super().connect(host, port, nursery=nursery)
        try:
            info = await tcp.call("__shm", {}, timeout=HANDSHAKE_TIMEOUT)
            name = str(info["socket"])
        except (RemoteError, KeyError, TypeError) as exc:
            log.info("%s: tcp (the peer offers no shared memory: %s)", tcp.peer, exc)
            return tcp
        except BaseException:
            await tcp.aclose()
            raise
        sock = trio.socket.socket(_stdsocket.AF_UNIX, _stdsocket.SOCK_STREAM)
        try:
            await sock.connect("\0" + name)
        except OSError:
            sock.close()
            log.info("%s: tcp (another host or network namespace)", tcp.peer)
            return tcp
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                table, slots = await self._handshake_shm(sock, tcp)
        except BaseException as exc:
            sock.close()
            await tcp.aclose()
            if isinstance(exc, trio.TooSlowError):
                raise ConnectError(f"{tcp.peer}: same-host handshake timed out") from None
            if isinstance(exc, (*SOCKET_ERRORS, PeerLost)):
                raise ConnectError(f"{tcp.peer}: same-host handshake failed: {exc}") from None
            raise
        log.info("%s: shared memory (same host)", tcp.peer)
        return ShmConnection(tcp, sock, table, slots)

    async def _handshake_shm(self, sock: trio.socket.SocketType, tcp: TcpConnection) -> tuple[mmap.mmap, int]:
        snonce, fds = await _recv_exact(sock, _NONCE)
        for fd in fds:
            os.close(fd)
        cnonce = new_nonce()
        await send_with_fd(sock, cnonce + client_proof(self.token, snonce, cnonce))
        data, fds = await _recv_exact(sock, WELCOME.size)
        status, proof, incarnation, slots = WELCOME.unpack(data)
        try:
            if status != OK:
                raise AuthError(f"{tcp.peer} refused our cluster token (same host)")
            if not secrets.compare_digest(proof, server_proof(self.token, snonce, cnonce)):
                raise AuthError(f"{tcp.peer} could not prove it holds the cluster token (same host)")
            if incarnation != tcp.incarnation or len(fds) != 1:
                raise ConnectError(f"{tcp.peer}: the same-host socket belongs to another process")
            return mmap.mmap(fds[0], 4 * slots, prot=mmap.PROT_READ), slots
        finally:
            for fd in fds:
                os.close(fd)


__all__ = ["ShmConnection", "ShmTransport", "TransportError", "shm_unusable_reason"]
