"""One PS node: control calls, heartbeats, replication of stripes and metadata, resync.

Data moves one-sidedly: peers READ stripe regions and WRITE into staging regions without this
code running. What runs here is the control path:

- ``commit`` (on a stripe's primary): install a staged range into the stripe under its seqlock,
  then replicate it to the stripe's backups (WRITE into the backup's staging + ``apply``) before
  answering, so an acknowledged write lives on every live replica. One lock per stripe orders
  commits, so every backup sees them in version order; a backup that is behind (it was down)
  answers ``stale`` and gets the whole stripe.
- ``meta`` (on the metadata primary): validate and apply a namespace op, then forward it with its
  sequence number to every other live node (``meta_apply``); a node that missed ops gets a
  snapshot.
- ``heartbeat``, ``stripe_info``, ``staging``, ``stripes``, reads of the namespace.

- training (``on_imm``: fused pushes; ``train_info``, ``train_wait``, ``train_record(s)``): the
  primary of a stripe takes pushes under its sync policy (sync.py), runs the optimizer, and sends
  parameters and push bookkeeping to the backups in one ``apply``, so a backup can take over.
- ``freeze``/``thaw`` (the commit barrier of snapshots and rebalance), ``rebalance_pull``,
  ``reconfigure`` and ``members`` (membership changes, rebalance.py).

A node starts ``syncing``: it tells its peers it is ``joining`` (they replicate to it from then
on), serves replication but not reads, fetches the namespace, every stripe it should hold and
their push bookkeeping from ready peers (newest version wins), logs its progress, turns
``ready`` and asks each peer to ``handover`` what it stood in for (``_join``: never two
primaries for a stripe). The first node of a fresh cluster finds no ready peer and is
ready at once. A ready node that reaches less than a majority, or that a ready peer counts down,
fences itself (syncing) and resyncs before it serves again. With ``--persist`` it loads its
stripes and namespace from disk first (persist.py).

Concurrency: one trio thread; handlers run as concurrent tasks, so everything that must be
ordered takes a lock (metadata, per stripe).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import sys
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np
import trio

from ..cluster import DOWN, READY, SYNCING, Cluster, NodeDown, StagingPool, now_ns, read_verified
from ..config import ClusterConfig, ConfigError, NodeSpec, load
from ..metrics import Latency, node_samples
from ..metrics import serve as serve_metrics
from ..notify import notify
from ..placement import placement
from ..progress import Progress
from ..transport.base import Access, AccessError, RemoteError, Transport, TransportError
from . import optim
from .meta import Meta
from .persist import Persist
from .store import NoSpace, Store
from .sync import Model, PolicyError, StripeTraining, parse_policy

log = logging.getLogger(__name__)

MAX_STAGING_PER_OWNER = 512 << 20
FREEZE_SECONDS = 30.0  # a frozen node thaws by itself after this
# after a membership change, stripes a node no longer holds are kept this many heartbeats (plus
# down_after) so that clients still on the old membership read them until they learn the new one
GRACE_HEARTBEATS = 20


class KeyedLocks:
    """One trio.Lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[Any, list] = {}

    def __call__(self, key: Any):
        return _KeyedLock(self, key)

    def busy(self) -> list:
        """The keys someone holds or waits for."""
        return list(self._locks)


class _KeyedLock:
    def __init__(self, owner: KeyedLocks, key: Any):
        self.owner, self.key = owner, key

    async def __aenter__(self) -> None:
        entry = self.owner._locks.setdefault(self.key, [trio.Lock(), 0])
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._release_ref(entry)
            raise

    async def __aexit__(self, *exc: object) -> None:
        entry = self.owner._locks[self.key]
        entry[0].release()
        self._release_ref(entry)

    def _release_ref(self, entry: list) -> None:
        entry[1] -= 1
        if entry[1] == 0:
            del self.owner._locks[self.key]


class Node:
    def __init__(self, cfg: ClusterConfig, name: str, transport: Transport, persist: str | None = None):
        self.cfg = cfg
        self.name = name
        self.spec = cfg.node(name)
        self.transport = transport
        self.state = SYNCING
        self.meta = Meta()
        self.persist = Persist(persist) if persist else None
        self.store = Store(transport, cfg.capacity, self.persist)
        self.meta_lock = trio.Lock()
        self.stripe_locks = KeyedLocks()
        self.staging: dict[str, list] = defaultdict(list)
        self.cluster: Cluster | None = None
        self.peer_staging: StagingPool | None = None
        self.started = time.time()
        self.counters: dict[str, int] = defaultdict(int)
        self.latency = Latency()
        self.training: dict[tuple[int, int], StripeTraining] = defaultdict(StripeTraining)
        # optimizer state a primary sent ahead of the parameters it goes with: installed by the
        # parameters' apply, never alone (a primary that dies between leaves both as they were)
        self.pending_state: dict[tuple[int, int, int], tuple[bytes, int, int, int]] = {}
        self.taken_over = trio.Event()  # set once peers have handed this node its stripes back
        self.progress = trio.Event()  # set (and replaced) whenever pushes may have been applied
        # The commit barrier: a snapshot freezes commits on every node at once.
        self.commits_in_flight = 0
        self.commits_drained = trio.Event()
        self.frozen_by: str | None = None
        self.freeze_deadline = 0.0
        self.work: dict = {}
        self.ready_since = 0.0  # long work under way (resync, rebalance): shown by heartbeats
        self.thawed = trio.Event()
        self.thawed.set()

    # -- lifetime ----------------------------------------------------------------------------
    def _load_persisted(self) -> None:
        meta, stripes = self.persist.load()
        if meta is not None:
            self.meta = Meta.restore(meta)
        for key, raw in stripes:
            self.store.load(key, raw)
        log.info("node %s: loaded %d stripes (%d bytes) and %s from %s", self.name, len(stripes), self.store.bytes_held, "the namespace" if meta else "no namespace", self.persist.root)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self.persist is not None:
            self._load_persisted()  # then resync as always: a peer's newer version wins
        async with trio.open_nursery() as nursery:
            self.cluster = Cluster(self.cfg, self.transport, nursery, me=self.name, my_state=lambda: self.state)
            self.cluster.on_adopt = self._adopted  # a membership learnt from a peer's heartbeat
            # slots of two units: optimizer state of a float16 stripe is twice its size
            self.peer_staging = StagingPool(self.cluster, f"node:{self.name}:{time.time_ns()}", 2 * self.cfg.stripe_unit)
            address = await nursery.start(partial(self.transport.serve, self.spec.host, self.spec.port, self.handle, on_imm=self.on_imm))
            log.info("node %s listening on %s:%s (transport %s)", self.name, *address, self.transport.name)
            await self.cluster.refresh()
            nursery.start_soon(self.cluster.heartbeat_loop)
            task_status.started(address)
            await self._join()
            log.info("node %s ready", self.name)
            notify(f"READY=1\nSTATUS=serving on {address[0]}:{address[1]}")
            nursery.start_soon(self._fence_loop)

    # -- joining: resync, then the hand-over ------------------------------------------------------
    async def _join(self) -> None:
        """(Re)join the cluster without ever having two primaries for a stripe.

        While this node was away, stand-ins were primaries of its stripes. It tells every peer
        it is ``joining`` (they replicate to it from then on, without waiting for a heartbeat),
        resyncs, turns ready, and asks each peer to ``handover``: the peer counts it ready, so
        stops taking commits and pushes for those stripes, and waits for the ones under way
        (which replicate here before they finish), and answers with the versions and push
        bookkeeping it holds of them; this node fetches any newer than its own (``_catch_up``).
        Commits, pushes, namespace ops and stripe lookups sent here meanwhile wait for the
        hand-over (``_await_takeover``). Peers' heartbeat probes begun before a node's own word
        are ignored (Cluster.vouch)."""
        self.state = SYNCING
        self.taken_over = trio.Event()
        await self._tell_peers("joining")
        await self.resync()
        self.state = READY
        self.ready_since = trio.current_time()
        handed = await self._tell_peers("handover")
        await self._catch_up(handed)
        self.taken_over.set()

    async def _tell_peers(self, method: str) -> dict[str, dict]:
        """Call ``method`` on every peer that answers; returns their answers by name."""
        answers: dict[str, dict] = {}

        async def one(peer: str) -> None:
            try:
                answers[peer] = await self.cluster.call(peer, method, {"name": self.name})
            except (NodeDown, RemoteError) as exc:  # down: it learns from heartbeats when back
                log.info("%s not told to %s: %s", method, peer, exc)

        async with trio.open_nursery() as n:
            for peer in self.cfg.names:
                if peer != self.name:
                    n.start_soon(one, peer)
        return answers

    async def _catch_up(self, handed: dict[str, dict]) -> None:
        """After the hand-over the stand-ins change nothing more of what this node leads: fetch
        what they hold newer than this node (a replication to it that failed while it synced),
        so it never leads with an old version or old push bookkeeping."""
        fetched = 0
        for peer, answer in handed.items():
            for fid, idx, snap, version in answer.get("stripes", []):
                mine = self.store.get(fid, idx, snap)
                if (mine is None or mine.version < version) and await self._fetch_stripe(fid, idx, snap, peer):
                    fetched += 1
            for key, rec in answer.get("records", {}).items():
                fid, idx = (int(x) for x in key.split(":"))
                await self._take_record_if_newer(fid, idx, rec)
        if fetched:
            log.warning("hand-over: %d stripes fetched again (their replication here had failed)", fetched)

    def _check_member(self, name: str) -> None:
        if name == self.name or name not in self.cfg.names:
            raise RemoteError("EINVAL", f"{name!r} is not another member of the cluster")

    async def rpc_joining(self, name: str) -> dict:
        """A peer is resyncing: replicate to it from now on."""
        self._check_member(name)
        self.cluster.vouch(name, SYNCING)
        return {}

    async def rpc_handover(self, name: str) -> dict:
        """A peer has resynced and is ready: it is primary again of what ranks it first. Count
        it ready, then wait for every commit, push or namespace op under way here on what it
        now leads (each rechecks who is primary under its lock, so none starts after this)."""
        self._check_member(name)
        self.cluster.vouch(name, READY)
        for key in self.stripe_locks.busy():
            if self.cluster.stripe_primary(*key) == name:
                async with self.stripe_locks(key):
                    pass
        if self.cluster.meta_primary() == name:
            async with self.meta_lock:
                pass
        # what it now leads, as held here: it fetches whatever of it is newer here than there
        led = {(fid, idx) for fid, idx, _ in self.store.stripes if self.cluster.stripe_primary(fid, idx) == name}
        return {
            "stripes": [[fid, idx, snap, s.version] for (fid, idx, snap), s in list(self.store.stripes.items()) if (fid, idx) in led],
            "records": {f"{fid}:{idx}": st.record() for (fid, idx), st in list(self.training.items()) if (fid, idx) in led and st.span[2]},
        }

    async def _await_takeover(self) -> None:
        """Primary work waits (briefly) while this node takes its stripes back."""
        if not self.taken_over.is_set():
            with trio.move_on_after(self.cfg.op_timeout):
                await self.taken_over.wait()
            if not self.taken_over.is_set():
                raise RemoteError("EAGAIN", f"node {self.name} is taking over from its stand-ins")

    def _check_primary(self, fid: int, idx: int) -> None:
        primary = self.cluster.stripe_primary(fid, idx)
        if primary != self.name:
            raise RemoteError("ENOTPRIMARY", primary or "")

    # -- fencing -------------------------------------------------------------------------------
    def _reaches_majority(self) -> bool:
        """Whether this node and the peers it can reach are a majority of the cluster."""
        reachable = sum(self.cluster.node_state(n) != DOWN for n in self.cfg.names if n != self.name)
        return reachable + 1 >= len(self.cfg.names) // 2 + 1

    def _cut_off(self) -> tuple[str, float] | None:
        """Why this node may hold stale data and how long that must last before it fences, or
        None: it reaches less than a majority of the cluster for ``down_after`` (counting
        itself; with one or two nodes a dead peer and a partition look alike, so this rule needs
        three), or a ready peer has counted it down (writes may have gone on without it: at
        once)."""
        peers = [n for n in self.cfg.names if n != self.name]
        if len(self.cfg.names) >= 3 and not self._reaches_majority():
            return "less than a majority of the cluster reachable", self.cfg.down_after
        settle = 3 * self.cfg.heartbeat + self.cfg.down_after  # peers see a new ready node by then
        for n in peers:
            info = self.cluster.info.get(n, {})
            if self.cluster.node_state(n) == READY and self.name not in info.get("sees_ready", [self.name]) and self.cluster.info_at.get(n, 0) - self.ready_since > settle:
                return f"{n} counts this node down", 0.0
        return None

    def _may_rejoin(self) -> bool:
        """A ready peer to resync from, or (everyone fenced) a majority to decide with."""
        return any(self.cluster.node_state(n) == READY for n in self.cfg.names if n != self.name) or self._reaches_majority()

    async def _fence_loop(self) -> None:
        """A node cut off from the cluster stops serving (syncing) and, once it reaches a peer
        again, resyncs before it serves: a stale node never serves an old version."""
        cut_since = None
        while True:
            await trio.sleep(self.cfg.heartbeat)
            cut = self._cut_off() if self.state == READY else None
            if cut is None:
                cut_since = None
                continue
            why, grace = cut
            cut_since = cut_since if cut_since is not None else trio.current_time()
            if trio.current_time() - cut_since < grace:
                continue  # a moment without heartbeats: not yet a partition
            log.warning("node %s fenced: %s; it serves nothing until it has resynced", self.name, why)
            self.state = SYNCING
            while not self._may_rejoin():
                await self.cluster.wait_changed(self.cfg.heartbeat * 5)
            await self._join()
            cut_since = None
            log.info("node %s ready again after resync", self.name)

    # -- dispatch ----------------------------------------------------------------------------
    async def handle(self, method: str, args: dict) -> dict:
        fn = getattr(self, f"rpc_{method}", None)
        if fn is None:
            raise RemoteError("ENOSYS", f"unknown method {method!r}")
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as exc:
            raise RemoteError("EINVAL", f"{method}: {exc}") from None
        self.counters[method] += 1
        t0 = time.perf_counter()
        try:
            return await fn(**args)
        except NoSpace as exc:
            raise RemoteError("ENOSPC", str(exc)) from None
        except (KeyError, ValueError) as exc:
            raise RemoteError("EINVAL", f"{method}: {exc}") from None
        finally:
            self.latency.observe(method, time.perf_counter() - t0)

    def _require_ready(self) -> None:
        if self.state != READY:
            raise RemoteError("EAGAIN", f"node {self.name} is {self.state}")

    # -- status ------------------------------------------------------------------------------
    @property
    def sees_all_ready(self) -> bool:
        return self.cluster is not None and self.cluster.ready() == self.cfg.names

    async def rpc_heartbeat(self, **_: Any) -> dict:
        return {
            "name": self.name,
            "state": self.state,
            "sees_ready": self.cluster.ready() if self.cluster else [],
            "meta_seq": self.meta.seq,
            "stripes": len(self.store.stripes),
            "bytes": self.store.bytes_held,
            "capacity": self.cfg.capacity,
            "transport": self.transport.name,
            "pid": __import__("os").getpid(),
            "uptime": round(time.time() - self.started, 3),
            "epoch": self.cluster.epoch if self.cluster else 0,
            "work": self.work,
            "calls": sum(self.counters.values()),
            "served_bytes": sum(b for _, b in self.transport.served.values()),
            "replicas_behind": sum(self.cluster.node_state(n) != READY for n in self.cfg.names if n != self.name) if self.cluster else 0,
        }

    async def rpc_stripes(self) -> dict:
        return {"stripes": self.store.listing()}

    # -- metadata ----------------------------------------------------------------------------
    async def rpc_meta(self, op: dict) -> dict:
        """Apply a namespace op as the metadata primary and replicate it to every live node."""
        self._require_ready()
        await self._await_takeover()
        async with self.meta_lock:
            primary = self.cluster.meta_primary()  # under the lock: a hand-over waits for it
            if primary != self.name:
                raise RemoteError("ENOTPRIMARY", primary or "")
            op = self.meta.prepare(op, now_ns())
            if op["op"] == "snapshot":
                return await self._take_snapshot(op)
            return await self._apply_and_forward(op)

    async def _apply_and_forward(self, op: dict) -> dict:
        result = self._apply_meta(op)
        seq = self.meta.seq
        async with trio.open_nursery() as n:
            for peer in self.cluster.live():
                if peer != self.name:
                    n.start_soon(self._forward_meta, peer, seq, op)
        return result

    async def _take_snapshot(self, op: dict) -> dict:
        """Freeze commits on every live node, record the namespace, copy every live stripe on
        every node under the snapshot id, thaw. Every commit is either wholly in or out."""
        self.meta.check_snapshot_name(op["name"])
        nodes = self.cluster.live()
        token = f"{self.name}:{op['id']}"
        frozen: list[str] = []
        try:
            async with trio.open_nursery() as n:
                for node in nodes:
                    n.start_soon(self._freeze_one, node, token, frozen)
            result = await self._apply_and_forward(op)
            copied = {}
            async with trio.open_nursery() as n:
                for node in nodes:
                    n.start_soon(self._copy_one, node, op["id"], copied)
            log.info("snapshot %r (id %d) taken on %s: %d bytes", op["name"], op["id"], ", ".join(sorted(copied)), sum(copied.values()))
            return dict(result, nodes=sorted(copied))
        finally:
            with trio.CancelScope(shield=True):
                for node in frozen:
                    try:
                        await self._call_node(node, "thaw", {"token": token})
                    except (NodeDown, RemoteError) as exc:  # it auto-thaws after its deadline
                        log.warning("thaw of %s failed: %s", node, exc)

    async def _call_node(self, node: str, method: str, args: dict) -> dict:
        if node == self.name:
            return await self.handle(method, args)
        return await self.cluster.call(node, method, args)

    async def _freeze_one(self, node: str, token: str, frozen: list[str]) -> None:
        try:
            await self._call_node(node, "freeze", {"token": token, "seconds": FREEZE_SECONDS})
            frozen.append(node)
        except NodeDown as exc:
            log.warning("snapshot: %s is down, it gets the snapshot at resync: %s", node, exc)

    async def _copy_one(self, node: str, snap: int, copied: dict) -> None:
        try:
            copied[node] = (await self._call_node(node, "snap_copy", {"snap": snap}))["bytes"]
        except (NodeDown, RemoteError) as exc:
            log.warning("snapshot %d not copied on %s: %s", snap, node, exc)

    def _save_meta(self) -> None:
        if self.persist is not None:
            self.persist.save_meta(self.meta.snapshot())

    def _apply_meta(self, op: dict) -> dict:
        result = self.meta.apply(op)
        self._save_meta()
        # Side effects on data are local and deterministic, so every replica does the same.
        if result.get("freed"):
            self.store.drop(result["freed"])
        if op["op"] == "unsnapshot":
            self.store.drop_snapshot(result["id"])
        if op["op"] == "setxattr" and op["name"] in ("user.irdma.removed", "user.irdma.workers") and self.cluster:
            self.cluster.nursery.start_soon(self._recheck_training)
        if op["op"] == "setattr" and "size" in op["attrs"]:
            node = self.meta.inode(op["ino"])
            if node["unit"]:
                self.store.drop(op["ino"], math.ceil(op["attrs"]["size"] / node["unit"]))
        return result

    async def _forward_meta(self, peer: str, seq: int, op: dict) -> None:
        try:
            r = await self.cluster.call(peer, "meta_apply", {"seq": seq, "op": op})
            if r.get("stale"):
                await self.cluster.call(peer, "meta_restore", {"snapshot": self.meta.snapshot()})
        except (NodeDown, RemoteError) as exc:
            log.warning("metadata op %d not replicated to %s: %s", seq, peer, exc)

    async def rpc_meta_apply(self, seq: int, op: dict) -> dict:
        if seq <= self.meta.seq:
            return {}
        if seq != self.meta.seq + 1:
            return {"stale": True}
        try:
            self._apply_meta(op)
        except RemoteError as exc:  # diverged somehow: ask for the whole namespace
            log.warning("metadata op %d failed here (%s); asking for a snapshot", seq, exc)
            return {"stale": True}
        return {}

    async def rpc_meta_restore(self, snapshot: dict) -> dict:
        if snapshot["seq"] > self.meta.seq:
            self.meta = Meta.restore(snapshot)
            self._save_meta()
            known = self.meta.files()
            for fid in {fid for fid, _, snap in self.store.stripes if snap == 0} - known:
                self.store.drop(fid)
            snaps = set(self.meta.snapshot_ids().values())
            for snap in {snap for _, _, snap in self.store.stripes if snap} - snaps:
                self.store.drop_snapshot(snap)
        return {}

    async def rpc_meta_snapshot(self) -> dict:
        return self.meta.snapshot()

    async def rpc_lookup(self, parent: int, name: str, snap: int = 0) -> dict:
        return self.meta.view(snap).lookup(parent, name)

    async def rpc_getattr(self, ino: int, snap: int = 0) -> dict:
        return self.meta.view(snap).attr(ino)

    async def rpc_readdir(self, ino: int, snap: int = 0) -> dict:
        return {"entries": self.meta.view(snap).readdir(ino)}

    async def rpc_snapshots(self) -> dict:
        return {"snapshots": {n: {"id": s["id"], "time_ns": s["time_ns"]} for n, s in self.meta.snapshots.items()}}

    # -- the commit barrier (snapshots, rebalance) -----------------------------------------------
    @asynccontextmanager
    async def _commit_barrier(self):
        """Around a change of stripe data (a commit, a push): waits while the node is frozen,
        and counts as in flight so that a freeze waits for it."""
        while self.frozen_by is not None:
            await self.thawed.wait()
        self.commits_in_flight += 1
        try:
            yield
        finally:
            self.commits_in_flight -= 1
            if not self.commits_in_flight:
                self.commits_drained.set()
                self.commits_drained = trio.Event()

    async def rpc_freeze(self, token: str, seconds: float) -> dict:
        """Hold new commits and pushes and wait for those in flight; thaws by itself after
        ``seconds`` (at most FREEZE_SECONDS) so a coordinator that died cannot leave the node
        frozen. The same token again extends the freeze (a long rebalance keeps it alive)."""
        if self.frozen_by not in (None, token):
            raise RemoteError("EBUSY", f"frozen by {self.frozen_by}")
        self.freeze_deadline = trio.current_time() + min(seconds, FREEZE_SECONDS)
        if self.frozen_by is None:
            self.frozen_by = token
            self.thawed = trio.Event()
            self.cluster.nursery.start_soon(self._auto_thaw, token)
        while self.commits_in_flight:
            await self.commits_drained.wait()
        return {}

    async def _auto_thaw(self, token: str) -> None:
        while self.frozen_by == token and trio.current_time() < self.freeze_deadline:
            await trio.sleep(self.freeze_deadline - trio.current_time())
        if self.frozen_by == token:
            log.warning("freeze %s not lifted or extended in time; thawing", token)
            await self.rpc_thaw(token)

    async def rpc_thaw(self, token: str) -> dict:
        if self.frozen_by == token:
            self.frozen_by = None
            self.thawed.set()
        return {}

    async def rpc_snap_copy(self, snap: int) -> dict:
        return {"bytes": self.store.copy_snapshot(snap)}

    async def rpc_statfs(self) -> dict:
        return {"capacity": self.cfg.capacity, "used": self.store.bytes_held, "files": len(self.meta.inodes)}

    # -- data --------------------------------------------------------------------------------
    async def rpc_stripe_info(self, fid: int, idxs: list[int], snap: int = 0) -> dict:
        self._require_ready()
        await self._await_takeover()  # no reads of this node's copies before it has caught up
        return {str(i): (s.describe() if (s := self.store.get(fid, i, snap)) else None) for i in idxs}

    async def rpc_staging(self, owner: str, size: int) -> dict:
        if not 0 < size <= MAX_STAGING_PER_OWNER:
            raise RemoteError("EINVAL", f"staging size {size} out of range")
        held = sum(r.length for r in self.staging[owner])
        if held + size > MAX_STAGING_PER_OWNER:
            raise RemoteError("ENOSPC", f"owner {owner} holds {held} bytes of staging already")
        region = self.transport.alloc_region(size, Access.WRITE)
        self.staging[owner].append(region)
        return {"rkey": region.rkey, "size": size}

    async def rpc_release(self, owner: str) -> dict:
        for region in self.staging.pop(owner, []):
            self.transport.free_region(region)
        return {}

    def _staged(self, rkey: int, offset: int, length: int) -> memoryview:
        try:
            return self.transport.regions.check(rkey, offset, length, Access.WRITE)
        except AccessError as exc:
            raise RemoteError("EINVAL", f"staging: {exc}") from None

    def _check_range(self, offset: int, length: int, unit: int) -> None:
        if unit != self.cfg.stripe_unit and (unit < 4096 or unit & (unit - 1)):
            raise RemoteError("EINVAL", f"bad stripe unit {unit}")
        if offset < 0 or length < 0 or offset + length > unit:
            raise RemoteError("EINVAL", f"range {offset}+{length} outside a stripe of {unit}")

    async def rpc_commit(self, fid: int, idx: int, offset: int, length: int, rkey: int, soff: int, unit: int) -> dict:
        """Install a staged range as the stripe's primary, replicate it, answer with its version."""
        self._require_ready()
        self._check_range(offset, length, unit)
        self._check_primary(fid, idx)
        data = self._staged(rkey, soff, length)
        await self._await_takeover()
        async with self._commit_barrier():
            async with self.stripe_locks((fid, idx)):
                # again, under the lock: a rebalance or a hand-over may have moved it meanwhile
                self._check_primary(fid, idx)
                version = self.store.install(fid, idx, offset, data, unit)
                stripe = self.store.get(fid, idx)
                async with trio.open_nursery() as n:
                    for peer in self.cluster.targets(fid, idx):
                        if peer != self.name:
                            n.start_soon(self._replicate, peer, fid, idx, offset, length, version, unit, stripe)
        return {"version": version}

    async def _replicate(self, peer: str, fid: int, idx: int, offset: int, length: int, version: int, unit: int, stripe, snap: int = 0, record: dict | None = None, *, pending: bool = False, state: int = 0) -> None:
        """Send a range of a stripe to a backup (WRITE into its staging + ``apply``); with
        ``pending``, the whole stripe, held there until the apply that names it in ``state``."""
        extra = ({"record": record} if record is not None else {}) | ({"pending": True} if pending else {}) | ({"state": state} if state else {})

        async def push(rkey: int, soff: int, off: int, view: memoryview, full: bool) -> dict:
            conn = await self.cluster.conn(peer)
            await conn.write(rkey, soff, view)
            return await self.cluster.call(
                peer,
                "apply",
                {"fid": fid, "idx": idx, "offset": off, "length": len(view), "rkey": rkey, "soff": soff, "version": version, "unit": unit, "full": full, "snap": snap, "clock": stripe.clock} | extra,
            )

        for attempt in (1, 2):
            try:
                if pending:
                    await self.peer_staging.with_slot(peer, lambda rk, so: push(rk, so, 0, stripe.data[: stripe.capacity], True))
                    return
                r = await self.peer_staging.with_slot(peer, lambda rk, so: push(rk, so, offset, stripe.data[offset : offset + length], False))
                if r.get("stale"):
                    log.info("replica %s of stripe %d:%d is behind; sending the whole stripe", peer, fid, idx)
                    await self.peer_staging.with_slot(peer, lambda rk, so: push(rk, so, 0, stripe.data[: stripe.capacity], True))
                return
            except (TransportError, RemoteError) as exc:
                if isinstance(exc, AccessError) or isinstance(exc, RemoteError) and exc.code == "EINVAL":
                    # its staging region is gone (it restarted): ask for a new one, once
                    self.peer_staging.forget(peer)
                    if attempt == 1:
                        continue
                log.warning("stripe %d:%d version %d not replicated to %s: %s", fid, idx, version, peer, exc)
                return

    async def rpc_apply(self, fid: int, idx: int, offset: int, length: int, rkey: int, soff: int, version: int, unit: int, full: bool, snap: int = 0, clock: int = 0, record: dict | None = None, pending: bool = False, state: int = 0) -> dict:
        """Install a range (or the whole stripe) a primary sent, in version order, with the
        push bookkeeping and the ``state`` optimizer-state stripes (sent ahead, ``pending``)
        that go with it (training) in the same step."""
        self._check_range(offset, length, unit)
        data = self._staged(rkey, soff, length)
        if pending:  # optimizer state: kept aside until the parameters it belongs to arrive
            if snap >= 0 or not full:
                raise RemoteError("EINVAL", "only whole optimizer-state stripes are sent ahead")
            self.pending_state[(fid, idx, snap)] = (bytes(data), version, clock, unit)
            return {}
        if not 0 <= state <= 2:
            raise RemoteError("EINVAL", f"{state} optimizer-state stripes (at most 2)")
        async with self.stripe_locks((fid, idx)):
            stripe = self.store.get(fid, idx, snap)
            current = stripe.version if stripe else 0
            if full:
                if version > current:
                    self.store.replace(fid, idx, data, unit, version, snap, clock)
            elif current == version - 1:
                self.store.install(fid, idx, offset, data, unit, version, clock, snap)
            elif current < version:
                return {"stale": True}
            for k in range(1, state + 1):  # with the parameters, not before: never one without the other
                held = self.pending_state.pop((fid, idx, -k), None)
                if held is None:
                    log.warning("stripe %d:%d: optimizer state %d did not arrive with its parameters", fid, idx, -k)
                    continue
                raw, sversion, sclock, sunit = held
                mine = self.store.get(fid, idx, -k)
                if mine is None or mine.version < sversion:
                    self.store.replace(fid, idx, memoryview(raw), sunit, sversion, -k, sclock)
            if record is not None:
                self.training[(fid, idx)].restore(record)
        return {}

    # -- training: pushes, updates, clocks ----------------------------------------------------------
    def model_of(self, fid: int) -> tuple[Model, optim.Optimizer, dict]:
        """The sync policy, worker count and optimizer in force for tensor ``fid``, from the
        user.irdma.* xattrs of its directories; EINVAL naming the accepted forms if malformed."""
        tensor = self.meta.inode(fid).get("tensor")
        if not tensor:
            raise RemoteError("EINVAL", f"inode {fid} is not a tensor")
        x = self.meta.inherited_xattrs(fid)
        try:
            policy = parse_policy(x.get("user.irdma.sync", "bsp"))
            opt = optim.parse(x.get("user.irdma.optimizer", "sgd lr=0.01"))
            workers = int(x.get("user.irdma.workers", "1"))
            removed = frozenset(int(r) for r in x.get("user.irdma.removed", "").split(",") if r.strip())
        except (PolicyError, optim.OptimError, ValueError) as exc:
            log.warning("tensor %d: %s", fid, exc)
            raise RemoteError("EINVAL", str(exc)) from None
        if workers < 1:
            raise RemoteError("EINVAL", "user.irdma.workers must be at least 1")
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
            # float16 into float32 stays float16 here: the round sum takes it in one pass
            # (native.acc_f16); anything else becomes the working dtype now
            return dense.copy() if (wire, work) == (np.float16, np.float32) else dense.astype(work)
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

    async def rpc_train_info(self, fid: int, rank: int) -> dict:
        """The model's policy as this tensor sees it, and how many pushes of ``rank`` this node
        (a stripe primary) has taken for it."""
        model, opt, tensor = self.model_of(fid)
        pushed = max((st.next_step(rank) for (f, _), st in self.training.items() if f == fid), default=0)
        x = self.meta.inherited_xattrs(fid)
        timeout = float(x.get("user.irdma.timeout", "60"))
        return {"sync": str(model.policy), "workers": model.workers, "active": model.active, "pushed": pushed, "timeout": timeout, "tensor": tensor, "compress": x.get("user.irdma.compress", "none")}

    def policy_info(self, fid: int) -> dict:
        """What a pushing client caches about a tensor's model; sent back with every push."""
        model, _, _ = self.model_of(fid)
        x = self.meta.inherited_xattrs(fid)
        return {"sync": str(model.policy), "workers": model.workers, "active": model.active, "timeout": float(x.get("user.irdma.timeout", "60")), "compress": x.get("user.irdma.compress", "none")}

    async def on_imm(self, region, offset: int, length: int, imm: int) -> dict:
        """A client's fused pushes, delivered by one WRITE with immediate into its staging slot:
        ``imm`` bytes of JSON descriptors, then the gradients they point at. Each push gets its
        own result, so one refused push does not fail the others; the reply also carries the
        policy of every tensor involved, which keeps the client's cache fresh without calls."""
        if region is None or not 0 < imm <= length:
            raise RemoteError("EINVAL", "notification without a descriptor")
        try:
            descs = json.loads(bytes(region.buf[offset : offset + imm]))
            assert isinstance(descs, list) and all(isinstance(d, dict) for d in descs)
        except (ValueError, AssertionError):
            raise RemoteError("EINVAL", "malformed push descriptor") from None
        data = region.buf[offset + imm : offset + length]
        results: list[dict] = [{} for _ in descs]

        async def one(i: int, d: dict) -> None:
            try:
                at = d.pop("at")
                results[i] = await self._push(data[at:], **d)
            except RemoteError as exc:
                results[i] = {"error": exc.code, "message": exc.message}
            except (KeyError, TypeError, ValueError) as exc:
                results[i] = {"error": "EINVAL", "message": f"bad push descriptor: {exc}"}

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for i, d in enumerate(descs):
                n.start_soon(one, i, dict(d))
        self.latency.observe("push", time.perf_counter() - t0)
        info = {}
        for fid in {d.get("fid") for d in descs}:
            try:
                info[str(fid)] = self.policy_info(fid)
            except (RemoteError, TypeError):
                pass
        return {"results": results, "info": info}

    async def _push(self, staged: memoryview, fid: int, idx: int, offset: int, count: int, rank: int, step: int, wire: str, unit: int, spans: list | None = None, busy: float | None = None, paced: float = 0.0) -> dict:
        """Gradient push ``step`` of ``rank`` for the ``count`` elements of this stripe starting
        at byte ``offset``, read from ``staged`` in dtype ``wire``: all of them, or with
        ``spans`` only the [start, length] element runs listed (chunk sparsification; the rest
        is zero); applied as the policy says."""
        self._require_ready()
        await self._await_takeover()
        async with self._commit_barrier():
            return await self._push_now(staged, fid, idx, offset, count, rank, step, wire, unit, spans, busy, paced)

    async def _push_now(self, staged: memoryview, fid: int, idx: int, offset: int, count: int, rank: int, step: int, wire: str, unit: int, spans: list | None, busy: float | None, paced: float) -> dict:
        self._check_primary(fid, idx)
        model, opt, tensor = self.model_of(fid)
        if rank not in model.active:
            raise RemoteError("EINVAL", f"rank {rank} is not one of the active workers {model.active}")
        dtype = np.dtype(tensor["dtype"])
        self._check_range(offset, count * dtype.itemsize, unit)
        if wire not in ("<f2", "<f4", "<f8"):
            raise RemoteError("EINVAL", f"gradients travel as float16/32/64, not {wire}")
        grad = self._gradient(staged, count, np.dtype(wire), spans, optim.work_dtype(dtype))
        key = (fid, idx)
        st = self.training[key]
        async with self.stripe_locks(key):
            self._check_primary(fid, idx)  # again, under the lock: a hand-over may have moved it
            done = st.next_step(rank)
            if step < done:  # a retry of a push already taken: exactly once
                return {"clock": st.clock(model), "pushed": done, "duplicate": True}
            if step > done:
                log.warning("push %d of rank %d to stripe %d:%d refused: %d taken so far", step, rank, fid, idx, done)
                raise RemoteError("EINVAL", f"rank {rank} pushed {done} times; push {step} is out of order")
            st.span = (offset, count, unit)
            st.observe(rank, busy)
            now = trio.current_time()
            st.arrive(rank, step, now, paced)
            await self._settle(fid, idx, st, model, opt, dtype, st.take(model, rank, step, grad))
            clock, held = st.clock(model), step >= st.pushed.get(rank, 0)
        self._progressed()
        return {
            "clock": clock,
            "pushed": step + 1,
            "held": held,  # r2sp: taken, applied when its turn comes
            "slot_in": round(st.slot_in(model, rank, now), 6),  # r2sp: wait this long before the next push
            "busy": {str(r): round(v, 6) for r, v in st.busy.items()},  # compute time per step
        }

    def _progressed(self) -> None:
        """Wake whoever waits for pushes to be applied."""
        self.progress.set()
        self.progress = trio.Event()

    async def rpc_train_wait(self, fid: int, idx: int, rank: int, pushed: int, timeout: float) -> dict:
        """Until ``pushed`` pushes of ``rank`` to this stripe have been applied (an r2sp push is
        held until its turn); ETIMEDOUT after ``timeout`` seconds."""
        st = self.training[(fid, idx)]
        with trio.move_on_after(timeout):
            while st.pushed.get(rank, 0) < pushed:
                await self.progress.wait()
            return {"pushed": st.pushed.get(rank, 0)}
        raise RemoteError("ETIMEDOUT", f"rank {rank}'s push {pushed - 1} not applied within {timeout}s")

    async def _settle(self, fid: int, idx: int, st: StripeTraining, model: Model, opt: optim.Optimizer, dtype: np.dtype, updates: list) -> None:
        """Apply ``updates`` and the stripe's new clock in one install, then replicate them.
        Called with the stripe's lock held."""
        offset, count, unit = st.span
        clock = st.clock(model)
        stripe = self.store.get(fid, idx)
        if stripe is None:
            raise RemoteError("EINVAL", f"tensor {fid} has no data in stripe {idx}")
        # The push bookkeeping goes to the backups with the parameters it produced, in the same
        # apply: a backup that takes over then holds both or neither, so a client's retry of an
        # unanswered push is applied exactly once (duplicate if it was, anew if it was not).
        record = st.record()
        if not updates and stripe.clock == clock:  # a bsp push that only adds to its round
            await self._replicate_record(fid, idx, record)
            return
        param = np.frombuffer(stripe.data[offset : offset + count * dtype.itemsize], dtype).copy()
        if updates:
            self._apply_updates(fid, idx, param, updates, opt, unit)
        self.store.install(fid, idx, offset, memoryview(param).cast("B"), unit, clock=clock)
        await self._replicate_training(fid, idx, offset, count * dtype.itemsize, unit, len(opt.state_names) if updates else 0, record)

    async def _replicate_record(self, fid: int, idx: int, record: dict) -> None:
        async def one(peer: str) -> None:
            try:
                await self.cluster.call(peer, "train_record", {"fid": fid, "idx": idx, "record": record})
            except (NodeDown, RemoteError) as exc:
                log.warning("training record of stripe %d:%d not replicated to %s: %s", fid, idx, peer, exc)

        async with trio.open_nursery() as n:
            for peer in self.cluster.targets(fid, idx):
                if peer != self.name:
                    n.start_soon(one, peer)

    async def rpc_train_record(self, fid: int, idx: int, record: dict) -> dict:
        """A backup keeps the primary's push bookkeeping for a stripe (to take over with it)."""
        async with self.stripe_locks((fid, idx)):
            self.training[(fid, idx)].restore(record)
        return {}

    async def _recheck_training(self) -> None:
        """The set of active ranks changed: rounds waiting for a removed rank complete, clocks
        move on, and r2sp turns skip it."""
        for (fid, idx), st in list(self.training.items()):
            if self.cluster.stripe_primary(fid, idx) != self.name or not st.span[2]:
                continue
            try:
                model, opt, tensor = self.model_of(fid)
            except RemoteError:
                continue
            async with self.stripe_locks((fid, idx)):
                if self.cluster.stripe_primary(fid, idx) != self.name:
                    continue  # handed over meanwhile
                updates = st.release(model) + st.complete_rounds(model)
                await self._settle(fid, idx, st, model, opt, np.dtype(tensor["dtype"]), updates)
        self._progressed()

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
            self.store.install(fid, idx, 0, memoryview(state[name]).cast("B"), 2 * unit, clock=t, snap=-k)

    async def _replicate_training(self, fid: int, idx: int, offset: int, length: int, unit: int, nstate: int, record: dict | None = None) -> None:
        """Optimizer state (held aside by each backup), then the parameters with version, clock
        and push bookkeeping, whose apply installs the state too: a backup that takes over holds
        all of one step or none of it."""
        stripe = self.store.get(fid, idx)
        peers = [p for p in self.cluster.targets(fid, idx) if p != self.name]
        async with trio.open_nursery() as n:
            for peer in peers:
                for k in range(1, nstate + 1):
                    s = self.store.get(fid, idx, -k)
                    n.start_soon(partial(self._replicate, peer, fid, idx, 0, s.capacity, s.version, 2 * unit, s, -k, pending=True))
        async with trio.open_nursery() as n:
            for peer in peers:
                n.start_soon(partial(self._replicate, peer, fid, idx, offset, length, stripe.version, unit, stripe, record=record, state=nstate))

    # -- resync and rebalance ---------------------------------------------------------------------
    async def resync(self) -> None:
        peers = [n for n in self.cluster.ready() if n != self.name]
        if not peers:
            log.info("node %s: no ready peer; starting with what it holds", self.name)
            return
        t0 = time.monotonic()
        primary = self.cluster.meta_primary()
        snap = await self.cluster.call(primary, "meta_snapshot")
        await self.rpc_meta_restore(snap)
        live = set(peers) | {self.name}

        def mine(fid: int, idx: int) -> bool:
            return self.name in [n for n in self.cluster.stripe_rank(fid, idx) if n in live][: self.cfg.replicas]

        await self._pull_stripes("resync", peers, mine)
        await self._pull_training_records(peers, mine)
        log.info("resync of node %s done in %.2fs", self.name, time.monotonic() - t0)

    async def _pull_training_records(self, peers: list[str], mine) -> None:
        """The push bookkeeping of the stripes this node holds, from its peers: a node that
        becomes a stripe's primary again must know how many pushes each rank made."""
        for peer in peers:
            try:
                records = (await self.cluster.call(peer, "train_records"))["records"]
            except (NodeDown, RemoteError) as exc:
                log.warning("resync: no training records from %s: %s", peer, exc)
                continue
            for key, rec in records.items():
                fid, idx = (int(x) for x in key.split(":"))
                if mine(fid, idx):
                    await self._take_record_if_newer(fid, idx, rec)

    async def _take_record_if_newer(self, fid: int, idx: int, rec: dict) -> None:
        """A peer's push bookkeeping of a stripe, if it has taken more pushes (never go back)."""
        incoming = StripeTraining()
        incoming.restore(rec)
        async with self.stripe_locks((fid, idx)):
            if incoming.progress > self.training[(fid, idx)].progress:
                self.training[(fid, idx)].restore(rec)

    async def rpc_train_records(self) -> dict:
        return {"records": {f"{fid}:{idx}": st.record() for (fid, idx), st in list(self.training.items()) if st.span[2]}}

    async def _pull_stripes(self, what: str, peers: list[str], mine, *, strict: bool = False) -> dict:
        """Fetch, from ``peers``, the newest copy of every stripe (live, snapshot, optimizer
        state) for which ``mine(fid, idx)`` holds and that this node lacks or holds older. With
        ``strict``, a peer that cannot be listed or a stripe that cannot be fetched is an error
        (a rebalance must not switch over without every copy); otherwise it is logged."""
        newest: dict[tuple[int, int, int], tuple[int, str, int]] = {}
        for peer in peers:
            try:
                listing = (await self.cluster.call(peer, "stripes"))["stripes"]
            except (NodeDown, RemoteError) as exc:
                if strict:
                    raise RemoteError("EAGAIN", f"{what}: cannot list {peer}: {exc}") from None
                log.warning("%s: cannot list %s: %s", what, peer, exc)
                continue
            for fid, idx, snap, version, cap in listing:
                if version > newest.get((fid, idx, snap), (-1,))[0]:
                    newest[(fid, idx, snap)] = (version, peer, cap)
        live_files = self.meta.files()
        files = {0: live_files, -1: live_files, -2: live_files} | {sid: self.meta.view(sid).files() for sid in self.meta.snapshot_ids().values()}
        todo = []
        for (fid, idx, snap), (version, peer, cap) in newest.items():
            held = self.store.get(fid, idx, snap)
            if fid in files.get(snap, ()) and mine(fid, idx) and (held is None or held.version < version):
                todo.append((fid, idx, snap, peer, cap))
        total_bytes = sum(t[4] for t in todo)
        log.info("%s: %d stripes (%d bytes) to fetch from %d peers", what, len(todo), total_bytes, len(peers))
        done_bytes, last_log = 0, time.monotonic()
        self.work = {"what": what, "done": 0, "total": len(todo), "bytes": 0, "total_bytes": total_bytes}
        bar = Progress(what, total_bytes, unit="B") if sys.stderr.isatty() and todo else None  # in a terminal
        try:
            for i, (fid, idx, snap, peer, cap) in enumerate(todo, 1):
                if not await self._fetch_stripe(fid, idx, snap, peer) and strict:
                    raise RemoteError("EAGAIN", f"{what}: stripe {fid}:{idx} (snapshot {snap}) not fetched from {peer}")
                done_bytes += cap
                self.work.update(done=i, bytes=done_bytes)
                if bar is not None:
                    bar.update(done_bytes)
                elif time.monotonic() - last_log > 1.0 or i == len(todo):
                    last_log = time.monotonic()
                    log.info("%s: %d/%d stripes, %d/%d bytes", what, i, len(todo), done_bytes, total_bytes)
                    notify(f"STATUS={what} {i}/{len(todo)} stripes")
        finally:
            self.work = {}
            if bar is not None:
                bar.close()
        return {"stripes": len(todo), "bytes": done_bytes}

    async def rpc_members(self) -> dict:
        """The membership this node works with, and its epoch (0: as its config file says)."""
        return {"epoch": self.cluster.epoch, "replicas": self.cfg.replicas, "nodes": [asdict(n) for n in self.cfg.nodes]}

    async def rpc_rebalance_pull(self, nodes: list[dict], replicas: int) -> dict:
        """Rebalance, step 1 (the cluster frozen): fetch every stripe this node holds under the
        new membership ``nodes`` and lacks, from any node of the old or the new membership."""
        specs = [NodeSpec(str(n["name"]), str(n["host"]), int(n["port"])) for n in nodes]
        self.cluster.know(specs)
        names = [s.name for s in specs]
        peers = sorted((set(names) | set(self.cfg.names)) - {self.name})

        def mine(fid: int, idx: int) -> bool:
            return self.name in placement(fid, idx, names, replicas)

        return await self._pull_stripes("rebalance", peers, mine, strict=True)

    async def rpc_reconfigure(self, nodes: list[dict], replicas: int, epoch: int) -> dict:
        """Rebalance, step 2: switch to the new membership; after a grace period (clients learn
        it from heartbeats meanwhile) drop the stripes this node no longer holds."""
        if epoch <= self.cluster.epoch:
            return {"epoch": self.cluster.epoch}
        specs = [NodeSpec(str(n["name"]), str(n["host"]), int(n["port"])) for n in nodes]
        self.cluster.adopt(specs, replicas, epoch)
        self._adopted(epoch)
        return {"epoch": epoch}

    def _adopted(self, epoch: int) -> None:
        if self.name in self.cfg.names:
            self.cluster.nursery.start_soon(self._drop_unhomed, epoch)
        else:
            log.warning("node %s is not a member any more (membership %d): it can be stopped", self.name, epoch)

    async def _drop_unhomed(self, epoch: int) -> None:
        await trio.sleep(GRACE_HEARTBEATS * self.cfg.heartbeat + self.cfg.down_after)
        if self.cluster.epoch != epoch:
            return  # another change came meanwhile: it drops for itself
        names, r = self.cfg.names, self.cfg.replicas
        gone = [k for k in self.store.stripes if self.name not in placement(k[0], k[1], names, r)]
        freed = self.store.drop_keys(gone)
        log.info("rebalance: dropped %d stripes this node no longer holds", freed)

    async def _fetch_stripe(self, fid: int, idx: int, snap: int, peer: str) -> bool:
        """Copy one stripe from ``peer`` unless this node holds it as new; False if it failed."""
        try:
            info = (await self.cluster.call(peer, "stripe_info", {"fid": fid, "idxs": [idx], "snap": snap}))[str(idx)]
            if info is None:
                log.warning("stripe %d:%d (snapshot %d) is gone from %s", fid, idx, snap, peer)
                return False
            buf = bytearray(info["capacity"])
            conn = await self.cluster.conn(peer)
            version, clock = await read_verified(conn, info["rkey"], 0, memoryview(buf))
        except (TransportError, RemoteError) as exc:
            log.warning("stripe %d:%d from %s failed: %s", fid, idx, peer, exc)
            return False
        async with self.stripe_locks((fid, idx)):
            mine = self.store.get(fid, idx, snap)
            if mine is None or mine.version < version:  # replication may have brought newer
                self.store.replace(fid, idx, memoryview(buf), 2 * self.cfg.stripe_unit, version, snap, clock)
        return True


def choose_transport(cfg: ClusterConfig) -> Transport:
    from ..transport.select import choose

    return choose(cfg.transport, cfg.token, op_timeout=cfg.op_timeout)


def setup_logging(prefix: str, level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="irdmafs-node", description="Run one irdmafs PS node.")
    ap.add_argument("--config", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--metrics", metavar="[HOST:]PORT", help="serve Prometheus metrics here")
    ap.add_argument("--persist", metavar="DIR", help="keep every stripe and the namespace in DIR (written through) and load them at start")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(args.node, logging.DEBUG if args.verbose else logging.INFO)
    try:
        cfg = load(args.config)
        cfg.node(args.node)
    except ConfigError as exc:
        print(f"irdmafs: {exc}", file=sys.stderr)
        return 2
    node = Node(cfg, args.node, choose_transport(cfg), persist=args.persist)
    if args.metrics:
        try:
            serve_metrics(args.metrics, lambda: node_samples(node))
        except (OSError, ValueError) as exc:
            print(f"irdmafs: metrics on {args.metrics}: {exc}", file=sys.stderr)
            return 2
    try:
        trio.run(node.run)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
