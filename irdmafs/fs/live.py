"""The live tree: the namespace's files and directories as they are now, as an inode family.

LiveFiles is the whole, and owns what the kernel asks of a live inode and the opens of its
files: attributes, lookups and listings (under the name lease: what the kernel may cache, the
listings kept and the notes lookups leave for the opens that follow), opens and creates (the
handles and what the mount knows of each open file, its cached pages kept across opens). Its
parts, each with its own module:

- ``contents`` (contents.py): what a file holds (plain bytes, a tensor, a model file, a packed
  tensor), detected at a flush, and resizes;
- ``changes`` (changes.py): names made, removed and renamed, what may be changed where, and a
  file unlinked while open (usable until its last close, as NFS does);
- ``xattrs`` (xattrs.py): user xattrs, those listed and those read by name only.

``X/`` (no real ``X``) is a model file's tensor directory, and ``X.safetensors`` (no real file)
the view of a directory ``X`` of tensors (views.py); neither is listed, nor are the names the
mount keeps for itself (inodes.RESERVED). Also the xattrs and links of a snapshot's inodes
(read-only: EROFS to changes).
"""

from __future__ import annotations

import errno
import logging
import os
import stat as S
from typing import TYPE_CHECKING, Any

from ..errors import FsError, RemoteError
from . import models
from .changes import NameChanges
from .contents import FileContents
from .handles import FileHandle
from .inodes import HIDDEN_PREFIX, SUFFIX, Family, is_cluster, stat_of, write_only, writes
from .namelease import NameCaches
from .openfiles import OpenFiles
from .pagecache import PageCache
from .views import Views
from .xattrs import LiveXattrs

if TYPE_CHECKING:
    from ..client.client import Client
    from .streams import Layouts

log = logging.getLogger(__name__)


class LiveFiles(Family):
    def __init__(self, client: "Client", files: OpenFiles, models_: models.ModelFiles, layouts: "Layouts", views: "Views", caches: NameCaches) -> None:
        self.client = client
        self.lookups = caches.lookups  # what the last lookups fetched, for the opens that follow
        self.names = caches.lease  # how long the kernel may cache names and attributes (namelease.py)
        self.listings = caches.listings  # whole directories kept while the lease holds (listings.py)
        self.pages = PageCache(client)  # which files' cached pages an open keeps
        self.files = files  # what the mount knows of each file it has open
        self.models = models_  # model files: conversions, tensor directories, kept names
        self.views = views  # X.safetensors beside a directory X of tensors
        self.contents = FileContents(client, files, models_, layouts)  # what a file holds; resizes
        self.changes = NameChanges(client, files, models_, layouts, self.stat)  # names made, removed, renamed
        self.xattrs = LiveXattrs(client, self.contents.alone)  # user.* attributes

    def owns(self, ino: int) -> bool:
        return is_cluster(ino)

    def stat(self, attr: dict) -> dict:
        return stat_of(attr, self.files.get(attr["ino"]))

    async def getattr(self, ino: int) -> dict:
        # The kernel asks before a read once its copy is older than FILE_ATTR_SECONDS (libfuse
        # turns auto_inval_data on); while this mount has the file open, what the open fetched
        # answers (close-to-open, as NFS does)
        f = self.files.get(ino)
        if f:
            return self.stat(f.attr)
        leased = self.names.begin()
        attr = (self.names.holds() and self.listings.attr(ino)) or await self.client.getattr(ino)
        return self.names.attrs(self.stat(attr), leased) if self._cacheable(ino, "", attr) else self.stat(attr)

    async def lookup(self, parent: int, name: str) -> dict:
        try:
            begun, leased = self.lookups.begin(), self.names.begin()
            attr = self.names.holds() and self.listings.entry(parent, name)
            if not attr:
                attr = await self.models.entry(parent, name)
                if S.S_ISREG(attr["mode"]):  # (a listed one's open asks: listings serve stat only)
                    self.lookups.note(("attr", attr["ino"]), attr, begun)
                if self.names.holds() and self._cacheable(parent, name, attr) and self.listings.asked(parent):
                    await self._list(parent)
            st = self.stat(attr)
            return self.names.entry(st, parent, name, leased) if self._cacheable(parent, name, attr) else st
        except RemoteError as exc:
            if exc.code != "ENOENT" or not name.endswith(SUFFIX) or len(name) == len(SUFFIX):
                raise
        return await self.views.beside(parent, name)

    async def readdir(self, ino: int) -> list[tuple[str, dict]]:
        leased, listing = self.names.begin(), self.listings.begin()
        listed = await self.models.listed(ino)
        if self.names.holds() and ino not in self.models.tensor_dirs:
            self.listings.keep(ino, listed, listing)
        return [(name, self.stat(attr) | ({"offer": (ino, name, leased)} if self._cacheable(ino, name, attr) else {})) for name, attr in listed]

    async def _list(self, parent: int) -> None:
        """List ``parent`` whole (its next lookups answer from the listing: listings.py)."""
        begun = self.listings.begin()
        self.listings.keep(parent, await self.models.listed(parent), begun)

    def _cacheable(self, parent: int, name: str, attr: dict) -> bool:
        """Whether the kernel may cache this entry and its attributes under the lease: a plain
        name of the namespace (not a model file's tensor directory or its alias, nor a name the
        mount keeps) of an inode not open here (its size is this mount's own then)."""
        return not (
            "alias_of" in attr
            or name.startswith(HIDDEN_PREFIX)
            or parent in self.models.tensor_dirs
            or attr["ino"] in self.models.tensor_dirs
            or self.files.get(attr["ino"]) is not None
        )

    # -- files ---------------------------------------------------------------------------------
    async def open(self, ino: int, flags: int, uid: int) -> FileHandle:
        # close-to-open: the attributes as the primary has them now; a listing kept under the
        # lease is that (another mount's change drops it before it returns; this mount's own
        # drop every listing), for a read: a write asks (what it unpacks or truncates)
        listed = not writes(flags) and self.names.holds() and self.listings.attr(ino)
        attr = self.lookups.take(("attr", ino)) or listed or await self.client.getattr(ino)
        if S.S_ISDIR(attr["mode"]):
            raise FsError(errno.EISDIR)
        rewrite = bool(flags & os.O_TRUNC and writes(flags))
        if set(attr.get("writers", ())) - {self.client.owner}:  # another writer's unfinished file
            attr = await self.unfinished(ino, rewrite)
        marked = False
        if rewrite and (attr["size"] or attr.get("writers")):
            # libfuse asks for atomic O_TRUNC: the kernel sends no setattr, the open truncates
            attr = await self.contents.resize(ino, {"size": 0}, writing=True)
            marked = True
        elif writes(flags):  # written in place: a packed tensor's bytes are its own first
            attr = await self.contents.alone(ino, attr)
        if writes(flags):
            self.pages.forget(ino)
            alone = self.files.get(ino) is None  # no other open of it here (handles.py, write_only)
            h = self.file_handle(ino, attr, 0, write_only=alone and write_only(flags, attr["mode"]))
            h.writable = True
            h.file.marked = h.file.marked or marked  # (a truncate's op marked it: no writing op at its first write)
            return h
        return self.file_handle(ino, attr, 0, pages_current=await self.pages.keep(ino, attr))

    async def unfinished(self, ino: int, rewrite: bool) -> dict:
        """A file another writer marked unfinished (W1): its attributes as the node judges them
        now; EIO if a writer of it is gone (W3: it died before it was done, and the file may
        hold zeros where its data should be), unless this open rewrites it (O_TRUNC)."""
        attr = await self.client.getattr(ino)
        if attr.get("writer_gone") and not rewrite:
            who = ", ".join(attr.get("writers", ()))
            log.warning("file %d: its writer %s is gone before it finished it: EIO (rewrite it with O_TRUNC, or remove it)", ino, who)
            raise FsError(errno.EIO)
        return attr

    async def create(self, parent: int, name: str, mode: int, flags: int, uid: int, gid: int) -> tuple[FileHandle, dict]:
        self.changes.check_create(parent, name)
        attr = await self.client.create(parent, name, mode, uid, gid, writing=True)  # unfinished until its last flush (W1)
        h = self.file_handle(attr["ino"], attr, 0, name, write_only=write_only(flags, attr["mode"]))
        h.writable, h.file.marked = True, True
        return h, self.stat(attr)

    def file_handle(self, ino: int, attr: dict, snap: int, name: str = "", pages_current: bool = False, write_only: bool = False) -> FileHandle:
        """A handle of a cluster file, referring to what the mount knows of it (openfiles.py);
        the attributes fetched by this open are the file's from now on (close-to-open).
        ``pages_current``: the kernel's cached pages of it are its bytes now (pagecache.py);
        ``write_only``: opened for writing only (its writes go around the page cache)."""
        f = self.files.open(ino, attr, snap)
        f.update(attr)
        slots = self.files.write_slots
        h = FileHandle(ino, file=f, client=self.client, models=self.models, slots=slots, snap=snap, size=attr["size"], name=name)
        h.pages_current, h.write_only = pages_current, write_only
        h.on_flushed, h.on_changed = self.contents.detect, self.contents.changed
        if not snap:
            f.handles.add(h)
        return h

    async def setattr(self, ino: int, changes: dict[str, Any]) -> dict:
        # a size set while this mount has the file open for writing (an ftruncate: safetensors
        # sizes its file so before it writes) is a writer's: unfinished until its last flush (W1)
        writing = "size" in changes and any(h.writable for h in self.files.handles(ino))
        return self.stat(await self.contents.resize(ino, changes, writing=writing))

