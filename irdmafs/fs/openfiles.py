"""Open files: what this mount knows of each inode it has open, in one place.

An ``OpenFile`` stands for one inode with live handles in this mount (handles.py's
``FileHandle`` refers to its own): its attributes as of the open, kept current by this mount's
own changes (a ``stat`` while it is open answers from them: close-to-open, as NFS does); the
size written through this mount and not yet flushed (``pending``); how many writes it took (a
read waits until none came while it drained the write-behinds); the write-behinds of its
handles; and, for a file unlinked while open, the hidden name it keeps until its last close.
``OpenFiles`` is the mount's table of them; vfs.py asks it and never keeps such state itself.

A snapshot's file is read only: its handles get an ``OpenFile`` of their own, not in the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from . import writeback


@dataclass(eq=False)
class OpenFile:
    ino: int
    attr: dict  # as of the open; this mount's changes keep it current
    handles: set = field(default_factory=set)  # its live FileHandles
    pending: int = 0  # size written through this mount, not yet flushed
    writes_seen: int = 0  # writes taken (a read waits them out)
    writers: set = field(default_factory=set)  # its handles' write-behinds
    unlinked: tuple[int, str] | None = None  # (parent, hidden name) after an unlink while open
    marked: bool = False  # this mount is one of the file's writers in the namespace (W1), until its last writable handle goes
    mark_lock: trio.Lock = field(default_factory=trio.Lock)  # one op at a time marks or unmarks it
    sized: int = 0  # the largest size a writer here set it to (ftruncate, O_TRUNC) since it was marked
    wrote: int = 0  # the furthest end a write here reached since it was marked

    async def drain(self) -> None:
        """Until the writes this mount has on their way to the file have landed."""
        for w in list(self.writers):
            await w.drain()

    def forget_fetched(self) -> None:
        """Its handles drop what they read ahead: this mount changed the file."""
        for h in self.handles:
            if h.reader is not None:
                h.reader.invalidate()

    def update(self, attr: dict) -> None:
        """Attributes fetched or returned by a change: kept unless older than those held (an
        answer that arrives late must not undo a change made meanwhile, such as a conversion
        to a model file: every handle of the file reads by these). ctime moves with every
        change of the inode."""
        if attr.get("ctime_ns", 0) >= self.attr.get("ctime_ns", 0):
            self.attr = attr

    def changed(self, attr: dict) -> None:
        """New attributes from this mount's own change (a truncate, a chmod, a conversion to a
        model file or back): every handle reads by them from now on."""
        self.update(attr)
        for h in self.handles:
            h.model = None  # a model file's layout is made again at the next read
        self.forget_fetched()


class OpenFiles:
    """The mount's open files, by inode."""

    def __init__(self) -> None:
        self.files: dict[int, OpenFile] = {}
        self.write_slots = trio.Semaphore(writeback.SLOTS)  # stripes on their way, mount-wide

    def get(self, ino: int | None) -> OpenFile | None:
        return self.files.get(ino) if ino is not None else None

    def handles(self, ino: int | None) -> list:
        f = self.get(ino)
        return list(f.handles) if f else []

    def open(self, ino: int, attr: dict, snap: int = 0) -> OpenFile:
        """The file a new handle of ``ino`` refers to (the one already open, or a new one)."""
        if snap:
            return OpenFile(ino, attr)
        f = self.files.get(ino)
        if f is None:
            f = self.files[ino] = OpenFile(ino, attr)
        return f

    def close(self, handle) -> OpenFile | None:
        """``handle`` is released: the file, if that was its last handle (it leaves the table)."""
        f = handle.file
        f.handles.discard(handle)
        if handle.behind is not None:
            f.writers.discard(handle.behind)
        if f.handles or self.files.get(f.ino) is not f:
            return None
        del self.files[f.ino]
        return f

    async def drain(self, ino: int | None = None) -> None:
        """Until the writes this mount has on their way to ``ino`` (or to any file) have landed."""
        for f in [self.get(ino)] if ino is not None else list(self.files.values()):
            if f is not None:
                await f.drain()
