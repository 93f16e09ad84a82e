"""The one path by which a node sends what it changed to the other replicas, and the one place of
the acknowledgement rule.

- ``update(peer, u)``: a stripe's ``Update`` to a backup: its bytes WRITTEn into the backup's
  staging (a slot of this node's ``StagingPool`` there), then ``apply`` naming them. A backup that
  is behind (it was down) answers ``stale`` and gets the whole stripe.
- ``record(peer, ...)``: push bookkeeping alone (an r2sp push held for its turn), its arrays
  through the same staging.
- ``meta(peer, seq, op)``: a namespace op, with the whole namespace for a peer that missed ops.

Each send goes through ``_reliably``: a backup whose staging region is gone (it restarted) is asked
for a new one, once; a send that fails for good counts the peer down (``lost``), which makes it
fence and resync before it serves (Cluster.lost), and answers False.

``to_every_target(key, one)`` is the acknowledgement rule of a stripe's change: answered only once
every node the stripe now targets (``Cluster.targets``) holds it. A backup that fails is counted
down, which brings the stripe's stand-in into its targets, and the stand-in gets it too (one that
lacks the stripe answers "stale" and gets it whole). Acknowledging with the failed backup merely
counted down lost acknowledged pushes once the primary fenced and resynced from that backup's older
copy (found by the fault simulator, tests/sim, "drop" seed 0). With no other live node it is held
here alone, as the cluster is then down to one copy. (Still the heartbeat design: "counted down" is
this node's own view, which the views of issue 20 replace.)
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from ..cluster import Cluster, Slot, StagingPool
from ..transport.base import AccessError, RemoteError, TransportError
from .updates import StripeKey, Update

log = logging.getLogger(__name__)


class Replicator:
    def __init__(self, name: str, cluster: Cluster, slots: StagingPool, snapshot: Callable[[], dict]):
        self.name = name
        self.cluster = cluster
        self.slots = slots  # this node's slots in its peers' staging regions
        self.snapshot = snapshot  # the namespace as it is now, for a peer that missed ops

    def lost(self, peer: str, exc: BaseException) -> None:
        """A send to ``peer`` failed for good: it lacks what it was sent, so it must not serve
        before it resyncs. Counting it down here makes it fence (Cluster.lost)."""
        self.cluster.mark_down(peer, f"replication failed: {exc}")

    async def _reliably(self, peer: str, what: str, send: Callable[[], Awaitable[object]]) -> bool:
        """``send()`` to ``peer``; True once done, False once it failed for good (``lost``)."""
        for attempt in (1, 2):
            try:
                await send()
                return True
            except TransportError as exc:
                if isinstance(exc, AccessError) or isinstance(exc, RemoteError) and exc.code == "EINVAL":
                    self.slots.forget(peer)  # its staging region is gone (it restarted): a new one, once
                    if attempt == 1:
                        continue
                log.warning("%s not replicated to %s: %s", what, peer, exc)
                self.lost(peer, exc)
                return False
        return False

    async def _apply(self, peer: str, u: Update, slot: Slot) -> dict:
        await self.cluster.write(peer, slot.rkey, slot.offset, u.bytes(), slot.inc)
        args = {"where": u.range.wire(), "staged": [slot.rkey, slot.offset], "version": u.version, "clock": u.source.clock}
        args |= {"full": u.full, "sender": self.name}
        args |= ({"record": u.record} if u.record is not None else {}) | ({"pending": True} if u.pending else {}) | ({"state": u.state} if u.state else {})
        return await self.cluster.call(peer, "apply", args)

    async def update(self, peer: str, u: Update) -> bool:
        """``u`` to backup ``peer`` (the whole stripe if it is behind); True once it holds it."""

        async def send() -> None:
            r = await self.slots.with_slot(peer, lambda slot: self._apply(peer, u, slot))
            if r.get("stale"):
                log.info("replica %s of stripe %d:%d is behind; sending the whole stripe", peer, u.range.key.fid, u.range.key.idx)
                await self.slots.with_slot(peer, lambda slot: self._apply(peer, u.whole(), slot))

        key = u.range.key
        return await self._reliably(peer, f"stripe {key.fid}:{key.idx} (snapshot {key.snap}) version {u.version}", send)

    async def record(self, peer: str, key: StripeKey, record: dict, blobs: list[memoryview], inline: Callable[[], dict]) -> bool:
        """Push bookkeeping of a stripe to ``peer``: ``record`` with its arrays (``blobs``)
        through ``peer``'s staging, or all of it inline (``inline()``, arrays as base64) when they
        are larger than a staging slot."""
        args = {"fid": key.fid, "idx": key.idx, "record": record, "lengths": [len(v) for v in blobs], "sender": self.name}

        async def staged(slot: Slot) -> dict:
            await self.cluster.write(peer, slot.rkey, slot.offset, blobs, slot.inc)
            return await self.cluster.call(peer, "train_record", dict(args, rkey=slot.rkey, soff=slot.offset))

        async def send() -> None:
            if not blobs:
                await self.cluster.call(peer, "train_record", args)
            elif sum(args["lengths"]) <= self.slots.slot_size:
                await self.slots.with_slot(peer, staged)
            else:
                await self.cluster.call(peer, "train_record", {"fid": key.fid, "idx": key.idx, "record": inline(), "sender": self.name})

        return await self._reliably(peer, f"training record of stripe {key.fid}:{key.idx}", send)

    async def meta(self, peer: str, seq: int, op: dict) -> bool:
        """Namespace op ``seq`` to ``peer``; the whole namespace if it missed ops."""

        async def send() -> None:
            r = await self.cluster.call(peer, "meta_apply", {"seq": seq, "op": op, "sender": self.name})
            if r.get("stale"):
                await self.cluster.call(peer, "meta_restore", {"snapshot": self.snapshot()})

        return await self._reliably(peer, f"metadata op {seq}", send)

    async def to_every_target(self, key: StripeKey, one: Callable[[str], Awaitable[bool]]) -> None:
        """Return once every node stripe ``key`` now targets holds the change ``one(peer)``
        sends (True: ``peer`` holds it); EAGAIN if the targets kept changing."""
        have = {self.name}
        for _ in range(2 * len(self.cluster.cfg.names) + 2):
            todo = [p for p in self.cluster.targets(key.fid, key.idx) if p not in have]
            if not todo:
                return
            done: dict[str, bool] = {}

            async def send(peer: str) -> None:
                done[peer] = await one(peer)

            async with trio.open_nursery() as n:
                for peer in todo:
                    n.start_soon(send, peer)
            have |= {p for p, ok in done.items() if ok}
        raise RemoteError("EAGAIN", f"stripe {key.fid}:{key.idx}: its replicas kept changing; not acknowledged, send it again")
