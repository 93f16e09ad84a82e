#!/usr/bin/env python3
"""The pyfuse3 ceiling: a minimal FUSE file system serving one file from a buffer in memory.

    python scripts/memfs.py MOUNTPOINT SIZE_BYTES [--cached]

One file, ``data``, of SIZE_BYTES, read and written straight from and into a bytearray, opened
with ``direct_io`` (no page cache: each read and write is one request of up to 1 MiB, libfuse's
largest, answered from or copied into the buffer), or with ``--cached`` through the page cache
(reads then reach it as the kernel's read-ahead, widened as the mount widens it; pages dropped
at each open). Neither mode is the faster for every request here, so scripts/bench.py measures
both and takes the faster of the two for each figure as the most a pyfuse3 file system can
achieve on this machine for the same requests. Unmounts on SIGINT/SIGTERM.

Per request it does no more than pyfuse3 forces plus the one copy a file system that keeps the
bytes must make. A read answers with a memoryview of the buffer (no copy here; pyfuse3 copies it
into /dev/fuse). A write gets the request as a ``bytes`` (pyfuse3's own copy out of libfuse's
buffer, unavoidable) and copies it once into the buffer through a memoryview: assigning a
``bytes`` to a bytearray slice, as this file did before, first copies it into a temporary
bytearray (CPython's bytearray_ass_subscript), and slicing the request copied it again when it
ran past the end of the file.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

import pyfuse3
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from irdmafs.launch.mount import _terminate_on_signals, _widen_readahead  # noqa: E402

DATA_INO = pyfuse3.ROOT_INODE + 1


class MemFs(pyfuse3.Operations):
    def __init__(self, size: int, cached: bool = False):
        super().__init__()
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.cached = cached

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = (stat.S_IFDIR | 0o755) if ino == pyfuse3.ROOT_INODE else (stat.S_IFREG | 0o644)
        a.st_nlink = 2 if ino == pyfuse3.ROOT_INODE else 1
        a.st_size = 0 if ino == pyfuse3.ROOT_INODE else len(self.buf)
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        a.st_blksize = 1 << 20
        return a

    async def getattr(self, ino, ctx=None):
        if ino not in (pyfuse3.ROOT_INODE, DATA_INO):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def lookup(self, parent, name, ctx=None):
        if parent != pyfuse3.ROOT_INODE or name != b"data":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(DATA_INO)

    async def setattr(self, ino, attr, fields, fh, ctx):
        return self._attr(ino)  # O_TRUNC: the size stays (the buffer is fixed)

    async def opendir(self, ino, ctx):
        return ino

    async def readdir(self, fh, off, token):
        if off == 0:
            pyfuse3.readdir_reply(token, b"data", self._attr(DATA_INO), 1)

    async def open(self, ino, flags, ctx):
        if ino != DATA_INO:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=ino, keep_cache=False, direct_io=not self.cached)

    async def read(self, fh, off, size):
        return self.view[off : off + size]  # no copy: pyfuse3 replies straight from it

    async def write(self, fh, off, buf):
        n = max(0, min(len(self.buf) - off, len(buf)))  # the file's size is fixed: the rest is dropped
        if n:
            self.view[off : off + n] = memoryview(buf)[:n]  # the one copy, no temporary
        return len(buf)


async def main(mountpoint: str, size: int, cached: bool) -> None:
    fs = MemFs(size, cached)
    pyfuse3.init(fs, mountpoint, {"fsname=memfs", "subtype=memfs", "default_permissions"})
    try:
        async with trio.open_nursery() as n:
            n.start_soon(_terminate_on_signals)
            n.start_soon(trio.to_thread.run_sync, _widen_readahead, mountpoint)
            await pyfuse3.main()
            n.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]), "--cached" in sys.argv[3:])
