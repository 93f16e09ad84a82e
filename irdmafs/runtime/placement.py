"""Where data lives: a pure function, computed alike by every client and node with no lookup.

Rendezvous (highest-random-weight) hashing: every node gets a score for a key, and the key lives
on the nodes with the highest scores. Adding or removing one of N nodes moves only the keys whose
top set that node enters or leaves (about 1/N of them), and every node holding a key agrees on the
order of its replicas, whose first live member is the primary.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Iterable, Sequence


def score(key: str, node: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{node}".encode(), digest_size=8).digest(), "little")


def stripe_key(file_id: int, stripe: int) -> str:
    return f"{file_id}:{stripe}"


def rank(key: str, nodes: Iterable[str]) -> list[str]:
    """Every node, best home for ``key`` first."""
    return list(_ranked(key, tuple(nodes)))


@functools.lru_cache(maxsize=1 << 16)
def _ranked(key: str, nodes: tuple[str, ...]) -> tuple[str, ...]:
    # asked for every stripe of every push and pull: a step's hundreds of hashes, once
    return tuple(sorted(nodes, key=lambda n: (score(key, n), n), reverse=True))


def placement(file_id: int, stripe: int, nodes: Sequence[str], replicas: int) -> list[str]:
    """The ``replicas`` distinct nodes (fewer if fewer exist) that hold stripe ``stripe`` of
    ``file_id`` among ``nodes``; the first is the primary."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    return rank(stripe_key(file_id, stripe), nodes)[:replicas]
