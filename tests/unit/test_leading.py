"""The one update path of a primary (server/leading.py; docs/design.md U1-U3), broken step by step
on real in-process nodes: a change from an older view or to a node that does not serve is
refused before anything is installed (U1); a change waits for a freeze, and under the stripe's
lock a new view or a moved primary refuses it (U2); it is answered only once every target holds
it, its source pinned while the sends read it (U3)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
import trio.testing

from irdmafs.client.client import Client
from irdmafs.errors import RemoteError
from irdmafs.runtime.cluster import SYNCING
from irdmafs.server.updates import StripeKey
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster


@pytest.fixture
async def bed(nursery):
    cfg = config(unit=64 << 10)
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        ino = (await c.paths.save("/w.npy", np.zeros(1000, np.float32)))["ino"]
        primary = next(n for n in nodes if n.name == c.cluster.roles.stripe_primary(ino, 0))
        yield c, nodes, ino, primary


def commit_args(node, ino: int, epoch: int) -> dict:
    # staged nowhere: U1 refuses before the staged range is even looked at
    return {"fid": ino, "idx": 0, "offset": 0, "length": 4, "unit": 64 << 10, "staged": [0, 0], "epoch": epoch}


async def refused(call) -> str:
    with pytest.raises(RemoteError) as exc:
        await call
    return exc.value.code


async def test_a_change_from_an_older_view_or_to_a_node_that_does_not_serve_is_refused_first(bed):
    c, nodes, ino, primary = bed
    epoch = primary.cluster.roles.view_epoch
    assert epoch > 0
    before = primary.store.get(ino, 0).stamp
    op = {"op": "mkdir", "parent": 1, "name": "d", "mode": 0o755, "rid": "test-leading-1"}
    meta_primary = next(n for n in nodes if n.name == n.cluster.roles.meta_primary())
    # U1: an older view epoch is ESTALE, for a commit, a push's info and a namespace op alike
    assert await refused(primary.handle("commit", commit_args(primary, ino, epoch - 1))) == "ESTALE"
    assert await refused(primary.handle("train_info", {"fid": ino, "rank": 0, "epoch": epoch - 1})) == "ESTALE"
    assert await refused(meta_primary.handle("meta", {"op": op, "epoch": epoch - 1})) == "ESTALE"
    # ... and a node that does not serve (fenced, resyncing) is EAGAIN in the sender's own view
    for node in {primary, meta_primary}:
        node.serving.state = SYNCING
    try:
        assert await refused(primary.handle("commit", commit_args(primary, ino, epoch))) == "EAGAIN"
        assert await refused(primary.handle("train_next", {"fid": ino, "idx": 0, "rank": 0})) == "EAGAIN"
        assert await refused(meta_primary.handle("meta", {"op": op, "epoch": epoch})) == "EAGAIN"
    finally:
        for node in {primary, meta_primary}:
            node.serving.became_ready()
    assert primary.store.get(ino, 0).stamp == before  # nothing installed
    assert "d" not in await c.paths.listdir("/")


async def test_a_change_waits_for_a_freeze_and_goes_on_at_the_thaw(bed, nursery):
    c, nodes, ino, primary = bed
    await primary.barrier.freeze("test:1", 30, nursery)
    entered = trio.Event()

    async def change() -> None:
        async with primary.as_primary.holding(StripeKey(ino, 0), primary.cluster.roles.view_epoch):
            entered.set()

    nursery.start_soon(change)
    await trio.testing.wait_all_tasks_blocked()
    assert not entered.is_set() and primary.barrier.in_flight == 0  # U2: held at the barrier
    primary.barrier.thaw("test:1")
    with trio.fail_after(5):
        await entered.wait()
    # and a freeze waits for a change in flight: it holds the barrier until it leaves
    async with primary.as_primary.holding(StripeKey(ino, 0), primary.cluster.roles.view_epoch):
        frozen = trio.Event()

        async def freeze() -> None:
            await primary.barrier.freeze("test:2", 30, nursery)
            frozen.set()

        nursery.start_soon(freeze)
        await trio.testing.wait_all_tasks_blocked()
        assert not frozen.is_set() and primary.barrier.in_flight == 1
    with trio.fail_after(5):
        await frozen.wait()
    primary.barrier.thaw("test:2")


async def test_under_the_stripe_lock_a_new_view_or_a_moved_primary_refuses_the_change(bed, nursery, monkeypatch):
    c, nodes, ino, primary = bed
    key = StripeKey(ino, 0)
    roles = primary.cluster.roles
    epoch = roles.view_epoch
    entered = []

    async def change(results: list) -> None:
        try:
            async with primary.as_primary.holding(key, epoch):
                entered.append(True)
        except RemoteError as exc:
            results.append(exc.code)

    for move in ("view", "primary"):
        results: list = []
        async with primary.stripe_locks((ino, 0)):  # the change queues behind the lock ...
            nursery.start_soon(change, results)
            await trio.testing.wait_all_tasks_blocked()
            assert not results and not entered
            # ... and meanwhile a new view comes, or the stripe moves to another node
            if move == "view":
                monkeypatch.setattr(roles, "view", dataclasses.replace(roles.view, epoch=epoch + 1))
            else:
                other = next(n.name for n in nodes if n is not primary)
                monkeypatch.setattr(roles, "stripe_primary", lambda fid, idx: other)
        with trio.fail_after(5):
            while not results:
                await trio.testing.wait_all_tasks_blocked()
        assert results == ["ESTALE" if move == "view" else "ENOTPRIMARY"] and not entered
        monkeypatch.undo()
    async with primary.as_primary.holding(key, epoch):  # as it was: taken
        entered.append(True)
    assert entered == [True]


async def test_a_change_is_answered_once_every_target_holds_it_with_its_source_pinned_while_sent(bed):
    c, nodes, ino, primary = bed
    stripe = primary.store.get(ino, 0)
    pins_seen = []
    real = primary.replicator.update

    async def update(peer, u):
        pins_seen.append(u.source.memory.pins if u.source.memory is not None else None)
        return await real(peer, u)

    primary.replicator.update = update
    await c.paths.save("/w.npy", np.full(1000, 2.0, np.float32))
    stripe = primary.store.get(ino, 0)
    assert pins_seen and all(p is not None and p >= 1 for p in pins_seen)  # U3: pinned while sent
    assert stripe.memory is None or stripe.memory.pins == 0  # ... and no longer once answered
    for name in primary.cluster.roles.targets(ino, 0):  # every target holds the version acknowledged
        node = next(n for n in nodes if n.name == name)
        assert node.store.get(ino, 0).stamp == stripe.stamp
