"""Write-behind for files written through the mount.

The kernel hands a FUSE file system writes of at most 1 MiB. Sending each as it comes and
answering only once it is committed and replicated leaves the network idle between writes, so
a file's writes are gathered here into runs cut at stripe boundaries, and each complete stripe
leaves in the background, several in flight at once (bounded per mount). A run holds the
writes' own buffers (``Gather``): their bytes are copied once, by the WRITE that stages them on
the primary, not first into a run as well (a third of the mount's copying per byte written). A write that overlaps
one still in flight waits for it, so the cluster sees overlapping writes in the order they were
made. An error of a background write is kept and raised by every later write, read, flush and
fsync of the file; flush and fsync wait for everything in flight, so a successful close() still
means the data is on every live replica (close-to-open consistency, as before).
"""

from __future__ import annotations

import trio

from ..transport.base import Gather

# Stripes in flight per mount: with the default 4 MiB unit, 64 MiB of written data held at most.
SLOTS = 16


class WriteBehind:
    """The writes of one open file, on their way to the cluster."""

    def __init__(self, client, ino: int, attr: dict, slots: trio.Semaphore):
        self.client = client
        self.ino = ino
        self.attr = attr
        self.unit = attr["unit"]
        self.slots = slots
        self.start = 0  # file offset of the run being gathered
        self.run = Gather()
        self.inflight: list[tuple[int, int, trio.Event]] = []
        self.error: BaseException | None = None

    def check(self) -> None:
        """Raise the error a background write met (sticky: the file lost that write)."""
        if self.error is not None:
            raise self.error

    async def write(self, off: int, data: bytes) -> None:
        self.check()
        if self.run and off == self.start + len(self.run):
            self.run.append(data)
        else:
            await self._send_run()
            self.start, self.run = off, Gather([data])
        cut = (self.start + len(self.run)) // self.unit * self.unit
        if cut > self.start:  # whole stripes are complete: send them now
            whole = self.run
            self.run = whole.split(cut - self.start)
            start, self.start = self.start, cut
            await self._send(start, whole)

    async def drain(self) -> None:
        """Send what is gathered and wait until nothing is in flight; raises a write's error."""
        await self._send_run()
        while self.inflight:
            await self.inflight[0][2].wait()
        self.check()

    async def _send_run(self) -> None:
        if self.run:
            run, self.run = self.run, Gather()
            await self._send(self.start, run)

    async def _send(self, start: int, run: Gather) -> None:
        end = start + len(run)
        entry = (start, end, trio.Event())
        earlier = [done for s, e, done in self.inflight if s < end and start < e]
        # In flight from now on, also while it waits below: a drain meanwhile must wait for it
        # (its bytes are no longer in the run, and not yet in the cluster).
        self.inflight.append(entry)
        try:
            for done in earlier:  # an overlapping write goes first
                await done.wait()
            await self.slots.acquire()
        except BaseException:
            self.inflight.remove(entry)
            entry[2].set()
            raise
        # A system task: it outlives the FUSE request that made it, which is the point.
        trio.lowlevel.spawn_system_task(self._write, start, run, entry)

    async def _write(self, start: int, run: Gather, entry: tuple) -> None:
        try:
            await self.client.write(self.ino, start, run, self.attr, extend=False)
        except trio.Cancelled:
            self.error = self.error or OSError("write cancelled: the mount is shutting down")
            raise
        except Exception as exc:  # noqa: BLE001 -- kept and raised at the file's next call
            self.error = self.error or exc
        finally:
            self.inflight.remove(entry)
            self.slots.release()
            entry[2].set()
