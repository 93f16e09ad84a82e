"""The transport interface: a remote machine is a device with a memory interface.

A serving process allocates *regions* (buffers the transport may expose) and hands out their
keys; a peer then reads and writes them one-sidedly with ``Connection.read`` /
``Connection.write``: the serving process's own logic is not involved. Control traffic (allocate,
metadata, commit) is the two-sided ``Connection.call``.

Every implementation (``memory``, ``tcp``, ``verbs``) offers the same classes and raises only the
errors defined here, so the layers above never see ``OSError`` or a pyverbs exception.

Concurrency: every object here is used from one trio thread; ``Connection`` methods may be called
from many tasks at once (many operations in flight per peer).
"""

from __future__ import annotations

import abc
import enum
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence, Union

import trio

from ..errors import (  # noqa: F401 (the same classes: transport.base.RemoteError is errors.RemoteError)
    AccessError, AuthError, ConnectError, PeerLost, ProtocolError, RemoteError, StaleKey, TimeoutError, TransportError,
)

if TYPE_CHECKING:
    from .probes import StatusBoard

Buffer = Union[bytes, bytearray, memoryview]
# A scatter-gather list: one remote range <-> several local buffers, in order.
BufferList = Union[Buffer, Sequence[Buffer]]
Handler = Callable[[str, dict], Awaitable[dict]]
# Called after a WRITE_IMM landed: (region, offset, length, imm) -> JSON-able result
ImmHandler = Callable[["Region", int, int, int], Awaitable[dict]]


# What a socket-based transport (tcp, shm) catches from the socket and trio's streams, to turn it
# into ConnectError or PeerLost (or, on the serving side, the end of one connection) at its edge.
SOCKET_ERRORS = (OSError, trio.ClosedResourceError, trio.BrokenResourceError)


class Access(enum.IntFlag):
    READ = 1
    WRITE = 2
    RW = 3


@dataclass
class Region:
    """A buffer registered with a transport; ``buf`` is the local view of it."""

    rkey: int
    buf: memoryview
    access: Access

    @property
    def length(self) -> int:
        return len(self.buf)


def as_buffers(data: BufferList) -> list[memoryview]:
    """Normalise a buffer or scatter-gather list into a list of flat byte memoryviews."""
    if isinstance(data, (bytes, bytearray, memoryview)) or hasattr(data, "__buffer__"):
        data = [data]  # type: ignore[list-item]
    out = []
    for b in data:  # type: ignore[union-attr]
        mv = memoryview(b)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        out.append(mv)
    return out


class Gather:
    """Bytes kept as the buffers they arrived in, not joined: a write-behind's run of writes.

    ``len(g)`` is its size; ``g[a:b]`` is those bytes as a list of memoryviews of the buffers (a
    ``BufferList``, what every transport's WRITE takes), with no copy. Buffers appended are
    referenced, not copied, so they must not change afterwards (pyfuse3 hands writes over as
    ``bytes``). Small ones (under ``SMALL``) are copied together into a buffer of their own, so a
    run of small writes is a few large buffers and not thousands of tiny ones."""

    SMALL = 256 << 10

    __slots__ = ("parts", "size", "_tail")

    def __init__(self, parts: Sequence[Buffer] = ()) -> None:
        self.parts: list[Buffer] = []
        self.size = 0
        self._tail: bytearray | None = None  # the last part, while small writes still go into it
        for b in parts:
            self.append(b)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self[0 : self.size])

    def append(self, data: Buffer) -> None:
        mv = memoryview(data).cast("B")
        if not len(mv):
            return
        self.size += len(mv)
        if len(mv) >= self.SMALL:
            self.parts.append(mv)
            self._tail = None
        elif self._tail is not None and len(self._tail) + len(mv) <= self.SMALL:
            self._tail += mv
        else:
            self._tail = bytearray(mv)
            self.parts.append(self._tail)

    def __getitem__(self, s: slice) -> list[memoryview]:
        start, stop, step = s.indices(self.size)
        if step != 1:
            raise ValueError("a Gather slices with step 1 only")
        out, pos = [], 0
        for p in self.parts:
            end = pos + len(p)
            if pos >= stop:
                break
            if end > start:
                if p is self._tail:
                    self._tail = None  # viewed now: a bytearray with views cannot grow
                out.append(memoryview(p)[max(start - pos, 0) : min(stop, end) - pos])
            pos = end
        return out

    def split(self, n: int) -> "Gather":
        """Keep the first ``n`` bytes here; return the rest as a new Gather (no copy)."""
        n = min(max(n, 0), self.size)
        rest = Gather()
        rest.parts, rest.size = self[n : self.size], self.size - n
        self.parts, self.size = self[0:n], n
        return rest


class KeyStream:
    """Region keys: every key one process hands out is new (never drawn again after a free) and
    unguessable by a peer that was not given it.

    A key is a keyed permutation (a 4-round Feistel network over the 32-bit word, its round
    function a keyed BLAKE2b) of a counter that starts at a random point: distinct for 2**32
    allocations, and without the process's secret a peer cannot tell the next key from the
    last. The counter is the key's *generation*: a freed key never names another region, so a
    peer holding a stale one gets AccessError, never another region's bytes (before, keys were
    random and could be drawn again after a free)."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(16)
        self._start = secrets.randbits(32)
        self.drawn = 0

    def _round(self, i: int, half: int) -> int:
        return int.from_bytes(hashlib.blake2b(bytes((i, half & 0xFF, half >> 8)), digest_size=2, key=self._secret).digest(), "little")

    def permute(self, n: int) -> int:
        left, right = n >> 16, n & 0xFFFF
        for i in range(4):
            left, right = right, left ^ self._round(i, right)
        return left << 16 | right

    def next(self) -> tuple[int, int]:
        """(key, generation); the key is never 0."""
        while True:
            if self.drawn >= 1 << 32:
                raise RuntimeError("this process has drawn every region key")
            gen = self.drawn
            self.drawn += 1
            key = self.permute((self._start + gen) & 0xFFFFFFFF)
            if key:
                return key, gen


class RegionTable:
    """rkey -> Region, with the serving-side bounds and access check every transport uses.

    ``mirror``, when set, is a native engine's table (transport/engine.py) kept equal to this
    one: every add and remove goes to both, so the engine serves exactly these regions."""

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._keys = KeyStream()
        self.mirror: Any = None

    def add(self, buf: memoryview, access: Access) -> Region:
        rkey, gen = self._keys.next()
        region = Region(rkey, buf, access)
        if self.mirror is not None:
            self.mirror.add_region(rkey, gen, buf, access)
        self._regions[rkey] = region
        return region

    def get(self, rkey: int) -> Region | None:
        return self._regions.get(rkey)

    def remove(self, rkey: int) -> bool:
        """The key refused from now on. With a mirror, the engine lets the memory go once the
        operations in flight on it end (never under one): transport/engine.py. Returns whether
        no operation can move bytes of it any more (False: one in flight still may, until
        ``settled``)."""
        if self._regions.pop(rkey, None) is not None and self.mirror is not None:
            return self.mirror.free_region(rkey)
        return True

    def settled(self, rkey: int) -> bool:
        """Whether no operation in flight can still move bytes of freed key ``rkey``."""
        return self.mirror is None or self.mirror.settled(rkey)

    def __len__(self) -> int:
        return len(self._regions)

    def check(self, rkey: int, offset: int, length: int, access: Access) -> memoryview:
        """The slice [offset, offset+length) of region rkey, or AccessError saying why not."""
        region = self._regions.get(rkey)
        if region is None:
            raise AccessError(f"unknown rkey {rkey}")
        if not region.access & access:
            raise AccessError(f"rkey {rkey} does not allow {access.name}")
        if offset < 0 or length < 0 or offset + length > region.length:
            raise AccessError(
                f"range {offset}+{length} outside rkey {rkey} of {region.length} bytes"
            )
        return region.buf[offset : offset + length]


def page_aligned(nbytes: int) -> memoryview:
    """A zeroed, page-aligned, writable buffer (what RDMA registration wants)."""
    import mmap

    size = max(nbytes, 1)
    m = mmap.mmap(-1, (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
    return memoryview(m)[:nbytes]


# --- authentication (shared by every socket-based transport) ------------------------------------

NONCE = 32


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, b"irdmafs-client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, b"irdmafs-server" + client_nonce + server_nonce, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE)


# --- the interface ---------------------------------------------------------------------------------


class Connection(abc.ABC):
    """One authenticated link to a serving peer."""

    peer: str
    # the serving process's incarnation, learnt in the handshake (0: the peer did not say)
    incarnation: int = 0
    # whether its bytes cross a network (tcp, verbs) or are copies in this host's memory (shm,
    # memory): what a sender sizes its batches by (client/training.py, PUSH_BATCH)
    wire: bool = True

    @abc.abstractmethod
    async def read(self, rkey: int, offset: int, into: BufferList) -> None:
        """One-sided READ of the remote range into the local buffer(s), filled in order."""

    @abc.abstractmethod
    async def write(self, rkey: int, offset: int, data: BufferList) -> None:
        """One-sided WRITE of the local buffer(s), concatenated, to the remote range."""

    @abc.abstractmethod
    async def write_imm(self, rkey: int, offset: int, data: BufferList, imm: int) -> dict:
        """A WRITE that also delivers ``imm`` to the serving side's notification handler (as
        RDMA WRITE_WITH_IMM does) once the data has landed; returns the handler's result."""

    async def read_many(self, ops: Sequence[tuple[int, int, BufferList]]) -> None:
        """Several READs issued back to back; the peer serves them in order (used for the
        version-checked stripe read). Implementations pipeline them."""
        for rkey, offset, into in ops:
            await self.read(rkey, offset, into)

    @abc.abstractmethod
    async def call(self, method: str, args: dict[str, Any] | None = None, *, timeout: float | None = None, probe: bool = False) -> dict:
        """Two-sided control call; raises RemoteError with the serving side's errno name.
        ``timeout`` overrides the connection's default for calls that wait on purpose.
        ``probe``: a liveness probe (a ``heartbeat``), which a serving side with a status board
        answers from it ahead of queued work (probes.py); a transport without a queue to jump
        sends it as the call it is."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    def waits(self) -> str:
        """What this connection waits on now, for the log line of a peer that went silent
        (requests unanswered, frames queued, how long since each socket last brought an answer);
        empty where the transport cannot say."""
        return ""


class Transport(abc.ABC):
    """One implementation of the contract: serving side (regions, listener) and calling side."""

    name: str

    def __init__(self, token: bytes):
        if not token:
            raise ValueError("a cluster token is required")
        self.token = token
        self.regions = RegionTable()
        # New at every start of a serving process: every key it hands out belongs to it, and a
        # peer that sees it change drops what it cached (runtime/peers.py, Peers.on_restart).
        self.incarnation = secrets.randbits(32) or 1  # 32 bits: it travels in a header's imm word
        # one-sided operations this process served: op -> [count, bytes] (for metrics; a
        # transport whose one-sided operations bypass the CPU, as verbs', cannot count them)
        self.served: dict[str, list[int]] = {}

    def count_served(self, op: str, nbytes: int) -> None:
        c = self.served.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += nbytes

    def alloc_region(self, nbytes: int, access: Access) -> Region:
        """A new zeroed region this transport will serve."""
        return self.regions.add(page_aligned(nbytes), access)

    def alias_region(self, region: Region) -> Region:
        """Another registration of ``region``'s memory, under a key of its own and with its
        access: the same bytes through both keys. Each is freed on its own (``free_region``);
        a freed key answers AccessError while the other still reads, and the memory lives while
        any registration of it does (a snapshot shares a live stripe this way: server/store.py)."""
        return self.regions.add(region.buf, region.access)

    def free_region(self, region: Region) -> bool:
        """The key refused from now on; True if no operation can move bytes of the memory
        through it any more, False while one in flight still may (a native engine's READ whose
        bytes are still leaving: ``settled`` says when it ended). A Python responder checks
        each READ as its turn comes, after the earlier one's bytes left; a shared-memory peer
        checks the key table after its copy; a verbs MR is deregistered: those are settled at
        once."""
        return self.regions.remove(region.rkey)

    def settled(self, rkey: int) -> bool:
        """Whether no operation in flight can still move bytes of freed key ``rkey`` (memory
        reused for other bytes must wait for it: server/spares.py)."""
        return self.regions.settled(rkey)

    @abc.abstractmethod
    async def serve(
        self, host: str, port: int, handler: Handler, *, on_imm: ImmHandler | None = None, board: "StatusBoard | None" = None, task_status: Any
    ) -> None:
        """Serve regions, control calls and (with ``on_imm``) WRITE_IMM notifications until
        cancelled; ``task_status.started((host, port))`` once listening (port 0 picks one).
        ``board``: probes are answered from it while its copy is valid (probes.py)."""

    @abc.abstractmethod
    async def connect(self, host: str, port: int, *, nursery: Any) -> Connection:
        """Connect and authenticate; tasks the connection needs run in ``nursery``."""


async def notify_by_call(control: "Connection", rkey: int, offset: int, data: BufferList, imm: int) -> dict:
    """The second half of a WRITE_IMM whose data went one-sidedly already (verbs, shm): the
    notification, as a ``__imm`` control call ordered after the data (``serve_imm_call`` on the
    serving side). (IBV_WR_RDMA_WRITE_WITH_IMM would need receive work requests posted there.)"""
    length = sum(map(len, as_buffers(data)))
    return await control.call("__imm", {"rkey": rkey, "offset": offset, "length": length, "imm": imm})


async def serve_imm_call(regions: RegionTable, on_imm: ImmHandler | None, args: dict) -> dict:
    """The notification of a WRITE_IMM whose data went one-sidedly (verbs, shm): the ``__imm``
    control call, checked as the TCP responder checks a WRITE_IMM frame."""
    try:
        rkey, offset, length, imm = (int(args[k]) for k in ("rkey", "offset", "length", "imm"))
    except (KeyError, TypeError, ValueError):
        raise RemoteError("EINVAL", "__imm takes integer rkey, offset, length and imm") from None
    if on_imm is None:
        raise RemoteError("EINVAL", "this peer takes no notifications")
    try:
        regions.check(rkey, offset, length, Access.WRITE)
    except AccessError as exc:
        raise RemoteError("EINVAL", str(exc)) from None
    return await on_imm(regions.get(rkey), offset, length, imm)
