"""How busy each direction of each shaped link was, 25 ms at a time, while a benchmark's timed
steps ran (issue 42: whether a step's pulls overlap its pushes is seen, not inferred).

``LinkTrace(devs)`` reads the root-namespace ends' byte counters (netns.py ``link_bytes``) in a
thread of this process every ``PERIOD`` seconds between ``start()`` and ``stop()``. ``steps``
cuts the trace at each step's edges (the earliest start and the latest end over the ranks,
CLOCK_MONOTONIC, which every process of the host shares) and says, for the link that carried
the most in that step, what fraction of the rate each direction ran at and in what fraction of
its 25 ms bins both directions ran above half the rate at once. ``plot`` draws the trace of the
busiest links with the steps' edges.
"""

from __future__ import annotations

import threading
import time

from netns import link_bytes

PERIOD = 0.025
BOTH = 0.5  # a bin counts as both directions busy when each ran above this fraction of the rate


class LinkTrace:
    def __init__(self, devs: list[str], period: float = PERIOD) -> None:
        self.devs, self.period = devs, period
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []  # (time, dev -> (in, out))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> None:
        self.samples.append((time.monotonic(), {d: link_bytes(d) for d in self.devs}))

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            self._read()
            due += self.period
            self._stop.wait(max(0.0, due - time.monotonic()))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="link-trace", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._read()

    def bins(self, dev: str) -> list[tuple[float, float, int, int]]:
        """(begin, end, bytes into the namespace, bytes out of it) of each sampled interval."""
        s = self.samples
        return [(t0, t1, c1[dev][0] - c0[dev][0], c1[dev][1] - c0[dev][1]) for (t0, c0), (t1, c1) in zip(s, s[1:])]


def steps(trace: LinkTrace, marks: list[list[tuple[float, float]]], rate_bits: float, label) -> list[dict]:
    """Per timed step (``marks``: per rank, each step's (start, end)), the link that carried the
    most in it (``label(dev)`` names it), the fraction of the rate each of its directions ran at
    over the step, and the fraction of its bins in which both ran above ``BOTH`` of the rate."""
    out = []
    for k in range(min(len(m) for m in marks)):
        t0, t1 = min(m[k][0] for m in marks), max(m[k][1] for m in marks)
        best = None
        for dev in trace.devs:
            inside = [b for b in trace.bins(dev) if b[1] > t0 and b[0] < t1]  # the bins the step touches
            if not inside:
                continue
            nin, nout = sum(b[2] for b in inside), sum(b[3] for b in inside)
            if best is None or max(nin, nout) > best[0]:
                span = inside[-1][1] - inside[0][0]
                cap = rate_bits / 8 * span
                both = sum(1 for b in inside if min(b[2], b[3]) > BOTH * rate_bits / 8 * (b[1] - b[0]))
                best = (max(nin, nout), dev, nin / cap, nout / cap, both / len(inside))
        if best is not None:
            out.append({"step": k, "seconds": t1 - t0, "link": label(best[1]), "in": best[2], "out": best[3], "both": best[4]})
    return out


def busiest(trace: LinkTrace, kind) -> str | None:
    """The device of ``kind`` (a predicate on devices) that carried the most over the trace."""
    devs = [d for d in trace.devs if kind(d)]
    if not devs or len(trace.samples) < 2:
        return None
    first, last = trace.samples[0][1], trace.samples[-1][1]
    return max(devs, key=lambda d: max(last[d][0] - first[d][0], last[d][1] - first[d][1]))


def plot(trace: LinkTrace, devs: list[tuple[str, str]], marks: list[list[tuple[float, float]]], rate_bits: float, title: str, path: str) -> None:
    """Each of ``devs`` ((device, name)): the fraction of the rate into and out of its host per
    bin, against time from the first step's start; the steps' starts as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    zero = min(m[0][0] for m in marks)
    fig, axes = plt.subplots(len(devs), 1, figsize=(9, 2.2 * len(devs)), sharex=True, squeeze=False)
    for ax, (dev, name) in zip(axes[:, 0], devs):
        bins = trace.bins(dev)
        xs = [b[0] - zero for b in bins]
        cap = [rate_bits / 8 * (b[1] - b[0]) for b in bins]
        ax.step(xs, [b[2] / c for b, c in zip(bins, cap)], where="post", label="into the host", lw=0.9)
        ax.step(xs, [b[3] / c for b, c in zip(bins, cap)], where="post", label="out of the host", lw=0.9)
        for k in range(min(len(m) for m in marks)):
            ax.axvline(min(m[k][0] for m in marks) - zero, color="grey", lw=0.5, ls=":")
        ax.set_ylim(0, 1.1)
        ax.set_ylabel(f"{name}\nof the rate")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel(f"seconds (bins of {trace.period * 1000:.0f} ms; dotted: a step begins)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
