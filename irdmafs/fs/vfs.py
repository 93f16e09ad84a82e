"""What each path of the mount means: which family of inodes serves it. No pyfuse3 here.

Families (each a small class with the operations it serves; inodes.py numbers their inodes):

| family | inodes | module |
| --- | --- | --- |
| the live tree | the namespace's files and directories | live.py (contents.py, changes.py, xattrs.py; model files: models.py) |
| snapshots | ``/.snapshots``, ``SNAP | id << 40 | i`` | snapshots.py |
| workers | ``/.workers``, ``WORK``/``STREAM``/``DOOR | rank << 40 | i`` | workers.py (streams.py, worker/door.py) |
| views | ``VIEW | d``: ``<d>.safetensors`` beside a directory of tensors | views.py |
| status | ``/.irdma``: status files, ranks, batch sizes | status.py |

Vfs owns the table of families and what each request means by inode: it dispatches names,
attributes, namespace changes and xattrs, and opens files by their family. The open handles by
number, and the requests on a number (read, write, flush, fsync, release), are the handle
table's (``vfs.handles``: handletable.py); statfs is the status files' (status.py). What the
mount knows of each file it has open is in openfiles.py; the open files' behaviour in
handles.py. Hidden entries and views are reachable by name and never listed, so ``cp -r`` /
``rsync -a`` of the mount or of a model copies each byte once.

Errors are ``FsError(errno)``; ``ops.py`` turns them into ``FUSEError``. Namespace errors from the
cluster arrive as ``RemoteError`` and are mapped by errno name there too (fs/errnos.py).

Concurrency: methods run as concurrent trio tasks (pyfuse3 starts one per request). Per-handle
state is only touched by requests on that handle; the shared tables (handles, open files) are
updated without awaiting in between.
"""

from __future__ import annotations

import errno
import functools
import os

from ..client import nodes
from ..client.client import Client
from ..metrics import Latency, as_dict
from ..names import ROOT
from . import models
from ..errors import FsError
from .handletable import HandleTable
from .inodes import HIDDEN, RANKS_DIR, SNAPSHOTS_DIR, WORK, Family, writes
from .live import LiveFiles
from .listings import Listings
from .lookups import Lookups
from .namelease import NameCaches, NameLease
from .openfiles import OpenFiles
from .snapshots import Snapshots
from .status import StatusFiles, mount_samples
from .streams import Layouts, Streams
from .views import Views
from .workers import WorkerFiles


def changing(fn):
    """A VFS operation that changes the namespace: what lookups fetched before it completed may
    be old (lookups.py), whether it succeeded or not."""

    @functools.wraps(fn)
    async def wrapper(self, *args):
        try:
            return await fn(self, *args)
        finally:
            self.lookups.changed()

    return wrapper


class Vfs:
    def __init__(self, client: Client, *, status: dict | None = None):
        self.client = client
        self.status = status or {}
        self.counters: dict[str, int] = {}
        self.latency = Latency()  # per FUSE operation (fs/ops.py observes)
        self.files = OpenFiles()  # what the mount knows of each file it has open
        # safetensors files as models: a conversion skips a file a handle here writes, and open
        # handles and step layouts follow one (contents.py)
        self.models = models.ModelFiles(
            client, writing=lambda ino: any(h.dirty for h in self.files.handles(ino)), changed=lambda ino, attr: self.live.contents.changed(ino, attr)
        )
        self.streams = Streams(client, Layouts(client))  # the step streams' client and layouts
        self.layouts = self.streams.layouts
        self.door = None  # the shared-memory door (fs/door_server.py), when the mount serves one
        self.listings = Listings()  # whole directories, answered from while the lease holds
        # what lookups just fetched, for the opens that follow; a change of this mount's own
        # drops every listing too (the primary tells no mount of its own changes)
        self.lookups = Lookups(on_change=self.listings.clear)
        # the open handles by number; a cluster file's last close goes to the live tree (made below)
        self.handles = HandleTable(self.lookups, closed=lambda h: self.live.changes.closed(h))
        client.meta.on_change.append(self.lookups.changed)  # any namespace op of this mount's (a bucket's pack too)
        # how long the kernel may cache names: a lease kept by ``names.run`` (launch/mount.py starts it)
        self.names = NameLease(client.meta, forget=self._told)
        self.views = Views(client, self.handles.of, self.lookups)
        self.live = LiveFiles(client, self.files, self.models, self.layouts, self.views, NameCaches(self.lookups, self.names, self.listings))
        self.snapshots = Snapshots(client, self.models, self.live.file_handle, self.files.drain)
        self.workers = WorkerFiles(self.streams, self.models, lambda: self.door)
        figures = lambda: nodes.figures(self.client) | {  # noqa: E731
            "fuse": self.counters,
            "names": self.names.figures() | {"listing_hits": self.listings.hits},
            "metrics": as_dict(mount_samples(self)),
        }
        self.status_files = StatusFiles(client, self.status, figures, self.handles.of)
        self.families: list[Family] = [self.live, self.snapshots, self.workers, self.views, self.status_files]

    def _told(self, entries: set, inodes: set, everything: bool) -> None:
        """Another mount changed these names and inodes (the lease's invalidations)."""
        self.listings.drop(entries, inodes, everything)
        self.lookups.told()

    def family(self, ino: int) -> Family:
        """The family that serves inode ``ino``; ENOENT for a number none has."""
        for f in self.families:
            if f.owns(ino):
                return f
        raise FsError(errno.ENOENT)

    # -- attributes and names ----------------------------------------------------------------------
    async def getattr(self, ino: int) -> dict:
        return await self.family(ino).getattr(ino)

    async def lookup(self, parent: int, name: str) -> dict:
        if parent == ROOT and name in HIDDEN:
            return await self.getattr(HIDDEN[name])
        return await self.family(parent).lookup(parent, name)

    async def readdir(self, ino: int) -> list[tuple[str, dict]]:
        return await self.family(ino).readdir(ino)

    @changing
    async def setattr(self, ino: int, changes: dict) -> dict:
        return await self.family(ino).setattr(ino, changes)

    async def readlink(self, ino: int) -> str:
        return await self.live.changes.readlink(ino)

    # -- directories -------------------------------------------------------------------------------
    @changing
    async def mkdir(self, parent: int, name: str, mode: int, uid: int, gid: int) -> dict:
        self.layouts.forget()  # tensors may come or go
        if parent == SNAPSHOTS_DIR:
            return await self.snapshots.take(name)
        return await self.live.changes.mkdir(parent, name, mode, uid, gid)

    @changing
    async def symlink(self, parent: int, name: str, target: str, uid: int, gid: int) -> dict:
        return await self.live.changes.symlink(parent, name, target, uid, gid)

    @changing
    async def mknod(self, parent: int, name: str, mode: int, rdev: int, uid: int, gid: int) -> dict:
        return await self.live.changes.mknod(parent, name, mode, rdev, uid, gid)

    @changing
    async def link(self, ino: int, new_parent: int, new_name: str) -> dict:
        return await self.live.changes.link(ino, new_parent, new_name)

    @changing
    async def rmdir(self, parent: int, name: str) -> None:
        self.layouts.forget()  # tensors may come or go
        if parent == SNAPSHOTS_DIR:
            await self.snapshots.drop(name)
        elif parent == RANKS_DIR:
            await self.status_files.remove_rank(name)
        else:
            await self.live.changes.rmdir(parent, name)

    @changing
    async def unlink(self, parent: int, name: str) -> None:
        self.layouts.forget()  # tensors may come or go
        await self.live.changes.unlink(parent, name)

    @changing
    async def rename(self, parent: int, name: str, new_parent: int, new_name: str, flags: int) -> None:
        self.layouts.forget()  # tensors may come or go
        await self.live.changes.rename(parent, name, new_parent, new_name, flags)

    # -- files: opened by their family, numbered and served by the handle table (handletable.py) --
    async def open(self, ino: int, flags: int, uid: int = 0) -> int:
        try:
            return self.handles.add(await self.family(ino).open(ino, flags, uid))
        finally:
            if flags & os.O_TRUNC and writes(flags):
                self.lookups.changed()  # it truncated the file

    @changing
    async def create(self, parent: int, name: str, mode: int, flags: int, uid: int, gid: int) -> tuple[int, dict]:
        handle, st = await self.live.create(parent, name, mode, flags, uid, gid)
        return self.handles.add(handle), st

    async def read(self, fh: int, off: int, size: int) -> memoryview:
        return await self.handles.read(fh, off, size)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        return await self.handles.write(fh, off, data)

    async def flush(self, fh: int) -> None:
        await self.handles.flush(fh)

    async def release(self, fh: int) -> None:
        await self.handles.release(fh)

    async def fsyncdir(self, ino: int) -> None:
        """On a ``.workers/<rank>/...`` directory: until every push this mount made for that
        rank is applied. Elsewhere namespace changes are already replicated: nothing to wait."""
        if ino & WORK:
            await self.workers.fsyncdir(ino)

    # -- extended attributes and the rest ----------------------------------------------------------
    async def getxattr(self, ino: int, name: str) -> bytes:
        return await self.live.xattrs.getxattr(ino, name)

    async def listxattr(self, ino: int) -> list[str]:
        return await self.live.xattrs.listxattr(ino)

    @changing
    async def setxattr(self, ino: int, name: str, value: bytes | None) -> None:
        await self.live.xattrs.setxattr(ino, name, value)
