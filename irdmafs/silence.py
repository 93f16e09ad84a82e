"""A deadline on silence, not on size: work of any size may take as long as it progresses.

``SilenceBound(seconds)`` gives blocks (``with bound():``) that raise ``trio.TooSlowError`` once
nothing they share progressed for ``seconds``; each ``progressed()`` moves every open block's
deadline to ``seconds`` from now. A push of a model of GBs queues its tensors behind one another:
a fixed deadline per tensor counted its wait in the queue, and tensors late in a long step got
ETIMEDOUT while the step moved at full speed (chaos.py --model-gib 1; issue 41: "a deadline
bounds silence, not size").

Concurrency: one trio thread.
"""

from __future__ import annotations

from contextlib import contextmanager

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
