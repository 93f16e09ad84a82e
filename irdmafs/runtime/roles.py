"""Who serves what: the view in force and the membership, and the routing they answer. One room
of a process's ``Cluster`` (runtime/cluster.py), which feeds it the views heartbeats and the
coordinator bring and the memberships a rebalance switches to.

Who serves is decided by views alone (coord/views.py): the newest view known names the active
nodes, and another node is ready if that view names it active, else down, whatever heartbeats
say (a node still answers for itself, through ``my_state``). Every process that holds the same
view epoch then names the same primary and replicas for a stripe. A newer epoch always replaces
an older one (coord/views.py, V1). A process starts with the empty view (epoch 0, nobody
active) and routes nothing until it has learnt one.

From the view and the membership (``members``, a value a rebalance replaces whole) the pure
placement and routing functions (runtime/placement.py, runtime/routing.py) answer: the metadata primary (first
active member), a stripe's primary (first active node in the stripe's rendezvous ranking), the
replicas a write must reach, and the order in which to try replicas for a read.

Concurrency: one trio thread.
"""

from __future__ import annotations

from typing import Callable, Hashable

from . import routing
from ..config import Members, NodeSpec
from ..coord.views import View
from .liveness import DOWN, READY, SYNCING
from .placement import rank, stripe_key


class Roles:
    """The view and membership one process holds, and who serves what under them."""

    def __init__(
        self, members: Members, me: str | None, my_state: Callable[[], str], read_order: Callable[[str], Hashable], changed: Callable[[], None]
    ) -> None:
        """``read_order(node)``: how this process ranks a stripe's homes for a read (least loaded
        first); ``changed()``: called when a newer view is learnt (what waits on a change wakes)."""
        self.members = members
        self.known: dict[str, NodeSpec] = {}  # nodes reachable though not (yet) members
        self.me = me
        self._my_state = my_state
        self._read_order = read_order
        self._changed = changed
        self.view: View = View()  # the newest view known; epoch 0: none yet
        self.on_view: list[Callable[[View], None]] = []  # called with each newer view learnt

    def spec(self, name: str) -> NodeSpec | None:
        """Where ``name`` listens: a member's address, or a node known before it is one."""
        return self.members.spec(name) or self.known.get(name)

    def know(self, specs: list[NodeSpec]) -> None:
        """Nodes this process may connect to before they are members (a rebalance's copies)."""
        for s in specs:
            self.known[s.name] = s

    @property
    def epoch(self) -> int:
        """The membership's epoch (0: the config's), which heartbeats carry."""
        return self.members.epoch

    @property
    def view_epoch(self) -> int:
        """The epoch every message that changes data carries (0: no view learnt yet)."""
        return self.view.epoch

    def learn_view(self, view: View) -> None:
        """Keep ``view`` if it is newer than the one held; it decides who serves from now on."""
        if view.epoch <= self.view.epoch:
            return
        self.view = view
        for callback in self.on_view:
            callback(view)
        self._changed()

    def node_state(self, name: str) -> str:
        if name == self.me:
            return self._my_state()
        return READY if name in self.view.active else DOWN

    def ready(self) -> list[str]:
        return [n for n in self.members.names if self.node_state(n) == READY]

    def live(self) -> list[str]:
        return [n for n in self.members.names if self.node_state(n) in (READY, SYNCING)]

    def meta_primary(self) -> str | None:
        ready = self.ready()
        return ready[0] if ready else None

    def stripe_rank(self, fid: int, idx: int) -> list[str]:
        return rank(stripe_key(fid, idx), self.members.names)

    def stripe_primary(self, fid: int, idx: int) -> str | None:
        return routing.primary(self.stripe_rank(fid, idx), self.node_state)

    def targets(self, fid: int, idx: int) -> list[str]:
        """Where a write of this stripe must land: the first R nodes of its ranking the view names
        active (this node too while it syncs), always including the primary (runtime/routing.py)."""
        return routing.targets(self.stripe_rank(fid, idx), self.members.replicas, self.node_state)

    def read_candidates(self, fid: int, idx: int) -> list[str]:
        """Nodes to try for a read: the stripe's homes the view names active (the first R of its
        ranking) in ``read_order`` (runtime/cluster.py: one this process's own heartbeats count down
        last, then least-loaded first, of those the one that served this process the fewest
        bytes, so a file's reads spread over its homes by bytes, not all to its primaries:
        four readers of one snapshot on four nodes sent 22-30% of the bytes from each node).
        They hold every acknowledged write once caught up (their ``stripe_info`` waits for that).

        A stand-in (a node past the first R that took writes while a home was expelled) is
        never asked while a home is active: it holds only what it took while it stood in. A
        mount on the minority side of a cut, reaching neither home, read a stand-in's copy from
        an earlier view, and a write acknowledged since by the homes read back old (chaos,
        seed 7). Reaching no home, the read is unavailable (EIO) rather than old. Only a view
        that names no home active (every home expelled: R=1, or R=2 on five nodes and more)
        leaves the stand-ins it writes to, the only copies it acknowledges writes on."""
        return routing.read_candidates(self.stripe_rank(fid, idx), self.members.replicas, self.node_state, self._read_order)
