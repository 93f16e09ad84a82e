"""A client's waits for stripe clocks, told by the node (server/clocks.py) instead of polled.

A pull that finds a stripe's clock behind the round it needs calls ``ClockWaits.wait``, which
returns once the node that serves the stripe says the header is worth reading again (the round
closed, or the key went stale), or at the caller's deadline. The caller then reads the header
one-sidedly, as before, and trusts only that read.

Invariants (server/clocks.py keeps the node's side):
- Being woken proves nothing: a wait's only effect is when the caller looks again, so a late,
  lost or wrong answer delays a pull but never lets it read a round that has not closed.
- Every waiting stripe is in at most one call at a time, and one not in any is put in one
  within GATHER scheduler passes (by its own waiter, if no other takes it): the waits that
  start together (a step's pulls as their pushes are
  taken) share one call per node, and a call's answer releases those it names, the others
  joining the next call together with the waits that came meanwhile.
- A node that cannot answer (down, or too old to know the call: ENOSYS) is polled instead, the
  caller backing off as it did before notifications (``wait`` returns False): a wait never
  fails a pull that a poll would have served.

Concurrency: one trio thread; no task of its own (the first waiter of a batch makes the call).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from ..errors import NodeDown, TransportError
from ..regions import CLOCK_WAITS

log = logging.getLogger(__name__)

MAX_WAIT = 1.0  # seconds one call may wait on the node (server/clocks.py allows up to 5)
GATHER = 4  # scheduler passes a call waits for more waits to join it
UNTOLD = 30.0  # seconds a node that does not know ``clock_wait`` is polled instead


@dataclass(eq=False)
class _Wait:
    stripe: list  # [rkey, incarnation, clock, settled], as the call names it
    told: bool = False  # the node said: look again
    asking: bool = False  # in a call under way
    gone: bool = False  # its waiter stopped waiting
    event: trio.Event = field(default_factory=trio.Event)  # set when its call comes back


class ClockWaits:
    """Waits for stripe clocks, one call per node for all that wait together."""

    def __init__(self, call: Callable[..., Awaitable[dict]], op_timeout: float):
        """``call(node, method, args, timeout=)``: a control call (Cluster.call)."""
        self._call, self._op_timeout = call, op_timeout
        self._waiting: dict[str, list[_Wait]] = {}  # node -> waits in no call
        self._untold: dict[str, float] = {}  # node -> until when it is polled instead
        self.calls = 0  # clock_wait calls made (tests, metrics)

    async def wait(self, node: str, rkey: int, inc: int, clock: int, settled: bool, until: float) -> bool:
        """Until ``node`` says the stripe of key (``rkey``, ``inc``) may have reached
        ``clock`` (not pending, if ``settled``), or ``until``. False at once if the node is
        polled instead (the caller sleeps its own backoff, then reads the header)."""
        if trio.current_time() < self._untold.get(node, -1.0):
            return False
        w = _Wait([rkey, inc, clock, settled])
        self._waiting.setdefault(node, []).append(w)
        try:
            with trio.move_on_at(until):
                while not w.told:
                    if w.asking:
                        await w.event.wait()
                        continue
                    await self._gather(node)
                    if not (w.asking or w.told):
                        await self._ask(node, until, w)
        finally:
            w.gone = True
            waiting = self._waiting.get(node)
            if waiting and w in waiting:
                waiting.remove(w)
        return not self._untold.get(node, -1.0) > trio.current_time()

    async def _gather(self, node: str) -> None:
        """Let the waits starting beside this one join its call: scheduler passes while more
        of them come (a step's pulls reach their waits a pass or two apart), GATHER at most."""
        before = -1
        for _ in range(GATHER):
            waiting = len(self._waiting.get(node, ()))
            if waiting == before:
                return
            before = waiting
            await trio.lowlevel.checkpoint()

    async def _ask(self, node: str, until: float, mine: _Wait) -> None:
        """One call for the waits on ``node`` in no call now, ``mine`` (the caller's) first
        (CLOCK_WAITS of them; the others make their own); each told or back in the queue."""
        waiting = self._waiting.get(node, [])
        if mine in waiting:
            waiting.remove(mine)
            waiting.insert(0, mine)
        batch, waiting[:] = waiting[:CLOCK_WAITS], waiting[CLOCK_WAITS:]
        if not batch:
            return
        for w in batch:
            w.asking = True
        reached: set[int] = set()
        try:
            wait = max(0.0, min(MAX_WAIT, until - trio.current_time()))
            self.calls += 1
            r = await self._call(node, "clock_wait", {"stripes": [w.stripe for w in batch], "timeout": wait}, timeout=wait + self._op_timeout)
            reached = {i for i in r.get("reached", []) if isinstance(i, int)}
        except (NodeDown, TransportError) as exc:  # RemoteError included: ENOSYS from an older node, EIO
            code = getattr(exc, "code", "")
            untold = UNTOLD if code == "ENOSYS" else self._op_timeout
            if self._untold.get(node, -1.0) <= trio.current_time():
                log.info("clock waits on %s: %s; its clocks are polled for %.0f s", node, exc, untold)
            self._untold[node] = trio.current_time() + untold
            reached = set(range(len(batch)))  # every waiter looks again, and polls
        finally:
            left = []
            for i, w in enumerate(batch):
                w.asking = False
                w.told = w.told or i in reached
                if not (w.told or w.gone):
                    left.append(w)
                ev, w.event = w.event, trio.Event()
                ev.set()
            if left:  # the first of them to run asks again, for these and any new ones
                self._waiting.setdefault(node, []).extend(left)
