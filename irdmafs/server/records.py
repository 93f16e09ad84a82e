"""The push bookkeeping of a PS node: ``PushRecords``, a ``StripeTraining`` (rounds.py) per stripe
that took pushes, and every rule of how it travels.

A stripe's record goes with its bytes, never without them:

- to the backups with the parameters a step produced (training.py, in the same ``apply``), or
  alone when a push was taken and nothing applied (an r2sp push held for its turn:
  ``replicate``, its arrays as raw bytes through the backup's staging); a backup takes the
  primary's word (``take_replicated``);
- to a resyncing peer with the bytes it copies (``record_of``), or in pages of at most
  ``RECORDS_PAGE`` bytes of arrays (``train_index``, then ``train_records``), taken only if it
  describes the bytes held there and counts more pushes (``take_records``, ``would_take``);
- dropped with the bytes (``drop_record``), or replaced with a peer's copy of other bytes
  (``take_fetched``); a tensor written anew forgets its stripes' records (``forget``).

A malformed record from a peer is EINVAL and changes nothing (``StripeTraining.from_record``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterator

import numpy as np

from ..errors import RemoteError
from .core import NodeCore
from .leading import Leading
from .rounds import RecordError, StripeTraining
from .staging import Staged, StagingRegions
from .updates import StripeKey

RECORDS_PAGE = 4 << 20  # bytes of arrays (round sums, held pushes) in one train_records answer


class PushRecords:
    """Every stripe's push bookkeeping here (``by_stripe``, by (fid, idx)) and the calls that
    move it between nodes."""

    def __init__(self, core: NodeCore, staging: StagingRegions, leading: Leading):
        self.cluster, self.store, self.stripe_locks, self.serving = core.cluster, core.store, core.locks, core.serving
        self.staging, self.leading = staging, leading
        self.by_stripe: dict[tuple[int, int], StripeTraining] = defaultdict(StripeTraining)

    def of(self, fid: int, idx: int) -> StripeTraining:
        """Stripe (fid, idx)'s bookkeeping (empty until it takes a push)."""
        return self.by_stripe[(fid, idx)]

    def items(self) -> Iterator[tuple[tuple[int, int], StripeTraining]]:
        """Every stripe's bookkeeping, as a list (the caller may wait between them)."""
        return iter(list(self.by_stripe.items()))

    def next_step(self, fid: int, rank: int) -> int:
        """The step of ``rank``'s next push to tensor ``fid`` as the stripes held here count."""
        return max((st.next_step(rank) for (f, _), st in self.by_stripe.items() if f == fid), default=0)

    def forget(self, fid: int, from_idx: int = 0, below: float = math.inf) -> None:
        """The push bookkeeping of stripes ``from_idx`` to ``below`` that are gone (their clocks
        went with them): a tensor written anew (np.save truncates first, a publish with other
        shapes) starts its training from nothing, on every replica alike."""
        for key in [k for k in self.by_stripe if k[0] == fid and from_idx <= k[1] < below]:
            del self.by_stripe[key]

    async def rpc_train_busy(self, fids: list) -> dict:
        """Which of ``fids`` this node holds push bookkeeping of (a pack goes on only for
        tensors no rank has pushed to: client/buckets.py)."""
        if not isinstance(fids, list) or not all(type(f) is int for f in fids):
            raise RemoteError("EINVAL", "train_busy: fids is a list of inode numbers")
        want = set(fids)
        return {"busy": sorted({f for f, _ in self.by_stripe if f in want})}

    async def replicate(self, fid: int, idx: int, st: StripeTraining) -> None:
        """The push bookkeeping of a stripe to its backups when a push was taken but nothing
        applied: an r2sp push held for its turn (a round of a policy with ``rounds`` stays on
        the primary: training.py ``_settle``). Its held arrays travel as raw bytes through the backup's staging
        (one-sided WRITE, then the call naming them), not as base64 inside the call: they are
        as many bytes as the gradients themselves. Called with the stripe's lock held, so the
        arrays do not change while they are sent."""
        blobs: list[np.ndarray] = []
        record = st.record(blobs)
        views = [memoryview(b).cast("B") for b in blobs]
        key = StripeKey(fid, idx)
        await self.leading.replicate(key, lambda peer: self.leading.replicator.record(peer, key, record, views, st.record))

    async def rpc_train_record(
        self, fid: int, idx: int, record: dict, lengths: list | None = None, staged: list | None = None, sender: str = "", epoch: int = 0
    ) -> dict:
        """A backup keeps the primary's push bookkeeping for a stripe (to take over with it);
        its arrays, if ``lengths`` are given, were staged at ``staged`` ([rkey, offset] of a
        staging region here) in that order."""
        await self.serving.check_epoch(epoch)
        self.serving.check_sender(sender, lambda: self.cluster.roles.stripe_primary(fid, idx))
        blobs = None
        if lengths:
            if not all(isinstance(n, int) and n >= 0 for n in lengths):
                raise RemoteError("EINVAL", "bad record array lengths")
            data = self.staging.view(Staged.parse(staged, sum(lengths)))
            blobs, at = [], 0
            for n in lengths:
                blobs.append(data[at : at + n])
                at += n
        try:
            incoming = StripeTraining.from_record(record, blobs)
        except RecordError as exc:
            raise RemoteError("EINVAL", str(exc)) from None
        async with self.stripe_locks((fid, idx)):
            self.take_replicated(fid, idx, incoming)
        return {}

    # -- the push bookkeeping from elsewhere: one owner, the rules written here ------------------
    def take_replicated(self, fid: int, idx: int, incoming: StripeTraining) -> None:
        """The record a stripe's primary sent with a change (an apply, or a held push's
        ``train_record``), under the stripe lock: taken as it comes. The primary decides, as it
        decides the version it sends with it: a backup's own record may be further along only
        with pushes no view acknowledged (an old primary's), which the primary's word undoes."""
        self.by_stripe[(fid, idx)].restore(incoming)

    def record_of(self, fid: int, idx: int) -> dict | None:
        """The push bookkeeping of a stripe as it travels with the stripe's bytes to a peer that
        copies them (datapath.py ``rpc_stripe_info`` for a resync); None if it took no push."""
        st = self.by_stripe.get((fid, idx))
        return st.record() if st is not None and st.span[2] else None

    def take_fetched(self, fid: int, idx: int, incoming: StripeTraining | None) -> None:
        """This node's copy of a stripe was replaced by a peer's copy of another version (a
        resync, a catch-up): its bookkeeping is that peer's, read with those bytes (None: the
        peer's took no push), whether it counts more pushes or fewer. Under the stripe lock.
        Bookkeeping kept from the old bytes, or taken later from a peer whose bytes had moved
        on, can count fewer pushes than the bytes hold: a round applied before a fence was
        sent again and applied twice (tests/unit/test_training_resync.py)."""
        if incoming is None:
            self.drop_record(fid, idx)
        else:
            self.by_stripe[(fid, idx)].restore(incoming)

    def drop_record(self, fid: int, idx: int) -> None:
        """A stripe's bookkeeping goes with its bytes: they were freed (a truncate a resync
        found), or replaced by a peer's copy that took no push (``take_fetched``)."""
        self.by_stripe.pop((fid, idx), None)

    def wire_records(
        self, keys: set[tuple[int, int]] | None = None, after: tuple[int, int] | None = None, limit: int | None = None, blobs: list | None = None
    ) -> tuple[list, list | None]:
        """The push bookkeeping of every stripe that took pushes (of ``keys`` only, if given)
        as it travels: ``[fid, idx, record, stamp]`` each, ``stamp`` the (tag, version) of the
        bytes here that the record describes (None if this node holds none). In key order from
        past ``after``, and once ``limit`` bytes of arrays are in, no more: returns the records
        and the key to go on after (None when they were the last). With ``blobs``, arrays are
        appended there, not encoded (``StripeTraining.record``)."""
        out, size = [], 0
        for fid, idx in sorted(k for k in self.by_stripe if after is None or k > after):
            st = self.by_stripe.get((fid, idx))
            if st is None or not st.span[2] or keys is not None and (fid, idx) not in keys:
                continue
            if limit is not None and out and size + st.payload_bytes > limit:
                return out, out[-1][:2]
            stripe = self.store.get(fid, idx)
            out.append([fid, idx, st.record(blobs), list(stripe.stamp) if stripe is not None else None])
            size += st.payload_bytes
        return out, None

    async def take_records(self, records: list, mine: Callable[[int, int], bool] = lambda fid, idx: True, blobs: list | None = None) -> None:
        """A peer's ``wire_records`` (a resync, a hand-over's catch-up): each stripe's
        bookkeeping for which ``mine`` holds, only if it describes the bytes this node holds
        (the same stamp: a record goes with its bytes, never without them) and that peer has
        taken more pushes of it (never go back: unlike ``take_replicated``, no peer here decides
        for this node). A peer's record of other bytes may count a push its old primary took
        and never got acknowledged: taken with this node's bytes, which lack that push, the
        client's retry of it was answered as a duplicate and the gradient lost (fault
        simulator, mixed seed 1988, a primary held while it applied a push)."""
        for fid, idx, rec, *stamp in records:
            if mine(fid, idx):
                incoming = StripeTraining.from_record(rec, blobs)
                async with self.stripe_locks((fid, idx)):
                    if self.would_take(fid, idx, tuple(stamp[0]) if stamp and stamp[0] is not None else None, incoming.progress):
                        self.by_stripe[(fid, idx)].restore(incoming)

    def would_take(self, fid: int, idx: int, stamp: tuple | None, progress: int) -> bool:
        """``take_records``' rule for a peer's record of stripe (fid, idx): it describes the
        bytes this node holds (``stamp``, None: the peer holds none) and counts more pushes
        than this node's own record (a resync's index is filtered by it too: server/resync.py)."""
        held = self.store.get(fid, idx)
        if held is None or stamp is None or stamp != held.stamp:
            return False
        own = self.by_stripe.get((fid, idx))
        return progress > (own.progress if own is not None else 0)

    def record_index(self) -> list:
        """Every record that took pushes as ``[fid, idx, stamp, progress, bytes]``, without its
        arrays: ``stamp`` the (tag, version) of the bytes here it describes (None if this node
        holds none), ``progress`` its pushes taken, ``bytes`` its arrays' size. What a resyncing
        peer reads first, to fetch only the records it would take (server/resync.py)."""
        out = []
        for (fid, idx), st in self.by_stripe.items():
            if st.span[2]:
                stripe = self.store.get(fid, idx)
                out.append([fid, idx, list(stripe.stamp) if stripe is not None else None, st.progress, st.payload_bytes])
        return out

    async def rpc_train_index(self) -> dict:
        """``record_index``, for a resync."""
        return {"index": self.record_index()}

    async def rpc_train_records(self, after: list | None = None, keys: list | None = None) -> dict:
        """One page of ``wire_records`` (at most ``RECORDS_PAGE`` bytes of arrays) from past key
        ``after``, of the stripes ``keys`` ([fid, idx] each) only if given (a resync's);
        ``next``: the ``after`` of the next page, or None."""
        pair = lambda k: isinstance(k, list) and len(k) == 2 and all(type(x) is int for x in k)  # noqa: E731
        if after is not None and not pair(after):
            raise RemoteError("EINVAL", f"train_records: after is [fid, idx], not {after!r}")
        if keys is not None and not (isinstance(keys, list) and all(pair(k) for k in keys)):
            raise RemoteError("EINVAL", "train_records: keys is a list of [fid, idx]")
        records, more = self.wire_records({tuple(k) for k in keys} if keys is not None else None, tuple(after) if after else None, RECORDS_PAGE)
        return {"records": records, "next": more}
