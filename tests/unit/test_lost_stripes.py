"""A node knows what it does not hold (server/missing.py, held.py): a stripe that holds written
bytes, which its home came back without and no peer could give, reads as EIO, never zeros;
holes still read as zeros; ``status`` counts what is lost. A whole cluster in one process."""

import os

import numpy as np
import pytest
import trio

from irdmafs import held
from irdmafs.client.client import Client
from irdmafs.errors import RemoteError, Unavailable
from irdmafs.server.meta import Meta
from irdmafs.transport.memory import MemoryTransport
from irdmafs.util import leaves

from .test_cluster_inprocess import config, start_cluster


def unavailable(excinfo) -> str:
    """The message of an EIO a read raised (one per stripe, in a group when several failed)."""
    errors = list(leaves(excinfo.value)) if isinstance(excinfo.value, BaseExceptionGroup) else [excinfo.value]
    assert errors and all(isinstance(e, Unavailable) for e in errors), errors
    return str(errors[0])


def restart_empty(node) -> None:
    """What a node restarted without its data holds: nothing (its namespace it takes again)."""
    node.store.drop_keys(list(node.store.stripes))


async def test_runs_of_written_stripes_follow_writes_truncates_and_holes():
    m = Meta()
    m.apply({"op": "create", "parent": 1, "name": "f", "mode": 0o100644, "unit": 100, "ino": 2, "now": 1})
    assert m.written(2, 0) is False and m.attr(2)["blocks"] == 0
    m.apply({"op": "extend", "ino": 2, "size": 250, "stripes": [[0, 1], [2, 3]], "now": 2})  # stripe 1 a hole
    assert [m.written(2, i) for i in range(4)] == [True, False, True, False]
    assert m.attr(2)["blocks"] == held.blocks([[0, 1], [2, 3]], 250, 100) == 1  # 150 bytes written of 250
    assert "stripes" not in m.attr(2)  # a client sees the blocks, not the runs
    m.apply({"op": "extend", "ino": 2, "size": 250, "stripes": [[1, 2]], "now": 3})
    assert m.inodes[2]["stripes"] == [[0, 3]]
    m.apply({"op": "setattr", "ino": 2, "attrs": {"size": 120}, "now": 4})  # stripe 1 holds the new end
    assert m.inodes[2]["stripes"] == [[0, 2]]
    m.apply({"op": "setattr", "ino": 2, "attrs": {"size": 1000}, "now": 5})  # grown: a hole
    assert m.inodes[2]["stripes"] == [[0, 2]] and not m.written(2, 5)
    for bad in ([[1, 1]], [[-1, 2]], [[0, True]], [[0, 1, 2]], "0-1", [[0, 1.5]]):
        with pytest.raises(RemoteError) as e:
            m.apply({"op": "extend", "ino": 2, "size": 10, "stripes": bad, "now": 6})
        assert e.value.code == "EINVAL"
    assert m.inodes[2]["stripes"] == [[0, 2]]  # a refused op changed nothing
    with pytest.raises(RemoteError):
        m.apply({"op": "setattr", "ino": 2, "attrs": {"size": True}, "now": 7})  # a bool is no size


def test_an_extend_records_no_stripe_a_truncate_dropped_since_it_was_made():
    """A write's extend that comes after a truncate dropped its stripes (another client's)
    records them as holes, not written: a later loss of them must not read as EIO."""
    m = Meta()
    m.apply({"op": "create", "parent": 1, "name": "f", "mode": 0o100644, "unit": 100, "ino": 2, "now": 1})
    made_before = m.seq << 32 | 1  # a stripe made now (datapath's version base)
    m.apply({"op": "setattr", "ino": 2, "attrs": {"size": 0}, "now": 2})  # drops every stripe
    m.apply({"op": "extend", "ino": 2, "size": 300, "stripes": [[0, 3]], "made": made_before, "now": 3})
    assert m.inodes[2]["stripes"] == [] and m.inodes[2]["size"] == 300
    m.apply({"op": "extend", "ino": 2, "size": 300, "stripes": [[0, 3]], "made": m.seq << 32 | 1, "now": 4})
    assert m.inodes[2]["stripes"] == [[0, 3]]  # made since: written


def test_runs_merge_and_cut():
    assert held.runs_of([5, 0, 1, 3, 2]) == [[0, 4], [5, 6]]
    assert held.add([[0, 2], [6, 8]], [[2, 3], [5, 6]]) == [[0, 3], [5, 8]]
    assert held.cut([[0, 3], [5, 8]], 6) == [[0, 3], [5, 6]]
    assert held.cut([[0, 3], [5, 8]], 0) == []
    assert held.blocks(None, 1000, 100) == 2  # nothing known: every byte taken


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_home_back_without_its_data_reads_eio_never_zeros_and_says_so(nursery, replicas):
    cfg = config(n=3, r=replicas)
    nodes = await start_cluster(nursery, cfg)
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(6 * unit)
        fid = (await c.paths.write_file("/model.bin", data))["ino"]
        sparse = (await c.paths.write_file("/sparse", b"x"))["ino"]
        await c.truncate(sparse, 6 * unit)  # stripes 1..5: holes
        victim = max(nodes, key=lambda n: sum(n.store.get(fid, i) is not None for i in range(6)))
        theirs = [i for i in range(6) if victim.store.get(fid, i) is not None]
        restart_empty(victim)
        if replicas == 2:  # the other home still holds every stripe: a resync brings them back
            await victim.resync.resync()
            assert all(victim.store.get(fid, i) is not None for i in theirs)
            assert victim.missing.summary() == {"stripes": 0, "bytes": 0}
            assert await c.paths.read_file("/model.bin") == data
            # a second fault before the first was repaired: both homes of a stripe came back empty
            idx = theirs[0]
            other = next(n for n in nodes if n is not victim and n.store.get(fid, idx) is not None)
            restart_empty(other)
            restart_empty(victim)
            await other.resync.resync()
            await victim.resync.resync()
        else:
            await victim.resync.resync()
        lost = victim.missing.summary()
        assert lost["stripes"] >= 1 and lost["bytes"] == lost["stripes"] * unit
        assert (await victim.calls["heartbeat"]())["lost"] == lost
        with pytest.raises((Unavailable, BaseExceptionGroup)) as e:
            await c.paths.read_file("/model.bin")
        said = unavailable(e)
        assert f"of file {fid}" in said and f"node {victim.name} came back without it" in said
        # the holes of a sparse file are holes still, on every node
        assert await c.paths.read_file("/sparse") == b"x" + bytes(6 * unit - 1)
        # written again, the file is whole and nothing is counted lost
        await c.paths.write_file("/model.bin", data)
        assert await c.paths.read_file("/model.bin") == data
        assert victim.missing.summary() == {"stripes": 0, "bytes": 0}


async def test_a_truncate_frees_what_was_lost(nursery):
    cfg = config(n=2, r=1)
    nodes = await start_cluster(nursery, cfg)
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        fid = (await c.paths.write_file("/t", os.urandom(4 * unit)))["ino"]
        victim = next(n for n in nodes if n.store.get(fid, 3) is not None)
        restart_empty(victim)
        await victim.resync.resync()
        assert victim.missing.summary()["stripes"] >= 1
        await c.truncate(fid, 0)
        assert victim.missing.summary() == {"stripes": 0, "bytes": 0}
        await c.truncate(fid, 4 * unit)  # grown again: holes, zeros
        assert await c.paths.read_file("/t") == bytes(4 * unit)


async def test_a_snapshot_stripe_lost_reads_eio(nursery):
    cfg = config(n=2, r=1)
    nodes = await start_cluster(nursery, cfg)
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(4 * unit)
        fid = (await c.paths.write_file("/s", data))["ino"]
        snap = (await c.take_snapshot("one"))["id"]
        victim = next(n for n in nodes if n.store.get(fid, 0) is not None)
        restart_empty(victim)
        await victim.resync.resync()
        assert any(k[2] == snap for k in victim.missing.keys)
        attr = await c.getattr(fid, snap)
        with pytest.raises((Unavailable, BaseExceptionGroup)) as e:
            await c.read(fid, 0, len(data), attr, snap)
        unavailable(e)
        later = (await c.take_snapshot("two"))["id"]  # taken after the loss: lost in it too
        attr = await c.getattr(fid, later)
        with pytest.raises((Unavailable, BaseExceptionGroup)) as e:
            await c.read(fid, 0, len(data), attr, later)
        unavailable(e)


async def test_stripes_a_writer_that_is_gone_left_past_the_end_are_freed_on_every_replica(nursery):
    """server/tails.py: a writer that committed stripes and never extended the file (a mount
    killed mid-write) leaves them past the end; once its staging lease is over (here: it closed
    and released it) the primary trims them, on every replica. A live writer's are kept, and
    so is a stripe written again since by another."""
    cfg = config(n=3, r=2)
    nodes = await start_cluster(nursery, cfg)
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as keeper:
        fid = (await keeper.paths.write_file("/f", b"x" * unit))["ino"]  # one stripe, extended
        async with Client.connect(cfg, MemoryTransport(cfg.token)) as gone:
            await gone.io.write(fid, unit, unit, memoryview(os.urandom(3 * unit)))  # stripes 1-3, never extended
            assert all(any(n.store.get(fid, i) for n in nodes) for i in (1, 2, 3))
            for n in nodes:
                await n.tails.sweep()  # its writer is alive: nothing goes
            assert all(any(n.store.get(fid, i) for n in nodes) for i in (1, 2, 3))
        await keeper.io.write(fid, unit, 3 * unit, memoryview(b"y" * unit))  # stripe 3 again, by a live writer
        for n in nodes:
            await n.tails.sweep()
        held = {i: [n.name for n in nodes if n.store.get(fid, i) is not None] for i in range(4)}
        assert held[1] == [] and held[2] == [], held  # freed everywhere
        assert len(held[0]) == 2 and len(held[3]) == 2, held  # inside the file; a live writer's
        assert sum(n.tails.trimmed for n in nodes) == 2
        assert (await keeper.getattr(fid))["size"] == unit  # nothing else changed
        assert await keeper.paths.read_file("/f") == b"x" * unit


async def test_a_failed_writer_frees_only_its_own_stripes_past_the_end(nursery):
    """``Client.free_past_end`` trims what this client committed past the end, by version, in
    the namespace's order: another writer's stripes past the end (its extend still to come),
    and a stripe it wrote again since, are kept (a truncate to the file's size took them)."""
    cfg = config(n=3, r=2)
    nodes = await start_cluster(nursery, cfg)
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as other, Client.connect(cfg, MemoryTransport(cfg.token)) as failed:
        fid = (await other.paths.write_file("/f", b"x" * unit))["ino"]
        theirs = os.urandom(2 * unit)
        await other.io.write(fid, unit, unit, memoryview(theirs))  # stripes 1-2, extend to come
        await failed.io.write(fid, unit, 3 * unit, memoryview(os.urandom(3 * unit)))  # stripes 3-5: its write then fails
        again = os.urandom(unit)
        await other.io.write(fid, unit, 5 * unit, memoryview(again))  # stripe 5 written again by the other
        half = os.urandom(unit // 2)
        await other.io.write(fid, unit, 6 * unit, memoryview(half))  # stripe 6: the other's first half...
        await failed.io.write(fid, unit, 6 * unit + unit // 2, memoryview(os.urandom(unit // 2)))  # ... the failed one's second, later
        await failed.data.free_past_end(fid)
        held_by = {i: sum(n.store.get(fid, i) is not None for n in nodes) for i in range(7)}
        assert held_by == {0: 2, 1: 2, 2: 2, 3: 0, 4: 0, 5: 2, 6: 2}, held_by
        await other.data.extend(fid, 6 * unit + unit // 2)
        got = await other.paths.read_file("/f")
        assert got[unit : 3 * unit] == theirs and got[5 * unit : 6 * unit] == again and got[3 * unit : 5 * unit] == bytes(2 * unit)
        assert got[6 * unit :] == half
