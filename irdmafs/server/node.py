"""One PS node: it builds its services, holds the table of control calls, and serves the data path.

Data moves one-sidedly: peers READ stripe regions and WRITE into staging regions without this
code running. What runs here is the control path, in services each of its own module, built
here with their collaborators handed in; their imports run one way (membership -> resync ->
training -> replicator -> cluster; the namespace gets training's two hooks as functions):

- serving.py: whether this node serves now (syncing, ready), and the checks every call makes;
- staging.py: the staging regions peers WRITE into, leased by their owners' heartbeats;
- locks.py, barrier.py: a lock per stripe; the commit barrier (freeze/thaw) of snapshots;
- replicator.py: the one path that sends a change to the other replicas, and the one place of
  the acknowledgement rule (``to_every_target``);
- namespace.py: namespace ops, their replication, snapshots;
- training.py: pushes, sync policies, optimizer steps, push bookkeeping;
- resync.py: how a node that was away catches up; membership.py: joining, the hand-over,
  fencing, membership changes; leases.py: the coordination lease and view.

The calls served here are the data path's:

- ``commit`` (on a stripe's primary): install a staged range into the stripe under its seqlock,
  then replicate it to the stripe's backups before answering (the replicator), so an
  acknowledged write lives on every live replica. One lock per stripe orders commits, so every
  backup sees them in version order; a backup that is behind (it was down) answers ``stale``
  and gets the whole stripe. A backup refuses replication from a node it counts down
  (``ESTALE``). A new stripe's versions start above any earlier stripe's of the same index
  (``version_base``).
- ``apply`` (on a backup): install what a primary sent, in version order, with the push
  bookkeeping and optimizer state that go with it.
- ``heartbeat``, ``stripe_info``, ``stripes``, ``staging``, ``release``, ``freeze``, ``thaw``,
  ``snap_copy``, ``statfs``. Heartbeats carry the node's incarnation (new at each start) and
  serving generation, and lease the caller's staging (``STAGING_LEASE``).

With ``--persist`` a node loads its stripes and namespace from disk first (persist.py), then
resyncs as always.

Concurrency: one trio thread; handlers run as concurrent tasks, so everything that must be
ordered takes a lock (the namespace, per stripe).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import time
from collections import defaultdict
from functools import partial
from typing import Any, Callable

import trio

from ..cluster import DOWN, READY, Cluster, StagingPool
from ..config import ClusterConfig, ConfigError, load
from ..metrics import Latency, node_samples
from ..metrics import serve as serve_metrics
from ..notify import notify
from ..transport.base import RemoteError, Transport
from ..util import keep_freed_memory
from .barrier import CommitBarrier
from .leases import ServingLease
from .locks import KeyedLocks
from .membership import Membership
from .meta import Meta
from .namespace import Namespace
from .persist import Persist
from .policies import RecordError, StripeTraining
from .replicator import Replicator
from .resync import Resync
from .serving import Serving
from .staging import MAX_STAGING_PER_OWNER, Staged, StagingRegions
from .store import NoSpace, Store
from .training import Training
from .updates import StripeKey, StripeRange, Update, check_range

log = logging.getLogger(__name__)

__all__ = ["Node", "MAX_STAGING_PER_OWNER", "VERSION_SHIFT", "main"]

VERSION_SHIFT = 32  # a stripe takes 2**32 writes before its versions reach the next base


class Node:
    """A PS node: its services, and its control calls (``rpc_<method>`` of this object and of
    its services, dispatched by ``handle``)."""

    def __init__(self, cfg: ClusterConfig, name: str, transport: Transport, persist: str | None = None):
        self.cfg, self.name, self.spec, self.transport = cfg, name, cfg.node(name), transport
        self.persist = Persist(persist) if persist else None
        self.started = time.time()
        self.counters: dict[str, int] = defaultdict(int)
        self.latency = Latency()
        self.cluster = Cluster(cfg, transport, None, me=name, my_state=lambda: self.serving.state)
        self.lease = ServingLease(cfg, name)  # its lease and view, if the config names a coordinator
        self.serving = Serving(cfg, name, self.cluster, self.lease, transport.incarnation)
        self.staging = StagingRegions(transport)
        self.stripe_locks = KeyedLocks()
        self.barrier = CommitBarrier()
        # this node's own slots in its peers' staging regions, as a writer: replicated stripe
        # ranges, optimizer state and push bookkeeping go through them to the backups (slots
        # of two units: optimizer state of a float16 stripe is twice its size)
        slots = StagingPool(self.cluster, f"node:{name}:{time.time_ns()}", 2 * cfg.stripe_unit)
        self.replicator = Replicator(name, self.cluster, slots, lambda: self.namespace.meta.snapshot())
        # A stripe created after namespace op N starts at version N << 32 + 1: a truncate is an
        # op, so a stripe freed and written again is always "newer" than its old copies, which
        # a node away meanwhile may still hold (its resync then takes the new one). Every node
        # has applied the truncate before the write that recreates the stripe is sent.
        self.store = Store(transport, cfg.capacity, self.persist, version_base=lambda: self.namespace.meta.seq << VERSION_SHIFT)
        self.training = Training(
            name, cfg, lambda: self.namespace.meta, self.store, self.stripe_locks, self.serving, self.barrier, self.replicator, self.staging, self.latency
        )
        self.namespace = Namespace(
            name, self.cluster, self.store, self.persist, self.serving, self.replicator, self._call_node, self.training.forget, self.training.recheck
        )
        self.resync = Resync(
            name, cfg, self.cluster, self.store, self.stripe_locks, self.serving, self.training, self.namespace.current, self.namespace.restore
        )
        self.membership = Membership(
            name, cfg, self.cluster, self.store, self.stripe_locks, self.namespace.lock, self.serving, self.training, self.resync, self.lease
        )
        self.cluster.on_adopt = self.membership.adopted  # a membership learnt from a peer's heartbeat
        # optimizer state a primary sent ahead of the parameters it goes with: installed by the
        # parameters' apply, never alone (a primary that dies between leaves both as they were)
        self.state_ahead: dict[tuple[int, int, int], tuple[bytes, int, int, int]] = {}
        self.calls: dict[str, Callable] = {}  # method -> its handler (``handle``)
        for part in (self, self.namespace, self.training, self.membership):
            for attr in dir(part):
                if attr.startswith("rpc_"):
                    assert attr[4:] not in self.calls, f"two handlers of {attr}"
                    self.calls[attr[4:]] = getattr(part, attr)
        self._signatures: dict[str, inspect.Signature] = {}  # method -> its handler's signature

    # -- what the rest of the process (metrics, tests) reads ---------------------------------
    @property
    def state(self) -> str:
        return self.serving.state

    @property
    def gen(self) -> int:
        return self.serving.gen

    @property
    def meta(self) -> Meta:
        return self.namespace.meta

    @property
    def sees_all_ready(self) -> bool:
        return self.cluster.nursery is not None and self.cluster.ready() == self.cfg.names

    # -- lifetime ----------------------------------------------------------------------------
    def _load_persisted(self) -> None:
        meta, stripes = self.persist.load()
        if meta is not None:
            self.namespace.meta = Meta.restore(meta)
        for key, raw in stripes:
            self.store.load(key, raw)
        what = "the namespace" if meta else "no namespace"
        log.info("node %s: loaded %d stripes (%d bytes) and %s from %s", self.name, len(stripes), self.store.bytes_held, what, self.persist.root)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self.persist is not None:
            self._load_persisted()  # then resync as always: a peer's newer version wins
        async with trio.open_nursery() as nursery:
            self.cluster.nursery = nursery
            address = await nursery.start(partial(self.transport.serve, self.spec.host, self.spec.port, self.handle, on_imm=self.training.on_imm))
            log.info("node %s listening on %s:%s (transport %s)", self.name, *address, self.transport.name)
            await self.cluster.refresh()
            self.cluster.heartbeat_args["owner"] = self.replicator.slots.owner
            nursery.start_soon(self.cluster.heartbeat_loop)
            nursery.start_soon(self.staging.expire_loop)
            nursery.start_soon(self.lease.run)
            task_status.started(address)
            await self.membership.join()
            log.info("node %s ready", self.name)
            notify(f"READY=1\nSTATUS=serving on {address[0]}:{address[1]}")
            nursery.start_soon(self.membership.fence_loop)

    # -- dispatch ----------------------------------------------------------------------------
    async def handle(self, method: str, args: dict) -> dict:
        """Run control call ``method``. Bad input is EINVAL: arguments the method lacks or does
        not take (checked against its signature before it runs), and what each call refuses
        itself (``RemoteError``). Anything else raised is a fault here, not the caller's:
        logged with its traceback and answered EIO."""
        fn = self.calls.get(method)
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

    async def _call_node(self, node: str, method: str, args: dict) -> dict:
        """``method`` on ``node``, this node included (a snapshot freezes every node)."""
        if node == self.name:
            return await self.handle(method, args)
        return await self.cluster.call(node, method, args)

    # -- status ------------------------------------------------------------------------------
    async def rpc_heartbeat(self, owner: str | None = None, lost_at: list | None = None, **_: Any) -> dict:
        serving = self.serving
        if serving.state == READY:
            serving.check_stall()  # before saying "ready": this process may have been stopped
            serving.check_lease()
            serving.lost_by_peer(lost_at)
        if owner is not None:
            self.staging.seen(owner)
        return {
            "name": self.name,
            "state": serving.state,
            "sees_ready": self.cluster.ready(),
            "sees_down": [n for n in self.cfg.names if n != self.name and self.cluster.node_state(n) == DOWN],
            "meta_seq": self.meta.seq,
            "stripes": len(self.store.stripes),
            "bytes": self.store.bytes_held,
            "capacity": self.cfg.capacity,
            "transport": self.transport.name,
            "pid": os.getpid(),
            "incarnation": self.transport.incarnation,
            "gen": serving.gen,
            "uptime": round(time.time() - self.started, 3),
            "epoch": self.cluster.epoch,
            "work": self.resync.work,
            "calls": sum(self.counters.values()),
            "served_bytes": sum(b for _, b in self.transport.served.values()),
            "apply_seconds": round(self.training.apply_seconds, 6),
            **self.lease.status(),
            "replicas_behind": sum(self.cluster.node_state(n) != READY for n in self.cfg.names if n != self.name),
        }

    async def rpc_stripes(self) -> dict:
        return {"stripes": self.store.listing()}

    async def rpc_statfs(self) -> dict:
        return {"capacity": self.cfg.capacity, "used": self.store.bytes_held, "files": len(self.meta.inodes)}

    # -- the commit barrier (snapshots, rebalance) -------------------------------------------
    async def rpc_freeze(self, token: str, seconds: float) -> dict:
        """Hold new commits and pushes and wait for those in flight (barrier.py)."""
        await self.barrier.freeze(token, seconds, self.cluster.nursery)
        return {}

    async def rpc_thaw(self, token: str) -> dict:
        self.barrier.thaw(token)
        return {}

    async def rpc_snap_copy(self, snap: int) -> dict:
        return {"bytes": self.store.copy_snapshot(snap)}

    # -- staging -----------------------------------------------------------------------------
    async def rpc_staging(self, owner: str, size: int, replace: bool = False) -> dict:
        """A staging region for ``owner`` (staging.py; ``replace``: its earlier ones freed)."""
        return self.staging.alloc(owner, size, replace)

    async def rpc_release(self, owner: str) -> dict:
        self.staging.release(owner)
        return {}

    # -- data --------------------------------------------------------------------------------
    async def rpc_stripe_info(self, fid: int, idxs: list[int], snap: int = 0) -> dict:
        self.serving.require_ready()
        await self.serving.await_takeover()  # no reads of this node's copies before it has caught up
        return {str(i): (s.describe() if (s := self.store.get(fid, i, snap)) else None) for i in idxs}

    async def rpc_commit(self, fid: int, idx: int, offset: int, length: int, rkey: int, soff: int, unit: int) -> dict:
        """Install a staged range as the stripe's primary, replicate it, answer with its version."""
        self.serving.require_ready()
        check_range(offset, length, unit, self.cfg.stripe_unit)
        self.serving.check_primary(fid, idx)
        data = self.staging.view(Staged(rkey, soff, length))
        await self.serving.await_takeover()
        async with self.barrier.changing():
            async with self.stripe_locks((fid, idx)):
                # again, under the lock: a rebalance or a hand-over may have moved it meanwhile
                self.serving.check_primary(fid, idx)
                version = self.store.install(fid, idx, offset, data, unit)
                self.serving.led_now((fid, idx, 0))
                update = Update(StripeRange(StripeKey(fid, idx), offset, length, unit), version, self.store.get(fid, idx))
                await self.replicator.to_every_target(update.range.key, lambda peer: self.replicator.update(peer, update))
        return {"version": version}

    async def rpc_apply(
        self,
        where: list,
        staged: list,
        version: int,
        clock: int,
        full: bool,
        record: dict | None = None,
        pending: bool = False,
        state: int = 0,
        sender: str = "",
    ) -> dict:
        """Install range ``where`` (or with ``full`` the whole stripe) a primary sent (replicator.py), in
        version order, with the push bookkeeping (``record``) and the ``state`` optimizer-state
        stripes sent ahead (``pending``) that go with it (training) in the same step."""
        self.serving.check_sender(sender)
        r = StripeRange.parse(where)
        (fid, idx, snap), offset, length, unit = r
        check_range(offset, length, unit, self.cfg.stripe_unit)
        if not (isinstance(staged, list) and len(staged) == 2 and all(type(v) is int for v in staged)):
            raise RemoteError("EINVAL", f"staged is [rkey, offset], not {staged!r}")
        data = self.staging.view(Staged(staged[0], staged[1], length))
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
                self.training.records[(fid, idx)].restore(incoming)
        return {}


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
