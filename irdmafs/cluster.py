"""One process's view of the cluster: connections, node liveness, who is primary for what.

Nodes and clients both hold a ``Cluster``. It connects to nodes lazily and heartbeats them.

Who serves is decided by views alone (coord/views.py): the newest view known names the active
nodes, and another node is ready if that view names it active, else down, whatever heartbeats
say (a node still answers for itself, through ``my_state``). Every process that holds the same
view epoch then names the same primary and replicas for a stripe. Views come from the
coordinator (a node's ``ViewKeeper``) and from heartbeats, which carry the view their node holds;
a newer epoch always replaces an older one (coord/views.py, V1). A process starts with the empty
view (epoch 0, nobody active) and routes nothing until it has learnt one.

Heartbeats keep each node's *liveness* (``state``: ``ready``, ``syncing`` or ``down``, as its
answers say, or down when it does not answer): it orders a read's replicas (one that does not
answer last), aborts what waits on a node that stopped answering, and tells a node which peers
to expel (server/membership.py, ``expel_loop``). It never decides who serves.

Every node process has an *incarnation*, new at each start, learnt in the transport's handshake
and repeated in heartbeats. Whatever a process caches about a node (region keys, staging slots)
is tied to the incarnation it came from: when a node's incarnation changes, ``on_restart``
callbacks drop those caches, and a one-sided operation given a key's incarnation refuses to send
it to a newer one (``StaleKey``, an ``AccessError``: refresh and retry).

From the view, the membership (``members``, a value a rebalance replaces whole) and the pure
placement and routing functions (placement.py, routing.py) it answers: the metadata primary
(first active member), a stripe's primary (first active node in the stripe's rendezvous
ranking), the replicas a write must reach, and the order in which to try replicas for a read
(its active homes, least-loaded first).

It also holds ``read_verified``, the seqlock read every data mover needs (it never returns a torn
stripe; the region's layout is regions.py's). Write staging in peers' memory is slots.py's.

Concurrency: one trio thread; the heartbeat task runs in the nursery given to the constructor.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from typing import Callable

import trio

from . import routing
from .config import ClusterConfig, Members, NodeSpec
from .coord.views import View
from .placement import rank, stripe_key
from .regions import HEADER, Header, read_header
from .transport.base import (
    ConnectError,
    Connection,
    PeerLost,
    RemoteError,
    StaleKey,
    TimeoutError,
    Transport,
    TransportError,
)

log = logging.getLogger(__name__)

READY, SYNCING, DOWN = routing.READY, routing.SYNCING, "down"


class NodeDown(TransportError):
    """A node could not be reached; it has been marked down."""

    def __init__(self, node: str, why: str):
        super().__init__(f"node {node} is down: {why}")
        self.node = node


class Unavailable(TransportError):
    """No live replica could serve a stripe (the file system answers EIO)."""


class TornRead(TransportError):
    """A stripe kept changing under a reader for every retry."""


class _AbortOnDown:
    """Runs an operation on a node so that it fails (NodeDown) as soon as the node is counted
    down, instead of waiting out its own timeout: heartbeats find a hung node in
    ``down_after``, and what waits on it (a push, a commit) goes to a replica then."""

    def __init__(self, cluster: "Cluster", name: str):
        self.cluster, self.name = cluster, name
        self.scope = trio.CancelScope()

    def __enter__(self) -> None:
        self.cluster._inflight[self.name].add(self.scope)
        self.scope.__enter__()

    def __exit__(self, *exc) -> bool:
        try:
            handled = self.scope.__exit__(*exc)
        finally:
            self.cluster._inflight[self.name].discard(self.scope)
        if self.scope.cancelled_caught and self.cluster.state.get(self.name) == DOWN:
            raise NodeDown(self.name, "counted down while the operation waited")
        return handled


class Cluster:
    def __init__(
        self,
        cfg: ClusterConfig,
        transport: Transport,
        nursery: trio.Nursery | None,
        *,
        me: str | None = None,
        my_state: Callable[[], str] | None = None,
    ):
        self.cfg = cfg
        self.transport = transport
        self.nursery = nursery
        self.me = me
        self._my_state = my_state or (lambda: DOWN)
        self.state: dict[str, str] = {n: DOWN for n in cfg.names if n != me}  # liveness, by heartbeats
        self.info: dict[str, dict] = {}
        self.info_at: dict[str, float] = {}  # when each node's info was last heard
        self.vouched_at: dict[str, float] = {}  # when a node last told us its state itself
        self.load: dict[str, int] = defaultdict(int)
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, trio.Lock] = defaultdict(trio.Lock)
        self.changed = trio.Event()  # set (and replaced) whenever a state changes
        self.calls = 0  # control calls made (the steady state of training should make none)
        self.calls_by_method: dict[str, int] = defaultdict(int)
        # membership: the config's nodes (epoch 0) until a rebalance switches every process over;
        # a value replaced whole by ``adopt`` (the config stays as loaded: every service holds it)
        self.members: Members = cfg.members()
        self.known: dict[str, NodeSpec] = {}  # nodes reachable though not (yet) members
        self.on_adopt: Callable[[int], None] | None = None
        self.follow_membership = True  # False for a rebalance coordinator, which sets it itself
        # node -> the incarnation of it this process last talked to; on_restart(node) callbacks
        # run (synchronously, before the new connection is used) when it changes
        self.incarnation: dict[str, int] = {}
        self.on_restart: list[Callable[[str], None]] = []
        self.restarts_seen = 0
        # sent with every heartbeat: "owner" keeps this process's staging leased (server/node.py)
        self.heartbeat_args: dict = {}
        self._inflight: dict[str, set[trio.CancelScope]] = defaultdict(set)  # see _AbortOnDown
        self.view: View = View()  # the newest view known (see above); epoch 0: none yet
        self.on_view: list[Callable[[View], None]] = []  # called with each newer view learnt

    @property
    def epoch(self) -> int:
        """The membership's epoch (0: the config's), which heartbeats carry."""
        return self.members.epoch

    @property
    def view_epoch(self) -> int:
        """The epoch every message that changes data carries (0: no view learnt yet)."""
        return self.view.epoch

    async def after_lost(self) -> None:
        """A call to a node failed with NodeDown. Only a new view moves its work (a node that
        cannot be reached is expelled by its peers, coord/views.py V6): wait a heartbeat and ask
        the nodes for their view before trying again."""
        await trio.sleep(self.cfg.heartbeat)
        await self.refresh()

    def learn_view(self, view: View) -> None:
        """Keep ``view`` if it is newer than the one held; it decides who serves from now on."""
        if view.epoch <= self.view.epoch:
            return
        self.view = view
        for callback in self.on_view:
            callback(view)
        self.changed.set()
        self.changed = trio.Event()

    # -- states ------------------------------------------------------------------------------
    def node_state(self, name: str) -> str:
        if name == self.me:
            return self._my_state()
        return READY if name in self.view.active else DOWN

    def _set(self, name: str, state: str, why: str = "") -> None:
        if name not in self.members.names and name not in self.known:
            return  # no longer a member: nothing to track
        old = self.state.get(name)
        if old != state:
            self.state[name] = state
            if state == DOWN:
                for scope in list(self._inflight.get(name, ())):
                    scope.cancel()
            log.log(logging.WARNING if state == DOWN else logging.INFO, "node %s: %s -> %s%s", name, old, state, f" ({why})" if why else "")
            self.changed.set()
            self.changed = trio.Event()

    def vouch(self, name: str, state: str) -> None:
        """A node told us its state itself (joining, taking its stripes back: server/membership.py).
        That is newer than any heartbeat probe already under way, whose answer is then ignored."""
        self.vouched_at[name] = trio.current_time()
        self._set(name, state, "told by the node")

    def mark_down(self, name: str, why: str, since: float | None = None) -> None:
        """Drop the connection to ``name`` and count it down, unless the failure is of an
        operation begun ``since`` before the node vouched for itself (the process that failed
        it is gone; the one that vouched is new)."""
        conn = self._conns.pop(name, None)
        if conn is not None:
            self.nursery.start_soon(conn.aclose)
        if name != self.me and (since is None or self.vouched_at.get(name, -math.inf) < since):
            self._set(name, DOWN, why)

    def heard_majority(self) -> bool:
        """Whether this node and the peers its own heartbeats reach (whatever a view says) are a
        majority of the members: a node cut off from the others must not expel them
        (server/replicator.py)."""
        names = self.members.names
        heard = sum(self.state.get(n, DOWN) != DOWN for n in names if n != self.me)
        return heard + 1 >= len(names) // 2 + 1

    def ready(self) -> list[str]:
        return [n for n in self.members.names if self.node_state(n) == READY]

    def live(self) -> list[str]:
        return [n for n in self.members.names if self.node_state(n) in (READY, SYNCING)]

    def meta_primary(self) -> str | None:
        ready = self.ready()
        return ready[0] if ready else None

    def stripe_rank(self, fid: int, idx: int) -> list[str]:
        return rank(stripe_key(fid, idx), self.members.names)

    def stripe_primary(self, fid: int, idx: int) -> str | None:
        return routing.primary(self.stripe_rank(fid, idx), self.node_state)

    def targets(self, fid: int, idx: int) -> list[str]:
        """Where a write of this stripe must land: the first R nodes of its ranking the view names
        active (this node too while it syncs), always including the primary (routing.py)."""
        return routing.targets(self.stripe_rank(fid, idx), self.members.replicas, self.node_state)

    def read_candidates(self, fid: int, idx: int) -> list[str]:
        """Nodes to try for a read: the stripe's homes the view names active (the first R of its
        ranking), least-loaded first, and one this process's own heartbeats count down (a
        stopped node, until the view expels it) last. They hold every acknowledged write once
        caught up (their ``stripe_info`` waits for that).

        A stand-in (a node past the first R that took writes while a home was expelled) is
        never asked while a home is active: it holds only what it took while it stood in. A
        mount on the minority side of a cut, reaching neither home, read a stand-in's copy from
        an earlier view, and a write acknowledged since by the homes read back old (chaos,
        seed 7). Reaching no home, the read is unavailable (EIO) rather than old. Only a view
        that names no home active (every home expelled: R=1, or R=2 on five nodes and more)
        leaves the stand-ins it writes to, the only copies it acknowledges writes on."""
        order = lambda n: (self.state.get(n) == DOWN, self.load[n])  # noqa: E731
        return routing.read_candidates(self.stripe_rank(fid, idx), self.members.replicas, self.node_state, order)

    # -- connections ---------------------------------------------------------------------------
    async def conn(self, name: str) -> Connection:
        begun = trio.current_time()
        conn = self._conns.get(name)
        if conn is not None:
            return conn
        async with self._connecting[name]:
            conn = self._conns.get(name)
            if conn is None:
                spec = self.members.spec(name) or self.known.get(name)
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
                    self.mark_down(name, why, since=begun)
                    raise NodeDown(name, why) from None
                self._conns[name] = conn
                self._seen(name, conn.incarnation)
        return conn

    def _failed(self, name: str, exc: BaseException, begun: float) -> None:
        """An operation on ``name`` failed: a lost connection counts it down. A timeout does on
        a node (a replication that did not land must keep the peer from serving until it
        resyncs), not on a client: a call may wait on purpose (a commit during a snapshot's
        freeze), and heartbeats tell a hung node from a busy one soon enough."""
        if isinstance(exc, PeerLost) or self.me is not None:
            self.mark_down(name, str(exc) or "timed out", since=begun)

    def _seen(self, name: str, incarnation: int) -> None:
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

    async def call(self, name: str, method: str, args: dict | None = None, *, timeout: float | None = None) -> dict:
        """A control call; a node that cannot be reached is marked down and raises NodeDown."""
        return (await self.call_on(name, method, args, timeout=timeout))[0]

    async def call_on(self, name: str, method: str, args: dict | None = None, *, timeout: float | None = None) -> tuple[dict, int]:
        """``call``, and the incarnation that answered: the one any key in the reply belongs to."""
        begun = trio.current_time()
        conn = await self.conn(name)
        if method != "heartbeat":
            self.calls += 1
            self.calls_by_method[method] += 1
        try:
            with _AbortOnDown(self, name):
                reply = await conn.call(method, args or {}, timeout=timeout or self.cfg.op_timeout)
        except (PeerLost, TimeoutError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc)) from None
        await self.follow_acked(reply)
        return reply, conn.incarnation

    async def follow_acked(self, reply: object) -> None:
        """A change acknowledged in a newer view than this process holds (a commit, a namespace
        op, a push: their answers say ``acked_in``) is learnt before the caller acts on it: that
        view may have expelled a replica the older one still names, which lacks the change. A
        client that went on by the older view read an acknowledged write back old from it, or
        pushed to it as a stripe's primary a tensor whose creation it never got (ENOENT: chaos
        --views seed 11, a cut of n3). Heartbeats carry the view (``_probe``); asked again a few
        times, never longer than a heartbeat each."""
        acked_in = reply.get("acked_in", 0) if isinstance(reply, dict) else 0
        for _ in range(3):
            if not isinstance(acked_in, int) or acked_in <= self.view_epoch:
                return
            await self.refresh()
            if acked_in > self.view_epoch:
                await trio.sleep(self.cfg.heartbeat)

    async def write(self, name: str, rkey: int, offset: int, data, inc: int | None = None) -> None:
        """A one-sided WRITE; a node that cannot be reached is marked down and raises NodeDown.
        ``inc``: the incarnation ``rkey`` came from (StaleKey if the node restarted since)."""
        begun = trio.current_time()
        conn = await self._conn_for(name, inc)
        try:
            with _AbortOnDown(self, name), trio.fail_after(self.cfg.op_timeout):
                await conn.write(rkey, offset, data)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "write timed out") from None

    async def write_imm(self, name: str, rkey: int, offset: int, data, imm: int, inc: int | None = None) -> dict:
        """A WRITE with immediate; a node that cannot be reached is marked down (NodeDown)."""
        begun = trio.current_time()
        conn = await self._conn_for(name, inc)
        try:
            with _AbortOnDown(self, name), trio.fail_after(self.cfg.op_timeout * 3):
                reply = await conn.write_imm(rkey, offset, data, imm)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "write timed out") from None
        await self.follow_acked(reply)
        return reply

    async def read_stripe(self, name: str, rkey: int, offset: int, into: memoryview, inc: int | None = None) -> Header:
        """``read_verified`` against one node, counted in its load; marks it down on failure."""
        begun = trio.current_time()
        conn = await self._conn_for(name, inc)
        self.load[name] += 1
        try:
            with _AbortOnDown(self, name), trio.fail_after(self.cfg.op_timeout):
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
            with _AbortOnDown(self, name), trio.fail_after(self.cfg.op_timeout):
                await conn.read(rkey, 0, buf)
        except (PeerLost, TimeoutError, trio.TooSlowError) as exc:
            self._failed(name, exc, begun)
            raise NodeDown(name, str(exc) or "read timed out") from None
        return read_header(buf)

    # -- heartbeats ----------------------------------------------------------------------------
    async def _probe(self, name: str) -> None:
        sent = trio.current_time()
        try:
            with trio.fail_after(self.cfg.down_after):
                args = {"from": self.me or "client", **self.heartbeat_args}
                info = await self.call(name, "heartbeat", args, timeout=self.cfg.down_after)
        except (NodeDown, trio.TooSlowError, RemoteError) as exc:
            self.mark_down(name, str(exc) or "no heartbeat", since=sent)
            return
        self._seen(name, info.get("incarnation", 0))
        self.info[name] = info
        if info.get("view", 0) > self.view.epoch and isinstance(info.get("view_serving"), dict):
            serving = tuple(sorted((str(n), int(lease)) for n, lease in info["view_serving"].items()))
            self.learn_view(View(info["view"], serving, tuple(sorted(info.get("view_expelled", [])))))
        self.info_at[name] = trio.current_time()
        if self.vouched_at.get(name, -math.inf) < sent:  # else older than what the node told us
            self._set(name, info.get("state", DOWN))
        if self.follow_membership and info.get("epoch", 0) > self.epoch:  # a rebalance switched membership: follow it
            try:
                m = await self.call(name, "members")
            except (NodeDown, RemoteError) as exc:
                log.warning("membership %d from %s not fetched: %s", info["epoch"], name, exc)
                return
            if m["epoch"] > self.epoch:
                self.adopt([NodeSpec(n["name"], n["host"], n["port"]) for n in m["nodes"]], m["replicas"], m["epoch"])
                if self.on_adopt is not None:
                    self.on_adopt(m["epoch"])

    def know(self, specs: list[NodeSpec]) -> None:
        """Nodes this process may connect to before they are members (a rebalance's copies)."""
        for s in specs:
            self.known[s.name] = s

    def adopt(self, specs: list[NodeSpec], replicas: int, epoch: int) -> None:
        """Switch to a new membership: placement, heartbeats and connections follow it. Who the
        members are is read from ``members`` everywhere, never from the config, which a rebalance
        once changed in place under every service holding it."""
        old = set(self.members.names)
        self.members = Members(tuple(specs), replicas, epoch)
        for name in set(self.members.names) - old - {self.me}:
            self.state.setdefault(name, DOWN)
        for name in old - set(self.members.names):
            self.state.pop(name, None)
            self.info.pop(name, None)
            conn = self._conns.pop(name, None)
            if conn is not None:
                self.nursery.start_soon(conn.aclose)
        log.info("membership %d adopted: %s (R=%d)", epoch, ", ".join(self.members.names), replicas)
        self.changed.set()
        self.changed = trio.Event()

    async def refresh(self) -> None:
        """Probe every other node once, in parallel."""
        async with trio.open_nursery() as n:
            for name in list(self.state):
                n.start_soon(self._probe, name)

    async def heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.heartbeat)
            await self.refresh()

    async def wait_changed(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            await self.changed.wait()

    async def aclose(self) -> None:
        for conn in list(self._conns.values()):
            await conn.aclose()
        self._conns.clear()


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


def now_ns() -> int:
    return time.time_ns()

