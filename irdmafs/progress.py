"""Progress of long work for a person: a bar on a terminal (tqdm), plain lines in a log otherwise.

    p = Progress("rebalance", total_bytes, unit="B")
    p.update(done)      # as often as you like: the terminal is redrawn at most 10 times a second,
    p.close()           # a log line is written at most every 2 seconds
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def _human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:.0f}"
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:.1f} {suffix}" if suffix != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    def __init__(self, what: str, total: float, *, unit: str = "", stream: TextIO | None = None, width: int = 30):
        self.what = what
        self.total = total
        self.unit = unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.width = width
        self.done = 0.0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._bar: tqdm | None = None
        if self.tty:  # a total of 0 is not known yet (a rebalance learns it from the nodes)
            self._bar = tqdm(
                total=total or None,
                desc=what,
                unit=unit or "it",
                unit_scale=unit == "B",
                unit_divisor=1024,
                file=self.stream,
                mininterval=0.1,
                bar_format=f"{{l_bar}}{{bar:{width}}}{{r_bar}}",
            )

    def line(self) -> str:
        """The log line: what, how far of how much, and (for bytes) the rate so far."""
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        rate = self.done / max(1e-9, time.monotonic() - self.t0)
        text = f"{self.what}: {_human(self.done, self.unit)}/{_human(self.total, self.unit)} ({frac:.0%}"
        if self.unit == "B":
            text += f", {_human(rate, 'B')}/s"
        return text + ")"

    def update(self, done: float, total: float | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if self._bar is not None:
            if total is not None and (total or None) != self._bar.total:
                self._bar.total = total or None
            self._bar.update(done - self._bar.n)  # tqdm redraws at most every mininterval
            return
        now = time.monotonic()
        if now - self._last < 2.0:
            return
        self._last = now
        self._log()

    def _log(self) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()  # the bar as it ends, left on the terminal
        else:
            self._log()
