"""Training on a PS node: gradient pushes, sync policies, optimizer steps, and the push
bookkeeping that lets a backup take over. ``Training`` is one service of a node (server/node.py
builds it and hands it its collaborators: the store, the stripe locks, the serving checks, the
commit barrier, the replicator).

A client's pushes arrive fused in one WRITE with immediate (``on_imm``). The primary of each
stripe takes a push under the model's policy (rounds.py: bsp, asp, ssp, r2sp), runs the optimizer
(optim.py; state in stripes -1/-2 of the stripe) and sends the parameters, the optimizer state
(held aside by the backup until then) and the push bookkeeping to every backup in one ``apply``:
a backup that takes over holds all of one step or none of it, so a client's retry of an
unanswered push is applied exactly once. A bsp round still open lives on the primary alone; its
pushers keep their pushes until they see it closed (its clock published, once every backup holds
it) and send them again to a new primary (``train_next`` says whether it has them), so a primary
lost mid-round loses nothing either; the push that closes a round is answered once the round is
applied here, before that copy (``_push_now``). ``train_wait`` waits for held r2sp pushes;
``train_index`` and ``train_records`` hand the bookkeeping to a resyncing peer.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from collections import defaultdict
from functools import partial
from typing import Callable, NamedTuple

import numpy as np
import trio

from ..metrics import Latency
from ..names import LAYOUT_CHANGED
from ..policy import parse_policy, parse_removed, parse_timeout, parse_workers
from ..errors import PolicyError, RemoteError
from .. import packing
from . import optim
from .barrier import CommitBarrier
from .core import NodeCore
from .meta import Meta
from .rounds import Model, RecordError, StripeTraining
from .replicator import Replicator
from .staging import Staged, StagingRegions
from .store import NoSpace, pinned
from .updates import StripeKey, StripeRange, Update, check_range

log = logging.getLogger(__name__)
PACK_MARGIN_NS = 5 * 10**9  # a pack's lease, as a node reads it, lasts this much longer
RECORDS_PAGE = 4 << 20  # bytes of arrays (round sums, held pushes) in one train_records answer

_NUMBER = (int, float)


class Push(NamedTuple):
    """Gradient push ``step`` of ``rank`` for the ``count`` elements of stripe (fid, idx)
    starting at byte ``offset``, in dtype ``wire``: all of them, or with ``spans`` only the
    [start, length] element runs listed (chunk sparsification; the rest is zero). ``busy``:
    the pusher's compute time per step; ``paced``: how long it waited for its r2sp slot."""

    fid: int
    idx: int
    offset: int
    count: int
    rank: int
    step: int
    wire: str
    unit: int
    spans: list | None = None
    busy: float | None = None
    paced: float = 0.0
    epoch: int = 0  # the pusher's view epoch (serving.py, check_epoch)
    layout: int = -1  # a bucket's push: the bucket's version the pusher laid its step out by
    early: bool = False  # the pusher pulls next (a step stream): a round it closes may be answered before its backups hold it


class Trained(NamedTuple):
    """What a tensor's steps are applied with: its model's policy and ranks, its optimizer and
    its dtype (``Training.trained``)."""

    model: Model
    opt: optim.Optimizer
    dtype: np.dtype


# the types of a push descriptor's fields (``_push_args``); ``spans`` and ``busy`` may be null
PUSH_TYPES = {
    "fid": int, "idx": int, "offset": int, "count": int, "rank": int, "step": int, "unit": int,
    "wire": str, "spans": list, "busy": _NUMBER, "paced": _NUMBER, "epoch": int, "layout": int, "early": bool,
}
PUSH_REQUIRED = frozenset(k for k, p in inspect.signature(Push).parameters.items() if p.default is inspect.Parameter.empty)


def pull_timeout(x: dict[str, str]) -> float:
    """Seconds a pull waits for its step (user.irdma.timeout); EINVAL if not a number above 0."""
    try:
        return parse_timeout(x.get("user.irdma.timeout", "60"))
    except PolicyError as exc:
        raise RemoteError("EINVAL", str(exc)) from None


class Training:
    """Pushes, the ``train_*`` calls and the push bookkeeping (``records``, by (fid, idx)) of a
    node. ``meta()`` is the node's namespace as it is now (a resync replaces it)."""

    def __init__(self, core: NodeCore, meta: Callable[[], Meta], barrier: CommitBarrier, replicator: Replicator, staging: StagingRegions, latency: Latency):
        self.name, self.cfg, self.cluster, self.store, self.stripe_locks, self.serving = core
        self._meta, self.barrier, self.replicator, self.staging, self.latency = meta, barrier, replicator, staging, latency
        self.records: dict[tuple[int, int], StripeTraining] = defaultdict(StripeTraining)
        self.apply_seconds = 0.0  # optimizer steps and installs of pushed gradients
        self.pushes_applied = trio.Event()  # set (and replaced) whenever pushes may have been applied
        self._found: dict = {}  # ("model" | "policy", fid) -> what model_of / policy_info found (``_cache``)
        self._cached_for: tuple = (None, None)  # the namespace (object, stamp) they were found in

    @property
    def meta(self) -> Meta:
        return self._meta()

    def forget(self, fid: int, from_idx: int = 0, below: float = math.inf) -> None:
        """The push bookkeeping of stripes ``from_idx`` to ``below`` that are gone (their clocks
        went with them): a tensor written anew (np.save truncates first, a publish with other
        shapes) starts its training from nothing, on every replica alike."""
        for key in [k for k in self.records if k[0] == fid and from_idx <= k[1] < below]:
            del self.records[key]

    def _cache(self) -> dict:
        """What ``model_of`` and ``policy_info`` found, for the namespace as it is now: every
        namespace op moves its stamp, and a resync replaces it, either of which empties it (a
        step's thousand pushes of one model walk its directories' xattrs once, not per push)."""
        meta = self.meta
        if self._cached_for[0] is not meta or self._cached_for[1] != meta.stamp:
            self._cached_for = (meta, meta.stamp)
            self._found.clear()
        return self._found

    def model_of(self, fid: int) -> tuple[Model, optim.Optimizer, dict]:
        """The sync policy, worker count and optimizer in force for tensor ``fid``, from the
        user.irdma.* xattrs of its directories; EINVAL naming the accepted forms if malformed."""
        cache = self._cache()
        found = cache.get(("model", fid))
        if found is None:
            found = cache[("model", fid)] = self._model_of(fid)
        return found

    def trained(self, fid: int) -> Trained:
        """``model_of`` as a step applies it (the tensor's dtype for its entry)."""
        model, opt, tensor = self.model_of(fid)
        return Trained(model, opt, np.dtype(tensor["dtype"]))

    def _model_of(self, fid: int) -> tuple[Model, optim.Optimizer, dict]:
        tensor = self.meta.inode(fid).get("tensor")
        if not tensor:
            raise RemoteError("EINVAL", f"inode {fid} is not a tensor")
        x = self.meta.inherited_xattrs(fid)
        try:
            policy = parse_policy(x.get("user.irdma.sync", "bsp"))
            opt = optim.parse(x.get("user.irdma.optimizer", "sgd lr=0.01"))
            workers = parse_workers(x.get("user.irdma.workers", "1"))
            removed = parse_removed(x.get("user.irdma.removed", ""))
        except PolicyError as exc:  # (an optimizer's OptimError is one)
            log.warning("tensor %d: %s", fid, exc)
            raise RemoteError("EINVAL", str(exc)) from None
        try:
            np.dtype(tensor.get("dtype"))
        except TypeError:
            raise RemoteError("EINVAL", f"inode {fid}: tensor of unknown dtype {tensor.get('dtype')!r}") from None
        return Model(policy, workers, removed), opt, tensor

    @staticmethod
    def _gradient(staged: memoryview, count: int, wire: np.dtype, spans: list | None, work: np.dtype) -> np.ndarray:
        """The staged gradient as a dense array in the working dtype (accumulation precision),
        except that a dense float16 gradient for float32 work stays float16 (summed by
        native.acc_f16 without a temporary)."""

        def take(nbytes: int) -> memoryview:
            if nbytes > len(staged):
                raise RemoteError("EINVAL", f"push of {nbytes} bytes, {len(staged)} staged")
            return staged[:nbytes]

        if spans is None:
            dense = np.frombuffer(take(count * wire.itemsize), wire)
            # A view of the staging slot when it is in the working dtype, or float16 for
            # float32 work (the round sum takes it in one pass: native.acc_f16): whatever keeps
            # it past the push copies it (policies.StripeTraining.take/accept). Else converted now.
            return dense if wire == work or (wire, work) == (np.float16, np.float32) else dense.astype(work)
        total, end = 0, 0
        for start, length in spans:
            if not (isinstance(start, int) and isinstance(length, int)) or start < end or length < 1 or start + length > count:
                raise RemoteError("EINVAL", f"bad span [{start}, {length}] for {count} elements")
            end = start + length
            total += length
        values = np.frombuffer(take(total * wire.itemsize), wire)
        grad = np.zeros(count, work)
        pos = 0
        for start, length in spans:
            grad[start : start + length] = values[pos : pos + length]
            pos += length
        return grad

    def _check_layout(self, p: Push) -> None:
        """LAYOUT_CHANGED (the user's ESTALE) for a push against a layout that is not the
        namespace's (B2, docs/buckets.md): to a tensor packed into a bucket, or being packed
        (its lease, PACK_MARGIN_NS added for clocks that disagree: the primary that ends the
        pack judges by its own); to a bucket whose version moved since the pusher laid its
        step out (a tensor of it unpacked)."""
        node = self.meta.inodes.get(p.fid)
        if node is None and p.layout >= 0:  # a bucket freed since (its last tensor unpacked)
            raise RemoteError(LAYOUT_CHANGED, f"bucket {p.fid} is gone since the step was laid out: lay it out again")
        node = self.meta.inode(p.fid)  # (ENOENT for a file gone)
        ptr = packing.pointer(node)
        if ptr is not None and ("until" not in ptr or time.time_ns() < ptr["until"] + PACK_MARGIN_NS):
            raise RemoteError(LAYOUT_CHANGED, f"tensor {p.fid} is packed into bucket {ptr['fid']}: lay the step out again")
        if p.layout >= 0 and node["version"] != p.layout:
            raise RemoteError(LAYOUT_CHANGED, f"bucket {p.fid} changed since the step was laid out: lay it out again")

    async def rpc_train_busy(self, fids: list) -> dict:
        """Which of ``fids`` this node holds push bookkeeping of (a pack goes on only for
        tensors no rank has pushed to: client/buckets.py)."""
        if not isinstance(fids, list) or not all(type(f) is int for f in fids):
            raise RemoteError("EINVAL", "train_busy: fids is a list of inode numbers")
        want = set(fids)
        return {"busy": sorted({f for f, _ in self.records if f in want})}

    async def rpc_train_info(self, fid: int, rank: int, epoch: int = 0) -> dict:
        """The model's policy as this tensor sees it, and how many pushes of ``rank`` this node
        (a stripe primary) has taken for it; from a node that serves in the sender's view and
        has caught up (EAGAIN, ESTALE otherwise: the client asks again). A node just named by a
        view, its namespace not yet handed over, answered from its old one: ENOENT "no inode"
        for a tensor made while it was away, to a pusher (chaos --views seeds 7 and 11)."""
        await self.serving.check_epoch(epoch)
        self.serving.require_ready()
        await self.serving.await_takeover()
        model, opt, tensor = self.model_of(fid)
        pushed = max((st.next_step(rank) for (f, _), st in self.records.items() if f == fid), default=0)
        x = self.meta.inherited_xattrs(fid)
        timeout = pull_timeout(x)
        policy = {"sync": str(model.policy), "workers": model.workers, "active": model.active}
        return policy | {"pushed": pushed, "timeout": timeout, "tensor": tensor, "compress": x.get("user.irdma.compress", "none")}

    def policy_info(self, fid: int) -> dict:
        """What a pushing client caches about a tensor's model; sent back with every push."""
        cache = self._cache()
        found = cache.get(("policy", fid))
        if found is None:
            found = cache[("policy", fid)] = self._policy_info(fid)
        return found

    def _policy_info(self, fid: int) -> dict:
        model, _, _ = self.model_of(fid)
        x = self.meta.inherited_xattrs(fid)
        version = self.meta.inode(fid)["version"]  # changed: the client's cached tensor is stale
        policy = {"sync": str(model.policy), "workers": model.workers, "active": model.active}
        return policy | {"timeout": pull_timeout(x), "compress": x.get("user.irdma.compress", "none"), "version": version}

    async def on_imm(self, region, offset: int, length: int, imm: int) -> dict:
        """A client's fused pushes, delivered by one WRITE with immediate into its staging slot:
        ``imm`` bytes of JSON descriptors, then the gradients they point at. Each push gets its
        own result, so one refused push does not fail the others; the reply also carries the
        policy of every tensor involved, which keeps the client's cache fresh without calls."""
        if region is None or not 0 < imm <= length:
            raise RemoteError("EINVAL", "notification without a descriptor")
        try:
            descs = json.loads(bytes(region.buf[offset : offset + imm]))
        except (ValueError, RecursionError):
            raise RemoteError("EINVAL", "malformed push descriptor") from None
        # checked, not asserted: python -O drops asserts, and this is a peer's input
        if not isinstance(descs, list) or not all(isinstance(d, dict) for d in descs):
            raise RemoteError("EINVAL", "malformed push descriptor: not a list of objects")
        data = region.buf[offset + imm : offset + length]
        results: list[dict | None] = [None] * len(descs)
        answered = [trio.Event() for _ in descs]

        def answer(i: int, result: dict) -> None:
            if results[i] is None:
                results[i] = result
                answered[i].set()

        def failed(i: int, d: dict, result: dict) -> None:
            if results[i] is None:
                answer(i, result)
            else:  # answered once applied here: its pusher keeps it until the round is seen closed
                log.info("node %s: round of stripe %s:%s applied, not settled: %s", self.name, d.get("fid"), d.get("idx"), result["message"])

        async def one(i: int, d: dict) -> None:
            try:
                answer(i, await self._push(*self._push_args(data, d), partial(answer, i)))
            except RemoteError as exc:
                failed(i, d, {"error": exc.code, "message": exc.message})
            except NoSpace as exc:
                failed(i, d, {"error": "ENOSPC", "message": str(exc)})
            except Exception as exc:  # a fault here, not in the descriptor (checked above)
                log.exception("node %s: push to stripe %s:%s failed", self.name, d.get("fid"), d.get("idx"))
                failed(i, d, {"error": "EIO", "message": f"{type(exc).__name__}: {exc}"})
            finally:  # cancelled (the node stopping): never leave the batch waiting for it
                if results[i] is None:
                    answer(i, {"error": "EAGAIN", "message": "the node stopped before it took this push"})

        t0 = time.perf_counter()
        # in the node's nursery: a push answered once applied here (``_push_now``) settles its round
        # after this answer has gone
        for i, d in enumerate(descs):
            self.cluster.nursery.start_soon(one, i, dict(d))
        for ev_ in answered:
            await ev_.wait()
        self.latency.observe("push", time.perf_counter() - t0)
        info = {}
        for fid in {d.get("fid") for d in descs if isinstance(d.get("fid"), int)}:
            try:
                info[str(fid)] = self.policy_info(fid)
            except RemoteError:  # not a tensor (its push said so)
                pass
        return {"results": results, "info": info, "acked_in": self.cluster.roles.view_epoch}  # runtime/heartbeats.py, follow_acked

    def _push_args(self, data: memoryview, d: dict) -> tuple[memoryview, Push]:
        """A push descriptor, checked: where its gradient starts in the pushed bytes (``at``)
        and the ``Push`` it describes, every field of its type; EINVAL saying what is wrong."""
        at = d.pop("at", None)
        if not isinstance(at, int) or not 0 <= at <= len(data):
            raise RemoteError("EINVAL", f"bad push descriptor: gradient at {at!r} of {len(data)} bytes pushed")
        if not PUSH_REQUIRED <= d.keys() <= PUSH_TYPES.keys():
            missing, unknown = sorted(PUSH_REQUIRED - d.keys()), sorted(d.keys() - PUSH_TYPES.keys())
            raise RemoteError("EINVAL", f"bad push descriptor: missing {missing}, unknown {unknown}")
        wrong = [k for k, v in d.items() if not isinstance(v, PUSH_TYPES[k]) and not (v is None and k in ("spans", "busy"))]
        if wrong:
            raise RemoteError("EINVAL", f"bad push descriptor: {', '.join(wrong)} of the wrong type")
        return data[at:], Push(**d)

    async def _push(self, staged: memoryview, p: Push, answer: Callable[[dict], None]) -> dict:
        """Push ``p``, its gradient read from ``staged``, applied as the policy says;
        ``answer``: see ``_push_now``."""
        await self.serving.check_epoch(p.epoch)
        self.serving.require_ready()
        await self.serving.await_takeover()
        async with self.barrier.changing():
            return await self._push_now(staged, p, answer)

    async def _push_now(self, staged: memoryview, p: Push, answer: Callable[[dict], None]) -> dict:
        """Take push ``p`` and apply what it completes. A bsp push that closes its round is
        answered (``answer``) once its round is applied here, before it is copied to the
        backups: its answer names the clock published before it, so its pusher keeps it
        as it keeps a push to a round still open, and sends it again to a new primary should
        this one be lost before the round is settled (``_settle``); a failure to apply it here
        (NoSpace) is still answered as one. Its staged bytes are not read after the take (the
        round's sum is a copy). Without it, the pusher that closed each round waited for the
        copy to a backup behind a full link before its next batch could use the staging slot,
        and the ranks drifted apart (issue 42). Only a pusher that says it pulls next
        (``Push.early``: a step stream, whose pull waits for the published clock) is answered
        so: a push through a rank's file returns once the round it closed is on every replica,
        so that once every rank's push has returned a plain read of the model, which may go to
        a backup, sees the whole round (a checkpoint copied after training's last step had
        stripes one round behind the others). A lone rank has no
        others to fall behind: its pushes are answered once settled, with the new clock, so its
        next pull reads at once, one-sided (no ``clock_wait``)."""
        fid, idx, offset, count, rank, step, unit = p.fid, p.idx, p.offset, p.count, p.rank, p.step, p.unit
        self.serving.check_primary(fid, idx)
        self._check_layout(p)
        t = self.trained(fid)
        model, dtype = t.model, t.dtype
        if rank not in model.active:
            raise RemoteError("EINVAL", f"rank {rank} is not one of the active workers {model.active}")
        check_range(offset, count * dtype.itemsize, unit, self.cfg.stripe_unit)
        if p.wire not in ("<f2", "<f4", "<f8"):
            raise RemoteError("EINVAL", f"gradients travel as float16/32/64, not {p.wire}")
        grad = self._gradient(staged, count, np.dtype(p.wire), p.spans, optim.work_dtype(dtype))
        key = (fid, idx)
        st = self.records[key]
        async with self.stripe_locks(key):
            self.serving.check_primary(fid, idx)  # again, under the lock: a hand-over may have moved it
            self.serving.check_same_epoch(p.epoch)  # and a view may have come while it waited
            done = st.next_step(rank)
            if step < done:  # a retry of a push already taken: exactly once
                # ... and on every replica before it is answered: its first send may have been
                # answered EAGAIN because the step did not reach them (it is sent again here)
                await self._unsettled(fid, idx, st, t)
                stripe = self.store.get(fid, idx)
                return {"clock": stripe.clock if stripe is not None else st.clock(model), "pushed": done, "duplicate": True}
            if step > done:
                log.warning("push %d of rank %d to stripe %d:%d refused: %d taken so far", step, rank, fid, idx, done)
                raise RemoteError("EINVAL", f"rank {rank} pushed {done} times; push {step} is out of order")
            st.span = (offset, count, unit)
            st.observe(rank, p.busy)
            now = trio.current_time()
            st.arrive(rank, step, now, p.paced)
            ups = st.take(model, rank, step, grad)
            early = None
            if ups and p.early and model.policy.kind == "bsp" and len(model.active) > 1:
                early = lambda: answer(self._reply(st, model, rank, step, now, clock=self.store.get(fid, idx).clock))  # noqa: E731
            await self._settle(fid, idx, st, t, ups, applied=early)
            reply = self._reply(st, model, rank, step, now)
        self._signal_applied()
        return reply

    @staticmethod
    def _reply(st: StripeTraining, model: Model, rank: int, step: int, now: float, clock: int | None = None) -> dict:
        """The answer to push ``step`` of ``rank``: the stripe's clock (``clock``: as readers
        see it, for an answer before the publish), its push count, and under r2sp whether it is
        held and when its next slot is."""
        return {
            "clock": st.clock(model) if clock is None else clock,
            "pushed": step + 1,
            "held": step >= st.pushed.get(rank, 0),  # r2sp: taken, applied when its turn comes
            "slot_in": round(st.slot_in(model, rank, now), 6),  # r2sp: wait this long before the next push
            "busy": {str(r): round(v, 6) for r, v in st.busy.items()},  # compute time per step
        }

    async def rpc_train_next(self, fid: int, idx: int, rank: int) -> dict:
        """The step of ``rank``'s next push to this stripe, as its primary counts: a client
        whose push sat in a round that did not close asks before sending it again."""
        self.serving.require_ready()
        await self.serving.await_takeover()
        self.serving.check_primary(fid, idx)
        st = self.records[(fid, idx)]
        if st.span[2]:
            t = self.trained(fid)
            async with self.stripe_locks((fid, idx)):
                self.serving.check_primary(fid, idx)
                await self._unsettled(fid, idx, st, t)
        return {"next": st.next_step(rank)}

    async def _unsettled(self, fid: int, idx: int, st: StripeTraining, t: Trained) -> None:
        """A step applied here whose replication failed (its clock unpublished: ``_settle``) is
        sent to every replica again and published. Called with the stripe's lock held."""
        stripe = self.store.get(fid, idx)
        if stripe is not None and st.span[2] and (stripe.clock < st.clock(t.model) or stripe.pending):
            await self._settle(fid, idx, st, t, [])

    def _signal_applied(self) -> None:
        """Wake whoever waits for pushes to be applied (``train_wait``)."""
        self.pushes_applied.set()
        self.pushes_applied = trio.Event()

    async def rpc_train_wait(self, fid: int, idx: int, rank: int, pushed: int, timeout: float) -> dict:
        """Until ``pushed`` pushes of ``rank`` to this stripe have been applied (an r2sp push is
        held until its turn); ETIMEDOUT after ``timeout`` seconds."""
        if not isinstance(timeout, _NUMBER) or not timeout >= 0:
            raise RemoteError("EINVAL", f"train_wait: timeout {timeout!r} is not a number of seconds")
        st = self.records[(fid, idx)]
        with trio.move_on_after(timeout):
            while st.pushed.get(rank, 0) < pushed:
                await self.pushes_applied.wait()
            return {"pushed": st.pushed.get(rank, 0)}
        raise RemoteError("ETIMEDOUT", f"rank {rank}'s push {pushed - 1} not applied within {timeout}s")

    async def _settle(self, fid: int, idx: int, st: StripeTraining, t: Trained, updates: list, applied: Callable[[], None] | None = None) -> None:
        """Apply ``updates`` in one install, replicate them with the stripe's new clock, and
        only then publish that clock here. Called with the stripe's lock held. ``applied()`` is
        called once the updates are installed here, before the copy to the backups (the early
        answer of ``_push_now``): a failure to install them (NoSpace) is still its pusher's.

        A pull waits for the clock and then reads the parameters (from any replica), and a
        pusher forgets a round's piece once a pull has seen the round closed: were the clock
        published before every backup held the step, a primary lost in between would take the
        round with it, its pieces forgotten (a dirty read; found by CI's soak: "push 13 is out
        of order" after a kill). Should the step not reach every replica (EAGAIN: this node no
        longer leads, a backup refused, the replicas kept changing; or the call was cancelled),
        the clock stays unpublished: no pull takes the round for closed, its pushers keep their
        pieces, and the next push, a retry (answered "duplicate") or a ``train_next`` sends the
        step again before anything is answered (``_unsettled``); a fence's resync settles it
        otherwise."""
        offset, count, unit = st.span
        model, opt, dtype = t
        clock = st.clock(model)
        stripe = self.store.get(fid, idx)
        if stripe is None:
            raise RemoteError("EINVAL", f"tensor {fid} has no data in stripe {idx}")
        # The push bookkeeping goes to the backups with the parameters it produced, in the same
        # apply: a backup that takes over then holds both or neither, so a client's retry of an
        # unanswered push is applied exactly once (duplicate if it was, anew if it was not).
        if not updates and stripe.clock == clock and not stripe.pending:  # a push taken, nothing to apply yet
            if model.policy.kind == "bsp":
                # It only adds to an open round, whose sum stays here: the backups learn of
                # the round when it is applied (the record goes with the parameters). Until
                # then each pushing client keeps its push and sends it again to whoever is
                # primary if the round does not close (client/training.py, PushPull._repush_open): the sum of a
                # round is never copied to the backups, which would cost as many bytes as
                # the gradients themselves, W-1 times per step.
                return
            await self._replicate_record(fid, idx, st)  # an r2sp push held for its turn
            return
        record = st.record()
        base_tag = stripe.tag
        t0 = time.perf_counter()

        def step(view: memoryview) -> None:
            self._apply_updates(fid, idx, np.frombuffer(view, dtype), updates, opt, unit)

        # the bytes hold the step before its clock is published: readers that want a tensor
        # all of one step see that in the header (regions.PENDING) and wait for the publish
        where = StripeRange(StripeKey(fid, idx), offset, count * dtype.itemsize, unit)
        self.store.update(where, step if updates else None, pending=bool(updates))
        self.serving.led_now((fid, idx, 0))
        self.apply_seconds += time.perf_counter() - t0
        nstate = len(opt.state_names) if updates else 0
        if applied is not None:
            applied()
        await self._replicate_training(where, nstate, record, base_tag, clock)
        self.store.publish_clock(fid, idx, clock)

    async def _replicate_record(self, fid: int, idx: int, st: StripeTraining) -> None:
        """The push bookkeeping of a stripe to its backups when a push was taken but nothing
        applied: an r2sp push held for its turn (a bsp round stays on the primary, see
        ``_settle``). Its held arrays travel as raw bytes through the backup's staging
        (one-sided WRITE, then the call naming them), not as base64 inside the call: they are
        as many bytes as the gradients themselves. Called with the stripe's lock held, so the
        arrays do not change while they are sent."""
        blobs: list[np.ndarray] = []
        record = st.record(blobs)
        views = [memoryview(b).cast("B") for b in blobs]
        key = StripeKey(fid, idx)
        await self.replicator.to_every_target(key, lambda peer: self.replicator.record(peer, key, record, views, st.record))

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
        self.records[(fid, idx)].restore(incoming)

    def record_of(self, fid: int, idx: int) -> dict | None:
        """The push bookkeeping of a stripe as it travels with the stripe's bytes to a peer that
        copies them (``DataPath.rpc_stripe_info`` for a resync); None if it took no push."""
        st = self.records.get((fid, idx))
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
            self.records[(fid, idx)].restore(incoming)

    def drop_record(self, fid: int, idx: int) -> None:
        """A stripe's bookkeeping goes with its bytes: they were freed (a truncate a resync
        found), or replaced by a peer's copy that took no push (``take_fetched``)."""
        self.records.pop((fid, idx), None)

    async def recheck(self) -> None:
        """The set of active ranks changed: rounds waiting for a removed rank complete, clocks
        move on, and r2sp turns skip it."""
        for (fid, idx), st in list(self.records.items()):
            if self.cluster.roles.stripe_primary(fid, idx) != self.name or not st.span[2]:
                continue
            try:
                t = self.trained(fid)
            except RemoteError:
                continue
            try:
                async with self.stripe_locks((fid, idx)):
                    if self.cluster.roles.stripe_primary(fid, idx) != self.name:
                        continue  # handed over meanwhile
                    updates = st.release(t.model) + st.complete_rounds(t.model)
                    await self._settle(fid, idx, st, t, updates)
            except RemoteError as exc:  # not on every replica (EAGAIN): sent again by the next push
                log.warning("stripe %d:%d: rounds completed by the new set of ranks not replicated: %s", fid, idx, exc)
        self._signal_applied()

    def _apply_updates(self, fid: int, idx: int, param: np.ndarray, grads: list[np.ndarray], opt: optim.Optimizer, unit: int) -> None:
        """Optimizer steps on ``param`` (in place); the state lives in stripes -1, -2 of the
        stripe, whose clock word counts the steps taken (Adam's t)."""
        n = len(param)
        wd = optim.work_dtype(param.dtype)
        state, t = {}, 0
        for k, name in enumerate(opt.state_names, 1):
            s = self.store.get(fid, idx, -k)
            if s is not None and s.capacity >= n * wd.itemsize:
                state[name] = np.frombuffer(s.data[: n * wd.itemsize], wd).copy()
                t = s.clock
            else:
                state[name] = np.zeros(n, wd)
        for grad in grads:
            t += 1
            optim.step(opt, param, grad, state, t)
        for k, name in enumerate(opt.state_names, 1):
            self.store.install(StripeKey(fid, idx, -k), 0, memoryview(state[name]).cast("B"), 2 * unit, clock=t)

    async def _replicate_training(self, where: StripeRange, nstate: int, record: dict | None, base_tag: int, clock: int) -> None:
        """Optimizer state (held aside by each backup), then the parameters with version,
        ``clock`` and push bookkeeping, whose apply installs the state too: a backup that takes
        over holds all of one step or none of it. ``base_tag``: the tag of the version the step
        was made on."""
        fid, idx, _ = where.key
        unit = where.unit
        stripe = self.store.get(fid, idx)
        params = Update(where, stripe.version, stripe, record=record, state=nstate, base_tag=base_tag, clock=clock)

        async def one(peer: str) -> bool:
            for k in range(1, nstate + 1):
                s = self.store.get(fid, idx, -k)
                state = Update(StripeRange(StripeKey(fid, idx, -k), 0, s.capacity, 2 * unit), s.version, s, pending=True, full=True)
                with pinned(s):
                    if not await self.replicator.update(peer, state):
                        return False
            return await self.replicator.update(peer, params)

        with pinned(stripe):  # the Updates' bytes are read as each send goes (store.py)
            await self.replicator.to_every_target(StripeKey(fid, idx), one)

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
        for fid, idx in sorted(k for k in self.records if after is None or k > after):
            st = self.records.get((fid, idx))
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
                        self.records[(fid, idx)].restore(incoming)

    def would_take(self, fid: int, idx: int, stamp: tuple | None, progress: int) -> bool:
        """``take_records``' rule for a peer's record of stripe (fid, idx): it describes the
        bytes this node holds (``stamp``, None: the peer holds none) and counts more pushes
        than this node's own record (a resync's index is filtered by it too: server/resync.py)."""
        held = self.store.get(fid, idx)
        if held is None or stamp is None or stamp != held.stamp:
            return False
        own = self.records.get((fid, idx))
        return progress > (own.progress if own is not None else 0)

    def record_index(self) -> list:
        """Every record that took pushes as ``[fid, idx, stamp, progress, bytes]``, without its
        arrays: ``stamp`` the (tag, version) of the bytes here it describes (None if this node
        holds none), ``progress`` its pushes taken, ``bytes`` its arrays' size. What a resyncing
        peer reads first, to fetch only the records it would take (server/resync.py)."""
        out = []
        for (fid, idx), st in self.records.items():
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
