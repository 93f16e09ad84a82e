"""The one way a PS node changes what it leads: ``Leading``.

A change a node makes as a primary (a commit of staged bytes, a push and the round it closes, a
round applied here but not yet on every replica sent again, the rounds a new set of ranks
completes, a namespace op) goes through the same steps in the same order. The services call
these steps instead of repeating them (docs/design.md, U1-U4):

1. **admitted** (``admit``): the request's view epoch is this node's (``Serving.check_epoch``:
   ESTALE for an older one, a newer one read first) and the node is ready (not fenced by a stall
   or its lease). With ``takeover``, it also waits for its hand-over (``await_takeover``): a node
   just named by a view takes its work back from its stand-ins first.
2. **held** (``holding``; its halves ``changing`` and ``locked`` for a push, whose checks of
   the model and layout go between them, inside the barrier as they always were): the
   hand-over is awaited, then the commit barrier is entered (a
   snapshot or a rebalance freezes changes on every node: barrier.py), then the stripe's lock is
   taken; under it the node checks again that it leads the stripe and that the view is still
   the request's (``check_same_epoch``): a hand-over, a rebalance or a new view may have come
   while it waited, and its sender may have given it up.
3. **installed and replicated** (``replicate``): to every node the view targets, with the stripes
   whose bytes the sends read pinned until they are sent (store.py ``pinned``), so freed memory
   is not used again under a send. An acknowledged change lives on every replica.
4. **published**: only then is a round's clock published or the request answered (the early
   answer of a bsp round is the one exception, documented at ``Training._push_now``).

A backup's side (an ``apply``, a record kept) is not a change as primary: it checks the sender
(``Serving.check_sender``) and takes the stripe lock, and stays with its services. Nor is a
resync's install of a peer's copy (resync.py): a syncing node takes it under the stripe lock
alone, leads nothing and sends nothing.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from .barrier import CommitBarrier
from .core import NodeCore
from .replicator import Replicator
from .store import pinned
from .updates import StripeKey


class Leading:
    """Steps 1-3 above for one node (its serving checks, barrier, stripe locks, replicator)."""

    def __init__(self, core: NodeCore, barrier: CommitBarrier, replicator: Replicator):
        self.serving, self.locks = core.serving, core.locks
        self.barrier, self.replicator = barrier, replicator

    async def admit(self, epoch: int | None, *, takeover: bool = True) -> None:
        """Step 1: the request's view (``epoch``; None for a call that carries none) and the
        node's readiness; with ``takeover`` its hand-over awaited too (``holding`` awaits it
        anyway: a caller that refuses cheaply first, such as a commit to a stripe another node
        leads, passes False)."""
        if epoch is not None:
            await self.serving.check_epoch(epoch)
        self.serving.require_ready()
        if takeover:
            await self.serving.await_takeover()

    @asynccontextmanager
    async def holding(self, key: StripeKey, epoch: int | None, *, frozen: bool = True) -> AsyncIterator[None]:
        """Step 2 for stripe ``key``: ``changing`` (unless ``frozen`` is False: what was
        installed before a freeze and is only sent again), then ``locked``."""
        async with self.changing(frozen):
            async with self.locked(key, epoch):
                yield

    @asynccontextmanager
    async def changing(self, frozen: bool = True) -> AsyncIterator[None]:
        """The first half of step 2: the hand-over awaited (at once if ``admit`` awaited it),
        then the commit barrier entered. A change whose checks read what a freeze may change
        meanwhile (a push: the model's ranks, the layout) makes them inside it, before
        ``locked``, as the barrier's wait would leave them stale."""
        await self.serving.await_takeover()
        if frozen:
            async with self.barrier.changing():
                yield
        else:
            yield

    @asynccontextmanager
    async def locked(self, key: StripeKey, epoch: int | None) -> AsyncIterator[None]:
        """The second half of step 2: the stripe's lock taken, and under it ENOTPRIMARY unless
        this node still leads the stripe, ESTALE if a new view came meanwhile (``epoch``; None:
        not checked)."""
        async with self.locks((key.fid, key.idx)):
            self.serving.check_primary(key.fid, key.idx)
            if epoch is not None:
                self.serving.check_same_epoch(epoch)
            yield

    async def replicate(self, key: StripeKey, send: Callable[[str], Awaitable[bool]], *sources: object) -> None:
        """Step 3: ``send(peer)`` to every node the view targets for stripe ``key`` (True: that
        peer holds the change), with ``sources`` (store stripes the sends read) pinned meanwhile;
        EAGAIN if the targets kept changing or this node stopped leading it (replicator.py)."""
        with pinned(*sources):
            await self.replicator.to_every_target(key, send)
