"""``NodeCore``: what every service of one PS node shares, handed to each as one value."""

from __future__ import annotations

from typing import NamedTuple

from ..runtime.cluster import Cluster
from ..config import ClusterConfig
from .locks import KeyedLocks
from .serving import Serving
from .store import Store


class NodeCore(NamedTuple):
    """A node's name and config, its view of the cluster, its stripes, their locks, and whether
    it serves now."""

    name: str
    cfg: ClusterConfig
    cluster: Cluster
    store: Store
    locks: KeyedLocks
    serving: Serving
