"""One PS node: it builds its services and holds the table of their control calls.

Data moves one-sidedly: peers READ stripe regions and WRITE into staging regions without this
code running. What runs here is the control path, in services each of its own module, built
here with their collaborators handed in (``NodeCore``: name, config, cluster view, store, stripe
locks, serving state; and what else each needs). Their imports run one way: membership ->
resync -> records -> leading -> replicator -> cluster; training -> records; the namespace gets
the two hooks of training and records as functions.

- leading.py: the one update path of a primary (admitted, held, replicated, published), which
  commits, pushes and namespace ops go through;
- datapath.py: ``commit`` (a stripe's primary), ``apply`` (a backup), ``stripe_info``;
- namespace.py: namespace ops, their replication, snapshots;
- pushes.py: a client's fused pushes taken apart and checked; training.py: the round (a push
  taken under its policy, optimizer steps, their replication); records.py: the push
  bookkeeping and how it travels; clocks.py: a pull told when its round closed (``clock_wait``);
- membership.py: joining, the hand-over, fencing, membership changes; resync.py: how a node
  that was away catches up; leases.py: the coordination lease and view;
- replicator.py: the one path that sends a change to the other replicas, and the one place of
  the acknowledgement rule (``to_every_target``);
- serving.py: whether this node serves now (syncing, ready), and the checks every call makes;
- staging.py, locks.py, barrier.py: the staging regions peers WRITE into, a lock per stripe,
  the commit barrier (freeze/thaw) of snapshots and rebalance.

Here: ``heartbeat`` (the node's status; it carries the incarnation, new at each start, the
serving generation, and what serves its data plane: transport, engine, kernels; and leases the
caller's staging), ``statfs``, ``staging``/``release``,
``freeze``/``thaw``. With ``--persist`` a node loads its stripes and namespace from disk first
(persist.py), then resyncs as always.

Concurrency: one trio thread; handlers run as concurrent tasks, so everything that must be
ordered takes a lock (the namespace, per stripe).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import defaultdict
from functools import partial
from typing import Any, Callable

import trio

from ..calls import CALLS
from ..runtime.cluster import READY, Cluster
from ..config import NO_COORDINATOR, ClusterConfig, load
from ..errors import ConfigError, RemoteError
from ..coord.contract import Coordinator
from ..runtime import dataplane, looplag
from ..runtime.looplag import LoopLag
from ..metrics import Latency, node_samples
from ..metrics import serve as serve_metrics
from ..runtime.notify import notify
from ..runtime.offload import Offload
from ..runtime.slots import StagingPool
from ..transport.base import Transport
from ..util import keep_freed_memory
from . import health
from .barrier import CommitBarrier
from .budget import Budget
from .clocks import ClockWaits
from .core import NodeCore
from .datapath import VERSION_SHIFT, DataPath
from .missing import Missing
from .tails import Tails
from .leading import Leading
from .leases import ServingLease
from .spares import SPARE
from .locks import KeyedLocks
from .membership import Membership
from .meta import Meta
from .namespace import Namespace
from .persist import Persist
from .pushes import PushIntake
from .records import PushRecords
from .replicator import Replicator
from .resync import Resync
from .serving import Serving
from .staging import MAX_STAGING_PER_OWNER, StagingRegions
from .status import Publisher
from .store import NoSpace, Store
from .training import Training

log = logging.getLogger(__name__)
WRITER_GRACE = 3  # down_afters a file's writer may go unheard before its file opens as EIO (W3)

__all__ = ["Node", "MAX_STAGING_PER_OWNER", "main"]



class Node:
    """A PS node: its services, and its control calls (``rpc_<method>`` of this object and of
    its services, each with its request and reply types in irdmafs/calls.py, dispatched by
    ``handle``)."""

    def __init__(
        self, cfg: ClusterConfig, name: str, transport: Transport, persist: str | None = None, coord: Coordinator | None = None, offload: Offload | None = None
    ):
        """``coord``: the coordination service, if not the etcd the config names (the simulator);
        ``offload``: how work leaves the loop (runtime/offload.py; the simulator's runs inline)."""
        self.cfg, self.name, self.spec, self.transport = cfg, name, cfg.node(name), transport
        self.offload = offload or Offload()
        self.persist = Persist(persist) if persist else None
        self.started = time.time()
        self.counters: dict[str, int] = defaultdict(int)
        self.latency = Latency()
        self.cluster = Cluster(cfg, transport, None, me=name, my_state=lambda: self.serving.state)
        self.lease = ServingLease(cfg, name, lambda: self.cluster.roles.members, coord)  # its lease and views
        keeper_learns = self.lease.follow(self.cluster.roles.learn_view)  # views decide who serves (runtime/roles.py)
        if keeper_learns is None:
            raise ConfigError(NO_COORDINATOR)
        self.cluster.roles.on_view.append(keeper_learns)
        self.serving = Serving(cfg, name, self.cluster, self.lease, transport.incarnation)
        # every byte this node holds for others, against its capacity (budget.py)
        self.budget = Budget(cfg.capacity)
        self.staging = StagingRegions(transport, self.budget)
        self.loop_lag = LoopLag()  # how late this node's loop runs (runtime/looplag.py)
        self.stripe_locks = KeyedLocks()
        # a snapshot's freeze (token "<node>:<id>") lifts once the view no longer names its
        # coordinator active; a rebalance's ("rebalance:...") only by its thaw or its deadline
        self.barrier = CommitBarrier(self._freezer_gone)
        # this node's own slots in its peers' staging regions, as a writer: replicated stripe
        # ranges, optimizer state and push bookkeeping go through them to the backups (slots
        # of two units: optimizer state of a float16 stripe is twice its size)
        slots = StagingPool(self.cluster, f"node:{name}:{time.time_ns()}", 2 * cfg.stripe_unit)
        self.replicator = Replicator(name, self.cluster, slots, lambda: self.namespace.meta.snapshot(), self.serving)
        # A stripe created after namespace op N starts at version N << 32 + 1: a truncate is an
        # op, so a stripe freed and written again is always "newer" than its old copies, which
        # a node away meanwhile may still hold (its resync then takes the new one). Every node
        # has applied the truncate before the write that recreates the stripe is sent.
        # Versions a primary gives are tagged with its view epoch (store.py: replicas compare both).
        self.store = Store(
            transport, self.budget, self.persist, version_base=lambda: self.namespace.meta.seq << VERSION_SHIFT, epoch=lambda: self.cluster.roles.view_epoch
        )
        core = NodeCore(name, cfg, self.cluster, self.store, self.stripe_locks, self.serving)
        self.as_primary = Leading(core, self.barrier, self.replicator)  # the one update path of a primary
        self.records = PushRecords(core, self.staging, self.as_primary)  # push bookkeeping, per stripe
        self.training = Training(core, lambda: self.namespace.meta, self.as_primary, self.records)
        self.pushes = PushIntake(name, self.cluster, self.latency, self.training.push, self.training.policy_info)
        self.namespace = Namespace(core, self.persist, self.as_primary, self._call_node, self.records.forget, self.training.recheck, self._writer_heard)
        self.missing = Missing(name, self.store, lambda: self.namespace.meta)  # the stripes it came back without
        self.resync = Resync(core, self.records, self.namespace.current, self.namespace.restore, self.missing)
        self.membership = Membership(core, self.namespace.lock, self.barrier, self.records, self.resync, self.lease, self.namespace.drop_freed)
        # stripes past a file's end whose writers are gone (tails.py)
        self.tails = Tails(self.store, self.staging, lambda: self.namespace.meta, self._trim, lambda f, i: self.cluster.roles.stripe_primary(f, i) == self.name)
        self.data = DataPath(core, self.as_primary, self.staging, self.records, self.offload, self.missing, self.tails)
        self.cluster.heartbeats.on_adopt = self.membership.adopted  # a membership learnt from a peer's heartbeat
        self.clocks = ClockWaits(transport, self.store)
        self.publisher = Publisher(cfg, self.serving, self.lease, self.cluster.roles, self.status, self._probed)
        self.calls: dict[str, Callable] = {}  # method -> its handler (``handle``)
        for part in (self, self.data, self.namespace, self.training, self.records, self.membership, self.clocks, self.tails):
            for attr in dir(part):
                if attr.startswith("rpc_"):
                    assert attr[4:] not in self.calls, f"two handlers of {attr}"
                    self.calls[attr[4:]] = getattr(part, attr)
        untyped = sorted(set(self.calls) - set(CALLS))
        assert not untyped, f"handlers without a request type in irdmafs/calls.py: {untyped}"

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
    def data_plane(self) -> dict:
        """What serves this node's data plane: transport, engine, kernels, with why for what is
        not native (runtime/dataplane.py); in its status and metrics, logged at start."""
        return dataplane.facts(self.transport)

    @property
    def sees_all_ready(self) -> bool:
        return self.cluster.nursery is not None and self.cluster.roles.ready() == self.cluster.roles.members.names

    # -- lifetime ----------------------------------------------------------------------------
    async def _load_persisted(self) -> None:
        """The namespace and every stripe from disk, each file read straight into its region in
        a worker thread (3 GB held the loop 12 s when read on it, and twice the memory)."""
        meta, stripes = self.persist.load()
        if meta is not None:
            self.namespace.meta = Meta.restore(meta)
        for key, nbytes, same_as in stripes:
            buf = self.store.load(key, nbytes, same_as, self.persist.tags.get(key, 0))
            if buf is not None:
                await self.offload.run(self.persist.read_into, key, buf)
        if meta is not None:
            self.namespace.prune()  # a drop's removals a kill left undone (persist.py)
        what = "the namespace" if meta else "no namespace"
        log.info("node %s: loaded %d stripes (%d bytes) and %s from %s", self.name, len(stripes), self.store.bytes_held, what, self.persist.root)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self.persist is not None:
            await self._load_persisted()  # then resync as always: a peer's newer version wins
        async with trio.open_nursery() as nursery:
            self.cluster.nursery = nursery
            serve = partial(self.transport.serve, self.spec.host, self.spec.port, self.handle, on_imm=self.pushes.on_imm, board=self.publisher.board)
            address = await nursery.start(serve)
            plane = self.data_plane  # one line: what serves its data plane, why for what is not native
            log.log(dataplane.level(plane), "node %s listening on %s:%s (%s)", self.name, *address, dataplane.line(plane))
            await self.cluster.heartbeats.refresh()
            self.cluster.heartbeats.args["owner"] = self.replicator.slots.owner
            nursery.start_soon(self.cluster.heartbeats.loop)
            nursery.start_soon(self.staging.expire_loop)
            nursery.start_soon(self.tails.loop)
            if not self.offload.inline:  # not in the simulator: its seeds' schedules stay as they were
                nursery.start_soon(self.publisher.loop)  # probes answered ahead of queued calls (status.py)
                nursery.start_soon(self.loop_lag.run)
                nursery.start_soon(self.store.behind.reap, self.offload)  # freed memory released off the loop
                if self.persist is not None:
                    nursery.start_soon(self.store.behind.write_behind, self.offload)  # files of every stripe at once
            nursery.start_soon(self.lease.run)
            task_status.started(address)
            await self.membership.join()
            log.info("node %s ready", self.name)
            notify(f"READY=1\nSTATUS=serving on {address[0]}:{address[1]}")
            nursery.start_soon(self.membership.fence_loop)
            nursery.start_soon(self.membership.expel_loop)

    # -- dispatch ----------------------------------------------------------------------------
    async def handle(self, method: str, args: dict) -> dict:
        """Run control call ``method``. Bad input is EINVAL: a request that is not its call's
        type (irdmafs/calls.py: a field missing, unknown, or of another type or range), parsed
        before anything here runs, and what each call refuses itself (``RemoteError``). The
        handler gets the parsed fields as keyword arguments, defaults included. Anything else
        raised is a fault here, not the caller's, and so is a reply that is not the call's
        declared reply type: logged with its traceback and answered EIO."""
        fn, call = self.calls.get(method), CALLS.get(method)
        if fn is None or call is None:
            raise RemoteError("ENOSYS", f"unknown method {method!r}")
        fields = call.parse(args).kwargs()
        self.counters[method] += 1
        t0 = time.perf_counter()
        try:
            reply = await fn(**fields)
            call.check_reply(reply)
            return reply
        except RemoteError:
            raise
        except NoSpace as exc:
            raise RemoteError("ENOSPC", str(exc)) from None
        except Exception as exc:
            log.exception("node %s: control call %s failed", self.name, method)
            raise RemoteError("EIO", f"{method}: {type(exc).__name__}: {exc}") from None
        finally:
            self.latency.observe(method, time.perf_counter() - t0)

    async def rpc_apply_batch(self, updates: list, sender: str = "", epoch: int = 0) -> dict:
        """Several ``apply`` calls of one primary in one message (server/replicator.py,
        ``_fused``): each run as its own call would be (checked, counted, at once), each with
        its own answer in ``results``, ``{"error", "message"}`` for one refused; EINVAL for the
        whole if ``updates`` is not a list of argument objects."""
        if not isinstance(updates, list) or not all(isinstance(u, dict) and "sender" not in u and "epoch" not in u for u in updates):
            raise RemoteError("EINVAL", "apply_batch: updates is a list of apply arguments (without sender and epoch)")
        results: list[dict] = [{} for _ in updates]

        async def one(i: int, args: dict) -> None:
            try:
                results[i] = await self.handle("apply", args | {"sender": sender, "epoch": epoch})
            except RemoteError as exc:
                results[i] = {"error": exc.code, "message": exc.message}

        async with trio.open_nursery() as n:
            for i, args in enumerate(updates):
                n.start_soon(one, i, args)
        return {"results": results}

    async def _trim(self, op: dict) -> dict:
        """A ``trim`` (tails.py) as a namespace op of the metadata primary's, once."""
        primary = self.cluster.roles.meta_primary()
        if primary is None:
            raise RemoteError("EAGAIN", "no metadata primary")
        rid = f"trim:{self.name}:{op['ino']}:{op['stripes']}"  # a retry is applied once
        return await self._call_node(primary, "meta", {"op": dict(op, rid=rid), "epoch": self.cluster.roles.view_epoch})

    async def _call_node(self, node: str, method: str, args: dict) -> dict:
        """``method`` on ``node``, this node included (a snapshot freezes every node)."""
        if node == self.name:
            return await self.handle(method, args)
        return await self.cluster.call(node, method, args)

    # -- status ------------------------------------------------------------------------------
    async def rpc_heartbeat(self, owner: str | None = None, **args: Any) -> dict:
        """The node's status, checked now (the ordinary way: a probe is answered from the
        status board while its copy is valid, status.py)."""
        self.serving.check_now()  # before saying "ready": this process may have been stopped
        if owner is not None:
            self.staging.seen(owner)
        return self.status(args.get("from"))

    def _probed(self, fields: dict) -> None:
        """A probe answered from the status board: what the heartbeat call does besides answering."""
        self.counters["heartbeat"] += 1
        if fields.get("owner") is not None:
            self.staging.seen(fields["owner"])

    def status(self, asker: str | None = None) -> dict:
        """The heartbeat's answer. ``caught_up``: it serves and has taken its stripes back; asked
        by ``status`` (``irdmafs status``, ``wait_settled``) it also counts the stripes it leads
        that are not whole (``degraded``: health.py), which costs a look at each of them."""
        serving = self.serving
        return {
            "name": self.name,
            "state": serving.state,
            "sees_ready": self.cluster.roles.ready(),
            "meta_seq": self.meta.seq,
            "stripes": len(self.store.stripes),
            "bytes": self.store.bytes_held,
            "capacity": self.cfg.capacity,
            "held": dict(self.budget.held),  # what holds the memory (budget.py)
            "loop_lag": round(self.loop_lag.worst, 4),
            "loop_busy": round(self.loop_lag.worst_busy, 4),
            **self.data_plane,  # transport, engine, kernels (runtime/dataplane.py)
            "pid": os.getpid(),
            "incarnation": self.transport.incarnation,
            "gen": serving.gen,
            "uptime": round(time.time() - self.started, 3),
            "epoch": self.cluster.roles.epoch,
            "work": self.resync.work,
            "calls": sum(self.counters.values()),
            "served_bytes": sum(b for _, b in self.transport.served.values()),
            "apply_seconds": round(self.training.apply_seconds, 6),
            **self.lease.status(),
            "replicas_behind": sum(self.cluster.roles.node_state(n) != READY for n in self.cluster.roles.members.names if n != self.name),
            "caught_up": self.caught_up,
            "lost": self.missing.summary(),  # written stripes it came back without (missing.py)
            **(self.leading() if asker == "status" else {}),
        }

    def _writer_heard(self, owner: str) -> bool:
        """Whether the writer ``owner`` (a mount, by the name its heartbeats carry) still writes:
        heard from within ``WRITER_GRACE`` x ``down_after`` (W3; a mount's probe of each node
        waits for its probes of all of them, each up to ``down_after``, so one slow node spaces
        its heartbeats to the others that far apart). One never heard from is gone once this
        node has served for that long (before, its heartbeat may not have come yet); one that
        released its staging (closed) is gone."""
        seen = self.staging.last_heard(owner)
        now, grace = trio.current_time(), WRITER_GRACE * self.cfg.down_after
        if seen is None:
            return self.serving.state == READY and now - self.serving.ready_since < grace
        return now - seen <= grace

    @property
    def caught_up(self) -> bool:
        """Serving, and its stripes taken back from its stand-ins (membership.py, the hand-over)."""
        return self.serving.state == READY and self.serving.taken_over.is_set()

    def leading(self) -> dict:
        """What ``irdmafs status`` shows of the live stripes this node leads: how many of them
        have a home that does not serve (``degraded``, health.py: a home serves when the view
        names it active and, by its last heartbeat, it has caught up), and their bytes
        (``led_bytes``: how evenly placement spreads the primaries' work)."""
        if not self.caught_up:
            return {"degraded": 0, "led_bytes": 0}  # it leads nothing yet: whoever leads its stripes counts them
        cluster = self.cluster
        led = {(fid, idx) for fid, idx, snap in list(self.store.stripes) if snap == 0 and cluster.roles.stripe_primary(fid, idx) == self.name}
        held = self.store.stripes

        def serving(name: str) -> bool:
            if name == self.name:
                return True
            return cluster.roles.node_state(name) == READY and bool(cluster.liveness.info.get(name, {}).get("caught_up"))

        degraded = health.degraded(led, lambda fid, idx: cluster.roles.stripe_rank(fid, idx)[: cluster.roles.members.replicas], serving)
        return {"degraded": degraded, "led_bytes": sum(held[(fid, idx, 0)].capacity for fid, idx in led if (fid, idx, 0) in held)}

    async def rpc_statfs(self) -> dict:
        # spare memory goes the moment anything needs it (spares.py): free, as df sees it
        return {"capacity": self.cfg.capacity, "used": self.budget.used - self.budget.held[SPARE], "files": len(self.meta.inodes)}

    # -- the commit barrier (snapshots, rebalance) -------------------------------------------
    def _freezer_gone(self, token: str) -> bool:
        holder = token.split(":")[0]
        return holder in self.cluster.roles.members.names and holder not in self.cluster.roles.view.active

    async def rpc_freeze(self, token: str, seconds: float, epoch: int = 0) -> dict:
        """Hold new commits and pushes and wait for those in flight (barrier.py); ESTALE from a
        freezer in an older view (EAGAIN from a newer one this node cannot read yet). A
        snapshot's freeze held on a cut link came after the link healed, the node expelled and
        named again meanwhile: its freezer had gone on without it and its thaw had failed, and
        the freeze held every commit there for its 30 s
        (chaos --views, seed 7: a write ETIMEDOUT)."""
        await self.serving.check_epoch(epoch)
        self.serving.check_same_epoch(epoch)  # again: reading a newer view waits (a thaw may come meanwhile)
        await self.barrier.freeze(token, seconds, self.cluster.nursery)
        return {}

    async def rpc_thaw(self, token: str) -> dict:
        self.barrier.thaw(token)
        return {}

    # -- staging -----------------------------------------------------------------------------
    async def rpc_staging(self, owner: str, size: int, replace: bool = False) -> dict:
        """A staging region for ``owner`` (staging.py; ``replace``: its earlier ones freed)."""
        return self.staging.alloc(owner, size, replace)

    async def rpc_release(self, owner: str) -> dict:
        self.staging.release(owner)
        return {}


def choose_transport(cfg: ClusterConfig) -> Transport:
    from ..transport.select import choose

    return choose(cfg.transport, cfg.token, op_timeout=cfg.op_timeout)


def setup_logging(prefix: str, level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="irdmafs-node", description="Run one irdmafs PS node.")
    ap.add_argument("--config", required=True, help="the cluster config (TOML)")
    ap.add_argument("--node", required=True, help="the name of this node in the config")
    ap.add_argument("--metrics", metavar="[HOST:]PORT", help="serve Prometheus metrics here")
    ap.add_argument("--persist", metavar="DIR", help="keep every stripe and the namespace in DIR (written through) and load them at start")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
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
        trio.run(node.run, instruments=looplag.instruments())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
