"""Spare stripe memory: what a node keeps for its next copies on write instead of unmapping it.

A model trained with a snapshot every step copies every stripe once a step (store.py
``_writable``) into new memory, while the snapshot dropped a step before frees as much. New
memory costs a page fault and the kernel clearing each page on the node's loop, and unmapping
the old costs again; on a VM with free page reporting (this project's CI machines) memory freed
a moment ago has gone back to the host, and touching it again is a host fault. So:

- **Kept, not unmapped.** Memory only snapshots held, whose last registration goes (a dropped
  snapshot's copies; never a live stripe's, which a change being replicated may still read), is
  kept here (under a key of its
  own that no peer was told: the old key is freed, so a reader holding it gets AccessError, and
  its bytes are never served again) when there is room under ``limit``; ``take`` gives it to the
  next copy on write of the same capacity, which overwrites every byte (header included).
- **Counted, and given up first.** Spare memory is in the node's budget as "spare"; a take of
  any other kind that would not fit releases spares first (``Budget.reclaim``), so a spare never
  makes a write ENOSPC; all of them go after ``IDLE`` seconds without a take.

Not warmed ahead: regions made and written in a worker thread when a snapshot froze trained
stripes cost the same host faults (1.2 GB a node took 10 s beside a training step here) and made
the first step after the first snapshot no faster (docs/benchmarks.md).
"""
from __future__ import annotations

import logging
from typing import Callable

import trio

from ..transport.base import Region, Transport
from .budget import Budget

log = logging.getLogger(__name__)

SPARE = "spare"  # the budget's kind for kept memory
IDLE = 10.0  # seconds without a take after which every spare is released


class Spares:
    def __init__(self, transport: Transport, budget: Budget, dispose: Callable[[memoryview], None], limit: int):
        """``dispose(buf)``: release a spare's memory (the store's reaper); ``limit``: the most
        bytes kept (a fraction of the node's capacity)."""
        self.transport, self.budget, self.dispose, self.limit = transport, budget, dispose, limit
        self.free: dict[int, list[Region]] = {}  # capacity -> regions, each under a key nobody knows
        self.held = 0
        self.last_use = 0.0  # the last keep or take (loop time)
        self.taken = 0  # how many copies on write took kept memory

    def keep(self, region: Region, capacity: int) -> bool:
        """``region``'s memory has no user left: keep it under a fresh key (the caller then frees
        ``region``'s own) if there is room; False if not (the caller releases it)."""
        if self.held + capacity > self.limit or self.budget.used + capacity > self.budget.capacity:
            return False
        try:  # a registration can fail (descriptors, pinned memory): then it is released as before
            alias = self.transport.alias_region(region)
        except Exception as exc:  # noqa: BLE001 - any failure to keep is "not kept"
            log.warning("spare memory not kept: %s", exc)
            return False
        self.budget.take(SPARE, capacity, reclaim=False)  # fits: checked above, nothing between
        self.free.setdefault(capacity, []).append(alias)
        self.held += capacity
        self.last_use = trio.current_time()
        return True

    def take(self, capacity: int, kind: str) -> Region | None:
        """A kept region of ``capacity`` data bytes, now counted as ``kind``; None if none."""
        regions = self.free.get(capacity)
        if not regions:
            return None
        region = regions.pop()
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
                region = regions.pop()
                self.transport.free_region(region)
                self.dispose(region.buf)
                self.budget.give(SPARE, capacity)
                self.held -= capacity
                freed += capacity
        return freed

    def idle(self) -> bool:
        return bool(self.held) and trio.current_time() - self.last_use > IDLE
