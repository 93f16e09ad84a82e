"""How late a process's trio loop runs: the measure of "no work blocks the loop".

A task sleeps ``INTERVAL`` in a loop and records how much later than asked it woke: the time
something else held the thread without yielding (a copy, a scan, a big install). A node fences
itself when its own loop did not run for ``down_after`` (server/serving.py), so work over large
data must run in slices or off the loop (issue 41: at most 0.2 s). ``worst`` is the worst lag
since start; ``recent`` the worst within the last ``WINDOW`` seconds. Shown by heartbeats,
``irdmafs status`` and the metrics (``irdmafs_node_loop_lag_worst_seconds``).

Concurrency: one task in the process's trio loop; readers on the same thread.
"""

from __future__ import annotations

import trio

INTERVAL = 0.02
WINDOW = 10.0


class LoopLag:
    def __init__(self) -> None:
        self.worst = 0.0
        self._recent: list[tuple[float, float]] = []  # (when, lag) of lags over 1 ms, last WINDOW s

    @property
    def recent(self) -> float:
        now = trio.current_time()
        return max((lag for when, lag in self._recent if now - when <= WINDOW), default=0.0)

    def observe(self, lag: float, now: float) -> None:
        self.worst = max(self.worst, lag)
        if lag > 0.001:
            self._recent = [(w, g) for w, g in self._recent if now - w <= WINDOW] + [(now, lag)]

    async def run(self) -> None:
        while True:
            asked = trio.current_time() + INTERVAL
            await trio.sleep_until(asked)
            now = trio.current_time()
            self.observe(now - asked, now)
