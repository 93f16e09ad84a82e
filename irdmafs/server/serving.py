"""Whether a PS node serves now, and the checks every call makes of that.

A node is ``syncing`` (it takes replication, serves no reads and leads nothing) until it has
resynced, then ``ready``. ``Serving`` holds that state and what goes with it: the serving
generation (+1 at each turn to ready), the hand-over (``taken_over``: set once the stand-ins
have handed its stripes back), and, for a node fenced while it led, which stripes it gave
versions to and since when that is suspect (its resync then takes its peers' copies of them).

The checks, each answered with the error the caller acts on:

- ``require_ready``: EAGAIN unless ready; a stall (``check_stall``: the process did not run for
  most of ``down_after``: SIGSTOP, a paused VM) or a lost coordination lease (``check_lease``)
  fences it first, so a call queued while the process was stopped finds it fenced;
- ``check_primary``: ENOTPRIMARY naming the primary, unless this node leads the stripe;
- ``check_epoch``: every message that reads or changes data or training
  state carries its sender's view epoch. An older one is ESTALE (the sender refreshes its view
  and decides again); a newer one makes this node read the view first (EAGAIN if it still
  cannot see it). So two processes act on one message only when they hold the same view, and
  with it the same primary and replicas of every stripe; ``check_same_epoch`` checks it again
  where a commit installs, after its waits;
- ``check_sender``: replication only from the node that leads what it sends: the primary the
  receiver's view names (ESTALE otherwise);
- ``await_takeover``: primary work waits while the node takes its stripes back, then answers
  EAGAIN, well inside the caller's call timeout (a third of ``op_timeout``): a caller hears a
  refusal, which it follows for as long as the node's catch-up moves (runtime/silence.py), never
  silence, which counts the node down. (It waited the whole ``op_timeout``, the same as the
  caller's timeout: with a GB catch-up of 15 s every commit, push and namespace op sent
  meanwhile timed out, the mount counted the node down and a flush ended in ETIMEDOUT: 1 GiB
  chaos soak, a stopped metadata primary.) ``require_caught_up``: reads of its copies do not
  wait (EAGAIN at once).

membership.py moves a node between the states (joining, fencing); everything else only asks.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import trio

from ..runtime.cluster import READY, SYNCING, Cluster
from ..config import ClusterConfig
from ..errors import RemoteError
from .leases import ServingLease

log = logging.getLogger(__name__)


class Serving:
    def __init__(self, cfg: ClusterConfig, name: str, cluster: Cluster, lease: ServingLease, incarnation: int):
        self.cfg, self.name, self.cluster, self.lease = cfg, name, cluster, lease
        self.incarnation = incarnation
        self.on_state: Callable[[], None] | None = None  # told of every change of ``state`` (the node's status board)
        self._state = SYNCING
        self.gen = 0  # serving generation: +1 each time this node becomes ready (after a resync)
        self.ready_since = 0.0
        self.last_tick = 0.0  # when this process last ran its fence ticker or a heartbeat (trio clock)
        self.must_rejoin = False  # fenced by a stall or its lease: its fence loop resyncs it
        self.stalled = False  # fenced by a stall, the view still naming it: it steps aside (membership.py)
        self.taken_over = trio.Event()  # set once peers have handed this node its stripes back
        # this process has taken its stripes back once (a hand-over's catch-up done): from then
        # on it holds every acknowledged stripe of its homes, or a view expels it. Until then a
        # restarted process holds none (or what it loaded), while a view made before its crash
        # may still name it: its ``stripes`` listing is no evidence that a stripe was freed
        self.complete = False
        self.complete_term = 0  # the lease this node served under when it last caught up (``holds_all``)
        # (fid, idx, snap) -> when this node last gave the stripe a version as its primary. A
        # node fenced by a stall or its lease may have given versions whose replication never
        # finished (nor was acknowledged) while the next primary gave the same numbers to other
        # bytes: its resync takes its peers' copy of what it led since ``suspect_since``.
        self.led: dict[tuple[int, int, int], float] = {}
        self.suspect_since = math.inf

    # -- the checks --------------------------------------------------------------------------
    def check_now(self) -> None:
        """The checks before this node says or acts as ready: a stall, its lease (each fences)."""
        if self.state == READY:
            self.check_stall()
            self.check_lease()

    def require_ready(self) -> None:
        self.check_now()  # calls queued while this process was stopped find it fenced
        if self.state != READY:
            raise RemoteError("EAGAIN", f"node {self.name} is {self.state}")

    def check_primary(self, fid: int, idx: int) -> None:
        primary = self.cluster.roles.stripe_primary(fid, idx)
        if primary != self.name:
            raise RemoteError("ENOTPRIMARY", primary or "")

    async def check_epoch(self, epoch: int) -> None:
        """ESTALE for a message of an older view epoch; a newer one is read first (see above)."""
        view = self.cluster.roles.view
        if epoch > view.epoch:
            await self.lease.refresh()
            view = self.cluster.roles.view
        if epoch != view.epoch:
            code = "ESTALE" if epoch < view.epoch else "EAGAIN"
            raise RemoteError(code, f"sent in view {epoch}; node {self.name} is in view {view.epoch}")

    def check_same_epoch(self, epoch: int) -> None:
        """``check_epoch`` again where a change is installed, without waiting: ESTALE if a new
        view came while the message waited here (for a lock, a freeze, the hand-over). Its
        sender may have given it up and sent it again in that view: installed late, it would
        go over what the new view acknowledged since."""
        view = self.cluster.roles.view
        if epoch != view.epoch:
            raise RemoteError("ESTALE", f"sent in view {epoch}; node {self.name} moved to view {view.epoch} while it waited")

    def check_sender(self, sender: str, leads: Callable[[], str | None]) -> None:
        """Replication only from the node that leads what it sends (``leads()``: its primary as
        this node's view names it): one that no longer does (stopped, cut off, expelled) may send
        what it began before, numbered as the next primary numbers other bytes. It is refused;
        it fences (a stall, its lease, the view) and resyncs."""
        if not sender:
            return
        primary = leads()
        if sender != primary:
            raise RemoteError("ESTALE", f"{sender} does not lead this in view {self.cluster.roles.view.epoch} ({primary} does)")

    async def await_takeover(self) -> None:
        """Primary work waits (briefly: see above) while this node takes its stripes back, and
        then finds it ready still: a view that no longer names it may have come meanwhile (its
        hand-over then hands nothing back; a push that had waited was taken with the node's old
        push count and refused as out of order: fault simulator, fresh seed 1124354834)."""
        if not self.taken_over.is_set():
            with trio.move_on_after(self.cfg.op_timeout / 3):
                await self.taken_over.wait()
            self.require_ready()
            self._check_taken_over()

    def require_caught_up(self) -> None:
        """EAGAIN at once unless ready and its stripes taken back: what is read from this node's
        copies (region keys, a snapshot's copy) waits for that, and the reader asks another."""
        self.require_ready()
        self._check_taken_over()

    def _check_taken_over(self) -> None:
        if not self.taken_over.is_set():
            raise RemoteError("EAGAIN", f"node {self.name} is taking over from its stand-ins")

    def caught_up(self) -> None:
        """Its hand-over's catch-up is done: it holds every acknowledged change of what it
        serves, under the lease it serves with now (none: 0, which no view names)."""
        self.complete = True
        self.complete_term = self.lease.term() if self.lease.holds() else 0

    def holds_all(self) -> bool:
        """Whether this node still holds every acknowledged change (``complete`` and more): it
        caught up under the lease the newest view it knows names it active with. A view never
        names a lease active again once one dropped or expelled it (coord/views.py V2, V6), so
        no view since left it out, and every change acknowledged since reached it (views that
        keep a node whose lease ended named, V7, keep this true through a coordinator outage).
        A node expelled and named again under a new lease lacks what was acknowledged while it
        was out until its next catch-up (mixed seed 208)."""
        view = self.cluster.roles.view
        return self.complete and self.name in view.active and view.lease_of(self.name) == self.complete_term

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        changed, self._state = value != self._state, value
        if changed and self.on_state is not None:
            self.on_state()

    def led_now(self, key: tuple[int, int, int]) -> None:
        """This node gave stripe ``key`` a version as its primary, now."""
        self.led[key] = trio.current_time()

    # -- fencing -----------------------------------------------------------------------------
    def fence(self, why: str, suspect_since: float) -> None:
        """Stop serving until a resync; what this node led since ``suspect_since`` may not have
        reached its peers, so that resync takes their copy of it."""
        log.warning("node %s fenced: %s; it serves nothing until it has resynced", self.name, why)
        self.suspect_since = suspect_since
        self.state = SYNCING

    def check_stall(self) -> None:
        """Fence at once if this process did not run for most of ``down_after`` (SIGSTOP, a
        paused VM, swapping): its peers may have counted it down and gone on writing without
        it, and it cannot know. Called first thing by every heartbeat it answers and by its
        own ticker, whichever runs first after the stall, so no heartbeat answers "ready" in
        between (clients trust a node's state only from its heartbeats)."""
        now = trio.current_time()
        gap, self.last_tick = now - self.last_tick, now
        if gap > 0.8 * self.cfg.down_after and self.state == READY:
            # suspect: commits begun before the stall
            self.fence(f"it did not run for {gap:.1f} s (stopped or paused)", now - gap - self.cfg.op_timeout)
            self.must_rejoin = self.stalled = True

    def check_lease(self) -> None:
        """Fence at once when this node no longer holds its lease, or the
        newest view no longer names it (server/leases.py). Checked where ``check_stall`` is."""
        if self.state == READY and not self.lease.holds():
            self.fence(self.lease.why_not(), trio.current_time() - 2 * (self.cfg.op_timeout + self.cfg.down_after))
            self.must_rejoin = True

    def take_stalled(self) -> bool:
        """Whether this node fenced for a stall since the last ask (it then leaves the view)."""
        stalled, self.stalled = self.stalled, False
        return stalled

    def take_rejoin(self) -> bool:
        """Whether this node was fenced since the last ask (its fence loop then rejoins)."""
        fenced, self.must_rejoin = self.must_rejoin, False
        return fenced

    def begin_join(self) -> None:
        """(Re)joining: syncing, and its stripes not yet taken back (membership.py)."""
        self.state = SYNCING
        self.taken_over = trio.Event()

    def became_ready(self) -> None:
        """Resynced: serve, as a new generation, with nothing suspect."""
        self.suspect_since = math.inf
        self.led.clear()  # what it led before is settled by this resync
        self.gen += 1  # a new serving generation (heartbeats and status show it)
        self.ready_since = self.last_tick = trio.current_time()
        self.state = READY  # last: its status (``on_state``) shows the new generation
