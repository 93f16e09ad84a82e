"""What irdmafs needs of a coordination service: etcd's v3 contract, as one abstract class.

Two implementations keep it: ``EtcdCoord`` (etcd.py, a real etcd through its v3 JSON gateway) and
``MemoryCoord`` (memory.py, a model for tests and the fault simulator). One conformance suite
(tests/unit/test_coord_contract.py) runs on both, so the model never promises more than etcd does.

The contract:
- A map from string keys to bytes with one global *revision*: every change (put, delete, a lease
  ending) makes the next revision, and every key remembers the revision of its own last change
  (``mod_revision``). Reads and writes are linearizable.
- ``cas(key, expect, value)`` writes only if the key's ``mod_revision`` is ``expect`` (0: the key
  must not exist), in one step: the way a new view is made (views.py), its epoch being the new
  revision.
- Leases: ``grant(ttl)`` gives a lease that ends ``ttl`` seconds after it was granted or last kept
  alive; the keys put with it are deleted when it ends. ``keepalive`` answers the seconds left
  (0: the lease is gone); ``revoke`` ends it now. A put with a lease that is gone raises
  ``LeaseGone``.
- ``Unavailable``: the service could not be reached in time. The caller does not know whether a
  change it asked for happened (a ``cas`` may have); it reads again before acting on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..errors import CoordError, CoordUnavailable as Unavailable, LeaseGone  # noqa: F401 (the same classes)


@dataclass(frozen=True)
class Entry:
    """One key as read: its value, the revision of its last change and the lease it lives by."""

    key: str
    value: bytes
    mod_revision: int
    lease: int = 0


class Coordinator(ABC):
    """A linearizable key-value store with revisions, compare-and-set and leases (etcd's v3)."""

    @abstractmethod
    async def get(self, key: str) -> Entry | None:
        """The key, or None if it does not exist."""

    @abstractmethod
    async def range(self, prefix: str) -> tuple[list[Entry], int]:
        """Every key that starts with ``prefix`` (sorted), and the store's revision at the read."""

    @abstractmethod
    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Set the key; the new revision. LeaseGone if ``lease`` has ended."""

    @abstractmethod
    async def cas(self, key: str, expect: int, value: bytes, lease: int = 0) -> tuple[bool, int]:
        """Set the key if its mod_revision is ``expect`` (0: absent): (whether it did, the
        store's revision after: the key's new mod_revision when it did)."""

    @abstractmethod
    async def create_all(self, entries: dict[str, bytes]) -> tuple[bool, int]:
        """Put every key, in one step, only if none of them exists: (whether it did, the store's
        revision after). What a namespace kept here would need for a create."""

    @abstractmethod
    async def delete(self, key: str) -> int:
        """Remove the key if it exists; the store's revision after."""

    @abstractmethod
    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds (at least 1); its id."""

    @abstractmethod
    async def keepalive(self, lease: int) -> int:
        """Renew the lease for its full TTL; the seconds it now has, or 0 if it has ended."""

    @abstractmethod
    async def revoke(self, lease: int) -> None:
        """End the lease now (its keys are deleted); nothing if it has ended already."""

    async def aclose(self) -> None:
        """Release what the client holds (connections); the store itself is untouched."""
