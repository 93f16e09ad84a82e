"""A hand-over's arrays as they were at its answer, kept by a stand-in until the joiner fetched them.

A hand-over's answer must carry the stand-in's push bookkeeping taken at that instant (membership.py:
paging it in calls after the answer let a later change set a count back and lost a push, mixed
simulator seed 732). At a model's size that bookkeeping is mostly arrays (the open bsp rounds'
sums: hundreds of MB for a 1 GiB model mid-round), which encoded into the answer held the node's
loop for seconds and overflowed the control frame, so a node could never rejoin (chaos
``--model-gib 1``, issue 41). So the answer carries the counts and references into a cut:

- C1. ``take`` keeps the arrays by reference and freezes them (numpy's ``writeable`` off): the
  bookkeeping never changes one in place again (rounds.py ``_own``: a push into a frozen
  round's sum, or its completion, works on a copy), so what the joiner fetches later is exactly
  the instant's, at no copy at the answer.
- C2. ``page`` serves the arrays in order from a cursor, at most ``limit`` bytes a call, so no
  call encodes more than a page on the loop.
- C3. A cut is dropped when the joiner releases it, or ``TTL`` seconds after its last use (a
  joiner that died); a joiner that finds it gone (``ESTALE``) begins its join again.

Concurrency: the node's trio thread.
"""

from __future__ import annotations

import itertools

import numpy as np
import trio

from ..errors import RemoteError

TTL = 120.0  # seconds a cut is kept after its last use


class Cuts:
    def __init__(self) -> None:
        self._cuts: dict[int, tuple[list[memoryview], float]] = {}
        self._ids = itertools.count(1)

    def take(self, arrays: list[np.ndarray]) -> int:
        """Keep ``arrays`` as they are now (frozen, C-contiguous); the cut's id."""
        self.expire()
        views = []
        for a in arrays:
            a.flags.writeable = False
            views.append(memoryview(a.reshape(-1)).cast("B"))
        cut = next(self._ids)
        self._cuts[cut] = (views, trio.current_time())
        return cut

    def page(self, cut: int, k: int, offset: int, limit: int) -> tuple[list[tuple[int, int, memoryview]], tuple[int, int] | None]:
        """From array ``k``, byte ``offset`` on: (k, offset, bytes) pieces of at most ``limit``
        bytes in all, and the cursor to go on from (None after the last)."""
        views = self._get(cut)
        out, size = [], 0
        while k < len(views) and size < limit:
            piece = views[k][offset : offset + limit - size]
            out.append((k, offset, piece))
            size += len(piece)
            offset += len(piece)
            if offset >= len(views[k]):
                k, offset = k + 1, 0
        return out, ((k, offset) if k < len(views) else None)

    def sizes(self, cut: int) -> list[int]:
        return [len(v) for v in self._get(cut)]

    def release(self, cut: int) -> None:
        self._cuts.pop(cut, None)

    def expire(self) -> None:
        now = trio.current_time()
        for cut in [c for c, (_, used) in self._cuts.items() if now - used > TTL]:
            del self._cuts[cut]

    def _get(self, cut: int) -> list[memoryview]:
        self.expire()
        entry = self._cuts.get(cut)
        if entry is None:
            raise RemoteError("ESTALE", f"hand-over cut {cut} is gone (released, expired, or this node restarted)")
        self._cuts[cut] = (entry[0], trio.current_time())
        return entry[0]
