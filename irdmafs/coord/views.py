"""Views: which nodes serve, each view with an epoch, kept in the coordination service.

Keys, under ``/irdmafs/<cluster>/``:

- ``alive/<node>``: put by a node ready to serve (it has resynced), with its lease. It is gone
  once that lease ends: the node stopped keeping it alive (dead, stopped, cut off from etcd) or
  it was revoked (the node left, or a peer expelled it).
- ``view``: ``{"serving": {node: lease}, "expelled": [node]}``. Its ``mod_revision`` is the
  view's *epoch*. The nodes it names and does not mark expelled are its ``active`` ones: they
  serve, and every stripe's primary and replicas are chosen among them (runtime/roles.py).

The rules, each with a test in tests/unit/test_views.py:

V1. A new view is a compare-and-set of the view key against the epoch it replaces. Views form one
    chain, epochs only grow, and two processes that hold the same epoch hold the same view.
V2. A view adds a member as soon as its alive key exists, under the lease that key lives by. It
    drops a node only after the proposer has seen that node's alive key gone for ``ttl``
    seconds. So the lease the old view named has ended by etcd's count, and by the node's own
    count too (V3): a view never drops a node that may still serve. A member whose key is under
    another lease is named under that one at once: a node takes a new lease only once it has
    stopped holding the old one (or as a new process, the old one dead). A proposer adds only
    the members of its own config, but drops any node, member or not, by that rule alone:
    during a rebalance configs differ (a node started for it names itself, the others do not
    yet), and views dropping it at once and naming it again fenced it at each turn.
V3. A node serves only while it holds its lease, by its own clock: until ``sent + ttl`` of the
    last keepalive etcd answered, ``sent`` being when that keepalive was sent. etcd ends the lease
    no earlier than ``ttl`` after it received it, so the node stops first (clock rates agreeing,
    as every lease assumes). A stalled process (SIGSTOP, a paused VM) finds its time run out the
    moment it runs again, before it answers anything.
V4. A node serves only in a view that names it with the lease it holds now (``serving``). A node
    that lost its lease takes a new one and must be dropped and added again (V2): a new epoch.
V5. While etcd is unreachable there is no new view; nodes serve until their leases end (V3), then
    stop; ``unreachable_since`` says since when, for the status line.
V6. To expel a peer it cannot replicate to, a node that serves commits a view marking the peer
    expelled (a CAS on the view it serves in, so of two nodes expelling each other one wins and
    the other finds itself expelled), then revokes the peer's lease. A view never expels below a
    majority of the members active, counting only the proposer's members (so one node cut off
    from the others cannot expel them all, nor count a node started for a rebalance;
    the node also asks its own heartbeats first, server/replicator.py). An expelled node is not
    active: it stops serving as soon as it reads that view, and by its own count when its lease
    ends; the view drops it ``ttl`` after its alive key is gone (V2) and names it again, not
    expelled, once it announces itself under a new lease. A node fenced for a stall expels
    itself the same way (server/membership.py), under the same limits.

V7. A view leaves at most R-1 members out (not active in it; R: the members' replicas). A node
    V2 would drop stays named, under the lease the view names (ended or not), while dropping it
    would leave more out (the first in name order stay), and an expel (V6) that would is
    refused. A stripe's R homes each hold it once their hand-over is done, and nothing copies a
    stripe to a new home but a write to it or that home's hand-over from an active node, so with
    more than R-1 members out a stripe may have no active node that holds it: its primary would
    be a node that never held it and would serve it empty. Kept named, its holder's stripes are
    unavailable (their primary does not answer) until it is back. (Every node lost its lease in
    a coordinator outage longer than the TTL; the first one announced again made a view naming
    itself alone, led stripes it had never held, and a push found no bookkeeping: the model's
    state was lost. The fault simulator, mixed seed 19 with the default heartbeats.)

Only nodes holding their lease propose views; clients read them (``ViewReader``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import trio

from ..config import Members
from .contract import Coordinator
from ..errors import CoordError, LeaseGone, CoordUnavailable as Unavailable

log = logging.getLogger(__name__)


def prefix_of(cluster: str) -> str:
    return f"/irdmafs/{cluster}/"


@dataclass(frozen=True)
class View:
    """One view: its epoch and the serving nodes, each with the lease it serves under."""

    epoch: int = 0
    serving: tuple[tuple[str, int], ...] = ()
    expelled: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.serving)

    @functools.cached_property
    def active(self) -> tuple[str, ...]:
        """The nodes this view names and does not mark expelled: those that serve in it (a
        view never changes: asked for every stripe a read or a push routes, found once)."""
        return tuple(name for name, _ in self.serving if name not in self.expelled)

    def lease_of(self, name: str) -> int:
        return dict(self.serving).get(name, 0)

    @staticmethod
    def decode(value: bytes, epoch: int) -> "View":
        """The view key's value as read at ``epoch``; CoordError if it is not a view."""
        try:
            doc = json.loads(value)
            serving = tuple(sorted((str(n), int(lease)) for n, lease in doc["serving"].items()))
            expelled = tuple(sorted(str(n) for n in doc.get("expelled", [])))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CoordError(f"the view key does not hold a view ({exc}): {value[:200]!r}") from None
        return View(epoch, serving, expelled)

    def encode(self) -> bytes:
        return json.dumps({"serving": dict(self.serving), "expelled": list(self.expelled)}, sort_keys=True).encode()


class ViewReader:
    """The newest view a process has read, for clients and nodes alike."""

    def __init__(self, coord: Coordinator, cluster: str):
        self.coord = coord
        self.prefix = prefix_of(cluster)
        self.view = View()
        self.unreachable_since = math.inf
        self.on_view: list[Callable[[View], None]] = []  # called with each newer view learnt

    async def read(self) -> tuple[View, dict[str, int]]:
        """Read the view and the alive keys (node -> lease) at one revision; keep the view if newer."""
        try:
            entries, _ = await self.coord.range(self.prefix)
        except Unavailable:
            self.unreachable_since = min(self.unreachable_since, trio.current_time())
            raise
        self.unreachable_since = math.inf
        alive = {e.key[len(self.prefix) + len("alive/") :]: e.lease for e in entries if e.key.startswith(self.prefix + "alive/")}
        view = next((View.decode(e.value, e.mod_revision) for e in entries if e.key == self.prefix + "view"), View())
        self.learn(view)
        return self.view, alive

    def learn(self, view: View) -> None:
        """Keep ``view`` if it is newer than the one held (one read, or a CAS that committed it)."""
        if view.epoch > self.view.epoch:
            out = f" ({', '.join(view.expelled)} expelled)" if view.expelled else ""
            log.info("view %d: serving %s%s", view.epoch, ", ".join(view.active) or "nothing", out)
            self.view = view
            for callback in self.on_view:
                callback(view)


def members_out(active: set[str], members: Members) -> int:
    """V7: how many members a view whose active nodes are ``active`` leaves out."""
    return sum(n not in active for n in members.names)


@dataclass
class _Lease:
    """The lease a node holds, and until when it holds it by its own clock (V3)."""

    id: int = 0
    until: float = -math.inf

    def held(self) -> bool:
        return self.id != 0 and trio.current_time() < self.until


@dataclass
class ViewKeeper:
    """A node's side: keeps its lease, says when it is alive, proposes views (V1-V6).

    ``members()``: the membership views may name (config.Members, as it is now: a rebalance
    replaces it), with its replicas (V7).
    ``run`` keeps it all going; the node
    calls ``announce`` once it is ready to serve and asks ``serving()`` before anything it serves.
    """

    coord: Coordinator
    cluster: str
    name: str
    members: Callable[[], Members]
    ttl: int = 2
    reader: ViewReader = field(init=False)
    lease: _Lease = field(default_factory=_Lease)
    announced: bool = False
    _missing_since: dict[tuple[str, int], float] = field(default_factory=dict)
    _kept: list[str] = field(default_factory=list)  # the nodes V7 keeps named, as last logged

    def __post_init__(self) -> None:
        self.reader = ViewReader(self.coord, self.cluster)

    @property
    def view(self) -> View:
        return self.reader.view

    @property
    def interval(self) -> float:
        """How often the lease is kept alive and the view read: a quarter of the TTL, at most
        half a second (a long TTL, to ride out an etcd restart, must not slow down views)."""
        return min(self.ttl / 4, 0.5)

    def serving(self) -> bool:
        """V3, V4, V6: this node holds its lease, and the newest view it knows names it with it
        and does not mark it expelled."""
        return self.lease.held() and self.view.lease_of(self.name) == self.lease.id and self.name not in self.view.expelled

    # -- the lease ---------------------------------------------------------------------------
    async def keep_lease(self) -> None:
        """Take a lease and keep it alive; when it ends, take a new one (the node must then be
        announced again, after it resynced: ``announced`` turns False)."""
        while True:
            sent = trio.current_time()
            try:
                if not self.lease.id:
                    lease = await self.coord.grant(self.ttl)
                    self.lease = _Lease(lease, sent + self.ttl)
                    log.info("node %s: lease %x taken", self.name, lease)
                elif await self.coord.keepalive(self.lease.id) > 0:
                    self.lease.until = sent + self.ttl
                else:
                    self._lost_lease("it ended")
                    continue
            except Unavailable as exc:
                log.debug("keepalive not sent: %s", exc)
            except CoordError as exc:
                log.warning("node %s: lease: %s", self.name, exc)
            await trio.sleep(self.interval)

    def _lost_lease(self, why: str) -> None:
        log.warning("node %s: lease %x lost (%s): it serves nothing until it is announced again", self.name, self.lease.id, why)
        self.lease = _Lease()
        self.announced = False

    async def announce(self) -> None:
        """This node is ready to serve: its alive key, under its lease (LeaseGone: take a new
        lease first; Unavailable: try again later)."""
        if not self.lease.held():
            raise LeaseGone(f"node {self.name} holds no lease")
        try:
            await self.coord.put(self.prefix + "alive/" + self.name, b"{}", lease=self.lease.id)
        except LeaseGone:
            self._lost_lease("gone when announced")
            raise
        self.announced = True

    async def leave(self) -> None:
        """Stop serving for good: revoke the lease (the view drops this node ``ttl`` later)."""
        lease, self.lease = self.lease.id, _Lease()
        self.announced = False
        if lease:
            await self.coord.revoke(lease)

    async def expel(self, peer: str) -> bool:
        """V6: commit a view in which ``peer`` is expelled, then end its lease. False if this
        node does not serve, ``peer`` is not active in its view, the view would keep less than a
        majority active, or another view came first (it is read: decide again). Unavailable if
        the coordinator cannot be reached."""
        view = self.view
        if not self.serving() or peer not in view.active:
            return False
        config = self.members()
        members = set(config.names)
        if len(members.intersection(view.active)) - 1 < len(members) // 2 + 1:
            log.warning("node %s does not expel %s: view %d would keep less than a majority active", self.name, peer, view.epoch)
            return False
        if members_out(set(view.active) - {peer}, config) > config.replicas - 1:
            log.warning("node %s does not expel %s: with %d replicas its stripes would have no copy left (V7)", self.name, peer, config.replicas)
            return False
        proposal = View(0, view.serving, tuple(sorted({*view.expelled, peer})))
        done, revision = await self.coord.cas(self.prefix + "view", view.epoch, proposal.encode())
        if not done:
            await self.reader.read()
            return False
        self.reader.learn(View(revision, proposal.serving, proposal.expelled))
        lease = view.lease_of(peer)
        log.warning("node %s expels %s (lease %x) in view %d", self.name, peer, lease, revision)
        try:
            await self.coord.revoke(lease)
        except CoordError as exc:  # it ends by itself; the view already keeps the peer out
            log.warning("lease %x of %s not revoked: %s", lease, peer, exc)
        return True

    @property
    def prefix(self) -> str:
        return self.reader.prefix

    # -- views -------------------------------------------------------------------------------
    async def keep_views(self) -> None:
        """Read the view every ``interval``; propose the next one when it is due (V1, V2)."""
        while True:
            try:
                view, alive = await self.reader.read()
                if self.lease.held():
                    await self.propose(view, alive)
            except Unavailable as exc:
                log.debug("view not read: %s", exc)
            except CoordError as exc:
                log.warning("view: %s", exc)
            await trio.sleep(self.interval)

    def next_serving(self, view: View, alive: dict[str, int]) -> dict[str, int]:
        """V2 and V7: who the next view names, from the view and the alive keys read at one revision."""
        now = trio.current_time()
        config = self.members()
        members = set(config.names)
        serving = {n: lease for n, lease in alive.items() if n in members}
        for name, lease in view.serving:
            if alive.get(name) == lease:
                self._missing_since.pop((name, lease), None)
                serving[name] = lease  # a member or not: dropped only once its key is gone
                continue
            if name in alive:
                # its key under another lease: the node took it after it lost this one (or it
                # restarted), so nothing serves under this one any more: named under the new
                # one at once, not a ttl later (with a long ttl a restarted node stayed
                # named under its old lease, refusing the writes its stripes needed)
                self._missing_since.pop((name, lease), None)
                serving[name] = alive[name]
                continue
            since = self._missing_since.setdefault((name, lease), now)
            if now - since < self.ttl:
                # its key gone, or under another lease, for less than ttl: the lease the view
                # names may not have ended by the node's count yet; it stays until it has
                serving[name] = lease
        gone = [n for n in view.active if n in members and n not in serving]
        expelled = {n for n in view.expelled if serving.get(n) == view.lease_of(n)}  # as ``propose`` keeps them
        out = members_out(set(serving) - expelled, config)
        kept = gone[: max(0, out - (config.replicas - 1))]  # V7: the first in name order stay
        if kept != self._kept:
            if kept:
                log.warning("node %s: views keep %s named (gone) so that every stripe keeps a copy (V7)", self.name, ", ".join(kept))
            self._kept = kept
        for name in kept:
            serving[name] = view.lease_of(name)
        return serving

    async def propose(self, view: View, alive: dict[str, int]) -> View:
        """Commit the next view if it differs from ``view``; the newest view known after."""
        serving = self.next_serving(view, alive)
        # an expelled node stays expelled while the view names it under the same lease (V6)
        expelled = tuple(n for n in view.expelled if n in serving and serving[n] == view.lease_of(n))
        if serving == dict(view.serving) and expelled == view.expelled:
            return view
        proposal = View(0, tuple(sorted(serving.items())), expelled)
        done, revision = await self.coord.cas(self.prefix + "view", view.epoch, proposal.encode())
        if done:
            self.reader.learn(View(revision, proposal.serving, proposal.expelled))
            for key in [k for k in self._missing_since if k not in proposal.serving]:
                del self._missing_since[key]
        return self.view

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Keep the lease and the views until cancelled; started once the first lease is held."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.keep_lease)
            while not self.lease.id:
                await trio.sleep(self.interval / 4)
            task_status.started()
            nursery.start_soon(self.keep_views)
