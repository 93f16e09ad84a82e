"""A deadline on silence, not on size: work of any size may take as long as it progresses.

``SilenceBound(seconds)`` gives blocks (``with bound():``) that raise ``trio.TooSlowError`` once
nothing they share progressed for ``seconds``; each ``progressed()`` moves every open block's
deadline to ``seconds`` from now. A push of a model of GBs queues its tensors behind one another:
a fixed deadline per tensor counted its wait in the queue, and tensors late in a long step got
ETIMEDOUT while the step moved at full speed (chaos.py --model-gib 1; issue 41: "a deadline
bounds silence, not size").

``Patience(progress, seconds)`` is the same rule for an operation that follows nodes (a
namespace call, a commit, a read) while one of them does long work it must wait for (a resync,
a hand-over's catch-up): ``progress(node)`` is what that node last reported of its work (its
heartbeat's ``work``), and each ``heed(node)`` that finds it moved gives the operation its
``seconds`` again. A node taking a GB of stripes back made every lookup sent to it ETIMEDOUT
after a fixed 3 op timeouts while it fetched at full speed (chaos.py --model-gib 1, seed 3);
one that reports nothing new is waited for ``seconds`` and no more.

Concurrency: one trio thread.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable

import trio


class SilenceBound:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self._scopes: set[trio.CancelScope] = set()

    @contextmanager
    def __call__(self):
        scope = trio.CancelScope(deadline=trio.current_time() + self.seconds)
        self._scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._scopes.discard(scope)
        if scope.cancelled_caught:
            raise trio.TooSlowError

    def progressed(self) -> None:
        """Something the open blocks wait on moved: each has ``seconds`` again."""
        deadline = trio.current_time() + self.seconds
        for scope in self._scopes:
            scope.deadline = deadline


class Moves:
    """What nodes last reported of their long work (``progress(node)``), and whether it moved
    since it was last looked at (the first look at a node is where its progress is counted
    from). A client's pushes refused by a primary taking a GB back count its moves as their own
    progress (client/training.py): they timed out while it fetched (chaos --model-gib 2)."""

    def __init__(self, progress: Callable[[str], Hashable]):
        self.progress = progress
        self._seen: dict[str, Hashable] = {}

    def moved(self, *nodes: str) -> bool:
        moved = False
        for node in nodes:
            now = self.progress(node)
            moved |= node in self._seen and self._seen[node] != now
            self._seen[node] = now
        return moved


class Patience:
    """One operation's deadline on silence while it follows nodes (see the module's docstring):
    ``bound()`` around it, ``heed(node)`` after each refusal, ``expired()`` for a loop that
    checks rather than being cancelled."""

    def __init__(self, progress: Callable[[str], Hashable], seconds: float):
        self.moves = Moves(progress)
        self.seconds = seconds
        self.deadline = trio.current_time() + seconds
        self._scope: trio.CancelScope | None = None

    @contextmanager
    def bound(self):
        """A block that raises ``trio.TooSlowError`` at the deadline, moved by ``heed``."""
        self._scope = trio.CancelScope(deadline=self.deadline)
        try:
            with self._scope:
                yield self
        finally:
            scope, self._scope = self._scope, None
        if scope.cancelled_caught:
            raise trio.TooSlowError

    def heed(self, *nodes: str) -> None:
        """The deadline is ``seconds`` from now if any of ``nodes`` reported progress since it
        was last heeded (the first look at a node is where its progress is counted from)."""
        if self.moves.moved(*nodes):
            self.deadline = trio.current_time() + self.seconds
            if self._scope is not None:
                self._scope.deadline = self.deadline

    def expired(self) -> bool:
        return trio.current_time() >= self.deadline
