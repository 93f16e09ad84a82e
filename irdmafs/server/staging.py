"""Staging regions a node serves: where peers' one-sided WRITEs land before the call that names
them (a commit, an apply, a push, a training record).

Each owner (a client, a mount, a peer node) asks for regions (``alloc``), up to
``MAX_STAGING_PER_OWNER`` bytes, and keeps them leased by its heartbeats (``seen``): a killed mount
never says ``release``, so the regions of an owner not heard from for ``STAGING_LEASE`` seconds
are freed (``expire_loop``). A call names a staged range by (rkey, offset, length); ``view`` checks
it against the registered regions and answers EINVAL for one that is not there (freed, or never
handed out).

A region an owner replaces (it gave up a call in it: irdmafs/runtime/slots.py) is unregistered at once,
so every call that names it from then on is refused, but its memory is freed only
``STAGING_LEASE`` seconds later: a push under way may still hold a view of its bytes (over
verbs, freeing the memory region under it would free that memory).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import NamedTuple

import trio

from ..transport.base import Access, Region, Transport
from ..errors import AccessError, RemoteError
from .budget import Budget, NoSpace

log = logging.getLogger(__name__)

MAX_STAGING_PER_OWNER = 512 << 20
# Staging of an owner not heard from in heartbeats for this long is freed. A live owner cut off
# longer than this finds its region gone (AccessError) and asks for a new one.
STAGING_LEASE = 60.0
# Replaced regions waiting to be freed (see above), at most this many.
MAX_DRAINING = 64


class Staged(NamedTuple):
    """Where a peer's WRITE landed: a range of one of this node's staging regions."""

    rkey: int
    offset: int
    length: int

    @staticmethod
    def parse(value: object, length: int) -> "Staged":
        """``length`` bytes staged where a call's ``staged`` says: [rkey, offset]; EINVAL if it
        is not two integers."""
        if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
            raise RemoteError("EINVAL", f"staged is [rkey, offset], not {value!r}")
        return Staged(value[0], value[1], length)


class StagingRegions:
    def __init__(self, transport: Transport, budget: Budget | None = None):
        """``budget``: the node's (budget.py): staging counts against its capacity."""
        self.transport = transport
        self.budget = budget if budget is not None else Budget(1 << 62)
        self.by_owner: dict[str, list] = defaultdict(list)
        self.owner_seen: dict[str, float] = {}  # owner -> when last heard (trio clock)
        self.draining: list[tuple[float, Region]] = []  # (when replaced, region): freed later

    def alloc(self, owner: str, size: int, replace: bool = False) -> dict:
        """A staging region for ``owner``; with ``replace``, the owner's earlier ones go first:
        refused at once, their memory freed later (see above). A client that dropped its region
        after a failed transfer asks for a new one; the old one would otherwise stay allocated
        until the owner's 512 MiB were used up, then every write got ENOSPC (scripts/chaos.py)."""
        if not 0 < size <= MAX_STAGING_PER_OWNER:
            raise RemoteError("EINVAL", f"staging size {size} out of range")
        if replace:
            for old in self.by_owner.pop(owner, []):
                self.transport.regions.remove(old.rkey)  # refused from now on; freed later
                self.draining.append((trio.current_time(), old))
            while len(self.draining) > MAX_DRAINING:  # an owner replacing in a loop: the oldest go now
                self._free(self.draining.pop(0)[1])
        held = sum(r.length for r in self.by_owner[owner])
        if held + size > MAX_STAGING_PER_OWNER:
            raise RemoteError("ENOSPC", f"owner {owner} holds {held} bytes of staging already")
        try:
            self.budget.take("staging", size, f"; staging for {owner}")
        except NoSpace as exc:
            raise RemoteError("ENOSPC", str(exc)) from None
        region = self.transport.alloc_region(size, Access.WRITE)
        self.by_owner[owner].append(region)
        self.seen(owner)
        return {"rkey": region.rkey, "size": size}

    def release(self, owner: str) -> None:
        for region in self.by_owner.pop(owner, []):
            self._free(region)
        self.owner_seen.pop(owner, None)

    def _free(self, region: Region) -> None:
        self.transport.free_region(region)
        self.budget.give("staging", region.length)

    def holds(self, owner: str) -> bool:
        """Whether ``owner`` still has staging here: its lease has not ended (tails.py)."""
        return owner in self.by_owner

    def owner_of(self, where: "Staged") -> str | None:
        """The owner of the region a staged range is in (None: not a region handed out)."""
        for owner, regions in self.by_owner.items():
            if any(r.rkey == where.rkey for r in regions):
                return owner
        return None

    def last_heard(self, owner: str) -> float | None:
        """When ``owner``'s heartbeat last came (trio clock); None if never, or since its release."""
        return self.owner_seen.get(owner)

    def seen(self, owner: str) -> None:
        """``owner`` was heard from: its regions stay leased."""
        self.owner_seen[owner] = trio.current_time()

    async def expire_loop(self) -> None:
        """Free the regions of owners whose heartbeats stopped (``STAGING_LEASE``)."""
        while True:
            await trio.sleep(min(STAGING_LEASE / 4, 5.0))
            now = trio.current_time()
            while self.draining and now - self.draining[0][0] > STAGING_LEASE:
                self._free(self.draining.pop(0)[1])
            for owner in [o for o in self.by_owner if now - self.owner_seen.get(o, now) > STAGING_LEASE]:
                log.info("staging of %s freed: not heard from in %.0f s", owner, STAGING_LEASE)
                self.release(owner)

    def view(self, where: Staged) -> memoryview:
        """The staged bytes; EINVAL if that range is not in a staging region here."""
        try:
            return self.transport.regions.check(where.rkey, where.offset, where.length, Access.WRITE)
        except AccessError as exc:
            raise RemoteError("EINVAL", f"staging: {exc}") from None
