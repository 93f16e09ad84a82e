"""The data path's control calls on a PS node: commits (as a stripe's primary), applies (as a
backup), and what readers and resyncing peers ask of its stripes.

- ``commit`` (on a stripe's primary): install a staged range into the stripe under its seqlock,
  then replicate it to the stripe's backups before answering (replicator.py), so an
  acknowledged write lives on every replica the stripe targets. One lock per stripe orders
  commits, so every backup sees them in version order; a backup that is behind (it was down)
  answers ``stale`` and gets the whole stripe. A backup refuses replication from a node it
  counts down (``ESTALE``, serving.py).
- ``apply`` (on a backup): install what a primary sent, in version order, with the push
  bookkeeping and the optimizer state (sent ahead, held aside until then) that go with it.
- ``stripe_info``, ``stripes``, ``snap_copy``: a stripe's region key and version, every stripe
  held, a snapshot of every live stripe (copy-on-write: store.py).

A new stripe's versions start above any earlier stripe's of the same index (the store's
``version_base``: ``VERSION_SHIFT``).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..runtime.offload import Offload
from ..regions import VERSION_SHIFT
from ..errors import RemoteError
from .core import NodeCore
from .leading import Leading
from .missing import Missing
from .tails import Tails
from .records import PushRecords
from .rounds import RecordError, StripeTraining
from .staging import Staged, StagingRegions
from .updates import StripeKey, StripeRange, Update, check_range

log = logging.getLogger(__name__)

# (VERSION_SHIFT, regions.py: a stripe takes 2**32 writes before its versions reach the next base)


class Apply(NamedTuple):
    """One ``apply`` message: install range ``where`` (or with ``full`` the whole stripe) a
    primary staged here at ``staged`` ([rkey, offset]), in order, with the push bookkeeping
    (``record``) and the ``state`` optimizer-state stripes sent ahead (``pending``) that go with
    it (training) in the same step. ``(tag, version)``: the stamp the primary gave it
    (store.py); a range applies only on top of the stamp it was made on, ``(base_tag, version -
    1)``; a backup that holds an older stamp answers ``stale`` and gets the whole stripe.
    ``sender`` and ``epoch``: who sent it, in which view (serving.py)."""

    where: list
    staged: list
    version: int
    clock: int
    full: bool
    record: dict | None = None
    pending: bool = False
    state: int = 0
    sender: str = ""
    epoch: int = 0
    tag: int = 0
    base_tag: int = 0

    @classmethod
    def parse(cls, message: dict) -> "Apply":
        try:
            return cls(**message)
        except TypeError as exc:  # a field missing, or one it does not have
            raise RemoteError("EINVAL", f"apply: {exc}") from None


class DataPath:
    def __init__(
        self,
        core: NodeCore,
        leading: Leading,
        staging: StagingRegions,
        records: PushRecords,
        offload: Offload,
        missing: Missing,
        tails: Tails,
    ):
        """``leading``: the one update path of a primary (a commit goes through it);
        ``records``: the owner of the push bookkeeping an apply brings (``take_replicated``);
        ``offload``: how work leaves the loop (a snapshot's files, with ``--persist``);
        ``missing``: the stripes this node came back without (a read of one is told so);
        ``tails``: what it commits past a file's end, watched for a writer that is gone."""
        self.name, self.cfg, self.cluster, self.store, self.stripe_locks, self.serving = core
        self.offload, self.missing, self.tails = offload, missing, tails
        self.leading, self.staging, self.records = leading, staging, records
        # optimizer state a primary sent ahead of the parameters it goes with: installed by the
        # parameters' apply, never alone (a primary that dies between leaves both as they were)
        self.state_ahead: dict[tuple[int, int, int], tuple[bytes, int, int, int, int]] = {}

    async def rpc_stripes(self) -> dict:
        """Every stripe held, and whether this process holds all it should (``complete``:
        resync.py counts a stripe missing here as freed only then)."""
        return {"stripes": self.store.listing(), "complete": self.serving.complete}

    async def rpc_snap_copy(self, snap: int) -> dict:
        """Freeze every live stripe under snapshot id ``snap`` (a snapshot's coordinator asks
        every node, commits frozen), only once this node serves and has caught up (EAGAIN at
        once otherwise: the snapshot is taken again): a node just named by a view copied what
        it held before its hand-over, and the snapshot read a write back old (chaos, seed 7)."""
        self.serving.require_caught_up()
        frozen = self.store.take_snapshot(snap)
        self.missing.frozen(snap)  # a stripe lost here is lost in the snapshot, never a hole there
        await self.store.behind.persisted(self.offload)  # with --persist: its links on disk, off the loop
        return {"bytes": frozen}

    async def rpc_stripe_info(self, fid: int, idxs: list[int], snap: int = 0, resync: bool = False) -> dict:
        """Where stripes of ``fid`` are held here, for a one-sided read. A client reads only a
        ready node that has caught up; a peer's resync (``resync``) reads any node's copies,
        whose stamps say how new they are (after a coordinator outage every node fenced at
        once, and the newest copy may be on one still syncing)."""
        if not resync:
            self.serving.require_caught_up()  # the reader asks the other home meanwhile
        held = {str(i): (s.describe() if (s := self.store.get(fid, i, snap)) else None) for i in idxs}
        if not resync:  # a stripe lost here is not a hole (missing.py): the reader asks elsewhere, or says EIO
            for i, d in held.items():
                if d is None and (why := self.missing.why(fid, int(i), snap)) is not None:
                    held[i] = {"lost": why}
        if resync and snap == 0:  # the push bookkeeping of those bytes goes with them (resync.py)
            for i, d in held.items():
                if d is not None:
                    d["record"] = self.records.record_of(fid, int(i))
        return held | {"lease": self.serving.lease.term()}  # client/stripe.py: a key reads in its lease

    async def rpc_stripe_versions(self, stripes: list) -> dict:
        """The version of each live stripe ``[fid, idx]`` of ``stripes`` held here (0: none
        here, a hole; None: lost here, missing.py), as its header says (the word a one-sided read of it gives): what a mount
        stamps a file with at an open (fs/pagecache.py), for every stripe of a model of
        hundreds of tensors in one call rather than one read each. From a ready node that has
        caught up only (EAGAIN: the mount asks the stripe's other home)."""
        if not isinstance(stripes, list) or not all(isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in stripes):
            raise RemoteError("EINVAL", "stripe_versions: stripes is a list of [fid, idx]")
        self.serving.require_caught_up()
        return {
            "versions": [
                s.version if (s := self.store.get(fid, idx)) is not None else None if self.missing.why(fid, idx) else 0 for fid, idx in stripes
            ]
        }

    async def rpc_commit(self, fid: int, idx: int, offset: int, length: int, unit: int, staged: list, epoch: int = 0) -> dict:
        """Install the range ``staged`` ([rkey, offset] of a staging region here) as the
        stripe's primary, replicate it, answer with its version and the view epoch it was
        acknowledged in (``acked_in``: runtime/heartbeats.py, ``follow_acked``)."""
        await self.leading.admit(epoch, takeover=False)  # what it refuses at once comes first
        check_range(offset, length, unit, self.cfg.stripe_unit)
        self.serving.check_primary(fid, idx)
        staged = Staged.parse(staged, length)
        self.staging.view(staged)  # EINVAL at once for a range that is not staged here
        key = StripeKey(fid, idx)
        # under the lock, primacy and the view again: a rebalance or a hand-over may have moved
        # it meanwhile, a new view may have come, and its sender may have given it up (runtime/slots.py)
        async with self.leading.holding(key, epoch):
            data = self.staging.view(staged)
            base = self.store.get(fid, idx)
            base_tag = base.tag if base is not None else 0
            version = self.store.install(key, offset, data, unit)
            self.tails.committed(fid, idx, staged, self.store.get(fid, idx).stamp)  # past the end: watched
            self.serving.led_now((fid, idx, 0))
            stripe = self.store.get(fid, idx)
            update = Update(StripeRange(key, offset, length, unit), version, stripe, base_tag=base_tag)
            # its bytes are read as each send goes (a truncate may free it meanwhile: pinned)
            await self.leading.replicate(key, lambda peer: self.leading.replicator.update(peer, update), stripe)
        return {"version": version, "acked_in": self.cluster.roles.view_epoch}

    async def rpc_apply(self, **message) -> dict:
        """Install what a primary sent (replicator.py), an ``Apply`` (see there); EINVAL for a
        message that is not one."""
        m = Apply.parse(message)
        where, staged, version, clock, full, record, pending, state, sender, epoch, tag, base_tag = m
        await self.serving.check_epoch(epoch)
        r = StripeRange.parse(where)
        (fid, idx, snap), offset, length, unit = r
        self.serving.check_sender(sender, lambda: self.cluster.roles.stripe_primary(fid, idx))
        check_range(offset, length, unit, self.cfg.stripe_unit)
        where = Staged.parse(staged, length)
        data = self.staging.view(where)
        try:  # read before anything is installed: a malformed record changes nothing
            incoming = StripeTraining.from_record(record) if record is not None else None
        except RecordError as exc:
            raise RemoteError("EINVAL", str(exc)) from None
        if pending:  # optimizer state: kept aside until the parameters it belongs to arrive
            if snap >= 0 or not full:
                raise RemoteError("EINVAL", "only whole optimizer-state stripes are sent ahead")
            self.state_ahead[(fid, idx, snap)] = (bytes(data), version, clock, unit, tag)
            return {}
        if not 0 <= state <= 2:
            raise RemoteError("EINVAL", f"{state} optimizer-state stripes (at most 2)")
        async with self.stripe_locks((fid, idx)):
            data = self.staging.view(where)  # again: its sender may have given it up meanwhile (runtime/slots.py)
            stripe = self.store.get(fid, idx, snap)
            held = stripe.stamp if stripe else (0, 0)
            if full:
                if (tag, version) > held:
                    self.store.replace(r.key, data, unit, (tag, version), clock)
            elif held == (base_tag, version - 1) or (stripe is None and version & ((1 << VERSION_SHIFT) - 1) == 1):
                # on top of what it was made on, or the first version of a stripe the primary
                # just created (its other bytes are zeros, as a missing stripe's are here)
                self.store.install(r.key, offset, data, unit, stamp=(tag, version), clock=clock)
            elif held < (tag, version):
                return {"stale": True}
            if snap == 0 and held == (tag, version) and (clock > stripe.clock or stripe.pending and clock >= stripe.clock):
                # the same version, copied here (a resync) before its primary published its
                # clock (it may be pending, or the step may not have moved the clock: asp)
                self.store.publish_clock(fid, idx, clock)
            for k in range(1, state + 1):  # with the parameters, not before: never one without the other
                held = self.state_ahead.pop((fid, idx, -k), None)
                if held is None:
                    log.warning("stripe %d:%d: optimizer state %d did not arrive with its parameters", fid, idx, -k)
                    continue
                raw, sversion, sclock, sunit, stag = held
                mine = self.store.get(fid, idx, -k)
                if mine is None or mine.stamp < (stag, sversion):
                    self.store.replace(StripeKey(fid, idx, -k), memoryview(raw), sunit, (stag, sversion), sclock)
            if incoming is not None:
                self.records.take_replicated(fid, idx, incoming)
        return {}
