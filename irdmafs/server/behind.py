"""What the store leaves to tasks off the loop: freed memory released, and files written behind.

``Behind`` owns both queues and the tasks that drain them (the node runs ``reap`` and, with
``--persist``, ``write_behind``; without them, as in a test's store, each is done where it is
queued):

- memory whose last registration went (``dispose``), released through a worker thread by
  ``reap``: freeing a snapshot of 800 MiB unmapped its pages for 0.12 s on the loop. While the
  reaper runs, memory only snapshots held may be kept as spares instead for the next copy on
  write (spares.py: ``spares``, which it releases when idle and when it stops);
- the persist operations queued for every stripe at once (``later``: a snapshot's links, what
  a drop freed), done in order by ``write_behind`` (persist.py); ``persisted`` waits until they
  are on disk (a snapshot answers then).

Concurrency: the node's trio thread; the work itself runs in ``offload``'s worker thread.
"""

from __future__ import annotations

import trio

from ..runtime.offload import Offload
from ..transport.base import Transport
from .budget import Budget
from .spares import Spares

IDLE_CHECK = 2.0  # how often the reaper looks for idle spares


class Behind:
    def __init__(self, transport: Transport, budget: Budget, persist, spare_limit: int):
        self.persist = persist  # a server.persist.Persist, or None
        # memory whose last registration went, released off the loop by ``reap``; inline without it
        self.reaping = False
        self.dying: list[memoryview] = []
        self._dying_ready = trio.Event()
        # memory kept for the copies on write to come (spares.py); only while the reaper runs
        # (a node: it also releases what is idle)
        self.spares = Spares(transport, budget, self.dispose, spare_limit)
        # files of every stripe at once written behind by ``write_behind``; inline without it
        self.writing_behind = False
        self._behind = trio.Event()

    async def reap(self, offload: Offload) -> None:
        """Release freed memory through ``offload`` (a worker thread: munmap releases the GIL),
        batch by batch, for as long as it runs; the node runs it. Without it (a test's store)
        memory is released where it is freed."""
        self.reaping = True
        try:
            while True:
                with trio.move_on_after(IDLE_CHECK):
                    await self._dying_ready.wait()
                if self.spares.idle():
                    self.spares.release()
                if not self.dying:
                    continue
                self._dying_ready = trio.Event()
                batch, self.dying = self.dying, []
                await offload.run(batch.clear)
        finally:
            self.reaping = False
            self.spares.release()

    def dispose(self, buf: memoryview) -> None:
        """Memory nobody uses any more: released by the reaper (inline without it)."""
        if self.reaping:
            self.dying.append(buf)
            self._dying_ready.set()

    async def write_behind(self, offload: Offload) -> None:
        """Do the persist operations queued for every stripe at once (``later``) through
        ``offload``, for as long as it runs; the node runs it with ``--persist``."""
        self.writing_behind = True
        try:
            while True:
                await self._behind.wait()
                self._behind = trio.Event()
                await offload.run(self.persist.drain)
        finally:
            self.writing_behind = False
            self.persist.drain()  # a node that stops leaves nothing queued

    async def persisted(self, offload: Offload) -> None:
        """Until what ``later`` queued is on disk (a snapshot answers then)."""
        if self.persist is not None:  # always: drain waits, under the lock, for one in flight
            await offload.run(self.persist.drain)

    def later(self, ops: list) -> None:
        """Queue persist operations (persist.py ``later``) for ``write_behind``; done at once
        without it."""
        if self.persist is None or not ops:
            return
        self.persist.later(ops)
        if self.writing_behind:
            self._behind.set()
        else:
            self.persist.drain()
