"""Stripes committed past their file's end by a writer that is gone: found and freed.

A write lands stripe by stripe (``commit``) and grows the file once, at its flush (``extend``),
so while a file is written its stripes past the namespace's size are normal: they are on their
way. Left there by a writer that failed (issue 55: a 0-byte file held 450 MB after `dd` met
ENOSPC) or died (a mount killed, a client process gone), they would hold memory nobody can read,
for ever. A writer that fails gives its own up here (``FileData.free_past_end``, client/data.py); one that dies
cannot, and its staging lease ending says so.

So the primary that commits a stripe past its file's end notes who wrote it (the owner of the
staging region it came in; every writer of it since it went past the end) and its stamp (tag,
version) (``committed``). Every ``SWEEP`` seconds it looks at what it noted: a stripe that the
file has grown over, that is gone, that changed here otherwise (another stamp: a view's new
primary wrote it) or that this node no longer leads is forgotten; one every writer of which is
gone (its staging lease ended: heartbeats stopped for ``STAGING_LEASE``, or it released its
staging: a client that closed) or gave it up (a failed write: ``release_tails``, from
``FileData.free_past_end``, client/data.py) is trimmed: the primary sends the namespace op ``trim {ino, stripes:
[[idx, tag, version]]}``, which every node applies in the namespace's order by dropping its copy
if the stripe is still past the file's end and its stamp is still that one or older
(server/namespace.py). A live writer's bytes in the stripe keep it (it is one of its writers);
a file grown over the stripe keeps it; so a trim never takes bytes a live writer may still
acknowledge.

Not covered: a primary that changes (a view change) before the writer's lease ends forgets what
it noted; the new one notes only what it commits. A live writer cut off from the primary alone
for longer than the staging lease counts as gone there, and its stripes past the end go before
its extend (which then grows the file over holes). A node's resync drops a copy past the end that
no peer holds (resync.py, ``converge``).

Concurrency: the node's trio thread; ``sweep`` awaits only the namespace op.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from ..held import extent_end
from ..errors import NodeDown, RemoteError
from .meta import Meta
from .staging import Staged, StagingRegions
from .store import Store

log = logging.getLogger(__name__)

SWEEP = 5.0  # seconds between looks at the stripes noted
NOTED_MAX = 1 << 16  # stripes noted at most (the oldest go first: a leak of their memory, logged)
TRIM_ROWS = 4096  # stripes one trim op names at most (a control document of ~100 KB; meta.py allows MAX_RUNS)


class Tails:
    """What this node committed past a file's end, and by whom (see the module's docstring)."""

    def __init__(
        self,
        store: Store,
        staging: StagingRegions,
        meta: Callable[[], Meta],
        trim: Callable[[dict], Awaitable[dict]],
        leads: Callable[[int, int], bool],
    ):
        """``trim(op)``: send a namespace op to the metadata primary (node.py); ``leads(fid,
        idx)``: whether this node is the stripe's primary in the view in force."""
        self.store, self.staging, self.meta, self.trim, self.leads = store, staging, meta, trim, leads
        # (fid, idx) -> [owners who committed to it since it went past the end, those of them
        # who gave it up (a failed write: ``rpc_release_tails``), its stamp after the last one]
        self.noted: dict[tuple[int, int], list] = {}
        self.trimmed = 0  # stripes freed this way (metrics, tests)

    def committed(self, fid: int, idx: int, staged: Staged, stamp: tuple[int, int]) -> None:
        """A commit of stripe (fid, idx), stamped (tag, version), from staging range ``staged``
        just installed here as its primary. Its writer is looked up only for a stripe past
        the end (``owner_of`` walks the owners' regions)."""
        node = self.meta().inodes.get(fid)
        if node is None or not node.get("unit") or idx * node["unit"] < extent_end(node):
            self.noted.pop((fid, idx), None)
            return
        owner = self.staging.owner_of(staged)  # None: not known
        entry = self.noted.pop((fid, idx), None) or [set(), set(), stamp]
        # an owner not known keeps the stripe for ever: never taken for a writer that is gone
        entry[0].add(owner if owner is not None else "?")
        entry[1].discard(owner)
        entry[2] = stamp
        self.noted[(fid, idx)] = entry  # (re-inserted last: the oldest first)
        if len(self.noted) > NOTED_MAX:
            (f, i), _ = next(iter(self.noted.items()))
            del self.noted[(f, i)]
            log.warning("stripe %d:%d: no longer watched for a writer gone (%d noted past their files' ends)", f, i, NOTED_MAX)

    def _gone(self, owner: str, released: set) -> bool:
        return owner != "?" and (owner in released or not self.staging.holds(owner))

    def due(self, only: set | None = None) -> list[tuple[int, int, tuple[int, int]]]:
        """The noted stripes to trim now, (fid, idx, stamp): every writer of each gone or given
        up, this node still their primary, the stripe as the last of them left it. Forgets
        those that no longer need watching."""
        meta, out = self.meta(), []
        for (fid, idx), (owners, released, stamp) in list(self.noted.items()):
            if only is not None and (fid, idx) not in only:
                continue
            node, stripe = meta.inodes.get(fid), self.store.get(fid, idx)
            if node is None or stripe is None or stripe.stamp != stamp or idx * node["unit"] < extent_end(node) or not self.leads(fid, idx):
                del self.noted[(fid, idx)]  # freed, written again elsewhere, grown over, or led elsewhere now
            elif all(self._gone(o, released) for o in owners):
                out.append((fid, idx, stamp))
        return out

    async def sweep(self, only: set | None = None) -> None:
        by_file: dict[int, list] = {}
        for fid, idx, (tag, version) in self.due(only):
            by_file.setdefault(fid, []).append([idx, tag, version])
        batches = [(fid, rows[at : at + TRIM_ROWS]) for fid, rows in by_file.items() for at in range(0, len(rows), TRIM_ROWS)]
        for fid, rows in batches:
            try:
                result = await self.trim({"op": "trim", "ino": fid, "stripes": rows})
            except (RemoteError, NodeDown) as exc:
                log.info("file %d: %d stripes past its end: trim not done yet (%s)", fid, len(rows), exc)
                continue
            for idx, *_ in rows:
                self.noted.pop((fid, idx), None)
            if result.get("trim"):
                self.trimmed += len(result["trim"])
                log.info("file %d: %d stripes past its end, their writers gone: freed", fid, len(result["trim"]))

    async def rpc_release_tails(self, owner: str, fid: int, idxs: list) -> dict:
        """``owner``'s write failed: it gives up what it committed past the end of ``fid``
        (``FileData.free_past_end``, client/data.py); a stripe no other writer of which is still there is trimmed
        now."""
        if not isinstance(owner, str) or type(fid) is not int or not isinstance(idxs, list) or not all(type(i) is int for i in idxs):
            raise RemoteError("EINVAL", "release_tails: owner, fid and a list of stripe indices")
        mine = set()
        for idx in idxs:
            entry = self.noted.get((fid, idx))
            if entry is not None and owner in entry[0]:
                entry[1].add(owner)
                mine.add((fid, idx))
        await self.sweep(mine)
        return {"released": len(mine)}

    async def loop(self) -> None:
        while True:
            await trio.sleep(SWEEP)
            await self.sweep()
