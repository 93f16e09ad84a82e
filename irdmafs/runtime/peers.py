"""Peers: this process's connections to the nodes, the calls and one-sided operations on them.

``Peers`` connects to a node lazily (its address from ``spec(name)``: a member, or a node known to
be joining), makes control calls (``call_on``) and one-sided READs and WRITEs (``write``,
``write_imm``, ``read_stripe``, ``read_header``), and counts what it makes (``calls``, ``load``,
``served``).
Any of them that cannot reach its node (lost connection, timeout) calls ``lost(name, why,
since)`` (runtime/cluster.py: drop the connection, count the node down) and raises ``NodeDown``. An
operation under way on a node that liveness counts down is cancelled at once (``abort``) and
raises ``NodeDown`` too, instead of waiting out its own timeout: heartbeats find a hung node in
``down_after``, and what waits on it (a push, a commit) goes to a replica then.

Every node process has an *incarnation*, new at each start, learnt in the transport's handshake
and repeated in heartbeats (``seen``). Whatever a process caches about a node (region keys,
staging slots) is tied to the incarnation it came from: when a node's incarnation changes,
``on_restart`` callbacks drop those caches before the new connection is used, and a one-sided
operation given a key's incarnation refuses to send it to a newer one (``StaleKey``, an
``AccessError``: refresh and retry).

``read_verified`` is the seqlock read every data mover needs (it never returns a torn stripe;
the region's layout is regions.py's).

Concurrency: one trio thread; closing connections runs in ``nursery``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable

import trio

from ..config import ClusterConfig, NodeSpec
from ..regions import HEADER, Header, read_header
from ..transport.base import Connection, Transport
from ..errors import ConnectError, NodeDown, PeerLost, StaleKey, TimeoutError, TornRead

log = logging.getLogger(__name__)


class Peers:
    def __init__(
        self,
        cfg: ClusterConfig,
        transport: Transport,
        nursery: trio.Nursery | None,
        *,
        spec: Callable[[str], NodeSpec | None],
        lost: Callable[[str, str, float], None],
        is_down: Callable[[str], bool],
        counts_timeouts: bool,
    ):
        """``spec(name)``: where a node listens (None: not a node to talk to any more);
        ``lost(name, why, since)``: an operation begun at ``since`` could not reach ``name``;
        ``is_down(name)``: whether liveness counts it down; ``counts_timeouts``: whether a
        timeout is a node lost (on a node: a replication that did not land must keep the peer
        from serving until it resyncs), or only a lost connection (on a client: a call may wait
        on purpose, a commit during a snapshot's freeze, and heartbeats tell a hung node from a
        busy one soon enough)."""
        self.cfg, self.transport, self.nursery = cfg, transport, nursery
        self.spec, self.lost, self.is_down, self.counts_timeouts = spec, lost, is_down, counts_timeouts
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, trio.Lock] = defaultdict(trio.Lock)
        self._inflight: dict[str, set[trio.CancelScope]] = defaultdict(set)  # see _AbortOnDown
        self.load: dict[str, int] = defaultdict(int)  # one-sided reads under way, per node
        self.served: dict[str, int] = defaultdict(int)  # bytes read from each node so far
        self.calls = 0  # control calls made (the steady state of training makes none but clock waits)
        self.calls_by_method: dict[str, int] = defaultdict(int)
        # node -> the incarnation of it this process last talked to; on_restart(node) callbacks
        # run (synchronously, before the new connection is used) when it changes
        self.incarnation: dict[str, int] = {}
        self.on_restart: list[Callable[[str], None]] = []
        self.restarts_seen = 0

    # -- connections -----------------------------------------------------------------------------
    async def conn(self, name: str) -> Connection:
        begun = trio.current_time()
        conn = self._conns.get(name)
        if conn is not None:
            return conn
        async with self._connecting[name]:
            conn = self._conns.get(name)
            if conn is None:
                spec = self.spec(name)
                if spec is None:  # removed by a membership change while a probe was under way
                    raise NodeDown(name, "not a member of the cluster any more")
                try:
                    # bounded by the op timeout, not the transport's handshake timeout (10 s): a
                    # stopped node's kernel still accepts connections, and a read that tried it
                    # again waited out the handshake (the chaos soak, SIGSTOP with views)
                    with trio.fail_after(self.cfg.op_timeout):
                        conn = await self.transport.connect(spec.host, spec.port, nursery=self.nursery)
                except (ConnectError, trio.TooSlowError) as exc:
                    why = str(exc) or f"no handshake within {self.cfg.op_timeout}s"
                    self.lost(name, why, begun)
                    raise NodeDown(name, why) from None
                self._conns[name] = conn
                self.seen(name, conn.incarnation)
        return conn

    def over_wire(self, name: str) -> bool:
        """Whether operations on ``name`` cross a network (True while not connected)."""
        conn = self._conns.get(name)
        return conn is None or conn.wire

    def waits(self, name: str) -> str:
        """What the connection to ``name`` waits on now (``Connection.waits``), for a log line;
        empty if there is none (dropped: it broke) or its transport cannot say."""
        conn = self._conns.get(name)
        return "" if conn is None else conn.waits()

    def drop(self, name: str) -> None:
        """Close the connection to ``name`` (the next operation connects again)."""
        conn = self._conns.pop(name, None)
        if conn is not None:
            self.nursery.start_soon(conn.aclose)

    def abort(self, name: str) -> None:
        """Cancel every operation under way on ``name`` (liveness counts it down)."""
        for scope in list(self._inflight.get(name, ())):
            scope.cancel()

    def seen(self, name: str, incarnation: int) -> None:
        """``name`` answered as ``incarnation``: a new one means it restarted, and everything
        cached from the old one is dropped before anything uses the new connection."""
        if not incarnation:
            return
        old = self.incarnation.get(name)
        self.incarnation[name] = incarnation
        if old is not None and old != incarnation:
            self.restarts_seen += 1
            log.warning("node %s restarted (incarnation %08x -> %08x): dropping what was cached of it", name, old, incarnation)
            for callback in self.on_restart:
                callback(name)

    async def _conn_for(self, name: str, inc: int | None) -> Connection:
        """The connection to ``name``, unless a key of incarnation ``inc`` is to be used on it
        and the node has restarted since: StaleKey, before anything is sent."""
        conn = await self.conn(name)
        if inc is not None and conn.incarnation and conn.incarnation != inc:
            raise StaleKey(f"node {name}: key from incarnation {inc:08x}, node is now {conn.incarnation:08x}")
        return conn

    def _failed(self, name: str, exc: BaseException, begun: float) -> None:
        if isinstance(exc, PeerLost) or self.counts_timeouts:
            self.lost(name, str(exc) or "timed out", begun)

    # -- calls and one-sided operations ----------------------------------------------------------
    async def call_on(self, name: str, method: str, args: dict | None = None, *, timeout: float | None = None, probe: bool = False) -> tuple[dict, int]:
        """A control call, and the incarnation that answered: the one any key in the reply
        belongs to. A node that cannot be reached raises NodeDown. ``probe``: a heartbeat
        answered ahead of queued work (transport/probes.py)."""
        begun = trio.current_time()
        conn = await self.conn(name)
        if method != "heartbeat":
            self.calls += 1
            self.calls_by_method[method] += 1
        try:
            with _AbortOnDown(self, name):
                reply = await conn.call(method, args or {}, timeout=timeout or self.cfg.op_timeout, probe=probe)
        except (PeerLost, TimeoutError) as exc:
            if method != "heartbeat" or isinstance(exc, PeerLost):  # a heartbeat's silence: its prober decides
                self._failed(name, exc, begun)
            raise NodeDown(name, str(exc)) from None
        return reply, conn.incarnation

    async def write(self, name: str, rkey: int, offset: int, data, inc: int | None = None) -> None:
        """A one-sided WRITE. ``inc``: the incarnation ``rkey`` came from (StaleKey if the node
        restarted since)."""
        begun = trio.current_time()
        conn = await self._conn_for(name, inc)
        try:
            with _AbortOnDown(self, name), trio.fail_after(self.cfg.op_timeout):
                await conn.write(rkey, offset, data)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "write timed out") from None

    async def write_imm(self, name: str, rkey: int, offset: int, data, imm: int, inc: int | None = None) -> dict:
        """A WRITE with immediate, and the answer to it."""
        begun = trio.current_time()
        conn = await self._conn_for(name, inc)
        try:
            with _AbortOnDown(self, name), trio.fail_after(self.cfg.op_timeout * 3):
                return await conn.write_imm(rkey, offset, data, imm)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "write timed out") from None

    async def read_stripe(self, name: str, rkey: int, offset: int, into: memoryview, inc: int | None = None) -> Header:
        """``read_verified`` against one node, counted in its load and what it served."""
        begun = trio.current_time()
        conn = await self._conn_for(name, inc)
        self.load[name] += 1
        self.served[name] += len(into)
        try:
            with _AbortOnDown(self, name):  # the transport bounds silence (tcp.py), not a deadline on queueing
                return await read_verified(conn, rkey, offset, into)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "read timed out") from None
        finally:
            self.load[name] -= 1

    async def read_header(self, name: str, rkey: int, inc: int | None = None) -> Header:
        """A stripe's header alone: how a pull waits for a step."""
        begun = trio.current_time()
        buf = bytearray(HEADER)
        conn = await self._conn_for(name, inc)
        try:
            with _AbortOnDown(self, name):  # the transport bounds silence
                await conn.read(rkey, 0, buf)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "read timed out") from None
        return read_header(buf)

    async def read_headers(self, name: str, keys: list[tuple[int, int]]) -> list[Header]:
        """The headers of several stripes of one node in one pipelined burst, each key with the
        incarnation it came from (StaleKey if the node restarted since)."""
        begun = trio.current_time()
        conn = await self.conn(name)
        if any(inc and conn.incarnation and conn.incarnation != inc for _, inc in keys):
            raise StaleKey(f"node {name}: a key from an older incarnation than {conn.incarnation:08x}")
        bufs = [bytearray(HEADER) for _ in keys]
        try:
            with _AbortOnDown(self, name):  # the transport bounds silence
                await conn.read_many([(rkey, 0, buf) for (rkey, _), buf in zip(keys, bufs)])
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "read timed out") from None
        return [read_header(buf) for buf in bufs]

    async def read_stripes(self, name: str, items: list[tuple[int, int, int, memoryview]]) -> list[Header | None]:
        """Several stripes of one node, each (rkey, the key's incarnation, data offset, into)
        read as ``read_verified`` reads one (its header, its data, its header again), all in
        one pipelined burst that the node serves in order; for each its header, or None if an
        install overlapped its read (the caller reads it again). StaleKey if a key is from an
        older incarnation."""
        begun = trio.current_time()
        conn = await self.conn(name)
        if any(inc and conn.incarnation and conn.incarnation != inc for _, inc, _, _ in items):
            raise StaleKey(f"node {name}: a key from an older incarnation than {conn.incarnation:08x}")
        heads = [(bytearray(HEADER), bytearray(HEADER)) for _ in items]
        ops: list = []
        for (rkey, _, offset, into), (before, after) in zip(items, heads):
            ops += [(rkey, 0, before), (rkey, HEADER + offset, into), (rkey, 0, after)]
        self.load[name] += 1
        self.served[name] += sum(len(into) for *_, into in items)
        try:
            with _AbortOnDown(self, name):  # no deadline on the burst's size: the transport's own bound silence
                await conn.read_many(ops)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "read timed out") from None
        finally:
            self.load[name] -= 1
        return [read_header(before) if before == after and not before[0] & 1 else None for before, after in heads]

    async def aclose(self) -> None:
        for conn in list(self._conns.values()):
            await conn.aclose()
        self._conns.clear()


class _AbortOnDown:
    """Runs an operation on a node so that it fails (NodeDown) as soon as the node is counted
    down (``Peers.abort``), instead of waiting out its own timeout.

    Its scope is cancelled by ``abort`` alone, so a cancellation it caught always raises
    NodeDown, whatever liveness says by the time the task resumes. It raised only while the node
    was still counted down: one that answered a heartbeat meanwhile, or that membership forgot,
    let the cancelled operation return as if done (a call without its reply, a WRITE never
    made, zeroed headers read as a verified read), and a node died of it rejoining
    (``UnboundLocalError`` in ``call_on``, issue 41)."""

    def __init__(self, peers: Peers, name: str):
        self.peers, self.name = peers, name
        self.scope = trio.CancelScope()

    def __enter__(self) -> None:
        self.peers._inflight[self.name].add(self.scope)
        self.scope.__enter__()

    def __exit__(self, *exc) -> bool:
        try:
            handled = self.scope.__exit__(*exc)
        finally:
            self.peers._inflight[self.name].discard(self.scope)
        if self.scope.cancelled_caught:
            raise NodeDown(self.name, "counted down while the operation waited")
        return handled


async def read_verified(conn: Connection, rkey: int, offset: int, into: memoryview, *, retries: int = 100) -> Header:
    """Read ``into`` from data offset ``offset`` of a stripe region, untorn; returns its
    header.

    The header is read before and after the data in one pipelined burst; the peer serves them in
    order, so equal headers with an even version mean no install overlapped the data read."""
    before, after = bytearray(HEADER), bytearray(HEADER)
    for attempt in range(retries):
        await conn.read_many([(rkey, 0, before), (rkey, HEADER + offset, into), (rkey, 0, after)])
        if before == after and not before[0] & 1:
            return read_header(before)
        await trio.sleep(0 if attempt < 10 else 0.001 * attempt)
    raise TornRead(f"stripe region {rkey} kept changing over {retries} reads")
