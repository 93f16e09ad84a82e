"""A coordination service in memory: etcd's contract (contract.py) as a model, on trio's clock.

For unit tests and the deterministic fault simulator: one object shared by every node and client
of a process. Linearizable because every call runs to completion on the trio thread without
awaiting. Leases end by trio's clock (a ``MockClock`` in the simulator): an ended lease's keys are
deleted before any call reads or writes, which no caller can tell from etcd deleting them on time.

``down`` makes every call raise ``Unavailable``, as an etcd that cannot be reached does; leases keep
running meanwhile (etcd's leader keeps counting them down, and keepalives do not get through).
"""

from __future__ import annotations

import itertools

import trio

from .contract import Coordinator, Entry
from ..errors import LeaseGone, CoordUnavailable as Unavailable


class MemoryCoord(Coordinator):
    """The model: keys, one revision counter, leases with deadlines on trio's clock."""

    def __init__(self) -> None:
        self.revision = 1  # etcd starts at 1 as well
        self.keys: dict[str, Entry] = {}
        self.leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, deadline)
        self._ids = itertools.count(0x1000)
        self.down = False
        self.calls = 0

    def _enter(self) -> None:
        """Every call: refuse while down, then end the leases whose time is up."""
        self.calls += 1
        if self.down:
            raise Unavailable("the coordination service is unreachable (simulated)")
        now = trio.current_time()
        for lease, (_, deadline) in list(self.leases.items()):
            if deadline <= now:
                self._end(lease)

    def _end(self, lease: int) -> None:
        del self.leases[lease]
        doomed = [k for k, e in self.keys.items() if e.lease == lease]
        if doomed:
            self.revision += 1  # etcd deletes a lease's keys in one revision
            for k in doomed:
                del self.keys[k]

    def _set(self, key: str, value: bytes, lease: int) -> int:
        if lease and lease not in self.leases:
            raise LeaseGone(f"lease {lease:x} has ended")
        self.revision += 1
        self.keys[key] = Entry(key, bytes(value), self.revision, lease)
        return self.revision

    async def get(self, key: str) -> Entry | None:
        self._enter()
        return self.keys.get(key)

    async def range(self, prefix: str) -> tuple[list[Entry], int]:
        self._enter()
        return [self.keys[k] for k in sorted(self.keys) if k.startswith(prefix)], self.revision

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._enter()
        return self._set(key, value, lease)

    async def cas(self, key: str, expect: int, value: bytes, lease: int = 0) -> tuple[bool, int]:
        self._enter()
        current = self.keys.get(key)
        if (current.mod_revision if current is not None else 0) != expect:
            return False, self.revision
        return True, self._set(key, value, lease)

    async def create_all(self, entries: dict[str, bytes]) -> tuple[bool, int]:
        self._enter()
        if any(k in self.keys for k in entries):
            return False, self.revision
        self.revision += 1  # one transaction, one revision
        for k, v in entries.items():
            self.keys[k] = Entry(k, bytes(v), self.revision, 0)
        return True, self.revision

    async def delete(self, key: str) -> int:
        self._enter()
        if self.keys.pop(key, None) is not None:
            self.revision += 1
        return self.revision

    async def grant(self, ttl: int) -> int:
        self._enter()
        lease = next(self._ids)
        self.leases[lease] = (max(1, int(ttl)), trio.current_time() + max(1, int(ttl)))
        return lease

    async def keepalive(self, lease: int) -> int:
        self._enter()
        if lease not in self.leases:
            return 0
        ttl = self.leases[lease][0]
        self.leases[lease] = (ttl, trio.current_time() + ttl)
        return ttl

    async def revoke(self, lease: int) -> None:
        self._enter()
        if lease in self.leases:
            self._end(lease)
