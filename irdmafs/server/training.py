"""The round on a PS node: a push taken under its model's sync policy, the optimizer steps it
completes, and their replication. ``Training`` is one service of a node (server/node.py builds it
and hands it its collaborators: the store, the stripe locks, the serving checks, ``Leading``: the
one update path of a primary, the push bookkeeping ``PushRecords``). Pushes arrive through
pushes.py (``PushIntake``), which hands each checked ``Push`` to ``push``.

The primary of each
stripe takes a push under the model's policy (rounds.py: bsp, asp, ssp, r2sp), runs the optimizer
(optim.py; state in stripes -1/-2 of the stripe) and sends the parameters, the optimizer state
(held aside by the backup until then) and the push bookkeeping to every backup in one ``apply``:
a backup that takes over holds all of one step or none of it, so a client's retry of an
unanswered push is applied exactly once. A bsp round still open lives on the primary alone; its
pushers keep their pushes until they see it closed (its clock published, once every backup holds
it) and send them again to a new primary (``train_next`` says whether it has them), so a primary
lost mid-round loses nothing either; the push that closes a round is answered once the round is
applied here, before that copy (``_push_now``). ``train_wait`` waits for held r2sp pushes;
records.py hands the bookkeeping to backups and resyncing peers.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import numpy as np
import trio

from ..names import LAYOUT_CHANGED
from ..policy import parse_policy, parse_removed, parse_timeout, parse_workers
from ..errors import PolicyError, RemoteError
from .. import packing
from . import optim
from .core import NodeCore
from .leading import Leading
from .meta import Meta
from .pushes import Push, gradient
from .records import PushRecords
from .rounds import Averaged, Model, StripeTraining
from .sums import RoundSums
from .updates import StripeKey, StripeRange, Update, check_range

log = logging.getLogger(__name__)
PACK_MARGIN_NS = 5 * 10**9  # a pack's lease, as a node reads it, lasts this much longer

_NUMBER = (int, float)


class Trained(NamedTuple):
    """What a tensor's steps are applied with: its model's policy and ranks, its optimizer and
    its dtype (``Training.trained``)."""

    model: Model
    opt: optim.Optimizer
    dtype: np.dtype


def pull_timeout(x: dict[str, str]) -> float:
    """Seconds a pull waits for its step (user.irdma.timeout); EINVAL if not a number above 0."""
    try:
        return parse_timeout(x.get("user.irdma.timeout", "60"))
    except PolicyError as exc:
        raise RemoteError("EINVAL", str(exc)) from None


class Training:
    """Pushes taken, rounds applied, and the ``train_info``, ``train_next`` and ``train_wait``
    calls of a node. ``meta()`` is the node's namespace as it is now (a resync replaces it)."""

    def __init__(self, core: NodeCore, meta: Callable[[], Meta], leading: Leading, records: PushRecords):
        self.name, self.cfg, self.cluster, self.store, self.stripe_locks, self.serving = core
        self._meta, self.leading, self.records = meta, leading, records
        self.apply_seconds = 0.0  # optimizer steps and installs of pushed gradients
        self.sums = RoundSums(self.store.budget)  # the rounds' accumulators, counted (sums.py)
        self.pushes_applied = trio.Event()  # set (and replaced) whenever pushes may have been applied
        self._found: dict = {}  # ("model" | "policy", fid) -> what model_of / policy_info found (``_cache``)
        self._cached_for: tuple = (None, None)  # the namespace (object, stamp) they were found in

    @property
    def meta(self) -> Meta:
        return self._meta()

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

    async def rpc_train_info(self, fid: int, rank: int, epoch: int = 0) -> dict:
        """The model's policy as this tensor sees it, and how many pushes of ``rank`` this node
        (a stripe primary) has taken for it; from a node that serves in the sender's view and
        has caught up (EAGAIN, ESTALE otherwise: the client asks again). A node just named by a
        view, its namespace not yet handed over, answered from its old one: ENOENT "no inode"
        for a tensor made while it was away, to a pusher (chaos --views seeds 7 and 11)."""
        await self.leading.admit(epoch)
        model, opt, tensor = self.model_of(fid)
        pushed = self.records.next_step(fid, rank)
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

    async def push(self, staged: memoryview, p: Push, answer: Callable[[dict], None]) -> dict:
        """Push ``p``, its gradient read from ``staged``, applied as the policy says;
        ``answer``: see ``_push_now``."""
        await self.leading.admit(p.epoch)
        async with self.leading.changing():  # its checks below read what a freeze's wait may change
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
        grad = gradient(staged, count, np.dtype(p.wire), p.spans, optim.work_dtype(dtype))
        st = self.records.of(fid, idx)
        async with self.leading.locked(StripeKey(fid, idx), p.epoch):  # again, under the lock: still its primary, in its view
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
            ups = st.take(model, rank, step, grad, self.sums)
            early = None
            if ups and p.early and model.policy.rounds and len(model.active) > 1:
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
        await self.leading.admit(None)
        self.serving.check_primary(fid, idx)
        st = self.records.of(fid, idx)
        if st.span[2]:
            t = self.trained(fid)
            # what was applied before a freeze is only sent again: not held by the commit barrier
            async with self.leading.holding(StripeKey(fid, idx), None, frozen=False):
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
        st = self.records.of(fid, idx)
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
            if model.policy.rounds:
                # It only adds to an open round, whose sum stays here: the backups learn of
                # the round when it is applied (the record goes with the parameters). Until
                # then each pushing client keeps its push and sends it again to whoever is
                # primary if the round does not close (client/training.py, PushPull._repush_open): the sum of a
                # round is never copied to the backups, which would cost as many bytes as
                # the gradients themselves, W-1 times per step.
                return
            await self.records.replicate(fid, idx, st)  # an r2sp push held for its turn
            return
        record = st.record()
        base_tag = stripe.tag
        t0 = time.perf_counter()

        prior = self._state_before(fid, idx, opt, count * optim.work_dtype(dtype).itemsize, unit) if updates else ([], 0)

        def step(view: memoryview) -> None:
            self._apply_updates(fid, idx, np.frombuffer(view, dtype), updates, opt, unit, prior)
        # the bytes hold the step before its clock is published: readers that want a tensor
        # all of one step see that in the header (regions.PENDING) and wait for the publish
        where = StripeRange(StripeKey(fid, idx), offset, count * dtype.itemsize, unit)
        self.store.update(where, step if updates else None, pending=bool(updates))
        st.recycle(updates, self.sums)  # its sums are spares now (sums.py S2)
        self.serving.led_now((fid, idx, 0))
        self.apply_seconds += time.perf_counter() - t0
        nstate = len(opt.state_names) if updates else 0
        if applied is not None:
            applied()
        await self._replicate_training(where, nstate, record, base_tag, clock)
        self.store.publish_clock(fid, idx, clock)

    async def recheck(self) -> None:
        """The set of active ranks changed: rounds waiting for a removed rank complete, clocks
        move on, and r2sp turns skip it."""
        for (fid, idx), st in self.records.items():
            if self.cluster.roles.stripe_primary(fid, idx) != self.name or not st.span[2]:
                continue
            try:
                t = self.trained(fid)
            except RemoteError:
                continue
            try:  # the node's own consequence of a namespace op: under the stripe lock, not through Leading (leading.py)
                async with self.stripe_locks((fid, idx)):
                    if self.cluster.roles.stripe_primary(fid, idx) != self.name:
                        continue  # handed over meanwhile
                    updates = st.release(t.model, self.sums) + st.complete_rounds(t.model)
                    await self._settle(fid, idx, st, t, updates)
            except RemoteError as exc:  # not on every replica (EAGAIN): sent again by the next push
                log.warning("stripe %d:%d: rounds completed by the new set of ranks not replicated: %s", fid, idx, exc)
        self._signal_applied()

    def _state_before(self, fid: int, idx: int, opt: optim.Optimizer, nbytes: int, unit: int) -> tuple[list[bool], int]:
        """Before a step: which state stripes (-1, -2) hold ``nbytes`` of state (one missing or
        too small, the stripe's first step, starts from zeros) and the steps taken (Adam's t,
        their clock word); then their memory made ready, so NoSpace comes before any byte of the
        step changed."""
        held = [self.store.get(fid, idx, -k) for k in range(1, len(opt.state_names) + 1)]
        ok = [s is not None and s.capacity >= nbytes for s in held]
        t = next((s.clock for s, good in zip(reversed(held), reversed(ok)) if good), 0)
        for k in range(1, len(held) + 1):
            self.store.ensure(fid, idx, nbytes, 2 * unit, -k, based=True)
        return ok, t

    def _apply_updates(
        self, fid: int, idx: int, param: np.ndarray, updates: list[Averaged], opt: optim.Optimizer, unit: int, prior: tuple[list[bool], int]
    ) -> None:
        """Optimizer steps on ``param`` (in place), each averaging its update as it reads it;
        the state lives in stripes -1, -2 of the stripe, whose clock word counts the steps taken
        (Adam's t), and is changed in place under their seqlocks, nested in the parameters'
        (store.py ``update``): no copy out and back. ``prior``: ``_state_before``'s answer."""
        wd = optim.work_dtype(param.dtype)
        nbytes = len(param) * wd.itemsize
        names = opt.state_names
        ok, t = prior
        state: dict[str, np.ndarray] = {}

        def with_state(k: int) -> None:
            if k == len(names):
                for i, u in enumerate(updates, 1):
                    optim.step(opt, param, u.total, state, t + i, div=u.count)
                return

            def take(view: memoryview) -> None:
                state[names[k]] = np.frombuffer(view, wd)
                if not ok[k]:
                    state[names[k]][:] = 0
                with_state(k + 1)

            self.store.update(StripeRange(StripeKey(fid, idx, -(k + 1)), 0, nbytes, 2 * unit), take, clock=t + len(updates))

        with_state(0)

    async def _replicate_training(self, where: StripeRange, nstate: int, record: dict | None, base_tag: int, clock: int) -> None:
        """Optimizer state (held aside by each backup), then the parameters with version,
        ``clock`` and push bookkeeping, whose apply installs the state too: a backup that takes
        over holds all of one step or none of it. ``base_tag``: the tag of the version the step
        was made on."""
        fid, idx, _ = where.key
        unit = where.unit
        stripe = self.store.get(fid, idx)
        params = Update(where, stripe.version, stripe, record=record, state=nstate, base_tag=base_tag, clock=clock)

        states = [self.store.get(fid, idx, -k) for k in range(1, nstate + 1)]
        replicator = self.leading.replicator

        async def one(peer: str) -> bool:
            for k, s in enumerate(states, 1):
                state = Update(StripeRange(StripeKey(fid, idx, -k), 0, s.capacity, 2 * unit), s.version, s, pending=True, full=True)
                if not await replicator.update(peer, state):
                    return False
            return await replicator.update(peer, params)

        # the Updates' bytes are read as each send goes: their stripes pinned until then (store.py)
        await self.leading.replicate(StripeKey(fid, idx), one, stripe, *states)

