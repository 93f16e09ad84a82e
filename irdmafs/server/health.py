"""Whether the stripes a node leads have all R of their copies serving: the cluster is *whole*.

A stripe is whole when each of its R homes (the first R nodes of its rendezvous ranking over the
members) is active in the view and has caught up (its hand-over done: it answers reads of its
copies and takes its part of every write). A home expelled, down, or named again but still
taking its stripes back leaves the stripe *degraded*: one fault more on the copies left and a
read or a pull of it fails (EIO), as Ceph's degraded placement groups say. ``irdmafs status``,
the metrics and ``wait_settled`` (what the chaos soak waits for between faults) read it.

Each node counts only the live stripes it leads (it is their primary in its view), so the sum
over the nodes counts every stripe once. Pure: the view, the ranking and who has caught up are
handed in; nothing here touches the network.
"""

from __future__ import annotations

from typing import Callable, Iterable


def degraded(
    led: Iterable[tuple[int, int]],
    homes: Callable[[int, int], list[str]],
    serving: Callable[[str], bool],
) -> int:
    """How many of the stripes ``led`` (fid, idx) have a home that does not serve
    (``serving(name)``: active in the view and caught up)."""
    return sum(1 for fid, idx in led if not all(serving(h) for h in homes(fid, idx)))
