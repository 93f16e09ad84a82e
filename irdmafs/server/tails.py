"""Stripes committed past their file's end by a writer that is gone: found and freed.

A write lands stripe by stripe (``commit``) and grows the file once, at its flush (``extend``),
so while a file is written its stripes past the namespace's size are normal: they are on their
way. A writer that fails frees them itself (``Client.free_past_end``: a truncate to the file's
own size). One that dies cannot (a mount killed, a client process gone): its stripes past the
end would hold memory nobody can read, for ever (issue 55: a 0-byte file held 450 MB).

So the primary that commits a stripe past its file's end notes who wrote it (the owner of the
staging region it came in) and its version (``committed``). Every ``SWEEP`` seconds it looks at
what it noted: a stripe that the file has grown over, that is gone, or that was written again
(another version: noted anew) is forgotten; one whose writer's staging lease has ended (its
heartbeats stopped for ``STAGING_LEASE``, or it released its staging: a client that closed) is
trimmed: the primary sends the namespace op ``trim {ino, stripes: [[idx, version]]}``, which every node applies
in the namespace's order by dropping its copy if the stripe is still past the file's end and
still at that version or older (server/namespace.py). A live writer's later commit has a higher
version, and a file grown over the stripe keeps it, so a trim never takes acknowledged bytes.

Not covered: a primary that changes (a view change) before the writer's lease ends forgets what
it noted; the new one notes only what it commits. A node's resync drops a copy past the end that
no peer holds (resync.py, ``converge``).

Concurrency: the node's trio thread; ``sweep`` awaits only the namespace op.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from ..held import extent_end
from ..peers import NodeDown
from ..transport.base import RemoteError
from .meta import Meta
from .staging import StagingRegions
from .store import Store

log = logging.getLogger(__name__)

SWEEP = 5.0  # seconds between looks at the stripes noted
NOTED_MAX = 1 << 16  # stripes noted at most (the oldest go first: a leak of their memory, logged)


class Tails:
    """What this node committed past a file's end, and by whom (see the module's docstring)."""

    def __init__(self, store: Store, staging: StagingRegions, meta: Callable[[], Meta], trim: Callable[[dict], Awaitable[dict]]):
        """``trim(op)``: send a namespace op to the metadata primary (node.py)."""
        self.store, self.staging, self.meta, self.trim = store, staging, meta, trim
        self.noted: dict[tuple[int, int], tuple[str, int]] = {}  # (fid, idx) -> (owner, version)
        self.trimmed = 0  # stripes freed this way (metrics, tests)

    def committed(self, fid: int, idx: int, owner: str | None, version: int) -> None:
        """A commit of stripe (fid, idx) at ``version`` by ``owner`` (None: not known) just
        installed here as its primary."""
        node = self.meta().inodes.get(fid)
        if owner is None or node is None or not node.get("unit") or idx * node["unit"] < extent_end(node):
            self.noted.pop((fid, idx), None)
            return
        self.noted.pop((fid, idx), None)  # (re-inserted last: the oldest first)
        self.noted[(fid, idx)] = (owner, version)
        if len(self.noted) > NOTED_MAX:
            (f, i), _ = next(iter(self.noted.items()))
            del self.noted[(f, i)]
            log.warning("stripe %d:%d: no longer watched for a writer gone (%d noted past their files' ends)", f, i, NOTED_MAX)

    def due(self) -> list[tuple[int, int, int]]:
        """The noted stripes to trim now, (fid, idx, version); forgets those that no longer
        need watching."""
        meta, out = self.meta(), []
        for (fid, idx), (owner, version) in list(self.noted.items()):
            node, stripe = meta.inodes.get(fid), self.store.get(fid, idx)
            if node is None or stripe is None or stripe.version != version or idx * node["unit"] < extent_end(node):
                del self.noted[(fid, idx)]  # freed, written again (noted again if past the end), or grown over
            elif not self.staging.holds(owner):
                out.append((fid, idx, version))
        return out

    async def sweep(self) -> None:
        for fid, idx, version in self.due():
            try:
                result = await self.trim({"op": "trim", "ino": fid, "stripes": [[idx, version]]})
            except (RemoteError, NodeDown) as exc:
                log.info("stripe %d:%d past its file's end: trim not done yet (%s)", fid, idx, exc)
                continue
            self.noted.pop((fid, idx), None)
            if result.get("trim"):
                self.trimmed += 1
                log.info("stripe %d:%d (version %d): past its file's end, its writer gone: freed", fid, idx, version)

    async def loop(self) -> None:
        while True:
            await trio.sleep(SWEEP)
            await self.sweep()
