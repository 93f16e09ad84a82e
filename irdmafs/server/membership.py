"""How a PS node joins, rejoins and leaves the membership: one service of a node (server/node.py
builds it), moving its ``Serving`` state.

Views decide who serves (coord/views.py, runtime/roles.py); this service moves a node through them:

- Joining (``join``): a node tells its peers it is ``joining`` (their heartbeats then count it
  alive, so nobody expels it while it syncs), resyncs, announces itself and waits until a view
  names it (server/leases.py), turns ready, and asks every node the view names active to
  ``handover``, with its view epoch, retrying until each has answered (or left the view): each
  peer reads that view, waits for every commit, push and namespace op under way, and answers
  with the version of every stripe it holds that the joiner is now a replica of (not only those
  it leads: it took no replication while it synced), their push bookkeeping, and its namespace
  sequence number. The bookkeeping is the answer's instant's; its arrays beyond a page (a GB
  model's open rounds) stay in a cut on the peer, frozen, and are fetched in pages (cuts.py).
  The joiner fetches what is newer, the namespace included, before it serves reads or leads
  (``taken_over``). So a stripe never has two primaries, and a node never leads
  with an old copy.
- Fencing (``fence_loop``): a node fences when its lease ends, a view stops naming it, or it
  stalls (it did not run for most of ``down_after``: SIGSTOP, a paused VM;
  ``Serving.check_stall``, before any heartbeat answers "ready"), and rejoins once it holds a
  lease. Its resync then takes its peers' copy of what it led just before. A node fenced for a
  stall that the view still names expels itself first (``_step_aside``), so that stand-ins
  lead its stripes while it resyncs, as they do for a node a peer expelled.
- Expelling (``expel_loop``): a peer the view names active that this node's heartbeats have not
  heard for twice ``down_after`` is expelled, while this node serves and hears a majority.
- Membership changes (launch/rebalance.py drives them): ``members``, ``rebalance_pull``, ``reconfigure``,
  and dropping what a node no longer holds after a grace period.

Everything here runs on the node's trio thread; the cluster view, store, locks, resync and
the push bookkeeping (records.py) are handed in.
"""

from __future__ import annotations

import logging
import math
from base64 import b64decode, b64encode
from dataclasses import asdict
from typing import Callable

import trio

from ..runtime.cluster import READY, SYNCING
from ..errors import NodeDown, RemoteError, TransportError
from ..config import NodeSpec
from ..runtime.placement import placement
from ..util import leaves
from .barrier import CommitBarrier
from .budget import NoSpace
from .cuts import Cuts
from .core import NodeCore
from .leases import ServingLease
from .resync import FETCHES, Resync
from .records import RECORDS_PAGE, PushRecords

log = logging.getLogger(__name__)

# after a membership change, stripes a node no longer holds are kept this many heartbeats (plus
# down_after) so that clients still on the old membership read them until they learn the new one
GRACE_HEARTBEATS = 20


def _node_specs(nodes: list) -> list[NodeSpec]:
    """The members a rebalance names (``rpc_members``' form); EINVAL if they are not that."""
    if not isinstance(nodes, list):
        raise RemoteError("EINVAL", f"the members are a list, not {nodes!r}")
    specs = []
    for n in nodes:
        if not (isinstance(n, dict) and isinstance(n.get("name"), str) and isinstance(n.get("host"), str) and isinstance(n.get("port"), int)):
            raise RemoteError("EINVAL", f"a member is {{name, host, port}}, not {n!r}")
        specs.append(NodeSpec(n["name"], n["host"], n["port"]))
    return specs


class Membership:
    """Joining, the hand-over, fencing and membership changes of a node."""

    def __init__(
        self,
        core: NodeCore,
        meta_lock: trio.Lock,
        barrier: CommitBarrier,
        records: PushRecords,
        resync: Resync,
        lease: ServingLease,
        drop_freed: Callable[[], None],
    ):
        """``drop_freed``: the namespace service's (namespace.py), run after a hand-over's catch-up."""
        self.name, self.cfg, self.cluster, self.store, self.stripe_locks, self.serving = core
        self.meta_lock, self.barrier, self.records, self.resync, self.lease = meta_lock, barrier, records, resync, lease
        self.drop_freed = drop_freed
        self.cuts = Cuts()  # hand-overs' arrays kept for their joiners (cuts.py)
        self.precopied: set[tuple[int, int, int]] = set()  # a rebalance's pre-copy (rpc_rebalance_pull)

    # -- joining: resync, then the hand-over -----------------------------------------------------
    async def join(self) -> None:
        """(Re)join the cluster without ever having two primaries for a stripe.

        While this node was away, stand-ins were primaries of its stripes. It tells every peer
        it is ``joining`` (they count it alive, syncing; they do not replicate to it: a view
        does not name it, so what changes while it resyncs is fetched again by its catch-up),
        resyncs, turns ready, and asks each peer to ``handover``: the peer counts it ready, so
        stops taking commits and pushes for those stripes, and waits for the ones under way
        (which replicate here before they finish), and answers with the versions and push
        bookkeeping it holds of them; this node fetches any newer than its own (``_catch_up``).
        Commits, pushes, namespace ops and stripe lookups sent here meanwhile wait for the
        hand-over (``Serving.await_takeover``). Peers' heartbeat probes begun before a node's own
        word are ignored (Cluster.vouch).

        A resync that fails (the peer it fetches the namespace from is lost meanwhile) is begun
        again once a peer is there to resync from; the node stays syncing until then. (It ended
        the node's tasks, and the node with them; found by the fault simulator, tests/sim.)"""
        self.serving.begin_join()
        # a freeze from before (a snapshot, a rebalance) is over for this node: its freezer
        # counted it gone, and the thaw may never come (it was cut off). Kept, it held every
        # commit and replication here for 30 s after the node rejoined (chaos --views, seed 2).
        self.barrier.lift()
        while True:
            await self._tell_peers("joining")
            try:
                await self.resync.resync()
                break
            except (TransportError, NoSpace, ExceptionGroup) as exc:  # never the end of the node
                failed = list(leaves(exc))
                if not all(isinstance(e, (TransportError, NoSpace)) for e in failed):
                    raise
                full = [e for e in failed if isinstance(e, NoSpace)]
                if full:  # it stays syncing, and says why (status shows its memory)
                    log.error("node %s: its resync does not fit (%s); it serves nothing and begins again", self.name, full[0])
                else:
                    log.warning("node %s: resync failed (%s); it begins again", self.name, failed[0])
            await self.cluster.liveness.wait_changed(self.cfg.heartbeat * 5)
            while not self._may_rejoin():
                await self.cluster.liveness.wait_changed(self.cfg.heartbeat * 5)
        await self.lease.announce()  # until a view names it (server/leases.py)
        self.serving.became_ready()
        named = trio.current_time()
        handed = await self._hand_over()
        await self._catch_up(handed)
        self.serving.caught_up()
        self.serving.taken_over.set()
        # the window in which its stripes have one serving copy fewer (server/health.py)
        log.info("node %s caught up %.2f s after a view named it (hand-over from %d peers)", self.name, trio.current_time() - named, len(handed))

    async def _hand_over(self) -> dict[str, dict]:
        """The ``handover`` answer of every node the view names active (see above)."""
        answers: dict[str, dict] = {}
        while True:
            self.serving.check_lease()  # a view that no longer names it fences it: no hand-over
            if self.serving.state != READY:
                break
            view = self.cluster.roles.view
            todo = [p for p in view.active if p != self.name and p not in answers]
            if not todo:
                break
            stale: list[str] = []

            async def one(peer: str) -> None:
                try:
                    answers[peer] = await self.cluster.call(peer, "handover", {"name": self.name, "epoch": view.epoch})
                except (NodeDown, RemoteError) as exc:
                    log.info("hand-over from %s not yet: %s", peer, exc)
                    if isinstance(exc, RemoteError) and exc.code == "ESTALE":
                        stale.append(peer)

            async with trio.open_nursery() as n:
                for peer in todo:
                    n.start_soon(one, peer)
            if stale:
                await self.lease.refresh()
            if any(p not in answers for p in todo):
                await trio.sleep(self.cfg.heartbeat)
        return answers

    async def _tell_peers(self, method: str) -> dict[str, dict]:
        """Call ``method`` on every peer that answers; returns their answers by name."""
        answers: dict[str, dict] = {}

        async def one(peer: str) -> None:
            try:
                answers[peer] = await self.cluster.call(peer, method, {"name": self.name})
            except (NodeDown, RemoteError) as exc:  # down: it learns from heartbeats when back
                log.info("%s not told to %s: %s", method, peer, exc)

        async with trio.open_nursery() as n:
            for peer in self.cluster.roles.members.names:
                if peer != self.name:
                    n.start_soon(one, peer)
        return answers

    async def _catch_up(self, handed: dict[str, dict]) -> None:
        """After the hand-over the stand-ins change nothing more of what this node leads: fetch
        what they hold newer than this node (a replication to it that failed while it synced),
        so it never leads with an old version or old push bookkeeping."""
        fetched = 0
        fetching = trio.CapacityLimiter(FETCHES)
        work = self.resync.work = {"what": "catch-up", "done": 0, "total": sum(len(a.get("stripes", [])) for a in handed.values())}

        async def fetch(fid: int, idx: int, snap: int, peer: str) -> None:
            nonlocal fetched
            async with fetching:
                if await self.resync.fetch_stripe(fid, idx, snap, peer):
                    fetched += 1
            work["done"] += 1

        try:  # its progress in heartbeats: what waits on this node waits while it moves (runtime/silence.py)
            for peer, answer in handed.items():
                async with trio.open_nursery() as n:
                    for fid, idx, snap, version, tag in answer.get("stripes", []):
                        mine = self.store.get(fid, idx, snap)
                        if mine is None or mine.stamp < (tag, version):
                            n.start_soon(fetch, fid, idx, snap, peer)
                        else:
                            work["done"] += 1
                await self.records.take_records(answer.get("records", []), blobs=await self._arrays_of(peer, answer))
        finally:
            self.resync.work = {}
        newest = max(handed.items(), key=lambda item: tuple(item[1].get("meta_stamp", (-1, -1))), default=None)
        if newest is not None and tuple(newest[1].get("meta_stamp", (-1, -1))) > self.resync.meta().stamp:
            try:
                self.resync.restore_meta(await self.cluster.call(newest[0], "meta_snapshot"))
            except (NodeDown, RemoteError) as exc:
                log.warning("hand-over: the namespace of %s not fetched: %s", newest[0], exc)
        if fetched:
            log.warning("hand-over: %d stripes fetched again (their replication here had failed)", fetched)
        # a truncate acknowledged while this node joined may have come between a peer's answer
        # and this node's fetch, or only with the namespace just taken: what it freed is
        # dropped here before this node serves (chaos, seed 7: a stale stripe under a write
        # that grew the file again read back its old bytes)
        self.drop_freed()

    def _check_member(self, name: str) -> None:
        if name == self.name or name not in self.cluster.roles.members.names:
            raise RemoteError("EINVAL", f"{name!r} is not another member of the cluster")

    async def rpc_joining(self, name: str) -> dict:
        """A peer is resyncing: count it alive (it is not expelled while it syncs)."""
        self._check_member(name)
        self.cluster.vouch(name, SYNCING)
        return {}

    async def rpc_handover(self, name: str, epoch: int = 0) -> dict:
        """A peer has resynced and a view names it: wait for every commit, push or namespace op
        under way here (each rechecks the view under its lock, so none of an older view starts
        after this), and answer with what it now holds a copy of (see the module's docstring)."""
        self._check_member(name)
        await self.serving.check_epoch(epoch)  # from now on nothing of an older view is taken here
        if name not in self.cluster.roles.view.active:  # it leads nothing here: an empty answer
            # would let it serve with what it held before (fresh simulator seed 1124354834)
            raise RemoteError("ESTALE", f"view {self.cluster.roles.view.epoch} does not name {name} active")
        for key in self.stripe_locks.busy():
            async with self.stripe_locks(key):
                pass
        async with self.meta_lock:
            pass
        keys = {(fid, idx) for fid, idx, _ in self.store.stripes if name in self.cluster.roles.targets(fid, idx)}
        # taken at this instant, with the stripes: not paged as a resync's are (a paged fetch
        # after the answer broke mixed simulator seed 732: a count set back). Arrays beyond a
        # page stay here in a cut of this instant, fetched by the joiner (cuts.py)
        blobs: list = []
        records = self.records.wire_records(keys, blobs=blobs)[0]
        answer = {
            "stripes": [[fid, idx, snap, s.version, s.tag] for (fid, idx, snap), s in list(self.store.stripes.items()) if (fid, idx) in keys],
            "records": records,
            "meta_stamp": list(self.resync.meta().stamp),
        }
        if sum(b.nbytes for b in blobs) <= RECORDS_PAGE:
            answer["arrays"] = [[b64encode(memoryview(b.reshape(-1)).cast("B")).decode()] for b in blobs]
        elif blobs:
            cut = self.cuts.take(blobs)
            answer["cut"] = {"id": cut, "sizes": self.cuts.sizes(cut)}
        return answer

    async def rpc_handover_arrays(self, cut: int, at: list) -> dict:
        """One page of a hand-over's cut (cuts.py) from cursor ``at`` = [array, byte offset]:
        ``pieces`` [array, offset, base64] and ``next``, the cursor of the next page or None."""
        if not (isinstance(cut, int) and isinstance(at, list) and len(at) == 2 and all(type(x) is int and x >= 0 for x in at)):
            raise RemoteError("EINVAL", f"handover_arrays: cut is an id and at [array, offset], not {cut!r}, {at!r}")
        pieces, more = self.cuts.page(cut, at[0], at[1], RECORDS_PAGE)
        return {"pieces": [[k, off, b64encode(piece).decode()] for k, off, piece in pieces], "next": list(more) if more else None}

    async def rpc_handover_release(self, cut: int) -> dict:
        """The joiner has the cut's arrays: they are dropped here."""
        if isinstance(cut, int):
            self.cuts.release(cut)
        return {}

    async def _arrays_of(self, peer: str, answer: dict) -> list | None:
        """The arrays a ``handover`` answer's records refer to: in it, or fetched from the
        peer's cut in pages (then released there); None if it has no records with arrays."""
        if "arrays" in answer:
            return [b64decode(a[0]) for a in answer["arrays"]]
        cut = answer.get("cut")
        if not cut:
            return None
        arrays = [bytearray(n) for n in cut["sizes"]]
        at: list | None = [0, 0]
        while at is not None:
            page = await self.cluster.call(peer, "handover_arrays", {"cut": cut["id"], "at": at})
            for k, off, data in page["pieces"]:
                raw = b64decode(data)
                arrays[k][off : off + len(raw)] = raw
                if self.resync.work:  # a catch-up's progress (heartbeats show it)
                    self.resync.work["bytes"] = self.resync.work.get("bytes", 0) + len(raw)
            at = page["next"]
        try:
            await self.cluster.call(peer, "handover_release", {"cut": cut["id"]})
        except (NodeDown, RemoteError) as exc:  # it expires there
            log.info("hand-over cut %d of %s not released: %s", cut["id"], peer, exc)
        return arrays

    # -- fencing ---------------------------------------------------------------------------------
    def _may_rejoin(self) -> bool:
        """Only while it holds a lease: it resyncs from the nodes the view names, or starts
        with what it holds."""
        return self.lease.may_rejoin()

    async def fence_loop(self) -> None:
        """A node that stalled, lost its lease or left the view stops serving (syncing) and,
        once it holds a lease again, resyncs before it serves: a stale node never serves an old
        version."""
        while True:
            await trio.sleep(min(self.cfg.heartbeat, self.cfg.down_after / 4))
            self.serving.check_stall()
            self.serving.check_lease()
            if not self.serving.take_rejoin():
                continue
            while not self._may_rejoin():
                await self.cluster.liveness.wait_changed(self.cfg.heartbeat * 5)
            await self.join()
            log.info("node %s ready again after resync", self.name)

    async def expel_loop(self) -> None:
        """Expel (coord/views.py V6) a peer the view names active that this node's
        heartbeats count down and have not heard for twice ``down_after``, while this node
        serves and its heartbeats reach a majority of the members (a node cut off from the
        others expels nobody). A failed replication expels too (replicator.py), but only when
        a write goes to that peer: a primary killed in a quiet cluster stayed in the view until
        its lease ended and then a TTL more (V2), and none of its stripes could be written."""
        tried: dict[str, float] = {}  # peer -> when this node last tried (etcd may be out)
        silent = 2 * self.cfg.down_after

        def quiet(peer: str) -> float:
            """How long this node's heartbeats have not heard ``peer`` (0: they count it up)."""
            if not self.cluster.liveness.is_down(peer):
                return 0.0
            return trio.current_time() - max(self.cluster.liveness.info_at.get(peer, -math.inf), self.serving.ready_since)

        while True:
            await trio.sleep(self.cfg.heartbeat)
            # a process that was itself stopped finds every peer silent: it fences first
            self.serving.check_stall()
            self.serving.check_lease()
            if self.serving.take_stalled():
                await self._step_aside()
            view = self.cluster.roles.view
            if self.serving.state != READY:
                continue
            now = trio.current_time()
            due = [p for p in view.active if p != self.name and quiet(p) >= silent and now - tried.get(p, -math.inf) >= silent]
            if not due:
                continue
            await self.cluster.heartbeats.refresh()  # heartbeats as they are now, not as they were
            for peer in due:
                if self.serving.state != READY or not self.cluster.heard_majority() or quiet(peer) < silent:
                    continue
                tried[peer] = trio.current_time()
                log.warning("node %s: %s not heard for %.1f s: expelling it", self.name, peer, quiet(peer))
                await self.lease.expel(peer)

    async def _step_aside(self) -> None:
        """A node fenced for a stall while the view still names it (its lease held, no peer
        expelled it) expels itself (coord/views.py V6, its own lease revoked), so that stand-ins
        lead its stripes while it resyncs, as when a peer expels it. Left named, its stripes
        answered EAGAIN until its resync and catch-up were done: 38 s with a 1 GiB model
        training, and pushes waiting on it timed out (chaos --model-gib 1, seed 125172). Where
        V6 or V7 refuse (a majority or a copy of every stripe would not stay active) or etcd is
        out of reach, it stays named and resyncs so, as before."""
        if not self.lease.holds():
            return  # expelled meanwhile, or its lease ended: the view moves on without it anyway
        if await self.lease.expel(self.name):
            log.warning("node %s stalled: it left view %d so that its stripes are led by others while it resyncs", self.name, self.cluster.roles.view.epoch)

    # -- membership changes (launch/rebalance.py) -------------------------------------------------------
    async def rpc_members(self) -> dict:
        """The membership this node works with, and its epoch (0: as its config file says)."""
        m = self.cluster.roles.members
        return {"epoch": m.epoch, "replicas": m.replicas, "nodes": [asdict(n) for n in m.nodes]}

    async def rpc_rebalance_pull(self, nodes: list[dict], replicas: int, settle: bool = True) -> dict:
        """Rebalance, the copy: fetch every stripe this node holds under the new membership
        ``nodes`` and lacks or holds older, from any node of the old or the new membership.
        First while writes go on (``settle`` false: the pre-copy, best effort; the stripes it
        copied are remembered), then with the cluster frozen (``settle``: every copy or an
        error; only what changed since moves, and a pre-copied stripe that no node lists any
        more was freed meanwhile and goes, unless this node is one of its homes now)."""
        specs = _node_specs(nodes)
        self.cluster.roles.know(specs)
        names = [s.name for s in specs]
        peers = sorted((set(names) | set(self.cluster.roles.members.names)) - {self.name})

        def mine(fid: int, idx: int) -> bool:
            return self.name in placement(fid, idx, names, replicas)

        if not settle:
            done = await self.resync.pull_stripes("rebalance pre-copy", peers, mine)
            self.precopied.update(done["fetched"])
            return {"stripes": done["stripes"], "bytes": done["bytes"]}
        done = await self.resync.pull_stripes("rebalance", peers, mine, strict=True)
        homes = self.cluster.roles.members
        freed = [k for k in self.precopied if k not in done["listed"] and self.name not in placement(k[0], k[1], homes.names, homes.replicas)]
        if freed:
            log.info("rebalance: %d pre-copied stripes freed since: dropped", len(freed))
            self.store.drop_keys(freed)
        self.precopied.clear()
        return {"stripes": done["stripes"], "bytes": done["bytes"]}

    async def rpc_rebalance_abort(self) -> dict:
        """A rebalance ended without switching (launch/rebalance.py): what its pre-copy brought here
        that this node does not hold under the membership it stays on (no home of it, not a
        write's target now: a stand-in keeps its copy) goes; it held memory nobody reads. The
        count dropped."""
        m = self.cluster.roles.members
        stray = [
            k for k in self.precopied if self.name not in placement(k[0], k[1], m.names, m.replicas) and self.name not in self.cluster.roles.targets(k[0], k[1])
        ]
        self.precopied.clear()
        if stray:
            log.info("rebalance abandoned: %d pre-copied stripes this node does not hold dropped", len(stray))
        return {"dropped": self.store.drop_keys(stray)}

    async def rpc_reconfigure(self, nodes: list[dict], replicas: int, epoch: int) -> dict:
        """Rebalance, step 2: switch to the new membership; after a grace period (clients learn
        it from heartbeats meanwhile) drop the stripes this node no longer holds."""
        if epoch <= self.cluster.roles.epoch:
            return {"epoch": self.cluster.roles.epoch}
        specs = _node_specs(nodes)
        self.cluster.adopt(specs, replicas, epoch)
        self.adopted(epoch)
        if self.name in self.cluster.roles.members.names:
            await self._take_namespace()
        return {"epoch": epoch}

    async def _take_namespace(self) -> None:
        """A node a rebalance adds heard no namespace op until now: it takes the namespace (a
        newer one only: the others hold it already) before it leads anything (the cluster is
        frozen until every node switched), so a stripe it makes has a version base above every
        truncate acknowledged before (namespace.py, ``drop_freed``). Ops from here on reach it
        as every member."""
        primary = self.cluster.roles.meta_primary()
        if primary is None or primary == self.name:
            return
        try:
            had = self.resync.meta().stamp
            # briefly: the caller's reconfigure call has the same bound, and the node's first op
            # brings the namespace whole anyway
            self.resync.restore_meta(await self.cluster.call(primary, "meta_snapshot", timeout=self.cfg.op_timeout / 3))
            if self.resync.meta().stamp != had:
                log.info("node %s took the namespace of %s on joining (at op %d)", self.name, primary, self.resync.meta().seq)
        except (NodeDown, RemoteError) as exc:  # its first op then brings the namespace whole
            log.warning("node %s: the namespace of %s not taken on joining: %s", self.name, primary, exc)

    def adopted(self, epoch: int) -> None:
        if self.name in self.cluster.roles.members.names:
            self.cluster.nursery.start_soon(self._drop_unhomed, epoch)
        else:
            log.warning("node %s is not a member any more (membership %d): it can be stopped", self.name, epoch)

    async def _drop_unhomed(self, epoch: int) -> None:
        await trio.sleep(GRACE_HEARTBEATS * self.cfg.heartbeat + self.cfg.down_after)
        m = self.cluster.roles.members
        if m.epoch != epoch:
            return  # another change came meanwhile: it drops for itself
        names, r = m.names, m.replicas
        gone = [k for k in self.store.stripes if self.name not in placement(k[0], k[1], names, r)]
        freed = self.store.drop_keys(gone)
        log.info("rebalance: dropped %d stripes this node no longer holds", freed)
