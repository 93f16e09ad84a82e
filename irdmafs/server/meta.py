"""The namespace: inodes and directory entries, as a deterministic state machine.

The metadata primary (the first ready node in config order) decides everything that is not
deterministic (new inode numbers, timestamps) and writes it into the op; every node then applies
the same ops in the same order (``seq``), so every node holds the same namespace. A PS namespace
is small (hundreds of tensors), so replicating it to every node is cheap and lets any node take
over as primary.

Errors are ``RemoteError`` with an errno name, which the file system maps straight to its errno.
Pure: no I/O, no trio.
"""

from __future__ import annotations

import copy
import json
import stat as S
from typing import Any

# (the client and the file system import these from irdmafs.names, not from here)
from ..names import MODEL_SUFFIX, MODEL_XATTR, NAME_MAX, PATH_MAX, ROOT
from .. import held, packing
from ..regions import VERSION_SHIFT
from ..policy import POLICIES, check as check_policy
from ..errors import PolicyError
from ..errors import RemoteError
from . import buckets

LINK_MAX = 65000  # names one inode may have (ext4's limit)
# what an inode may be: files hold data, directories names, symbolic links a target; FIFOs,
# sockets and device nodes are only names (the kernel does their I/O)
KINDS = {S.S_IFREG, S.S_IFDIR, S.S_IFLNK, S.S_IFIFO, S.S_IFSOCK, S.S_IFCHR, S.S_IFBLK}


def _err(code: str, msg: str) -> RemoteError:
    return RemoteError(code, msg)


def check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise _err("EINVAL", f"invalid name {name!r}")
    if len(name.encode(errors="surrogateescape")) > NAME_MAX:
        raise _err("ENAMETOOLONG", f"name longer than {NAME_MAX} bytes")


DONE_KEPT = 4096  # results of this many recent ops are kept for retries (see Meta.done)

_NAMING = {"uid": int, "gid": int}
# What a client's namespace op carries, by kind: field -> its type (``Meta.check``); then the
# fields it may leave out. What the primary adds (``now``, a new ``ino``, a snapshot's ``id``)
# is not the client's to send, and is not checked here.
OP_FIELDS: dict[str, dict[str, Any]] = {
    "create": {"parent": int, "name": str, "mode": int},
    "mkdir": {"parent": int, "name": str, "mode": int},
    "link": {"ino": int, "new_parent": int, "new_name": str},
    "unlink": {"parent": int, "name": str},
    "rmdir": {"parent": int, "name": str},
    "rename": {"parent": int, "name": str, "new_parent": int, "new_name": str},
    "setattr": {"ino": int, "attrs": dict},
    "extend": {"ino": int, "size": int},
    "setmodel": {"ino": int, "model": (dict, type(None))},
    "settensor": {"ino": int, "tensor": (dict, type(None))},
    "snapshot": {"name": str},
    "unsnapshot": {"name": str},
    "setxattr": {"ino": int, "name": str},
    "pack": {"bucket": int, "tensors": list, "count": int, "final": bool},
    "unpack": {"bucket": int, "tensors": list},
    "cacher": {"owner": str, "on": bool},  # a mount that may cache names (server/namecache.py)
    "trim": {"ino": int, "stripes": list},  # [[idx, tag, version], ...] past the end, their writers failed or gone (server/tails.py)
}
OP_OPTIONAL: dict[str, dict[str, Any]] = {
    "create": {"target": str, "unit": int, "rdev": int, **_NAMING},
    "mkdir": dict(_NAMING),
    "setxattr": {"value": (str, type(None))},
    "extend": {"stripes": list, "made": int},  # the runs of stripes the write wrote (held.py), the oldest's version
}


class Meta:
    def __init__(self) -> None:
        self.seq = 0
        self.tag = 0  # the view epoch the last op was applied in (0: no views)
        self.next_ino = ROOT + 1
        self.next_snap = 1
        self.inodes: dict[int, dict[str, Any]] = {}
        self.entries: dict[int, dict[str, int]] = {}
        # file -> [[seq, idx], ...]: the truncates that freed its stripes from idx on, by the op's
        # seq (a stripe made since has a higher version base: datapath.VERSION_SHIFT); a node that
        # takes a namespace whole drops what they freed (Namespace.restore). A later cut at a
        # lower index replaces the earlier ones it covers.
        self.cuts: dict[int, list[list[int]]] = {}
        # name -> {"id", "time_ns", "inodes", "entries"}: frozen copies of the namespace
        self.snapshots: dict[str, dict[str, Any]] = {}
        self._views: dict[int, Meta] = {}
        # request id -> result of the newest DONE_KEPT ops that carried one: a client retrying
        # an op whose answer it lost (its primary died after forwarding it) gets that answer
        # again instead of the op applied twice (a second mkdir would say EEXIST). Applied on
        # every node in the same order, so whichever node is primary next knows it.
        self.done: dict[str, dict] = {}
        # the mounts that took a cache lease and may still hold one: a new metadata primary
        # waits out a lease before it changes anything while any is recorded (namecache.py)
        self.cachers: set[str] = set()
        self._new_inode(ROOT, S.S_IFDIR | 0o755, 0, 0, 0, 0)

    # -- reading ---------------------------------------------------------------------------
    def inode(self, ino: int) -> dict:
        node = self.inodes.get(ino)
        if node is None:
            raise _err("ENOENT", f"no inode {ino}")
        return node

    def directory(self, ino: int) -> dict[str, int]:
        if not S.S_ISDIR(self.inode(ino)["mode"]):
            raise _err("ENOTDIR", f"inode {ino} is not a directory")
        return self.entries[ino]

    def lookup(self, parent: int, name: str) -> dict:
        if len(name.encode(errors="surrogateescape")) > NAME_MAX:
            raise _err("ENAMETOOLONG", f"name longer than {NAME_MAX} bytes")
        ino = self.directory(parent).get(name)
        if ino is None:
            raise _err("ENOENT", f"{name!r} not in directory {parent}")
        return self.attr(ino)

    def attr(self, ino: int) -> dict:
        """An inode's attributes as a client sees them: its record without the runs of its
        written stripes (held.py; they may be long), with the blocks they take."""
        node = self.inode(ino)
        out = {k: v for k, v in node.items() if k != "stripes"}
        if S.S_ISREG(node["mode"]):
            out["blocks"] = held.blocks(node.get("stripes"), node["size"], node["unit"])
        out["ino"] = ino
        return out

    def written(self, ino: int, idx: int) -> bool | None:
        """Whether stripe ``idx`` of file ``ino`` holds bytes someone wrote (held.py): True,
        False (a hole: zeros), or None when the namespace does not know (no such file, or a
        record from before the runs were kept)."""
        node = self.inodes.get(ino)
        if node is None or node.get("stripes") is None:
            return None
        return held.contains(node["stripes"], idx)

    def model_dir(self, node: dict) -> int | None:
        """The tensor directory of a model file's inode record (fs/models.py), or None."""
        try:
            d = json.loads(node["xattrs"].get(MODEL_XATTR) or "null")
        except ValueError:
            return None
        return d["dir"] if isinstance(d, dict) and d.get("dir") in self.inodes else None

    def lookup_or_model(self, parent: int, name: str) -> dict:
        """``lookup``, and where ``name`` is missing, the tensor directory of a model file
        ``name.safetensors`` of the same directory (the name ``X`` of ``X.safetensors``'s
        tensors: one call for what the mount would otherwise ask twice)."""
        try:
            return self.lookup(parent, name)
        except RemoteError as exc:
            if exc.code != "ENOENT" or name.endswith(MODEL_SUFFIX):
                raise
            ino = self.directory(parent).get(name + MODEL_SUFFIX)
            d = self.model_dir(self.inodes[ino]) if ino is not None else None
            if d is None:
                raise
            return dict(self.attr(d), alias_of=ino)

    def readdir(self, ino: int) -> list[list]:
        return [[name, self.attr(child)] for name, child in sorted(self.directory(ino).items())]

    def inherited_xattrs(self, ino: int) -> dict[str, str]:
        """The user.irdma.* attributes in force for ``ino``: each from the nearest directory
        above it (its own first) that sets it."""
        out: dict[str, str] = {}
        seen = set()
        while ino in self.inodes and ino not in seen:
            seen.add(ino)
            node = self.inodes[ino]
            for k, v in node["xattrs"].items():
                if k.startswith("user.irdma.") and k not in out:
                    out[k] = v
            if ino == ROOT:
                break
            ino = node.get("parent", ROOT)
        return out

    def files(self) -> set[int]:
        return {ino for ino, n in self.inodes.items() if S.S_ISREG(n["mode"])}

    def view(self, snap: int) -> "Meta":
        """The namespace as it is (snap 0) or as snapshot ``snap`` froze it."""
        if snap == 0:
            return self
        if snap not in self._views:
            for s in self.snapshots.values():
                if s["id"] == snap:
                    v = Meta()
                    v.inodes = {int(k): n for k, n in s["inodes"].items()}
                    v.entries = {int(k): dict(e) for k, e in s["entries"].items()}
                    self._views[snap] = v
                    break
            else:
                raise _err("ENOENT", f"no snapshot {snap}")
        return self._views[snap]

    def snapshot_ids(self) -> dict[str, int]:
        return {name: s["id"] for name, s in self.snapshots.items()}

    @property
    def stamp(self) -> tuple[int, int]:
        """(epoch, seq) of the last op: one primary per epoch numbers ops, so two namespaces at
        one stamp went through the same ops, and of two stamps the greater is the newer."""
        return self.tag, self.seq

    def snapshot(self) -> dict:
        return {
            "seq": self.seq,
            "tag": self.tag,
            "next_ino": self.next_ino,
            "next_snap": self.next_snap,
            "inodes": {str(k): v for k, v in self.inodes.items()},
            "entries": {str(k): v for k, v in self.entries.items()},
            "snapshots": self.snapshots,
            "done": self.done,
            "cuts": {str(k): v for k, v in self.cuts.items()},
            "cachers": sorted(self.cachers),
        }

    @classmethod
    def restore(cls, snap: dict) -> "Meta":
        m = cls()
        m.seq = snap["seq"]
        m.tag = snap.get("tag", 0)
        m.next_ino = snap["next_ino"]
        m.next_snap = snap.get("next_snap", 1)
        m.inodes = {int(k): v for k, v in snap["inodes"].items()}
        m.entries = {int(k): dict(v) for k, v in snap["entries"].items()}
        m.snapshots = copy.deepcopy(snap.get("snapshots", {}))
        m.done = dict(snap.get("done", {}))
        m.cuts = {int(k): [list(c) for c in v] for k, v in snap.get("cuts", {}).items()}
        m.cachers = set(snap.get("cachers", ()))
        return m

    # -- the primary's side: turn a request into a deterministic op -----------------------------
    @staticmethod
    def check(op: Any) -> None:
        """EINVAL unless ``op`` is an op a client may send: a known kind, with the fields that
        kind needs (``OP_FIELDS``), each of its type. What the op then means for the namespace
        (a name that exists, a directory that is not empty) is ``apply``'s to judge."""
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise _err("EINVAL", 'a namespace op is an object with a string "op"')
        kind = op["op"]
        fields = OP_FIELDS.get(kind)
        if fields is None:
            raise _err("EINVAL", f"unknown metadata op {kind!r}")
        for key, want in {**fields, **OP_OPTIONAL.get(kind, {}), "rid": str}.items():
            if key not in op:
                if key in fields:
                    raise _err("EINVAL", f"{kind}: no {key!r}")
            elif not isinstance(op[key], want):
                raise _err("EINVAL", f"{kind}: {key!r} is a {type(op[key]).__name__}")
        if kind == "setattr" and not all(isinstance(v, int) and not isinstance(v, bool) for v in op["attrs"].values()):
            raise _err("EINVAL", "setattr: attributes are integers")
        if kind == "extend" and "stripes" in op:
            try:
                held.check(op["stripes"])
            except ValueError as exc:
                raise _err("EINVAL", f"extend: {exc}") from None

    def prepare(self, op: dict, now_ns: int) -> dict:
        """Fill in what only the primary may decide; the op is checked here (``check``), what it
        does to the namespace is validated in ``apply``."""
        self.check(op)
        op = dict(op, now=now_ns)
        if op["op"] in ("create", "mkdir"):
            op["ino"] = self.next_ino
        if op["op"] == "snapshot":
            op["id"] = self.next_snap
        return op

    # -- everyone's side ---------------------------------------------------------------------
    def apply(self, op: dict) -> dict:
        """Apply one op; returns its result. Raises RemoteError and changes nothing if invalid.
        Every op is validated before any state changes, so a refused op leaves no trace."""
        self.check(op)
        buckets.guard(self, op)
        result = getattr(self, f"_op_{op['op']}")(op)
        self.seq += 1
        root = self.inodes[ROOT]
        if not root["ctime_ns"] and op.get("now"):  # made with the namespace, before any clock: the first op's time
            root["atime_ns"] = root["mtime_ns"] = root["ctime_ns"] = op["now"]
        if op["op"] == "setattr" and "size" in op["attrs"] and self.inodes[op["ino"]]["unit"]:
            cut = -(-op["attrs"]["size"] // self.inodes[op["ino"]]["unit"])
            self.cuts[op["ino"]] = [c for c in self.cuts.get(op["ino"], []) if c[1] < cut] + [[self.seq, cut]]
        if result.get("freed"):
            self.cuts.pop(result["freed"], None)
        for b in result.get("freed_buckets", ()):
            self.cuts.pop(b, None)
        if op.get("rid"):
            self.done[op["rid"]] = result
            while len(self.done) > DONE_KEPT:
                del self.done[next(iter(self.done))]
        return result

    def _new_inode(self, ino: int, mode: int, uid: int, gid: int, now: int, unit: int) -> dict:
        node = {
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "size": 0,
            "nlink": 2 if S.S_ISDIR(mode) else 1,
            "atime_ns": now,
            "mtime_ns": now,
            "ctime_ns": now,
            "unit": unit,
            "xattrs": {},
            "version": 0,  # counts content changes
            "tensor": None,  # {"dtype", "shape", "offset"} while the content is a valid .npy
        }
        if S.S_ISREG(mode) and unit:
            node["stripes"] = []  # the runs of its stripes that hold written bytes (held.py)
        self.inodes[ino] = node
        if S.S_ISDIR(mode):
            self.entries[ino] = {}
        self.next_ino = max(self.next_ino, ino + 1)
        return node

    def _touch_dir(self, ino: int, now: int) -> None:
        d = self.inodes[ino]
        d["mtime_ns"] = d["ctime_ns"] = now

    def _op_create(self, op: dict) -> dict:
        parent, name = op["parent"], op["name"]
        check_name(name)
        entries = self.directory(parent)
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
        node = self._new_inode(op["ino"], mode, op.get("uid", 0), op.get("gid", 0), op["now"], unit)
        node["parent"] = parent
        if S.S_ISLNK(mode):
            node["target"] = target
            node["size"] = len(target.encode(errors="surrogateescape"))
        if S.S_ISCHR(mode) or S.S_ISBLK(mode):
            node["rdev"] = int(op.get("rdev", 0))
        entries[name] = op["ino"]
        if S.S_ISDIR(mode):
            self.inodes[parent]["nlink"] += 1
        self._touch_dir(parent, op["now"])
        return self.attr(op["ino"])

    def _op_mkdir(self, op: dict) -> dict:
        return self._op_create(dict(op, mode=S.S_IFDIR | S.S_IMODE(op["mode"])))

    def _op_link(self, op: dict) -> dict:
        """A second name for ``ino`` (a hard link): never for a directory (its parent is one)."""
        node = self.inode(op["ino"])
        parent, name = op["new_parent"], op["new_name"]
        check_name(name)
        entries = self.directory(parent)
        if S.S_ISDIR(node["mode"]):
            raise _err("EPERM", "a directory cannot have another name")
        if name in entries:
            raise _err("EEXIST", f"{name!r} exists")
        if node["nlink"] >= LINK_MAX:
            raise _err("EMLINK", f"inode {op['ino']} has {LINK_MAX} names already")
        entries[name] = op["ino"]
        node["nlink"] += 1
        node["ctime_ns"] = op["now"]
        self._touch_dir(parent, op["now"])
        return self.attr(op["ino"])

    def _child(self, parent: int, name: str) -> tuple[dict[str, int], int]:
        """(entries of ``parent``, inode of ``name`` in it); ENOENT if there is none."""
        entries = self.directory(parent)
        ino = entries.get(name)
        if ino is None:
            raise _err("ENOENT", f"{name!r} not found")
        return entries, ino

    def _op_unlink(self, op: dict) -> dict:
        parent, name = op["parent"], op["name"]
        entries, ino = self._child(parent, name)
        node = self.inodes[ino]
        if S.S_ISDIR(node["mode"]):
            raise _err("EISDIR", f"{name!r} is a directory")
        del entries[name]
        node["nlink"] -= 1
        node["ctime_ns"] = op["now"]  # its link count changed (seen through its other names)
        freed = bucket = None
        if node["nlink"] <= 0:
            bucket = buckets.release(self, ino, op["now"])
            del self.inodes[ino]
            freed = ino
        self._touch_dir(parent, op["now"])
        result = {"ino": ino, "freed": freed, "nlink": node["nlink"], "model": self._freed_model(node, freed)}
        return dict(result, freed_buckets=[bucket]) if bucket else result

    def _op_rmdir(self, op: dict) -> dict:
        parent, name = op["parent"], op["name"]
        entries, ino = self._child(parent, name)
        self.directory(ino)  # ENOTDIR for anything else
        if not buckets.only_orphans(self, ino):  # (what a pack cut short left goes with it)
            raise _err("ENOTEMPTY", f"{name!r} is not empty")
        freed = buckets.free_orphans(self, ino)
        del entries[name]
        del self.inodes[ino], self.entries[ino]
        self.inodes[parent]["nlink"] -= 1
        self._touch_dir(parent, op["now"])
        return {"ino": ino, "freed_buckets": freed}

    def _is_ancestor(self, maybe_ancestor: int, ino: int) -> bool:
        # Directories have one parent; walk down from maybe_ancestor looking for ino.
        stack = [maybe_ancestor]
        while stack:
            cur = stack.pop()
            if cur == ino:
                return True
            stack.extend(c for c in self.entries.get(cur, {}).values() if c in self.entries)
        return False

    def _op_rename(self, op: dict) -> dict:
        name, new_name = op["name"], op["new_name"]
        check_name(new_name)
        src_dir, ino = self._child(op["parent"], name)
        dst_dir = self.directory(op["new_parent"])
        if dst_dir.get(new_name) == ino:
            # two names of one file (or a name onto itself): POSIX says nothing happens
            return {"ino": ino, "freed": None}
        moving_dir = S.S_ISDIR(self.inodes[ino]["mode"])
        if moving_dir and self._is_ancestor(ino, op["new_parent"]):
            raise _err("EINVAL", "cannot move a directory into itself")
        replaced = dst_dir.get(new_name)
        freed = freed_model = bucket = None
        if replaced is not None and replaced != ino:
            target = self.inodes[replaced]
            if S.S_ISDIR(target["mode"]):
                if not moving_dir:
                    raise _err("EISDIR", f"{new_name!r} is a directory")
                if self.entries[replaced]:
                    raise _err("ENOTEMPTY", f"{new_name!r} is not empty")
            elif moving_dir:
                raise _err("ENOTDIR", f"{new_name!r} is not a directory")
        # validated: now change state
        if replaced is not None and replaced != ino:
            target = self.inodes[replaced]
            if S.S_ISDIR(target["mode"]):
                del self.inodes[replaced], self.entries[replaced]
                self.inodes[op["new_parent"]]["nlink"] -= 1
            else:
                target["nlink"] -= 1
                target["ctime_ns"] = op["now"]
                if target["nlink"] <= 0:
                    bucket = buckets.release(self, replaced, op["now"])
                    del self.inodes[replaced]
                    freed = replaced
                    freed_model = self._freed_model(target, freed)
        del src_dir[name]
        dst_dir[new_name] = ino
        self.inodes[ino]["parent"] = op["new_parent"]
        if moving_dir and op["parent"] != op["new_parent"]:
            self.inodes[op["parent"]]["nlink"] -= 1
            self.inodes[op["new_parent"]]["nlink"] += 1
        self.inodes[ino]["ctime_ns"] = op["now"]
        self._touch_dir(op["parent"], op["now"])
        self._touch_dir(op["new_parent"], op["now"])
        return {"ino": ino, "freed": freed, "model": freed_model, "freed_buckets": [bucket] if bucket else []}

    _SETTABLE = {"mode", "uid", "gid", "atime_ns", "mtime_ns", "size"}

    def _op_setattr(self, op: dict) -> dict:
        node = self.inode(op["ino"])
        fields = op["attrs"]
        bad = set(fields) - self._SETTABLE
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
            bucket = buckets.release(self, op["ino"], op["now"])
        if "size" in fields and fields["size"] != node["size"]:
            node["version"] += 1
            if "mtime_ns" not in fields:
                node["mtime_ns"] = op["now"]
        node.update(fields)
        node["ctime_ns"] = op["now"]
        return dict(self.attr(op["ino"]), freed_buckets=[bucket]) if bucket else self.attr(op["ino"])

    def _op_pack(self, op: dict) -> dict:
        return buckets.pack(self, op)

    def _op_unpack(self, op: dict) -> dict:
        return buckets.unpack(self, op)

    def _op_extend(self, op: dict) -> dict:
        """A write ended at ``size``: grow the file if needed; content changed, so mtime moves."""
        node = self.inode(op["ino"])
        if S.S_ISDIR(node["mode"]):
            raise _err("EISDIR", "cannot write a directory")
        node["size"] = max(node["size"], op["size"])
        if op.get("stripes") and node.get("stripes") is not None:
            runs = op["stripes"]
            # a truncate since the oldest of them was made dropped those past its cut: they are
            # holes now, not written (a later loss of them must not read as EIO)
            for seq, cut in self.cuts.get(op["ino"], ()):
                if "made" not in op or op["made"] < seq << VERSION_SHIFT:
                    runs = held.cut(runs, cut)
            node["stripes"] = held.add(node["stripes"], runs)
        node["mtime_ns"] = node["ctime_ns"] = op["now"]
        node["version"] += 1
        return self.attr(op["ino"])

    def _freed_model(self, node: dict, freed: int | None) -> int | None:
        """The tensor directory a freed model file leaves behind (the mount removes it)."""
        return self.model_dir(node) if freed else None

    def _op_setmodel(self, op: dict) -> dict:
        """A file becomes a model file (``model`` = {"dir", "start"}: its tensors' bytes now
        live in directory ``dir``, it keeps its first ``start`` bytes: the node drops its
        stripes past them, node.py) or stops being one (``model`` None), in one op, so no reader
        sees the one without the other."""
        node = self.inode(op["ino"])
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
            if not (isinstance(d, int) and d in self.entries and isinstance(start, int) and 0 < start <= node["size"]):
                raise _err("EINVAL", f"bad model record {model!r}")
            node["xattrs"][MODEL_XATTR] = json.dumps(model)
            if node.get("stripes") is not None and node["unit"]:  # the stripes past ``start`` go
                node["stripes"] = held.cut(node["stripes"], -(-start // node["unit"]))
        node["ctime_ns"] = op["now"]
        return self.attr(op["ino"])

    def _op_settensor(self, op: dict) -> dict:
        """Record what the file's .npy header says (or None: not a tensor)."""
        node = self.inode(op["ino"])
        if S.S_ISDIR(node["mode"]):
            raise _err("EISDIR", "a directory is not a tensor")
        packed = packing.in_force(node)  # (the same header again: ``buckets.guard`` let it through)
        node["tensor"] = dict(op["tensor"], bucket=packed) if packed else op["tensor"]
        return self.attr(op["ino"])

    def check_snapshot_name(self, name: str) -> None:
        check_name(name)
        if name in self.snapshots:
            raise _err("EEXIST", f"snapshot {name!r} exists")

    def _op_snapshot(self, op: dict) -> dict:
        self.check_snapshot_name(op["name"])
        self.snapshots[op["name"]] = {
            "id": op["id"],
            "time_ns": op["now"],
            "inodes": copy.deepcopy({str(k): v for k, v in self.inodes.items()}),
            "entries": copy.deepcopy({str(k): v for k, v in self.entries.items()}),
        }
        self.next_snap = max(self.next_snap, op["id"] + 1)
        return {"id": op["id"], "time_ns": op["now"]}

    def _op_unsnapshot(self, op: dict) -> dict:
        snap = self.snapshots.pop(op["name"], None)
        if snap is None:
            raise _err("ENOENT", f"no snapshot {op['name']!r}")
        self._views.pop(snap["id"], None)
        return {"id": snap["id"]}

    def _op_setxattr(self, op: dict) -> dict:
        if op["name"] == MODEL_XATTR:  # only setmodel records it, with the drop of the stripes
            raise _err("EPERM", f"{MODEL_XATTR} is kept by the file system")
        if op["name"] in POLICIES and op.get("value") is not None:
            # checked when set, by any client, with the parser the training path reads it with
            # (the mount checks first and logs why: fs/live.py check_xattr)
            try:
                check_policy(op["name"], op["value"])
            except PolicyError as exc:
                raise _err("EINVAL", f"{op['name']}: {exc}") from None
        node = self.inode(op["ino"])
        if op.get("value") is None:
            if op["name"] not in node["xattrs"]:
                raise _err("ENODATA", f"no attribute {op['name']!r}")
            del node["xattrs"][op["name"]]
        else:
            node["xattrs"][op["name"]] = op["value"]
        node["ctime_ns"] = op["now"]
        return {}

    def _op_trim(self, op: dict) -> dict:
        """Of the stripes ``[[idx, tag, version], ...]`` of file ``ino``, those past the file's
        end now, in the namespace's order: every node then drops its copy of each if its stamp
        is still (tag, version) or older (server/namespace.py; the stripe's primary sends it:
        server/tails.py). Ordered with the extends, a stripe a write has grown the file over
        since is not among them, and one written again since has a newer stamp: neither is
        dropped. The trimmed stripes leave the file's runs of written stripes (held.py): a
        later grow makes them holes, not lost."""
        node = self.inode(op["ino"])
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

    def _op_cacher(self, op: dict) -> dict:
        """A mount recorded as one that may cache names (on), or dropped from the record."""
        (self.cachers.add if op["on"] else self.cachers.discard)(op["owner"])
        return {}
