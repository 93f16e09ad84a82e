"""A stripe's push bookkeeping travels with its bytes: a node that takes a peer's copy of a
stripe (a resync, a hand-over's catch-up) takes that peer's record of the pushes in it, so a
round applied once is never applied again (CI, ``test_pull_many`` on a loaded machine: every
node of an in-process cluster fenced while a primary replicated an applied round; the primary
took its backup's older copy while the backup took the primary's newer one, and each kept the
bookkeeping of the bytes it gave up: the round's pushes, sent again, were applied twice)."""

import time

import numpy as np
import trio

from irdmafs.server.updates import StripeKey

from .test_pull_many import SIZE, _push, bed  # noqa: F401 (the fixture)


async def test_a_cluster_stalled_while_a_round_is_replicated_applies_it_once(bed, monkeypatch):
    c, nodes, inos = bed
    outs = [np.empty(SIZE, np.float32) for _ in inos]
    stalled = []
    for node in nodes:
        real = node.training._replicate_training

        async def stalling(*args, real=real, **kw):
            if not stalled:  # the first round applied anywhere: every node's loop stops
                stalled.append(True)
                time.sleep(0.45)  # past down_after (0.3 s): each node fences and resyncs
            return await real(*args, **kw)

        monkeypatch.setattr(node.training, "_replicate_training", stalling)
    await _push(c, inos, 1, 3.0)
    await _push(c, inos, 0, 1.0)
    with trio.fail_after(20):
        await c.training.pull_many(0, list(zip(inos, outs)))
    assert stalled, "no round was replicated: the stall never happened"
    wrong = {ino: float(o[0]) for ino, o in zip(inos, outs) if not np.array_equal(o, np.full(SIZE, -2, np.float32))}
    assert not wrong, f"tensors whose round was applied other than once (SGD lr=1 of a mean of 2 is -2): {wrong}"
    for node in nodes:  # and every copy agrees on how many pushes its bytes hold
        for ino in inos:
            if node.store.get(ino, 0) is not None and (ino, 0) in node.records.by_stripe:
                assert node.records.by_stripe[(ino, 0)].pushed == {0: 1, 1: 1}, (node.name, ino)


async def test_a_fetch_takes_untrained_bytes_that_moved_under_its_read(bed, monkeypatch):
    """A file rewritten every few ms moves its version between a resync's ``stripe_info`` and
    its read: bytes without push bookkeeping are taken at whatever version was read (demanding
    the answer's version failed three reads in a row, and a node with a writer beside it stayed
    syncing for 10 minutes: bench_snapshot.py --recover)."""
    c, nodes, _ = bed
    attr = await c.paths.write_file("/plain", b"a" * 100)
    fid = attr["ino"]
    holder = next(n for n in nodes if n.store.get(fid, 0) is not None)
    other = next(n for n in nodes if n is not holder)
    real = other.cluster.peers.read_stripe
    moves = []

    async def moving(name, rkey, offset, into, inc=None):
        # the holder's stripe changes after every answer, before the read
        holder.store.install(StripeKey(fid, 0), 0, memoryview(b"b" * 100), holder.cfg.stripe_unit)
        moves.append(holder.store.get(fid, 0).version)
        return await real(name, rkey, offset, into, inc)

    monkeypatch.setattr(other.cluster.peers, "read_stripe", moving)
    other.store.drop_keys([(fid, 0, 0)])
    assert await other.resync.fetch_stripe(fid, 0, 0, holder.name) is True
    assert len(moves) == 1 and other.store.get(fid, 0).version == moves[0]
