"""The one path by which a node sends what it changed to the other replicas, and the one place of
the acknowledgement rule.

- ``update(peer, u)``: a stripe's ``Update`` to a backup: its bytes WRITTEn into the backup's
  staging (a slot of this node's ``StagingPool`` there), then ``apply`` naming them. A backup that
  is behind (it was down) answers ``stale`` and gets the whole stripe. Updates to one peer that
  queue while a slot's worth of them is under way travel together (``_fused``): their bytes in
  one WRITE, one ``apply_batch`` naming each (the peer applies each as its own ``apply``, at
  once, and answers each apart), so a step that closes a thousand small stripes' rounds costs a
  backup a few transfers, not a thousand (issue 32). Each update keeps its own answer and its
  own retry: fusing changes how many messages carry them, never what is acknowledged. An update
  whose batch was never answered because its sender's task was cancelled (not a failure of the
  peer) is queued again, never counted as the peer's failure.
- ``record(peer, ...)``: push bookkeeping alone (an r2sp push held for its turn), its arrays
  through the same staging.
- ``meta(peer, seq, op)``: a namespace op, with the whole namespace for a peer that missed ops.

Every message carries this node's view epoch (``epoch``): a backup in another epoch refuses it
(serving.py).

Each send goes through ``_reliably``: a backup whose staging region is gone (it restarted) is asked
for a new one, once. A send that fails for good answers False, and a backup that could not be
reached (lost, timed out) is expelled by a new view (coord/views.py, V6), which takes it out of the stripe's replicas, if this node's own
  heartbeats, probed again first, reach a majority of the members (a node cut off from the others
  expels nobody: it waits, unacknowledged, until they expel it or the links return; found by the
  fault simulator, kind "cut": without the fresh probe the cut-off node's heartbeats still said
  "majority" for a moment, and it expelled one of the others, mixed seed 39). A backup that
those fresh probes hear again (the fault that failed the send healed while it waited) is sent
the change once more before it is expelled, once per change: expelled a moment after it was
back, its stripes had one copy until their stand-ins got them, and a crash of that copy's node
then lost them with every node up a moment before (mixed seed 1758162611: a bucket's pushes
taken for out of order). A backup that answers probes but not the data plane costs one more
send before it goes. A backup that
refused (ESTALE: it holds another view; EAGAIN) is not expelled: this node reads the view and
decides again.

``to_every_target(key, one)`` is the acknowledgement rule of a stripe's change: answered only once
every node the stripe now targets (``Roles.targets``, runtime/roles.py) holds it, and while this node still leads
the stripe in the view it then holds; else EAGAIN, and the change is not acknowledged. A backup
that fails leaves the targets (expelled by a new view), which brings the
stripe's stand-in in, and the stand-in gets it too (one that lacks the stripe answers "stale" and
gets it whole). Acknowledging with the failed backup merely counted down lost acknowledged pushes
once the primary fenced and resynced from that backup's older copy (found by the fault simulator,
tests/sim, "drop" seed 0, in the heartbeat design before views). With no other live node it is held here alone, as the cluster is then
down to one copy.

A change is acknowledged only in the serving generation it was made in (``Serving.gen``): a node
fenced while a change waited for its backups resyncs, and its copy (a stripe, the namespace) may
then be its peers', without the change; answering it after the node was ready again
acknowledged what it no longer held, and its next change, made on its peers' copy, replaced the
backups' copy that had it (fault simulator, mixed seed 631: a truncate lost, the file read back
at its old size).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from ..errors import AccessError, RemoteError, TransportError, Unsent
from ..runtime.batching import Batcher
from ..runtime.cluster import Cluster
from ..runtime.slots import Slot, StagingPool, staging_gone
from .serving import Serving
from .store import pinned
from .updates import StripeKey, Update

log = logging.getLogger(__name__)


class Replicator:
    def __init__(self, name: str, cluster: Cluster, slots: StagingPool, snapshot: Callable[[], dict], serving: Serving):
        self.name = name
        self.cluster = cluster
        self.slots = slots  # this node's slots in its peers' staging regions
        self.snapshot = snapshot  # the namespace as it is now, for a peer that missed ops
        self.serving = serving
        self.unreached: set[str] = set()  # backups to expel (see above)
        self._queues: dict[str, Batcher] = {}  # peer -> updates waiting to be sent (``_fused``)

    @property
    def epoch(self) -> int:
        return self.cluster.roles.view.epoch

    def lost(self, peer: str, exc: BaseException) -> None:
        """A send to ``peer`` failed for good: it lacks what it was sent, so it must not serve
        before it resyncs. A peer that could not be reached is to be expelled; one that refused
        (another view, EAGAIN) is asked again once this node has read the view."""
        if not isinstance(exc, RemoteError) or exc.code not in ("ESTALE", "EAGAIN"):
            self.unreached.add(peer)

    async def _reliably(self, peer: str, what: str, send: Callable[[], Awaitable[object]]) -> bool:
        """``send()`` to ``peer``; True once done, False once it failed for good (``lost``)."""
        for attempt in (1, 2):
            try:
                await send()
                return True
            except TransportError as exc:
                if isinstance(exc, AccessError) or isinstance(exc, RemoteError) and exc.code == "EINVAL":
                    if attempt == 1:  # its staging region is gone (it restarted): a new one, once
                        continue
                log.warning("%s not replicated to %s: %s", what, peer, exc)
                self.lost(peer, exc)
                return False
        return False

    @staticmethod
    def _apply_args(u: Update, staged: list[int]) -> dict:
        """The ``apply`` arguments of ``u``, its bytes staged at ``staged`` ([rkey, offset])."""
        args = {"where": u.range.wire(), "staged": staged, "version": u.version, "clock": u.clock_sent}
        args |= {"full": u.full, "tag": u.source.tag, "base_tag": u.base_tag}
        args |= {"record": u.record} if u.record is not None else {}
        return args | ({"pending": True} if u.pending else {}) | ({"state": u.state} if u.state else {})

    async def _apply(self, peer: str, updates: list[Update], slot: Slot) -> list:
        """``updates`` to ``peer`` through one slot: their bytes back to back in one WRITE, then
        ``apply`` (one update) or ``apply_batch``; each one's answer, a dict or a RemoteError."""
        at, bufs, each = slot.offset, [], []
        for u in updates:
            data = u.bytes()
            bufs.append(data)
            each.append(self._apply_args(u, [slot.rkey, at]))
            at += len(data)
        await self.cluster.peers.write(peer, slot.rkey, slot.offset, bufs, slot.inc)
        who = {"sender": self.name, "epoch": self.epoch}
        if len(updates) == 1:
            return [await self.cluster.call(peer, "apply", each[0] | who)]
        results = (await self.cluster.call(peer, "apply_batch", {"updates": each} | who)).get("results")
        if not isinstance(results, list) or len(results) != len(updates) or not all(isinstance(r, dict) for r in results):
            raise RemoteError("EIO", f"{peer} answered apply_batch of {len(updates)} updates with {results!r:.80}")
        answers = [RemoteError(str(r["error"]), str(r.get("message", ""))) if "error" in r else r for r in results]
        if any(staging_gone(a) for a in answers):
            self.slots.forget(peer, slot.rkey)  # as ``with_slot`` does for a send that raised it
        return answers

    async def _fused(self, peer: str, u: Update) -> dict:
        """``apply`` of ``u`` on ``peer``: sent at once if fewer sends to it are under way than
        this node has staging slots there, else with every update to ``peer`` that queued
        meanwhile, up to a slot's bytes (runtime/batching.py: fusion with no added latency when idle;
        each update's task returns as soon as its own batch is answered). Raises what its send
        raised (a TransportError, or its own RemoteError). An update whose batch was cut off by
        its sender's cancellation is queued again."""
        q = self._queues.get(peer)
        if q is None:

            async def send(batch: list[Update]) -> list:
                # pinned from here: an update's own task may be cancelled while its batch
                # waits for a slot or its bytes leave (runtime/batching.py), its pin gone
                with pinned(*(u.source for u in batch)):
                    try:
                        return await self.slots.with_slot(peer, lambda slot: self._apply(peer, batch, slot))
                    except TransportError as exc:
                        return [exc] * len(batch)

            q = self._queues[peer] = Batcher(self.slots.slots, self.slots.slot_size, send)
        while True:
            try:
                return await q.put(u, len(u.bytes()))
            except Unsent:
                continue

    async def update(self, peer: str, u: Update) -> bool:
        """``u`` to backup ``peer`` (the whole stripe if it is behind); True once it holds it."""

        async def send() -> None:
            r = await self._fused(peer, u)
            if r.get("stale"):
                log.info("replica %s of stripe %d:%d is behind; sending the whole stripe", peer, u.range.key.fid, u.range.key.idx)
                (whole,) = await self.slots.with_slot(peer, lambda slot: self._apply(peer, [u.whole()], slot))
                if isinstance(whole, BaseException):
                    raise whole

        key = u.range.key
        return await self._reliably(peer, f"stripe {key.fid}:{key.idx} (snapshot {key.snap}) version {u.version}", send)

    async def record(self, peer: str, key: StripeKey, record: dict, blobs: list[memoryview], inline: Callable[[], dict]) -> bool:
        """Push bookkeeping of a stripe to ``peer``: ``record`` with its arrays (``blobs``)
        through ``peer``'s staging, or all of it inline (``inline()``, arrays as base64) when they
        are larger than a staging slot."""
        args = {"fid": key.fid, "idx": key.idx, "record": record, "lengths": [len(v) for v in blobs], "sender": self.name, "epoch": self.epoch}

        async def staged(slot: Slot) -> dict:
            await self.cluster.peers.write(peer, slot.rkey, slot.offset, blobs, slot.inc)
            return await self.cluster.call(peer, "train_record", dict(args, staged=[slot.rkey, slot.offset]))

        async def send() -> None:
            if not blobs:
                await self.cluster.call(peer, "train_record", args)
            elif sum(args["lengths"]) <= self.slots.slot_size:
                await self.slots.with_slot(peer, staged)
            else:
                await self.cluster.call(peer, "train_record", {"fid": key.fid, "idx": key.idx, "record": inline(), "sender": self.name, "epoch": self.epoch})

        return await self._reliably(peer, f"training record of stripe {key.fid}:{key.idx}", send)

    async def meta(self, peer: str, seq: int, op: dict, tag: int, prev: tuple[int, int]) -> bool:
        """Namespace op ``seq``, stamped (``tag``, ``seq``) on top of stamp ``prev``, to
        ``peer``; the whole namespace if it missed ops or holds others (server/namespace.py)."""

        async def send() -> None:
            args = {"seq": seq, "op": op, "sender": self.name, "epoch": self.epoch, "tag": tag, "prev": list(prev)}
            r = await self.cluster.call(peer, "meta_apply", args)
            if r.get("stale"):
                await self.cluster.call(peer, "meta_restore", {"snapshot": self.snapshot()})

        return await self._reliably(peer, f"metadata op {seq}", send)

    async def namespace(self, peer: str) -> bool:
        """This node's whole namespace to ``peer``, which takes it if it is newer than its own."""

        async def send() -> None:
            await self.cluster.call(peer, "meta_restore", {"snapshot": self.snapshot()})

        return await self._reliably(peer, "the namespace", send)

    async def to_every_target(self, key: StripeKey, one: Callable[[str], Awaitable[bool]]) -> None:
        """Return once every node stripe ``key`` now targets holds the change ``one(peer)``
        sends (True: ``peer`` holds it); EAGAIN if the targets kept changing."""
        what = f"stripe {key.fid}:{key.idx}"
        await self.to_every(what, lambda: self.cluster.roles.targets(key.fid, key.idx), one, lambda: self.serving.check_primary(key.fid, key.idx))

    async def to_every(self, what: str, targets: Callable[[], list[str]], one: Callable[[str], Awaitable[bool]], leads: Callable[[], None]) -> None:
        """``to_every_target`` for any set of replicas: ``targets()`` as they are now, ``leads()``
        raising unless this node still leads what is sent (a view may have moved it)."""
        have = {self.name}
        spared: set[str] = set()  # backups heard again after a failed send: sent once more (``_out_of_view``)
        made_in = self.serving.gen
        for _ in range(2 * len(self.cluster.roles.members.names) + 2):
            try:
                self.serving.require_ready()  # expelled, or its lease ended
                leads()  # or a new view moved the stripe
                if self.serving.gen != made_in:
                    raise RemoteError("ESTALE", "this node resynced since the change was made here")
            except RemoteError as exc:  # EAGAIN whatever the reason: it is held here, maybe there
                raise RemoteError("EAGAIN", f"{what}: not acknowledged ({exc}); send it again") from None
            todo = [p for p in targets() if p not in have]
            if not todo:
                return
            done: dict[str, bool] = {}

            async def send(peer: str) -> None:
                done[peer] = await one(peer)

            async with trio.open_nursery() as n:
                for peer in todo:
                    n.start_soon(send, peer)
            have |= {p for p, ok in done.items() if ok}
            failed = [p for p, ok in done.items() if not ok]
            if failed:
                await self._out_of_view(failed, spared)
        raise RemoteError("EAGAIN", f"{what}: its replicas kept changing; not acknowledged, send it again")

    async def _out_of_view(self, failed: list[str], spared: set[str]) -> None:
        """Expel the backups that could not be reached, unless fresh probes hear one again and
        it is not in ``spared`` yet (it joins it, and is sent the change again); for those that
        refused, read the view (they may know a newer one)."""
        refused = False
        for peer in failed:
            if peer in self.unreached:
                self.unreached.discard(peer)
                await self.cluster.heartbeats.refresh()  # its heartbeats as they are now, not as they were
                if peer not in spared and not self.cluster.liveness.is_down(peer):
                    spared.add(peer)
                    continue
                if not self.cluster.heard_majority() or not await self.serving.lease.expel(peer):
                    await self.serving.lease.refresh()
                    await trio.sleep(self.cluster.cfg.heartbeat)
            else:
                refused = True
        if refused:
            await self.serving.lease.refresh()
            await trio.sleep(self.cluster.cfg.heartbeat)  # a peer still resyncing, or a moment of views apart
