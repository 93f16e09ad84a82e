"""This mount's name cache lease: how long the kernel may cache the names and attributes it is
told, and dropping them when another mount changes them (docs/caching.md, invariants C1-C7;
the metadata primary's side is server/namecache.py).

- ``run``: one task keeps a long-poll ``cache_wait`` to the metadata primary going (and
  ``release``, at a clean unmount, gives the lease up). Each answer
  brings the invalidations queued for this mount and a lease, counted from when the call was
  sent (so it ends before the primary's count of it). The invalidations are applied to the
  kernel, and only then acknowledged, by the next call.
- ``entry``/``attrs``: a stat the VFS is about to answer, with the kernel timeouts it may carry
  now: what is left of the lease less a margin (C2); none without a lease, or if an
  invalidation was applied since the call that fetched it began (``begin``: C3), or past
  ``MAX_GIVEN`` names handed out (C6). What is handed out is remembered, so that "drop
  everything" can drop it.
- The kernel's invalidations (fs/ops.py's ``kernel_drop``, handed to ``run``) run in a worker
  thread: pyfuse3's calls block until the kernel has finished any related request, which this
  mount's own loop may be serving.

Without a session (the VFS awaited directly in tests) or with caching off on the cluster
(``name_lease`` 0: the node answers ENOSYS), nothing is cached, as before leases.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, NamedTuple

import trio

from ..errors import NodeDown, RemoteError, TransportError
from .listings import Listings
from .lookups import Lookups

log = logging.getLogger(__name__)

MAX_GIVEN = 200_000  # names and inodes handed out with a timeout within two leases; beyond, none more
RETRY = 0.2  # seconds between attempts while the primary cannot be reached


class NameLease:
    def __init__(self, client, forget: Callable[[set, set, bool], None]):
        """``client``: whose ``cache_wait`` keeps the lease and whose ``op`` gives it up (a
        Client's ``meta``: client/meta.py); ``forget(entries, inodes, everything)``: what else
        the mount forgets when told (its lookup notes, its listings), called before the
        acknowledgement."""
        self._client, self._forget = client, forget
        self._drop: Callable[[list, list], None] | None = None  # the kernel's (``run``)
        self.until = -math.inf  # trio clock: the lease ends
        self.margin = 0.0
        self.span = 0.0  # the longest timeout a lease allowed: older handouts have expired
        self.acked = 0  # the highest namespace seq applied
        self.applied = 0  # invalidations applied so far (C3)
        # what was handed out with a timeout, this span and the one before (what went out
        # earlier has left the kernel: no timeout outlives a span)
        self._given: list[set[tuple[int, str]]] = [set(), set()]
        self._given_inodes: list[set[int]] = [set(), set()]
        self._rotated = -math.inf
        self.running = False

    @property
    def given(self) -> set[tuple[int, str]]:
        return self._given[0] | self._given[1]

    @property
    def given_inodes(self) -> set[int]:
        return self._given_inodes[0] | self._given_inodes[1]

    def _handing_out(self) -> None:
        """Before a handout: a span over, the older set goes (its timeouts have run out)."""
        now = trio.current_time()
        if now - self._rotated >= self.span:
            self._given = [set(), self._given[0]]
            self._given_inodes = [set(), self._given_inodes[0]]
            self._rotated = now

    # -- what the VFS asks ---------------------------------------------------------------------
    def begin(self) -> int:
        """Called as a call that fetches names or attributes begins: what ``entry`` takes."""
        return self.applied

    def holds(self) -> bool:
        """Whether the lease holds now (what the mount keeps besides the kernel may serve)."""
        return self.until - trio.current_time() > self.margin

    def timeout(self, begun: int) -> float:
        """Seconds the kernel may cache what a call begun at ``begun`` fetched (0: not at all)."""
        self._handing_out()
        if begun != self.applied or sum(map(len, self._given + self._given_inodes)) >= MAX_GIVEN:
            return 0.0
        return max(0.0, self.until - trio.current_time() - self.margin)

    def entry(self, st: dict, parent: int, name: str, begun: int) -> dict:
        """``st`` (the stat of ``name`` in ``parent``) with the timeouts it may carry now."""
        t = self.timeout(begun)
        if t <= 0:
            return st
        self._given[0].add((parent, name))
        self._given_inodes[0].add(st["st_ino"])
        return st | {"entry_timeout": t, "attr_timeout": max(t, st.get("attr_timeout", 0.0))}

    def offer(self, st: dict) -> dict:
        """A listing's stat at the moment the kernel gets it (``readdir`` replies come after the
        listing was fetched): its timeouts as ``entry`` would give them now, if it carries an
        ``offer`` (parent, name, begun); else as it is."""
        offer = st.get("offer")
        if offer is None:
            return st
        st = {k: v for k, v in st.items() if k != "offer"}
        return self.entry(st, *offer)

    def attrs(self, st: dict, begun: int) -> dict:
        """``st`` (an inode's stat) with the attribute timeout it may carry now."""
        t = self.timeout(begun)
        if t <= st.get("attr_timeout", 0.0):
            return st
        self._given_inodes[0].add(st["st_ino"])
        return st | {"attr_timeout": t}

    def figures(self) -> dict:
        """For ``.irdma/stats``: seconds left on the lease, names and inodes handed out with a
        timeout, invalidation batches applied, the last sequence number acknowledged."""
        left = self.until - trio.current_time()
        given = {"given": len(self.given), "given_inodes": len(self.given_inodes)}
        return {"lease_left": round(max(0.0, left), 3), **given, "applied": self.applied, "acked": self.acked}

    # -- the lease ---------------------------------------------------------------------------
    async def run(self, drop: Callable[[list, list], None]) -> None:
        """The long-poll, for as long as the mount lives; ``drop(entries, inodes)`` drops them
        from the kernel's caches (blocking: fs/ops.py's ``kernel_drop``)."""
        self._drop = drop
        self.running = True
        try:
            while True:
                sent = trio.current_time()
                try:
                    r = await self._client.cache_wait(self.acked)
                except RemoteError as exc:
                    if exc.code == "ENOSYS":
                        log.info("names are not cached on this mount: %s", exc)
                        return
                    await trio.sleep(RETRY)
                    continue
                except (NodeDown, TransportError, trio.TooSlowError) as exc:
                    log.debug("name cache lease: %s", exc)
                    await trio.sleep(RETRY)
                    continue
                try:
                    if r.get("fresh"):  # a lease anew: changes made while there was none were told to nobody
                        self.acked = int(r.get("acked", 0))
                        self._forget(set(), set(), True)
                    await self.apply(r.get("inval", []))
                except Exception:  # a fault here: nothing more is handed out; acknowledged only once applied
                    log.exception("name cache: invalidations not applied; names are not cached until they are")
                    self.until = -math.inf
                    await trio.sleep(RETRY)
                    continue
                self.margin = float(r["lease"]) / 10
                self.until = sent + float(r["held"]) + float(r["lease"])
                self.span = max(self.span, self.until - trio.current_time())
        finally:
            self.running = False
            self.until = -math.inf

    async def release(self) -> None:
        """At a clean unmount: this mount's record as one that caches goes, so no change waits
        for its lease and no later failover waits a grace for it (best effort, 2 s at most)."""
        if not self.running:
            return
        self.until = -math.inf
        with trio.move_on_after(2):
            try:
                await self._client.op(op="cacher", owner=self._client.owner, on=False)
            except (RemoteError, NodeDown, TransportError) as exc:
                log.info("name cache record not dropped at unmount: %s", exc)

    async def apply(self, inval: list) -> None:
        """Drop what ``inval`` ([seq, entries, inodes, everything], ...) names, in the kernel
        and here; what is acknowledged next."""
        if not inval:
            return
        self.applied += 1  # an answer in flight may predate these: not cached (C3)
        entries: set[tuple[int, str]] = set()
        inodes: set[int] = set()
        drop_all, acked = False, self.acked
        for seq, ents, inos, everything in inval:
            drop_all = drop_all or bool(everything)
            entries |= {(int(p), str(n)) for p, n in ents}
            inodes |= {int(i) for i in inos}
            acked = max(acked, int(seq))
        self._forget(entries, inodes, drop_all)
        if drop_all:
            entries |= self.given
            inodes |= self.given_inodes
        # forgotten before the kernel's calls: one handed out again meanwhile stays known (and
        # is dropped again by the next invalidation that names it)
        drop = sorted(e for e in entries if any(e in g for g in self._given)), sorted(i for i in inodes if any(i in g for g in self._given_inodes))
        for given in self._given:
            given -= entries
        for given in self._given_inodes:
            given -= inodes
        # abandoned if the mount stops meanwhile: a kernel waiting on a request nobody serves
        # any more would hold the unmount for good
        await trio.to_thread.run_sync(self._drop, *drop, abandon_on_cancel=True)
        self.acked = acked  # what the next call acknowledges: only what was dropped


class NameCaches(NamedTuple):
    """What a mount keeps of names, handed around as one: the notes its lookups leave for the
    opens that follow (lookups.py), its lease (how long the kernel may keep what it is told),
    and its whole-directory listings (listings.py)."""

    lookups: Lookups
    lease: NameLease
    listings: Listings
