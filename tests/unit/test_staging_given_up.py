"""A call its sender gave up on (a timeout, a lost connection) may still be under way on the node,
waiting there for a lock, a freeze or a view: it must install before the sender's next send to
that node or never, and never another call's bytes (irdmafs/runtime/slots.py). Over a network the node's
handler outlives the client's timeout; the memory transport cancels it with the caller, so here
the abandoned attempt runs as a task of its own."""

import os

import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.errors import NodeDown, RemoteError
from irdmafs.server import staging as staging_mod
from irdmafs.server.staging import Staged
from irdmafs.runtime.slots import StagingPool, staging_gone
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster


def primary_of(c, nodes, ino, idx=0):
    name = c.cluster.roles.stripe_primary(ino, idx)
    return next(n for n in nodes if n.name == name)


async def abandon_a_commit(nursery, c, primary, ino, offset, data, go_on: trio.Event):
    """A commit of ``data`` at ``offset`` of stripe 0 that the client gives up on (as at its
    op timeout) while the node's handler waits for ``go_on``; returns what the handler ended
    with, once it has."""
    outcome = []
    done = trio.Event()

    async def stage_then_give_up(slot):
        await c.cluster.peers.write(primary.name, slot.rkey, slot.offset, data, slot.inc)
        args = {"fid": ino, "idx": 0, "offset": offset, "length": len(data), "unit": c.cfg.stripe_unit}
        args |= {"staged": [slot.rkey, slot.offset], "epoch": c.cluster.roles.view_epoch}

        async def on_the_node():
            await go_on.wait()  # waiting there (a freeze, a lock, a view) past the client's timeout
            try:
                outcome.append(await primary.calls["commit"](**args))
            except RemoteError as exc:
                outcome.append(exc)
            done.set()

        nursery.start_soon(on_the_node)
        await trio.sleep(0)
        raise NodeDown(primary.name, "no answer within the op timeout")

    with pytest.raises(NodeDown):
        await c.staging.with_slot(primary.name, stage_then_give_up)
    return outcome, done


async def test_a_commit_given_up_on_never_installs_the_bytes_of_a_later_write(nursery):
    """The client gives up on a commit still waiting on its primary and writes again: the same
    range (acknowledged), then other data through the same node. When the old commit goes on,
    the range must still hold what was acknowledged. Returned to the pool, its slot took the
    later writes' bytes and the old commit installed them over the acknowledged range (chaos
    --views seed 7: a write's piece of a stripe read back as another write's bytes)."""
    cfg = config()
    nodes = await start_cluster(nursery, cfg)
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        f = await c.paths.write_file("/f", bytes(unit))
        primary = primary_of(c, nodes, f["ino"])
        first, later, other = os.urandom(1000), os.urandom(1000), os.urandom(unit - 4000)
        go_on = trio.Event()
        outcome, done = await abandon_a_commit(nursery, c, primary, f["ino"], 100, first, go_on)
        await c.write(f["ino"], 100, first)  # sent again: acknowledged
        await c.write(f["ino"], 100, later)  # the range written again, acknowledged
        await c.write(f["ino"], 3000, other)  # then other bytes through the same node's staging
        go_on.set()
        with trio.fail_after(5):
            await done.wait()
        want = bytearray(unit)
        want[100:1100], want[3000 : 3000 + len(other)] = later, other
        assert await c.read(f["ino"], 0, unit) == want
        assert isinstance(outcome[0], RemoteError) and outcome[0].code == "EINVAL", outcome  # refused: its staging is gone
        assert c.staging.retired == 1


async def test_a_commit_waiting_for_its_stripe_finds_its_staging_replaced_and_installs_nothing(cluster_nodes):
    """The node side alone: a commit that passed its first checks and waits for the stripe's lock
    while its sender replaces its staging region (it gave the commit up) is refused (EINVAL)
    when it gets the lock, and the stripe is as it was."""
    cfg, nodes = cluster_nodes
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        f = await c.paths.write_file("/f", b"a" * unit)
        primary = primary_of(c, nodes, f["ino"])
        pool = StagingPool(c.cluster, "given-up", unit)
        region = await pool._region(primary.name)
        await c.cluster.peers.write(primary.name, region.rkey, 0, b"b" * 100, region.inc)
        args = {"fid": f["ino"], "idx": 0, "offset": 0, "length": 100, "unit": unit, "staged": [region.rkey, 0], "epoch": c.cluster.roles.view_epoch}
        outcome, done = [], trio.Event()

        async def commit():
            try:
                outcome.append(await primary.calls["commit"](**args))
            except RemoteError as exc:
                outcome.append(exc)
            done.set()

        async with trio.open_nursery() as n:
            async with primary.stripe_locks((f["ino"], 0)):  # a commit before it still at work
                n.start_soon(commit)
                await trio.sleep(0.05)  # it waits for the lock now, past its first checks
                assert not outcome
                await primary.calls["staging"](owner="given-up", size=4 * unit, replace=True)
            with trio.fail_after(5):
                await done.wait()
        assert isinstance(outcome[0], RemoteError) and outcome[0].code == "EINVAL", outcome
        assert await c.read(f["ino"], 0, unit) == b"a" * unit


@pytest.fixture
async def cluster_nodes(nursery):
    cfg = config()
    return cfg, await start_cluster(nursery, cfg)


async def test_a_commit_and_a_namespace_op_say_the_view_they_were_acknowledged_in(cluster_nodes):
    """What ``Heartbeats.follow_acked`` reads (test_incarnation.py has the client's side)."""
    cfg, nodes = cluster_nodes
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        f = await c.paths.write_file("/f", b"a" * 10)
        primary = primary_of(c, nodes, f["ino"])
        region = await c.staging._region(primary.name)
        await c.cluster.peers.write(primary.name, region.rkey, 0, b"b" * 10, region.inc)
        args = {"fid": f["ino"], "idx": 0, "offset": 0, "length": 10, "unit": cfg.stripe_unit, "staged": [region.rkey, 0]}
        args["epoch"] = primary.cluster.roles.view_epoch
        assert (await primary.calls["commit"](**args))["acked_in"] == primary.cluster.roles.view_epoch
        meta_primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        op = {"op": "mkdir", "parent": 1, "name": "d", "mode": 0o755, "rid": "t:1"}
        answer = await meta_primary.calls["meta"](op=op, epoch=meta_primary.cluster.roles.view_epoch)
        assert answer["acked_in"] == meta_primary.cluster.roles.view_epoch and answer["ino"] > 1


async def test_a_replaced_staging_region_is_refused_at_once_and_freed_after_the_lease(nursery, monkeypatch):
    """A push under way may still hold a view of a replaced region's bytes: its memory goes only
    after STAGING_LEASE (over verbs, closing the memory region frees it), but no call naming it
    is taken from the moment it is replaced."""
    monkeypatch.setattr(staging_mod, "STAGING_LEASE", 0.3)
    cfg = config()
    node = (await start_cluster(nursery, cfg))[0]
    old = (await node.rpc_staging(owner="o", size=4096, replace=True))["rkey"]
    await node.rpc_staging(owner="o", size=4096, replace=True)
    with pytest.raises(RemoteError) as err:
        node.staging.view(Staged(old, 0, 10))
    assert err.value.code == "EINVAL" and staging_gone(err.value)
    assert [r.rkey for _, r in node.staging.draining] == [old]
    with trio.fail_after(5):
        while node.staging.draining:
            await trio.sleep(0.05)
