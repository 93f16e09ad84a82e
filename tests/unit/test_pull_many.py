"""A model's small parameters pulled together (``PushPull.pull_many``, issue 32): the stripes of
one node read in bursts once their clocks allow, with the per-tensor pull (``pull_into``) for
whatever is not at hand that way. Over an in-process cluster, bsp with two ranks."""

import numpy as np
import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.errors import NodeDown
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster

TENSORS = 24
SIZE = 300


@pytest.fixture
async def bed(nursery):
    cfg = config(unit=64 << 10)
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        d = (await c.paths.resolve("/m"))["ino"]
        for k, v in (("sync", "bsp"), ("workers", "2"), ("optimizer", "sgd lr=1")):
            await c.setxattr(d, f"user.irdma.{k}", v)
        inos = [(await c.paths.save(f"/m/t{i}.npy", np.zeros(SIZE, np.float32)))["ino"] for i in range(TENSORS)]
        yield c, nodes, inos


class Counted:
    """Counts the calls of ``obj.name`` (and lets a test change what they do)."""

    def __init__(self, monkeypatch, obj, name: str, instead=None):
        self.calls: list = []
        real = getattr(obj, name)

        async def wrapper(*args, **kw):
            self.calls.append(args)
            return await (instead or real)(*args, **kw)

        self.real = real
        monkeypatch.setattr(obj, name, wrapper)


async def _push(c, inos, rank: int, value: float) -> None:
    async with trio.open_nursery() as n:
        for ino in inos:
            n.start_soon(c.training.push, ino, rank, np.full(SIZE, value, np.float32))


async def _step(c, inos, outs) -> None:
    """Both ranks push (1 and 3: a mean of 2), rank 0 pulls every tensor with ``pull_many``."""
    await _push(c, inos, 1, 3.0)
    await _push(c, inos, 0, 1.0)
    with trio.fail_after(20):
        await c.training.pull_many(0, list(zip(inos, outs)))


async def test_a_model_pulled_in_bursts_reads_what_the_rounds_made(bed, monkeypatch):
    c, _, inos = bed
    outs = [np.empty(SIZE, np.float32) for _ in inos]
    await _step(c, inos, outs)  # the first pull looks the region keys up (per tensor)
    assert all(np.array_equal(o, np.full(SIZE, -2, np.float32)) for o in outs)
    bursts = Counted(monkeypatch, c.cluster.peers, "read_stripes")
    each = Counted(monkeypatch, c.training, "pull_into")
    await _step(c, inos, outs)
    assert all(np.array_equal(o, np.full(SIZE, -4, np.float32)) for o in outs)
    assert not each.calls, "every tensor was at hand: none pulled one by one"
    assert 1 <= len(bursts.calls) <= 2 * len(c.cluster.roles.members.names), "one burst (or two) per node, not one per tensor"
    one = np.empty(SIZE, np.float32)
    await c.training.pull_into(inos[0], 0, one)  # the per-tensor pull agrees
    assert np.array_equal(one, outs[0])


async def test_a_burst_waits_for_the_round_to_close(bed):
    c, _, inos = bed
    outs = [np.empty(SIZE, np.float32) for _ in inos]
    await _step(c, inos, outs)
    await _push(c, inos, 0, 1.0)
    done = trio.Event()

    async def pull() -> None:
        await c.training.pull_many(0, list(zip(inos, outs)))
        done.set()

    async with trio.open_nursery() as n:
        n.start_soon(pull)
        await trio.sleep(0.3)
        assert not done.is_set(), "rank 1 has not pushed: no round closed"
        assert all(np.array_equal(o, np.full(SIZE, -2, np.float32)) for o in outs)  # not written meanwhile
        await _push(c, inos, 1, 3.0)
        with trio.fail_after(10):
            await done.wait()
    assert all(np.array_equal(o, np.full(SIZE, -4, np.float32)) for o in outs)


async def test_a_node_lost_under_a_burst_leaves_its_tensors_to_the_per_tensor_pull(bed, monkeypatch):
    c, _, inos = bed
    outs = [np.empty(SIZE, np.float32) for _ in inos]
    await _step(c, inos, outs)
    lost = c.training.io.at_hand(inos[0], 0)[0]
    real = c.cluster.peers.read_stripes

    async def failing(node, items):
        if node == lost:
            raise NodeDown(node, "lost under the burst (test)")
        return await real(node, items)

    Counted(monkeypatch, c.cluster.peers, "read_stripes", failing)
    each = Counted(monkeypatch, c.training, "pull_into")
    await _step(c, inos, outs)
    assert all(np.array_equal(o, np.full(SIZE, -4, np.float32)) for o in outs)
    apart = {args[0] for args in each.calls}
    assert inos[0] in apart, "the lost node's tensors went one by one"
    assert len(apart) < len(inos), "the other nodes' tensors came in bursts"


async def test_a_stripe_torn_under_every_burst_is_pulled_alone(bed, monkeypatch):
    c, _, inos = bed
    outs = [np.empty(SIZE, np.float32) for _ in inos]
    await _step(c, inos, outs)
    real = c.cluster.peers.read_stripes
    victim = c.training.io.at_hand(inos[1], 0)[1].rkey

    async def tearing(node, items):
        heads = await real(node, items)
        return [None if rkey == victim else h for (rkey, *_), h in zip(items, heads)]

    Counted(monkeypatch, c.cluster.peers, "read_stripes", tearing)
    each = Counted(monkeypatch, c.training, "pull_into")
    await _step(c, inos, outs)
    assert all(np.array_equal(o, np.full(SIZE, -4, np.float32)) for o in outs)
    assert [args[0] for args in each.calls] == [inos[1]]
