"""One process's view of the cluster: who the members are, which view is in force, and who is
primary for what; the connections (peers.py) and the liveness (liveness.py) it is made of.

Nodes and clients both hold a ``Cluster``. It heartbeats the nodes (``heartbeat_loop``).

Who serves is decided by views alone (coord/views.py): the newest view known names the active
nodes, and another node is ready if that view names it active, else down, whatever heartbeats
say (a node still answers for itself, through ``my_state``). Every process that holds the same
view epoch then names the same primary and replicas for a stripe. Views come from the
coordinator (a node's ``ViewKeeper``) and from heartbeats, which carry the view their node holds;
a newer epoch always replaces an older one (coord/views.py, V1). A process starts with the empty
view (epoch 0, nobody active) and routes nothing until it has learnt one.

Heartbeats keep each node's liveness (liveness.py: it orders a read's replicas, aborts what waits
on a node that stopped answering, and tells a node which peers to expel; it never decides who
serves), its incarnation (peers.py), the view it holds, and the membership it works with (a
rebalance's new one is followed when a heartbeat says its epoch).

From the view, the membership (``members``, a value a rebalance replaces whole) and the pure
placement and routing functions (placement.py, routing.py) it answers: the metadata primary
(first active member), a stripe's primary (first active node in the stripe's rendezvous
ranking), the replicas a write must reach, and the order in which to try replicas for a read
(its active homes, least-loaded first, then the one that served this process the fewest bytes).
A reply acknowledged in a newer view than the one held
brings that view before the call returns (``follow_acked``).

Concurrency: one trio thread; the heartbeat task runs in the nursery given to the constructor.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import trio

from . import routing
from .config import ClusterConfig, Members, NodeSpec
from .coord.views import View
from .liveness import DOWN, READY, SYNCING, Liveness
from .peers import NodeDown, Peers
from .placement import rank, stripe_key
from .regions import Header
from .transport.base import Connection, RemoteError, TransportError, Transport
from .util import Shared

log = logging.getLogger(__name__)

STALLED = 0.1  # a heartbeat's timeout seen this late (a share of down_after): this process stalled, ask again

__all__ = ["DOWN", "READY", "SYNCING", "Cluster", "Unavailable", "now_ns"]


class Unavailable(TransportError):
    """No live replica could serve a stripe (the file system answers EIO)."""


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
        self.me = me
        self._my_state = my_state or (lambda: DOWN)
        # membership: the config's nodes (epoch 0) until a rebalance switches every process over;
        # a value replaced whole by ``adopt`` (the config stays as loaded: every service holds it)
        self.members: Members = cfg.members()
        self.known: dict[str, NodeSpec] = {}  # nodes reachable though not (yet) members
        self.on_adopt: Callable[[int], None] | None = None
        self.follow_membership = True  # False for a rebalance coordinator, which sets it itself
        self.liveness = Liveness(lambda name: name in self.members.names or name in self.known)
        self.liveness.track(set(self.members.names) - {me})
        self.peers = Peers(cfg, transport, nursery, spec=self._spec, lost=self.mark_down, is_down=self.liveness.is_down, counts_timeouts=me is not None)
        self.liveness.on_down.append(self.peers.abort)
        # sent with every heartbeat: "owner" keeps this process's staging leased (server/node.py)
        self.heartbeat_args: dict = {}
        self.view: View = View()  # the newest view known (see above); epoch 0: none yet
        self.on_view: list[Callable[[View], None]] = []  # called with each newer view learnt
        self._probes = Shared()  # one heartbeat probe of a node at a time (``refresh``)

    @property
    def nursery(self) -> trio.Nursery | None:
        return self.peers.nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery) -> None:
        self.peers.nursery = nursery

    def _spec(self, name: str) -> NodeSpec | None:
        return self.members.spec(name) or self.known.get(name)

    @property
    def epoch(self) -> int:
        """The membership's epoch (0: the config's), which heartbeats carry."""
        return self.members.epoch

    @property
    def view_epoch(self) -> int:
        """The epoch every message that changes data carries (0: no view learnt yet)."""
        return self.view.epoch

    def learn_view(self, view: View) -> None:
        """Keep ``view`` if it is newer than the one held; it decides who serves from now on."""
        if view.epoch <= self.view.epoch:
            return
        self.view = view
        for callback in self.on_view:
            callback(view)
        self.liveness.notify()

    # -- who serves ----------------------------------------------------------------------------
    def node_state(self, name: str) -> str:
        if name == self.me:
            return self._my_state()
        return READY if name in self.view.active else DOWN

    def vouch(self, name: str, state: str) -> None:
        """A node told us its state itself (liveness.py)."""
        self.liveness.vouch(name, state)

    def mark_down(self, name: str, why: str, since: float | None = None) -> None:
        """Drop the connection to ``name`` and count it down (liveness.py: unless the failure is
        of an operation begun ``since`` before the node vouched for itself)."""
        self.peers.drop(name)
        if name != self.me:
            self.liveness.mark_down(name, why, since)

    def heard_majority(self) -> bool:
        """Whether this node and the peers its own heartbeats reach are a majority of the members."""
        return self.liveness.heard_majority(self.members.names, self.me)

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
        ranking), least-loaded first, of those the one that served this process the fewest
        bytes (so a file's reads spread over its homes by bytes, not all to its primaries: four
        readers of one snapshot on four nodes sent 22-30% of the bytes from each node), and one
        this process's own heartbeats count down (a stopped node, until the view expels it)
        last. They hold every acknowledged write once caught up (their ``stripe_info`` waits
        for that).

        A stand-in (a node past the first R that took writes while a home was expelled) is
        never asked while a home is active: it holds only what it took while it stood in. A
        mount on the minority side of a cut, reaching neither home, read a stand-in's copy from
        an earlier view, and a write acknowledged since by the homes read back old (chaos,
        seed 7). Reaching no home, the read is unavailable (EIO) rather than old. Only a view
        that names no home active (every home expelled: R=1, or R=2 on five nodes and more)
        leaves the stand-ins it writes to, the only copies it acknowledges writes on."""
        order = lambda n: (self.liveness.is_down(n), self.peers.load[n], self.peers.served[n])  # noqa: E731
        return routing.read_candidates(self.stripe_rank(fid, idx), self.members.replicas, self.node_state, order)

    # -- calls: peers.py's, and the view an answer was acknowledged in -----------------------------
    async def call(self, name: str, method: str, args: dict | None = None, *, timeout: float | None = None) -> dict:
        """A control call; a node that cannot be reached is marked down and raises NodeDown."""
        return (await self.call_on(name, method, args, timeout=timeout))[0]

    async def call_on(self, name: str, method: str, args: dict | None = None, *, timeout: float | None = None) -> tuple[dict, int]:
        """``call``, and the incarnation that answered: the one any key in the reply belongs to."""
        reply, incarnation = await self.peers.call_on(name, method, args, timeout=timeout)
        await self.follow_acked(reply)
        return reply, incarnation

    async def write(self, name: str, rkey: int, offset: int, data, inc: int | None = None) -> None:
        """A one-sided WRITE (peers.py)."""
        await self.peers.write(name, rkey, offset, data, inc)

    async def write_imm(self, name: str, rkey: int, offset: int, data, imm: int, inc: int | None = None) -> dict:
        """A WRITE with immediate (peers.py), and the view its answer was acknowledged in."""
        reply = await self.peers.write_imm(name, rkey, offset, data, imm, inc)
        await self.follow_acked(reply)
        return reply

    async def read_stripe(self, name: str, rkey: int, offset: int, into: memoryview, inc: int | None = None) -> Header:
        """A verified one-sided READ of a stripe (peers.py)."""
        return await self.peers.read_stripe(name, rkey, offset, into, inc)

    async def read_header(self, name: str, rkey: int, inc: int | None = None) -> Header:
        """A stripe's header alone: how a pull waits for a step (peers.py)."""
        return await self.peers.read_header(name, rkey, inc)

    async def read_headers(self, name: str, keys: list[tuple[int, int]]) -> list[Header]:
        """Several stripes' headers from one node in one burst (peers.py)."""
        return await self.peers.read_headers(name, keys)

    async def read_stripes(self, name: str, items: list[tuple[int, int, int, memoryview]]) -> list[Header | None]:
        """Several stripes of one node, each verified, in one burst (peers.py)."""
        return await self.peers.read_stripes(name, items)

    async def conn(self, name: str) -> Connection:
        return await self.peers.conn(name)

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

    async def after_lost(self) -> None:
        """A call to a node failed with NodeDown. Only a new view moves its work (a node that
        cannot be reached is expelled by its peers, coord/views.py V6): wait a heartbeat and ask
        the nodes for their view before trying again."""
        await trio.sleep(self.cfg.heartbeat)
        await self.refresh()

    # -- heartbeats ----------------------------------------------------------------------------
    async def _probe(self, name: str) -> None:
        """One heartbeat to ``name``: its answer is what liveness hears; none within down_after
        counts it down. Unless this process's own loop ran late past the deadline (a host that
        did not run it, work that held it): the answer may be in the socket unread, and the
        node's silence is not proven, so it is asked once more (a mount on a busy host counted
        working nodes down and dropped their connections with hundreds of reads in flight;
        issue 41, chaos --model-gib)."""
        args = {"from": self.me or "client", **self.heartbeat_args}
        for attempt in (1, 2):
            sent = trio.current_time()
            deadline = sent + self.cfg.down_after
            try:
                with trio.fail_at(deadline):
                    info = await self.call(name, "heartbeat", args, timeout=self.cfg.down_after)
                break
            except (NodeDown, trio.TooSlowError, RemoteError) as exc:
                late = trio.current_time() - deadline
                if attempt == 1 and late > STALLED * self.cfg.down_after:
                    log.info("heartbeat to %s: this process ran %.2f s past the deadline: asking again", name, late)
                    continue
                self.mark_down(name, str(exc) or "no heartbeat", since=sent)
                return
        self.peers.seen(name, info.get("incarnation", 0))
        if info.get("view", 0) > self.view.epoch and isinstance(info.get("view_serving"), dict):
            serving = tuple(sorted((str(n), int(lease)) for n, lease in info["view_serving"].items()))
            self.learn_view(View(info["view"], serving, tuple(sorted(info.get("view_expelled", [])))))
        self.liveness.heard(name, info, sent)
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

    async def refresh(self) -> None:
        """Probe every other node once, in parallel; a probe of a node already under way is
        waited for, not sent again (a pull's thousand reads each asking while a node was out
        sent thousands of heartbeats at once, which timed out behind one another and counted
        the working nodes down: chaos --model-gib 2)."""
        async with trio.open_nursery() as n:
            for name in list(self.liveness.state):
                n.start_soon(self._probes.run, name, self._probe, name)

    async def heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.heartbeat)
            await self.refresh()

    async def wait_changed(self, timeout: float) -> None:
        await self.liveness.wait_changed(timeout)

    # -- membership ----------------------------------------------------------------------------
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
        self.liveness.track(set(self.members.names) - old - {self.me})
        for name in old - set(self.members.names):
            self.liveness.forget(name)
            self.peers.drop(name)
        log.info("membership %d adopted: %s (R=%d)", epoch, ", ".join(self.members.names), replicas)
        self.liveness.notify()

    async def aclose(self) -> None:
        await self.peers.aclose()


def now_ns() -> int:
    return time.time_ns()
