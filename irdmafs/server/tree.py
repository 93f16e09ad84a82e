"""The namespace's tables: inodes by number, each directory's entries, and the next inode number.

A ``Tree`` owns ``inodes``, ``entries`` and ``next_ino``, and answers every read of them
(lookups, attributes, listings, the user.irdma.* attributes a file inherits, which stripes of a
file hold written bytes: held.py), with the few table steps the ops are made of (a new inode, a
directory's times, a child looked up, an ancestor test). The live namespace's tree is
``Meta.tree``, which the ops change (nsops.py); a snapshot's view is a tree of its frozen
tables (snapshots.py). Pure: no I/O, no trio.
"""

from __future__ import annotations

import json
import stat as S
from typing import Any

from .. import held
from ..errors import RemoteError
from ..names import MODEL_SUFFIX, MODEL_XATTR, NAME_MAX, ROOT


def _err(code: str, msg: str) -> RemoteError:
    return RemoteError(code, msg)


def check_name(name: str) -> None:
    """EINVAL or ENAMETOOLONG unless ``name`` may name an entry (or a snapshot)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise _err("EINVAL", f"invalid name {name!r}")
    if len(name.encode(errors="surrogateescape")) > NAME_MAX:
        raise _err("ENAMETOOLONG", f"name longer than {NAME_MAX} bytes")


class Tree:
    def __init__(self) -> None:
        self.next_ino = ROOT + 1
        self.inodes: dict[int, dict[str, Any]] = {}
        self.entries: dict[int, dict[str, int]] = {}
        self.new_inode(ROOT, S.S_IFDIR | 0o755, 0, 0, 0, 0)

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
        tensors: one call for what the mount would otherwise ask twice), or, where that file
        is plain bytes still, its own attributes marked ``unconverted`` (the mount makes it a
        model where it is first wanted as one, fs/models.py)."""
        try:
            return self.lookup(parent, name)
        except RemoteError as exc:
            if exc.code != "ENOENT" or name.endswith(MODEL_SUFFIX):
                raise
            ino = self.directory(parent).get(name + MODEL_SUFFIX)
            if ino is None:
                raise
            d = self.model_dir(self.inodes[ino])
            if d is not None:
                return dict(self.attr(d), alias_of=ino)
            if not S.S_ISREG(self.inodes[ino]["mode"]):
                raise
            return dict(self.attr(ino), unconverted=True)

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

    def files_in(self, parent: int) -> list[tuple[int, int, int]]:
        """(file id, size, stripe unit) of each regular file in directory ``parent`` (none if it
        is not one: the op is refused when applied), for a new file's number (allocation.py)."""
        try:
            children = self.directory(parent).values()
        except RemoteError:
            return []
        nodes = (self.inodes.get(ino) for ino in children)
        return [(ino, n["size"], n["unit"]) for ino, n in zip(children, nodes) if n is not None and n.get("unit") and S.S_ISREG(n["mode"])]

    # -- the steps the ops are made of (nsops.py) ----------------------------------------------
    def new_inode(self, ino: int, mode: int, uid: int, gid: int, now: int, unit: int) -> dict:
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

    def touch_dir(self, ino: int, now: int) -> None:
        d = self.inodes[ino]
        d["mtime_ns"] = d["ctime_ns"] = now

    def child(self, parent: int, name: str) -> tuple[dict[str, int], int]:
        """(entries of ``parent``, inode of ``name`` in it); ENOENT if there is none."""
        entries = self.directory(parent)
        ino = entries.get(name)
        if ino is None:
            raise _err("ENOENT", f"{name!r} not found")
        return entries, ino

    def is_ancestor(self, maybe_ancestor: int, ino: int) -> bool:
        # Directories have one parent; walk down from maybe_ancestor looking for ino.
        stack = [maybe_ancestor]
        while stack:
            cur = stack.pop()
            if cur == ino:
                return True
            stack.extend(c for c in self.entries.get(cur, {}).values() if c in self.entries)
        return False
