"""Keyed locks: one ``trio.Lock`` per key (a stripe, the namespace), made on first use and
dropped when nobody holds or waits for it. A node orders everything that changes one stripe
(commits, applies, pushes, hand-overs) by that stripe's lock."""

from __future__ import annotations

from typing import Any

import trio


class KeyedLocks:
    """One trio.Lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[Any, list] = {}

    def __call__(self, key: Any) -> "_KeyedLock":
        return _KeyedLock(self, key)

    def busy(self) -> list:
        """The keys someone holds or waits for."""
        return list(self._locks)


class _KeyedLock:
    def __init__(self, owner: KeyedLocks, key: Any):
        self.owner, self.key = owner, key

    async def __aenter__(self) -> None:
        entry = self.owner._locks.setdefault(self.key, [trio.Lock(), 0])
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._release_ref(entry)
            raise

    async def __aexit__(self, *exc: object) -> None:
        entry = self.owner._locks[self.key]
        entry[0].release()
        self._release_ref(entry)

    def _release_ref(self, entry: list) -> None:
        entry[1] -= 1
        if entry[1] == 0:
            del self.owner._locks[self.key]
