"""Read-ahead for files read through the mount (cluster files and safetensors views).

The kernel asks a FUSE file system for at most 1 MiB per read, a few at a time. Fetching each
from the cluster as it comes costs a round trip per MiB and keeps at most a few stripes' worth of
transfers going, far below what the Client reaches with every stripe of a file in flight. So an
open file that is read sequentially (from offset 0, or from where the last read ended) is read in
whole stripes, and the next AHEAD stripes are fetched before they are asked for, from their
different nodes at once; the kernel's reads are then answered from memory (also when they come
out of order). A read elsewhere is fetched as asked: random access pays no read-ahead, and a
header peek does not pull a whole stripe. A safetensors view
is read ahead the same way, in chunks of the view that span many small tensor files at once.

What an open file holds is what the cluster held when it was fetched: close-to-open consistency,
as the page cache gives. Writes through this mount to the file drop what was fetched. Errors of
a fetch are raised by the read that needs its bytes; a prefetch nobody needs fails silently.
"""

from __future__ import annotations

import numpy as np
import trio

# stripes fetched ahead of a sequential reader: 48 MiB at the default 4 MiB unit. Four readers
# of one snapshot on four nodes behind 500 Mbit/s links reached 0.78 of their links with 3 (a
# node's link idled whenever no reader had a stripe of it in flight), 0.90 with 8, 0.92-0.94
# with 12 (scripts/bench_read.py --link).
AHEAD = 12


class _Fetch:
    def __init__(self, start: int, length: int):
        self.start = start
        self.buf = np.empty(length, np.uint8)  # not zeroed: every byte is read into or cut off
        self.n = 0
        self.done = trio.Event()
        self.error: BaseException | None = None


class ReadAhead:
    """The chunks of one open file, fetched and on their way. ``fetch(offset, into)`` reads
    bytes of the file into the memoryview ``into`` and returns how many it read."""

    def __init__(self, fetch):
        self.fetch = fetch
        self.stripes: dict[int, _Fetch] = {}
        self.next_off: int | None = None

    def invalidate(self) -> None:
        self.stripes.clear()
        self.next_off = None

    async def read(self, off: int, size: int, fsize: int, unit: int) -> memoryview | bytes:
        """``size`` bytes at ``off`` of a file of ``fsize`` bytes read in chunks of ``unit``."""
        end = min(off + size, fsize)
        if end <= off:
            return b""
        sequential = off == (self.next_off if self.next_off is not None else 0)
        self.next_off = end
        first, last = off // unit, (end - 1) // unit
        held = all(i in self.stripes for i in range(first, last + 1))
        if not sequential and not held:  # a random read: exactly what was asked, no read-ahead
            buf = bytearray(end - off)
            n = await self.fetch(off, memoryview(buf))
            return memoryview(buf)[:n]
        horizon = last + (AHEAD if sequential else 0)
        if sequential:
            for idx in [i for i in self.stripes if not first <= i <= horizon]:
                del self.stripes[idx]  # behind the reader (or far from it): not needed again
        for idx in range(first, horizon + 1):
            if idx * unit < fsize and idx not in self.stripes:
                f = self.stripes[idx] = _Fetch(idx * unit, min(unit, fsize - idx * unit))
                trio.lowlevel.spawn_system_task(self._fetch, f)
        # what this read needs, taken now: concurrent reads may evict them meanwhile
        needed = [self.stripes[idx] for idx in range(first, last + 1)]
        parts = []
        for f in needed:
            await f.done.wait()
            if f.error is not None:
                if self.stripes.get(f.start // unit) is f:
                    del self.stripes[f.start // unit]  # the next read tries again
                raise f.error
            a, b = max(off, f.start) - f.start, min(end, f.start + f.n) - f.start
            parts.append(memoryview(f.buf)[a:b])  # handed to the kernel without a copy
            if f.n < len(f.buf):
                break  # short: the file ends here
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _fetch(self, f: _Fetch) -> None:
        try:
            f.n = await self.fetch(f.start, memoryview(f.buf))
        except trio.Cancelled:
            f.error = OSError("read cancelled: the mount is shutting down")
            raise
        except Exception as exc:  # noqa: BLE001 -- raised by the read that needs these bytes
            f.error = exc
        finally:
            f.done.set()
