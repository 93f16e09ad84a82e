"""The namespace's snapshots: frozen copies of its tables, by name, and the views that read them.

``Snapshots`` owns the records (name -> {"id", "time_ns", "inodes", "entries"}, the tables as
the ``snapshot`` op froze them, JSON's string keys kept), the next snapshot id, and the views
built from them (a ``Tree`` each, built once and dropped with its snapshot). The ``snapshot``
and ``unsnapshot`` ops change them (nsops.py); ``Meta.snapshot`` persists them as they are.
The stripes a snapshot freezes are the store's (store.py), taken by namespace.py's
coordinator. Pure: no I/O, no trio.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import RemoteError
from .tree import Tree, check_name


class Snapshots:
    def __init__(self) -> None:
        # name -> {"id", "time_ns", "inodes", "entries"}: frozen copies of the namespace
        self.table: dict[str, dict[str, Any]] = {}
        self.next_id = 1
        self._views: dict[int, Tree] = {}

    def ids(self) -> dict[str, int]:
        return {name: s["id"] for name, s in self.table.items()}

    def view(self, snap: int) -> Tree:
        """The tables as snapshot ``snap`` froze them; ENOENT if there is none."""
        if snap not in self._views:
            for s in self.table.values():
                if s["id"] == snap:
                    v = Tree()
                    v.inodes = {int(k): n for k, n in s["inodes"].items()}
                    v.entries = {int(k): dict(e) for k, e in s["entries"].items()}
                    self._views[snap] = v
                    break
            else:
                raise RemoteError("ENOENT", f"no snapshot {snap}")
        return self._views[snap]

    def check_name(self, name: str) -> None:
        check_name(name)
        if name in self.table:
            raise RemoteError("EEXIST", f"snapshot {name!r} exists")

    def take(self, op: dict, tree: Tree) -> dict:
        """The ``snapshot`` op: ``tree`` frozen under ``op``'s name and id."""
        self.check_name(op["name"])
        self.table[op["name"]] = {
            "id": op["id"],
            "time_ns": op["now"],
            "inodes": copy.deepcopy({str(k): v for k, v in tree.inodes.items()}),
            "entries": copy.deepcopy({str(k): v for k, v in tree.entries.items()}),
        }
        self.next_id = max(self.next_id, op["id"] + 1)
        return {"id": op["id"], "time_ns": op["now"]}

    def drop(self, name: str) -> dict:
        """The ``unsnapshot`` op: snapshot ``name`` and its view go."""
        snap = self.table.pop(name, None)
        if snap is None:
            raise RemoteError("ENOENT", f"no snapshot {name!r}")
        self._views.pop(snap["id"], None)
        return {"id": snap["id"]}
