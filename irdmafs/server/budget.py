"""A PS node's memory budget: every byte it holds for others, counted against its capacity.

What a node holds grows with what others ask of it: stripe data (``kind`` "stripes": live and
optimizer state; "snapshots": what only snapshots still hold, server/store.py) and staging regions where peers' WRITEs
land (``kind`` "staging", server/staging.py). Both take from one budget, so a node answers ENOSPC
(``NoSpace``, mapped by the node's dispatcher) with a message saying what holds the memory, before
the kernel's OOM killer would decide instead: a node is never killed for memory. A resync or a
rebalance reads one stripe at a time (a stripe unit of buffer), outside the budget.

``irdmafs up`` sizes the capacity of its nodes to the machine (``machine_capacity``), so the
nodes of one host together stay well inside its memory.

Concurrency: the node's trio thread only.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable

MEMORY_SHARE = 0.6  # of the memory available at start, for all the nodes of one host together
MIN_CAPACITY = 256 << 20


class NoSpace(Exception):
    """The node's capacity would be exceeded (ENOSPC to the caller)."""


class Budget:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[str, int] = defaultdict(int)  # kind -> bytes
        # given the bytes short, frees what can go at once (spare memory: server/spares.py)
        self.reclaim: Callable[[int], int] | None = None

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def take(self, kind: str, nbytes: int, why: str = "", reclaim: bool = True) -> None:
        """Count ``nbytes`` more of ``kind``; NoSpace, and nothing counted, if they do not fit
        once what ``reclaim`` can free is freed."""
        if self.used + nbytes > self.capacity and reclaim and self.reclaim is not None:
            self.reclaim(self.used + nbytes - self.capacity)
        if self.used + nbytes > self.capacity:
            parts = ", ".join(f"{k} {v}" for k, v in sorted(self.held.items()) if v)
            raise NoSpace(f"node full: {nbytes} bytes of {kind} do not fit ({parts or 'nothing'} held of {self.capacity}){why}")
        self.held[kind] += nbytes

    def give(self, kind: str, nbytes: int) -> None:
        self.held[kind] -= nbytes

    def move(self, kind: str, to: str, nbytes: int) -> None:
        """The same bytes, counted as ``to`` now (live memory left to snapshots)."""
        self.held[kind] -= nbytes
        self.held[to] += nbytes


def machine_capacity(nodes: int, meminfo: str = "/proc/meminfo", ceiling: int = 8 << 30) -> int:
    """Capacity per node for ``nodes`` nodes on this host: their share of the memory available
    now (``MEMORY_SHARE``), at most ``ceiling`` each, at least ``MIN_CAPACITY``, in whole MiB."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = int(available * MEMORY_SHARE) // max(nodes, 1)
    return max(MIN_CAPACITY, min(ceiling, share)) >> 20 << 20
