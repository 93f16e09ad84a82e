"""A client's control calls that follow the node serving them, and its namespace ops.

Owns: the count of calls sent to the metadata primary (``calls``: the mount's
``metadata_calls``), the request ids of the namespace ops this client sends, and who is told
after each of them (``on_change``). ``follow`` is any control call to the node a chooser names
(the metadata primary; a stripe's primary for the pushes and pulls of training.py); ``call`` one
to the metadata primary; ``op`` a namespace op (a ``meta`` call with a request id). The inode
level methods of each kind are Client's (client.py), which sends them through here.
"""

from __future__ import annotations

from typing import Any, Callable

import trio

from ..config import ClusterConfig
from ..errors import NodeDown, RemoteError
from ..runtime.cluster import Cluster
from ..runtime.silence import Patience

# calls that carry the client's view epoch (server/serving.py, check_epoch)
EPOCH_METHODS = frozenset({"meta", "train_info", "cache_wait"})


class MetaCalls:
    def __init__(self, cfg: ClusterConfig, cluster: Cluster, owner: str) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.owner = owner
        self.calls = 0  # calls sent to the metadata primary
        self._rids = 0
        # called after each namespace op this client sends, whatever its outcome: a mount drops
        # what it keeps of names then (the primary tells no mount of its own changes)
        self.on_change: list[Callable[[], None]] = []

    async def call(self, method: str, args: dict) -> dict:
        """A namespace call to the metadata primary (first ready node), following it."""
        self.calls += 1
        return await self.follow(self.cluster.roles.meta_primary, method, args)

    async def follow(self, choose, method: str, args: dict, *, timeout: float | None = None) -> dict:
        """A control call to the node ``choose()`` names (the metadata primary, a stripe's
        primary), following it when it moves: a node lost or fenced mid-call is not an error
        the user should see while another can answer. Its deadline bounds silence: a refusal
        (EAGAIN) is waited for while the long work of any member moves, the target's own (its
        catch-up) or another's it waits on (a snapshot is taken only once every node named has
        caught up: a ``mkdir`` in ``.snapshots`` got ETIMEDOUT while a restarted node took a GB
        back, 1 GiB chaos soak)."""
        patience = Patience(self.cluster.liveness.work, (timeout or self.cfg.op_timeout) + 2 * self.cfg.op_timeout)
        with patience.bound():
            while True:
                target = choose()
                if target is None:
                    await self.cluster.liveness.wait_changed(0.5)
                    await self.cluster.heartbeats.refresh()
                    continue
                if method in EPOCH_METHODS:
                    args = dict(args, epoch=self.cluster.roles.view_epoch)  # as it is now (runtime/roles.py)
                try:
                    return await self.cluster.call(target, method, args, timeout=timeout)
                except NodeDown:
                    await self.cluster.heartbeats.after_lost()
                    continue
                except RemoteError as exc:
                    if exc.code not in ("ENOTPRIMARY", "EAGAIN", "ESTALE"):
                        raise
                    await trio.sleep(0.1)
                    await self.cluster.heartbeats.refresh()
                    patience.heed(*self.cluster.roles.members.names)

    async def op(self, **op: Any) -> dict:
        """A namespace op (server/meta.py), with a request id so that a retry after a lost
        answer is not applied twice; ``on_change`` is told after it, whatever its outcome. The
        kinds with no method of their own on Client go here directly (a bucket's ``pack`` and
        ``unpack``: buckets.py; a mount's ``cacher``: fs/namelease.py)."""
        self._rids += 1
        try:
            return await self.call("meta", {"op": dict(op, rid=f"{self.owner}:{self._rids}")})
        finally:
            for changed in self.on_change:
                changed()

    async def cache_wait(self, acked: int) -> dict:
        """This client's long-poll for a name cache lease at the metadata primary
        (server/namecache.py; the mount's side is fs/namelease.py)."""
        return await self.follow(self.cluster.roles.meta_primary, "cache_wait", {"owner": self.owner, "acked": acked})
