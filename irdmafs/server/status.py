"""What a node says of itself to liveness probes, published ahead (docs/design.md P1-P3).

The node's heartbeat answer (``Node.status``) is published on a ``StatusBoard``
(transport/probes.py), which the transports answer probes from while its copy is valid:

- every ``interval`` seconds (``min(heartbeat, down_after) / 8``, 20 ms at least), after the checks a heartbeat
  makes before it says "ready" (``Serving.check_now``: a stall, the lease), and at once at every
  change of the serving state (a fence withdraws "ready" the moment it happens) and of the view;
- each copy valid for ``down_after / 4``, less than the stall that fences a node (``0.8 x
  down_after``), and never past the lease's end while it says ready.

A probe answered from the board is heard afterwards (``probed``): its request is checked as the
call would be (calls.py), counted, and its owner's staging lease kept, as the heartbeat
handler does.

Concurrency: one trio thread.
"""

from __future__ import annotations

import logging
from typing import Callable

import trio

from ..calls import CALLS
from ..config import ClusterConfig
from ..errors import RemoteError
from ..coord.views import View
from ..runtime.cluster import READY
from ..runtime.roles import Roles
from ..transport.probes import PROBE_METHOD, StatusBoard
from .leases import ServingLease
from .serving import Serving

log = logging.getLogger(__name__)

MIN_INTERVAL = 0.02  # seconds: a status costs about 70 us to build and encode; tests' 50 ms heartbeats would publish 160 a second


class Publisher:
    """The node's status board, kept current."""

    def __init__(
        self, cfg: ClusterConfig, serving: Serving, lease: ServingLease, roles: Roles, status: Callable[[], dict], heard: Callable[[dict], None]
    ) -> None:
        """``status()``: the heartbeat's answer as it is now; ``heard(fields)``: a probe answered
        from the board, with its request's parsed fields (the heartbeat handler's side effects);
        ``roles``: where views are learnt (a view that drops this node ends its copy at once)."""
        self.cfg, self.serving, self.lease, self.roles = cfg, serving, lease, roles
        self._status, self._heard = status, heard
        self.board = StatusBoard(self.probed)
        self.interval = max(MIN_INTERVAL, min(cfg.heartbeat, cfg.down_after) / 8)
        self.valid_for = cfg.down_after / 4
        self.running = False  # publishing (a node in the simulator answers every heartbeat itself)

    def publish(self) -> None:
        """The status as it is now, on the board, valid as P1 says."""
        if not self.running:
            return
        valid = self.valid_for
        if self.serving.state == READY:
            valid = min(valid, self.lease.left())
        self.board.publish(self._status(), valid)

    async def loop(self) -> None:
        """Publish every ``interval`` seconds, after the checks, for as long as the node runs."""
        self.running = True
        self.serving.on_state = self.publish  # a fence (or a return to ready) shows at once
        self.roles.on_view.append(self._view_learnt)
        try:
            while True:
                self.serving.check_now()
                self.publish()
                await trio.sleep(self.interval)
        finally:
            self.running = False
            self.serving.on_state = None
            self.roles.on_view.remove(self._view_learnt)
            self.board.withdraw()

    def _view_learnt(self, view: View) -> None:
        """A newer view: published again at once, so a view that no longer names this node (its
        lease no longer serves: ``left`` is 0) leaves no "ready" copy valid; the next probe is
        the call, whose checks fence it."""
        self.publish()

    def probed(self, method: str, args: dict) -> None:
        """A probe the board answered: what the heartbeat call would have done besides its answer."""
        try:
            fields = CALLS[PROBE_METHOD].parse(args).kwargs()
        except RemoteError as exc:
            log.warning("a probe's request dropped: %s", exc.message)
            return
        self._heard(fields)
