"""How late a process's trio loop runs: the measure of "no work blocks the loop".

A task sleeps ``INTERVAL`` in a loop and records how much later than asked it woke: the time
something else held the thread without yielding (a copy, a scan, a big install). A node fences
itself when its own loop did not run for ``down_after`` (server/serving.py), so work over large
data must run in slices or off the loop (issue 41: at most 0.2 s). ``worst`` is the worst lag
since start; ``recent`` the worst within the last ``WINDOW`` seconds; ``worst_busy`` the worst
part of a lag this thread spent on the CPU (its ``thread_time``): near the lag when the loop's own
work held it, near zero when the process was not run at all (the host starved it: every node of
a host late at the same moment). Shown by heartbeats,
``irdmafs status`` and the metrics (``irdmafs_node_loop_lag_worst_seconds``).

To find what held it: ``IRDMAFS_SLOW_STEPS=0.1`` in a node's environment logs every task step
that ran that long, with the task's name and where it stopped (``SlowSteps``, a trio instrument;
off by default: it times every step).

Concurrency: one task in the process's trio loop; readers on the same thread.
"""

from __future__ import annotations

import logging
import os
import time

import trio

log = logging.getLogger(__name__)

INTERVAL = 0.02
WINDOW = 10.0
WARN = 0.2  # a lag this long is logged: the node's log then says what ran around it


class LoopLag:
    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_busy = 0.0
        self._recent: list[tuple[float, float]] = []  # (when, lag) of lags over 1 ms, last WINDOW s

    @property
    def recent(self) -> float:
        """Any thread may ask (the metrics are collected in one of their own)."""
        now = time.monotonic()
        return max((lag for when, lag in list(self._recent) if now - when <= WINDOW), default=0.0)

    def observe(self, lag: float, now: float, busy: float | None = None) -> None:
        """``lag`` seconds late at ``now`` (``time.monotonic()``), ``busy`` of them on the CPU."""
        busy = lag if busy is None else min(lag, busy)
        if lag >= WARN:
            log.warning("this process's loop ran %.3f s late, %.3f s of it running (the rest: not run by the host)", lag, busy)
        self.worst = max(self.worst, lag)
        self.worst_busy = max(self.worst_busy, busy)
        if lag > 0.001:
            self._recent = [(w, g) for w, g in self._recent if now - w <= WINDOW] + [(now, lag)]

    async def run(self) -> None:
        while True:
            asked, cpu = trio.current_time() + INTERVAL, time.thread_time()
            await trio.sleep_until(asked)
            self.observe(trio.current_time() - asked, time.monotonic(), time.thread_time() - cpu)


class SlowSteps(trio.abc.Instrument):
    """Logs each task step that held the loop ``threshold`` seconds or more, and how much of
    that this thread ran (the rest: the host did not run the process)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self._began = self._cpu = 0.0

    def before_task_step(self, task) -> None:
        self._began, self._cpu = time.perf_counter(), time.thread_time()

    def after_task_step(self, task) -> None:
        took = time.perf_counter() - self._began
        if took >= self.threshold:
            frame = task.coro.cr_frame
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "done"
            busy = time.thread_time() - self._cpu
            log.warning("task %s held the loop %.3f s, %.3f s of it running (stopped at %s)", task.name, took, busy, where)


def instruments() -> list[trio.abc.Instrument]:
    """What ``trio.run`` takes for ``IRDMAFS_SLOW_STEPS`` (none when unset)."""
    threshold = os.environ.get("IRDMAFS_SLOW_STEPS")
    return [SlowSteps(float(threshold))] if threshold else []
