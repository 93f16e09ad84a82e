"""What each namespace op does to the namespace: one function per kind, ``APPLY`` by kind.

Each takes the namespace (``meta.Meta``) it reads and changes as ``meta`` (its tables are
``meta.tree``, tree.py; its snapshots ``meta.frozen``, snapshots.py; its truncates
``meta.cuts``) and the op as the primary prepared it; it returns the op's result, or raises
``RemoteError`` having changed nothing (every check before any change). ``Meta.apply`` checks the
op, guards buckets (buckets.py) and calls the one for its kind; what an op means for a node's
stripes is namespace.py's. Pure: no I/O, no trio.
"""

from __future__ import annotations

import json
import stat as S

from .. import held, packing
from ..errors import PolicyError, RemoteError
from ..names import MODEL_XATTR, PATH_MAX
from ..policy import POLICIES
from ..policy import check as check_policy
from . import buckets
from .tree import Tree, check_name

LINK_MAX = 65000  # names one inode may have (ext4's limit)
# what an inode may be: files hold data, directories names, symbolic links a target; FIFOs,
# sockets and device nodes are only names (the kernel does their I/O)
KINDS = {S.S_IFREG, S.S_IFDIR, S.S_IFLNK, S.S_IFIFO, S.S_IFSOCK, S.S_IFCHR, S.S_IFBLK}


def _err(code: str, msg: str) -> RemoteError:
    return RemoteError(code, msg)


def op_create(meta, op: dict) -> dict:
    tree = meta.tree
    parent, name = op["parent"], op["name"]
    check_name(name)
    entries = tree.directory(parent)
    if name in entries:
        raise _err("EEXIST", f"{name!r} exists")
    mode = op["mode"]
    if S.S_IFMT(mode) not in KINDS:
        mode = S.S_IFREG | S.S_IMODE(mode)
    target = op.get("target")
    if S.S_ISLNK(mode) and (not target or len(target.encode(errors="surrogateescape")) > PATH_MAX - 1):
        raise _err("ENOENT" if not target else "ENAMETOOLONG", "a symbolic link needs a target shorter than PATH_MAX")
    # only regular files hold data (stripes); the others are names the kernel serves
    unit = op.get("unit", 0) if S.S_ISREG(mode) else 0
    node = tree.new_inode(op["ino"], mode, op.get("uid", 0), op.get("gid", 0), op["now"], unit)
    node["parent"] = parent
    if S.S_ISLNK(mode):
        node["target"] = target
        node["size"] = len(target.encode(errors="surrogateescape"))
    if S.S_ISCHR(mode) or S.S_ISBLK(mode):
        node["rdev"] = int(op.get("rdev", 0))
    if S.S_ISREG(mode) and op.get("writer"):
        _add_writer(node, op["writer"])  # W1: created to be written, unfinished until its writer is done
    entries[name] = op["ino"]
    if S.S_ISDIR(mode):
        tree.inodes[parent]["nlink"] += 1
    tree.touch_dir(parent, op["now"])
    return tree.attr(op["ino"])


def op_mkdir(meta, op: dict) -> dict:
    return op_create(meta, dict(op, mode=S.S_IFDIR | S.S_IMODE(op["mode"])))


def op_link(meta, op: dict) -> dict:
    """A second name for ``ino`` (a hard link): never for a directory (its parent is one)."""
    tree = meta.tree
    node = tree.inode(op["ino"])
    parent, name = op["new_parent"], op["new_name"]
    check_name(name)
    entries = tree.directory(parent)
    if S.S_ISDIR(node["mode"]):
        raise _err("EPERM", "a directory cannot have another name")
    if name in entries:
        raise _err("EEXIST", f"{name!r} exists")
    if node["nlink"] >= LINK_MAX:
        raise _err("EMLINK", f"inode {op['ino']} has {LINK_MAX} names already")
    entries[name] = op["ino"]
    node["nlink"] += 1
    node["ctime_ns"] = op["now"]
    tree.touch_dir(parent, op["now"])
    return tree.attr(op["ino"])


def op_unlink(meta, op: dict) -> dict:
    tree = meta.tree
    parent, name = op["parent"], op["name"]
    entries, ino = tree.child(parent, name)
    node = tree.inodes[ino]
    if S.S_ISDIR(node["mode"]):
        raise _err("EISDIR", f"{name!r} is a directory")
    del entries[name]
    node["nlink"] -= 1
    node["ctime_ns"] = op["now"]  # its link count changed (seen through its other names)
    freed = bucket = None
    if node["nlink"] <= 0:
        bucket = buckets.release(meta, ino, op["now"])
        del tree.inodes[ino]
        freed = ino
    tree.touch_dir(parent, op["now"])
    result = {"ino": ino, "freed": freed, "nlink": node["nlink"], "model": _freed_model(tree, node, freed)}
    return dict(result, freed_buckets=[bucket]) if bucket else result


def op_rmdir(meta, op: dict) -> dict:
    tree = meta.tree
    parent, name = op["parent"], op["name"]
    entries, ino = tree.child(parent, name)
    tree.directory(ino)  # ENOTDIR for anything else
    if not buckets.only_orphans(meta, ino):  # (what a pack cut short left goes with it)
        raise _err("ENOTEMPTY", f"{name!r} is not empty")
    freed = buckets.free_orphans(meta, ino)
    del entries[name]
    del tree.inodes[ino], tree.entries[ino]
    tree.inodes[parent]["nlink"] -= 1
    tree.touch_dir(parent, op["now"])
    return {"ino": ino, "freed_buckets": freed}


def op_rename(meta, op: dict) -> dict:
    tree = meta.tree
    name, new_name = op["name"], op["new_name"]
    check_name(new_name)
    src_dir, ino = tree.child(op["parent"], name)
    dst_dir = tree.directory(op["new_parent"])
    if dst_dir.get(new_name) == ino:
        # two names of one file (or a name onto itself): POSIX says nothing happens
        return {"ino": ino, "freed": None}
    moving_dir = S.S_ISDIR(tree.inodes[ino]["mode"])
    if moving_dir and tree.is_ancestor(ino, op["new_parent"]):
        raise _err("EINVAL", "cannot move a directory into itself")
    replaced = dst_dir.get(new_name)
    freed = freed_model = bucket = None
    if replaced is not None and replaced != ino:
        target = tree.inodes[replaced]
        if S.S_ISDIR(target["mode"]):
            if not moving_dir:
                raise _err("EISDIR", f"{new_name!r} is a directory")
            if tree.entries[replaced]:
                raise _err("ENOTEMPTY", f"{new_name!r} is not empty")
        elif moving_dir:
            raise _err("ENOTDIR", f"{new_name!r} is not a directory")
    # validated: now change state
    if replaced is not None and replaced != ino:
        target = tree.inodes[replaced]
        if S.S_ISDIR(target["mode"]):
            del tree.inodes[replaced], tree.entries[replaced]
            tree.inodes[op["new_parent"]]["nlink"] -= 1
        else:
            target["nlink"] -= 1
            target["ctime_ns"] = op["now"]
            if target["nlink"] <= 0:
                bucket = buckets.release(meta, replaced, op["now"])
                del tree.inodes[replaced]
                freed = replaced
                freed_model = _freed_model(tree, target, freed)
    del src_dir[name]
    dst_dir[new_name] = ino
    tree.inodes[ino]["parent"] = op["new_parent"]
    if moving_dir and op["parent"] != op["new_parent"]:
        tree.inodes[op["parent"]]["nlink"] -= 1
        tree.inodes[op["new_parent"]]["nlink"] += 1
    tree.inodes[ino]["ctime_ns"] = op["now"]
    tree.touch_dir(op["parent"], op["now"])
    tree.touch_dir(op["new_parent"], op["now"])
    return {"ino": ino, "freed": freed, "model": freed_model, "freed_buckets": [bucket] if bucket else []}


_SETTABLE = {"mode", "uid", "gid", "atime_ns", "mtime_ns", "size"}


def op_setattr(meta, op: dict) -> dict:
    tree = meta.tree
    node = tree.inode(op["ino"])
    fields = op["attrs"]
    bad = set(fields) - _SETTABLE
    if bad:
        raise _err("EINVAL", f"cannot set {sorted(bad)}")
    if "size" in fields and (S.S_ISDIR(node["mode"]) or fields["size"] < 0):
        raise _err("EISDIR" if S.S_ISDIR(node["mode"]) else "EINVAL", "bad size change")
    if "mode" in fields:
        fields = dict(fields, mode=S.S_IFMT(node["mode"]) | S.S_IMODE(fields["mode"]))
    if "size" in fields and node.get("stripes") is not None:  # every node drops the stripes past it
        node["stripes"] = held.cut(node["stripes"], -(-fields["size"] // node["unit"]))
    bucket = None
    if "size" in fields and packing.pointer(node) is not None:  # a whole rewrite: its data is its own again
        bucket = buckets.release(meta, op["ino"], op["now"])
    if "size" in fields and fields["size"] != node["size"]:
        node["version"] += 1
        if "mtime_ns" not in fields:
            node["mtime_ns"] = op["now"]
    node.update(fields)
    node["ctime_ns"] = op["now"]
    if op.get("writer") and S.S_ISREG(node["mode"]):
        if fields.get("size") == 0:  # a rewrite (O_TRUNC) starts the file afresh: earlier writers' marks go
            node.pop("writers", None)
        _add_writer(node, op["writer"])  # W1: cut or grown by a writer, unfinished until it is done
    return dict(tree.attr(op["ino"]), freed_buckets=[bucket]) if bucket else tree.attr(op["ino"])


def op_pack(meta, op: dict) -> dict:
    return buckets.pack(meta, op)


def op_unpack(meta, op: dict) -> dict:
    return buckets.unpack(meta, op)


def op_extend(meta, op: dict) -> dict:
    """A write ended at ``size``: grow the file if needed; content changed, so mtime moves."""
    tree = meta.tree
    node = tree.inode(op["ino"])
    if S.S_ISDIR(node["mode"]):
        raise _err("EISDIR", "cannot write a directory")
    node["size"] = max(node["size"], op["size"])
    if op.get("stripes") and node.get("stripes") is not None:
        runs = op["stripes"]
        # a truncate since the oldest of them was made dropped those past its cut: they are
        # holes now, not written (a later loss of them must not read as EIO)
        runs = meta.cuts.missed(op["ino"], runs, op.get("made"))
        node["stripes"] = held.add(node["stripes"], runs)
    node["mtime_ns"] = node["ctime_ns"] = op["now"]
    node["version"] += 1
    return tree.attr(op["ino"])


def _add_writer(node: dict, owner: str) -> None:
    """``owner`` writes the file: one of its ``writers`` until it says it is done (W1, W2)."""
    node["writers"] = sorted(set(node.get("writers", ())) | {owner})


def op_writing(meta, op: dict) -> dict:
    """W1: a writer's first change of a file it neither created nor truncated: the file is
    unfinished until that writer is done (``written``). Nothing else moves."""
    node = meta.tree.inode(op["ino"])
    if not S.S_ISREG(node["mode"]):
        raise _err("EINVAL", "only a regular file is written")
    _add_writer(node, op["writer"])
    return meta.tree.attr(op["ino"])


def op_written(meta, op: dict) -> dict:
    """W2: a writer released its last writable handle of the file, every write of it flushed:
    it is no longer one of the file's writers (the others' marks stand). Nothing else moves."""
    node = meta.tree.inode(op["ino"])
    left = [w for w in node.get("writers", ()) if w != op["writer"]]
    if left:
        node["writers"] = left
    else:
        node.pop("writers", None)
    return meta.tree.attr(op["ino"])


def _freed_model(tree: Tree, node: dict, freed: int | None) -> int | None:
    """The tensor directory a freed model file leaves behind (the mount removes it)."""
    return tree.model_dir(node) if freed else None


def op_setmodel(meta, op: dict) -> dict:
    """A file becomes a model file (``model`` = {"dir", "start"}: its tensors' bytes now
    live in directory ``dir``, it keeps its first ``start`` bytes: the node drops its
    stripes past them, node.py) or stops being one (``model`` None), in one op, so no reader
    sees the one without the other."""
    tree = meta.tree
    node = tree.inode(op["ino"])
    if not S.S_ISREG(node["mode"]):
        raise _err("EINVAL", "only a regular file is a model file")
    model = op["model"]
    if model is None:
        node["xattrs"].pop(MODEL_XATTR, None)
    else:
        stale = op.get("version") not in (None, node["version"]) or op.get("size") not in (None, node["size"])
        if stale or MODEL_XATTR in node["xattrs"]:
            raise _err("EAGAIN", f"inode {op['ino']} changed while it was made a model")
        d, start = model.get("dir"), model.get("start")  # (a dict: ``check`` saw to it)
        if not (isinstance(d, int) and d in tree.entries and isinstance(start, int) and 0 < start <= node["size"]):
            raise _err("EINVAL", f"bad model record {model!r}")
        node["xattrs"][MODEL_XATTR] = json.dumps(model)
        if node.get("stripes") is not None and node["unit"]:  # the stripes past ``start`` go
            node["stripes"] = held.cut(node["stripes"], -(-start // node["unit"]))
    node["ctime_ns"] = op["now"]
    return tree.attr(op["ino"])


def op_settensor(meta, op: dict) -> dict:
    """Record what the file's .npy header says (or None: not a tensor)."""
    tree = meta.tree
    node = tree.inode(op["ino"])
    if S.S_ISDIR(node["mode"]):
        raise _err("EISDIR", "a directory is not a tensor")
    packed = packing.in_force(node)  # (the same header again: ``buckets.guard`` let it through)
    node["tensor"] = dict(op["tensor"], bucket=packed) if packed else op["tensor"]
    return tree.attr(op["ino"])


def op_snapshot(meta, op: dict) -> dict:
    return meta.frozen.take(op, meta.tree)


def op_unsnapshot(meta, op: dict) -> dict:
    return meta.frozen.drop(op["name"])


def op_setxattr(meta, op: dict) -> dict:
    tree = meta.tree
    if op["name"] == MODEL_XATTR:  # only setmodel records it, with the drop of the stripes
        raise _err("EPERM", f"{MODEL_XATTR} is kept by the file system")
    if op["name"] in POLICIES and op.get("value") is not None:
        # checked when set, by any client, with the parser the training path reads it with
        # (the mount checks first and logs why: fs/xattrs.py check_xattr)
        try:
            check_policy(op["name"], op["value"])
        except PolicyError as exc:
            raise _err("EINVAL", f"{op['name']}: {exc}") from None
    node = tree.inode(op["ino"])
    if op.get("value") is None:
        if op["name"] not in node["xattrs"]:
            raise _err("ENODATA", f"no attribute {op['name']!r}")
        del node["xattrs"][op["name"]]
    else:
        node["xattrs"][op["name"]] = op["value"]
    node["ctime_ns"] = op["now"]
    return {}


def op_trim(meta, op: dict) -> dict:
    """Of the stripes ``[[idx, tag, version], ...]`` of file ``ino``, those past the file's
    end now, in the namespace's order: every node then drops its copy of each if its stamp
    is still (tag, version) or older (server/namespace.py; the stripe's primary sends it:
    server/tails.py). Ordered with the extends, a stripe a write has grown the file over
    since is not among them, and one written again since has a newer stamp: neither is
    dropped. The trimmed stripes leave the file's runs of written stripes (held.py): a
    later grow makes them holes, not lost."""
    tree = meta.tree
    node = tree.inode(op["ino"])
    rows = op["stripes"]
    if not S.S_ISREG(node["mode"]) or not node["unit"]:
        raise _err("EINVAL", f"trim: inode {op['ino']} is no striped file")
    if len(rows) > held.MAX_RUNS or not all(isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r) and r[0] >= 0 for r in rows):
        raise _err("EINVAL", "trim: stripes is a list of [idx, tag, version]")
    end = held.extent_end(node)
    trimmed = [r for r in rows if r[0] * node["unit"] >= end]
    if trimmed and node.get("stripes") is not None:
        gone = {r[0] for r in trimmed}
        node["stripes"] = held.runs_of(i for lo, hi in node["stripes"] for i in range(lo, hi) if i not in gone)
    return {"trim": trimmed}


def op_cacher(meta, op: dict) -> dict:
    """A mount recorded as one that may cache names (on), or dropped from the record."""
    (meta.cachers.add if op["on"] else meta.cachers.discard)(op["owner"])
    return {}


APPLY = {
    "create": op_create,
    "mkdir": op_mkdir,
    "link": op_link,
    "unlink": op_unlink,
    "rmdir": op_rmdir,
    "rename": op_rename,
    "setattr": op_setattr,
    "extend": op_extend,
    "setmodel": op_setmodel,
    "settensor": op_settensor,
    "snapshot": op_snapshot,
    "unsnapshot": op_unsnapshot,
    "setxattr": op_setxattr,
    "pack": op_pack,
    "unpack": op_unpack,
    "cacher": op_cacher,
    "trim": op_trim,
    "writing": op_writing,
    "written": op_written,
}
