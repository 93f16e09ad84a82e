#!/usr/bin/env python3
"""The pyfuse3 ceiling for names: a minimal FUSE file system of many small files, every name and
attribute answered from dicts in memory, with the kernel told to cache both for a minute.

    python scripts/namesfs.py MOUNTPOINT FILES

The tree is scripts/bench_names.py's: ``many/dNNN/fNNNNN.txt``, FILES files in directories of
1,000. ``lookup``, ``getattr``, ``opendir``/``readdir`` (readdirplus: attributes with every
entry) and nothing else; no call does more than a dict lookup and building the reply. So a
``stat`` of a name the kernel does not hold costs what one pyfuse3 request costs here at the
least, and bench_names.py times the same walks on it as on the mount: the most any pyfuse3 file
system can do for them on this machine. Unmounts on SIGINT/SIGTERM.
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

from irdmafs.launch.mount import _terminate_on_signals  # noqa: E402

PER_DIR = 1000
CACHE = 60.0  # seconds the kernel may keep a name and its attributes


class NamesFs(pyfuse3.Operations):
    def __init__(self, files: int):
        super().__init__()
        self.children: dict[int, dict[bytes, int]] = {pyfuse3.ROOT_INODE: {}}
        self.dirs = {pyfuse3.ROOT_INODE}
        ino = pyfuse3.ROOT_INODE
        many = ino = ino + 1
        self.children[pyfuse3.ROOT_INODE][b"many"] = many
        self.children[many], self.dirs = {}, self.dirs | {many}
        for i in range(files):
            if i % PER_DIR == 0:
                ino += 1
                d = ino
                self.children[many][b"d%03d" % (i // PER_DIR)] = d
                self.children[d] = {}
                self.dirs.add(d)
            ino += 1
            self.children[d][b"f%05d.txt" % i] = ino

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        is_dir = ino in self.dirs
        a.st_mode = (stat.S_IFDIR | 0o755) if is_dir else (stat.S_IFREG | 0o644)
        a.st_nlink = 2 if is_dir else 1
        a.st_size = 0 if is_dir else 6
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        a.st_blksize = 1 << 20
        a.entry_timeout = a.attr_timeout = CACHE
        return a

    async def getattr(self, ino, ctx=None):
        return self._attr(ino)

    async def lookup(self, parent, name, ctx=None):
        ino = self.children.get(parent, {}).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def opendir(self, ino, ctx):
        if ino not in self.dirs:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return ino

    async def readdir(self, fh, off, token):
        names = sorted(self.children[fh].items())
        for i in range(off, len(names)):
            name, ino = names[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i + 1):
                break


async def main(mountpoint: str, files: int) -> None:
    fs = NamesFs(files)
    pyfuse3.init(fs, mountpoint, {"fsname=namesfs", "subtype=namesfs", "default_permissions"})
    try:
        async with trio.open_nursery() as n:
            n.start_soon(_terminate_on_signals)
            await pyfuse3.main()
            n.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
