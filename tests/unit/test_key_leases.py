"""A cached region key reads a node only in the lease it was given under (client/stripe.py).

Two nodes on the memory transport, each holding one stripe in a region of its own, as a node's
store does, and answering heartbeats with a view. Node "a" comes back after an outage: the view
names it again with a new lease while its region still holds the bytes from before a write
acknowledged without it, and its ``stripe_info`` waits for the hand-over (EAGAIN). The client
read it through the key cached before the outage and got those old bytes (chaos --views, seed 7:
a write read back old right after it returned).
"""

from irdmafs.client.stripe import Extent, StripeIO
from irdmafs.runtime.cluster import Cluster
from irdmafs.config import from_dict
from irdmafs.runtime.placement import rank, stripe_key
from irdmafs.regions import HEADER, WORD
from irdmafs.runtime.slots import StagingPool
from irdmafs.transport.base import Access
from irdmafs.errors import RemoteError
from irdmafs.transport.memory import MemoryTransport

UNIT = 4096


def config():
    return from_dict(
        {
            "nodes": [{"name": "a", "host": "mem", "port": 9601}, {"name": "b", "host": "mem", "port": 9602}],
            "token": "test-token-123",
            "replicas": 2,
            "stripe_unit": UNIT,
            "transport": ["memory"],
            "coordinator": ["http://127.0.0.1:2379"],  # never reached: no node here reads views
            "heartbeat": 0.05,
            "down_after": 0.3,
        }
    )


class FakeNode:
    """One stripe of file ``fid`` in a region, its version word even; a view and a lease."""

    def __init__(self, cfg, name: str, fid: int, data: bytes, view: dict):
        self.transport = MemoryTransport(cfg.token)
        self.name, self.fid, self.view = name, fid, view
        self.region = self.transport.alloc_region(HEADER + UNIT, Access.READ)
        self.put(data, version=1)
        self.lease = view["serving"][name]
        self.caught_up = True

    def put(self, data: bytes, version: int) -> None:
        self.region.buf[HEADER : HEADER + len(data)] = data
        WORD.pack_into(self.region.buf, 0, 2 * version)

    async def handle(self, method: str, args: dict) -> dict:
        if method == "heartbeat":
            return {"state": "ready", "view": self.view["epoch"], "view_serving": self.view["serving"], "view_expelled": []}
        if method == "stripe_info":
            if not self.caught_up:
                raise RemoteError("EAGAIN", f"node {self.name} is taking over from its stand-ins")
            desc = {"rkey": self.region.rkey, "capacity": UNIT, "version": 1, "clock": 0, "tag": 0}
            return {str(i): desc if args["fid"] == self.fid and i == 0 else None for i in args["idxs"]} | {"lease": self.lease}
        raise AssertionError(method)


async def test_a_key_cached_before_a_node_went_away_does_not_read_it_once_a_view_names_it_with_a_new_lease(nursery):
    cfg = config()
    fid = next(f for f in range(1, 100) if rank(stripe_key(f, 0), cfg.names)[0] == "a")  # "a" is read first
    view = {"epoch": 5, "serving": {"a": 11, "b": 21}}
    old, new = b"o" * UNIT, b"n" * UNIT
    nodes = {n: FakeNode(cfg, n, fid, old, view) for n in ("a", "b")}
    for spec in cfg.nodes:
        await nursery.start(nodes[spec.name].transport.serve, spec.host, spec.port, nodes[spec.name].handle)
    cluster = Cluster(cfg, MemoryTransport(cfg.token), nursery)
    await cluster.heartbeats.refresh()
    io = StripeIO(cluster, StagingPool(cluster, "test", UNIT))
    got = bytearray(UNIT)
    await io.read(Extent(fid, UNIT, UNIT), 0, memoryview(got))
    assert got == old and ("a", fid, 0, 0) in io._keys  # read from "a", its key cached

    # "a" went away; a write was acknowledged by "b" alone (view 6); "a" came back with a new
    # lease (view 7), its hand-over not done: its region still holds the old bytes
    nodes["b"].put(new, version=2)
    nodes["a"].caught_up = False
    nodes["a"].lease = 12
    view.update(epoch=7, serving={"a": 12, "b": 21})
    await cluster.heartbeats.refresh()
    assert cluster.roles.view_epoch == 7 and cluster.roles.view.lease_of("a") == 12
    await io.read(Extent(fid, UNIT, UNIT), 0, memoryview(got))
    assert got == new

    nodes["a"].put(new, version=2)  # its hand-over done: its keys are given again, in lease 12
    nodes["a"].caught_up = True
    await io.read(Extent(fid, UNIT, UNIT), 0, memoryview(got))
    assert got == new and io._keys[("a", fid, 0, 0)].lease == 12
    nursery.cancel_scope.cancel()
