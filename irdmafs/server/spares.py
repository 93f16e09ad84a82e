"""Spare stripe memory: what a node keeps for its next stripes instead of unmapping it.

Memory freed a moment ago is wanted again at once: a model trained with a snapshot every step
copies every stripe once a step (store.py ``_writable``) while the snapshot dropped a step
before frees as much; a rotated checkpoint (save N, delete N-2) writes new files as it frees
old ones. New memory costs a page fault and the kernel clearing each page on the node's loop
(2.97 ms per 4 MiB here, a reused region 0.07 ms), and unmapping the old costs again; on a VM
with free page reporting (this project's CI machines) memory freed a moment ago has gone back to
the host, and touching it again is a host fault. So:

- **Kept, not unmapped.** Memory whose last registration goes (a dropped snapshot's copies, a
  live stripe unlinked, truncated or grown out of its region) is kept here, under a key of its
  own that no peer was told (the old keys are freed, so a reader holding one gets AccessError
  and its bytes are never served again), when there is room under ``limit``.
- **Used again only once nothing can move its bytes** (``ready``): no replication in this
  process reads it (``KeptMemory.pins``: a primary's ``Update`` reads its stripe's bytes when it
  sends them, store.py ``pinned``), and no operation in flight on any key it was registered
  under (``KeptMemory.draining``: a native engine may still be sending a READ's bytes from it after
  the key was freed, ``Transport.settled``). Other readers need no pin: a Python responder
  checks each READ of a seqlock burst as its turn comes, a shared-memory peer checks the key
  table after its copy, a verbs MR is deregistered.
- **Every byte written before it is read.** ``take`` gives a ready spare of the same capacity
  to a copy on write (which overwrites all of it) or to a new or grown stripe, whose store zeroes
  every byte it does not write at once (store.py ``_alloc``): reused memory reads as zeros
  where a file has holes, as fresh memory does.
- **Counted, and given up first.** Spare memory is in the node's budget as "spare"; a take of
  any other kind that would not fit releases spares first (``Budget.reclaim``), ready or not
  (releasing only drops this reference: an Update's stripe and the engine's buffer keep the
  mapping until they end), so a spare never makes a write ENOSPC.
- **Kept ``IDLE`` seconds** after the last keep or take, then all released: long enough for the
  saves of a rotation and the steps of a training run with snapshots, which reuse it within
  seconds; not for ever, because kept memory is memory the host cannot have back.

Not warmed ahead: regions made and written in a worker thread when a snapshot froze trained
stripes cost the same host faults (1.2 GB a node took 10 s beside a training step here) and made
the first step after the first snapshot no faster (docs/benchmarks.md).
"""
from __future__ import annotations

import logging
from typing import Callable, Protocol

import trio

from ..transport.base import Region, Transport
from .budget import Budget

log = logging.getLogger(__name__)

SPARE = "spare"  # the budget's kind for kept memory
IDLE = 60.0  # seconds without a keep or take after which every spare is released


class KeptMemory(Protocol):
    """What a spare knows of the memory it keeps (store.py's ``Memory`` is one)."""

    capacity: int
    pins: int  # replications reading it now
    draining: set[int]  # its freed keys an operation in flight may still move bytes through


class Spares:
    def __init__(self, transport: Transport, budget: Budget, dispose: Callable[[memoryview], None], limit: int):
        """``dispose(buf)``: release a spare's memory (the store's reaper); ``limit``: the most
        bytes kept (a fraction of the node's capacity)."""
        self.transport, self.budget, self.dispose, self.limit = transport, budget, dispose, limit
        # capacity -> (region under a key nobody knows, the memory's bookkeeping), oldest first
        self.free: dict[int, list[tuple[Region, KeptMemory]]] = {}
        self.held = 0
        self.last_use = 0.0  # the last keep or take (loop time)
        self.taken = 0  # how many stripes took kept memory
        self.waited = 0  # takes that found a spare of the capacity, none of them ready

    def keep(self, region: Region, memory: KeptMemory) -> bool:
        """``region``'s memory (``memory``) has no user left: keep it under a fresh key (the
        caller then frees ``region``'s own) if there is room; False if not (the caller releases
        it)."""
        capacity = memory.capacity
        if self.held + capacity > self.limit or self.budget.used + capacity > self.budget.capacity:
            return False
        try:  # a registration can fail (descriptors, pinned memory): then it is released as before
            alias = self.transport.alias_region(region)
        except Exception as exc:  # noqa: BLE001 - any failure to keep is "not kept"
            log.warning("spare memory not kept: %s", exc)
            return False
        self.budget.take(SPARE, capacity, reclaim=False)  # fits: checked above, nothing between
        self.free.setdefault(capacity, []).append((alias, memory))
        self.held += capacity
        self.last_use = trio.current_time()
        return True

    def ready(self, memory: KeptMemory) -> bool:
        """Nothing can move bytes of ``memory`` any more: no pin, no key draining."""
        if memory.pins:
            return False
        memory.draining = {k for k in memory.draining if not self.transport.settled(k)}
        return not memory.draining

    def take(self, capacity: int, kind: str) -> Region | None:
        """A ready kept region of ``capacity`` data bytes, now counted as ``kind``; None if none
        (the caller allocates fresh memory)."""
        regions = self.free.get(capacity)
        if not regions:
            return None
        at = next((i for i, (_, memory) in enumerate(regions) if self.ready(memory)), None)
        if at is None:
            self.waited += 1
            return None
        region, _ = regions.pop(at)
        self.held -= capacity
        self.budget.move(SPARE, kind, capacity)
        self.last_use = trio.current_time()
        self.taken += 1
        return region

    def release(self, nbytes: int | None = None) -> int:
        """Release spares (all, or until ``nbytes`` are freed); returns the bytes freed."""
        freed = 0
        for capacity, regions in self.free.items():
            while regions and (nbytes is None or freed < nbytes):
                region, _ = regions.pop()
                self.transport.free_region(region)  # nobody was told this key: nothing in flight on it
                self.dispose(region.buf)
                self.budget.give(SPARE, capacity)
                self.held -= capacity
                freed += capacity
        return freed

    def idle(self) -> bool:
        return bool(self.held) and trio.current_time() - self.last_use > IDLE
