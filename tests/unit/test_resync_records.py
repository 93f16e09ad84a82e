"""A resync's push bookkeeping (server/resync.py ``pull_records``): an index first, then only the
records the node would take, each from the peer with the most pushes, its progress in the
node's ``work``; a peer lost mid-fetch leaves its records to the next. A 1 GiB model mid-round
holds hundreds of MB of sums in its records: fetched whole from every peer they took 14 s of a
resync, in which pushes waiting on the node timed out (chaos --model-gib 1, seed 125172).
Over an in-process cluster of 3 nodes, R=3 (every node holds every stripe)."""

import numpy as np
import pytest

from irdmafs.client.client import Client
from irdmafs.errors import NodeDown, RemoteError
from irdmafs.server import resync as R
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster

UNIT = 64 << 10


@pytest.fixture
async def bed(nursery):
    cfg = config(r=3, unit=UNIT)
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        d = (await c.paths.resolve("/m"))["ino"]
        await c.setxattr(d, "user.irdma.optimizer", "sgd lr=1")
        yield c, nodes


class Spy:
    """Every call a node makes, as (peer, method, args), and its ``work`` at each ``train_records``;
    ``train_records`` to ``fail`` raises NodeDown."""

    def __init__(self, node, monkeypatch, fail: str | None = None):
        self.calls: list = []
        self.seen: list = []
        call = node.cluster.call

        async def wrapped(peer, method, args=None, **kw):
            self.calls.append((peer, method, args))
            if method == "train_records":
                if peer == fail:
                    raise NodeDown(peer, "lost (test)")
                self.seen.append(dict(node.resync.work))  # what heartbeats show while it fetches
            return await call(peer, method, args, **kw)

        monkeypatch.setattr(node.cluster, "call", wrapped)


async def test_open_rounds_come_from_their_primary_and_only_the_stripes_asked_for(bed, monkeypatch):
    """bsp with 2 ranks, rank 0 alone pushed: every stripe's round is open on its primary,
    holding its sum (64 KiB a stripe). A backup that resyncs takes each of those records from
    the primary, with the sum, for the stripes ``mine`` names only; asked again, it fetches
    nothing (its records are as far along), and its ``work`` moved while it fetched."""
    c, nodes = bed
    d = (await c.paths.resolve("/m"))["ino"]
    await c.setxattr(d, "user.irdma.sync", "bsp")
    await c.setxattr(d, "user.irdma.workers", "2")
    w = np.zeros((1 << 20) // 4, np.float32)  # 17 stripes (the .npy header first)
    ino = (await c.paths.save("/m/w.npy", w))["ino"]
    await c.training.push(ino, 0, np.ones_like(w))
    x = nodes[0]
    stripes = {i for n in nodes for (f, i), st in n.records.by_stripe.items() if f == ino and st.rounds}
    open_elsewhere = {i for i in stripes if c.cluster.roles.stripe_primary(ino, i) != x.name}
    assert open_elsewhere and all(not x.records.by_stripe.get((ino, i)) or not x.records.by_stripe[(ino, i)].rounds for i in open_elsewhere)
    spy = Spy(x, monkeypatch)
    mine = lambda fid, idx: fid == ino and idx % 2 == 0  # noqa: E731
    peers = [n.name for n in nodes if n is not x]
    await x.resync.pull_records(peers, mine)
    asked = [tuple(k) for peer, method, args in spy.calls if method == "train_records" for k in args["keys"]]
    want = {i for i in open_elsewhere if i % 2 == 0}
    assert sorted(asked) == sorted((ino, i) for i in want)  # each once, none it would not take
    for i in want:
        st = x.records.by_stripe[(ino, i)]
        primary = next(n for n in nodes if n.name == c.cluster.roles.stripe_primary(ino, i))
        assert st.pushed.get(0) == 1 and np.array_equal(st.rounds[0][0], primary.records.by_stripe[(ino, i)].rounds[0][0])
    assert spy.seen and all(s["what"] == "resync records" for s in spy.seen) and x.resync.work == {}
    spy.calls.clear()
    await x.resync.pull_records(peers, mine)
    assert [m for _, m, _ in spy.calls] == ["train_index", "train_index"]  # nothing it lacks


async def test_records_of_a_peer_lost_mid_fetch_come_from_the_next(bed, monkeypatch):
    """asp, every push applied and replicated: all three nodes hold each stripe's record. A node
    whose records fell behind (as one that was away) asks the first peer with the most pushes;
    that peer lost, it takes them from the other one."""
    c, nodes = bed
    w = np.zeros((256 << 10) // 4, np.float32)  # 4 stripes
    ino = (await c.paths.save("/m/a.npy", w))["ino"]
    for _ in range(3):
        await c.training.push(ino, 0, np.ones_like(w))
    x = nodes[0]
    for i in range(4):
        assert x.records.by_stripe[(ino, i)].pushed[0] == 3
        x.records.by_stripe[(ino, i)].pushed[0] = 1  # behind, on the same bytes
    first, second = [n.name for n in nodes if n is not x]
    spy = Spy(x, monkeypatch, fail=first)
    await x.resync.pull_records([first, second], lambda fid, idx: fid == ino)
    assert [x.records.by_stripe[(ino, i)].pushed[0] for i in range(4)] == [3, 3, 3, 3]
    assert {p for p, m, _ in spy.calls if m == "train_records"} == {first, second}


async def test_records_of_other_bytes_and_bad_requests_are_refused(bed):
    """An index entry of other bytes than this node holds is not fetched (``take_records``'
    rule: a record goes with its bytes); ``train_records`` with keys that are not [fid, idx]
    pairs is EINVAL."""
    c, nodes = bed
    w = np.zeros(100, np.float32)
    ino = (await c.paths.save("/m/b.npy", w))["ino"]
    await c.training.push(ino, 0, np.ones_like(w))
    x, peer = nodes[0], nodes[1]
    x.records.by_stripe[(ino, 0)].pushed[0] = 0
    entry = next(e for e in peer.records.record_index() if e[:2] == [ino, 0])
    assert tuple(entry[2]) == x.store.get(ino, 0).stamp and entry[3] == 1
    assert x.records.would_take(ino, 0, tuple(entry[2]), entry[3])
    assert not x.records.would_take(ino, 0, (entry[2][0], entry[2][1] + 1), entry[3])
    assert not x.records.would_take(ino, 0, None, entry[3])
    assert not x.records.would_take(ino, 0, tuple(entry[2]), 0)  # no further along
    for keys in ("1:0", [[ino]], [[ino, "0"]]):
        with pytest.raises(RemoteError) as exc:
            await peer.records.rpc_train_records(keys=keys)
        assert exc.value.code == "EINVAL"


def test_batches_keep_to_the_page_and_the_count():
    sizes = {k: s for k, s in enumerate([3, 3, 3, 10, 1, 1, 1])}
    assert list(R._batches(list(sizes), sizes, 6, 2)) == [[0, 1], [2], [3], [4, 5], [6]]
    assert list(R._batches([], {}, 6, 2)) == []
