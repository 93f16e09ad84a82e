"""The namespace: inodes and directory entries, as a deterministic state machine.

The metadata primary (the first ready node in config order) decides everything that is not
deterministic (new inode numbers, timestamps) and writes it into the op; every node then applies
the same ops in the same order (``seq``), so every node holds the same namespace. A PS namespace
is small (hundreds of tensors), so replicating it to every node is cheap and lets any node take
over as primary.

``Meta`` owns the op log's state (the stamp, the results kept for retries, the mounts that may
cache names) and holds the parts, each with its own state: the tables (``tree``: tree.py), the
snapshots (``frozen``: snapshots.py) and the truncates' cuts (``cuts``: ``Cuts`` here); what each
op does is nsops.py's. Reads of the live namespace are its tree's, forwarded here for the
callers that read the namespace itself.

Errors are ``RemoteError`` with an errno name, which the file system maps straight to its errno.
Pure: no I/O, no trio.
"""

from __future__ import annotations

import copy
from typing import Any

from .. import held
from ..errors import RemoteError
from ..names import ROOT
from ..regions import VERSION_SHIFT
from . import buckets, nsops
from .nsops import LINK_MAX  # noqa: F401 (tests import it from here)
from .snapshots import Snapshots
from .tree import Tree


def _err(code: str, msg: str) -> RemoteError:
    return RemoteError(code, msg)


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
    "writing": {"ino": int, "writer": str},  # a mount's first change of a file it did not create or truncate (nsops.py, W1)
    "written": {"ino": int, "writer": str},  # that mount's last writable handle of the file released (W2)
}
OP_OPTIONAL: dict[str, dict[str, Any]] = {
    "create": {"target": str, "unit": int, "rdev": int, "writer": str, **_NAMING},  # writer: opened to be written (W1)
    "mkdir": dict(_NAMING),
    "setxattr": {"value": (str, type(None))},
    "setattr": {"writer": str},  # an O_TRUNC open's or an ftruncate's size, by that writer (W1)
    "extend": {"stripes": list, "made": int},  # the runs of stripes the write wrote (held.py), the oldest's version
}


class Cuts:
    """The truncates that freed a file's stripes: file -> [[seq, idx], ...], the op's seq and the
    first index it freed (a stripe made since has a higher version base: datapath.VERSION_SHIFT);
    a node that takes a namespace whole drops what they freed (Namespace.restore). A later cut
    at a lower index replaces the earlier ones it covers."""

    def __init__(self) -> None:
        self.table: dict[int, list[list[int]]] = {}

    def truncated(self, ino: int, seq: int, cut: int) -> None:
        """Op ``seq`` freed file ``ino``'s stripes from ``cut`` on."""
        self.table[ino] = [c for c in self.table.get(ino, []) if c[1] < cut] + [[seq, cut]]

    def forget(self, ino: int) -> None:
        """File ``ino`` is gone."""
        self.table.pop(ino, None)

    def missed(self, ino: int, runs: list, made: int | None) -> list:
        """``runs`` (held.py) of file ``ino`` without the stripes a truncate since the oldest of
        them was made (version ``made``; None: unknown, every truncate) dropped."""
        for seq, cut in self.table.get(ino, ()):
            if made is None or made < seq << VERSION_SHIFT:
                runs = held.cut(runs, cut)
        return runs


class Meta:
    def __init__(self) -> None:
        self.seq = 0
        self.tag = 0  # the view epoch the last op was applied in (0: no views)
        self.tree = Tree()  # inodes, entries, the next inode number
        self.cuts = Cuts()  # the truncates' cuts, by file
        self.frozen = Snapshots()  # the snapshots: frozen copies of the tree, by name
        # request id -> result of the newest DONE_KEPT ops that carried one: a client retrying
        # an op whose answer it lost (its primary died after forwarding it) gets that answer
        # again instead of the op applied twice (a second mkdir would say EEXIST). Applied on
        # every node in the same order, so whichever node is primary next knows it.
        self.done: dict[str, dict] = {}
        # the mounts that took a cache lease and may still hold one: a new metadata primary
        # waits out a lease before it changes anything while any is recorded (namecache.py)
        self.cachers: set[str] = set()

    # -- reading: the live tree's (tree.py), forwarded -------------------------------------------
    @property
    def inodes(self) -> dict[int, dict[str, Any]]:
        return self.tree.inodes

    @property
    def entries(self) -> dict[int, dict[str, int]]:
        return self.tree.entries

    @property
    def snapshots(self) -> dict[str, dict[str, Any]]:
        """name -> {"id", "time_ns", "inodes", "entries"} (snapshots.py)."""
        return self.frozen.table

    def inode(self, ino: int) -> dict:
        return self.tree.inode(ino)

    def directory(self, ino: int) -> dict[str, int]:
        return self.tree.directory(ino)

    def lookup(self, parent: int, name: str) -> dict:
        return self.tree.lookup(parent, name)

    def attr(self, ino: int) -> dict:
        return self.tree.attr(ino)

    def written(self, ino: int, idx: int) -> bool | None:
        return self.tree.written(ino, idx)

    def files(self) -> set[int]:
        return self.tree.files()

    def inherited_xattrs(self, ino: int) -> dict[str, str]:
        return self.tree.inherited_xattrs(ino)

    def view(self, snap: int) -> Tree:
        """The namespace's tables as they are (snap 0) or as snapshot ``snap`` froze them."""
        return self.tree if snap == 0 else self.frozen.view(snap)

    def snapshot_ids(self) -> dict[str, int]:
        return self.frozen.ids()

    @property
    def stamp(self) -> tuple[int, int]:
        """(epoch, seq) of the last op: one primary per epoch numbers ops, so two namespaces at
        one stamp went through the same ops, and of two stamps the greater is the newer."""
        return self.tag, self.seq

    def snapshot(self) -> dict:
        return {
            "seq": self.seq,
            "tag": self.tag,
            "next_ino": self.tree.next_ino,
            "next_snap": self.frozen.next_id,
            "inodes": {str(k): v for k, v in self.tree.inodes.items()},
            "entries": {str(k): v for k, v in self.tree.entries.items()},
            "snapshots": self.frozen.table,
            "done": self.done,
            "cuts": {str(k): v for k, v in self.cuts.table.items()},
            "cachers": sorted(self.cachers),
        }

    @classmethod
    def restore(cls, snap: dict) -> "Meta":
        m = cls()
        m.seq = snap["seq"]
        m.tag = snap.get("tag", 0)
        m.tree.next_ino = snap["next_ino"]
        m.frozen.next_id = snap.get("next_snap", 1)
        m.tree.inodes = {int(k): v for k, v in snap["inodes"].items()}
        m.tree.entries = {int(k): dict(v) for k, v in snap["entries"].items()}
        m.frozen.table = copy.deepcopy(snap.get("snapshots", {}))
        m.done = dict(snap.get("done", {}))
        m.cuts.table = {int(k): [list(c) for c in v] for k, v in snap.get("cuts", {}).items()}
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
            elif not isinstance(op[key], want) or type(op[key]) is bool and bool not in (want if isinstance(want, tuple) else (want,)):
                raise _err("EINVAL", f"{kind}: {key!r} is a {type(op[key]).__name__}")  # (True is an int to isinstance, not here)
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
            op["ino"] = self.tree.next_ino
        if op["op"] == "snapshot":
            op["id"] = self.frozen.next_id
        return op

    # -- everyone's side ---------------------------------------------------------------------
    def apply(self, op: dict) -> dict:
        """Apply one op; returns its result. Raises RemoteError and changes nothing if invalid.
        Every op is validated before any state changes, so a refused op leaves no trace."""
        self.check(op)
        buckets.guard(self, op)
        result = nsops.APPLY[op["op"]](self, op)
        self.seq += 1
        root = self.tree.inodes[ROOT]
        if not root["ctime_ns"] and op.get("now"):  # made with the namespace, before any clock: the first op's time
            root["atime_ns"] = root["mtime_ns"] = root["ctime_ns"] = op["now"]
        if op["op"] == "setattr" and "size" in op["attrs"] and self.tree.inodes[op["ino"]]["unit"]:
            self.cuts.truncated(op["ino"], self.seq, -(-op["attrs"]["size"] // self.tree.inodes[op["ino"]]["unit"]))
        if result.get("freed"):
            self.cuts.forget(result["freed"])
        for b in result.get("freed_buckets", ()):
            self.cuts.forget(b)
        if op.get("rid"):
            self.done[op["rid"]] = result
            while len(self.done) > DONE_KEPT:
                del self.done[next(iter(self.done))]
        return result
