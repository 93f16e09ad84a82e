"""Workers' ranks as threads of the test process: each rank's calls at once, as separate worker
processes would make them (the mount sees one connection or stream per rank)."""

from __future__ import annotations

import threading
from typing import Callable


def each_rank(work: Callable[[int], None], ranks=(0, 1), timeout: float = 60) -> None:
    """``work(rank)`` for every rank in its own thread, all at once; every one's exception is
    reported (an AssertionError listing them), and a rank still running after ``timeout``
    seconds fails too."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            work(r)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in zip(ranks, threads) if t.is_alive()]
    assert not errors and not stuck, (errors, f"ranks still running: {stuck}")
