"""``/.snapshots``: ``mkdir NAME`` takes a snapshot of the whole namespace and its data, ``rmdir
NAME`` drops it; ``.snapshots/NAME/...`` is the tree as it was, read-only. A model file's
tensors are there as in the live tree (``X/`` by name, models.py).

As ZFS's ``.zfs/snapshot``: each file and directory shows its own mode, owner and times (a
backup or a restore through a snapshot with ``rsync -a``, ``cp -a`` or ``tar`` keeps them; with
the write bits stripped, as before, every copy came out read-only), and every change inside gets
EROFS from the mount: an open for writing or with O_TRUNC here (the kernel's permission check,
``default_permissions``, lets it through once the write bits show), setattr here, and create,
mkdir, mknod, symlink, link, unlink, rmdir, rename and setxattr/removexattr in live.py, which
refuses every change under a snapshot's inode."""

from __future__ import annotations

import errno
import logging
import os
import stat as S
from typing import TYPE_CHECKING, Awaitable, Callable

from ..names import ROOT
from ..errors import FsError
from .inodes import SNAP, SNAPSHOTS_DIR, Family, dir_stat, snap_ino, split_snap, stat_of, writes

if TYPE_CHECKING:
    from ..client.client import Client
    from .models import ModelFiles

log = logging.getLogger(__name__)

# A snapshot never changes and its ids are never reused: the kernel keeps what it learnt of the
# names and attributes inside one (a dropped one's names are gone with its root's, which is
# looked up again every time, as a name may be taken anew by another snapshot)
SNAPSHOT_CACHE_SECONDS = 3600.0


def _frozen(attr: dict, ino: int) -> dict:
    return stat_of(attr, None, ino) | {"entry_timeout": SNAPSHOT_CACHE_SECONDS, "attr_timeout": SNAPSHOT_CACHE_SECONDS}


def _root(st: dict) -> dict:
    """A snapshot's root as named in ``.snapshots``: the name is asked again every time."""
    return st | {"entry_timeout": 0.0}


class Snapshots(Family):
    def __init__(self, client: "Client", models: "ModelFiles", file_handle: Callable, drain: Callable[[], Awaitable[None]]) -> None:
        self.client = client
        self.models = models  # the names the mount keeps, and X/ of a model file
        self.file_handle = file_handle  # (ino, attr, snap) -> a read-only FileHandle
        self.drain = drain  # until this mount's writes in flight have landed

    def owns(self, ino: int) -> bool:
        return ino == SNAPSHOTS_DIR or bool(ino & SNAP)

    async def ids(self) -> dict[str, int]:
        return {name: s["id"] for name, s in (await self.client.snapshots()).items()}

    async def getattr(self, ino: int) -> dict:
        if ino == SNAPSHOTS_DIR:
            return dir_stat(ino, 0o755)
        sid, i = split_snap(ino)
        return _frozen(await self.client.getattr(i, sid), ino)

    async def lookup(self, parent: int, name: str) -> dict:
        if parent == SNAPSHOTS_DIR:
            sid = (await self.ids()).get(name)
            if sid is None:
                raise FsError(errno.ENOENT)
            return _root(await self.getattr(snap_ino(sid, ROOT)))
        sid, p = split_snap(parent)
        attr = await self.models.entry(p, name, sid)
        return _frozen(attr, snap_ino(sid, attr["ino"]))

    async def readdir(self, ino: int) -> list[tuple[str, dict]]:
        if ino == SNAPSHOTS_DIR:
            return [(name, _root(await self.getattr(snap_ino(sid, ROOT)))) for name, sid in sorted((await self.ids()).items())]
        sid, i = split_snap(ino)
        return [(n, _frozen(a, snap_ino(sid, a["ino"]))) for n, a in await self.models.listed(i, sid)]

    async def open(self, ino: int, flags: int, uid: int):
        if ino == SNAPSHOTS_DIR:
            raise FsError(errno.EISDIR)
        if writes(flags) or flags & os.O_TRUNC:  # (O_RDONLY | O_TRUNC truncates on Linux)
            raise FsError(errno.EROFS)
        sid, i = split_snap(ino)
        attr = await self.client.getattr(i, sid)
        if S.S_ISDIR(attr["mode"]):
            raise FsError(errno.EISDIR)
        if attr.get("writers"):  # caught mid-write: no writer can finish a snapshot's copy (W3)
            log.warning("snapshot %d: file %d was being written by %s when it was taken: EIO", sid, i, ", ".join(attr["writers"]))
            raise FsError(errno.EIO)
        return self.file_handle(i, attr, sid)

    async def setattr(self, ino: int, changes: dict) -> dict:
        raise FsError(errno.EROFS)

    async def take(self, name: str) -> dict:
        """``mkdir .snapshots/NAME``: what this mount wrote before it is in the snapshot."""
        await self.drain()
        snap = await self.client.take_snapshot(name)
        log.info("snapshot %r taken (id %d)", name, snap["id"])
        return await self.getattr(snap_ino(snap["id"], ROOT))

    async def drop(self, name: str) -> None:
        await self.client.drop_snapshot(name)
