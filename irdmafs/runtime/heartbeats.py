"""Heartbeats: how one process hears the nodes. One room of a process's ``Cluster``
(runtime/cluster.py), which hands it the connections (runtime/peers.py), the liveness it feeds (runtime/liveness.py),
the roles whose view it brings (runtime/roles.py), and what to do with a node that does not answer
(``lost``) and with a membership a node says is newer (``adopt``).

A heartbeat's answer carries its node's liveness (it orders a read's replicas, aborts what waits
on a node that stopped answering, and tells a node which peers to expel; it never decides who
serves), its incarnation (runtime/peers.py), the view it holds (a newer one is learnt) and the
membership it works with (a rebalance's new one is fetched and followed when its epoch is
newer). A reply acknowledged in a newer view than the one held brings that view before the call
returns (``follow_acked``).

Concurrency: one trio thread; ``loop`` runs in the nursery its owner gives it.
"""

from __future__ import annotations

import logging
from typing import Callable

import trio

from ..config import ClusterConfig, NodeSpec
from ..coord.views import View
from .liveness import Liveness
from .peers import Peers
from ..errors import NodeDown, RemoteError
from .roles import Roles
from ..util import Shared

log = logging.getLogger(__name__)

STALLED = 0.1  # a heartbeat's timeout seen this late (a share of down_after): this process stalled, ask again


class Heartbeats:
    """Probes of every node, and what their answers teach this process."""

    def __init__(
        self,
        cfg: ClusterConfig,
        peers: Peers,
        liveness: Liveness,
        roles: Roles,
        lost: Callable[[str, str, float | None], None],
        adopt: Callable[[list[NodeSpec], int, int], None],
    ) -> None:
        """``lost(name, why, since)``: a node did not answer a probe sent at ``since``;
        ``adopt(specs, replicas, epoch)``: switch to the membership a node says is newer."""
        self.cfg, self.peers, self.liveness, self.roles = cfg, peers, liveness, roles
        self._lost, self._adopt = lost, adopt
        # sent with every heartbeat: "owner" keeps this process's staging leased (server/node.py)
        self.args: dict = {}
        self.follow_membership = True  # False for a rebalance coordinator, which sets it itself
        self.on_adopt: Callable[[int], None] | None = None
        self._probes = Shared()  # one probe of a node at a time (``refresh``)

    async def _probe(self, name: str) -> None:
        """One heartbeat to ``name``: its answer is what liveness hears; none within down_after
        counts it down. Unless this process's own loop ran late past the deadline (a host that
        did not run it, work that held it): the answer may be in the socket unread, and the
        node's silence is not proven, so it is asked once more (a mount on a busy host counted
        working nodes down and dropped their connections with hundreds of reads in flight;
        issue 41, chaos --model-gib)."""
        args = {"from": self.roles.me or "client", **self.args}
        for attempt in (1, 2):
            sent = trio.current_time()
            deadline = sent + self.cfg.down_after
            try:
                with trio.fail_at(deadline):
                    info, _ = await self.peers.call_on(name, "heartbeat", args, timeout=self.cfg.down_after, probe=True)
                break
            except (NodeDown, trio.TooSlowError, RemoteError) as exc:
                late = trio.current_time() - deadline
                if attempt == 1 and late > STALLED * self.cfg.down_after:
                    log.info("heartbeat to %s: this process ran %.2f s past the deadline: asking again", name, late)
                    continue
                waited = "" if isinstance(exc, RemoteError) else self.peers.waits(name)
                if waited:  # silence on a connection still up: say what it waited on
                    log.warning("heartbeat to %s unanswered in %.2f s (its connection: %s)", name, trio.current_time() - sent, waited)
                self._lost(name, str(exc) or "no heartbeat", sent)
                return
        self.peers.seen(name, info.get("incarnation", 0))
        if info.get("view", 0) > self.roles.view_epoch and isinstance(info.get("view_serving"), dict):
            serving = tuple(sorted((str(n), int(lease)) for n, lease in info["view_serving"].items()))
            self.roles.learn_view(View(info["view"], serving, tuple(sorted(info.get("view_expelled", [])))))
        self.liveness.heard(name, info, sent)
        if self.follow_membership and info.get("epoch", 0) > self.roles.epoch:  # a rebalance switched membership: follow it
            try:
                m, _ = await self.peers.call_on(name, "members")
            except (NodeDown, RemoteError) as exc:
                log.warning("membership %d from %s not fetched: %s", info["epoch"], name, exc)
                return
            if m["epoch"] > self.roles.epoch:
                self._adopt([NodeSpec(n["name"], n["host"], n["port"]) for n in m["nodes"]], m["replicas"], m["epoch"])
                if self.on_adopt is not None:
                    self.on_adopt(m["epoch"])

    async def refresh(self) -> None:
        """Probe every other node once, in parallel; a probe of a node already under way is
        waited for, not sent again (a pull's thousand reads each asking while a node was out
        sent thousands of heartbeats at once, which timed out behind one another and counted
        the working nodes down: chaos --model-gib 2)."""
        async with trio.open_nursery() as n:
            for name in list(self.liveness.state):
                n.start_soon(self._probes.run, name, self._probe, name)

    async def loop(self) -> None:
        """Every node probed each ``heartbeat`` seconds, for as long as the process runs."""
        while True:
            await trio.sleep(self.cfg.heartbeat)
            await self.refresh()

    async def follow_acked(self, reply: object) -> None:
        """A change acknowledged in a newer view than this process holds (a commit, a namespace
        op, a push: their answers say ``acked_in``) is learnt before the caller acts on it: that
        view may have expelled a replica the older one still names, which lacks the change. A
        client that went on by the older view read an acknowledged write back old from it, or
        pushed to it as a stripe's primary a tensor whose creation it never got (ENOENT: chaos
        --views seed 11, a cut of n3). Heartbeats carry the view (``_probe``); asked again a few
        times, never longer than a heartbeat each."""
        acked_in = reply.get("acked_in", 0) if isinstance(reply, dict) else 0
        for _ in range(3):
            if not isinstance(acked_in, int) or acked_in <= self.roles.view_epoch:
                return
            await self.refresh()
            if acked_in > self.roles.view_epoch:
                await trio.sleep(self.cfg.heartbeat)

    async def after_lost(self) -> None:
        """A call to a node failed with NodeDown. Only a new view moves its work (a node that
        cannot be reached is expelled by its peers, coord/views.py V6): wait a heartbeat and ask
        the nodes for their view before trying again."""
        await trio.sleep(self.cfg.heartbeat)
        await self.refresh()
