"""Clock waits: a pull is told when the round it waits for has closed, instead of polling the
stripe's clock word (``clock_wait``).

A client names stripes of this node as its keys name them, ``[rkey, incarnation, clock,
settled]``, and the node answers with the indices of those whose header now says what the
client waits for (a published clock of at least ``clock``; with ``settled``, not pending
either), or that the client must look at again itself: a key of another incarnation, or a
region gone or not readable one-sidedly (its own read then says why: StaleKey, AccessError).
It answers as soon as one of them is so, or with none after ``timeout`` seconds.

Invariants (client/clockwait.py keeps the other side):
- An answer is a hint, never a proof. The client reads the header one-sidedly before it reads
  the data and trusts only that read, so a late, lost or wrong answer can delay a pull but
  never make it read a round that has not closed.
- Every clock word moves through the store, which sets ``Store.changed`` each time (and when a
  region goes): no change is missed between a look and the wait that follows it, because both
  happen without a checkpoint between them.
- An answer comes within ``timeout`` (at most MAX_WAIT) of the call, whatever happens here.
- It tells a client nothing it could not read itself: only the headers of regions it may read.

Malformed arguments are EINVAL, saying what is wrong.
"""

from __future__ import annotations

import trio

from ..regions import CLOCK_WAITS, HEADER, PENDING, read_header
from ..transport.base import Access, Transport
from ..errors import AccessError, RemoteError
from .store import Store

MAX_WAIT = 5.0  # seconds a clock wait may hold a call
GATHER = 4  # scheduler passes an answer waits for more stripes to reach their clocks


class ClockWaits:
    """This node's side of ``clock_wait``."""

    def __init__(self, transport: Transport, store: Store):
        self.transport, self.store = transport, store

    async def rpc_clock_wait(self, stripes: list, timeout: float) -> dict:
        """Until one of ``stripes`` ([rkey, incarnation, clock, settled]) is as its waiter
        wants, or must be looked at again: ``{"reached": [indices]}``; none after ``timeout``."""
        waits = _checked(stripes, timeout)
        reached: list[int] = []
        with trio.move_on_after(timeout):
            while True:
                changed = self.store.changed  # taken before looking: a change after the look sets it
                reached = [i for i, w in enumerate(waits) if self._reached(*w)]
                if reached:
                    break
                await changed.wait()
        if reached:  # outside the timeout: what was found is answered, not lost at its edge
            reached = await self._more(waits, reached)
        return {"reached": reached}

    async def _more(self, waits: list, reached: list[int]) -> list[int]:
        """``reached``, and those that reach it within GATHER scheduler passes: the rounds of
        one batch of pushes close a pass or two apart, and one answer for them saves the
        client a call per round."""
        for _ in range(GATHER):
            await trio.lowlevel.checkpoint()
            now = [i for i, w in enumerate(waits) if self._reached(*w)]
            if len(now) == len(reached):
                break
            reached = now
        return reached

    def _reached(self, rkey: int, inc: int, clock: int, settled: bool) -> bool:
        if inc and inc != self.transport.incarnation:
            return True  # a key of an earlier start of this node: its read says StaleKey
        try:
            head = read_header(self.transport.regions.check(rkey, 0, HEADER, Access.READ))
        except AccessError:
            return True  # gone (moved, freed) or not a stripe: its read says so
        return head.clock >= clock and not (settled and head.pending)


def _checked(stripes, timeout) -> list[tuple[int, int, int, bool]]:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_WAIT:
        raise RemoteError("EINVAL", f"clock_wait: timeout {timeout!r} is not a number of seconds from 0 to {MAX_WAIT}")
    if not isinstance(stripes, list) or len(stripes) > CLOCK_WAITS:  # each is looked at on every clock change
        raise RemoteError("EINVAL", f"clock_wait: stripes must be a list of at most {CLOCK_WAITS}")
    out = []
    for w in stripes:
        if (
            not isinstance(w, list)
            or len(w) != 4
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < PENDING for x in w[:3])
            or not isinstance(w[3], bool)
        ):
            raise RemoteError("EINVAL", f"clock_wait: {w!r} is not [rkey, incarnation, clock, settled]")
        out.append((w[0], w[1], w[2], w[3]))
    return out
