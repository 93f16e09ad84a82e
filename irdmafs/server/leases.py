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

Without a coordinator ``holds()`` is always true, and the heartbeat rules of membership.py alone
decide. Views do not yet choose primaries or stamp messages with their epoch (issue 20's next
steps): heartbeats still choose primaries, inside the set of nodes that hold their leases.
"""

from __future__ import annotations

import hashlib
import logging
import math

import trio

from ..config import ClusterConfig
from ..coord.contract import CoordError
from ..coord.etcd import EtcdCoord
from ..coord.views import ViewKeeper

log = logging.getLogger(__name__)


def cluster_id(cfg: ClusterConfig) -> str:
    """The name a cluster's keys live under in a shared etcd: from its token, which its members
    share and nobody else has (hashed: the token itself never leaves the cluster)."""
    return hashlib.sha256(b"irdmafs-cluster\0" + cfg.token).hexdigest()[:16]


def lease_ttl(cfg: ClusterConfig) -> int:
    """Whole seconds (etcd's unit), at least 2 (etcd 3.4 lengthens shorter ones to 2)."""
    return max(2, math.ceil(cfg.down_after))


class ServingLease:
    """A node's lease and view, or nothing to check when the config names no coordinator."""

    def __init__(self, cfg: ClusterConfig, name: str):
        self.name = name
        self.keeper = None
        if cfg.coordinator:
            coord = EtcdCoord(cfg.coordinator, timeout=max(0.5, cfg.down_after / 2))
            self.keeper = ViewKeeper(coord, cluster_id(cfg), name, lambda: cfg.names, ttl=lease_ttl(cfg))

    async def run(self) -> None:
        """Keep the lease and read (and propose) views, until cancelled."""
        if self.keeper is not None:
            await self.keeper.run()

    def holds(self) -> bool:
        """May this node serve: its lease held and the newest view naming it with it."""
        return self.keeper is None or self.keeper.serving()

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

    def status(self) -> dict:
        """For heartbeats and ``irdmafs status``."""
        k = self.keeper
        if k is None:
            return {"coordinator": "none"}
        since = k.reader.unreachable_since
        reach = "reachable" if since == math.inf else f"UNREACHABLE for {trio.current_time() - since:.1f} s"
        return {"coordinator": reach, "view": k.view.epoch, "view_serving": list(k.view.names), "lease_held": k.lease.held(), "in_view": k.serving()}
