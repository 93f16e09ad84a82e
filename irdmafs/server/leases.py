"""Whether a node may serve, by its lease and view in the coordination service (coord/views.py).

With ``coordinator`` in the config (``irdmafs up`` starts a local etcd and names it), a node serves
only while it holds its etcd lease and the newest view it has read names it with that lease:

- at start and after every fence it resyncs, then announces itself and waits until a view names
  it, and only then turns ready (``Membership.join``);
- it fences at once when that stops being true: its lease ran out (etcd unreachable for the
  lease's TTL, the process stopped, the lease revoked). Checked before every heartbeat answer,
  before every call that needs it ready, and by its fence ticker (``Serving.check_lease``);
- it rejoins only while it holds a lease: while etcd is unreachable, nodes serve until their
  leases end and then wait, and no new view is made; heartbeats and ``irdmafs status`` say so.

The views also choose every stripe's primary and replicas (runtime/roles.py), and every message that
changes data carries its sender's view epoch (serving.py, ``check_epoch``). A config always
names a coordinator (config.py); ``keeper`` is None only for a node built without one, which
refuses to start (node.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Callable

import trio

from ..config import ClusterConfig, Members
from ..coord.contract import Coordinator
from ..errors import CoordError
from ..coord.etcd import EtcdCoord
from ..coord.views import View, ViewKeeper

log = logging.getLogger(__name__)


def cluster_id(cfg: ClusterConfig) -> str:
    """The name a cluster's keys live under in a shared etcd: from its token, which its members
    share and nobody else has (hashed: the token itself never leaves the cluster)."""
    return hashlib.sha256(b"irdmafs-cluster\0" + cfg.token).hexdigest()[:16]


def lease_ttl(cfg: ClusterConfig) -> int:
    """The config's ``lease_ttl`` (10 s unless set) in whole seconds (etcd's unit), at least 2
    (etcd 3.4 lengthens shorter ones to 2). Nodes ride out an etcd outage (a restart, a stall)
    shorter than this; it does not slow down failover, which expulsions do (coord/views.py V6,
    server/membership.py): it was ``down_after`` rounded up, and a 3-second etcd restart in the
    chaos soak fenced every node."""
    return max(2, math.ceil(cfg.lease_ttl))


class ServingLease:
    """A node's lease and view, or nothing to check when the config names no coordinator."""

    def __init__(self, cfg: ClusterConfig, name: str, members: Callable[[], Members], coord: Coordinator | None = None):
        """``members``: the membership views may name, as it is now (a rebalance replaces
        it); ``coord``: the coordination service, if not the config's etcd (tests, the simulator)."""
        self.name = name
        self.keeper = None
        if coord is None and cfg.coordinator:
            coord = EtcdCoord(cfg.coordinator, timeout=lease_ttl(cfg) / 2)  # a slow etcd (fsync under load) is no outage
        if coord is not None:
            self.keeper = ViewKeeper(coord, cluster_id(cfg), name, members, ttl=lease_ttl(cfg))

    async def run(self) -> None:
        """Keep the lease and read (and propose) views, until cancelled."""
        if self.keeper is not None:
            await self.keeper.run()

    def holds(self) -> bool:
        """May this node serve: its lease held and the newest view naming it with it."""
        return self.keeper is None or self.keeper.serving()

    def term(self) -> int:
        """The lease this node serves under (0 before it took one): a view names a node that
        comes back with a new one."""
        return self.keeper.lease.id if self.keeper is not None else 0

    def left(self) -> float:
        """Seconds this node may still serve by its lease's own clock (V3; inf without a
        coordinator, 0 when it may not serve now)."""
        if self.keeper is None:
            return math.inf
        if not self.keeper.serving():
            return 0.0
        return max(0.0, self.keeper.lease.until - trio.current_time())

    def may_rejoin(self) -> bool:
        return self.keeper is None or self.keeper.lease.held()

    def why_not(self) -> str:
        k = self.keeper
        if k is None or k.serving():
            return ""
        if not k.lease.held():
            return "its coordination lease ended" + (" (coordinator unreachable)" if k.reader.unreachable_since < math.inf else "")
        return f"view {k.view.epoch} does not name it with lease {k.lease.id:x}"

    async def announce(self) -> None:
        """Say this node is alive (after its resync) and wait until a view names it."""
        k = self.keeper
        if k is None:
            return
        said = False
        while not k.serving():
            if k.lease.held() and not k.announced:
                try:
                    await k.announce()
                except CoordError as exc:
                    if not said:
                        log.warning("node %s not announced yet: %s", self.name, exc)
                        said = True
            await trio.sleep(k.interval / 2)
        log.info("node %s serves in view %d", self.name, k.view.epoch)

    def follow(self, learn_here: Callable[[View], None]) -> Callable[[View], None] | None:
        """Views this node's keeper learns go to ``learn_here`` too; returns where views learnt
        elsewhere (peers' heartbeats) go for the keeper to hold them, or None without one."""
        if self.keeper is None:
            return None
        self.keeper.reader.on_view.append(learn_here)
        return self.keeper.reader.learn

    async def refresh(self) -> None:
        """Read the newest view now (a message came from a newer epoch than this node knows)."""
        if self.keeper is not None:
            try:
                await self.keeper.reader.read()
            except CoordError as exc:
                log.info("node %s: view not read: %s", self.name, exc)

    async def expel(self, peer: str) -> bool:
        """Commit a view that expels ``peer`` (coord/views.py, V6); False if that did not happen
        (this node does not serve, another view came first, the coordinator is unreachable)."""
        if self.keeper is None:
            return False
        try:
            return await self.keeper.expel(peer)
        except CoordError as exc:
            log.warning("node %s: %s not expelled: %s", self.name, peer, exc)
            return False

    def status(self) -> dict:
        """For heartbeats and ``irdmafs status``."""
        k = self.keeper
        if k is None:
            return {"coordinator": "none"}
        since = k.reader.unreachable_since
        reach = "reachable" if since == math.inf else f"UNREACHABLE for {trio.current_time() - since:.1f} s"
        view = k.view
        return {
            "coordinator": reach,
            "view": view.epoch,
            "view_serving": dict(view.serving),
            "view_expelled": list(view.expelled),
            "lease_held": k.lease.held(),
            "in_view": k.serving(),
        }
