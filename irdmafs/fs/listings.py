"""Whole directory listings this mount keeps while it holds its name lease (namelease.py), so a
walk over many names of one directory (``stat`` of every file, ``find``, ``rsync`` comparing
sizes and times) asks the cluster once for the directory, not once per name.

A directory is listed after ``LIST_AFTER`` lookups in it went to the metadata primary; from then
on a lookup or a ``getattr`` of a name it holds is answered from the listing. A name missing
from it still goes to the primary (a model file's tensor directory, a view, a name created
since: never "not found" from here).

Kept exact the way the kernel's cache is (docs/caching.md): every invalidation the lease brings
drops the listings it touches (the directory changed, or an inode in it: ``drop``); a change
of this mount's own drops them all (``clear``: the primary tells a changer nothing, C5); and
a listing whose fetch began before any drop is not kept (``begin``/``keep``: C3). The caller
answers from a listing only while the lease holds (``NameLease.holds``); a lease that lapsed
or came back new drops them all.
"""

from __future__ import annotations

from typing import Iterable

LIST_AFTER = 3  # lookups of one directory sent to the primary before it is listed whole
MAX_DIRS = 64  # directories listed at once (the oldest listing goes first)
MAX_ENTRIES = 50_000  # a directory with more is never listed for lookups
MAX_ASKED = 10_000  # directories whose lookups are counted; beyond, the counts start again


class Listings:
    def __init__(self) -> None:
        self._dirs: dict[int, dict[str, dict]] = {}  # directory -> name -> attributes
        self._where: dict[int, set[int]] = {}  # inode -> directories whose listing holds it
        self._attrs: dict[int, dict] = {}  # inode -> its attributes as listed
        self._asked: dict[int, int] = {}  # directory -> lookups sent to the primary since listed
        self.epoch = 0  # drops so far (C3)
        self.hits = 0  # lookups and getattrs answered from a listing

    def begin(self) -> int:
        """Called as a listing's fetch begins: what ``keep`` takes."""
        return self.epoch

    def entry(self, parent: int, name: str) -> dict | None:
        """``name``'s attributes if ``parent`` is listed and holds it; else None (ask)."""
        attr = self._dirs.get(parent, {}).get(name)
        if attr is not None:
            self.hits += 1
        return attr

    def attr(self, ino: int) -> dict | None:
        """Inode ``ino``'s attributes from any listing that holds it; else None."""
        attr = self._attrs.get(ino)
        if attr is not None:
            self.hits += 1
        return attr

    def asked(self, parent: int) -> bool:
        """A lookup in ``parent`` went to the primary: True when it is time to list it whole."""
        if parent in self._dirs:
            return False
        if len(self._asked) >= MAX_ASKED and parent not in self._asked:
            self._asked.clear()  # a walk over many directories, one lookup in each: bounded
        self._asked[parent] = n = self._asked.get(parent, 0) + 1
        return n >= LIST_AFTER

    def keep(self, parent: int, entries: list[tuple[str, dict]], begun: int) -> None:
        """A listing of ``parent`` fetched since ``begun``: kept unless something was dropped
        meanwhile (it may predate that change) or it is too big."""
        if begun != self.epoch or len(entries) > MAX_ENTRIES:
            return
        self._forget(parent)
        if len(self._dirs) >= MAX_DIRS:
            self._forget(next(iter(self._dirs)))
        self._dirs[parent] = dict(entries)
        self._asked.pop(parent, None)
        for _, attr in entries:
            self._where.setdefault(attr["ino"], set()).add(parent)
            self._attrs[attr["ino"]] = attr

    def drop(self, entries: Iterable[tuple[int, str]], inodes: Iterable[int], everything: bool = False) -> None:
        """What an invalidation touched: the directories named, those listing an inode named,
        and an inode's own listing if it is a directory; with ``everything``, all."""
        self.epoch += 1
        if everything:
            self.clear()
            return
        gone = {parent for parent, _ in entries}
        for ino in inodes:
            gone.add(ino)
            gone |= self._where.get(ino, set())
        for parent in gone:
            self._forget(parent)

    def clear(self) -> None:
        self.epoch += 1
        self._dirs.clear()
        self._where.clear()
        self._attrs.clear()
        self._asked.clear()

    def _forget(self, parent: int) -> None:
        for attr in self._dirs.pop(parent, {}).values():
            where = self._where.get(attr["ino"])
            if where is not None:
                where.discard(parent)
                if not where:
                    del self._where[attr["ino"]]
                    self._attrs.pop(attr["ino"], None)
