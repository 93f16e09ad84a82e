"""What this mount's lookups just fetched, for the open that follows.

An open by a path the kernel does not hold looks its name up first (names are cached only under
the name lease: namelease.py), and the kernel sends the open right after. What that lookup fetched (a file's attributes, a safetensors view's
layout) is as fresh as the open's own call for it would be, so the open takes it instead of
asking again: a metadata round trip per open, a listing of every tensor for a view.

An entry serves for ``FRESH`` seconds, once, and only if this mount changed nothing since the
lookup began: the VFS reports each change it makes (``changed``), which drops every entry and
refuses the notes of lookups that began before it. A change of this mount completed between a
lookup and its open (a flush that made the file a model, a truncate) is then never missed. An
open by another way than a path walk (a reopen through /proc/self/fd) within ``FRESH`` of a
lookup takes that lookup's attributes too: another mount's change in between is seen at the
next open, as with the kernel's attribute cache.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import trio


class Lookups:
    FRESH = 0.2  # seconds
    KEEP = 256  # entries kept at most (lookups with no open: stat, ls -l); beyond, none are

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        """``on_change``: what else goes at each change (the mount's listings: listings.py)."""
        self._seen: dict[Hashable, tuple[float, Any]] = {}
        self.changes = 0  # changes this mount made so far
        self._on_change = on_change

    def changed(self) -> None:
        """This mount changed something (the VFS calls it after each change it makes)."""
        self.told()
        self._on_change()

    def told(self) -> None:
        """Another mount changed something (the name lease's invalidations): every note goes."""
        self.changes += 1
        self._seen.clear()

    def begin(self) -> int:
        """Called as a lookup begins: what ``note`` takes as ``begun``."""
        return self.changes

    def note(self, key: Hashable, value: Any, begun: int) -> None:
        """What a lookup that began at ``begun`` fetched, for an open that follows it."""
        if begun != self.changes:
            return  # a change of this mount came meanwhile: the value may predate it
        now = trio.current_time()
        if len(self._seen) >= self.KEEP:
            self._seen = {k: e for k, e in self._seen.items() if now - e[0] < self.FRESH}
            if len(self._seen) >= self.KEEP:
                self._seen.clear()  # a burst of lookups (ls -l): none kept, none swept again each time
        self._seen[key] = (now, value)

    def take(self, key: Hashable) -> Any | None:
        """The value a lookup noted for ``key``, if it is still good; at most once."""
        seen = self._seen.pop(key, None)
        return seen[1] if seen is not None and trio.current_time() - seen[0] < self.FRESH else None
