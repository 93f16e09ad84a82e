"""One destination's queue of items sent in batches by the tasks that queued them: a client's
pushes to a node (client/training.py), a node's replica updates to a peer (server/replicator.py).

``Batcher.put(value, size, order)`` queues an item and returns its own answer. While fewer
than ``senders`` batches are under way the caller sends at once (its item first, with whatever
queued beside it, up to ``limit`` bytes); otherwise the item waits, and travels with the others
queued meanwhile in the next batch (fusion with no added latency when idle; as many batches in
flight as the destination has slots).

Rules:
- Items leave lowest ``order`` first, equal orders as they came. A caller with an ordered item
  (``order`` finite) lets the items queued in the same scheduler pass join the queue before it
  takes its first batch, so a step's pushes leave in the model's order, not the scheduler's.
- **A sender returns as soon as its own item is answered.** It does not drain the queue: the
  sending is handed on to the task of the lowest queued item (``_hand_on``). A sender that
  drained the queue held its own answer back until the queue was empty: a node's replica copy
  of the first round a step closed published only when the step's last copy had gone, and a
  push's pull started only after the rank's last push (issue 42: the step's pulls drained
  after its pushes instead of overlapping them).
- While items are queued, some task is sending or has been handed the sending: a sender that
  leaves, or a task that was handed the sending and is cancelled first, hands it on.
- A caller cancelled while its item is queued takes the item back: it is never sent. One whose
  item is in a batch on its way is answered ``Unsent`` if that batch's sender was cancelled
  midway (the item may or may not have arrived: the caller decides what a retry means).
- ``send(values)`` answers one result per value, in order (an exception instance as a value is
  raised to that item's caller); an exception it raises is every item's answer.

Concurrency: one trio thread; no task of its own.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Awaitable, Callable

import trio

from ..errors import Unsent  # noqa: F401 (the same class)


class _Item:
    __slots__ = ("value", "size", "order", "result", "done", "wake", "taken", "handed")

    def __init__(self, value: Any, size: int, order: float) -> None:
        self.value, self.size, self.order = value, size, order
        self.result: Any = None
        self.done = False
        self.wake = trio.Event()  # set when answered, or when handed the sending
        self.taken = False  # in a batch (no longer queued)
        self.handed = False  # its task is to send next (``_hand_on``)


class Batcher:
    def __init__(self, senders: int, limit: int, send: Callable[[list], Awaitable[list]]) -> None:
        """``senders``: batches under way at once at most; ``limit``: bytes a batch takes
        (its first item whatever its size); ``send(values)``: one batch's answers."""
        self.senders, self.limit, self.send = senders, limit, send
        self._queue: list[tuple[float, int, _Item]] = []
        self._seq = itertools.count()
        self._sending = 0  # tasks sending now
        self._handed = 0  # tasks handed the sending, not yet running it
        self.batches = 0  # batches sent (tests, metrics)

    def __len__(self) -> int:
        return len(self._queue)

    async def put(self, value: Any, size: int, order: float = math.inf) -> Any:
        """``value`` sent in a batch; its answer (raised if an exception)."""
        item = _Item(value, size, order)
        heapq.heappush(self._queue, (order, next(self._seq), item))
        try:
            if self._sending + self._handed < self.senders:
                await self._send_until(item, gather=order != math.inf)
            while not item.done:
                await item.wake.wait()
                item.wake = trio.Event()
                if item.handed:
                    item.handed = False
                    self._handed -= 1
                    await self._send_until(item)
        except BaseException:
            self._leave(item)
            raise
        if isinstance(item.result, BaseException):
            raise item.result
        return item.result

    async def _send_until(self, mine: _Item, gather: bool = False) -> None:
        """Send batches, lowest first, until ``mine`` is answered or nothing is queued."""
        self._sending += 1
        try:
            if gather:
                await trio.lowlevel.checkpoint()
            while self._queue and not mine.done:
                # a cancelled sender takes no batch: its cancellation would cut off the others' items
                await trio.lowlevel.checkpoint_if_cancelled()
                batch = self._take()
                try:
                    results = await self.send([i.value for i in batch])
                except Exception as exc:
                    results = [exc] * len(batch)
                except BaseException:  # cancelled midway: the batch's fate is unknown
                    for i in batch:
                        self._answer(i, Unsent("its batch's sender was cancelled"))
                    raise
                if len(results) != len(batch):  # never leave an item waiting for a missing answer
                    results = [RuntimeError(f"{len(results)} answers to a batch of {len(batch)}")] * len(batch)
                self.batches += 1
                for i, r in zip(batch, results, strict=True):
                    self._answer(i, r)
        finally:
            self._sending -= 1
            self._hand_on()

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        size, rehand = 0, False
        while self._queue and (not batch or size + self._queue[0][2].size <= self.limit):
            item = heapq.heappop(self._queue)[2]
            item.taken = True
            if item.handed:  # it was to send next; it is being sent instead: another is
                item.handed, rehand = False, True
                self._handed -= 1
            batch.append(item)
            size += item.size
        if rehand:
            self._hand_on()
        return batch

    @staticmethod
    def _answer(item: _Item, result: Any) -> None:
        item.result, item.done = result, True
        item.wake.set()

    def _hand_on(self) -> None:
        """While items are queued and fewer than ``senders`` tasks send or are about to, the
        task of the lowest queued item not yet handed it sends next."""
        while self._queue and self._sending + self._handed < self.senders:
            waiting = [e for e in self._queue if not e[2].handed]
            if not waiting:
                return
            item = min(waiting)[2]
            item.handed = True
            self._handed += 1
            item.wake.set()

    def _leave(self, item: _Item) -> None:
        """``item``'s caller is gone (cancelled): take it out of the queue, and pass on the
        sending it was handed."""
        if not item.taken and not item.done:
            self._queue = [e for e in self._queue if e[2] is not item]
            heapq.heapify(self._queue)
        if item.handed:
            item.handed = False
            self._handed -= 1
        self._hand_on()
