"""The mount's inode numbers and the attributes it makes up: pure, shared by every family of
inodes (vfs.py says which family serves which inode).

- cluster inodes (files and directories of the namespace) keep their own numbers (root is 1);
- ``VIRT + k``: the hidden entries ``/.irdma`` (status files), ``/.snapshots``, ``/.workers``,
  and below ``.irdma`` the per-rank directories and batch-size files;
- ``VIEW | d``: ``<name>.safetensors`` beside directory ``d`` (the whole-model view, views.py);
- ``SNAP | id << 40 | i``: inode ``i`` as snapshot ``id`` froze it (EROFS to changes, snapshots.py);
- ``WORK | rank << 40 | i``, ``STREAM | ...``, ``DOOR | ...``: ``.workers/<rank>/...``, inode
  ``i`` as worker ``rank`` pushes and pulls it, a model's step streams, its door (workers.py).
"""

from __future__ import annotations

import errno
import os
import re
import stat as S
import time

from ..names import MODEL_SUFFIX
from ..errors import FsError

VIRT = 1 << 56
VIEW = 1 << 57
SNAP = 1 << 58
WORK = 1 << 59  # WORK | rank << 40 | i: inode i as seen by worker ``rank`` (push and pull)
STREAM = 1 << 60  # STREAM | rank << 40 | d: .workers/<rank>/.../<d's name>.safetensors (streams.py)
DOOR = 1 << 61  # DOOR | rank << 40 | d: .workers/<rank>/.../<d's name>.door, a ticket to the door (worker/door.py)
INO_BITS = 40
INO_MASK = (1 << INO_BITS) - 1

IRDMA_DIR, SNAPSHOTS_DIR, WORKERS_DIR, CLUSTER_FILE, STATS_FILE, RANKS_DIR = (VIRT + k for k in range(1, 7))
RANK_DIR = VIRT + (1 << 20)  # RANK_DIR + r: .irdma/workers/<r>
BATCH_FILE = VIRT + (2 << 20)  # BATCH_FILE + r: .irdma/workers/<r>/batch_size
MAX_RANK = 1 << 16
HIDDEN = {".irdma": IRDMA_DIR, ".snapshots": SNAPSHOTS_DIR, ".workers": WORKERS_DIR}
IRDMA_FILES = {"cluster": CLUSTER_FILE, "stats": STATS_FILE}
REMOVED_XATTR = "user.irdma.removed"
# How long the kernel may cache .workers entries and attributes: they mirror tensors, whose
# size and place do not change while training, and caching them is what lets a training step
# through the mount run without a single metadata call.
WORK_CACHE_SECONDS = 60.0
# Directory attributes (mode, owner: what the kernel checks on every path walk) may be cached
# this long. Names (and longer attribute timeouts) are cached only under the mount's name lease,
# which another mount's change revokes before it returns (namelease.py, docs/caching.md); else
# every path walk looks each name up, so an open or a stat by name sees sizes and renames by
# other mounts at once (close-to-open) either way.
DIR_ATTR_SECONDS = 10.0
# A regular file's attributes may be cached this long between lookups. The kernel asks for them
# before every read(2) of a file (libfuse turns auto_inval_data on): uncached, that was a round
# trip through the mount per 1 MiB read, which halved a cold sequential read. What the cache can
# hold back is only what fstat(2) of a file open here sees, and that came from the open anyway
# (live.py, getattr); this mount's own writes, truncates and chmods refresh it in the kernel.
FILE_ATTR_SECONDS = 1.0
HIDDEN_PREFIX = ".irdmafs-"
UNLINKED = HIDDEN_PREFIX + "unlinked-"  # + inode: the hidden name of a file unlinked while open
TENSOR_DIR = HIDDEN_PREFIX + "model-"  # + inode: a model file's tensor directory (models.py)
RESERVED = re.compile(rf"{re.escape(HIDDEN_PREFIX)}(unlinked|model|bucket)-[0-9]+")  # the mount's own names
SUFFIX = MODEL_SUFFIX
DOOR_SUFFIX = ".door"
# made up from the inode: read by name, never listed, never set (xattrs.py, listed_xattrs)
DERIVED_XATTRS = ("user.irdma.dtype", "user.irdma.shape", "user.irdma.version")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


def _pack(family: int, hi: int, ino: int) -> int:
    return family | (hi << INO_BITS) | ino


def _unpack(family: int, ino: int) -> tuple[int, int]:
    return (ino & ~family) >> INO_BITS, ino & INO_MASK


def snap_ino(sid: int, ino: int) -> int:
    return _pack(SNAP, sid, ino)


def split_snap(ino: int) -> tuple[int, int]:
    return _unpack(SNAP, ino)


def work_ino(rank: int, ino: int) -> int:
    return _pack(WORK, rank, ino)


def split_work(ino: int) -> tuple[int, int]:
    return _unpack(WORK, ino)


def stream_ino(rank: int, model: int) -> int:
    return _pack(STREAM, rank, model)


def split_stream(ino: int) -> tuple[int, int]:
    return _unpack(STREAM, ino)


def door_ino(rank: int, model: int) -> int:
    return _pack(DOOR, rank, model)


def split_door(ino: int) -> tuple[int, int]:
    return _unpack(DOOR, ino)


def rank_of(name: str) -> int:
    if not name.isdigit() or int(name) >= MAX_RANK:
        raise FsError(errno.ENOENT, f"{name!r} is not a worker rank")
    return int(name)


def is_cluster(ino: int) -> bool:
    return ino < VIRT


def namespace_ino(ino: int, otherwise: int) -> tuple[int, int]:
    """(inode, snapshot id) in the namespace of a live or snapshot inode; FsError(otherwise)
    for the mount's own entries."""
    if ino & SNAP:
        sid, i = split_snap(ino)
        return i, sid
    if not is_cluster(ino):
        raise FsError(otherwise)
    return ino, 0


def dir_stat(ino: int, mode: int = 0o555, nlink: int = 2) -> dict:
    now = time.time_ns()
    times = {"st_atime_ns": now, "st_mtime_ns": now, "st_ctime_ns": now}
    return {"st_ino": ino, "st_mode": S.S_IFDIR | mode, "st_nlink": nlink, "st_uid": 0, "st_gid": 0, "st_size": 0} | times


def file_stat(ino: int, size: int, mode: int = 0o444, mtime_ns: int | None = None, uid: int = 0, gid: int = 0) -> dict:
    t = mtime_ns or time.time_ns()
    times = {"st_atime_ns": t, "st_mtime_ns": t, "st_ctime_ns": t}
    return {"st_ino": ino, "st_mode": S.S_IFREG | mode, "st_nlink": 1, "st_uid": uid, "st_gid": gid, "st_size": size} | times


def writes(flags: int) -> bool:
    return bool(flags & WRITE_FLAGS)


def write_only(flags: int, mode: int) -> bool:
    """An open whose writes may go around the page cache (handles.py, ``FileHandle.direct``):
    for writing only, of a file without set-user-ID or set-group-ID bits. A write that goes
    around it leaves clearing those bits to the file system (FUSE_WRITE_KILL_SUIDGID), a flag
    pyfuse3 does not pass on; through the page cache the kernel clears them itself."""
    return flags & os.O_ACCMODE == os.O_WRONLY and not mode & (S.S_ISUID | S.S_ISGID)


def stat_of(attr: dict, f=None, ino: int | None = None) -> dict:
    """The kernel's attributes of a namespace inode, a snapshot's too (its own mode: snapshots.py);
    ``f``, its ``OpenFile`` in this mount if open (its unflushed size shows, and a hidden name
    kept for an unlink does not count)."""
    mode = attr["mode"]
    size = max(attr["size"], f.pending) if f else attr["size"]
    cache = {"attr_timeout": DIR_ATTR_SECONDS} if S.S_ISDIR(mode) else {"attr_timeout": FILE_ATTR_SECONDS} if S.S_ISREG(mode) else {}
    return cache | {
        "st_ino": ino or attr["ino"],
        "st_mode": mode,
        "st_nlink": attr["nlink"] - bool(f and f.unlinked),
        "st_uid": attr["uid"],
        "st_gid": attr["gid"],
        "st_size": size,
        # the stripes that hold bytes (held.py: du and cp --sparse see holes), and what this
        # mount wrote past the flushed size; a record without them: every byte
        "st_blocks": attr["blocks"] + (max(0, size - attr["size"]) + 511) // 512 if "blocks" in attr else (size + 511) // 512,
        "st_atime_ns": attr["atime_ns"],
        "st_mtime_ns": attr["mtime_ns"],
        "st_ctime_ns": attr["ctime_ns"],
        "st_rdev": attr.get("rdev", 0),
    }


def work_stat(attr: dict, ino: int) -> dict:
    """A ``.workers`` entry: cached by the kernel as long as a tensor keeps its size and place."""
    return dict(stat_of(attr, None, ino), entry_timeout=WORK_CACHE_SECONDS, attr_timeout=WORK_CACHE_SECONDS)


class Family:
    """The operations one family of inodes serves; what it does not serve is refused here."""

    def owns(self, ino: int) -> bool:
        raise NotImplementedError

    async def getattr(self, ino: int) -> dict:
        raise FsError(errno.ENOENT)

    async def lookup(self, parent: int, name: str) -> dict:
        raise FsError(errno.ENOENT)

    async def readdir(self, ino: int) -> list[tuple[str, dict]]:
        raise FsError(errno.ENOTDIR)

    async def open(self, ino: int, flags: int, uid: int):
        raise FsError(errno.EISDIR)

    async def setattr(self, ino: int, changes: dict) -> dict:
        raise FsError(errno.EPERM)
