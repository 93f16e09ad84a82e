"""What a node pulls from its peers, from whom, and what a pull's outcome means: the decisions of
``Resync.pull_stripes`` (server/resync.py), apart from its calls.

``PullPlan`` takes each peer's listing (or its failure to list), then says which stripes to
fetch (``todo``: the newest copy among the peers of each stripe this node should hold and lacks
or holds older, or one to take instead of a copy it led before a fence) and, for a resync
(``converge``), which of its own stripes every other home freed while it was away (``freed``).
Each stripe to fetch is a ``StripePull``: it names the holder to ask next, in listing order, until
one gives it (True), and then what came of the stripe (``Settle``: fetched; every holder freed it,
so this node's copy goes too; or not fetched, an error under ``strict``, a miss under
``newer_or_fail``). ``Tally`` counts the pull's progress and says when to log it. Resync performs
the calls, the store's changes and the log lines, and feeds back what happened.

The rules, with the reasons resync.py's docstrings give:

- **Newest wins.** Of the peers' copies the highest (tag, version) stamp; every peer listing that
  stamp is a holder, asked in the order the peers listed (the next if one freed it meanwhile).
- **Take what is newer.** A stripe of a file the namespace has (live, snapshot, optimizer
  state), that ``mine`` gives this node, and that it lacks or holds at a lower stamp.
- **Converge** (a resync): a copy this node holds at the peers' stamp or higher, unchanged since
  the listing began, is replaced by theirs if it is higher or was led here since this node fell
  under suspicion, but never by a copy from an older epoch than its own (a stand-in's left
  behind). It is replaced once theirs arrived, never dropped before.
- **Freed while away** (converge): a stripe of this node that no peer listed, whose every other
  home listed completely (caught up once), unchanged since the listing began, is dropped, unless
  it still holds bytes of its file (``in_extent``: the homes that lack it lost it; kept).
- **Every holder freed it** after the listing: this node's copy of it goes too (one it held
  before: ``had``).
- **Strict** (a rebalance): a peer that cannot be listed, or a stripe no holder gave, is EAGAIN.
  **newer_or_fail** (a resync): a stripe newer on a peer that no holder gave fails the pull
  (EAGAIN) once every stripe was tried; one to take instead of this node's copy does not.

Pure: no I/O, no trio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ..errors import RemoteError

StripeId = tuple[int, int, int]  # (fid, idx, snap)
Stamp = tuple[int, int]  # (tag, version): what "newer" compares

LOG_EVERY = 1.0  # seconds between a pull's progress lines (in a terminal, a bar instead)


class Fetch(NamedTuple):
    """A stripe to fetch: its newest ``holders`` in listing order, its ``cap`` in bytes;
    ``instead``: this node's stamp to replace whatever it is (a copy led before a fence), else
    None; ``had``: this node's stamp of it when the pull chose it (None: it held none)."""

    fid: int
    idx: int
    snap: int
    holders: list[str]
    cap: int
    instead: Stamp | None
    had: Stamp | None


class Settle(NamedTuple):
    """What came of one stripe: ``fetched`` from a holder; ``drop``: every holder freed it, so
    this node's copy (at ``had``) goes too; ``error``: to raise (strict, not fetched)."""

    fetched: bool
    drop: bool
    error: RemoteError | None


class StripePull:
    """One stripe's fetch: ``next()`` names the holder to ask (None once done), ``outcome(o)``
    takes what that holder's fetch gave (True: copied; None: it no longer holds it; False: the
    copy failed), ``settle`` says what came of it."""

    def __init__(self, item: Fetch):
        self.item = item
        self.outcomes: list[bool | None] = []

    def next(self) -> str | None:
        if True in self.outcomes or len(self.outcomes) == len(self.item.holders):
            return None
        return self.item.holders[len(self.outcomes)]

    def outcome(self, got: bool | None) -> None:
        assert self.next() is not None, "no fetch was asked for"
        self.outcomes.append(got)


class Tally:
    """A pull's progress: stripes and bytes done of ``total`` and ``total_bytes``; ``due(now)``
    says whether to log it now (each LOG_EVERY seconds, and at the last stripe)."""

    def __init__(self, total: int, total_bytes: int, now: float):
        self.total, self.total_bytes = total, total_bytes
        self.stripes = self.bytes = 0
        self.logged = now

    def count(self, cap: int) -> None:
        self.stripes += 1
        self.bytes += cap

    def due(self, now: float) -> bool:
        if now - self.logged > LOG_EVERY or self.stripes == self.total:
            self.logged = now
            return True
        return False


class PullPlan:
    """One ``pull_stripes``: ``listed``/``unlisted`` for each peer, then ``todo`` (and, with
    ``converge``, ``freed``), then a ``StripePull`` per stripe with ``settle`` for each, and
    ``verdict`` at the end (see the module's docstring)."""

    def __init__(self, what: str, *, strict: bool = False, converge: bool = False, newer_or_fail: bool = False):
        self.what, self.strict, self.converge, self.newer_or_fail = what, strict, converge, newer_or_fail
        self.listed: set[str] = set()  # peers whose listing says what they lack (``complete``)
        # (fid, idx, snap) -> its newest (tag, version) among the peers, who hold it, capacity
        self.newest: dict[StripeId, tuple[Stamp, list[str], int]] = {}
        self.missed: list[str] = []  # stripes newer on a peer that no holder gave
        self.fetched: list[StripeId] = []

    # -- listings ------------------------------------------------------------------------------
    def took(self, peer: str, listing: list, complete: bool) -> None:
        """``peer`` listed its stripes ([fid, idx, snap, version, capacity, tag] each);
        ``complete``: it has caught up once (what it lacks it does not hold)."""
        if complete:
            self.listed.add(peer)
        for fid, idx, snap, version, cap, tag in listing:
            best = self.newest.get((fid, idx, snap))
            if best is None or (tag, version) > best[0]:
                self.newest[(fid, idx, snap)] = ((tag, version), [peer], cap)
            elif (tag, version) == best[0]:
                best[1].append(peer)  # as new: asked if the first has freed it

    def unlisted(self, peer: str, exc: Exception) -> RemoteError | None:
        """``peer`` could not be listed: the error to raise (strict), else None (logged, and
        the pull goes on without it)."""
        return RemoteError("EAGAIN", f"{self.what}: cannot list {peer}: {exc}") if self.strict else None

    # -- what to fetch -------------------------------------------------------------------------
    def todo(
        self,
        held: Callable[[StripeId], Stamp | None],
        files: Mapping[int, object],
        mine: Callable[[int, int], bool],
        before: Mapping[StripeId, Stamp],
        led: Mapping[StripeId, float],
        suspect_since: float,
    ) -> list[Fetch]:
        """The stripes to fetch, in listing order. ``held``: this node's stamp of a stripe (None:
        none); ``files``: the files of each snapshot (0, -1, -2: the live ones) the namespace
        has; ``before``: this node's stamps when the listing began (converge); ``led``/
        ``suspect_since``: when this node last led each stripe, and since when it may not have
        been the only one to (serving.py)."""
        out = []
        for (fid, idx, snap), (stamp, holders, cap) in self.newest.items():
            key = (fid, idx, snap)
            had = held(key)
            if fid in files.get(snap, ()) and mine(fid, idx) and (had is None or had < stamp):
                out.append(Fetch(fid, idx, snap, holders, cap, None, had))
            elif (
                self.converge
                and had is not None
                and had >= stamp
                and before.get(key) == had
                and (had > stamp or led.get(key, -math.inf) >= suspect_since)
                and stamp[0] >= had[0]  # never a copy of an older epoch's (a stand-in's left behind)
            ):
                # replaced once theirs has arrived, not dropped before: a peer that cannot give it
                # (every node fenced at once, as when the coordinator was out) leaves this copy
                out.append(Fetch(fid, idx, snap, holders, cap, had, had))
        return out

    def freed(
        self,
        me: str,
        before: Mapping[StripeId, Stamp],
        held: Callable[[StripeId], Stamp | None],
        homes: Callable[[int, int], list[str]],
        in_extent: Callable[[StripeId], bool],
    ) -> tuple[list[StripeId], list[StripeId]]:
        """(converge) This node's stripes freed on every other home while it was away, to drop;
        and those no other home holds that are kept, being inside their file (each a warning).
        ``homes``: a stripe's homes (the first R of its ranking)."""
        gone: list[StripeId] = []
        kept: list[StripeId] = []
        for key, stamp in before.items():
            every = homes(key[0], key[1])
            others = [n for n in every if n != me]
            # every other home answered and none holds it: freed while this node was away (a home
            # that did not answer may hold the last copy: then it stays; so may one whose process
            # has not caught up since it started: a home killed and restarted while the
            # coordinator was out, still named by the view, listed nothing, and the other home
            # dropped every stripe they shared: fault simulator, mixed seed 1663 with parallel
            # fetches)
            if key not in self.newest and me in every and others and set(others) <= self.listed and held(key) == stamp:
                if in_extent(key):
                    # inside its file as the namespace says: no truncate freed it (those dropped
                    # it by their cuts when the namespace was taken: namespace.py ``drop_freed``),
                    # so the homes that lack it lost it (mixed seed 1846: the last copy of an
                    # acknowledged write, which this node had led just before its fence). Kept
                    # even if led since this node fell under suspicion: at worst the bytes of a
                    # write that failed, which a failed write may leave; no later acknowledged
                    # write is older than them (its copies would be listed) and no truncate freed
                    # them (cuts)
                    kept.append(key)
                    continue
                gone.append(key)
        return gone, kept

    # -- outcomes ------------------------------------------------------------------------------
    def settle(self, pull: StripePull) -> Settle:
        """What came of ``pull`` once it asks no more holders (recorded: ``fetched``, ``missed``)."""
        assert pull.next() is None, "holders left to ask"
        item, outcomes = pull.item, pull.outcomes
        fetched = True in outcomes
        if fetched:
            self.fetched.append((item.fid, item.idx, item.snap))
        drop = item.had is not None and all(o is None for o in outcomes)
        error = None
        if False in outcomes and not fetched:
            if self.strict:
                error = RemoteError("EAGAIN", f"{self.what}: stripe {item.fid}:{item.idx} (snapshot {item.snap}) not fetched from {', '.join(item.holders)}")
            elif item.instead is None:  # newer there (a copy to take instead of one as new stays)
                self.missed.append(f"{item.fid}:{item.idx} (snapshot {item.snap})")
        return Settle(fetched, drop, error)

    def verdict(self) -> RemoteError | None:
        """Once every stripe was tried: the pull's error (newer_or_fail, a stripe newer on a peer
        not fetched), else None."""
        if self.missed and self.newer_or_fail:
            return RemoteError("EAGAIN", f"{self.what}: {len(self.missed)} stripes newer on a peer not fetched (first {self.missed[0]})")
        return None

