"""Byte ranges -> stripe units -> replicas: parallel fan-out and failover.

A read of a range becomes one version-checked one-sided READ per stripe unit it touches, issued in
parallel, each against the least-loaded ready replica; a lost node is marked down and the next
replica serves. A write becomes, per stripe unit, a one-sided WRITE into a staging slot on the
stripe's primary plus a ``commit``; the primary replicates before it answers, so when ``write``
returns the data is on every live replica. Whom a stripe's read asks, what it waits for and
when it gives up are client/readplan.py's rules (a pure state machine); ``_read_piece`` performs
them.

Stripe region keys (rkey, capacity) are cached per node, with the node's incarnation; a stale key
(the stripe grew, or the node restarted: StaleKey) answers AccessError and is looked up again.

**A cached key reads a node only in the lease it was given under.** A node hands out
keys (``stripe_info``) only while it serves and has caught up (its hand-over done), and says under
which coordination lease. A one-sided READ asks the node nothing, so a key kept from before the
node went away (stopped, cut off) would still read its region after a view names it again and
before its hand-over has brought what was acknowledged without it: the bytes from before those
writes (chaos --views, seed 7: a write's pieces on two stripes read back old, right after the
write). A view names a node that comes back with a new lease, so a cached key whose lease is not
the one the client's view names for that node is looked up again, and that lookup is refused
(EAGAIN) until the hand-over is done: the read goes to the other home meanwhile.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import trio

from ..runtime.cluster import READY, Cluster
from ..errors import AccessError, NodeDown, RemoteError, TornRead
from ..regions import Header
from ..runtime.silence import Patience
from ..runtime.slots import StagingPool, staging_gone
from ..transport.base import Gather
from ..util import leaves
from . import readplan as rp
from .clockwait import ClockWaits
from .readplan import Key, Lost, ReadPlan, Want

log = logging.getLogger(__name__)

# Stripes per ``stripe_versions`` call (about 1 MB of JSON each way): a stamp of a file of TBs
# stays within a control document (protocol.MAX_CONTROL) and holds the node's loop briefly.
VERSIONS_PER_CALL = 1 << 16

# A pull waits this long for one replica's clock before asking another (that replica may have
# missed an update while it restarted); the model's timeout bounds the whole wait.
CLOCK_SLICE = 1.0
# A settled read (read_settled) waits this long for stripes whose clock is behind the others'.
SETTLE = 0.5


def _unsettled(heads: dict[int, Header]) -> dict[int, int]:
    """The stripes of a settled read to read again, each with the clock to wait for (published,
    not pending): those behind the newest clock read, and every pending one. A pending stripe
    waits for its flag to clear, not for a later clock: under bsp its publish moves the clock
    (and the others then wait for it), under asp, ssp and r2sp most pushes leave the clock
    where it was."""
    if not heads:
        return {}
    newest = max(h.clock for h in heads.values())
    return {i: newest for i, h in heads.items() if h.pending or h.clock < newest}


class StepWait(NamedTuple):
    """What a read of a trained file waits for, stripe by stripe (a pull): its clock (training
    steps applied) at ``min_clock`` within ``wait`` seconds (trio.TooSlowError after that), and
    with ``settled`` not pending either (regions.PENDING). ``eager(idx)`` True says the stripe
    is likely there already (this client's push closed its round): it is read at once, its
    clock checked in the same burst, instead of its header first (one round trip less)."""

    min_clock: int = 0
    wait: float = 0.0
    eager: Callable[[int], bool] | None = None
    settled: bool = False


NO_WAIT = StepWait()  # a plain read: whatever each stripe holds now


class _Behind(Exception):
    """A replica's clock did not reach the one waited for within CLOCK_SLICE."""


class Piece(NamedTuple):
    idx: int  # stripe index
    offset: int  # offset inside the stripe
    pos: int  # offset inside the caller's buffer
    length: int


def split(offset: int, length: int, unit: int) -> list[Piece]:
    """The stripe pieces of [offset, offset+length), in order; pure."""
    pieces, pos = [], 0
    while pos < length:
        idx, soff = divmod(offset + pos, unit)
        n = min(unit - soff, length - pos)
        pieces.append(Piece(idx, soff, pos, n))
        pos += n
    return pieces


class Extent(NamedTuple):
    """What a read covers: file ``fid`` (or its snapshot ``snap``), ``size`` bytes long in
    stripes of ``unit`` bytes."""

    fid: int
    size: int
    unit: int
    snap: int = 0


class StripeIO:
    def __init__(self, cluster: Cluster, staging: StagingPool, *, write_deadline: float = 30.0):
        self.cluster = cluster
        self.staging = staging
        self.write_deadline = write_deadline
        # (node, fid, idx, snap) -> its Key, None for a hole, Lost for a stripe the node lost; a
        # node's entries go when it restarts (Peers.on_restart)
        self._keys: dict[tuple[str, int, int, int], Key | Lost | None] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        # file -> {stripe index: the version its last commit here gave} for the stripes written
        # here whose ``extend`` has not been sent yet (the namespace learns which stripes hold
        # bytes with it: held.py, Client.extend; a failed write trims those past the end by
        # their versions: Client.free_past_end)
        self.written: dict[int, dict[int, int]] = {}
        self.bytes_pushed = 0  # gradient bytes put on the wire
        # called when a stripe's clock has not moved for CLOCK_SLICE (client/training.py, PushPull._repush_open)
        self.on_behind = None
        self.clock_waits = ClockWaits(cluster.call, cluster.cfg.op_timeout)  # the nodes tell when a clock moved
        cluster.peers.on_restart.append(self.forget_node)

    # -- stripe keys ---------------------------------------------------------------------------
    async def _lookup(self, node: str, fid: int, idxs: list[int], snap: int) -> None:
        info, inc = await self.cluster.call_on(node, "stripe_info", {"fid": fid, "idxs": idxs, "snap": snap})
        for idx in idxs:
            d = info.get(str(idx))
            if d and "lost" in d:
                self._keys[(node, fid, idx, snap)] = Lost(str(d["lost"]))
            else:
                self._keys[(node, fid, idx, snap)] = Key(d["rkey"], d["capacity"], inc, info.get("lease", 0)) if d else None

    def _in_its_lease(self, node: str, key: Key | Lost | None, snap: int) -> bool:
        """Whether a cached ``key`` may read ``node`` now (see the module's docstring). A hole
        or a lost stripe is known for one read only (``read``), and a snapshot's stripes never
        change (one freed answers AccessError), so those are."""
        view = self.cluster.roles.view
        return not isinstance(key, Key) or snap != 0 or key.lease == view.lease_of(node)

    def _cached(self, node: str, fid: int, idx: int, snap: int) -> bool:
        """A key of ``node`` for this stripe that may be used as it is."""
        key = (node, fid, idx, snap)
        return key in self._keys and self._in_its_lease(node, self._keys[key], snap)

    async def _prefetch(self, fid: int, idxs: list[int], snap: int) -> None:
        """One stripe_info call per node for every stripe whose key is not cached."""
        wanted: dict[str, list[int]] = {}
        replicas = self.cluster.roles.members.replicas
        for idx in idxs:
            # every home replica: load balancing may pick any of them for this stripe
            for node in self.cluster.roles.read_candidates(fid, idx)[:replicas]:
                if not self._cached(node, fid, idx, snap):
                    wanted.setdefault(node, []).append(idx)
        async with trio.open_nursery() as n:
            for node, missing in wanted.items():
                n.start_soon(self._lookup_quietly, node, fid, missing, snap)

    async def _lookup_quietly(self, node: str, fid: int, idxs: list[int], snap: int) -> None:
        try:
            await self._lookup(node, fid, idxs, snap)
        except (NodeDown, RemoteError):
            pass  # the per-stripe read path deals with it

    def forget(self, fid: int) -> None:
        for key in [k for k in self._keys if k[1] == fid]:
            del self._keys[key]

    def forget_node(self, node: str) -> None:
        """``node`` restarted: none of its region keys (nor its holes) hold any more."""
        for key in [k for k in self._keys if k[0] == node]:
            del self._keys[key]

    async def versions(self, files: list[tuple[int, int, int]]) -> list[tuple[int, ...] | None]:
        """For each live file (fid, size, unit), the version of every stripe of it (0: a hole),
        from a home that serves it (fs/pagecache.py): a stripe's version moves at every
        install, a write's or a training step's, and never back. None for a file one of whose
        stripes could not be read. The stripes a node would be read from go in one call to it
        (``stripe_versions``: a model of 199 tensors took 30 ms to stamp one-sidedly, a header
        read each); those it cannot answer are read one-sidedly, one by one."""
        stripes = [(fid, idx) for fid, size, unit in files for idx in range(-(-size // unit))]
        by_node: dict[str, list[tuple[int, int]]] = {}
        for fid, idx in stripes:
            candidates = self.cluster.roles.read_candidates(fid, idx)
            if candidates:
                by_node.setdefault(candidates[0], []).append((fid, idx))
        got: dict[tuple[int, int], int] = {}

        async def ask(node: str, which: list[tuple[int, int]]) -> None:
            for at in range(0, len(which), VERSIONS_PER_CALL):
                part = which[at : at + VERSIONS_PER_CALL]
                try:
                    said = (await self.cluster.call(node, "stripe_versions", {"stripes": [list(s) for s in part]}))["versions"]
                except (NodeDown, RemoteError) as exc:  # not caught up, down: those go one by one
                    log.debug("stripe versions from %s: %s", node, exc)
                    return
                if len(said) != len(part):  # (a node that answers otherwise is not believed: those go one by one)
                    log.warning("%s answered stripe_versions of %d stripes with %d", node, len(part), len(said))
                    return
                got.update((k, v) for k, v in zip(part, said) if v is not None)  # None: lost there (asked one by one)

        async def one(fid: int, idx: int) -> None:
            for node in self.cluster.roles.read_candidates(fid, idx):
                for _ in range(2):  # a key gone stale (the stripe freed, the node restarted): asked again once
                    if not self._cached(node, fid, idx, 0):
                        await self._lookup_quietly(node, fid, [idx], 0)
                        if not self._cached(node, fid, idx, 0):
                            break
                    key = self._keys[(node, fid, idx, 0)]
                    if key is None:  # a hole there, known for this once (see ``read``)
                        del self._keys[(node, fid, idx, 0)]
                        got[(fid, idx)] = 0
                        return
                    if isinstance(key, Lost):  # not there: another home, or no stamp for the file
                        del self._keys[(node, fid, idx, 0)]
                        break
                    try:
                        got[(fid, idx)] = (await self.cluster.peers.read_header(node, key.rkey, key.inc)).version
                        return
                    except AccessError:
                        self._keys.pop((node, fid, idx, 0), None)
                    except NodeDown:  # another home, or none
                        break

        async with trio.open_nursery() as n:
            for node, which in by_node.items():
                n.start_soon(ask, node, which)
        async with trio.open_nursery() as n:
            for fid, idx in stripes:
                if (fid, idx) not in got:
                    n.start_soon(one, fid, idx)
        by_file: dict[int, list[int]] = {}
        for fid, idx in stripes:
            by_file.setdefault(fid, []).append(idx)
        out: list[tuple[int, ...] | None] = []
        for fid, _, _ in files:
            v = [got.get((fid, idx)) for idx in by_file.get(fid, [])]
            out.append(None if None in v else tuple(v))  # type: ignore[arg-type]
        return out

    # -- reads ---------------------------------------------------------------------------------
    def at_hand(self, fid: int, idx: int) -> tuple[str, Key] | None:
        """The node a read of live stripe (fid, idx) would ask first and its cached key, if
        that key may be used as it is and the stripe has a region there (not a hole); else
        None (``read`` looks it up)."""
        candidates = self.cluster.roles.read_candidates(fid, idx)
        if not candidates or not self._cached(candidates[0], fid, idx, 0):
            return None
        key = self._keys[(candidates[0], fid, idx, 0)]
        return (candidates[0], key) if isinstance(key, Key) else None

    async def read_burst(self, node: str, wants: list[tuple[Key, int, memoryview]], min_clock: int, give_up: float) -> list[bool]:
        """Read each (key, data offset, into) of ``node`` once its clock reaches ``min_clock``:
        their headers in one burst, those whose clocks reached it in one verified burst, the
        rest waited for (the node asked to tell when the last of them moves: ``ClockWaits``;
        polled, backing off, if it cannot) until ``give_up``. True for
        each read whole at such a clock; False for one that was not (still behind, or changing
        under every read): the caller reads it as ``read`` does. NodeDown, AccessError (a
        key gone stale) as the burst raised them. Counted in ``bytes_read``."""
        done = [False] * len(wants)
        pending = list(range(len(wants)))
        delay = 0.0005
        while pending:
            heads = await self.cluster.peers.read_headers(node, [(wants[i][0].rkey, wants[i][0].inc) for i in pending])
            ready = [i for i, h in zip(pending, heads) if h.clock >= min_clock]
            if ready:
                got = await self.cluster.peers.read_stripes(node, [(wants[i][0].rkey, wants[i][0].inc, wants[i][1], wants[i][2]) for i in ready])
                for i, head in zip(ready, got):
                    if head is not None and head.clock >= min_clock:
                        done[i] = True
                        self.bytes_read += len(wants[i][2])
            moved = len(pending)
            pending = [i for i in pending if not done[i]]
            if not pending or trio.current_time() >= give_up:
                break
            if len(pending) == moved:  # nothing read: wait for the last of them (its round closes last)
                key = wants[pending[-1]][0]
                while trio.current_time() < give_up:
                    if not await self.clock_waits.wait(node, key.rkey, key.inc or 0, min_clock, False, give_up):
                        await trio.sleep(delay)  # the node cannot tell: poll
                        delay = min(delay * 2, 0.02)
                    if (await self.cluster.peers.read_header(node, key.rkey, key.inc)).clock >= min_clock:
                        break
        return done

    async def read_small(self, items: list[tuple[int, int, int, int, memoryview]]) -> None:
        """Fill each ``into`` of (fid, size, unit, offset, into) from live files, many small
        reads at once (a safetensors view's hundreds of tensors): the stripes one node serves
        are read in two bursts (their headers, then their data, verified as ``read`` verifies
        each), not in two round trips each. A read not at hand that way (no key cached, a hole,
        a node lost, a stripe torn under the burst) is made by ``read``. Each ``into`` must lie
        within its file (a short read is the caller's to cut)."""
        slow: list[tuple[int, int, int, int, memoryview]] = []
        groups: dict[str, list] = {}  # node -> [(key, data offset, into, item)]
        left: dict[int, int] = {}  # item -> pieces not read yet
        for n, (fid, size, unit, offset, into) in enumerate(items):
            pieces = split(offset, len(into), unit)
            homes = [self.at_hand(fid, p.idx) for p in pieces]
            if offset + len(into) > size or any(h is None or p.offset + p.length > h[1].capacity for h, p in zip(homes, pieces)):
                slow.append(items[n])
                continue
            left[n] = len(pieces)
            for (node, key), p in zip(homes, pieces):
                groups.setdefault(node, []).append((key, p.offset, into[p.pos : p.pos + p.length], n))

        async def burst(node: str, wants: list) -> None:
            try:
                done = await self.read_burst(node, [w[:3] for w in wants], 0, trio.current_time())
            except (NodeDown, AccessError):  # read finds another replica, or the key anew
                done = [False] * len(wants)
            for ok, w in zip(done, wants):
                left[w[3]] -= ok

        async with trio.open_nursery() as nursery:
            for node, wants in groups.items():
                nursery.start_soon(burst, node, wants)
        slow += [items[n] for n, pieces in left.items() if pieces]
        if slow:
            async with trio.open_nursery() as nursery:
                for fid, size, unit, offset, into in slow:
                    nursery.start_soon(self.read, Extent(fid, size, unit), offset, into)

    async def read(self, extent: Extent, offset: int, into: memoryview, step: StepWait = NO_WAIT, clocks: dict | None = None) -> int:
        """Fill ``into`` from ``offset`` of ``extent`` (clipped at its size): the live file or
        a snapshot; returns the byte count. ``step``: what each stripe is read after (its clock
        at a training step: a pull). With ``clocks``, each stripe read records its header there
        by stripe index (a hole none)."""
        fid, size, unit, snap = extent
        n = max(0, min(len(into), size - offset))
        pieces = split(offset, n, unit)
        try:
            await self._prefetch(fid, [p.idx for p in pieces], snap)  # (inside: a hole it cached goes with a cancel too)
            async with trio.open_nursery() as nursery:
                for p in pieces:
                    nursery.start_soon(self._read_piece, fid, p, into[p.pos : p.pos + p.length], snap, step, clocks)
        except BaseExceptionGroup as group:
            # every piece ran out of the same wait (a pull's timeout): that is one timeout
            if all(isinstance(e, trio.TooSlowError) for e in leaves(group)):
                raise trio.TooSlowError from None
            raise
        finally:
            # A hole (or a stripe lost) is known only for this read: any client's next write may
            # fill it (a region key stays valid until its stripe moves, which the read notices:
            # AccessError).
            for p in pieces:
                for node in self.cluster.roles.stripe_rank(fid, p.idx):
                    k = (node, fid, p.idx, snap)
                    if k in self._keys and not isinstance(self._keys[k], Key):
                        del self._keys[k]
        self.bytes_read += n
        return n

    async def read_settled(self, extent: Extent, offset: int, into: memoryview, timeout: float = 30.0) -> int:
        """``read`` of a range that training updates stripe by stripe (a tensor), all of one
        version: returned once every stripe read shows the same published clock (the same steps
        applied) and none is pending (its bytes already hold a step whose clock its primary
        publishes once every backup holds it: regions.PENDING; equal clocks said nothing then,
        and a reader got one stripe of the next step beside two of this one). Stripes behind
        the newest clock, or pending, are read again once their clock reaches it (waiting up to
        SETTLE seconds each time); stripes that stay so without moving for that long are at rest
        (trained apart, a file grown after training, a step whose replication failed and that
        nothing trains on: no step under way) and taken as they are. A snapshot is frozen: read
        once. RemoteError EAGAIN if no such read came within ``timeout`` seconds."""
        fid, _, unit, snap = extent
        deadline = trio.current_time() + timeout
        heads: dict[int, Header] = {}
        n = await self.read(extent, offset, into, clocks=heads)
        pieces = {p.idx: p for p in split(offset, n, unit)}
        while not snap and (behind := _unsettled(heads)):
            if trio.current_time() > deadline:
                raise RemoteError("EAGAIN", f"file {fid}: stripes {heads} kept moving apart for {timeout:.0f}s")
            before = {i: heads[i] for i in behind}

            async def catch_up(p: Piece, want: int) -> None:
                piece = into[p.pos : p.pos + p.length]
                try:
                    await self.read(extent, offset + p.pos, piece, StepWait(want, SETTLE, settled=True), heads)
                except trio.TooSlowError:  # not there yet: where is it now (moved, or at rest)?
                    await self.read(extent, offset + p.pos, piece, clocks=heads)

            async with trio.open_nursery() as nursery:
                for i, want in behind.items():
                    nursery.start_soon(catch_up, pieces[i], want)
            if all(heads[i] == h for i, h in before.items()):
                return n  # none of them moved for SETTLE seconds: at rest
        return n

    async def _wait_clock(
        self, node: str, rkey: int, inc: int, min_clock: int, deadline: float, settled: bool = False, heard: Callable[[], None] | None = None
    ) -> None:
        """Read the stripe header one-sidedly until its clock reaches ``min_clock`` (and, if
        ``settled``, it is not pending), calling ``heard()`` after each header the node answers; after
        CLOCK_SLICE seconds raise _Behind so that another replica is asked (this one may have
        missed an update), and trio.TooSlowError at ``deadline``.

        Between reads the node is asked to tell when the header moves (``ClockWaits``: one
        call per node for every stripe waiting there), so a round is read as soon as it
        closes, whichever of a step's rounds closes first, and a slow rank costs no polling.
        A node that cannot tell is polled, backing off."""
        give_up = min(deadline, trio.current_time() + CLOCK_SLICE)
        delay = 0.0005

        def reached(head: Header) -> bool:
            if heard is not None:
                heard()
            return head.clock >= min_clock and not (settled and head.pending)

        while not reached(await self.cluster.peers.read_header(node, rkey, inc)):
            if trio.current_time() >= give_up:
                if give_up >= deadline:
                    raise trio.TooSlowError
                raise _Behind(node)
            if not await self.clock_waits.wait(node, rkey, inc or 0, min_clock, settled, give_up):
                await trio.sleep(min(delay, max(0.0, give_up - trio.current_time())))
                delay = min(delay * 2, 0.02)

    async def _read_piece(self, fid: int, p: Piece, view: memoryview, snap: int, step: StepWait, clocks: dict | None) -> None:
        """Read one piece into ``view``: ``ReadPlan`` (client/readplan.py) says whom to ask, what
        to wait for and when to give up; this performs each of its actions and tells it what
        happened."""
        want = Want(fid, p.idx, p.offset, len(view), step.min_clock, step.settled, step.wait)
        plan = ReadPlan(want, trio.current_time(), self.cluster.cfg.op_timeout)
        action: rp.Action = plan.start()
        head = caught = None  # the last header read; the last failure (for Reraise)
        while True:
            if isinstance(action, rp.Done):
                if action.record and clocks is not None:
                    clocks[p.idx] = head
                view[action.k :] = bytes(len(view) - action.k)
                caught = None  # (its traceback holds this frame, and so ``view``: a caller's buffer export)
                return
            if isinstance(action, rp.Fail):
                log.error(*action.log)
                caught = None
                raise action.error
            if isinstance(action, rp.Reraise):
                assert caught is not None
                try:
                    raise caught
                finally:
                    caught = None  # as ``except ... as exc`` drops its name: no cycle through this frame
            if not isinstance(action, (rp.Lookup, rp.WaitClock, rp.Read)):
                action = await self._tend(plan, action, fid, p.idx, snap, step)
                continue
            try:
                if isinstance(action, rp.Read):
                    head = await self.cluster.peers.read_stripe(action.node, action.key.rkey, p.offset, view[: action.k], action.key.inc)
                    action = plan.got(head.clock)
                elif isinstance(action, rp.WaitClock):
                    node, key = action.node, action.key
                    await self._wait_clock(node, key.rkey, key.inc, action.min_clock, action.deadline, action.settled, plan.heard)
                    action = plan.reached_clock()
                else:
                    await self._lookup(action.node, fid, [p.idx], snap)
                    action = plan.looked(self._keys[(action.node, fid, p.idx, snap)], self._eager(step, p.idx))
            except _Behind as exc:
                caught, action = exc, plan.failed(rp.BEHIND, trio.current_time())
            except AccessError as exc:
                caught, action = exc, plan.failed(rp.STALE, trio.current_time())
            except NodeDown as exc:
                log.warning("stripe %d:%d: node %s lost (%s); trying the next replica", fid, p.idx, plan.node, exc)
                caught, action = exc, plan.failed(rp.DOWN, trio.current_time())
            except RemoteError as exc:
                caught, action = exc, plan.failed(rp.REFUSED, trio.current_time(), exc.code)
            except TornRead as exc:
                caught, action = exc, plan.failed(rp.TORN, trio.current_time())

    @staticmethod
    def _eager(step: StepWait, idx: int) -> bool:
        return step.eager is not None and bool(step.min_clock) and step.eager(idx)

    async def _tend(self, plan: ReadPlan, action: rp.Action, fid: int, idx: int, snap: int, step: StepWait) -> rp.Action:
        """Perform one of a read plan's actions that asks no node for the stripe (the view, the
        key cache, a wait, a word to the pusher) and answer what came of it."""
        roles = self.cluster.roles
        if isinstance(action, rp.Look):
            return plan.candidates(roles.read_candidates(fid, idx))
        if isinstance(action, rp.Homes):
            every_home = roles.stripe_rank(fid, idx)[: roles.members.replicas]
            return plan.homes(trio.current_time(), every_home, [n for n in every_home if roles.node_state(n) == READY])
        if isinstance(action, rp.Check):
            k = (action.node, fid, idx, snap)
            present = k in self._keys
            entry = self._keys.get(k)
            return plan.cached(present, present and self._in_its_lease(action.node, entry, snap), entry, self._eager(step, idx))
        if isinstance(action, rp.Forget):
            self._keys.pop((action.node, fid, idx, snap), None)
            return plan.forgot()
        if isinstance(action, rp.Wait):
            if action.short:
                await trio.sleep(0.05)
                await self.cluster.heartbeats.refresh()
            else:  # the heartbeat loop keeps what each node said fresh
                await self.cluster.liveness.wait_changed(0.5)
            return plan.waited(trio.current_time(), {n: self.cluster.liveness.work(n) for n in action.heed})
        if isinstance(action, rp.Behind):
            if self.on_behind is not None:
                await self.on_behind(fid, idx)
            return plan.told()
        assert isinstance(action, rp.Pause), action
        log.warning("stripe %d:%d on %s kept changing; reading again", fid, idx, action.node)
        await trio.sleep(action.seconds)
        return plan.paused()

    # -- writes --------------------------------------------------------------------------------
    async def write(self, fid: int, unit: int, offset: int, data: memoryview | Gather) -> None:
        """``data`` at ``offset`` of file ``fid``, each stripe's piece staged and committed on
        its primary at once (a ``Gather``'s pieces are its buffers' views: no copy here)."""
        pieces = split(offset, len(data), unit)

        async def commit(p: Piece) -> None:
            args = {"fid": fid, "idx": p.idx, "offset": p.offset, "length": p.length, "unit": unit}
            answer = await self.to_primary(fid, p.idx, data[p.pos : p.pos + p.length], "commit", args)
            version = answer.get("version") if isinstance(answer, dict) else None
            mine = self.written.setdefault(fid, {})  # each piece as it lands: a failed write's too
            mine[p.idx] = max(mine.get(p.idx, 0), version if type(version) is int else 0)

        async with trio.open_nursery() as nursery:
            for p in pieces:
                nursery.start_soon(commit, p)
        self.bytes_written += len(data)

    async def to_primary(self, fid: int, idx: int, view: memoryview, method: str, args: dict) -> dict:
        """Stage ``view`` on the stripe's primary with a one-sided WRITE into one of this
        client's staging slots there, then call ``method`` naming the staged range (``commit``:
        the primary installs the bytes under the stripe's seqlock and replicates them before it
        answers); follows the primary when it moves. Gradient pushes do not come this way: they
        travel fused, as one WRITE with immediate per batch (client/training.py, ``_fused``)."""
        begun, told, last = trio.current_time(), False, None
        patience = Patience(self.cluster.liveness.work, self.write_deadline)  # silence, not size
        with patience.bound():
            while True:
                if not told and last is not None and trio.current_time() - begun > self.cluster.cfg.op_timeout:
                    # said once: its retries are silent, and a write that then runs out of time
                    # (ETIMEDOUT) should leave a trace of why (a freeze, a view, a lost node)
                    took = trio.current_time() - begun
                    log.warning("stripe %d:%d: %s not done after %.0f s (last: %s); trying until %.0f s", fid, idx, method, took, last, self.write_deadline)
                    told = True
                primary = self.cluster.roles.stripe_primary(fid, idx)
                if primary is None:
                    log.warning("stripe %d:%d: no ready node to write to; waiting", fid, idx)
                    await self.cluster.liveness.wait_changed(0.5)
                    await self.cluster.heartbeats.refresh()
                    continue

                async def send(slot) -> dict:
                    await self.cluster.peers.write(primary, slot.rkey, slot.offset, view, slot.inc)
                    return await self.cluster.call(primary, method, dict(args, staged=[slot.rkey, slot.offset], epoch=self.cluster.roles.view_epoch))

                try:
                    return await self.staging.with_slot(primary, send)
                except (NodeDown, AccessError) as exc:  # down, or restarted since its staging was given (with_slot dropped it)
                    last = exc
                    if isinstance(exc, NodeDown):
                        await self.cluster.heartbeats.after_lost()
                except RemoteError as exc:
                    last = exc
                    if exc.code in ("ENOTPRIMARY", "EAGAIN", "ESTALE"):
                        # Views of who is up differ for a moment; heartbeats settle it (and carry
                        # the newest view, for a node that said ESTALE).
                        await trio.sleep(0.1)
                        await self.cluster.heartbeats.refresh()
                        patience.heed(primary)
                    elif not staging_gone(exc):  # else with_slot dropped it: a new one now
                        raise
