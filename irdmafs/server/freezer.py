"""A snapshot taken across the nodes, by the metadata primary: freeze, copy, name, thaw.

``Freezer`` owns the orchestration of one ``snapshot`` op (namespace.py hands it the prepared
op under its lock): it freezes commits on every live node (the commit barrier, barrier.py),
freezes every live stripe under the snapshot id on every node (``snap_copy``: copy-on-write,
store.py: no byte is copied), has the op applied and replicated (the namespace's ``name``
callback: the snapshot is named only then) and thaws every node it asked. It holds no state
between snapshots; ``call_node`` is the node's control call to a peer.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from ..errors import NodeDown, RemoteError
from ..util import single_exception
from .barrier import FREEZE_SECONDS

log = logging.getLogger("irdmafs.server.namespace")  # logged as the namespace service


class Freezer:
    def __init__(self, name: str, cluster, serving, call_node: Callable[[str, str, dict], Awaitable[dict]], name_it: Callable[[dict], Awaitable[dict]]):
        self.name, self.cluster, self.serving = name, cluster, serving
        self.call_node = call_node
        self.name_it = name_it  # the op applied here and on every other live node (namespace.py)

    async def take(self, op: dict) -> dict:
        """Freeze commits on every live node, freeze every live stripe on every node under the
        snapshot id (copy-on-write: metadata only, store.py), record the snapshot in the
        namespace, thaw. Every commit is either wholly
        in or out. The copies come first: a snapshot is named (and a retry of its request
        answered from the record) only once they exist. Named first, a coordinator killed
        before the copies left a snapshot that read as zeros, and the retry was told it was
        taken (chaos --views, seed 2).

        Every node the view names active is frozen and holds its copies before the snapshot is
        named, in the view it began in; else it answers EAGAIN, names nothing, and the client
        asks again (by then a new view may have expelled a node that is gone). A cut of a few
        seconds expels nobody, and a snapshot taken then on its coordinator alone read as zeros
        from the other nodes (chaos, seed 7)."""
        nodes = self.cluster.roles.live()
        epoch = self.cluster.roles.view_epoch
        token = f"{self.name}:{op['id']}"
        frozen: list[str] = []
        try:
            with single_exception(RemoteError):  # ESTALE: a node moved to a newer view meanwhile
                async with trio.open_nursery() as n:
                    for node in nodes:
                        n.start_soon(self._freeze_one, node, token, frozen)
            self._everywhere("frozen", nodes, frozen)
            copied = {}
            async with trio.open_nursery() as n:
                for node in nodes:
                    n.start_soon(self._copy_one, node, op["id"], copied)
            self._everywhere("copied", nodes, copied)
            self.serving.check_same_epoch(epoch)  # a node that joined meanwhile holds no copies
            result = await self.name_it(op)
            log.info("snapshot %r (id %d) taken on %s: %d bytes", op["name"], op["id"], ", ".join(sorted(copied)), sum(copied.values()))
            return dict(result, nodes=sorted(copied))
        finally:
            # every node asked, not only those whose freeze answered: a freeze that timed out
            # here (it waits for the commits in flight there) may have landed, and that node
            # held every commit until its own deadline (30 s: chaos --views, seed 1). A thaw
            # under another token changes nothing.
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as n:
                    for node in nodes:
                        n.start_soon(self._thaw_one, node, token, node in frozen)

    def _everywhere(self, what: str, nodes: list[str], done) -> None:
        """EAGAIN unless every node of ``nodes`` is in ``done`` (see above)."""
        missing = [n for n in nodes if n not in done]
        if missing:
            raise RemoteError("EAGAIN", f"snapshot not {what} on {', '.join(missing)}; it is taken again")

    async def _freeze_one(self, node: str, token: str, frozen: list[str]) -> None:
        try:
            await self.call_node(node, "freeze", {"token": token, "seconds": FREEZE_SECONDS, "epoch": self.cluster.roles.view_epoch})
            frozen.append(node)
        except NodeDown as exc:
            log.warning("snapshot: %s is down, it gets the snapshot at resync: %s", node, exc)
        except RemoteError as exc:
            if exc.code != "EBUSY":
                raise
            # another freeze holds it (a snapshot or rebalance under way, or one whose holder
            # died and that lifts once the view drops it): asked again, not an error to the user
            raise RemoteError("EAGAIN", f"snapshot: {node} is frozen: {exc}") from None

    async def _thaw_one(self, node: str, token: str, frozen: bool) -> None:
        try:
            await self.call_node(node, "thaw", {"token": token})
        except (NodeDown, RemoteError) as exc:  # it auto-thaws after its deadline
            if frozen:
                log.warning("thaw of %s failed: %s", node, exc)

    async def _copy_one(self, node: str, snap: int, copied: dict) -> None:
        try:
            copied[node] = (await self.call_node(node, "snap_copy", {"snap": snap}))["bytes"]
        except (NodeDown, RemoteError) as exc:
            log.warning("snapshot %d not copied on %s: %s", snap, node, exc)
