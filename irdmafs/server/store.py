"""Stripes held in registered regions, each guarded by a version word (a seqlock).

A stripe's region is ``[version: u64][clock: u64][data: capacity bytes]`` (little-endian; the
layout is regions.py's, which readers share). Peers read the data one-sidedly; to never return a
torn stripe they read the header before and after the data (one pipelined burst on one
connection, served in order) and retry unless both are the same with an even version. The clock
counts the training steps applied to the stripe (server/rounds.py): a pull waits for it by
reading the header alone. Installing new data here is: word := odd, copy, word := next even. The
copy does not yield to trio, so over TCP it is atomic with respect to the responder; over verbs
the NIC may read concurrently, and the odd/changed word makes the reader retry.

``version`` as the API speaks of it counts commits: word == 2 * version when stable. Each
stripe also carries a ``tag``: the view epoch in which its version was given (0 without a
coordinator). Replicas compare ``(tag, version)``: two primaries of different epochs may give the
same version number to different bytes, and the later epoch's is the one that counts (the
acknowledgement rule of server/replicator.py makes the earlier one unacknowledged).

Stripes are keyed (file id, stripe index, snapshot id); snapshot 0 is the live data (ids below
0 are a live stripe's optimizer state). A snapshot is copy-on-write, kept on the same node as the
stripe it froze, so it has the same placement. The rules (docs/design.md, "Snapshots"):

- **Taking one is metadata.** ``take_snapshot`` gives every live stripe an entry under the
  snapshot id that is a second registration (its own rkey: ``Transport.alias_region``) of the
  same memory; nothing is copied. The memory is counted once (``Memory``).
- **A snapshot's bytes never change.** Before a live stripe's data changes in place (an install,
  a training step's update), the snapshots that share it move to one copy of it (``_writable``):
  the live stripe keeps its region and rkey, the snapshots get new rkeys, and their old ones are
  freed, so a reader holding one gets AccessError and asks again (as for a grown stripe). A live
  stripe that moves to a new region (it grew), is replaced whole (a resync) or is freed (unlink,
  truncate) leaves its memory to the snapshots sharing it: no copy. Only the header's clock word
  may move under a snapshot (``publish_clock``: the step of the version it holds, published).
- **A snapshot holds what changed since.** Memory is freed when its last registration goes; a
  copy made for several snapshots is one copy. ``used`` counts memory, not registrations.
- **Full is an answer.** A copy that does not fit is ``NoSpace`` (ENOSPC) before the live stripe
  is touched, naming the snapshots that hold the memory: the write fails whole, nothing changes.
- **Persisted alike.** With ``--persist`` a snapshot's file is a hard link to the live stripe's
  file; the live stripe's first write after it writes a new file, so the link keeps the old bytes
  (``_rewrite``); at load, linked files share memory again.
- **Spare memory** (spares.py, while the reaper runs): freed memory, a snapshot's or a live
  stripe's, is kept for the next copy on write or new stripe of its capacity once nothing can
  move its bytes (``pinned``: a replication reading it; a key's operation in flight); what the
  taker does not write is zeroed first; counted, reclaimed first, released when idle.

Capacity grows in GROW-byte steps up to the stripe unit; growing moves the stripe to a new region
(new rkey), and peers holding the old rkey get AccessError and look it up again.

``changed`` is a trio Event set whenever a stripe's clock word may have moved or a region
gone (server/clocks.py waits on it for the pulls that asked to be told).

``Store`` owns the table of stripes (``stripes``), which snapshots share a live stripe's memory
(``sharers``), the memory's accounting and the seqlock write path; what it frees and what it
writes of every stripe at once go to ``behind`` (behind.py), which releases the memory and
writes the files off the loop, and keeps the spares.

Concurrency: called from the node's trio thread only; nothing here awaits (``behind``'s tasks
do, off the loop).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import trio

from ..regions import CLOCK_AT, HEADER, PENDING, VERSION_AT, WORD
from ..transport.base import Access, Region, Transport
from .behind import Behind
from .budget import Budget, NoSpace
from .updates import StripeKey, StripeRange

__all__ = ["Memory", "NoSpace", "Store", "Stripe", "pinned"]

GROW = 64 << 10
LIVE, FROZEN = "stripes", "snapshots"  # what the budget counts stripe memory as (``Memory.kind``)
SPARE_SHARE = 4  # at most 1/4 of a node's capacity kept as spare memory (spares.py)


class Memory:
    """The bytes behind one or more registrations: counted in the budget until the last
    registration of them is freed, as ``kind``: "stripes" while a live stripe (or its optimizer
    state) uses them, "snapshots" once only snapshots do. ``pins``: replications reading them
    now (``pinned``); ``draining``: its freed keys an operation in flight may still move
    bytes through (``Transport.free_region``). Kept memory is used again only when both are
    empty (spares.py)."""

    __slots__ = ("capacity", "users", "kind", "pins", "draining")

    def __init__(self, capacity: int, kind: str):
        self.capacity = capacity
        self.users = 1
        self.kind = kind
        self.pins = 0
        self.draining: set[int] = set()


@dataclass
class Stripe:
    region: Region  # this entry's own registration (a snapshot's is an alias while it shares)
    tag: int = 0  # the view epoch its version was given in
    memory: Memory | None = None  # set by the store: what ``region`` registers

    @property
    def stamp(self) -> tuple[int, int]:
        """What "newer" compares: (tag, version)."""
        return (self.tag, self.version)

    @property
    def capacity(self) -> int:
        return self.region.length - HEADER

    @property
    def data(self) -> memoryview:
        return self.region.buf[HEADER:]

    @property
    def version(self) -> int:
        return WORD.unpack_from(self.region.buf, VERSION_AT)[0] // 2

    @property
    def clock(self) -> int:
        """The training steps applied and published (what a pull waits for)."""
        return WORD.unpack_from(self.region.buf, CLOCK_AT)[0] & ~PENDING

    @property
    def pending(self) -> bool:
        """The data holds a step whose clock is not published yet (regions.py)."""
        return bool(WORD.unpack_from(self.region.buf, CLOCK_AT)[0] & PENDING)

    def describe(self) -> dict:
        return {"rkey": self.region.rkey, "capacity": self.capacity, "version": self.version, "clock": self.clock, "tag": self.tag}


class Store:
    def __init__(
        self, transport: Transport, budget: Budget | int, persist=None, version_base: Callable[[], int] = lambda: 0, epoch: Callable[[], int] = lambda: 0
    ):
        """``budget``: the node's (budget.py), or a capacity for a store of its own."""
        self.transport = transport
        self.budget = budget if isinstance(budget, Budget) else Budget(budget)
        self.stripes: dict[tuple[int, int, int], Stripe] = {}
        # live (fid, idx) -> the snapshot ids whose entry shares the live stripe's memory
        self.sharers: dict[tuple[int, int], set[int]] = {}
        self.persist = persist  # a server.persist.Persist: every change written through
        # Where a new stripe's versions start: above every version an earlier stripe of the same
        # (file, index) had, freed since (a truncate), so "newer" stays "higher" for replicas and
        # resyncs (the node derives it from its namespace's sequence number).
        self.version_base = version_base
        self.epoch = epoch  # the view epoch a version given here (a primary's) is tagged with
        # set (and renewed) whenever a stripe's header may have changed or its region gone:
        # what clock waits wait on (server/clocks.py)
        self.changed = trio.Event()
        # memory whose last registration went, and files of every stripe at once (a snapshot's
        # links, what a drop freed): released and written off the loop (behind.py); the spares
        # are its (memory kept for the copies on write to come, while its reaper runs)
        self.behind = Behind(transport, self.budget, persist, self.budget.capacity // SPARE_SHARE)
        self.spares = self.behind.spares
        self.budget.reclaim = self.spares.release

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _saved(self, key: tuple[int, int, int], start: int = 0, end: int | None = None) -> None:
        if self.persist is not None:
            stripe = self.stripes[key]
            self.persist.write(key, stripe.region.buf, start, end, tag=stripe.tag)

    # -- memory and registrations --------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes of stripe memory held (each ``Memory`` once, however many share it)."""
        return self.budget.held[LIVE] + self.budget.held[FROZEN]

    def _alloc(self, capacity: int, kind: str, why: str = "", writes: tuple[tuple[int, int], ...] = ()) -> tuple[Region, Memory]:
        """A zeroed region for ``capacity`` data bytes counted as ``kind``, except the data
        ranges ``writes`` ([start, end) each), which the caller overwrites at once: kept memory
        (spares.py) has every other byte zeroed here, header included."""
        region = self.spares.take(capacity, kind)
        if region is not None:
            # persisted, its file is written whole before the caller writes (``ensure``): a
            # crash between would leave another file's bytes on disk under a valid header
            _zero_except(region.buf, writes if self.persist is None else ())
            return region, Memory(capacity, kind)
        self.budget.take(kind, capacity, why)
        return self.transport.alloc_region(HEADER + capacity, Access.READ), Memory(capacity, kind)

    def _forget(self, key: tuple[int, int, int], stripe: Stripe) -> None:
        """``key``'s entry and registration go (the caller removes or replaces it in
        ``stripes``); its memory stays while another entry uses it (a snapshot)."""
        fid, idx, snap = key
        if snap == 0:
            self.sharers.pop((fid, idx), None)  # they keep the memory, theirs alone now
        elif snap > 0 and snap in self.sharers.get((fid, idx), ()):
            self.sharers[(fid, idx)].discard(snap)
            if not self.sharers[(fid, idx)]:
                del self.sharers[(fid, idx)]
        memory = stripe.memory
        memory.users -= 1
        if not memory.users:
            self.budget.give(memory.kind, memory.capacity)
            # kept for the next stripe of its capacity, used once nothing can move its bytes
            if not (self.behind.reaping and self.spares.keep(stripe.region, memory)):
                self.behind.dispose(stripe.region.buf)
        # after keep: it keeps the memory under a key of its own; a key an operation in flight
        # still uses drains before the memory is used again
        if not self.transport.free_region(stripe.region):
            memory.draining.add(stripe.region.rkey)
        if memory.users and snap == 0 and memory.kind == LIVE:  # snapshots alone hold it now
            self.budget.move(LIVE, FROZEN, memory.capacity)
            memory.kind = FROZEN

    def _share(self, key: tuple[int, int, int], of: Stripe) -> None:
        """``key`` (a snapshot's) becomes an entry of ``of``'s memory under a key of its own."""
        region = self.transport.alias_region(of.region)
        of.memory.users += 1
        self.stripes[key] = Stripe(region, of.tag, of.memory)

    def _writable(self, fid: int, idx: int, snap: int = 0) -> None:
        """Before ``(fid, idx, snap)``'s memory changes in place, nobody else may see it: the
        snapshots sharing a live stripe move to one copy of it (the live stripe keeps its rkey),
        and a snapshot's entry that shares takes a copy of its own. NoSpace before anything
        changed if the copy does not fit."""
        key = (fid, idx, snap)
        stripe = self.stripes.get(key)
        if stripe is None or stripe.memory.users == 1:
            return
        movers = sorted(self.sharers.get((fid, idx), ())) if snap == 0 else [snap]
        assert movers, f"stripe {key} shares its memory with no snapshot"
        held = f"; snapshots {movers} hold this stripe's bytes as they were" if snap == 0 else ""
        region, memory = self._alloc(stripe.capacity, FROZEN, held, writes=((0, stripe.capacity),))
        region.buf[:] = stripe.region.buf
        memory.users = 0
        for s in movers:
            old = self.stripes[(fid, idx, s)]
            self._forget((fid, idx, s), old)
            self.stripes[(fid, idx, s)] = Stripe(region if not memory.users else self.transport.alias_region(region), old.tag, memory)
            memory.users += 1
            if self.persist is not None and snap != 0:
                self._rewrite((fid, idx, s))
        if snap == 0 and self.persist is not None:
            self._rewrite(key)  # the snapshots' files keep the old inode
        self._changed()  # readers holding the snapshots' old keys look again

    def _rewrite(self, key: tuple[int, int, int]) -> None:
        """A new file for ``key``, whole: a hard link to its old one keeps the old bytes."""
        self.persist.remove(key)
        self._saved(key)

    # -- stripes ---------------------------------------------------------------------------------
    def load(self, key: tuple[int, int, int], nbytes: int, same_as: tuple[int, int, int] | None = None, tag: int = 0) -> memoryview | None:
        """A stripe as persisted, with its ``tag``: a region of ``nbytes`` (header, then data),
        returned for the caller to fill byte for byte from its file before the node serves; or
        with ``same_as`` an entry of that stripe's memory (their files were one, hard linked):
        None, nothing to read."""
        self._changed()
        if same_as is not None and same_as in self.stripes:
            self._share(key, self.stripes[same_as])
            if same_as[2] == 0 and key[2] > 0:
                self.sharers.setdefault(key[:2], set()).add(key[2])
            return None
        region, memory = self._alloc(nbytes - HEADER, FROZEN if key[2] > 0 else LIVE)
        self.stripes[key] = Stripe(region, tag, memory)
        return region.buf

    def get(self, fid: int, idx: int, snap: int = 0) -> Stripe | None:
        return self.stripes.get((fid, idx, snap))

    def ensure(
        self, fid: int, idx: int, needed: int, unit: int, snap: int = 0, writes: tuple[int, int] | None = None, based: bool = False
    ) -> Stripe:
        """The stripe, created or grown so that ``needed`` data bytes fit (at most ``unit``);
        ``writes``: the data range [start, end) the caller overwrites next, before anything
        reads it (its other bytes are the old stripe's, or zeros). ``based``: memory an
        ``update`` changes next, made now so that NoSpace comes before anything else of a change
        does (a step's optimizer state); a new stripe then takes the version base its ``update``
        would have given it (its first version is that base + 1: a truncate's cuts tell stripes
        made since by it, effects.py)."""
        if needed > unit:
            raise ValueError(f"{needed} bytes do not fit a stripe unit of {unit}")
        key = (fid, idx, snap)
        stripe = self.stripes.get(key)
        if stripe is not None and stripe.capacity >= needed:
            return stripe
        if based and stripe is None:
            made = self.ensure(fid, idx, needed, unit, snap, writes)
            WORD.pack_into(made.region.buf, VERSION_AT, 2 * self.version_base())
            return made
        cap = min(unit, max(GROW, -(-needed // GROW) * GROW))
        copied = ((0, stripe.capacity),) if stripe is not None else ()  # (with its header)
        region, memory = self._alloc(cap, FROZEN if snap > 0 else LIVE, writes=copied + ((writes,) if writes else ()))
        try:
            return self._place(key, stripe, region, memory)
        except BaseException:
            if writes:  # the caller will not write its range: nothing of the memory's last use stays
                np.frombuffer(region.buf, np.uint8)[HEADER + writes[0] : HEADER + writes[1]] = 0
            raise

    def _place(self, key: tuple[int, int, int], stripe: Stripe | None, region: Region, memory: Memory) -> Stripe:
        """``ensure``'s new region for ``key`` in place of ``stripe`` (None: a new stripe)."""
        if stripe is not None:
            # Carry data and version over; the old region dies with its rkey (its memory stays
            # with the snapshots sharing it).
            region.buf[: stripe.region.length] = stripe.region.buf
            self._forget(key, stripe)
            self._changed()  # the old region's readers must look again
            if self.persist is not None:
                self.persist.remove(key)  # a snapshot's link to the old file keeps it
        stripe = Stripe(region, stripe.tag if stripe is not None else 0, memory)
        self.stripes[key] = stripe
        self._saved(key)  # the file takes the new size (zeros past the old data)
        return stripe

    def install(self, key: StripeKey, offset: int, data: memoryview, unit: int, *, stamp: tuple[int, int] | None = None, clock: int | None = None) -> int:
        """Copy ``data`` into stripe ``key`` at ``offset`` under the seqlock, and set its clock
        if given; returns the new version (the next one, tagged with this node's epoch, or the
        ``stamp`` (tag, version) a primary dictates to a backup)."""
        fid, idx, snap = key
        fresh = key not in self.stripes
        stripe = self.ensure(fid, idx, offset + len(data), unit, snap, writes=(offset, offset + len(data)))
        self._writable(fid, idx, snap)
        buf = stripe.region.buf
        word = WORD.unpack_from(buf, VERSION_AT)[0]
        tag, version = stamp if stamp is not None else (0, None)
        new = (self.version_base() + 1 if fresh else word // 2 + 1) if version is None else version
        WORD.pack_into(buf, VERSION_AT, word | 1)
        buf[HEADER + offset : HEADER + offset + len(data)] = data
        if clock is not None:
            WORD.pack_into(buf, CLOCK_AT, clock)
        WORD.pack_into(buf, VERSION_AT, 2 * new)
        stripe.tag = self.epoch() if version is None else tag
        if clock is not None:
            self._changed()
        self._saved(key, HEADER + offset, HEADER + offset + len(data))
        return new

    def update(self, where: StripeRange, fn, clock: int | None = None, pending: bool = False) -> int:
        """Change the bytes ``where`` names of a live stripe or its optimizer state (snap -1,
        -2) in place: ``fn(view)`` runs under the seqlock (it must not await; it may change
        other stripes under theirs, nested: a step's state), then the clock is set if given;
        returns the new version. A new stripe's bytes are zeros. An optimizer step this way
        writes the parameters and its state once, where a copy out, the step and ``install``
        would pass over them three times. ``pending``: the bytes now hold a step whose clock
        ``publish_clock`` sets later; readers see both in one header."""
        (fid, idx, snap), offset, length, unit = where
        assert snap <= 0 and not (pending and snap), "a live stripe's bytes or its state's"
        key = (fid, idx, snap)
        fresh = key not in self.stripes
        self.ensure(fid, idx, offset + length, unit, snap)
        self._writable(fid, idx, snap)
        stripe = self.stripes[key]  # after _writable: an entry that shared its memory has a copy of its own now
        buf = stripe.region.buf
        word = WORD.unpack_from(buf, VERSION_AT)[0]
        new = self.version_base() + 1 if fresh else word // 2 + 1
        WORD.pack_into(buf, VERSION_AT, word | 1)
        try:
            if fn is not None:
                fn(memoryview(buf)[HEADER + offset : HEADER + offset + length])
            if clock is not None:
                WORD.pack_into(buf, CLOCK_AT, clock)
            elif pending:
                WORD.pack_into(buf, CLOCK_AT, WORD.unpack_from(buf, CLOCK_AT)[0] | PENDING)
        finally:
            WORD.pack_into(buf, VERSION_AT, 2 * new)  # never left odd: readers would wait forever
        stripe.tag = self.epoch()
        if clock is not None or pending:
            self._changed()
        self._saved(key, HEADER + offset, HEADER + offset + length)
        return new

    def publish_clock(self, fid: int, idx: int, clock: int) -> None:
        """Set a live stripe's clock alone: a primary's training step, once every backup holds
        it (server/training.py, ``_settle``); the data is no longer pending. Readers compare
        the whole header before and after the data, so one that straddles this retries.
        Snapshots sharing the stripe see the clock move: it describes the same bytes and
        version (the step they hold, now published), and nothing reads a snapshot's clock."""
        stripe = self.stripes.get((fid, idx, 0))
        if stripe is None:  # freed meanwhile (a truncate, an unlink)
            return
        WORD.pack_into(stripe.region.buf, CLOCK_AT, clock)
        self._changed()  # before persisting: a write that fails there must not leave waiters asleep
        self._saved((fid, idx, 0), CLOCK_AT, CLOCK_AT + WORD.size)

    def replace(self, key: StripeKey, data: memoryview, unit: int, stamp: tuple[int, int], clock: int = 0) -> None:
        """Set the whole content of stripe ``key`` (resync, or a backup found behind), with
        version ``stamp`` (tag, version). ``clock`` is the
        whole clock word: a copy of a stripe whose step is not yet published stays pending. A
        snapshot's stripe of the very stamp and clock the live stripe here has shares its memory
        (a resync or a rebalance of a snapshot costs no copy of what is unchanged)."""
        fid, idx, snap = key
        tag, version = stamp
        held = self.stripes.get(key)
        if held is not None and held.memory.users > 1:  # written whole: the others keep the old
            self._forget(key, held)
            del self.stripes[key]
            if self.persist is not None:
                self.persist.remove(key)
        live = self.stripes.get((fid, idx, 0))
        if snap > 0 and live is not None and live.stamp == (tag, version) and WORD.unpack_from(live.region.buf, CLOCK_AT)[0] == clock:
            if key in self.stripes:
                self._drop([key])
            self._share(key, live)
            self.sharers.setdefault((fid, idx), set()).add(snap)
            if self.persist is not None:
                self.persist.link((fid, idx, 0), key)
            self._changed()
            return
        stripe = self.ensure(fid, idx, len(data), unit, snap, writes=(0, len(data)))
        buf = stripe.region.buf
        WORD.pack_into(buf, VERSION_AT, WORD.unpack_from(buf, VERSION_AT)[0] | 1)
        buf[HEADER : HEADER + len(data)] = data
        buf[HEADER + len(data) :] = bytes(len(buf) - HEADER - len(data))
        WORD.pack_into(buf, CLOCK_AT, clock)
        WORD.pack_into(buf, VERSION_AT, 2 * version)
        stripe.tag = tag
        self._changed()
        self._saved(key)

    def drop(self, fid: int, from_idx: int = 0) -> int:
        """Free the live stripes ``from_idx`` and up of a file (with their optimizer state,
        snapshot ids < 0); returns how many went. Snapshots sharing them keep their bytes."""
        return self._drop([k for k in self.stripes if k[0] == fid and k[1] >= from_idx and k[2] <= 0])

    def drop_snapshot(self, snap: int) -> int:
        return self._drop([k for k in self.stripes if k[2] == snap])

    def drop_keys(self, keys: list) -> int:
        """Free these (fid, idx, snap) stripes (a rebalance moved them elsewhere)."""
        return self._drop([k for k in keys if k in self.stripes])

    def _drop(self, keys: list) -> int:
        gone = []
        try:
            for key in keys:
                self._forget(key, self.stripes.pop(key))
                gone.append(key)
        finally:
            if keys:
                self._changed()
            self.behind.later([("remove", key, None) for key in gone])  # their files: off the loop
        return len(keys)

    def take_snapshot(self, snap: int) -> int:
        """Freeze every live stripe under snapshot id ``snap``, copying nothing: each gets an
        entry of its memory under a key of its own (in place of any entry held under ``snap``:
        an attempt whose coordinator died before the snapshot was named); returns the bytes
        frozen. Synchronous: nothing can commit in between."""
        self._drop([k for k in self.stripes if k[2] == snap])
        live = [(k, s) for k, s in self.stripes.items() if k[2] == 0]
        for (fid, idx, _), stripe in live:
            self._share((fid, idx, snap), stripe)
            self.sharers.setdefault((fid, idx), set()).add(snap)
        self.behind.later([("link", key, (key[0], key[1], snap)) for key, _ in live])  # off the loop
        return sum(s.capacity for _, s in live)

    def listing(self) -> list[list[int]]:
        """Every stripe held: [fid, idx, snap, version, capacity, tag]."""
        return [[fid, idx, snap, s.version, s.capacity, s.tag] for (fid, idx, snap), s in self.stripes.items()]

    @property
    def bytes_held(self) -> int:
        return self.used

    @property
    def snapshot_bytes(self) -> int:
        """Memory only snapshots hold: what changed (or went) since they were taken."""
        return self.budget.held[FROZEN]


@contextmanager
def pinned(*stripes: "Stripe | None") -> Iterator[None]:
    """While it lasts, the memory of ``stripes`` is not used for other bytes even if they are
    freed meanwhile (spares.py): what a replication holds from the ``Update`` it makes of a
    stripe until its last send, and each batch of Updates while its bytes leave
    (``Update.source`` is read when sent: replicator.py)."""
    memories = [s.memory for s in stripes if s is not None and s.memory is not None]
    for m in memories:
        m.pins += 1
    try:
        yield
    finally:
        for m in memories:
            m.pins -= 1


def _zero_except(buf: memoryview, writes: tuple[tuple[int, int], ...]) -> None:
    """Zero region ``buf`` (header, then data) but for the data ranges ``writes``."""
    a = np.frombuffer(buf, np.uint8)
    at = 0
    for start, end in sorted((HEADER + s, HEADER + e) for s, e in writes if e > s):
        if start > at:
            a[at:start] = 0
        at = max(at, end)
    a[at:] = 0
