"""A deterministic fault simulator: PS nodes and a client in one process, over the in-memory
transport, on trio's MockClock, under a seeded schedule of faults; then the invariants.

One ``simulate(seed, kinds)`` is one trio run, on a fresh MockClock, with trio's scheduler and
every random draw seeded from ``seed``: the same seed (and the same PYTHONHASHSEED, which
scripts/test fixes) replays exactly. ``python -m tests.sim.replay --kinds drop --seed N`` replays one
and prints what happened; ``--seeds K`` runs K of them and counts the failing ones.

The world: 3 nodes (R=2) and one client, every operation between them crossing a link of
``Links`` (irdmafs/transport/memory.py consults it), which can drop (the operation fails as a
lost connection or a timeout would), delay, or hold (delivered late, when the fault ends) the
operations of one link or of every link of a node. Nodes crash (their listener and tasks end;
the store is lost, as with ``kill -9`` and no ``--persist``) and restart as new processes.

The nodes keep their leases and views in the coordination service's model (coord/memory.py), reached by each node over its own
link to the endpoint "etcd" (``LinkedCoord``): a fault of that link (isolate) cuts the node off
from the coordinator too, "cut" drops only the links between a node and the other nodes (the
client and the coordinator still reach it), and "coord" makes the coordinator unreachable.

The workload, at the same time: a writer saving files of 1 byte to 3 stripes, a trainer
pushing gradients of a tensor under asp with SGD (lr 1, gradients of small integers, so float32
sums are exact), and one pushing the bucket of a directory of small tensors packed before the
faults (docs/buckets.md: the pack's two ops and its copy, pushes against the bucket's version,
reads of each tensor through its pointer). Faults come one at a time, each healed and followed by the cluster settling
(as the chaos soak does: never two nodes out).

Checked after every schedule:
- every file whose last write was acknowledged reads back as that write (a write that failed
  leaves no expectation: the file may hold the old or new bytes, and is not checked until its
  next acknowledged write);
- every gradient was applied exactly once: a failed push is retried with the same gradient
  (the client keeps its step, so a duplicate is answered as one), and the parameters equal a
  numpy replay of the ledger; the same for every packed tensor, read as a file;
- every node's namespace is identical after healing;
- at most one node acknowledges changes of a stripe in one view epoch (checked as
  they are acknowledged: ``Replicator.to_every_target`` is watched).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np
import trio
import trio.testing

import irdmafs.transport.memory as memory
from irdmafs.client.client import Client
from irdmafs.config import from_dict
from irdmafs.coord.contract import Coordinator
from irdmafs.errors import CoordUnavailable as Unavailable, PeerLost, RemoteError, TimeoutError, TransportError
from irdmafs.coord.memory import MemoryCoord
from irdmafs.names import PACK_MIN_TENSORS
from irdmafs.runtime.offload import Offload
from irdmafs.packing import in_force
from irdmafs.server.node import Node
from irdmafs.server.replicator import Replicator

log = logging.getLogger("sim")

NODES = ["n0", "n1", "n2"]
KINDS = ("crash", "drop", "delay", "hold", "isolate", "cut", "coord")
UNIT = 64 << 10
# (heartbeat, down_after) a schedule runs under: fast ones (many heartbeats between faults) and
# the product's defaults, which found a loss the fast ones never did (mixed seed 19: V7 in
# irdmafs/coord/views.py). A search takes them in turn, two seeds each (``timing_of``).
TIMINGS = {"fast": (0.1, 0.5), "default": (0.5, 2.0)}


def timing_of(seed: int) -> str:
    return ("fast", "default")[(seed // 2) % 2]


class Links:
    """The fate of every operation between two endpoints: per link, a fault with an end time."""

    def __init__(self, rnd: random.Random):
        self.rnd = rnd
        self.faults: dict[tuple[str, str], tuple[str, float]] = {}  # (src, dst) -> (kind, until)
        self.healed = trio.Event()
        self.crossings = 0

    def set(self, a: str, b: str, kind: str, seconds: float) -> None:
        """Both directions of link a-b get ``kind`` for ``seconds``."""
        until = trio.current_time() + seconds
        self.faults[(a, b)] = self.faults[(b, a)] = (kind, until)

    def heal(self) -> None:
        self.faults.clear()
        self.healed.set()
        self.healed = trio.Event()

    async def cross(self, src: str, dst: str, what: str) -> None:
        self.crossings += 1
        fault = self.faults.get((src, dst))
        if fault is None:
            return
        kind, until = fault
        if trio.current_time() >= until:
            self.faults.pop((src, dst), None)
            return
        if kind == "drop":
            await trio.sleep(self.rnd.uniform(0, 0.05))
            raise (PeerLost if self.rnd.random() < 0.5 else TimeoutError)(f"{src}->{dst}: {what} lost (simulated)")
        if kind == "delay":
            await trio.sleep(self.rnd.uniform(0, 0.4))
        elif kind == "hold":  # delivered when the fault ends, late
            await self.healed.wait()


class LinkedCoord(Coordinator):
    """A node's way to the coordinator model: each call crosses the link node -> "etcd" and its
    answer the link back; a dropped one is ``Unavailable``, as an etcd out of reach is."""

    def __init__(self, coord: MemoryCoord, links: Links, name: str):
        self.coord, self.links, self.name = coord, links, name

    async def _via(self, what: str, call):
        try:
            await self.links.cross(self.name, "etcd", what)
            result = await call()
            await self.links.cross("etcd", self.name, what + " answer")
            return result
        except (PeerLost, TimeoutError) as exc:
            raise Unavailable(str(exc)) from None

    async def get(self, key):
        return await self._via("get", lambda: self.coord.get(key))

    async def range(self, prefix):
        return await self._via("range", lambda: self.coord.range(prefix))

    async def put(self, key, value, lease=0):
        return await self._via("put", lambda: self.coord.put(key, value, lease))

    async def cas(self, key, expect, value, lease=0):
        return await self._via("cas", lambda: self.coord.cas(key, expect, value, lease))

    async def create_all(self, entries):
        return await self._via("create_all", lambda: self.coord.create_all(entries))

    async def delete(self, key):
        return await self._via("delete", lambda: self.coord.delete(key))

    async def grant(self, ttl):
        return await self._via("grant", lambda: self.coord.grant(ttl))

    async def keepalive(self, lease):
        return await self._via("keepalive", lambda: self.coord.keepalive(lease))

    async def revoke(self, lease):
        return await self._via("revoke", lambda: self.coord.revoke(lease))

    async def aclose(self):
        pass


@dataclass
class World:
    seed: int
    kinds: tuple[str, ...]
    rnd: random.Random
    links: Links
    cfg: object
    nursery: trio.Nursery
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    files: dict[str, bytes | None] = field(default_factory=dict)  # path -> last acknowledged bytes (None: unknown)
    grads: list[np.ndarray] = field(default_factory=list)  # every gradient pushed, in order
    bucket_grads: list[np.ndarray] = field(default_factory=list)  # every gradient pushed to the bucket
    events: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    t0: float = 0.0  # when the run began (events are stamped from it)
    coord: MemoryCoord = field(default_factory=MemoryCoord)  # the coordination service's model

    async def start(self, name: str) -> None:
        coord = LinkedCoord(self.coord, self.links, name)
        transport = memory.MemoryTransport(self.cfg.token, endpoint=name, op_timeout=self.cfg.op_timeout)
        node = Node(self.cfg, name, transport, coord=coord, offload=Offload(inline=True))

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            with trio.CancelScope() as scope:
                self.scopes[name] = scope
                await node.run(task_status=task_status)
                await trio.sleep_forever()

        await self.nursery.start(run)
        self.nodes[name] = node

    def crash(self, name: str) -> None:
        self.scopes.pop(name).cancel()
        del self.nodes[name]

    async def settled(self, timeout: float = 120) -> None:
        """Every node up, ready, taken over, and in one view naming all of them."""
        with trio.fail_after(timeout):
            while not (len(self.nodes) == len(NODES) and all(self._settled(n) for n in self.nodes.values())):
                await trio.sleep(0.05)

    def _settled(self, node: Node) -> bool:
        if not (node.sees_all_ready and node.state == "ready" and node.serving.taken_over.is_set()):
            return False
        view = node.cluster.roles.view
        newest = max(n.cluster.roles.view.epoch for n in self.nodes.values())
        return sorted(view.active) == NODES and view.epoch == newest

    def note(self, what: str) -> None:
        self.events.append(f"{trio.current_time() - self.t0:8.2f} {what}")
        log.info("%s", self.events[-1])

    async def faults(self, count: int) -> None:
        for _ in range(count):
            await trio.sleep(self.rnd.uniform(0.2, 3.0))
            kind = self.rnd.choice(self.kinds)
            target = self.rnd.choice(NODES)
            seconds = round(self.rnd.uniform(0.2, 3.0), 2)
            self.note(f"fault {kind} {target} {seconds}s")
            if kind == "crash":
                self.crash(target)
                await trio.sleep(seconds)
                await self.start(target)
            elif kind == "isolate":  # from every node, the client, and the coordinator
                for other in NODES + ["client", "etcd"]:
                    if other != target:
                        self.links.set(target, other, "drop", seconds)
                await trio.sleep(seconds)
            elif kind == "cut":  # from every other node only: the client and the coordinator still reach it
                for other in NODES:
                    if other != target:
                        self.links.set(target, other, "drop", seconds)
                await trio.sleep(seconds)
            elif kind == "coord":
                self.coord.down = True
                await trio.sleep(seconds)
                self.coord.down = False
            else:
                other = self.rnd.choice([n for n in NODES + ["client"] if n != target])
                self.links.set(target, other, kind, seconds)
                await trio.sleep(seconds)
            self.links.heal()
            await self.settled()
            self.note("settled")


async def writer(w: World, client: Client, stop: trio.Event) -> None:
    while not stop.is_set():
        path = f"/files/f{w.rnd.randrange(8)}"
        size = w.rnd.choice([1, 100, UNIT - 1, UNIT, UNIT + 1, 3 * UNIT])
        data = w.rnd.randbytes(size)
        try:
            with trio.fail_after(60):
                await client.paths.write_file(path, data)
            w.files[path] = data
        except (TransportError, OSError, trio.TooSlowError, ExceptionGroup) as exc:  # a group: several stripes failed at once
            w.files[path] = None  # unknown until its next acknowledged write
            w.note(f"write {path} failed: {exc!r}")
        await trio.sleep(w.rnd.uniform(0, 0.3))


async def trainer(w: World, client: Client, ino: int, shape: tuple, stop: trio.Event, layout: int = -1) -> None:
    ledger = w.grads if layout < 0 else w.bucket_grads
    while not stop.is_set():
        grad = np.full(shape, float(w.rnd.randrange(1, 4)), np.float32)
        ledger.append(grad)
        while True:  # the same gradient until it is acknowledged: its step stays the client's
            try:
                with trio.fail_after(60):
                    await client.training.push(ino, 0, grad, layout=layout)
                break
            except RemoteError as exc:
                if exc.code == "EINVAL":  # refused for good: the ledger can no longer be met
                    w.errors.append(f"push {len(w.grads) - 1} refused: {exc}")
                    stop.set()
                    return
                w.note(f"push {len(w.grads) - 1} failed, sent again: {exc!r}")
                await trio.sleep(0.2)
            except (TransportError, OSError, trio.TooSlowError, ExceptionGroup) as exc:
                w.note(f"push {len(w.grads) - 1} failed, sent again: {exc!r}")
                await trio.sleep(0.2)
        await trio.sleep(w.rnd.uniform(0, 0.3))


async def check(w: World, client: Client, ino: int, w0: np.ndarray) -> None:
    for path, want in sorted(w.files.items()):
        if want is not None:
            got = await client.paths.read_file(path)
            if got != want:
                w.errors.append(f"{path}: read {len(got)} bytes, the last acknowledged write was {len(want)} (first difference at "
                                f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))})")
    params = await client.paths.load("/model/w.npy")
    want = w0 - sum(w.grads) if w.grads else w0
    if not np.array_equal(params, want):
        w.errors.append(f"parameters differ from the replay of {len(w.grads)} pushes: max error {float(np.max(np.abs(params - want)))}")
    for name, p0 in PACKED.items():
        params = await client.paths.load(f"/packed/{name}.npy")
        want = p0 - sum(g[0] for g in w.bucket_grads) if w.bucket_grads else p0
        if not np.array_equal(params, want):
            w.errors.append(f"packed {name} differs from the replay of {len(w.bucket_grads)} bucket pushes")
    snaps = {n: node.meta.snapshot() for n, node in w.nodes.items()}
    first = snaps[NODES[0]]
    for n, snap in snaps.items():
        if snap["inodes"] != first["inodes"] or snap["entries"] != first["entries"]:
            w.errors.append(f"namespace of {n} differs from {NODES[0]}'s after healing")


# small tensors packed into one bucket of three stripes (UNIT), some across a stripe's end
PACKED = {f"t{i}": np.arange(i, i + 2500 + 100 * (i % 3), dtype=np.float32) for i in range(PACK_MIN_TENSORS)}


async def packed(client: Client) -> tuple[int, int, int]:
    """PACKED saved in /packed under asp and packed: (bucket, its elements, its version)."""
    await client.paths.makedirs("/packed")
    d = await client.paths.resolve("/packed")
    for k, v in (("sync", "asp"), ("workers", "1"), ("optimizer", "sgd lr=1")):
        await client.setxattr(d["ino"], f"user.irdma.{k}", v)
    attrs = [await client.paths.save(f"/packed/{n}.npy", p) for n, p in PACKED.items()]
    assert await client.buckets.pack(d["ino"], attrs), "the sim's directory was not packed"
    ptr = in_force(await client.paths.resolve("/packed/t0.npy"))
    b = await client.getattr(ptr["fid"])
    return ptr["fid"], b["tensor"]["shape"][0], b["version"]


async def _simulate(seed: int, kinds: tuple[str, ...], faults: int, timing: str) -> World:
    rnd = random.Random(seed)
    heartbeat, down_after = TIMINGS[timing]
    cfg = from_dict(
        {
            "nodes": [{"name": n, "host": "sim", "port": 9000 + i} for i, n in enumerate(NODES)],
            "token": "sim-token-0123456789",
            "replicas": 2,
            "stripe_unit": UNIT,
            "transport": ["memory"],
            "heartbeat": heartbeat,
            "down_after": down_after,
            "op_timeout": 2.0,
            # odd seeds: leases shorter than a coordinator outage (every node fences, and the
            # cluster comes back); even seeds: the default, longer than any outage here
            "lease_ttl": 2 if seed % 2 else 10,
            # the coordinator is the in-memory model each node is handed (LinkedCoord); the
            # endpoint only satisfies the config's rule that a config names one
            "coordinator": ["http://etcd.sim:2379"],
        }
    )
    links = Links(rnd)
    memory.LINKS = links
    acked: dict[tuple[int, int, int], str] = {}  # (fid, idx, epoch) -> the node that acknowledged
    unwatched = Replicator.to_every_target

    async def watched(self, key, one):
        await unwatched(self, key, one)
        if self.epoch:
            first = acked.setdefault((key.fid, key.idx, self.epoch), self.name)
            if first != self.name:
                w.errors.append(f"stripe {key.fid}:{key.idx}: {first} and {self.name} both acknowledged in view {self.epoch}")

    Replicator.to_every_target = watched
    try:
        async with trio.open_nursery() as nursery:
            w = World(seed, kinds, rnd, links, cfg, nursery)
            w.t0 = trio.current_time()
            for n in NODES:
                await w.start(n)
            await w.settled()
            async with Client.connect(cfg, memory.MemoryTransport(cfg.token, endpoint="client", op_timeout=cfg.op_timeout)) as client:
                await client.paths.makedirs("/files")
                await client.paths.makedirs("/model")
                d = await client.paths.resolve("/model")
                for k, v in (("sync", "asp"), ("workers", "1"), ("optimizer", "sgd lr=1")):
                    await client.setxattr(d["ino"], f"user.irdma.{k}", v)
                w0 = np.zeros((3 * UNIT) // 4, np.float32)  # three stripes
                ino = (await client.paths.save("/model/w.npy", w0))["ino"]
                bucket, count, version = await packed(client)
                stop = trio.Event()
                async with trio.open_nursery() as work:
                    work.start_soon(writer, w, client, stop)
                    work.start_soon(trainer, w, client, ino, w0.shape, stop)
                    work.start_soon(trainer, w, client, bucket, (count,), stop, version)
                    await w.faults(faults)
                    stop.set()
                links.heal()
                await w.settled()
                try:
                    await check(w, client, ino, w0)
                except (TransportError, ExceptionGroup) as exc:
                    w.errors.append(f"a read after healing failed: {exc!r}")
            nursery.cancel_scope.cancel()
    finally:
        memory.LINKS = None
        Replicator.to_every_target = unwatched
    return w


def simulate(seed: int, kinds: tuple[str, ...] = KINDS, faults: int = 6, timing: str | None = None) -> World:
    """One schedule, deterministic in ``seed`` (and ``timing``, of TIMINGS: ``timing_of(seed)``
    unless given): a fresh trio run on a MockClock."""
    trio._core._run._r.seed(seed)  # trio's scheduler shuffles with this (deterministic under Hypothesis's plugin)
    timing = timing or timing_of(seed)
    return trio.run(_simulate, seed, tuple(kinds), faults, timing, clock=trio.testing.MockClock(autojump_threshold=0))
