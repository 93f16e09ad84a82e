"""Liveness: what this process's own heartbeats and calls say of each other node.

A node's liveness ``state`` is ``ready``, ``syncing`` or ``down``: as its heartbeat answers say,
as it told us itself (``vouch``: joining, taking its stripes back), or down when an operation on it
failed or it stopped answering. It never decides who serves (views do, coord/views.py); it orders
a read's replicas (one counted down last), aborts what waits on a node counted down
(``on_down``: runtime/peers.py cancels those operations), and tells a node which peers to expel
(server/membership.py) and whether it hears a majority (``heard_majority``).

A failure of an operation begun before the node vouched for itself says nothing of the process
that vouched (it is a new one), so it does not count that node down (``mark_down``'s ``since``).

``changed`` is set (and replaced) at every change of a state, the view or the membership
(runtime/cluster.py): ``wait_changed`` is how a loop waits for one.

Concurrency: one trio thread.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import trio

from . import routing

log = logging.getLogger(__name__)

READY, SYNCING, DOWN = routing.READY, routing.SYNCING, "down"


class Liveness:
    def __init__(self, tracked: Callable[[str], bool]):
        """``tracked(name)``: whether ``name`` is a node to keep a state of (a member, or a node
        known to be joining): a state for anything else is not kept."""
        self.tracked = tracked
        self.state: dict[str, str] = {}
        self.info: dict[str, dict] = {}  # each node's last heartbeat answer
        self.info_at: dict[str, float] = {}  # when each node's info was last heard
        self.vouched_at: dict[str, float] = {}  # when a node last told us its state itself
        self.on_down: list[Callable[[str], None]] = []  # called when a node turns down
        self.changed = trio.Event()

    def set(self, name: str, state: str, why: str = "") -> None:
        if not self.tracked(name):
            return  # no longer a member: nothing to track
        old = self.state.get(name)
        if old != state:
            self.state[name] = state
            if state == DOWN:
                for callback in self.on_down:
                    callback(name)
            log.log(logging.WARNING if state == DOWN else logging.INFO, "node %s: %s -> %s%s", name, old, state, f" ({why})" if why else "")
            self.notify()

    def heard(self, name: str, info: dict, sent: float) -> None:
        """A heartbeat sent at ``sent`` answered ``info``: its state counts unless the node
        vouched for itself since the probe began."""
        self.info[name] = info
        self.info_at[name] = trio.current_time()
        if self.vouched_at.get(name, -math.inf) < sent:
            self.set(name, info.get("state", DOWN))

    def vouch(self, name: str, state: str) -> None:
        """A node told us its state itself (joining, taking its stripes back: server/membership.py).
        That is newer than any heartbeat probe already under way, whose answer is then ignored."""
        self.vouched_at[name] = trio.current_time()
        self.set(name, state, "told by the node")

    def mark_down(self, name: str, why: str, since: float | None = None) -> None:
        """Count ``name`` down, unless the failure is of an operation begun ``since`` before the
        node vouched for itself (the process that failed it is gone; the one that vouched is new)."""
        if since is None or self.vouched_at.get(name, -math.inf) < since:
            self.set(name, DOWN, why)

    def work(self, name: str) -> tuple:
        """What ``name``'s last heartbeat said of its long work (a resync, a catch-up): its
        kind and how far it got (Nones when none). A wait on that node may last while it moves
        (runtime/silence.py, ``Patience``)."""
        work = self.info.get(name, {}).get("work") or {}
        return (work.get("what"), work.get("done"), work.get("bytes"))

    def is_down(self, name: str) -> bool:
        return self.state.get(name) == DOWN

    def heard_majority(self, members: list[str], me: str | None) -> bool:
        """Whether ``me`` and the peers its heartbeats reach (whatever a view says) are a
        majority of ``members``: a node cut off from the others must not expel them
        (server/replicator.py)."""
        heard = sum(self.state.get(n, DOWN) != DOWN for n in members if n != me)
        return heard + 1 >= len(members) // 2 + 1

    def track(self, names: set[str]) -> None:
        """Keep a state (down until heard) for each of ``names``."""
        for name in names:
            self.state.setdefault(name, DOWN)

    def forget(self, name: str) -> None:
        """``name`` left the membership: nothing more is kept of it."""
        self.state.pop(name, None)
        self.info.pop(name, None)

    def notify(self) -> None:
        """Wake everything waiting for a change (``wait_changed``)."""
        self.changed.set()
        self.changed = trio.Event()

    async def wait_changed(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            await self.changed.wait()
