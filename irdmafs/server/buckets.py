"""The namespace's rules for buckets (docs/buckets.md): which tensors may be packed, the ``pack``
and ``unpack`` ops, and what every other op may do to a packed tensor or to a bucket.

A bucket is a hidden regular file of a model directory whose namespace record is a headerless
1-D tensor (``{"dtype", "shape": [n], "offset": 0, "members": [ino, ...]}``); the nodes train
it as any tensor. A packed tensor keeps its file, its header and its attributes; its record
says where its data lives: ``tensor["bucket"] = {"fid", "at", "size", "unit"}`` (the bucket's
inode, the byte where the tensor's data starts in it, the bucket's extent and stripe unit, so a
reader needs no second lookup).

A pack is two ops around the mount's copy of the data (client/buckets.py):
1. ``pack`` (``final`` false): each tensor gets a pointer with ``until`` (now + PACK_LEASE_NS):
   not in force (reads still go to the tensor's own stripes), but the nodes refuse pushes to it
   until then (server/training.py), so nothing trains the bytes being copied;
2. ``pack`` (``final`` true), once the bucket holds the copy: in force, if every tensor still
   has the version and the pointer of step 1 and its lease has not run out; every tensor's
   and the bucket's version moves (B1: every cached layout is seen stale).
An ``unpack`` clears pointers (the data copied back first by the mount, or not wanted: a whole
rewrite clears it in the truncate's own op). The op that drops a bucket's last member frees
the bucket (``freed_buckets`` in its result: every node drops its stripes).

Every function takes the namespace (``meta.Meta``) it reads and changes as ``meta``.
Pure: no I/O, no trio.
"""

from __future__ import annotations

import re
import stat as S
from typing import Any

import numpy as np

from ..names import BUCKET_NAME, LAYOUT_CHANGED, PACK_LEASE_NS
from ..packing import in_force, is_bucket, nbytes, packable, pointer
from ..errors import RemoteError

BUCKET_FILE = re.compile(re.escape(BUCKET_NAME) + "[0-9]+")  # the name a pack gives its bucket (client/buckets.py)


def _err(code: str, msg: str) -> RemoteError:
    return RemoteError(code, msg)


def _members(meta, op: dict) -> tuple[dict, list[tuple[int, int, int]]]:
    """The bucket's inode record and the op's (ino, at, version) list, shapes checked."""
    bucket = meta.inode(op["bucket"])
    rows = op["tensors"]
    if not rows or not all(isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r) for r in rows):
        raise _err("EINVAL", "pack: tensors is a list of [ino, at, version]")
    if len({r[0] for r in rows}) != len(rows):
        raise _err("EINVAL", "pack: a tensor named twice")
    return bucket, [tuple(r) for r in rows]  # type: ignore[misc]


def pack(meta, op: dict) -> dict:
    """Both steps of a pack (see above); every check before any change."""
    bucket, rows = _members(meta, op)
    b = op["bucket"]
    if not S.S_ISREG(bucket["mode"]) or not bucket["unit"] or bucket["nlink"] != 1:
        raise _err("EINVAL", f"inode {b} cannot be a bucket")
    nodes = [meta.inode(ino) for ino, _, _ in rows]
    dtypes = {np.dtype(n["tensor"]["dtype"]) if isinstance(n.get("tensor"), dict) else None for n in nodes}
    if len(dtypes) != 1 or None in dtypes:
        raise _err("EINVAL", "pack: tensors of one dtype only")
    dtype = dtypes.pop()
    count = op["count"]
    if type(count) is not int or count < 1:
        raise _err("EINVAL", f"pack: bad count {count!r}")
    end = 0
    for (ino, at, version), node in sorted(zip(rows, nodes), key=lambda x: x[0][1]):
        if node.get("parent") != bucket.get("parent"):
            raise _err("EXDEV", f"pack: tensor {ino} is not in the bucket's directory")
        if node["version"] != version:
            raise _err("EBUSY", f"pack: tensor {ino} changed since it was read")
        if at < end or at % dtype.itemsize:
            raise _err("EINVAL", f"pack: tensor {ino} at {at} overlaps or is misaligned")
        end = at + nbytes(node["tensor"])
        if op["final"]:
            p = pointer(node)
            if p is None or p.get("fid") != b or p.get("at") != at or p.get("until", 0) < op["now"]:
                raise _err("EBUSY", f"pack: tensor {ino} is no longer being packed into {b}")
        else:
            p = pointer(node)
            if not packable(node) or (p is not None and p.get("until", 0) >= op["now"]):
                raise _err("EBUSY", f"pack: tensor {ino} cannot be packed now")
    if end > count * dtype.itemsize:
        raise _err("EINVAL", f"pack: tensors end at byte {end}, past the bucket's {count} elements")
    if op["final"]:
        t = bucket.get("tensor")
        if not is_bucket(bucket) or t["members"] or bucket["size"] < count * dtype.itemsize:
            raise _err("EBUSY", f"pack: bucket {b} is not the one under way, or not written")
    elif bucket.get("tensor") is not None or bucket["size"]:
        raise _err("EINVAL", f"pack: inode {b} is not a new bucket")
    # checked: change
    bucket["tensor"] = {"dtype": dtype.str, "shape": [count], "offset": 0, "fortran": False, "members": []}
    for (ino, at, _), node in zip(rows, nodes):
        if op["final"]:
            ptr: dict[str, Any] = {"fid": b, "at": at, "size": count * dtype.itemsize, "unit": bucket["unit"]}
            node["version"] += 1
        else:
            ptr = {"fid": b, "at": at, "until": op["now"] + PACK_LEASE_NS}
        node["tensor"] = dict(node["tensor"], bucket=ptr)
        node["ctime_ns"] = op["now"]
    if op["final"]:
        bucket["tensor"]["members"] = sorted(ino for ino, _, _ in rows)
        bucket["version"] += 1
    bucket["ctime_ns"] = op["now"]
    return {"bucket": b, "tensors": [ino for ino, _, _ in rows]}


def unpack(meta, op: dict) -> dict:
    """Clear the pointers of ``tensors`` ([ino, version]: -1 for any) into ``bucket``; frees
    the bucket if no member is left."""
    b = op["bucket"]
    rows = op["tensors"]
    if not all(isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in rows):
        raise _err("EINVAL", "unpack: tensors is a list of [ino, version]")
    for ino, version in rows:
        node = meta.inode(ino)
        p = pointer(node)
        if p is None or p.get("fid") != b:
            raise _err("EINVAL", f"unpack: tensor {ino} is not packed into {b}")
        if version >= 0 and node["version"] != version:
            raise _err("EBUSY", f"unpack: tensor {ino} changed since it was read")
    freed = None
    for ino, _ in rows:
        freed = release(meta, ino, op["now"]) or freed
    if b in meta.inodes and is_bucket(meta.inodes[b]) and not meta.inodes[b]["tensor"]["members"]:
        freed = _free(meta, b)
    return {"freed_buckets": [freed] if freed else []}


def release(meta, ino: int, now: int) -> int | None:
    """Tensor ``ino``'s pointer goes (an unpack, a whole rewrite, its last name removed): the
    tensor's data is its own again (its version moves) and the bucket loses a member; returns
    the bucket if that freed it."""
    node = meta.inodes.get(ino)
    p = pointer(node)
    if p is None:
        return None
    node["tensor"] = {k: v for k, v in node["tensor"].items() if k != "bucket"}
    node["version"] += 1
    node["ctime_ns"] = now
    bucket = meta.inodes.get(p["fid"])
    if "until" in p or not is_bucket(bucket):
        return None
    members = bucket["tensor"]["members"]
    if ino in members:
        members.remove(ino)
        bucket["version"] += 1
    return _free(meta, p["fid"]) if not members else None


def _free(meta, b: int) -> int:
    """Remove bucket ``b`` from the namespace (its stripes are dropped by every node)."""
    bucket = meta.inodes.pop(b)
    entries = meta.entries.get(bucket.get("parent"), {})
    for name in [n for n, i in entries.items() if i == b]:
        del entries[name]
    meta.cuts.forget(b)
    return b


def _orphan(meta, name: str, ino: int) -> bool:
    """Whether entry ``name`` of a directory is what a pack cut short left: a bucket without
    members (its second step never landed, or it was undone), or the bare file a pack created
    under the bucket's reserved name before its first step (the mount died, or the first step
    was refused and the file's removal failed)."""
    node = meta.inodes.get(ino)
    if is_bucket(node):
        return not node["tensor"]["members"]
    return BUCKET_FILE.fullmatch(name) is not None and node is not None and S.S_ISREG(node["mode"]) and node.get("tensor") is None


def free_orphans(meta, directory: int) -> list[int]:
    """What packs cut short left in ``directory`` (``_orphan``): freed (an ``rmdir``)."""
    return [_free(meta, i) for name, i in list(meta.entries.get(directory, {}).items()) if _orphan(meta, name, i)]


def only_orphans(meta, directory: int) -> bool:
    """Whether ``directory`` holds nothing but what packs cut short left (``rmdir`` may go on)."""
    return all(_orphan(meta, name, i) for name, i in meta.entries.get(directory, {}).items())


def guard(meta, op: dict) -> None:
    """What an op other than pack/unpack may not do to a packed tensor or a bucket (B4, B6, B8):
    EBUSY where the mount unpacks first and asks again, LAYOUT_CHANGED (the user's ESTALE) for a
    write opened before a pack,
    EXDEV for a move out of the directory, EPERM for a bucket touched as a file."""
    kind = op["op"]
    ino = op.get("ino")
    node = meta.inodes.get(ino) if ino is not None else None
    if kind in ("setattr", "settensor", "setxattr") and is_bucket(node):
        if not (kind == "setattr" and "size" not in op["attrs"]):
            raise _err("EPERM", f"inode {ino} is a bucket: the file system keeps it")
    packed = in_force(node)
    if kind == "extend" and packed:
        raise _err(LAYOUT_CHANGED, f"tensor {ino} was packed since it was opened for writing: open it again")
    if kind == "settensor" and packed:
        same = op["tensor"] is not None and dict(op["tensor"], bucket=packed) == node["tensor"]
        if not same:
            raise _err("EBUSY", f"tensor {ino} is packed: unpack it first")
    if kind == "setattr" and packed and op["attrs"].get("size", 0) > node["tensor"]["offset"]:
        raise _err("EBUSY", f"tensor {ino} is packed: unpack it before a partial truncate")
    if kind == "setxattr" and packed and op["name"].startswith("user.irdma."):
        raise _err("EBUSY", f"tensor {ino} is packed: unpack it before it gets a policy of its own")
    if kind in ("link", "rename"):
        # (an op the namespace refuses anyway is left to say why itself: no lookup here raises)
        moving = node if kind == "link" else meta.inodes.get(meta.entries.get(op["parent"], {}).get(op["name"], -1))
        there = op["new_parent"]
        if in_force(moving) and moving.get("parent") != there:
            raise _err("EXDEV", "a packed tensor stays in its directory: copy it")
        if is_bucket(moving):
            raise _err("EPERM", "a bucket is kept by the file system")
    if kind in ("unlink", "rename"):
        parent, name = (op["parent"], op["name"]) if kind == "unlink" else (op["new_parent"], op["new_name"])
        gone = meta.inodes.get(meta.entries.get(parent, {}).get(name, -1))
        if is_bucket(gone) and gone["tensor"]["members"]:
            raise _err("EBUSY", "a bucket in use is kept by the file system")
