"""How many bytes of READ answers one TCP connection lets be on their way at once.

A TCP connection's serving side answers the requests of one socket in order, so whatever is
sent behind a burst of READs (a heartbeat, a control call, another task's read) waits until the
whole burst has crossed. A pull of a model of GBs is one burst of hundreds of MB per node: a
heartbeat behind it waited seconds and the caller counted a working node down (chaos
``--model-gib 1``, issue 41). The window bounds that wait by bytes, not by the size of what a
caller asked: a burst larger than the window is sent as earlier answers arrive, so nothing on
the socket ever queues behind more than ``limit`` bytes (plus the kernel's buffers).

Rules: room is given in turn (first come, first served: a large request is never starved by
small ones); a request larger than the whole window is let through alone once the window is
empty; a waiter gives up with ``TimeoutError`` when no answer freed any room for ``silence``
seconds (a deadline on silence, never on size), and with the connection's error once it broke.

Concurrency: one trio thread (the connection's).
"""

from __future__ import annotations

import trio

from ..errors import TimeoutError, TransportError


class Window:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0  # the most ever in flight at once (tests check the bound)
        self._turn = trio.Lock()  # FIFO: the head of the line waits for room, the rest for it
        self._freed = trio.Event()
        self._broken: TransportError | None = None

    def _fits(self, n: int) -> bool:
        return not self.used or self.used + n <= self.limit

    def _add(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    async def take(self, n: int, silence: float) -> None:
        """Room for ``n`` bytes, in turn. TimeoutError if nothing was freed for ``silence``
        seconds while waiting; the connection's error once it broke."""
        async with self._turn:
            while not self._fits(n):
                self._check()
                freed = self._freed
                with trio.move_on_after(silence) as waited:
                    await freed.wait()
                if waited.cancelled_caught:
                    raise TimeoutError(f"no READ answered within {silence}s")
            self._check()
            self._add(n)

    def _check(self) -> None:
        if self._broken is not None:
            raise type(self._broken)(str(self._broken))

    def try_take(self, n: int) -> bool:
        """Room for ``n`` bytes now, if nobody waits in line and it fits."""
        if self._turn.locked() or not self._fits(n) or self._broken is not None:
            return False
        self._add(n)
        return True

    def give(self, n: int) -> None:
        if n:
            self.used -= n
            self._freed.set()
            self._freed = trio.Event()

    def close(self, error: TransportError) -> None:
        """The connection broke: every waiter raises ``error``."""
        self._broken = error
        self._freed.set()
