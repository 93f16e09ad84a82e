"""A client's side of training: pushes, pulls and their bookkeeping (``Client.training``).

A push sends each stripe's part of a gradient to that stripe's primary, fused with the rank's
other pieces in one WRITE with immediate when transfers queue (``_fused``; queued pieces leave
lowest ``order`` first, a step's pushes in the model's order), and follows the primary when it
moves; the primary counts each rank's pushes, so a retried push is taken once.
A push is identified by (tensor, rank, step), the step from this client's own count
(``next_step``), never renumbered from a server's: a server that has taken fewer refuses it as out
of order (EINVAL), and a piece of a new step answered "duplicate" on its first send was pushed by
another process as this rank (EINVAL too), so no gradient ever silently takes another's place. A
push that failed is sent again with the same id by calling ``push`` again with the same gradient.
Under bsp a piece that joined a round still open is kept (``_open``) until the round closes, and
sent again if the primary is lost first (``_repush_open``, called by StripeIO when a pull's
stripe clock stops moving). A pull reads the parameters one-sidedly once the stripes' clocks
allow it (``pull_into``; ``pull_many`` for many small tensors at once, their stripes read in
bursts per node). Policies and push counts are cached per tensor and rank (``train_info``),
refreshed every TRAIN_INFO_TTL seconds (a push takes them at any age) or by push replies, and
dropped when a node restarts.

Collaborators, handed in by the Client: the cluster view, its staging pool and StripeIO, its
``getattr`` and its ``call_following`` (a control call that follows a moving primary).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from typing import Awaitable, Callable

import numpy as np
import trio

from ..errors import AccessError, NodeDown, RemoteError, Unsent
from ..runtime.batching import Batcher
from ..runtime.cluster import Cluster
from ..config import ClusterConfig
from ..packing import in_force
from ..policy import Policy, parse_policy
from ..runtime.offload import Offload
from ..runtime.silence import Moves, SilenceBound
from ..runtime.slots import StagingPool, staging_gone
from ..util import single_exception
from . import compress
from .stripe import CLOCK_SLICE, Extent, StepWait, StripeIO, split

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> Policy:
    return parse_policy(text)


def policy_of(info: dict) -> Policy:
    """The sync policy of a tensor's cached ``train_info`` (what its pushes and pulls wait for)."""
    return _parse(info["sync"])

TRAIN_INFO_TTL = 1.0
# bytes of gradients fused into one WRITE with immediate: over a network a batch's rounds are
# answered only once all of it has arrived, so smaller batches let rounds close (and pulls
# start) sooner; in shared memory a batch is one copy, and fewer of them cost less
PUSH_BATCH = 1 << 20
LOCAL_BATCH = 4 << 20
DESC_SLACK = 32  # bytes a descriptor may grow by in the batch's head (its "at", a comma)
DETACH_INLINE = 8 << 20  # kept pushes copied on the loop below this many bytes, in a thread above
PIECE_TIMEOUTS = 3  # a push's pieces are sent (and sent again) while this many op_timeouts pass with progress


def _parts(ino: int, start: int, isz: int, flat: np.ndarray, sparse: tuple, base: dict) -> tuple[list[tuple[dict, np.ndarray]], int]:
    """Each stripe's (descriptor, payload) of a gradient ``flat`` of ``isz``-byte elements
    laid out from byte ``start`` of file ``ino``, and the bytes they put on the wire.
    ``sparse``: (the chunks chosen, or None for all of them; the chunk size); ``base``: the
    descriptor's fields every piece shares, from ``rank`` on."""
    chosen, chunk = sparse
    wire = np.dtype(base["wire"])
    sent = 0
    parts = []
    for p in split(start, flat.size * isz, base["unit"]):
        e0, count = p.pos // isz, p.length // isz
        desc = {"fid": ino, "idx": p.idx, "offset": p.offset, "count": count} | base
        if chosen is None:
            values = flat[e0 : e0 + count]
        else:
            runs = _runs_in(chosen, chunk, e0, count)
            desc["spans"] = runs
            values = np.concatenate([flat[e0 + a : e0 + a + k] for a, k in runs]) if runs else flat[:0]
            sent += 8 * len(runs)  # the span list travels too
        payload = np.ascontiguousarray(values.astype(wire, copy=False))
        sent += payload.nbytes
        parts.append((desc, payload))
    return parts, sent


def _runs_in(chosen: np.ndarray, chunk: int, e0: int, count: int) -> list[list[int]]:
    """The [start, length] runs (relative to e0) of chosen chunks inside [e0, e0 + count)."""
    runs = []
    for c in chosen:
        a, b = max(int(c) * chunk, e0), min((int(c) + 1) * chunk, e0 + count)
        if a < b:
            if runs and runs[-1][0] + runs[-1][1] == a - e0:
                runs[-1][1] += b - a  # adjacent chunks travel as one run
            else:
                runs.append([a - e0, b - a])
    return runs


class PushPull:
    """A client's pushes and pulls of tensors (``Client.training``)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        cluster: Cluster,
        staging: StagingPool,
        io: StripeIO,
        getattr: Callable[[int], Awaitable[dict]],
        call_following: Callable[..., Awaitable[dict]],
    ):
        self.cfg, self.cluster, self.staging, self.io = cfg, cluster, staging, io
        self.getattr, self._call_following = getattr, call_following
        self._train: dict[tuple[int, int], dict] = {}
        self._sparsifiers: dict[tuple[int, int], compress.Sparsifier] = {}
        self._push_queues: dict[tuple[str, int], Batcher] = {}  # (node, rank) -> its pushes waiting (``_fused``)
        self.busy: dict[str, float] = {}  # rank -> its measured compute time per step (seconds)
        self._pulled_at: dict[tuple[int, int], float] = {}
        self._pacing: dict[int, list] = {}  # r2sp: rank -> [step, its slot wait, next slot time]
        # bsp pushes in rounds still open: (fid, idx, rank) -> [descriptor, payload, owner]
        self._open: dict[tuple[int, int, int], list] = {}
        self._pushed_to: dict[tuple[int, int], int] = {}  # (tensor, rank) -> clock its last bsp push needs
        # (tensor, rank) -> (the tensor's version, the step of the rank's next push): this
        # client's own count. A push is identified by (tensor, rank, step) and never renumbered
        # from a server's count, which a failover can set back or forward (``next_step``).
        self._steps: dict[tuple[int, int], tuple[int, int]] = {}
        self._sent: dict[tuple[int, int], tuple[int, int]] = {}  # (tensor, rank) -> (version, step) of its last push sent
        self._repushing: set[tuple[int, int, int, int]] = set()  # (fid, idx, rank, step) being sent again
        # a push's deadline: PIECE_TIMEOUTS op timeouts with none of this client's pushes taken
        self.silence = SilenceBound(cfg.op_timeout * PIECE_TIMEOUTS)
        self.catching_up = Moves(cluster.liveness.work)  # a refusing primary's catch-up moving is progress
        self.offload = Offload()  # large copies leave the loop (detach_off_loop)
        self.io.on_behind = self._repush_open
        # a restarted node lost its push bookkeeping: fetch policies and counts afresh
        self.cluster.peers.on_restart.append(lambda node: self._train.clear())

    async def train_info(self, ino: int, rank: int, *, pushing: bool = False) -> dict:
        """Policy, workers, pull timeout and this rank's push count for tensor ``ino``, from the
        primary of its first stripe; cached for TRAIN_INFO_TTL seconds so that a policy changed
        anywhere is seen within that time at the cost of one control call per tensor and rank.

        A push (``pushing``) takes the cached info at any age: the primary decides everything
        a push is checked against (ranks, shapes, the policy's rounds) and answers with the
        policy as it is now, which refreshes the cache before the pull that follows. Without
        that, a step slower than the TTL (a large model behind a network link) paid two calls
        per tensor before every push."""
        key = (ino, rank)
        cached = self._train.get(key)
        if cached is None or (trio.current_time() - cached["fetched"] > TRAIN_INFO_TTL and not (pushing and cached["fetched"] > -math.inf)):
            attr = await self.getattr(ino)
            t = attr.get("tensor")
            if not t:
                raise RemoteError("EINVAL", f"inode {ino} is not a tensor")
            info = await self._stripe_call(ino, t["offset"] // attr["unit"], "train_info", {"fid": ino, "rank": rank})
            self._train[key] = dict(info, attr=attr, fetched=trio.current_time())
        return self._train[key]

    def suggest_batch(self, rank: int, batches: dict[int, int]) -> int | None:
        """R2SP for heterogeneous workers: a batch for ``rank`` proportional to its measured
        throughput (its batch over its compute time per step, from pull to push), keeping the
        total batch, so that every rank keeps the same period. None until every rank has been
        measured."""
        speeds = {r: b / self.busy[str(r)] for r, b in batches.items() if self.busy.get(str(r))}
        if rank not in speeds or len(speeds) < len(batches):
            return None
        total = sum(batches.values())
        return max(1, round(total * speeds[rank] / sum(speeds.values())))

    def pushed_tensors(self, rank: int) -> list[int]:
        """The tensors ``rank`` has pushed to through this client."""
        return [ino for (ino, r), (_, step) in self._steps.items() if r == rank and step]

    def next_step(self, ino: int, rank: int, info: dict) -> int:
        """The step of ``rank``'s next push to tensor ``ino``: this client's own count. The
        server's count (``info``, from ``train_info``) is taken only for the rank's first push
        through this client, or when the tensor was written anew since (its version moved: a
        truncate reset the nodes' counts). Refreshes of ``info`` never change it: a server
        whose count went back or jumped after a failover then refuses the push loudly (EINVAL,
        out of order) or answers it as a duplicate, instead of a gradient silently taking the
        place of another."""
        mine = self._steps.get((ino, rank))
        if mine is None or mine[0] != info["attr"]["version"]:
            return info["pushed"]
        return mine[1]

    def cached_train_info(self, ino: int, rank: int) -> dict | None:
        """``train_info`` if this client has it at hand (no call)."""
        return self._train.get((ino, rank))

    async def push(
        self, ino: int, rank: int, grad: np.ndarray, *, owner: object = None, order: float = math.inf, layout: int = -1, early: bool = False
    ) -> int:
        """Push one gradient of ``rank`` for tensor ``ino``; returns its step. The gradient
        must have the tensor's dtype and shape (EINVAL otherwise, and nothing changes). Returns
        once every stripe's primary has taken its part (the update may still be pending).

        ``order``: where this push goes among the rank's pushes waiting for a node (lowest
        first; equal ones as they came). A step's pushes started together name their place
        in the model, so every worker sends them in the same order whatever order the
        scheduler runs their tasks in: each round then closes as soon as its tensor has come
        from every rank, and its pull overlaps the later pushes (``_fused``).

        Under bsp a part that joined a round still open is kept (``_open``) until the round
        closes, to be sent again if the primary is lost first (``_repush_open``): as a view of
        ``grad`` when the caller names an ``owner`` that lets it know before it reuses the
        memory (``detach``), else as a copy.

        ``layout``: a bucket's version as the caller laid the step out (the node refuses the
        push with LAYOUT_CHANGED if it moved: docs/buckets.md B2).

        ``early``: the caller pulls next (a step stream). A part that closes its round under
        bsp is then answered once the round is applied on its primary, before the backups hold
        it (the pull waits for them); without it, once every replica holds the round, so a
        plain read after every rank's push sees it whole (server/training.py ``_push_now``)."""
        info, grad, mode = await self._checked(ino, rank, grad)
        attr, t = info["attr"], info["tensor"]
        step = self.next_step(ino, rank, info)
        # the same push again (the last one with this id failed): its pieces that arrived then
        # are answered "duplicate", which is this push's own, not another process's
        again = self._sent.get((ino, rank)) == (attr["version"], step)
        self._sent[(ino, rank)] = (attr["version"], step)
        # compute time since this rank's last pull: what batch-size suggestions are based on
        pulled = self._pulled_at.pop((ino, rank), None)
        busy = round(trio.current_time() - pulled, 6) if pulled is not None else None
        paced = await self._pace(rank, step, info["timeout"]) if policy_of(info).paced else 0.0
        flat = np.require(grad, requirements="C").reshape(-1)
        wire = np.dtype(np.float16) if mode.fp16 else flat.dtype
        chosen = None
        if mode.fraction:
            sparsifier = self._sparsifiers.setdefault((ino, rank), compress.Sparsifier(flat.size, flat.dtype))
            chosen, flat = sparsifier.select(flat, mode)
        base = {"rank": rank, "step": step, "wire": wire.str, "unit": attr["unit"], "busy": busy, "paced": paced}
        if layout >= 0:
            base["layout"] = layout
        if early:
            base["early"] = True
        replies: list[dict] = []
        parts, sent = _parts(ino, t["offset"], grad.dtype.itemsize, flat, (chosen, mode.chunk), base)
        rounds = policy_of(info).rounds  # a part kept while its round is open
        # a payload made here (fp16, sparse) is ours to keep; a view of ``grad`` is the owner's
        await self._send_parts([(desc, memoryview(pl).cast("B"), replies, pl if pl.base is None else owner, rounds, again, order) for desc, pl in parts])
        self._pushed(ino, rank, step, info, replies)
        self.io.bytes_pushed += sent
        return step

    async def _checked(self, ino: int, rank: int, grad: np.ndarray) -> tuple[dict, np.ndarray, compress.Mode]:
        """A push's tensor info, its gradient as an array and its compression, once the gradient
        fits the tensor and the rank is active (EINVAL otherwise, and nothing changes)."""
        info = await self.train_info(ino, rank, pushing=True)
        grad = np.asarray(grad)
        t = info["tensor"]
        if grad.dtype != np.dtype(t["dtype"]) or grad.shape != tuple(t["shape"]) or rank not in info["active"]:
            # before refusing by the cache: the tensor may have been written anew, or the rank
            # taken back, since it was cached (a push takes it at any age: ``train_info``)
            self.forget_training(ino)
            info = await self.train_info(ino, rank)
        t = info["tensor"]
        if grad.dtype != np.dtype(t["dtype"]) or grad.shape != tuple(t["shape"]):
            raise RemoteError("EINVAL", f"gradient {grad.dtype}{list(grad.shape)} does not match tensor {t['dtype']}{t['shape']}")
        if grad.dtype.kind != "f":
            raise RemoteError("EINVAL", f"only floating-point tensors take gradients, not {grad.dtype}")
        if rank not in info["active"]:
            raise RemoteError("EINVAL", f"rank {rank} is not one of the active workers {info['active']}")
        try:
            mode = compress.parse(info["compress"])
        except compress.CompressError as exc:
            raise RemoteError("EINVAL", str(exc)) from None
        return info, grad, mode

    async def _send_parts(self, pieces: list[tuple]) -> None:
        """Every piece (``_push_kept``'s arguments) at once, until this client's pushes stop
        moving (runtime/silence.py: a piece follows a moving primary meanwhile, and waits its
        turn behind a model's other pushes)."""
        with self.silence(), single_exception(RemoteError):  # refused alike: one error
            if len(pieces) == 1:  # most tensors: no nursery
                await self._push_kept(*pieces[0])
            else:
                async with trio.open_nursery() as n:
                    for piece in pieces:
                        n.start_soon(self._push_kept, *piece)

    def _pushed(self, ino: int, rank: int, step: int, info: dict, replies: list[dict]) -> None:
        """A push of ``step`` done: the rank's next step, and what its primaries answered."""
        self._steps[(ino, rank)] = (info["attr"]["version"], step + 1)
        if policy_of(info).rounds:
            self._pushed_to[(ino, rank)] = step + 1  # pieces kept in _open are the rounds left open
        for r in replies:
            self.busy.update(r.get("busy", {}))
        if replies:  # r2sp: the slot of this rank's next step
            self._pacing.setdefault(rank, [step, 0.0, 0.0])[2] = trio.current_time() + max(r.get("slot_in", 0.0) for r in replies)

    async def _pace(self, rank: int, step: int, limit: float) -> float:
        """Under r2sp, wait for ``rank``'s slot before the first push of ``step`` (the primaries
        said when it is, with the replies to the previous step); returns the wait, which every
        push of the step reports so the period is measured without it."""
        entry = self._pacing.setdefault(rank, [step, 0.0, 0.0])  # [step, its wait, next slot]
        if entry[0] != step:
            entry[0], entry[1] = step, min(max(0.0, entry[2] - trio.current_time()), limit)
            await trio.sleep(entry[1])
        return round(entry[1], 6)

    async def _push_kept(self, desc: dict, payload: memoryview, replies: list, owner: object, rounds: bool, again: bool, order: float) -> None:
        """``_push_piece``, then, under a policy of ``rounds`` (bsp), keep the piece while its round is open."""
        r = await self._push_piece(desc, payload, replies, resent=again, order=order)
        if rounds and r.get("clock", 0) <= desc["step"]:
            if owner is None:
                payload = memoryview(bytes(payload))  # the caller may reuse its array at once
            self._open[(desc["fid"], desc["idx"], desc["rank"])] = [desc, payload, owner]

    def detach(self, owner: object) -> None:
        """The memory of ``owner`` is about to be reused: copy the kept pushes that are views
        of it."""
        for entry in self._open.values():
            if entry[2] is owner:
                entry[1], entry[2] = memoryview(bytes(entry[1])), None

    async def detach_off_loop(self, owner: object) -> None:
        """``detach`` with large copies made in a worker thread (``runtime/offload.py``): a worker that
        left a door with a GB model's rounds open had its kept pushes copied on the mount's
        loop for a second and more (issue 41). Until the copies are in place the kept pushes
        stay views of ``owner``, so its memory must stay as it is until this returns."""
        views = {key: entry[1] for key, entry in self._open.items() if entry[2] is owner}
        if sum(len(v) for v in views.values()) < DETACH_INLINE:
            self.detach(owner)
            return
        copies = await self.offload.run(lambda: {key: memoryview(bytes(v)) for key, v in views.items()})
        for key, copy in copies.items():
            entry = self._open.get(key)
            if entry is not None and entry[2] is owner:
                entry[1], entry[2] = copy, None
        self.detach(owner)  # any kept meanwhile

    def _closed(self, ino: int, rank: int, clock: int, idxs) -> None:
        """Every stripe ``idxs`` of ``ino`` has applied ``clock`` steps: rounds before it are
        closed (looked up by key: a model's pull closes each tensor's, not a scan per tensor)."""
        for idx in idxs:
            entry = self._open.get((ino, idx, rank))
            if entry is not None and entry[0]["step"] < clock:
                del self._open[(ino, idx, rank)]

    async def _repush_open(self, fid: int, idx: int) -> None:
        """A pull waits on stripe ``idx`` of ``fid`` longer than it should: if a round this
        client pushed to is still open there, ask the stripe's primary whether it has the push
        (a primary lost mid-round takes its open rounds with it) and send it again if not.
        The primary counts each rank's pushes, so a push it has is never taken twice."""
        for key in list(self._open):
            f, i, rank = key
            if (f, i) != (fid, idx):
                continue
            primary = self.cluster.roles.stripe_primary(fid, idx)
            if primary is None:
                return
            entry = self._open.get(key)
            if entry is None or (fid, idx, rank, entry[0]["step"]) in self._repushing:
                continue  # gone, or being checked and sent again already (once per push id)
            step = entry[0]["step"]
            self._repushing.add((fid, idx, rank, step))
            try:
                nxt = (await self.cluster.call(primary, "train_next", {"fid": fid, "idx": idx, "rank": rank}))["next"]
                # read the kept piece again: while we asked, its round may have closed, or its
                # owner reused the memory (detach then made the kept piece a copy)
                entry = self._open.get(key)
                if entry is None or entry[0]["step"] != step:
                    continue
                desc, payload, _ = entry
                if nxt <= desc["step"]:
                    log.warning(
                        "stripe %d:%d: %s lacks push %d of rank %d (its round was open on a lost primary); sending it again",
                        fid,
                        idx,
                        primary,
                        desc["step"],
                        rank,
                    )
                    # a copy: the owner may reuse its memory while this send waits (rare: failover)
                    with self.silence():  # ahead of any queued push: pulls wait on it
                        await self._push_piece(desc, memoryview(bytes(payload)), [], resent=True, order=-math.inf)
            except (NodeDown, RemoteError, AccessError, trio.TooSlowError) as exc:
                log.info("stripe %d:%d: open push of rank %d not checked with %s: %s", fid, idx, rank, primary, exc)
            finally:
                self._repushing.discard((fid, idx, rank, step))

    async def _push_piece(self, desc: dict, payload: memoryview, replies: list, *, resent: bool = False, order: float = math.inf) -> dict:
        """One stripe's part of a push, to the stripe's primary; follows the primary when it
        moves. A retried piece that already arrived is answered "duplicate" (exactly once).
        A piece answered "duplicate" the first time this client sends it was taken from
        someone else: another process pushes as this rank. That is EINVAL, not a silent drop
        of this gradient."""
        fid, idx = desc["fid"], desc["idx"]
        first = not resent
        while True:  # bounded by the caller's deadline (``push``, ``_repush_open``: PIECE_TIMEOUTS)
            primary = self.cluster.roles.stripe_primary(fid, idx)
            if primary is None:
                await self.cluster.liveness.wait_changed(0.5)
                await self.cluster.heartbeats.refresh()
                continue
            desc["epoch"] = self.cluster.roles.view_epoch  # as it is now: a retry may follow a newer view
            try:
                r = await self._fused(primary, desc, payload, order)
            except (NodeDown, AccessError) as exc:  # down, or restarted (with_slot dropped its staging)
                first = False  # it may have arrived: a duplicate now is this push's own
                if isinstance(exc, NodeDown):
                    await self.cluster.heartbeats.after_lost()
                continue
            except RemoteError as exc:
                if not staging_gone(exc):
                    raise
                # its staging region was replaced under it (another call there was given up:
                # runtime/slots.py): the node took nothing of it; sent again in the new region
                first = False
                continue
            code = r.get("error")
            if code is None and r.get("duplicate") and first:
                raise RemoteError(
                    "EINVAL",
                    f"push {desc['step']} of rank {desc['rank']} to stripe {fid}:{idx} was taken before this client sent it"
                    " (another process pushes as this rank)",
                )
            if code is None:
                replies.append(r)
                return r
            if code in ("ENOTPRIMARY", "EAGAIN", "ESTALE"):
                # EAGAIN: the primary may have taken it and not got it to every replica (then a
                # duplicate on the retry is this push's own); ENOTPRIMARY, ESTALE (another view:
                # refresh it): refused before anything was taken
                first = first and code != "EAGAIN"
                await trio.sleep(0.1)
                await self.cluster.heartbeats.refresh()
                if self.catching_up.moved(primary):  # taking its stripes back: waited for
                    self.silence.progressed()
                continue
            raise RemoteError(code, f"{r.get('message', '')} (stripe {fid}:{idx} on {primary})")

    async def _fused(self, node: str, desc: dict, payload: memoryview, order: float = math.inf) -> dict:
        """Send a push piece to ``node``: at once if fewer transfers to it are under way than
        the client has staging slots there, otherwise together with every piece of the same
        rank that queued meanwhile, in one WRITE with immediate (runtime/batching.py: fusion with no
        added latency when idle; as many transfers in flight as slots, so a whole model's
        pushes pipeline; each piece's task returns as soon as its own batch is answered).
        The queue goes lowest ``order`` first (``push``), so the order of a step's pushes is
        the model's, not the scheduler's (best effort for the first batches: a piece of a
        tensor of several stripes comes a pass later). A lone push (no order) is sent at once,
        as before. One queue per rank: under r2sp a rank's push may wait on the node for
        another rank's, which must not queue behind it."""
        key = (node, desc["rank"])
        q = self._push_queues.get(key)
        if q is None:
            limit = PUSH_BATCH if self.cluster.peers.over_wire(node) else LOCAL_BATCH
            q = self._push_queues[key] = Batcher(self.staging.slots, limit, lambda batch: self._send_batch(node, batch))
        size = len(payload) + len(json.dumps(desc, separators=(",", ":"))) + DESC_SLACK
        try:
            return await q.put((desc, payload), size, order)
        except Unsent:  # it may have arrived: sent again, a duplicate is this push's own
            raise NodeDown(node, "push sender cancelled") from None

    async def _send_batch(self, node: str, batch: list) -> list:
        """One WRITE with immediate of ``batch`` ((descriptor, payload) each); each one's
        answer (a dict, or the error that stopped them all)."""
        descs, bufs, at = [], [], 0
        for desc, payload in batch:
            descs.append(dict(desc, at=at))
            bufs.append(payload)
            at += len(payload)
        head = json.dumps(descs, separators=(",", ":")).encode()

        async def send(slot) -> dict:
            return await self.cluster.write_imm(node, slot.rkey, slot.offset, [head, *bufs], len(head), slot.inc)

        try:
            reply = await self.staging.with_slot(node, send)
            results = reply["results"]
            if len(results) != len(batch):  # never leave a pusher waiting for a missing answer
                raise RemoteError("EIO", f"{node} answered {len(results)} of {len(batch)} pushes")
            info = reply.get("info")
            if info:
                now, rank = trio.current_time(), batch[0][0]["rank"]  # a queue's batch is one rank's
                for fid, pinfo in info.items():
                    cached = self._train.get((int(fid), rank)) if fid.isdigit() else None
                    if cached is None or not isinstance(pinfo, dict):
                        continue
                    if pinfo.get("version", cached["attr"]["version"]) != cached["attr"]["version"]:
                        cached["fetched"] = -float("inf")  # written anew: shape and counts refetched
                    else:  # policy changes reach us with the push replies: no refresh call needed
                        cached.update(pinfo, fetched=now)
        except (NodeDown, RemoteError, AccessError) as exc:
            results = [exc] * len(batch)
        if any(isinstance(r, dict) and "error" not in r for r in results):
            self.silence.progressed()  # a push taken: every push under way has its time again
        return results

    async def pull_into(self, ino: int, rank: int, out: np.ndarray, info: dict | None = None) -> np.ndarray:
        """The tensor's parameters into ``out`` once the model's policy allows ``rank`` to see
        them (bsp: every rank's push of this rank's last step applied; ssp:S: the slowest rank
        within S steps; asp: at once). ETIMEDOUT after the model's ``user.irdma.timeout``.
        ``info``: ``train_info`` as the caller just had it (``pull_many``)."""
        info = info or await self.train_info(ino, rank)
        ptr = in_force(info["attr"])
        if ptr is not None:  # packed: its range of the bucket, as the bucket's policy lets the rank see it
            ino, start = ptr["fid"], ptr["at"]
            info = await self.train_info(ino, rank)
        else:
            start = info["tensor"]["offset"]
        if rank not in info["active"]:
            raise RemoteError("EINVAL", f"rank {rank} is not one of the active workers {info['active']}")
        unit = info["attr"]["unit"]
        need = policy_of(info).required_clock(self.next_step(ino, rank, info))
        view = memoryview(out.reshape(-1)).cast("B")
        # a stripe whose round this rank's push closed (nothing kept open) is there already
        closed = lambda idx: (ino, idx, rank) not in self._open and self._pushed_to.get((ino, rank)) == need  # noqa: E731
        await self.io.read(Extent(ino, start + len(view), unit), start, view, StepWait(need, info["timeout"], closed))
        self._closed(ino, rank, need, (p.idx for p in split(start, len(view), unit)))
        self._pulled_at[(ino, rank)] = trio.current_time()
        return out

    async def pull_many(self, rank: int, items: list[tuple[int, np.ndarray]]) -> None:
        """``pull_into`` of every (tensor, out) of ``items`` at once, for many small tensors:
        the stripes one node serves are read in bursts (their headers in one, then their data,
        verified, in one) once their clocks allow, so a model's thousand batch-norm vectors
        cost a few round trips per node, not two each. A tensor not at hand that way (a stripe
        whose region key is not cached yet, a hole, a node lost, a clock still behind after
        CLOCK_SLICE) is pulled by ``pull_into``, which deals with each of those cases; the
        same rules decide what either returns."""
        slow: list[tuple[int, np.ndarray, dict | None]] = []
        groups: dict[tuple[str, int], list] = {}  # (node, clock needed) -> [(key, offset, view, item)]
        plans = []  # (ino, need, stripes, pieces left): a tensor read in bursts
        deadline = trio.current_time() + CLOCK_SLICE
        for ino, out in items:
            info = await self.train_info(ino, rank)
            if in_force(info["attr"]):  # packed (a layout older than its pack): pulled from its bucket
                slow.append((ino, out, info))
                continue
            if rank not in info["active"]:
                raise RemoteError("EINVAL", f"rank {rank} is not one of the active workers {info['active']}")
            attr, t = info["attr"], info["tensor"]
            need = policy_of(info).required_clock(self.next_step(ino, rank, info))
            view = memoryview(out.reshape(-1)).cast("B")
            pieces = split(t["offset"], len(view), attr["unit"])
            homes = [self.io.at_hand(ino, p.idx) for p in pieces]
            if any(h is None or p.offset + p.length > h[1].capacity for h, p in zip(homes, pieces)):
                slow.append((ino, out, info))
                continue
            deadline = min(deadline, trio.current_time() + info["timeout"])
            plan = [ino, out, need, [p.idx for p in pieces], len(pieces), info]
            plans.append(plan)
            for (node, key), p in zip(homes, pieces):
                groups.setdefault((node, need), []).append((key, p.offset, view[p.pos : p.pos + p.length], plan))

        async def burst(node: str, need: int, wants: list) -> None:
            try:
                done = await self.io.read_burst(node, [w[:3] for w in wants], need, deadline)
            except (NodeDown, AccessError):  # pull_into finds another replica, or the key anew
                done = [False] * len(wants)
            for ok, w in zip(done, wants):
                w[3][4] -= ok

        async with trio.open_nursery() as n:
            for (node, need), wants in groups.items():
                n.start_soon(burst, node, need, wants)
        now = trio.current_time()
        for ino, out, need, idxs, left, info in plans:
            if left:
                slow.append((ino, out, info))
            else:
                self._closed(ino, rank, need, idxs)
                self._pulled_at[(ino, rank)] = now
        if slow:
            with single_exception(RemoteError):
                async with trio.open_nursery() as n:
                    for ino, out, info in slow:  # the info as it was: a fallback asks nothing again
                        n.start_soon(self.pull_into, ino, rank, out, info)

    async def wait_applied(self, ino: int, rank: int) -> None:
        """Until every push of ``rank`` to ``ino`` so far has been applied (under bsp, its
        rounds are complete; under r2sp, its turns have come; asp and ssp apply a push when
        they take it)."""
        info = await self.train_info(ino, rank)
        ptr = in_force(info["attr"])
        if ptr is not None:  # packed: its bucket's pushes
            ino = ptr["fid"]
            info = await self.train_info(ino, rank)
        t, attr = info["tensor"], info["attr"]
        pushed = self.next_step(ino, rank, info)
        policy = policy_of(info)
        if policy.rounds:  # the stripes' clocks say it: one-sided reads
            out = np.empty(t["shape"], t["dtype"])
            view = memoryview(out.reshape(-1)).cast("B")
            await self.io.read(Extent(ino, t["offset"] + len(view), attr["unit"]), t["offset"], view, StepWait(pushed, info["timeout"]))
            self._closed(ino, rank, pushed, (p.idx for p in split(t["offset"], len(view), attr["unit"])))
        elif policy.holds and pushed:  # a held push shows in no clock: ask
            nbytes = int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(t["dtype"]).itemsize
            async with trio.open_nursery() as n:
                for p in split(t["offset"], nbytes, attr["unit"]):
                    n.start_soon(self._train_wait, ino, p.idx, rank, pushed, info["timeout"])

    async def _train_wait(self, ino: int, idx: int, rank: int, pushed: int, timeout: float) -> None:
        args = {"fid": ino, "idx": idx, "rank": rank, "pushed": pushed, "timeout": timeout}
        await self._stripe_call(ino, idx, "train_wait", args, timeout=timeout + self.cfg.op_timeout)

    async def _stripe_call(self, fid: int, idx: int, method: str, args: dict, *, timeout: float | None = None) -> dict:
        """A control call to the stripe's primary, following it when it moves."""
        return await self._call_following(lambda: self.cluster.roles.stripe_primary(fid, idx), method, args, timeout=timeout)

    def forget_training(self, ino: int | None = None) -> None:
        """Drop cached policy/push counts (a policy xattr changed, or a rank was removed)."""
        for key in [k for k in self._train if ino is None or k[0] == ino]:
            del self._train[key]
