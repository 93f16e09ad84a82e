"""One PS node: control calls, heartbeats, replication of stripes and metadata, resync.

Data moves one-sidedly: peers READ stripe regions and WRITE into staging regions without this
code running. What runs here is the control path:

- ``commit`` (on a stripe's primary): install a staged range into the stripe under its seqlock,
  then replicate it to the stripe's backups (WRITE into the backup's staging + ``apply``) before
  answering, so an acknowledged write lives on every live replica. One lock per stripe orders
  commits, so every backup sees them in version order; a backup that is behind (it was down)
  answers ``stale`` and gets the whole stripe. A backup refuses replication from a node it
  counts down (``ESTALE``: it may be a stopped primary sending what it began before), and a
  replication that fails for good counts the backup down, so it fences and resyncs; the answer
  waits until every node the stripe then targets, the backup's stand-in included, holds the
  update (``to_every_target``, the one place of that rule). A new
  stripe's versions start above any earlier stripe's of the same index (``version_base``).
- ``meta`` (on the metadata primary): validate and apply a namespace op, then forward it with its
  sequence number to every other live node (``meta_apply``); a node that missed ops gets a
  snapshot.
- ``heartbeat``, ``stripe_info``, ``staging``, ``stripes``, reads of the namespace. Heartbeats
  carry the node's incarnation (new at each start) and serving generation, and lease the
  caller's staging (``STAGING_LEASE``).
- ``freeze``/``thaw``: the commit barrier of snapshots and rebalance.
- resync: a node starts ``syncing`` (serves replication, not reads), fetches the namespace and
  every stripe it should hold from ready peers (newest version wins; what they freed meanwhile
  is dropped), logs its progress, then turns ``ready``. The first node of a fresh cluster finds no ready peer and is ready at once.
  With ``--persist`` it loads its stripes and namespace from disk first (persist.py).

Two parts live in their own modules, mixed into ``Node``: training.py (pushes, policies,
optimizers, the push bookkeeping backups take over with) and membership.py (joining and the
hand-over of stripes from stand-ins, fencing, membership changes).

Concurrency: one trio thread; handlers run as concurrent tasks, so everything that must be
ordered takes a lock (metadata, per stripe).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import sys
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Awaitable, Callable

import trio

from ..cluster import DOWN, READY, SYNCING, Cluster, NodeDown, Slot, StagingPool, now_ns
from ..config import ClusterConfig, ConfigError, load
from ..metrics import Latency, node_samples
from ..metrics import serve as serve_metrics
from ..notify import notify
from ..progress import Progress
from ..util import keep_freed_memory
from ..transport.base import Access, AccessError, RemoteError, Transport, TransportError
from .leases import ServingLease
from .membership import Membership
from .meta import Meta
from .persist import Persist
from .policies import RecordError, StripeTraining
from .store import NoSpace, Store
from .training import TrainingCalls

log = logging.getLogger(__name__)

MAX_STAGING_PER_OWNER = 512 << 20
# Staging of an owner (a client, a mount, a peer) not heard from in heartbeats for this long is
# freed: a killed mount never says "release". A live owner cut off longer than this finds its
# region gone (AccessError) and asks for a new one.
STAGING_LEASE = 60.0
VERSION_SHIFT = 32  # a stripe takes 2**32 writes before its versions reach the next base
FREEZE_SECONDS = 30.0  # a frozen node thaws by itself after this
# what meta_restore checks of a snapshot (``Meta.snapshot``'s form) before it reads one
SNAPSHOT_FIELDS = {"seq": int, "next_ino": int, "inodes": dict, "entries": dict}


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


class Node(Membership, TrainingCalls):
    """A PS node's state and its control calls (``rpc_<method>``, dispatched by ``handle``)."""

    def __init__(self, cfg: ClusterConfig, name: str, transport: Transport, persist: str | None = None):
        self.cfg = cfg
        self.name = name
        self.spec = cfg.node(name)
        self.transport = transport
        self.state = SYNCING
        self.meta = Meta()
        self.persist = Persist(persist) if persist else None
        # A stripe created after namespace op N starts at version N << 32 + 1: a truncate is an
        # op, so a stripe freed and written again is always "newer" than its old copies, which
        # a node away meanwhile may still hold (its resync then takes the new one). Every node
        # has applied the truncate before the write that recreates the stripe is sent.
        self.store = Store(transport, cfg.capacity, self.persist, version_base=lambda: self.meta.seq << VERSION_SHIFT)
        self.meta_lock = trio.Lock()
        self.stripe_locks = KeyedLocks()
        # the staging regions this node serves: owner (a client, a mount, a peer) -> the regions
        # its WRITEs land in before the commit, apply or push that names them (``_staged``)
        self.staging: dict[str, list] = defaultdict(list)
        self.owner_seen: dict[str, float] = {}  # staging owner -> when last heard (trio clock)
        self.cluster: Cluster | None = None
        # this node's own slots in its peers' staging regions, as a writer: replicated stripe
        # ranges, optimizer state and push bookkeeping go through them to the backups
        self.replication_slots: StagingPool | None = None
        self.started = time.time()
        self.counters: dict[str, int] = defaultdict(int)
        self._signatures: dict[str, inspect.Signature] = {}  # rpc method -> its signature
        self.latency = Latency()
        self.apply_seconds = 0.0  # optimizer steps and installs of pushed gradients (training.py)
        self.training: dict[tuple[int, int], StripeTraining] = defaultdict(StripeTraining)
        # optimizer state a primary sent ahead of the parameters it goes with: installed by the
        # parameters' apply, never alone (a primary that dies between leaves both as they were)
        self.state_ahead: dict[tuple[int, int, int], tuple[bytes, int, int, int]] = {}
        self.taken_over = trio.Event()  # set once peers have handed this node its stripes back
        self.pushes_applied = trio.Event()  # set (and replaced) whenever pushes may have been applied
        # The commit barrier: a snapshot freezes commits on every node at once.
        self.commits_in_flight = 0
        self.commits_drained = trio.Event()
        self.frozen_by: str | None = None
        self.freeze_deadline = 0.0
        self.work: dict = {}
        self.ready_since = 0.0  # long work under way (resync, rebalance): shown by heartbeats
        self.last_tick = 0.0  # when this process last ran its fence ticker or a heartbeat (trio clock)
        self.must_rejoin = False  # fenced by a stall or a peer: its fence loop resyncs it
        self.gen = 0  # serving generation: +1 each time this node becomes ready (after a resync)
        # (fid, idx, snap) -> when this node last gave the stripe a version as its primary. A
        # node fenced by a stall or a peer may have given versions whose replication never
        # finished (nor was acknowledged) while the next primary gave the same numbers to other
        # bytes: its resync takes its peers' copy of what it led since ``suspect_since``.
        self.led: dict[tuple[int, int, int], float] = {}
        self.suspect_since = math.inf
        self.thawed = trio.Event()
        self.thawed.set()
        self.lease = ServingLease(cfg, name)  # its lease and view, if the config names a coordinator

    # -- lifetime ----------------------------------------------------------------------------
    def _load_persisted(self) -> None:
        meta, stripes = self.persist.load()
        if meta is not None:
            self.meta = Meta.restore(meta)
        for key, raw in stripes:
            self.store.load(key, raw)
        what = "the namespace" if meta else "no namespace"
        log.info("node %s: loaded %d stripes (%d bytes) and %s from %s", self.name, len(stripes), self.store.bytes_held, what, self.persist.root)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self.persist is not None:
            self._load_persisted()  # then resync as always: a peer's newer version wins
        async with trio.open_nursery() as nursery:
            self.cluster = Cluster(self.cfg, self.transport, nursery, me=self.name, my_state=lambda: self.state)
            self.cluster.on_adopt = self._adopted  # a membership learnt from a peer's heartbeat
            # slots of two units: optimizer state of a float16 stripe is twice its size
            self.replication_slots = StagingPool(self.cluster, f"node:{self.name}:{time.time_ns()}", 2 * self.cfg.stripe_unit)
            address = await nursery.start(partial(self.transport.serve, self.spec.host, self.spec.port, self.handle, on_imm=self.on_imm))
            log.info("node %s listening on %s:%s (transport %s)", self.name, *address, self.transport.name)
            await self.cluster.refresh()
            self.cluster.heartbeat_args["owner"] = self.replication_slots.owner
            nursery.start_soon(self.cluster.heartbeat_loop)
            nursery.start_soon(self._expire_staging)
            nursery.start_soon(self.lease.run)
            task_status.started(address)
            await self._join()
            log.info("node %s ready", self.name)
            notify(f"READY=1\nSTATUS=serving on {address[0]}:{address[1]}")
            nursery.start_soon(self._fence_loop)

    def _check_primary(self, fid: int, idx: int) -> None:
        primary = self.cluster.stripe_primary(fid, idx)
        if primary != self.name:
            raise RemoteError("ENOTPRIMARY", primary or "")

    # -- dispatch ----------------------------------------------------------------------------
    async def handle(self, method: str, args: dict) -> dict:
        """Run control call ``method`` (``rpc_<method>``). Bad input is EINVAL: arguments the
        method lacks or does not take (checked against its signature before it runs), and what
        each rpc refuses itself (``RemoteError``). Anything else raised is a fault here, not the
        caller's: logged with its traceback and answered EIO."""
        fn = getattr(self, f"rpc_{method}", None)
        if fn is None:
            raise RemoteError("ENOSYS", f"unknown method {method!r}")
        try:
            self._signature(method, fn).bind(**args)
        except TypeError as exc:
            raise RemoteError("EINVAL", f"{method}: {exc}") from None
        self.counters[method] += 1
        t0 = time.perf_counter()
        try:
            return await fn(**args)
        except RemoteError:
            raise
        except NoSpace as exc:
            raise RemoteError("ENOSPC", str(exc)) from None
        except Exception as exc:
            log.exception("node %s: control call %s failed", self.name, method)
            raise RemoteError("EIO", f"{method}: {type(exc).__name__}: {exc}") from None
        finally:
            self.latency.observe(method, time.perf_counter() - t0)

    def _signature(self, method: str, fn) -> inspect.Signature:
        sig = self._signatures.get(method)
        if sig is None:  # (inspect.signature costs more than many a call it checks)
            sig = self._signatures[method] = inspect.signature(fn)
        return sig

    def _require_ready(self) -> None:
        if self.state == READY:
            self._check_stall()  # calls queued while this process was stopped find it fenced
            self._check_lease()
        if self.state != READY:
            raise RemoteError("EAGAIN", f"node {self.name} is {self.state}")

    # -- status ------------------------------------------------------------------------------
    @property
    def sees_all_ready(self) -> bool:
        return self.cluster is not None and self.cluster.ready() == self.cfg.names

    async def rpc_heartbeat(self, owner: str | None = None, lost_at: list | None = None, **_: Any) -> dict:
        if self.state == READY:
            self._check_stall()  # before saying "ready": this process may have been stopped
            self._check_lease()
            self._lost_by_peer(lost_at)
        if owner is not None:
            self.owner_seen[owner] = trio.current_time()
        return {
            "name": self.name,
            "state": self.state,
            "sees_ready": self.cluster.ready() if self.cluster else [],
            "sees_down": [n for n in self.cfg.names if n != self.name and self.cluster.node_state(n) == DOWN] if self.cluster else [],
            "meta_seq": self.meta.seq,
            "stripes": len(self.store.stripes),
            "bytes": self.store.bytes_held,
            "capacity": self.cfg.capacity,
            "transport": self.transport.name,
            "pid": __import__("os").getpid(),
            "incarnation": self.transport.incarnation,
            "gen": self.gen,
            "uptime": round(time.time() - self.started, 3),
            "epoch": self.cluster.epoch if self.cluster else 0,
            "work": self.work,
            "calls": sum(self.counters.values()),
            "served_bytes": sum(b for _, b in self.transport.served.values()),
            "apply_seconds": round(self.apply_seconds, 6),
            **self.lease.status(),
            "replicas_behind": sum(self.cluster.node_state(n) != READY for n in self.cfg.names if n != self.name) if self.cluster else 0,
        }

    async def rpc_stripes(self) -> dict:
        return {"stripes": self.store.listing()}

    # -- metadata ----------------------------------------------------------------------------
    async def rpc_meta(self, op: dict) -> dict:
        """Apply a namespace op as the metadata primary and replicate it to every live node."""
        Meta.check(op)  # EINVAL for an op no client sends (unknown kind, missing fields)
        if op.get("rid") in self.meta.done:
            # a retry of an op applied already (its answer was lost with the old primary): a
            # hit is a fact on any node, as ops reach every node in one order
            return self.meta.done[op["rid"]]
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
            self._forget_training(result["freed"])
        if op["op"] == "unsnapshot":
            self.store.drop_snapshot(result["id"])
        if op["op"] == "setxattr" and op["name"] in ("user.irdma.removed", "user.irdma.workers") and self.cluster:
            self.cluster.nursery.start_soon(self._recheck_training)
        if op["op"] == "setattr" and "size" in op["attrs"]:
            node = self.meta.inode(op["ino"])
            if node["unit"]:
                cut = math.ceil(op["attrs"]["size"] / node["unit"])
                self.store.drop(op["ino"], cut)
                self._forget_training(op["ino"], cut)  # a truncated tensor trains from its new start
        if op["op"] == "setmodel" and op["model"]:  # the tensors' bytes live elsewhere now
            node = self.meta.inode(op["ino"])
            if node["unit"]:
                self.store.drop(op["ino"], math.ceil(op["model"]["start"] / node["unit"]))
        return result

    def _forget_training(self, fid: int, from_idx: int = 0) -> None:
        """The push bookkeeping of stripes that are gone (their clocks went with them): a tensor
        written anew (np.save truncates first, a publish with other shapes) starts its training
        from nothing, on every replica alike."""
        for key in [k for k in self.training if k[0] == fid and k[1] >= from_idx]:
            del self.training[key]

    async def _forward_meta(self, peer: str, seq: int, op: dict) -> None:
        try:
            r = await self.cluster.call(peer, "meta_apply", {"seq": seq, "op": op, "sender": self.name})
            if r.get("stale"):
                await self.cluster.call(peer, "meta_restore", {"snapshot": self.meta.snapshot()})
        except (NodeDown, RemoteError) as exc:
            log.warning("metadata op %d not replicated to %s: %s", seq, peer, exc)
            self.lost_replica(peer, exc)

    def lost_replica(self, peer: str, exc: BaseException) -> None:
        """A replication to ``peer`` failed for good: it lacks what it was sent, so it must not
        serve before it resyncs. Counting it down here makes it fence (Cluster.lost)."""
        self.cluster.mark_down(peer, f"replication failed: {exc}")

    def _check_sender(self, sender: str) -> None:
        """Replication only from a node this one does not count down: one that was (stopped,
        cut off) may send what it began before, numbered as the next primary numbers other
        bytes. It is refused; it fences (stall, or a peer's lost_at) and resyncs."""
        if sender and self.cluster is not None and self.cluster.node_state(sender) == DOWN:
            raise RemoteError("ESTALE", f"{sender} is counted down here: it must resync before it leads")

    async def rpc_meta_apply(self, seq: int, op: dict, sender: str = "") -> dict:
        self._check_sender(sender)
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
        if not isinstance(snapshot, dict) or not all(isinstance(snapshot.get(k), t) for k, t in SNAPSHOT_FIELDS.items()):
            raise RemoteError("EINVAL", "meta_restore: not a namespace snapshot (meta_snapshot's answer)")
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

    async def rpc_lookup(self, parent: int, name: str, snap: int = 0, alias: bool = False) -> dict:
        view = self.meta.view(snap)
        return view.lookup_or_model(parent, name) if alias else view.lookup(parent, name)

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

    async def rpc_staging(self, owner: str, size: int, replace: bool = False) -> dict:
        """A staging region for ``owner``; with ``replace``, the owner's earlier ones are freed
        first (a client that dropped its region after a failed transfer asks for a new one: the
        old one would otherwise stay allocated until the owner's 512 MiB were used up, then
        every write got ENOSPC; found by scripts/chaos.py)."""
        if not 0 < size <= MAX_STAGING_PER_OWNER:
            raise RemoteError("EINVAL", f"staging size {size} out of range")
        if replace:
            for old in self.staging.pop(owner, []):
                self.transport.free_region(old)
        held = sum(r.length for r in self.staging[owner])
        if held + size > MAX_STAGING_PER_OWNER:
            raise RemoteError("ENOSPC", f"owner {owner} holds {held} bytes of staging already")
        region = self.transport.alloc_region(size, Access.WRITE)
        self.staging[owner].append(region)
        self.owner_seen[owner] = trio.current_time()
        return {"rkey": region.rkey, "size": size}

    async def rpc_release(self, owner: str) -> dict:
        for region in self.staging.pop(owner, []):
            self.transport.free_region(region)
        self.owner_seen.pop(owner, None)
        return {}

    async def _expire_staging(self) -> None:
        """Free the staging of owners whose heartbeats stopped (see STAGING_LEASE)."""
        while True:
            await trio.sleep(min(STAGING_LEASE / 4, 5.0))
            now = trio.current_time()
            for owner in [o for o in self.staging if now - self.owner_seen.get(o, now) > STAGING_LEASE]:
                log.info("staging of %s freed: not heard from in %.0f s", owner, STAGING_LEASE)
                await self.rpc_release(owner)

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
                self.led[(fid, idx, 0)] = trio.current_time()
                stripe = self.store.get(fid, idx)
                await self.to_every_target(fid, idx, lambda peer: self._replicate(peer, fid, idx, offset, length, version, unit, stripe))
        return {"version": version}

    async def _replicate(
        self,
        peer: str,
        fid: int,
        idx: int,
        offset: int,
        length: int,
        version: int,
        unit: int,
        stripe,
        snap: int = 0,
        record: dict | None = None,
        *,
        pending: bool = False,
        state: int = 0,
    ) -> bool:
        """Send a range of a stripe to a backup (WRITE into its staging + ``apply``); with
        ``pending``, the whole stripe, held there until the apply that names it in ``state``.
        True once the backup holds it; False if it failed for good (the backup is counted down)."""
        extra = ({"record": record} if record is not None else {}) | ({"pending": True} if pending else {}) | ({"state": state} if state else {})

        async def push(slot: Slot, off: int, view: memoryview, full: bool) -> dict:
            await self.cluster.write(peer, slot.rkey, slot.offset, view, slot.inc)
            where = {"fid": fid, "idx": idx, "offset": off, "length": len(view), "rkey": slot.rkey, "soff": slot.offset}
            what = {"version": version, "unit": unit, "full": full, "snap": snap, "clock": stripe.clock, "sender": self.name}
            return await self.cluster.call(peer, "apply", where | what | extra)

        for attempt in (1, 2):
            try:
                if pending:
                    await self.replication_slots.with_slot(peer, lambda slot: push(slot, 0, stripe.data[: stripe.capacity], True))
                    return True
                r = await self.replication_slots.with_slot(peer, lambda slot: push(slot, offset, stripe.data[offset : offset + length], False))
                if r.get("stale"):
                    log.info("replica %s of stripe %d:%d is behind; sending the whole stripe", peer, fid, idx)
                    await self.replication_slots.with_slot(peer, lambda slot: push(slot, 0, stripe.data[: stripe.capacity], True))
                return True
            except (TransportError, RemoteError) as exc:
                if isinstance(exc, AccessError) or isinstance(exc, RemoteError) and exc.code == "EINVAL":
                    # its staging region is gone (it restarted): ask for a new one, once
                    self.replication_slots.forget(peer)
                    if attempt == 1:
                        continue
                log.warning("stripe %d:%d version %d not replicated to %s: %s", fid, idx, version, peer, exc)
                self.lost_replica(peer, exc)
                return False
        return False

    async def to_every_target(self, fid: int, idx: int, one: Callable[[str], Awaitable[bool]]) -> None:
        """The acknowledgement rule of a stripe's update, in one place: it is answered only once
        every node the stripe now targets (``Cluster.targets``) holds it. ``one(peer)`` sends it
        to a backup (True: it holds it). A backup that fails is counted down (``lost_replica``),
        which brings the stripe's stand-in into its targets, and the stand-in gets it too (one
        that lacks the stripe answers "stale" and gets it whole). Acknowledging with the failed
        backup merely counted down lost acknowledged pushes once this node fenced and resynced
        from that backup's older copy (found by the fault simulator, tests/sim, "drop" seed 0).
        With no other live node it is held here alone, as the cluster is then down to one copy.
        (Still the heartbeat design: "counted down" is this node's own view, which the views of
        issue 20 replace.)"""
        have = {self.name}
        for _ in range(2 * len(self.cfg.names) + 2):
            todo = [p for p in self.cluster.targets(fid, idx) if p not in have]
            if not todo:
                return
            done: dict[str, bool] = {}

            async def send(peer: str) -> None:
                done[peer] = await one(peer)

            async with trio.open_nursery() as n:
                for peer in todo:
                    n.start_soon(send, peer)
            have |= {p for p, ok in done.items() if ok}
        raise RemoteError("EAGAIN", f"stripe {fid}:{idx}: its replicas kept changing; not acknowledged, send it again")

    async def rpc_apply(
        self,
        fid: int,
        idx: int,
        offset: int,
        length: int,
        rkey: int,
        soff: int,
        version: int,
        unit: int,
        full: bool,
        snap: int = 0,
        clock: int = 0,
        record: dict | None = None,
        pending: bool = False,
        state: int = 0,
        sender: str = "",
    ) -> dict:
        """Install a range (or the whole stripe) a primary sent, in version order, with the
        push bookkeeping and the ``state`` optimizer-state stripes (sent ahead, ``pending``)
        that go with it (training) in the same step."""
        self._check_sender(sender)
        self._check_range(offset, length, unit)
        data = self._staged(rkey, soff, length)
        try:  # read before anything is installed: a malformed record changes nothing
            incoming = StripeTraining.from_record(record) if record is not None else None
        except RecordError as exc:
            raise RemoteError("EINVAL", str(exc)) from None
        if pending:  # optimizer state: kept aside until the parameters it belongs to arrive
            if snap >= 0 or not full:
                raise RemoteError("EINVAL", "only whole optimizer-state stripes are sent ahead")
            self.state_ahead[(fid, idx, snap)] = (bytes(data), version, clock, unit)
            return {}
        if not 0 <= state <= 2:
            raise RemoteError("EINVAL", f"{state} optimizer-state stripes (at most 2)")
        async with self.stripe_locks((fid, idx)):
            stripe = self.store.get(fid, idx, snap)
            current = stripe.version if stripe else 0
            if full:
                if version > current:
                    self.store.replace(fid, idx, data, unit, version, snap, clock)
            elif current == version - 1 or (stripe is None and version & ((1 << VERSION_SHIFT) - 1) == 1):
                # the next version, or the first of a stripe the primary just created (its other
                # bytes are zeros, as a missing stripe's are here)
                self.store.install(fid, idx, offset, data, unit, version, clock, snap)
            elif current < version:
                return {"stale": True}
            for k in range(1, state + 1):  # with the parameters, not before: never one without the other
                held = self.state_ahead.pop((fid, idx, -k), None)
                if held is None:
                    log.warning("stripe %d:%d: optimizer state %d did not arrive with its parameters", fid, idx, -k)
                    continue
                raw, sversion, sclock, sunit = held
                mine = self.store.get(fid, idx, -k)
                if mine is None or mine.version < sversion:
                    self.store.replace(fid, idx, memoryview(raw), sunit, sversion, -k, sclock)
            if incoming is not None:
                self.training[(fid, idx)].restore(incoming)
        return {}

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

        await self._pull_stripes("resync", peers, mine, converge=True)
        await self._pull_training_records(peers, mine)
        log.info("resync of node %s done in %.2fs", self.name, time.monotonic() - t0)

    async def _pull_stripes(self, what: str, peers: list[str], mine, *, strict: bool = False, converge: bool = False) -> dict:
        """Fetch, from ``peers``, the newest copy of every stripe (live, snapshot, optimizer
        state) for which ``mine(fid, idx)`` holds and that this node lacks or holds older. With
        ``strict``, a peer that cannot be listed or a stripe that cannot be fetched is an error
        (a rebalance must not switch over without every copy); otherwise it is logged. A stripe
        that every peer holding its newest copy has freed meanwhile (a namespace op: unlink,
        truncate) has nothing to copy.

        With ``converge`` (a resync: this node was away, its ready peers hold the truth), a
        stripe of this node that its peers hold at a *lower* version is replaced by theirs,
        and one that no home peer holds any more is dropped, unless it changed since the
        listing (a write replicated here meanwhile). A stripe freed by a truncate this node
        missed and then written again starts over at version 1 on its peers: keeping the old
        copy because its version is higher would serve old bytes (found by scripts/chaos.py)."""
        before = {key: s.version for key, s in self.store.stripes.items()} if converge else {}
        listed: set[str] = set()
        newest: dict[tuple[int, int, int], tuple[int, list[str], int]] = {}
        for peer in peers:
            try:
                listing = (await self.cluster.call(peer, "stripes"))["stripes"]
            except (NodeDown, RemoteError) as exc:
                if strict:
                    raise RemoteError("EAGAIN", f"{what}: cannot list {peer}: {exc}") from None
                log.warning("%s: cannot list %s: %s", what, peer, exc)
                continue
            listed.add(peer)
            for fid, idx, snap, version, cap in listing:
                best = newest.get((fid, idx, snap))
                if best is None or version > best[0]:
                    newest[(fid, idx, snap)] = (version, [peer], cap)
                elif version == best[0]:
                    best[1].append(peer)  # as new: asked if the first has freed it
        live_files = self.meta.files()
        files = {0: live_files, -1: live_files, -2: live_files} | {sid: self.meta.view(sid).files() for sid in self.meta.snapshot_ids().values()}
        todo = []
        for (fid, idx, snap), (version, holders, cap) in newest.items():
            held = self.store.get(fid, idx, snap)
            if fid in files.get(snap, ()) and mine(fid, idx) and (held is None or held.version < version):
                todo.append((fid, idx, snap, holders, cap))
            elif (
                converge
                and held is not None
                and held.version >= version
                and before.get((fid, idx, snap)) == held.version
                and (held.version > version or self.led.get((fid, idx, snap), -math.inf) >= self.suspect_since)
            ):
                log.info(
                    "%s: stripe %d:%d (snapshot %d) is at version %d here (led here before the fence), %d on its peers: taking theirs",
                    what,
                    fid,
                    idx,
                    snap,
                    held.version,
                    version,
                )
                self.store.drop_keys([(fid, idx, snap)])
                if snap == 0:  # its push bookkeeping goes with the bytes: the peers' record comes with theirs
                    self.training.pop((fid, idx), None)
                todo.append((fid, idx, snap, holders, cap))
        if converge:
            gone = []
            for key, version in before.items():
                homes = self.cluster.stripe_rank(key[0], key[1])[: self.cfg.replicas]
                others = [n for n in homes if n != self.name]
                held = self.store.get(*key)
                # every other home answered and none holds it: freed while this node was away
                # (a home that did not answer may hold the last copy: then it stays)
                if key not in newest and self.name in homes and others and set(others) <= listed and held is not None and held.version == version:
                    gone.append(key)
            if gone:
                log.info("%s: %d stripes freed on every peer while this node was away: dropped here", what, len(gone))
                self.store.drop_keys(gone)
        total_bytes = sum(t[4] for t in todo)
        log.info("%s: %d stripes (%d bytes) to fetch from %d peers", what, len(todo), total_bytes, len(peers))
        done_bytes, last_log = 0, time.monotonic()
        self.work = {"what": what, "done": 0, "total": len(todo), "bytes": 0, "total_bytes": total_bytes}
        bar = Progress(what, total_bytes, unit="B") if sys.stderr.isatty() and todo else None  # in a terminal
        try:
            for i, (fid, idx, snap, holders, cap) in enumerate(todo, 1):
                outcomes = []
                for peer in holders:
                    outcomes.append(await self._fetch_stripe(fid, idx, snap, peer))
                    if outcomes[-1] is True:
                        break
                if False in outcomes and True not in outcomes and strict:
                    raise RemoteError("EAGAIN", f"{what}: stripe {fid}:{idx} (snapshot {snap}) not fetched from {', '.join(holders)}")
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

    async def _fetch_stripe(self, fid: int, idx: int, snap: int, peer: str) -> bool | None:
        """Copy one stripe from ``peer`` unless this node holds it as new: True once done, None
        if ``peer`` no longer holds it (freed), False if the copy failed."""
        try:
            reply, inc = await self.cluster.call_on(peer, "stripe_info", {"fid": fid, "idxs": [idx], "snap": snap})
            info = reply[str(idx)]
            if info is None:
                log.info("stripe %d:%d (snapshot %d) is gone from %s (freed meanwhile)", fid, idx, snap, peer)
                return None
            buf = bytearray(info["capacity"])
            version, clock = await self.cluster.read_stripe(peer, info["rkey"], 0, memoryview(buf), inc)
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
    keep_freed_memory()  # stripe-sized buffers come and go every step: reuse, do not fault
    try:
        trio.run(node.run)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
