"""The mount's open handles by number (the ``fh`` of each FUSE request on an open file).

Owns the table of handles and the numbers it gives out: a handle opened by a family (vfs.py) is
numbered here (``add``), and the requests made on a number are served here: ``read``,
``write``, ``flush``, ``fsync`` and ``release`` (a number no handle has: EBADF; released twice:
nothing). A flush or release of a handle that wrote tells the lookups that what they fetched may
be old (lookups.py); at the last release of a file unlinked while open the live tree removes it
(``closed``: fs/changes.py). What each handle does is its own (handles.py, streams.py, views.py).
"""

from __future__ import annotations

import errno
import itertools
import logging
from typing import Awaitable, Callable

from ..errors import FsError
from .handles import FileHandle, Handle
from .lookups import Lookups
from .streams import PullStreamHandle, PushStreamHandle

log = logging.getLogger(__name__)


class HandleTable:
    def __init__(self, lookups: Lookups, closed: Callable[[FileHandle], Awaitable[None]]) -> None:
        self._handles: dict[int, Handle] = {}
        self._fh = itertools.count(1)
        self.lookups = lookups  # told when a handle that wrote is flushed or released
        self.closed = closed  # a cluster file's handle released (the live tree's NameChanges.closed)

    def add(self, handle: Handle) -> int:
        """Number an opened handle; returns its number."""
        fh = next(self._fh)
        self._handles[fh] = handle
        return fh

    def get(self, fh: int) -> Handle | None:
        return self._handles.get(fh)

    def handle(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def of(self, ino: int, kind: type) -> list:
        """This mount's open handles of ``ino`` of a kind made whole at open (views, status
        files); a cluster file's are its ``OpenFile``'s."""
        return [h for h in self._handles.values() if isinstance(h, kind) and h.ino == ino]

    async def read(self, fh: int, off: int, size: int) -> memoryview:
        return await self.handle(fh).read(off, size)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        return await self.handle(fh).write(off, data)

    async def flush(self, fh: int) -> None:
        h = self.handle(fh)
        try:
            await h.flush()
            if isinstance(h, FileHandle):
                await h.finish(final=False)  # a close: done writing it if nothing more is to come (W2)
        finally:
            self._wrote(h)

    async def fsync(self, fh: int) -> None:
        h = self.handle(fh)
        try:
            await h.fsync()
        finally:
            self._wrote(h)

    def _wrote(self, h: Handle) -> None:
        """After a flush: a handle that wrote may have changed its file (size, a tensor or a
        model now), so what lookups fetched before may be old (lookups.py)."""
        if getattr(h, "writes", 0) or getattr(h, "dirty", False):
            self.lookups.changed()

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        try:
            await h.flush()
            if isinstance(h, FileHandle):
                await h.finish(final=True)  # this mount's last writable handle of it: done writing it (W2)
        except FsError as exc:
            # close() already reported this through FLUSH; nobody sees RELEASE's answer
            log.info("inode %d released with its last flush refused: %s", h.ino, exc)
        finally:
            if isinstance(h, (PushStreamHandle, PullStreamHandle)):
                h.close()  # its buffer serves the next step
            if isinstance(h, FileHandle):
                gone = h.file is not None and h.file.unlinked
                try:
                    await self.closed(h)  # the last close of a file unlinked while open: it goes
                finally:
                    if gone or h.writes:
                        self.lookups.changed()
