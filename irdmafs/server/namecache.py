"""The metadata primary's cache leases: which mounts may cache names and attributes, and what
each must drop before a change is answered (docs/caching.md: the invariants C1-C7).

- A mount asks with a long-poll, ``wait(owner, acked)``: answered at once when invalidations are
  queued for it, else after ``hold`` seconds with none (a renewal). Each answer grants a lease
  of ``lease`` seconds counted from the answer here; the answer says how long the call was held,
  so the mount counts the same lease from when it sent the call, and its lease always ends
  first. ``acked`` is the highest sequence number the mount has applied to its kernel: every
  invalidation up to it is dropped from its queue.
- A change (``touched``) queues its invalidation for every lease but its changer's; ``settle``
  then waits until each of those has acknowledged it or has ended by this node's clock (C1).
  The changer invalidates its own kernel entries itself (C5); waiting for it would deadlock on
  the kernel's lock of the very directory it changes.
- A node that starts leading (a failover, a restart, a view it did not lead the view before)
  answers changes EAGAIN for ``lease + margin`` (``in_grace``), if any mount caches at all (the
  namespace records the owners that ever took a lease, replicated: ``Meta.cachers``): by then
  every lease an earlier primary granted has ended (C4).
- Bounded (C6): a queue past ``MAX_QUEUED`` invalidations becomes one "drop everything".

Concurrency: one trio thread; the state is only touched between awaits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import trio

log = logging.getLogger(__name__)

MAX_QUEUED = 1000  # invalidations queued for one mount; beyond, it drops everything it cached
STALE_LEASES = 3  # a recorded owner not heard from for this many leases is dropped (``stale``)


@dataclass(frozen=True)
class Touch:
    """What one namespace change made stale: directory entries (parent, name) and inodes whose
    attributes changed; ``everything`` for changes that touch more than they name."""

    seq: int
    entries: tuple[tuple[int, str], ...] = ()
    inodes: tuple[int, ...] = ()
    everything: bool = False

    def doc(self) -> list:
        return [self.seq, [list(e) for e in self.entries], list(self.inodes), self.everything]


# op kinds whose effects are more than the names and inodes they carry (a snapshot's listing,
# a bucket's members): every cached name and attribute goes
_EVERYTHING = {"snapshot", "unsnapshot", "pack", "unpack"}


def changer_of(op: dict) -> str | None:
    """The owner of the client that sent ``op`` (its request id is "<owner>:<n>")."""
    rid = op.get("rid")
    return rid.rsplit(":", 1)[0] if isinstance(rid, str) and ":" in rid else None


def touched_by(seq: int, op: dict, result: dict) -> Touch | None:
    """What op ``seq`` made stale, from the op and its result; None for an op that changes
    nothing a mount caches (a cache owner recorded)."""
    kind = op["op"]
    if kind == "cacher":
        return None
    if kind in _EVERYTHING:
        return Touch(seq, everything=True)
    entries = [(op[p], op[n]) for p, n in (("parent", "name"), ("new_parent", "new_name")) if p in op and n in op]
    inodes = {op[k] for k in ("parent", "new_parent", "ino") if isinstance(op.get(k), int)}
    inodes |= {result[k] for k in ("ino", "freed") if isinstance(result.get(k), int)}
    return Touch(seq, tuple(entries), tuple(sorted(inodes)))


@dataclass(eq=False)
class _Lease:
    until: float  # this node's clock: the lease ends (extended by each answer)
    queue: list = field(default_factory=list)  # Touches not yet acknowledged
    acked: int = 0  # the highest seq the mount applied
    told: trio.Event = field(default_factory=trio.Event)  # set when something is queued
    seen: float = 0.0  # the last call from it
    owed_since: float = 0.0  # when its queue last became non-empty


class NameLeases:
    def __init__(self, lease: float, clock: Callable[[], float] = trio.current_time):
        self.lease, self.margin, self.hold = lease, lease / 10, min(lease / 4, 1.0)
        self.clock = clock
        self.leases: dict[str, _Lease] = {}
        self.acks = trio.Event()  # set (and replaced) whenever a mount acknowledges
        self._led: tuple[int, float] | None = None  # (serving generation, since when) this node leads
        self.inherited = False  # mounts recorded before this lead began may hold leases
        self.waits = 0  # changes that waited for an acknowledgement (tests, metrics)

    @property
    def on(self) -> bool:
        return self.lease > 0

    # -- leading ---------------------------------------------------------------------------
    def leads(self, epoch: int, cachers, gen: int) -> None:
        """This node is metadata primary in view ``epoch``, in its serving generation ``gen``
        (serving.py: +1 each time it becomes ready), the namespace recording ``cachers``. A
        lead goes on while the node stays ready (the same generation) and primary in every
        view it learns (``view``) and at every call (``end`` otherwise); anything else begins
        a new one: a node that was fenced, expelled or not primary meanwhile may have missed
        another primary's leases. Only owners recorded before a lead began may hold a lease
        another primary granted: a mount recorded during it took its first lease here."""
        if self._led is not None and self._led[0] == gen:
            return
        self._led = (gen, self.clock())
        self.inherited = bool(cachers)
        self.leases.clear()  # any granted in a lead it lost track of end within the grace
        if self.inherited and self.on:
            log.info("metadata primary in view %d: changes wait %.1f s for the mounts' name caches to lapse", epoch, self.in_grace())

    def view(self, epoch: int, primary: bool, cachers, gen: int) -> None:
        """A view learnt: the lead goes on if this node is primary in it, else it ends."""
        if primary:
            self.leads(epoch, cachers, gen)
        else:
            self.end(epoch)

    def end(self, epoch: int) -> None:
        """This node found another primary (or none) in view ``epoch``: a later lead starts anew."""
        if self._led is not None:
            log.info("view %d names another metadata primary: this node's lead ends", epoch)
        self._led = None

    def in_grace(self) -> float:
        """Seconds left before a new lead may answer changes (0: none): a lease and a margin
        from its start, if any mount recorded before it may cache names (C4)."""
        if self._led is None or not self.inherited:
            return 0.0
        return max(0.0, self._led[1] + self.lease + self.margin - self.clock())

    def stale(self, owners) -> list[str]:
        """Of the recorded ``owners``, those this lead has not heard from for STALE_LEASES
        leases (their record goes: a mount killed for good stops costing every failover a grace)."""
        if self._led is None:
            return []
        now = self.clock()
        heard = lambda o: self.leases[o].seen if o in self.leases else self._led[1]  # noqa: E731
        return [o for o in owners if now - heard(o) > STALE_LEASES * self.lease]

    # -- the mounts' side --------------------------------------------------------------------
    async def wait(self, owner: str, acked: int, seq: int) -> dict:
        """The long-poll: acknowledge up to ``acked``; return the invalidations queued for
        ``owner`` (at once if any, else after ``hold``) and a new lease. ``seq``: the namespace's
        sequence number now (a mount's first call starts its acknowledgements there)."""
        now = self.clock()
        lease = self.leases.get(owner)
        if lease is None or lease.until < now:  # a new lease: nothing it cached before counts
            lease = self.leases[owner] = _Lease(until=now, acked=seq)
            fresh = True
        else:
            fresh = False
        lease.seen = now
        if acked > lease.acked:
            lease.acked = acked
            lease.queue = [t for t in lease.queue if t.seq > acked]
            self.acks.set()
            self.acks = trio.Event()
        if not lease.queue:
            with trio.move_on_after(self.hold):
                await lease.told.wait()
        lease.told = trio.Event()
        if self.leases.get(owner) is not lease:
            raise LookupError(owner)  # dropped meanwhile (a new lead): no lease from this call
        held = self.clock() - now
        if not lease.queue or self.clock() - lease.owed_since < self.lease:
            # renewed; not while it owes an acknowledgement for a whole lease (a mount that
            # answers but does not apply what it is told must not hold a change up for good)
            lease.until = self.clock() + self.lease
        return {"lease": max(0.0, lease.until - self.clock()), "held": held, "fresh": fresh, "acked": lease.acked, "inval": [t.doc() for t in lease.queue]}

    # -- the changes' side -------------------------------------------------------------------
    def touched(self, changer: str | None, touch: Touch) -> list[str]:
        """Queue ``touch`` for every live lease but ``changer``'s; the owners to wait for."""
        now, owed = self.clock(), []
        for owner, lease in list(self.leases.items()):
            if lease.until < now:
                if now - lease.until > self.lease:
                    del self.leases[owner]  # long over: its next call starts a new lease
                continue
            if owner == changer:
                continue
            if not lease.queue:
                lease.owed_since = now
            if touch.everything or len(lease.queue) >= MAX_QUEUED or lease.queue and lease.queue[-1].everything:
                lease.queue = [Touch(touch.seq, everything=True)]  # subsumes what was queued
            else:
                lease.queue.append(touch)
            lease.told.set()
            owed.append(owner)
        return owed

    def owing(self, seq: int) -> list[str]:
        """The owners with an invalidation up to ``seq`` still unacknowledged."""
        return [o for o, lease in self.leases.items() if any(t.seq <= seq for t in lease.queue)]

    async def settle(self, owners: list[str], seq: int) -> None:
        """Until each of ``owners`` acknowledged every invalidation up to ``seq`` queued for it,
        or its lease ended (C1)."""
        while True:
            now = self.clock()
            left = [o for o in owners if (lease := self.leases.get(o)) is not None and lease.until >= now and any(t.seq <= seq for t in lease.queue)]
            if not left:
                return
            self.waits += 1
            end = min(self.leases[o].until for o in left)
            acks = self.acks
            with trio.move_on_at(end + 0.001):
                await acks.wait()
