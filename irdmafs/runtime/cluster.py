"""One process's view of the cluster, as rooms of their own that this class puts together:

- the roles (runtime/roles.py): the view in force and the membership, and who serves what under them
  (the metadata primary, a stripe's primary, where a write lands, whom a read asks);
- the connections, calls and one-sided I/O (runtime/peers.py);
- the liveness heartbeats keep (runtime/liveness.py: it orders a read's replicas and aborts what waits
  on a node that stopped answering; it never decides who serves);
- the heartbeats (runtime/heartbeats.py), which bring views, incarnations and memberships.

Nodes and clients both hold a ``Cluster``. It runs the heartbeats (``heartbeats.loop``) and
makes the calls whose answers may bring a newer view (``call``, ``write_imm``: a reply
acknowledged in a newer view than the one held brings that view before the call returns), and
the membership switch, which touches every room (``adopt``). No room reaches into another:
each is handed what it needs of the others here.

Concurrency: one trio thread; the heartbeat task runs in the nursery given to the constructor.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import trio

from ..config import ClusterConfig, Members, NodeSpec
from .heartbeats import Heartbeats
from .liveness import DOWN, READY, SYNCING, Liveness
from .peers import Peers
from .roles import Roles
from ..transport.base import Transport
from ..errors import Unavailable

log = logging.getLogger(__name__)

__all__ = ["DOWN", "READY", "SYNCING", "Cluster", "Unavailable", "now_ns"]


class Cluster:
    """The rooms of one process's view of the cluster (see above), and what takes more than one."""

    def __init__(
        self,
        cfg: ClusterConfig,
        transport: Transport,
        nursery: trio.Nursery | None,
        *,
        me: str | None = None,
        my_state: Callable[[], str] | None = None,
    ):
        self.cfg = cfg
        self.me = me
        self.liveness = Liveness(lambda name: name in self.roles.members.names or name in self.roles.known)
        # membership: the config's nodes (epoch 0) until a rebalance switches every process over
        # (``adopt``); the config stays as loaded: every service holds it
        self.roles = Roles(cfg.members(), me, my_state or (lambda: DOWN), self._read_order, self.liveness.notify)
        self.liveness.track(set(self.roles.members.names) - {me})
        self.peers = Peers(cfg, transport, nursery, spec=self.roles.spec, lost=self.mark_down, is_down=self.liveness.is_down, counts_timeouts=me is not None)
        self.liveness.on_down.append(self.peers.abort)
        self.heartbeats = Heartbeats(cfg, self.peers, self.liveness, self.roles, lost=self.mark_down, adopt=self.adopt)

    @property
    def nursery(self) -> trio.Nursery | None:
        return self.peers.nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery) -> None:
        self.peers.nursery = nursery

    def _read_order(self, name: str) -> tuple:
        """A read asks a node this process's own heartbeats count down (a stopped node, until the
        view expels it) last; of the others the least loaded, then the one that served this
        process the fewest bytes (runtime/roles.py, ``read_candidates``)."""
        return (self.liveness.is_down(name), self.peers.load[name], self.peers.served[name])

    def vouch(self, name: str, state: str) -> None:
        """A node told us its state itself (runtime/liveness.py)."""
        self.liveness.vouch(name, state)

    def mark_down(self, name: str, why: str, since: float | None = None) -> None:
        """Drop the connection to ``name`` and count it down (runtime/liveness.py: unless the failure is
        of an operation begun ``since`` before the node vouched for itself)."""
        self.peers.drop(name)
        if name != self.me:
            self.liveness.mark_down(name, why, since)

    def heard_majority(self) -> bool:
        """Whether this node and the peers its own heartbeats reach are a majority of the members."""
        return self.liveness.heard_majority(self.roles.members.names, self.me)

    # -- calls whose answers may bring a newer view ------------------------------------------------
    async def call(self, name: str, method: str, args: dict | None = None, *, timeout: float | None = None) -> dict:
        """A control call; a node that cannot be reached is marked down and raises NodeDown."""
        return (await self.call_on(name, method, args, timeout=timeout))[0]

    async def call_on(self, name: str, method: str, args: dict | None = None, *, timeout: float | None = None) -> tuple[dict, int]:
        """``call``, and the incarnation that answered: the one any key in the reply belongs to."""
        reply, incarnation = await self.peers.call_on(name, method, args, timeout=timeout)
        await self.heartbeats.follow_acked(reply)
        return reply, incarnation

    async def write_imm(self, name: str, rkey: int, offset: int, data, imm: int, inc: int | None = None) -> dict:
        """A WRITE with immediate (runtime/peers.py), and the view its answer was acknowledged in."""
        reply = await self.peers.write_imm(name, rkey, offset, data, imm, inc)
        await self.heartbeats.follow_acked(reply)
        return reply

    # -- membership ----------------------------------------------------------------------------
    def adopt(self, specs: list[NodeSpec], replicas: int, epoch: int) -> None:
        """Switch to a new membership: placement, heartbeats and connections follow it. Who the
        members are is read from ``roles.members`` everywhere, never from the config, which a
        rebalance once changed in place under every service holding it."""
        old = set(self.roles.members.names)
        self.roles.members = Members(tuple(specs), replicas, epoch)
        self.liveness.track(set(self.roles.members.names) - old - {self.me})
        for name in old - set(self.roles.members.names):
            self.liveness.forget(name)
            self.peers.drop(name)
        log.info("membership %d adopted: %s (R=%d)", epoch, ", ".join(self.roles.members.names), replicas)
        self.liveness.notify()

    async def aclose(self) -> None:
        await self.peers.aclose()


def now_ns() -> int:
    return time.time_ns()
