"""The pyfuse3 adapter: a protocol adapter only. What paths mean lives in ``vfs.py``.

It converts between pyfuse3's types (bytes names, EntryAttributes, FileInfo, SetattrFields) and
the VFS's plain values, and it is the one exception boundary of the mount: every handler raises
only ``FUSEError``, with the errno from the one table (fs/errnos.py). Anything unexpected is logged with
its context and becomes EIO; no traceback ever reaches the kernel. The only module that imports
pyfuse3.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat as S
import time

import pyfuse3
import trio

from .errnos import errno_for
from .vfs import Vfs

log = logging.getLogger(__name__)

ATTR_TIMEOUT = 0.0  # unless a stat says otherwise (inodes.py: directories and files cache theirs)
ENTRY_TIMEOUT = 0.0  # unless the name lease allows more (namelease.py): other mounts rename and unlink


def fuse_errors(fn):
    """Run a handler; anything it raises becomes a FUSEError from the table."""

    @functools.wraps(fn)
    async def wrapper(self, *args):
        self.vfs.counters[fn.__name__] = self.vfs.counters.get(fn.__name__, 0) + 1
        t0 = time.perf_counter()
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # a group of errors too: errno_for answers with the most telling
            raise pyfuse3.FUSEError(errno_for(exc, fn.__name__)) from None
        finally:
            self.vfs.latency.observe(fn.__name__, time.perf_counter() - t0)

    return wrapper


UNKNOWN_INO = 0xFFFFFFFF  # an entry's inode number not given (libfuse's FUSE_UNKNOWN_INO)


def entry(st: dict) -> pyfuse3.EntryAttributes:
    """EntryAttributes from a VFS stat; ``entry_timeout``/``attr_timeout`` keys let the kernel
    cache the name or the attributes that long (default: not at all)."""
    e = pyfuse3.EntryAttributes()
    for key, value in st.items():
        if key.startswith("st_"):
            setattr(e, key, value)
    e.st_blksize = 1 << 20
    e.st_blocks = st.get("st_blocks", (st["st_size"] + 511) // 512)
    e.generation = 0
    e.entry_timeout = st.get("entry_timeout", ENTRY_TIMEOUT)
    e.attr_timeout = st.get("attr_timeout", ATTR_TIMEOUT)
    return e


def kernel_drop(entries: list[tuple[int, str]], inodes: list[int]) -> None:
    """Drop ``entries`` (parent, name) and the attributes of ``inodes`` from the kernel's caches
    (blocking: run in a worker thread, fs/namelease.py). Names it does not hold are no error."""
    for parent, name in entries:
        try:
            pyfuse3.invalidate_entry(parent, os.fsencode(name))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                log.warning("kernel entry %d/%s not invalidated: %s", parent, name, exc)
    for ino in inodes:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("kernel inode %d not invalidated: %s", ino, exc)


def file_info(fh: int, h) -> pyfuse3.FileInfo:
    """How the kernel treats an open handle's pages. keep_cache=False: the kernel drops cached
    pages at this open (close-to-open consistency), except of files that have not changed
    (FileHandle.keep_cache); direct_io: no page cache at all, for status files (their size
    changes between the stat and the read) and write-only opens (FileHandle.direct)."""
    return pyfuse3.FileInfo(fh=fh, keep_cache=getattr(h, "keep_cache", False), direct_io=getattr(h, "direct", False))


def name_of(raw: bytes) -> str:
    return os.fsdecode(raw)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False  # no NFS export: '.' and '..' are resolved by the kernel
    enable_writeback_cache = False

    def __init__(self, vfs: Vfs):
        super().__init__()
        self.vfs = vfs
        self._dirs: dict[int, list] = {}
        self._dir_inode: dict[int, int] = {}
        self._dir_fh = 1 << 40

    @fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        return entry(await self.vfs.lookup(parent_inode, name_of(name)))

    @fuse_errors
    async def getattr(self, inode, ctx=None):
        return entry(await self.vfs.getattr(inode))

    @fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        changes = {}
        if fields.update_size:
            changes["size"] = attr.st_size
        if fields.update_mode:
            changes["mode"] = attr.st_mode
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        if "size" not in changes:
            # futimens after writes (cp -a, tar, rsync): this mount's unflushed writes to the
            # file move its mtime when flushed, so they go first. The kernel names no handle
            # for futimens (only ftruncate carries one): every open handle of the file flushes.
            for h in self.vfs.files.handles(inode):
                await h.flush()
        return entry(await self.vfs.setattr(inode, changes) if changes else await self.vfs.getattr(inode))

    @fuse_errors
    async def opendir(self, inode, ctx):
        entries = await self.vfs.readdir(inode)  # listed once per open: offsets stay stable
        # ``ls -a`` shows "." and ".."; the kernel instantiates neither from a listing (no
        # lookup counted, their attributes unused), so only their inode numbers matter: the
        # directory's own, and for ".." the root's at the root, else libfuse's "unknown"
        dot = {"st_mode": S.S_IFDIR | 0o755, "st_size": 0, "entry_timeout": 0, "attr_timeout": 0}
        entries = [(".", dict(dot, st_ino=inode)), ("..", dict(dot, st_ino=inode if inode == pyfuse3.ROOT_INODE else UNKNOWN_INO))] + list(entries)
        self._dir_fh += 1
        self._dirs[self._dir_fh] = entries
        self._dir_inode[self._dir_fh] = inode
        return self._dir_fh

    @fuse_errors
    async def readdir(self, fh, start_id, token):
        entries = self._dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            name, st = entries[i]
            if not pyfuse3.readdir_reply(token, os.fsencode(name), entry(self.vfs.names.offer(st)), i + 1):
                break

    @fuse_errors
    async def releasedir(self, fh):
        self._dirs.pop(fh, None)
        self._dir_inode.pop(fh, None)

    @fuse_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        return entry(await self.vfs.mkdir(parent_inode, name_of(name), mode & 0o7777, ctx.uid, ctx.gid))

    @fuse_errors
    async def symlink(self, parent_inode, name, target, ctx):
        return entry(await self.vfs.symlink(parent_inode, name_of(name), name_of(target), ctx.uid, ctx.gid))

    @fuse_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return entry(await self.vfs.mknod(parent_inode, name_of(name), mode, rdev, ctx.uid, ctx.gid))

    @fuse_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return entry(await self.vfs.link(inode, new_parent_inode, name_of(new_name)))

    @fuse_errors
    async def readlink(self, inode, ctx):
        return os.fsencode(await self.vfs.readlink(inode))

    @fuse_errors
    async def rmdir(self, parent_inode, name, ctx):
        await self.vfs.rmdir(parent_inode, name_of(name))

    @fuse_errors
    async def unlink(self, parent_inode, name, ctx):
        await self.vfs.unlink(parent_inode, name_of(name))

    @fuse_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.vfs.rename(parent_inode_old, name_of(name_old), parent_inode_new, name_of(name_new), flags)

    @fuse_errors
    async def open(self, inode, flags, ctx):
        fh = await self.vfs.open(inode, flags, ctx.uid)
        return file_info(fh, self.vfs.handles.get(fh))

    @fuse_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, st = await self.vfs.create(parent_inode, name_of(name), mode & 0o7777, flags, ctx.uid, ctx.gid)
        return file_info(fh, self.vfs.handles.get(fh)), entry(st)

    @fuse_errors
    async def read(self, fh, off, size):
        return await self.vfs.read(fh, off, size)

    @fuse_errors
    async def write(self, fh, off, buf):
        return await self.vfs.write(fh, off, buf)

    @fuse_errors
    async def flush(self, fh):
        try:
            await self.vfs.flush(fh)
        except Exception:
            await self._forget_size(fh)
            raise

    @fuse_errors
    async def fsync(self, fh, datasync):
        try:
            await self.vfs.handles.fsync(fh)
        except Exception:
            await self._forget_size(fh)
            raise

    async def _forget_size(self, fh) -> None:
        """A flush that failed gave back what its writes took past the file's end (handles.py):
        the kernel, which grew the file's size with each write, is told to ask again."""
        ino = getattr(self.vfs.handles.get(fh), "ino", None)
        if ino is not None:
            await trio.to_thread.run_sync(kernel_drop, [], [ino])

    @fuse_errors
    async def fsyncdir(self, fh, datasync):
        await self.vfs.fsyncdir(self._dir_inode.get(fh, 0))

    @fuse_errors
    async def release(self, fh):
        await self.vfs.release(fh)

    @fuse_errors
    async def statfs(self, ctx):
        st = await self.vfs.status_files.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 1 << 20
        s.f_blocks = st["capacity"] // s.f_frsize
        s.f_bfree = s.f_bavail = max(0, st["capacity"] - st["used"]) // s.f_frsize
        s.f_files = 1 << 32
        s.f_ffree = s.f_favail = 1 << 31
        s.f_namemax = 255
        return s

    @fuse_errors
    async def getxattr(self, inode, name, ctx):
        return await self.vfs.getxattr(inode, name_of(name))

    @fuse_errors
    async def listxattr(self, inode, ctx):
        return [os.fsencode(n) for n in await self.vfs.listxattr(inode)]

    @fuse_errors
    async def setxattr(self, inode, name, value, ctx):
        await self.vfs.setxattr(inode, name_of(name), value)

    @fuse_errors
    async def removexattr(self, inode, name, ctx):
        await self.vfs.setxattr(inode, name_of(name), None)

    @fuse_errors
    async def forget(self, inode_list):
        pass  # inodes are cluster-wide numbers; nothing to drop per lookup
