"""Write-staging slots in peers' memory: where a one-sided WRITE lands before the call that names
it (a client's ``commit`` or push, a primary's ``apply`` or training record), one slot per
write in flight so that concurrent writes never share one.

A writer asks each node once for a staging region (``staging`` call) of ``slots`` slots of
``slot_size`` bytes. A region belongs to the node's incarnation: a restart drops it
(``Peers.on_restart``), and so does a slot found gone (EINVAL naming the staging, or
AccessError). Only the region that failed is dropped: several sends to a restarted node fail at
once, and the first to ask for a new region (which replaces the old one on the node) must not
have it dropped again by the others' failures on the old one -- that made the next send to it
fail too, and a node count its restarted peer down (fault simulator, heartbeat "crash" seed 22).

**A call given up on retires its region.** A call whose answer never came (a timeout, a lost
connection, a cancelled wait) may still be under way on the node: waiting there for a stripe
lock, a freeze, a view. Its slot is then never written again, and the region it is in is
retired: no new send starts in it, and the next send to that node asks for a new region with
``replace``, which frees the old one there. The node resolves a staged range again right before
it installs it (server/datapath.py), so a call its sender gave up on installs before the
sender's next send to that node, or never. Returned to the pool, the slot took the next write's
bytes while the old commit still waited on the node, which then installed them over the range
of the write that was since acknowledged (chaos --views seed 7, 30 minutes: a write's piece of
a stripe read back as another write's bytes, at every later check).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import trio

from ..errors import AccessError, RemoteError, TransportError

if TYPE_CHECKING:
    from .cluster import Cluster


class Slot(NamedTuple):
    """One slot of a peer's staging region: where a WRITE lands before the call naming it."""

    rkey: int
    offset: int
    inc: int  # the incarnation of the node that handed out the region


def staging_gone(exc: BaseException) -> bool:
    """Whether a send failed because its staging slot is gone: AccessError (the node restarted),
    EINVAL naming its staging (the node freed it), or EINVAL naming an unknown rkey (a WRITE
    with immediate whose notification found the region freed: transport/base.py,
    ``serve_imm_call``). The sender asks for a new region."""
    if isinstance(exc, AccessError):
        return True
    return isinstance(exc, RemoteError) and exc.code == "EINVAL" and exc.message.startswith(("staging", "unknown rkey"))


def answered(exc: BaseException) -> bool:
    """Whether a failed send has a known outcome: the node answered (an error of its own, which
    ends its handling of the call) or refused the WRITE before any call was made."""
    return isinstance(exc, (RemoteError, AccessError))


@dataclass
class Region:
    """A staging region this writer holds on one node."""

    rkey: int
    inc: int  # the incarnation of the node that handed it out
    free: list[int]  # offsets of the slots not in use
    sem: trio.Semaphore
    retired: bool = False  # a call in it was given up on: no new send starts here


class StagingPool:
    def __init__(self, cluster: "Cluster", owner: str, slot_size: int, slots: int = 4):
        self.cluster = cluster
        self.owner = owner
        self.slot_size = slot_size
        self.slots = slots
        self._regions: dict[str, Region] = {}
        self._locks: dict[str, trio.Lock] = defaultdict(trio.Lock)
        self.retired = 0  # regions retired for a call given up on (see above)
        cluster.peers.on_restart.append(self.forget)

    async def _region(self, node: str) -> Region:
        async with self._locks[node]:
            if node not in self._regions:
                # one region per node and owner: a new one replaces what the node still holds
                r, inc = await self.cluster.call_on(node, "staging", {"owner": self.owner, "size": self.slot_size * self.slots, "replace": True})
                free = [i * self.slot_size for i in range(self.slots)]
                self._regions[node] = Region(r["rkey"], inc, free, trio.Semaphore(self.slots))
            return self._regions[node]

    def forget(self, node: str, rkey: int | None = None) -> None:
        """The node restarted: its staging region is gone (with ``rkey``: only if that is still
        the region held of it)."""
        held = self._regions.get(node)
        if held is not None and (rkey is None or held.rkey == rkey):
            del self._regions[node]

    def _retire(self, node: str, region: Region) -> None:
        if not region.retired:
            region.retired = True
            self.retired += 1
        self.forget(node, region.rkey)

    async def with_slot(self, node: str, fn):
        """``fn(slot)`` with a free ``Slot`` of ``node``'s region, returned to the pool after.
        If the slot is found gone (``staging_gone``), the region is dropped so that the next
        call asks for a new one, and the error is raised for the caller to send again. If
        ``fn`` ends without an answer (see ``answered``), the region is retired and the slot
        kept out of the pool (see above), and the error is raised."""
        while True:
            region = await self._region(node)
            async with region.sem:
                if region.retired:
                    continue  # waited for a slot of a region given up meanwhile: the new one
                offset = region.free.pop()
                try:
                    result = await fn(Slot(region.rkey, offset, region.inc))
                except BaseException as exc:
                    if isinstance(exc, TransportError) and staging_gone(exc):
                        self.forget(node, region.rkey)
                    if not answered(exc):
                        self._retire(node, region)
                        raise  # its slot stays out of the pool: the call may still be under way
                    region.free.append(offset)
                    raise
                region.free.append(offset)
                return result
