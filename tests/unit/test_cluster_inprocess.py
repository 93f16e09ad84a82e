"""A whole cluster in one process on the memory transport: the fast tier of the data path.

The nodes keep their leases and views in the coordination service's model (coord/memory.py),
one per cluster; the config's endpoint only satisfies the rule that a config names one."""

import os
from dataclasses import replace

import numpy as np
import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.config import from_dict
from irdmafs.coord.memory import MemoryCoord
from irdmafs.errors import NodeDown, RemoteError
from irdmafs.runtime.placement import rank, stripe_key
from irdmafs.server import staging as staging_mod
from irdmafs.server.meta import Meta
from irdmafs.server.node import Node
from irdmafs.server.updates import StripeKey
from irdmafs.transport.memory import MemoryTransport


def config(n=3, r=2, unit=64 << 10):
    return from_dict(
        {
            "nodes": [{"name": f"n{i}", "host": "mem", "port": 9000 + i} for i in range(n)],
            "token": "test-token-123",
            "replicas": r,
            "stripe_unit": unit,
            "transport": ["memory"],
            "coordinator": ["http://mem:2379"],
            "heartbeat": 0.05,
            "down_after": 0.3,
        }
    )


async def start_cluster(nursery, cfg):
    nodes = []
    coord = MemoryCoord()
    for spec in cfg.nodes:
        node = Node(cfg, spec.name, MemoryTransport(cfg.token), coord=coord)
        await nursery.start(node.run)
        nodes.append(node)
    with trio.fail_after(5):
        while not all(n.sees_all_ready for n in nodes):
            await trio.sleep(0.01)
    return nodes


@pytest.fixture
async def cluster(nursery):
    cfg = config()
    nodes = await start_cluster(nursery, cfg)
    return cfg, nodes


async def test_files_round_trip_across_stripes(cluster):
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/model")
        blobs = {f"/model/f{n}": os.urandom(n) for n in (0, 1, 4095, 65536, 65537, 300_000)}
        for path, blob in blobs.items():
            await c.paths.write_file(path, blob)
        for path, blob in blobs.items():
            assert await c.paths.read_file(path) == blob
            assert (await c.paths.stat(path))["size"] == len(blob)
        assert sorted(await c.paths.listdir("/model")) == sorted(p.split("/")[-1] for p in blobs)
        # each stripe sits on exactly R nodes
        held = sum(len(n.store.stripes) for n in nodes)
        stripes = sum(-(-len(b) // cfg.stripe_unit) for b in blobs.values())
        assert held == stripes * cfg.replicas


async def test_partial_overwrite_and_read_at_offsets(cluster):
    cfg, _ = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        ref = bytearray(os.urandom(200_000))
        attr = await c.paths.write_file("/f", ref)
        patch = os.urandom(70_000)
        await c.write(attr["ino"], 60_000, patch)
        ref[60_000:130_000] = patch
        assert await c.read(attr["ino"], 0, 10**6) == ref
        assert await c.read(attr["ino"], 65_530, 20) == ref[65_530:65_550]
        assert await c.read(attr["ino"], 500_000, 10) == b""
        # write past the end leaves a hole of zeros
        await c.write(attr["ino"], 400_000, b"end")
        data = await c.paths.read_file("/f")
        assert len(data) == 400_003 and data[200_000:400_000] == bytes(200_000) and data[-3:] == b"end"


async def test_truncate_then_grow_reads_zeros(cluster):
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/t", os.urandom(300_000))
        await c.truncate(attr["ino"], 70_000)
        await c.write(attr["ino"], 299_999, b"x")
        data = await c.paths.read_file("/t")
        assert data[70_000:299_999] == bytes(229_999)


async def test_arrays_save_and_load(cluster):
    cfg, _ = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        for arr in (np.arange(100_000, dtype=np.float32).reshape(100, 1000), np.zeros((0, 3)), np.array(3.5)):
            await c.paths.save("/m/a.npy", arr)
            back = await c.paths.load("/m/a.npy")
            assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)
        await c.paths.write_file("/m/bad.npy", b"\x93NUMPY\x01\x00garbage")
        with pytest.raises(RemoteError) as err:
            await c.paths.load("/m/bad.npy")
        assert err.value.code == "EINVAL"


async def test_namespace_errors(cluster):
    cfg, _ = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/d/e")
        await c.paths.write_file("/d/f", b"1")
        cases = [
            (c.mkdir(1, "d"), "EEXIST"),
            (c.paths.resolve("/nope"), "ENOENT"),
            (c.paths.resolve("/d/f/x"), "ENOTDIR"),
            (c.paths.rmdir_path("/d"), "ENOTEMPTY"),
            (c.paths.remove("/d/e"), "EISDIR"),
            (c.mkdir(1, "x" * 256), "ENAMETOOLONG"),
            (c.mkdir(1, "a\0b"), "EINVAL"),
            (c.paths.move("/d", "/d/e/inside"), "EINVAL"),
        ]
        for coro, code in cases:
            with pytest.raises(RemoteError) as err:
                await coro
            assert err.value.code == code
        # rename over an existing file replaces it, as rsync does
        await c.paths.write_file("/d/g", b"new")
        await c.paths.move("/d/g", "/d/f")
        assert await c.paths.read_file("/d/f") == b"new"
        assert sorted(await c.paths.listdir("/d")) == ["e", "f"]


async def test_unlink_frees_stripes_everywhere(cluster):
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/big", os.urandom(500_000))
        assert sum(len(n.store.stripes) for n in nodes) > 0
        await c.paths.remove("/big")
        assert sum(len(n.store.stripes) for n in nodes) == 0


async def test_snapshot_is_point_in_time_and_survives_changes(cluster):
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        old = np.arange(50_000, dtype=np.float32)
        await c.paths.save("/m/w.npy", old)
        snap = await c.take_snapshot("s1")
        assert sorted(snap["nodes"]) == cfg.names
        await c.paths.save("/m/w.npy", old * 2)
        await c.paths.remove("/m/w.npy")
        # the snapshot's namespace and data are as they were
        sid = snap["id"]
        root = await c.getattr(1, sid)
        m = await c.lookup(root["ino"], "m", sid)
        w = await c.lookup(m["ino"], "w.npy", sid)
        data = await c.read(w["ino"], 0, w["size"], w, snap=sid)
        assert data[w["tensor"]["offset"]:] == old.tobytes()
        with pytest.raises(RemoteError) as err:
            await c.take_snapshot("s1")
        assert err.value.code == "EEXIST"
        assert set(await c.snapshots()) == {"s1"}
        await c.drop_snapshot("s1")
        assert await c.snapshots() == {}
        assert sum(len(n.store.stripes) for n in nodes) == 0  # the file and its snapshot copy are gone


async def test_snapshot_waits_for_commits_in_flight(cluster):
    """Commits and a snapshot racing: each stripe in the snapshot is wholly old or wholly new."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        unit = cfg.stripe_unit
        attr = await c.paths.write_file("/f", bytes([1]) * (8 * unit))
        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(c.write, attr["ino"], i * unit, bytes([2]) * unit)
            n.start_soon(c.take_snapshot, "race")
        sid = (await c.snapshots())["race"]["id"]
        data = await c.read(attr["ino"], 0, 8 * unit, await c.getattr(attr["ino"], sid), snap=sid)
        for i in range(8):
            assert data[i * unit : (i + 1) * unit] in (bytes([1]) * unit, bytes([2]) * unit)


async def test_a_handover_waits_for_the_commits_under_way_and_lists_what_the_joiner_holds(cluster):
    """A node a view names again asks each active peer to hand over: the peer first waits for
    every commit under way (each rechecks the view under its stripe lock, so none of an older
    view starts after the answer), then lists the stripes the joiner is now a replica of, and
    the joiner fetches any copy newer than its own. A hand-over of another view is ESTALE, of
    a name that is not another member EINVAL."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", os.urandom(16 * cfg.stripe_unit))
    back, peer = nodes[0], nodes[1]
    idx = next(i for i in range(16) if peer.cluster.roles.stripe_rank(attr["ino"], i)[:2] == ["n0", "n1"])
    epoch = peer.cluster.roles.view_epoch
    released, handed = trio.Event(), trio.Event()

    async def commit_under_way():
        async with peer.stripe_locks((attr["ino"], idx)):
            await released.wait()

    answer = {}

    async def handover():
        answer.update(await peer.membership.rpc_handover(name="n0", epoch=epoch))
        handed.set()

    async with trio.open_nursery() as n:
        n.start_soon(commit_under_way)
        await trio.sleep(0.01)
        n.start_soon(handover)
        await trio.sleep(0.05)
        assert not handed.is_set()  # waits for what the peer is doing on n0's stripe
        released.set()
    assert handed.is_set()
    # the answer lists what n0 holds a copy of as the peer holds it; n0 fetches what it lacks
    held = peer.store.get(attr["ino"], idx)
    assert [attr["ino"], idx, 0, held.version, held.tag] in answer["stripes"]
    back.store.replace(StripeKey(attr["ino"], idx), memoryview(bytes(10)), cfg.stripe_unit, (0, 0))  # as if a replication failed
    await back.membership._catch_up({"n1": answer})
    assert back.store.get(attr["ino"], idx).version == held.version
    assert bytes(back.store.get(attr["ino"], idx).data[: cfg.stripe_unit]) == bytes(held.data[: cfg.stripe_unit])
    with pytest.raises(RemoteError) as err:
        await peer.membership.rpc_handover(name="n0", epoch=epoch - 1)
    assert err.value.code == "ESTALE"
    with pytest.raises(RemoteError) as err:
        await peer.membership.rpc_handover(name="n9", epoch=epoch)
    assert err.value.code == "EINVAL"
    assert back.serving.taken_over.is_set()


async def test_optimizer_state_waits_for_its_parameters(cluster):
    """Optimizer state sent ahead is held aside: a primary that dies before the parameters'
    apply leaves the backup's state as it was; the apply installs both."""
    from irdmafs.transport.base import Access

    cfg, nodes = cluster
    backup, unit, fid, idx = nodes[2], cfg.stripe_unit, 999_999, 0
    staged = backup.transport.alloc_region(2 * unit, Access.WRITE)
    old_state = backup.store.get(fid, idx, -1)
    assert old_state is None

    def stage(value: int, n: int) -> None:
        staged.buf[:n] = bytes([value]) * n

    stage(7, 2 * unit)
    epoch = backup.cluster.roles.view_epoch
    await backup.data.rpc_apply(where=[fid, idx, -1, 0, 2 * unit, 2 * unit], staged=[staged.rkey, 0], version=1, clock=1, full=True, pending=True, epoch=epoch)
    assert backup.store.get(fid, idx, -1) is None  # not without its parameters
    stage(3, unit)
    await backup.data.rpc_apply(where=[fid, idx, 0, 0, unit, unit], staged=[staged.rkey, 0], version=1, clock=0, full=True, state=1, epoch=epoch)
    state = backup.store.get(fid, idx, -1)
    assert state is not None and bytes(state.data[: 2 * unit]) == bytes([7]) * (2 * unit) and state.clock == 1
    assert bytes(backup.store.get(fid, idx).data[:unit]) == bytes([3]) * unit
    with pytest.raises(RemoteError) as err:  # parameters are never sent ahead
        await backup.data.rpc_apply(where=[fid, idx, 0, 0, unit, unit], staged=[staged.rkey, 0], version=2, clock=0, full=True, pending=True, epoch=epoch)
    assert err.value.code == "EINVAL"


async def test_a_stripe_grown_since_its_key_was_cached_reads_its_new_end(nursery):
    """Stripes start small and grow into a new region as data lands further in: a read past the
    end a client cached asks for the stripe again instead of answering zeros (found by fsx)."""
    cfg = config(unit=1 << 20)  # stripes grow in 64 KiB steps up to 1 MiB
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", b"a" * 10)
        assert await c.read(attr["ino"], 0, 10) == b"a" * 10  # the key is cached: 64 KiB long
        await c.write(attr["ino"], 300_000, b"b" * 10)  # the stripe moves to a larger region
        assert await c.read(attr["ino"], 300_000, 10) == b"b" * 10


async def test_a_strict_pull_skips_a_stripe_freed_between_listing_and_copy(cluster):
    """A rebalance copy lists the peers' stripes, then fetches them; a file truncated or
    unlinked in between (namespace ops go on while commits are frozen) has nothing to copy:
    not an error. Found by the rebalance test once O_TRUNC truncated."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", os.urandom(3 * cfg.stripe_unit))
    fid = attr["ino"]
    puller = next(n for n in nodes if n.store.get(fid, 0) is not None)
    puller.store.drop(fid)  # it lacks the file's stripes: it will fetch them
    peers = [n for n in nodes if n is not puller]
    listed = puller.cluster.call_on

    async def call_on(node, method, args=None, **kw):
        if method == "stripe_info":  # between the listing and the copy: the file is truncated
            for p in peers:
                p.store.drop(fid)
        return await listed(node, method, args, **kw)

    puller.cluster.call_on = call_on
    result = await puller.resync.pull_stripes("test", [p.name for p in peers], lambda f, i: True, strict=True)
    assert result["stripes"] >= 1 and puller.store.get(fid, 0) is None


async def test_a_rebalance_pre_copy_settles_to_what_changed_and_what_was_freed_meanwhile(cluster):
    """A rebalance copies while writes go on, then freezes and copies what changed since
    (launch/rebalance.py; the freeze once lasted the whole copy, growing with the data). The
    settling copy takes a stripe overwritten after the pre-copy (its newer version), and a
    pre-copied stripe freed meanwhile (an unlink) goes: nothing old is served after the switch."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    members = [{"name": s.name, "host": s.host, "port": s.port} for s in cfg.nodes]
    wider = cfg.replicas + 1  # the new membership: every node a home of every stripe
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        a = (await c.paths.write_file("/a", os.urandom(4 * unit)))["ino"]
        b = (await c.paths.write_file("/b", os.urandom(4 * unit)))["ino"]
        copied = 0
        for n in nodes:  # the pre-copy, while writes go on
            copied += (await n.calls["rebalance_pull"](nodes=members, replicas=wider, settle=False))["stripes"]
        assert copied == 8  # each stripe of /a and /b to the one node that lacked it
        newer = os.urandom(4 * unit)
        await c.write(a, 0, newer)  # after the pre-copy: its copies are old now
        homes = {i: c.cluster.roles.stripe_rank(b, i)[: cfg.replicas] for i in range(4)}
        precopied = {(n, i): n.store.get(b, i) for n in nodes for i in range(4) if n.name not in homes[i]}
        kept = {k: (bytes(s.data), s.version, s.tag) for k, s in precopied.items()}
        assert len(kept) == 4
        await c.paths.remove("/b")  # and /b freed: its pre-copied stripes are of nothing
    for (n, i), (raw, version, tag) in kept.items():  # a node added by a rebalance is no member
        n.store.replace(StripeKey(b, i), memoryview(raw), unit, (tag, version))  # yet: it hears no namespace op
    for n in nodes:  # frozen (the commits are over): what changed since
        await n.calls["rebalance_pull"](nodes=members, replicas=wider)
    for n in nodes:
        for i in range(4):
            held = n.store.get(a, i)
            assert held is not None and bytes(held.data[:unit]) == newer[i * unit : (i + 1) * unit], (n.name, i)
            assert n.store.get(b, i) is None, (n.name, i)
        assert not n.membership.precopied


async def test_a_rebalance_abandoned_after_its_pre_copy_leaves_no_copy_behind(cluster):
    """A rebalance that fails after its pre-copy (a node lost, the freeze not kept) stays on the
    old membership; each node then drops what the pre-copy brought that it does not hold under
    that membership (launch/rebalance.py calls ``rebalance_abort``): left, it held memory nobody read,
    counted against the node's capacity, until the next rebalance."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    members = [{"name": s.name, "host": s.host, "port": s.port} for s in cfg.nodes]
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(4 * unit)
        a = (await c.paths.write_file("/a", data))["ino"]
        before = {n.name: set(n.store.stripes) for n in nodes}
        for n in nodes:
            await n.calls["rebalance_pull"](nodes=members, replicas=cfg.replicas + 1, settle=False)
        assert sum(len(n.store.stripes) - len(before[n.name]) for n in nodes) == 4  # one more copy of each
        dropped = [(await n.calls["rebalance_abort"]())["dropped"] for n in nodes]
        assert sum(dropped) == 4
        assert {n.name: set(n.store.stripes) for n in nodes} == before
        assert await c.paths.read_file("/a") == data


async def test_a_snapshot_stripe_dropped_between_its_key_and_the_read_is_fetched_as_freed_not_failed(cluster):
    """A resync asks a peer for a stripe's key, then reads it; a training job's rolling
    snapshots drop one every few seconds, and a dropped snapshot's region goes in between (the
    read: "unknown rkey"). Counted a failed copy, it failed the whole resync, which began again
    and again (a node stopped 1.3 s took 77 s to come back, 1 GiB chaos soak). The key is asked
    for again: gone from the peer, the stripe is freed, as if the peer had said so at once."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        fid = (await c.paths.write_file("/f", os.urandom(1000)))["ino"]
        sid = (await c.take_snapshot("s"))["id"]
        holder, other = [n for n in nodes if n.store.get(fid, 0, sid) is not None][:2]
        answer = holder.calls["stripe_info"]
        asked = []

        async def dropped_after_answering(**args):
            reply = await answer(**args)
            asked.append(args)
            if len(asked) == 1:  # the snapshot is dropped here right after the key went out
                holder.store.drop_keys([(fid, 0, sid)])
            return reply

        holder.calls["stripe_info"] = dropped_after_answering
        other.store.drop_keys([(fid, 0, sid)])  # the fetcher lacks it
        assert await other.resync.fetch_stripe(fid, 0, sid, holder.name) is None
        assert len(asked) == 2 and other.store.get(fid, 0, sid) is None


async def test_staging_of_an_owner_whose_heartbeats_stopped_is_freed(nursery, monkeypatch):
    """A killed mount never releases its staging: the node frees it once the owner's
    heartbeats stop for STAGING_LEASE; a live client's heartbeats keep its own."""

    monkeypatch.setattr(staging_mod, "STAGING_LEASE", 0.4)
    cfg = config()
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as live:
        await live.paths.write_file("/f", os.urandom(3 * cfg.stripe_unit))  # staging on the primaries
        held = {n.name for n in nodes if live.owner in n.staging.by_owner}
        assert held
        async with Client.connect(cfg, MemoryTransport(cfg.token)) as dead:
            g = os.urandom(3 * cfg.stripe_unit)
            await dead.paths.write_file("/g", g)
            owner = dead.owner
            dead.cluster.roles.ready = lambda: []  # as if killed: its exit releases nothing on any node
        assert any(owner in n.staging.by_owner for n in nodes)
        await trio.sleep(1.0)
        assert not any(owner in n.staging.by_owner for n in nodes)  # freed: its heartbeats stopped
        assert {n.name for n in nodes if live.owner in n.staging.by_owner} == held  # still leased
        assert await live.paths.read_file("/g") == g  # what the dead client closed stays
        await live.paths.write_file("/h", b"x" * 10)  # the live client's staging still works
        assert await live.paths.read_file("/h") == b"x" * 10


async def test_a_metadata_op_retried_after_its_answer_was_lost_is_applied_once(cluster):
    """A client whose primary died after applying and forwarding an op retries it on the next
    primary (found by scripts/chaos.py: a snapshot mkdir retried after a partition said
    EEXIST). Every node knows the op's request id, so the retry gets the first answer."""
    cfg, nodes = cluster
    primary, other = nodes[0], nodes[1]
    op = {"op": "mkdir", "parent": 1, "name": "d", "mode": 0o755, "rid": "client:x:1"}
    first = await primary.namespace.rpc_meta(op=dict(op), epoch=primary.cluster.roles.view_epoch)
    with trio.fail_after(5):
        while other.meta.seq < primary.meta.seq:  # forwarded
            await trio.sleep(0.01)
    seq = other.meta.seq
    assert dict(other.meta.done["client:x:1"], acked_in=first["acked_in"]) == first
    # the primary is lost: a view expels it, and the next one answers the retry
    assert await other.lease.expel(primary.name)
    with trio.fail_after(5):
        while other.cluster.roles.meta_primary() != other.name or other.state != "ready":
            await trio.sleep(0.01)
    again = await other.namespace.rpc_meta(op=dict(op), epoch=other.cluster.roles.view_epoch)
    assert dict(again, acked_in=0) == dict(first, acked_in=0) and other.meta.seq == seq  # not applied a second time
    with pytest.raises(RemoteError) as err:  # a new request for the same name still fails
        await other.namespace.rpc_meta(op=dict(op, rid="client:x:2"), epoch=other.cluster.roles.view_epoch)
    assert err.value.code == "EEXIST"


async def test_a_resync_drops_stripes_freed_meanwhile_and_takes_its_peers_lower_versions(cluster):
    """A node away while a file was truncated and written again holds the old stripes at
    higher versions than the new ones (a freed stripe starts over at 1); on resync its ready
    peers hold the truth. Found by scripts/chaos.py (old bytes read after a SIGSTOP)."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        old = os.urandom(8 * unit)
        attr = await c.paths.write_file("/f", old)
        fid = attr["ino"]
        away = max(nodes, key=lambda n: (n.store.get(fid, 1) is not None, sum(n.store.get(fid, i) is not None for i in range(2, 8))))
        freed = [i for i in range(2, 8) if away.store.get(fid, i) is not None]
        assert away.store.get(fid, 1) is not None and freed
        stale = {i: bytes(away.store.get(fid, i).data[:unit]) for i in [1, *freed]}
        # what the away node missed: a truncate to 1 stripe, then stripe 1 written again
        await c.truncate(fid, unit)
        new = os.urandom(unit)
        await c.write(fid, unit, new)
        assert (await c.paths.read_file("/f"))[unit:] == new
    # put the missed state back on the away node, as if it had been stopped meanwhile
    for i, data in stale.items():
        away.store.replace(StripeKey(fid, i), memoryview(data), unit, (0, 9))
    await away.resync.resync()
    assert all(away.store.get(fid, i) is None for i in freed)  # freed on every peer: dropped
    held = away.store.get(fid, 1)
    assert held is not None and bytes(held.data[:unit]) == new  # the peers' (lower) version won


async def test_a_resync_keeps_a_stripe_inside_its_file_that_its_other_home_lost(cluster):
    """Fault simulator, mixed seed 1846: a node expelled (a held link) kept the only copy of a
    stripe once the other home crashed, restarted empty and caught up from the one peer left,
    which a stand-in never given the stripe; resyncing, the expelled node read "every other
    home answered and none holds it" as freed while it was away, and dropped the last copy of an
    acknowledged write. A stripe inside its file's size was freed by no truncate (those drop it
    by their cuts): it is kept."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(unit + 1)
        fid = (await c.paths.write_file("/kept", data))["ino"]
        homes = [n for n in nodes if n.store.get(fid, 1) is not None]
        assert len(homes) == 2
        keeper, loser = homes
        loser.store.drop_keys([(fid, 1, 0)])  # what a crash and a resync from a peer lacking it leave
        await keeper.resync.resync()
        assert keeper.store.get(fid, 1) is not None  # its last copy: kept
        assert await c.paths.read_file("/kept") == data


async def test_what_a_resync_counts_inside_a_file(cluster):
    """``Resync._in_extent``: a stripe inside its file's size holds its bytes; past the end,
    optimizer state (kept with its record, not alone) and a snapshot that is gone do not."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        fid = (await c.paths.write_file("/extent", bytes(unit + 1)))["ino"]
    r = nodes[0].resync
    assert r._in_extent(fid, 0, 0) and r._in_extent(fid, 1, 0)
    assert not r._in_extent(fid, 2, 0)
    assert not r._in_extent(fid, 0, -1) and not r._in_extent(fid, 0, -2)
    assert not r._in_extent(fid, 0, 12345)  # no such snapshot
    assert not r._in_extent(fid + 1000, 0, 0)  # no such file


async def caught_up(nodes) -> None:
    """Every node has taken its stripes back once since it started (``Serving.complete``)."""
    with trio.fail_after(5):
        while not all(n.serving.complete for n in nodes):
            await trio.sleep(0.01)


async def test_a_resync_keeps_the_stripes_whose_other_home_restarted_empty_and_has_not_caught_up(cluster):
    """A home killed (its whole store lost) and restarted while the coordinator was out is still
    named by the view made before its crash, and lists no stripe until its catch-up. A resync
    of the other home counted every stripe they shared as freed on every peer and dropped it:
    acknowledged writes lost (fault simulator, mixed seed 1663). Only a listing that says
    ``complete`` is evidence of a free: a stripe freed meanwhile on a complete home still goes."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    await caught_up(nodes)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        node = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())  # resyncs (takes no namespace)
        restarted, complete = [n for n in nodes if n is not node]

        def shared_with(fid, other):
            return [i for i in range(16) if set(c.cluster.roles.stripe_rank(fid, i)[: cfg.replicas]) == {node.name, other.name}]

        keep = (await c.paths.write_file("/keep", os.urandom(16 * unit)))["ino"]
        gone = (await c.paths.write_file("/gone", os.urandom(16 * unit)))["ino"]
        kept, freed = shared_with(keep, restarted), shared_with(gone, complete)
        assert kept and freed
        held = {i: bytes(node.store.get(keep, i).data[:unit]) for i in kept}
        stale = {i: (bytes(node.store.get(gone, i).data[:unit]), node.store.get(gone, i).version) for i in freed}
        await c.truncate(gone, 0)
    for i, (data, version) in stale.items():  # as if the node had been away for the truncate
        node.store.replace(StripeKey(gone, i), memoryview(data), unit, (0, version))
    # the other home restarted empty; the view still names it active, its catch-up not done
    restarted.store.drop_keys(list(restarted.store.stripes))
    restarted.serving.complete = False
    assert await restarted.calls["stripes"]() == {"stripes": [], "complete": False}
    await node.resync.resync()
    for i, data in held.items():  # its only copy: kept
        mine = node.store.get(keep, i)
        assert mine is not None and bytes(mine.data[:unit]) == data, i
    assert all(node.store.get(gone, i) is None for i in freed)  # freed on a complete home: dropped


async def test_a_resync_takes_no_namespace_whole_from_a_primary_restarted_empty_until_it_caught_up(cluster):
    """A resync takes the metadata primary's namespace whole, dropping the stripes of every file
    it lacks. A primary restarted empty while a view made before its crash still names it has
    no file: a node resyncing then dropped every stripe, and those it shared with the primary
    were lost (read beside fault simulator seed 1663). The primary answers such a snapshot
    EAGAIN until it has caught up: the node stays syncing, keeps its stripes, asks again, and
    ends with the namespace of the primary once it has."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    await caught_up(nodes)
    data = os.urandom(16 * unit)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        fid = (await c.paths.write_file("/f", data))["ino"]
        await c.paths.makedirs("/d")
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())

        def shares(n) -> bool:  # some stripes of the file have the primary as their other home
            return any(set(c.cluster.roles.stripe_rank(fid, i)[: cfg.replicas]) == {n.name, primary.name} for i in range(16))

        node = next(n for n in nodes if n is not primary and shares(n))
    held = {key: bytes(s.data[:unit]) for key, s in node.store.stripes.items()}
    assert held
    # the primary restarts empty (no namespace, no stripe); the view still names it active
    meta, stripes = primary.namespace.meta, {k: (bytes(s.data), s.version, s.tag) for k, s in primary.store.stripes.items()}
    primary.store.drop_keys(list(stripes))
    primary.namespace.meta = Meta()
    primary.serving.complete = False
    asked = []
    real = primary.calls["meta_snapshot"]

    async def meta_snapshot(**kw):
        asked.append(kw.get("whole", False))
        return await real(**kw)

    primary.calls["meta_snapshot"] = meta_snapshot
    node.serving.last_tick -= 10 * cfg.down_after  # as if stopped: it fences and rejoins
    assert (await node.rpc_heartbeat())["state"] == "syncing"
    with trio.fail_after(5):
        while asked.count(True) < 2 and node.state != "ready":  # refused, and asked again
            await trio.sleep(0.01)
    assert all(node.store.get(*key) is not None for key in held)  # nothing dropped
    assert node.state == "syncing" and node.namespace.meta.lookup(1, "f")["ino"] == fid
    # the primary catches up (its namespace and stripes back, as its hand-over brings them)
    primary.namespace.meta = meta
    for (f, i, snap), (raw, version, tag) in stripes.items():
        primary.store.replace(StripeKey(f, i, snap), memoryview(raw), unit, (tag, version))
    primary.serving.complete = True
    with trio.fail_after(5):
        while node.state != "ready" or not node.serving.taken_over.is_set():
            await trio.sleep(0.01)
    assert node.namespace.meta.snapshot() == primary.namespace.meta.snapshot()
    for key, raw in held.items():
        mine = node.store.get(*key)
        assert mine is not None and bytes(mine.data[:unit]) == raw, key
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        assert await c.paths.read_file("/f") == data


async def test_a_namespace_is_given_whole_only_by_a_node_caught_up_under_the_lease_it_serves_with(cluster):
    """A primary expelled and named again under a new lease, still in its hand-over, lacks the
    ops acknowledged while it was out: a resync that took its namespace whole spread it, and the
    next op replaced the namespace of the node that held them (mixed seed 208: a write's extend
    lost). It gives its namespace whole only once it caught up under the lease the newest view
    names it with; to anyone else, and as a whole to a node that did, it still answers."""
    cfg, nodes = cluster
    await caught_up(nodes)
    node = nodes[0]
    view = node.cluster.roles.view
    assert node.serving.holds_all() and node.serving.complete_term == view.lease_of(node.name)
    assert (await node.calls["meta_snapshot"](whole=True))["seq"] == node.namespace.meta.seq
    node.serving.complete_term -= 1  # it caught up under an older lease: named again since
    with pytest.raises(RemoteError) as refused:
        await node.calls["meta_snapshot"](whole=True)
    assert refused.value.code == "EAGAIN"
    assert (await node.calls["meta_snapshot"]())["seq"] == node.namespace.meta.seq  # a catch-up's compare by stamp
    node.serving.caught_up()  # its next catch-up, under the lease it serves with
    assert node.serving.holds_all()


async def test_a_staging_region_asked_for_again_replaces_the_owners_old_one(cluster):
    """A client forgets a node's staging region after a failed transfer and asks again; the
    node must not keep the old one too (found by scripts/chaos.py: after enough failovers every
    write got ENOSPC, the owner's 512 MiB of staging used up by forgotten regions)."""
    cfg, nodes = cluster
    node = nodes[0]
    size = 1 << 20
    for _ in range(3 * staging_mod.MAX_STAGING_PER_OWNER // size):
        await node.rpc_staging(owner="c", size=size, replace=True)
    assert len(node.staging.by_owner["c"]) == 1
    with pytest.raises(RemoteError) as err:  # without replace the cap still holds
        for _ in range(staging_mod.MAX_STAGING_PER_OWNER // size + 1):
            await node.rpc_staging(owner="d", size=size)
    assert err.value.code == "ENOSPC"


async def test_a_node_that_did_not_run_fences_before_it_answers_ready(cluster):
    """Found by scripts/chaos.py: a node resumed from SIGSTOP answered its first heartbeat
    "ready" and served stripes its peers had changed meanwhile. It must say "syncing" at once,
    and come back ready (a new serving generation) only after a resync."""
    cfg, nodes = cluster
    node = nodes[2]
    gen = node.gen
    node.serving.last_tick -= 10 * cfg.down_after  # as if the process had been stopped
    assert (await node.rpc_heartbeat())["state"] == "syncing"
    with trio.fail_after(5):
        while node.state != "ready":
            await trio.sleep(0.01)
    assert node.gen == gen + 1


def views_seen(node) -> list:
    """Every newer view ``node`` learns from now on."""
    seen: list = []
    node.lease.keeper.reader.on_view.append(seen.append)
    return seen


async def test_a_node_that_stalled_leaves_the_view_while_it_resyncs(cluster):
    """A node fenced for a stall that no peer expelled expels itself (coord/views.py V6), so that
    its stripes are led by others while it resyncs: left named, they answered EAGAIN through its
    whole resync and catch-up (38 s with a 1 GiB model training; pushes timed out: chaos
    --model-gib 1, seed 125172). It is named again, under a new lease, once it has resynced."""
    cfg, nodes = cluster
    await caught_up(nodes)
    node, other = nodes[2], nodes[0]
    lease, seen = node.lease.term(), views_seen(other)
    node.serving.last_tick -= 10 * cfg.down_after  # as if the process had been stopped
    assert (await node.rpc_heartbeat())["state"] == "syncing"
    with trio.fail_after(5):
        while node.state != "ready" or node.name not in other.cluster.roles.view.active:
            await trio.sleep(0.01)
    out = [v for v in seen if node.name in v.expelled]
    assert out and out[0].lease_of(node.name) == lease  # it left under the lease it stalled with
    assert node.lease.term() != lease and other.cluster.roles.view.lease_of(node.name) == node.lease.term()


async def test_nodes_that_stalled_together_leave_one_at_a_time(cluster):
    """Two of three nodes (R=2) stall at once: a view leaves at most R-1 out (V7), so one steps
    aside and the other's expel of itself is refused: it resyncs named, as a node did before
    stepping aside. Both serve again."""
    cfg, nodes = cluster
    await caught_up(nodes)
    seen = views_seen(nodes[0])
    for node in nodes[1:]:
        node.serving.last_tick -= 10 * cfg.down_after
    for node in nodes[1:]:
        assert (await node.rpc_heartbeat())["state"] == "syncing"
    with trio.fail_after(10):
        while not all(n.state == "ready" and n.name in nodes[0].cluster.roles.view.active for n in nodes):
            await trio.sleep(0.01)
    assert any(v.expelled for v in seen) and all(len(v.expelled) <= cfg.replicas - 1 for v in seen)


async def test_reads_ask_a_stripes_active_homes_by_load_and_one_not_heard_last(cluster):
    """A read asks the stripe's homes the view names active, least-loaded first, never a
    stand-in while a home is active (it keeps the copy it took while a home was out: found by
    scripts/chaos.py); a home this process's heartbeats count down is asked last."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        rank = c.cluster.roles.stripe_rank(7, 0)
        homes, stand_in = rank[: cfg.replicas], rank[cfg.replicas]
        for _ in range(20):  # whatever the load counts say
            c.cluster.peers.load[stand_in] = -100
            order = lambda n: (c.cluster.peers.load[n], c.cluster.peers.served[n])  # noqa: E731
            assert c.cluster.roles.read_candidates(7, 0)[: cfg.replicas] == sorted(homes, key=order)
        c.cluster.mark_down(homes[0], "test")
        assert c.cluster.roles.read_candidates(7, 0) == [homes[1], homes[0]]


async def test_reads_never_ask_a_stand_in(cluster):
    """The homes the view names active hold every acknowledged write, and a stand-in
    only what it took while it stood in. A mount on the minority side of a cut, reaching neither
    home, read a stand-in's copy from an earlier view: a write acknowledged since read back old
    (chaos --views, seed 7). No home reachable is unavailable (EIO), never old bytes."""
    from irdmafs.coord.views import View

    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        rank = c.cluster.roles.stripe_rank(7, 0)
        homes, stand_in = rank[: cfg.replicas], rank[cfg.replicas]
        # set and taken back with no checkpoint between: no heartbeat changes it meanwhile
        real = c.cluster.roles.view
        c.cluster.roles.view = View(9, tuple((n, 1) for n in cfg.names))
        try:
            for home in homes:  # the minority side: its heartbeats reach neither home
                c.cluster.liveness.state[home] = "down"
            unreachable = c.cluster.roles.read_candidates(7, 0)
            c.cluster.roles.view = View(10, tuple((n, 1) for n in cfg.names), expelled=(homes[0],))
            one_expelled = c.cluster.roles.read_candidates(7, 0)
            c.cluster.roles.view = View(11, tuple((n, 1) for n in cfg.names), expelled=tuple(homes))
            none_active = c.cluster.roles.read_candidates(7, 0)
        finally:
            c.cluster.roles.view = real
            for home in homes:
                c.cluster.liveness.state[home] = "ready"
        assert sorted(unreachable) == sorted(homes) and stand_in not in unreachable
        assert one_expelled == [homes[1]]
        assert none_active == [stand_in]  # no home in the view: the stand-in it writes to


async def test_a_node_not_yet_caught_up_refuses_region_keys_at_once_and_the_read_goes_to_the_other_home(cluster):
    """A home named again by a view, its hand-over not done, answers ``stripe_info`` EAGAIN at
    once (it waited up to the op timeout, and every read of its stripes with it), and the read
    takes the other home's copy."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(1000)
        f = await c.paths.write_file("/f", data)
        home = next(n for n in nodes if n.name == c.cluster.roles.stripe_rank(f["ino"], 0)[0])
        home.serving.taken_over = trio.Event()  # rejoining: the hand-over not done
        with pytest.raises(RemoteError) as e:
            with trio.fail_after(cfg.op_timeout / 4):
                await home.calls["stripe_info"](fid=f["ino"], idxs=[0])
        assert e.value.code == "EAGAIN"
        c.io.forget(f["ino"])
        c.cluster.peers.load[home.name] = -100  # asked first
        with trio.fail_after(cfg.op_timeout / 4):
            assert await c.read(f["ino"], 0, 1000) == data
        home.serving.taken_over.set()


async def catch_up_moving(node, seconds: float) -> None:
    """``node``'s hand-over catch-up (its ``taken_over`` cleared by the caller) for ``seconds``,
    its progress moving in its heartbeats' ``work``; then it is done."""
    begun = trio.current_time()
    while trio.current_time() - begun < seconds:
        node.resync.work = {"what": "catch-up", "done": int((trio.current_time() - begun) * 100), "bytes": 0}
        await trio.sleep(0.05)
    node.resync.work = {}
    node.serving.taken_over.set()


async def test_work_sent_to_a_primary_catching_up_for_many_call_timeouts_is_answered_and_the_node_never_counted_down(nursery):
    """A node named again takes its stripes back (a GB catch-up: 15 s in the 1 GiB chaos soak);
    commits and namespace ops sent to it meanwhile must be refused inside the caller's call
    timeout (EAGAIN), never held until it: held the whole op timeout, every call timed out, the
    client counted the node down, and a flush ended in ETIMEDOUT once the catch-up outlasted
    the commit's deadline. The catch-up here lasts four times a call's bound and moves."""
    cfg = replace(config(), op_timeout=0.3, down_after=1.0)
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/before", b"x")
        node = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        downs = []
        c.cluster.liveness.on_down.append(downs.append)
        node.serving.taken_over = trio.Event()  # rejoining: its hand-over's catch-up under way
        seconds = 4 * 3 * cfg.op_timeout  # four times a call's bound (3 op timeouts of silence)
        nursery.start_soon(catch_up_moving, node, seconds)
        begun = trio.current_time()
        data = os.urandom(5 * cfg.stripe_unit)  # stripes led by every node, this one included
        await c.paths.write_file("/after", data)
        assert trio.current_time() - begun >= seconds * 0.9  # it was answered once caught up
        assert await c.paths.read_file("/after") == data
        assert downs == []


async def test_a_read_whose_one_replica_fails_after_a_long_wait_asks_again_before_calling_it_unavailable(nursery):
    """A read's bound on having no replica to ask counts from the moment none is left, not from
    the read's start: a pull's read queued for seconds behind a GB of others, then its one
    serving home (the other resyncing) counted down for a second by a busy mount, ended in EIO
    at once (1 GiB chaos soak). It asks again, and the home answers."""
    cfg = replace(config(), op_timeout=0.3, down_after=1.0)
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(1000)
        fid = (await c.paths.write_file("/f", data))["ino"]
        home = c.cluster.roles.stripe_rank(fid, 0)[0]
        c.cluster.roles.read_candidates = lambda f, i: [home]  # the other home resyncs
        read = c.cluster.peers.read_stripe
        reads = []

        async def late_then_lost(node, *args):
            reads.append(node)
            if len(reads) == 1:
                await trio.sleep(3 * cfg.op_timeout)  # queued behind a GB of others
                raise NodeDown(node, "counted down while the operation waited")
            return await read(node, *args)

        c.cluster.peers.read_stripe = late_then_lost
        c.io.forget(fid)
        assert await c.read(fid, 0, 1000) == data
        assert reads == [home, home]


async def test_a_read_that_reached_its_home_since_it_last_had_none_counts_its_bound_again(nursery):
    """The bound on having no replica to ask counts from the moment none is left each time, not
    from the first such moment of the read: a pull's read found no home for an instant (one
    resyncing, EAGAIN; the other's call failed), then waited on the other's clock for seconds
    (it answered: the round was not closed yet), and when that home was counted down for 0.2 s
    by a busy mount, the read ended in EIO at once on the bound begun seconds before (1 GiB chaos
    soak, 60 min, run 3). It asks again, and the home answers. Each turn here follows the read's
    own events: the home is lost again once the read gave up a clock slice on it (``_Behind``),
    which comes after CLOCK_SLICE, past the first bound's end (CLOCK_SLICE > op_timeout)."""
    from irdmafs.client.stripe import CLOCK_SLICE, Extent, StepWait

    cfg = replace(config(), op_timeout=0.3, down_after=5.0)  # only the test's own losses count
    assert CLOCK_SLICE > cfg.op_timeout
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(1000)
        fid = (await c.paths.write_file("/f", data))["ino"]
        attr = await c.getattr(fid)
        home = c.cluster.roles.stripe_rank(fid, 0)[0]
        c.cluster.roles.read_candidates = lambda f, i: [home]  # the other home resyncs
        real = c.cluster.peers.read_header
        events = []

        async def behind(f, i):
            events.append("behind")

        async def header(node, rkey, inc=None):
            head = await real(node, rkey, inc)
            if not events or events[-1] == "behind":  # lost: at first, and once it waited a slice
                events.append("lost")
                raise NodeDown(node, "counted down while the operation waited")
            if events.count("lost") == 1:
                return head._replace(clock=0)  # it answers; the round is not closed yet
            events.append("closed")
            return head._replace(clock=1)

        c.cluster.peers.read_header = header
        c.io.on_behind = behind
        c.io.forget(fid)
        buf = bytearray(1000)
        step = StepWait(min_clock=1, wait=30.0)
        await c.io.read(Extent(fid, attr["size"], attr["unit"]), 0, memoryview(buf), step)
        assert events == ["lost", "behind", "lost", "closed"]
        assert bytes(buf) == data


async def test_a_rejoin_whose_resync_loses_its_peer_begins_again_and_the_node_lives_on(cluster):
    """Found by the fault simulator: a fenced node whose resync lost the peer it fetched the
    namespace from (NodeDown) ended its tasks, and its process with them. It must stay syncing,
    resync again once a peer is there, and serve."""
    from irdmafs.errors import NodeDown

    cfg, nodes = cluster
    node = nodes[2]
    gen = node.gen
    real_call, failed = node.cluster.call, []

    async def call(name, method, args=None, **kw):
        if method == "meta_snapshot" and not failed:
            failed.append(name)
            raise NodeDown(name, "lost during the resync (test)")
        return await real_call(name, method, args, **kw)

    node.cluster.call = call
    node.serving.last_tick -= 10 * cfg.down_after  # as if the process had been stopped: it fences
    assert (await node.rpc_heartbeat())["state"] == "syncing"
    with trio.fail_after(10):
        while node.state != "ready":
            await trio.sleep(0.01)
    assert failed and node.gen == gen + 1  # one failed resync, then one that served
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/after", b"x" * 100)
        assert await c.paths.read_file("/after") == b"x" * 100


async def test_a_resync_that_cannot_fetch_a_newer_stripe_stays_syncing_until_it_can(cluster):
    """A rejoining node whose peers list a stripe newer than its own copy (here: it lost it) but
    refuse to give it does not say ready without it, which served zeros for it (found by
    scripts/chaos.py, peers refusing the fetch); it resyncs again and serves once it has it."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(9000)
        attr = await c.paths.write_file("/s", data)
        ino = attr["ino"]
        home = next(n for n in nodes if c.cluster.roles.stripe_rank(ino, 0)[0] == n.name)
        peers = [n for n in nodes if n is not home]
        refused = []

        def refusing(real):
            async def stripe_info(**kw):
                if kw.get("resync"):
                    refused.append(kw["fid"])
                    raise RemoteError("EIO", "refused (test)")
                return await real(**kw)

            return stripe_info

        real = {n.name: n.calls["stripe_info"] for n in peers}
        for n in peers:
            n.calls["stripe_info"] = refusing(real[n.name])
        home.store.drop_keys([(ino, 0, 0)])  # its copy is gone: its peers' is newer
        home.serving.last_tick -= 10 * cfg.down_after  # as if stopped: it fences and rejoins
        assert (await home.rpc_heartbeat())["state"] == "syncing"
        with trio.fail_after(10):
            while len(refused) < 3:  # the fetch was refused, and asked again
                await trio.sleep(0.01)
        assert home.state == "syncing" and home.store.get(ino, 0) is None
        for n in peers:
            n.calls["stripe_info"] = real[n.name]
        with trio.fail_after(10):
            while home.state != "ready":
                await trio.sleep(0.01)
        assert bytes(home.store.get(ino, 0).data[:9000]) == data
        assert await c.paths.read_file("/s") == data


async def test_a_namespace_op_retried_after_eagain_is_on_every_replica_before_it_is_answered(cluster):
    """A backup refuses the metadata primary's op once (ESTALE: it counts the primary down), so
    the op, applied on the primary, is answered EAGAIN; the client sends it again under the
    same request id. The retry is not answered from the primary's record of it until every
    replica holds the op: answered at once, it acknowledged an op a replica lacked."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/before")
        primary = c.cluster.roles.meta_primary()
        refused = []
        for n in nodes:
            if n.name == primary:
                continue
            real = n.calls["meta_apply"]

            def refusing_once(real=real, name=n.name):
                async def meta_apply(**kw):
                    if not refused:
                        refused.append(name)
                        raise RemoteError("ESTALE", "counted down here (test)")
                    return await real(**kw)

                return meta_apply

            n.calls["meta_apply"] = refusing_once()
        with trio.fail_after(20):
            await c.paths.makedirs("/after")
        assert refused, "a backup refused the op once"
        for n in nodes:  # answered only once every node holds it
            assert n.meta.lookup(1, "after"), n.name


async def test_a_retry_of_an_op_the_primary_took_from_a_peer_is_on_every_replica_before_it_is_answered(cluster):
    """The metadata primary holds an op it did not settle itself: taken with a peer's namespace
    (its own attempt refused by a replica in a newer view, the primary fenced and resynced from
    the third node, which had it), while a replica lacks it. The client's retry (same request
    id) is answered only once every live node holds the op: answered at once from the record,
    it was acknowledged while a replica lacked it, and a later failover to that replica would
    have lost it (fault simulator, mixed seed 1560: one node a sequence number behind after
    healing)."""
    cfg, nodes = cluster
    primary = next(n for n in nodes if n.name == nodes[0].cluster.roles.meta_primary())
    behind = next(n for n in nodes if n is not primary)
    op = {"op": "mkdir", "parent": 1, "name": "taken", "mode": 0o755, "rid": "client:y:1"}
    scratch = Meta.restore(primary.namespace.meta.snapshot())
    scratch.apply(scratch.prepare(dict(op), 1))
    scratch.tag = primary.namespace.meta.tag
    primary.namespace.restore(scratch.snapshot())  # a peer's newer namespace, with the op in it
    assert "client:y:1" in primary.meta.done and "taken" not in behind.meta.directory(1)
    again = await primary.namespace.rpc_meta(op=dict(op), epoch=primary.cluster.roles.view_epoch)
    assert again["ino"] == primary.meta.lookup(1, "taken")["ino"]
    for n in nodes:  # answered only once every node holds it
        assert "taken" in n.meta.directory(1), n.name
        assert n.meta.stamp == primary.meta.stamp, n.name


async def test_a_replica_holding_an_old_primarys_unacknowledged_op_takes_the_next_primarys_namespace(cluster):
    """Namespace ops are stamped (epoch, seq) (server/namespace.py). A replica holds op s+1 of an
    old primary, applied in epoch 5 and never acknowledged; the next primary, in epoch 7, applies
    another op as s+1. Its meta_apply is not taken as held for having that number: the replica
    asks for the whole namespace and ends with the primary's (fault simulator, mixed seed 13:
    one mtime on two nodes, another on the third, at one sequence number, after healing)."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/d")
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
    replica = next(n for n in nodes if n is not primary)
    ns, rs = primary.namespace, replica.namespace
    base = ns.meta.stamp
    assert rs.meta.stamp == base
    ino = ns.meta.lookup(1, "d")["ino"]
    old = rs.meta.prepare({"op": "setattr", "ino": ino, "attrs": {"mode": 0o700}}, 1)
    rs.apply(old, 5)  # the old primary's op, which reached this replica only
    new = ns.meta.prepare({"op": "setattr", "ino": ino, "attrs": {"mode": 0o750}}, 2)
    ns.apply(new, 7)
    assert ns.meta.seq == rs.meta.seq and ns.meta.snapshot() != rs.meta.snapshot()
    seq, op, prev = ns.last
    assert await primary.replicator.meta(replica.name, seq, op, 7, prev)
    assert rs.meta.snapshot() == ns.meta.snapshot() and rs.meta.stamp == (7, seq)
    assert rs.meta.inode(ino)["mode"] & 0o777 == 0o750
    # held: the same op again, or an earlier one of the same epoch
    assert await replica.namespace.rpc_meta_apply(seq, op, primary.name, replica.cluster.roles.view_epoch, 7, list(prev)) == {}
    with pytest.raises(RemoteError) as e:  # a stamp is two integers
        await replica.namespace.rpc_meta_apply(seq + 1, op, primary.name, replica.cluster.roles.view_epoch, 7, ["x", 1])
    assert e.value.code == "EINVAL"


async def test_a_stripe_freed_on_its_peers_while_a_resync_fetched_it_is_dropped_here_too(cluster):
    """A resyncing node holds an old copy of a stripe its peers hold newer; between the listing
    and the fetch the file is truncated, which the syncing node does not get. Its old copy goes
    too: kept, the file grew again over it and the bytes before the new write read back old
    (scripts/chaos.py --views, seed 1: 279,114 bytes)."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", os.urandom(3 * unit))
        fid = attr["ino"]
        puller = next(n for n in nodes if n.store.get(fid, 1) is not None)
        old = bytes(puller.store.get(fid, 1).data[:unit])
        await c.write(fid, unit, os.urandom(100))  # newer on its peers than the old copy below
    puller.store.replace(StripeKey(fid, 1), memoryview(old), unit, (0, 1))  # as if it missed that write
    peers = [n for n in nodes if n is not puller]
    listed = puller.cluster.call_on

    async def call_on(node, method, args=None, **kw):
        if method == "stripe_info":  # between the listing and the fetch: truncated to 1 stripe
            for p in peers:
                p.store.drop(fid, 1)
        return await listed(node, method, args, **kw)

    puller.cluster.call_on = call_on
    await puller.resync.pull_stripes("test", [p.name for p in peers], lambda f, i: True, converge=True, newer_or_fail=True)
    assert puller.store.get(fid, 1) is None and puller.store.get(fid, 0) is not None


async def test_a_snapshot_thaws_a_node_whose_freeze_answer_was_lost(cluster):
    """A snapshot's freeze of one node lands there but its answer is lost (it waits for the
    commits in flight there, and the call timed out): that attempt names nothing (EAGAIN: not
    frozen everywhere) and the client asks again, and that node is thawed all the same. It held
    every commit for 30 s, until its own deadline (chaos, seed 1: the whole soak stalled)."""
    from irdmafs.errors import NodeDown

    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/f", os.urandom(1000))
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        victim = next(n for n in nodes if n is not primary)
        real = primary.namespace.freezer.call_node

        lost = []

        async def call_node(node, method, args):
            answer = await real(node, method, args)
            if method == "freeze" and node == victim.name and not lost:
                lost.append(victim.barrier.frozen_by)
                raise NodeDown(node, "the answer was lost (test)")
            return answer

        primary.namespace.freezer.call_node = call_node
        await c.take_snapshot("s")
        assert lost and lost[0] is not None  # it had landed
        assert victim.barrier.frozen_by is None and all("s" in n.namespace.meta.snapshots for n in nodes)
        with trio.fail_after(5):  # its commits go on at once
            await c.paths.write_file("/g", os.urandom(1000))


async def test_a_freeze_from_an_older_view_is_refused_and_freezes_nothing(cluster):
    """A snapshot's freeze held on a cut link arrives once the link heals, after the node was
    expelled and named again: its freezer went on without it and its thaw failed. Taken, it held
    every commit there for its 30 s (chaos --views, seed 7: a write ETIMEDOUT). A snapshot's
    freeze carries its view epoch, and a node in a newer view refuses it ESTALE."""
    from irdmafs.coord.views import View

    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/f", os.urandom(1000))
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        real, sent = primary.namespace.freezer.call_node, []

        async def call_node(node, method, args):
            if method == "freeze":
                sent.append(args)
            return await real(node, method, args)

        primary.namespace.freezer.call_node = call_node
        await c.take_snapshot("s")
        assert len(sent) == len(nodes) and all(a["epoch"] == primary.cluster.roles.view_epoch for a in sent)
    node = nodes[1]
    # the view it moved to (set and taken back with no checkpoint between: nothing else runs)
    real = node.cluster.roles.view
    node.cluster.roles.view = View(epoch=77, serving=tuple((n.name, 1) for n in nodes))
    try:
        with pytest.raises(RemoteError) as e:
            await node.rpc_freeze("n0:33", 30.0, epoch=74)
        refused_frozen_by = node.barrier.frozen_by
        await node.rpc_freeze("n0:34", 30.0, epoch=77)
        taken_frozen_by = node.barrier.frozen_by
    finally:
        node.cluster.roles.view = real
        node.barrier.thaw("n0:34")
    assert e.value.code == "ESTALE" and "view 74" in str(e.value)
    assert refused_frozen_by is None and taken_frozen_by == "n0:34"


async def test_a_snapshot_not_copied_on_every_active_node_is_not_named(cluster):
    """A cut of a few seconds expels nobody: a snapshot whose copies failed on the
    other nodes (counted down meanwhile) was named on its coordinator's copies alone, and read
    as zeros from the others, which never resync (chaos --views, seed 7). It answers EAGAIN,
    names nothing, thaws every node; asked again once the nodes answer, it is taken."""
    from irdmafs.errors import NodeDown

    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        data = os.urandom(3 * cfg.stripe_unit)
        f = await c.paths.write_file("/f", data)
    primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
    other = next(n for n in nodes if n is not primary)
    real = primary.namespace.freezer.call_node

    async def call_node(node, method, args):
        if method == "snap_copy" and node == other.name:
            raise NodeDown(node, "counted down while the operation waited (test)")
        return await real(node, method, args)

    epoch = primary.cluster.roles.view_epoch  # its view names all three
    assert set(primary.cluster.roles.view.active) == {n.name for n in nodes}
    primary.namespace.freezer.call_node = call_node
    with pytest.raises(RemoteError) as e:
        await primary.namespace.rpc_meta({"op": "snapshot", "name": "s", "rid": "t:1"}, epoch=epoch)
    assert e.value.code == "EAGAIN" and other.name in str(e.value)
    assert all("s" not in n.namespace.meta.snapshots for n in nodes)
    assert all(n.barrier.frozen_by is None for n in nodes)
    primary.namespace.freezer.call_node = real
    await primary.namespace.rpc_meta({"op": "snapshot", "name": "s", "rid": "t:1"}, epoch=epoch)
    assert all("s" in n.namespace.meta.snapshots for n in nodes)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        snap = (await c.snapshots())["s"]["id"]
        assert await c.read(f["ino"], 0, len(data), snap=snap) == data


async def test_a_node_not_yet_caught_up_copies_no_snapshot(cluster):
    """A node a view has just named, its hand-over not done, copied what it held before it for
    a snapshot, which then read a write back old (chaos --views, seed 7). Its copy is EAGAIN,
    and the snapshot is named nowhere until it is taken again."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/f", os.urandom(1000))
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
    joining = next(n for n in nodes if n is not primary)
    epoch = primary.cluster.roles.view_epoch
    with pytest.raises(RemoteError) as e:  # every node in one view, "joining" not caught up
        joining.serving.taken_over = trio.Event()
        await primary.namespace.rpc_meta({"op": "snapshot", "name": "s", "rid": "t:1"}, epoch=epoch)
    assert e.value.code == "EAGAIN" and joining.name in str(e.value)
    assert all("s" not in n.namespace.meta.snapshots for n in nodes)
    joining.serving.taken_over.set()
    await primary.namespace.rpc_meta({"op": "snapshot", "name": "s", "rid": "t:1"}, epoch=epoch)
    assert all("s" in n.namespace.meta.snapshots for n in nodes)


async def test_a_snapshot_waits_while_a_node_it_waits_on_catches_up_past_the_calls_bound(nursery):
    """A snapshot is taken only once every node named has caught up (above); the metadata
    primary answers EAGAIN meanwhile. The client's bound on that refusal followed the target's
    own progress only, which stood still, so a ``mkdir`` in ``.snapshots`` got ETIMEDOUT while
    a restarted node took a GB back (1 GiB chaos soak). The catch-up here lasts four times the
    call's bound and moves: the snapshot is taken once it ends."""
    cfg = replace(config(), op_timeout=0.3, down_after=1.0)
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/f", os.urandom(1000))
        joining = next(n for n in nodes if n.name != c.cluster.roles.meta_primary())
        joining.serving.taken_over = trio.Event()
        seconds = 4 * 3 * cfg.op_timeout
        nursery.start_soon(catch_up_moving, joining, seconds)
        begun = trio.current_time()
        await c.take_snapshot("s")
        assert trio.current_time() - begun >= seconds * 0.9
        assert all("s" in n.namespace.meta.snapshots for n in nodes)


async def test_a_snapshot_meeting_another_freeze_is_asked_again_not_refused_ebusy(cluster):
    """A node still frozen by a snapshot whose coordinator was killed (it lifts once the view
    drops that node) made the next snapshot fail EBUSY to the user (chaos --views, seed 7). It
    is EAGAIN: the client asks again, and the snapshot is taken once the freeze is gone."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/f", b"x")
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        held = next(n for n in nodes if n is not primary)
        await held.rpc_freeze("n9:1", 30.0, epoch=held.cluster.roles.view_epoch)  # its holder is not a member
        with pytest.raises(RemoteError) as e:
            await primary.namespace.rpc_meta({"op": "snapshot", "name": "s", "rid": "t:1"}, epoch=primary.cluster.roles.view_epoch)
        assert e.value.code == "EAGAIN" and "frozen" in str(e.value)
        assert all("s" not in n.namespace.meta.snapshots for n in nodes)

        async def lifted_later():
            await trio.sleep(0.5)
            held.barrier.thaw("n9:1")

        async with trio.open_nursery() as n:
            n.start_soon(lifted_later)
            await c.take_snapshot("s")  # asked again until it is taken
        assert all("s" in n.namespace.meta.snapshots for n in nodes)


async def test_a_node_not_yet_caught_up_answers_namespace_reads_eagain(cluster):
    """A node syncing, or not yet handed its work back, answers lookups, getattr, readdir and
    the snapshot list EAGAIN, not from a namespace that may be old (chaos --views, seed 1: a
    snapshot just taken, a rename's source, ENOENT); the client asks again and gets the answer."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", b"x")
        node = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        node.serving.state = "syncing"
        for call in (node.namespace.rpc_lookup(1, "f"), node.namespace.rpc_getattr(attr["ino"]), node.namespace.rpc_readdir(1), node.namespace.rpc_snapshots()):
            with pytest.raises(RemoteError) as e:
                await call
            assert e.value.code == "EAGAIN"

        async def catch_up():
            await trio.sleep(0.3)
            node.serving.state = "ready"

        async with trio.open_nursery() as n:
            n.start_soon(catch_up)
            assert (await c.lookup(1, "f"))["ino"] == attr["ino"]


async def test_a_namespace_taken_whole_drops_the_stripes_a_missed_truncate_freed(cluster):
    """A node missed a truncate (it was syncing) and kept the stripes it freed; peers hold none
    of them, so no resync fetch finds them gone. Taking the namespace whole drops them (the
    namespace keeps each truncate's cut): kept, a write that grew the file again landed on one
    and the range before it read back old bytes (chaos --views, seed 2). A stripe past the cut
    made since (a write whose extend has not come yet) stays."""
    from irdmafs.server.datapath import VERSION_SHIFT
    from irdmafs.server.meta import Meta

    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", os.urandom(3 * unit))
        fid = attr["ino"]
        node = next(n for n in nodes if n.store.get(fid, 2) is not None)
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        old = node.store.get(fid, 2)
        stale, version = bytes(old.data[:unit]), old.version
        missed = node.namespace.meta.snapshot()
        await c.truncate(fid, unit)
    assert node.store.get(fid, 2) is None
    node.namespace.meta = Meta.restore(missed)  # as if it never got the truncate
    node.store.replace(StripeKey(fid, 2), memoryview(stale), unit, (0, version))
    node.store.replace(StripeKey(fid, 3), memoryview(os.urandom(unit)), unit, (0, (node.namespace.meta.seq + 1 << VERSION_SHIFT) + 1))  # made since
    node.namespace.restore(primary.namespace.meta.snapshot(), whole=True)
    assert node.store.get(fid, 2) is None
    assert node.store.get(fid, 3) is not None
    assert node.namespace.meta.snapshot() == primary.namespace.meta.snapshot()


async def test_a_joining_node_drops_a_stale_copy_a_truncate_freed_during_its_hand_over(cluster):
    """A truncate acknowledged while a node joined came between a peer's hand-over answer and
    the node's fetch of that stripe: the fetch brought back the copy the truncate freed (chaos
    --views, seed 7: a write that grew the file again landed on it, and the range past the
    write read back the old bytes, 393,450 of them). The hand-over's catch-up drops what the
    truncates freed before the node serves."""
    from irdmafs.server.datapath import VERSION_SHIFT

    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", os.urandom(4 * unit))
        fid = attr["ino"]
        node = next(n for n in nodes if n.store.get(fid, 2) is not None and any(n.store.get(fid, i) is not None for i in (0, 1)))
        old = node.store.get(fid, 2)
        stale, version = bytes(old.data[:unit]), old.version
        await c.truncate(fid, 2 * unit)
    assert node.store.get(fid, 2) is None and version < node.namespace.meta.seq << VERSION_SHIFT
    node.store.replace(StripeKey(fid, 2), memoryview(stale), unit, (0, version))  # the fetch lands after the truncate
    below = {i for i in (0, 1) if node.store.get(fid, i) is not None}
    await node.membership._catch_up({})  # nothing handed over: nothing awaited
    assert node.store.get(fid, 2) is None
    assert below and all(node.store.get(fid, i) is not None for i in below)  # what the cut kept


async def test_a_namespace_taken_whole_or_to_catch_up_drops_what_the_truncates_it_missed_freed(cluster):
    """A node that takes a newer namespace drops the stripes a truncate it missed freed (one with
    a version base from before that truncate): a resync (whole) by every cut, a node catching
    up (an op answered stale) by the cuts of the ops it missed; a stripe made since stays.
    (A node a rebalance adds takes the namespace before it leads anything: membership.py.)"""
    from irdmafs.server.meta import Meta

    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        attr = await c.paths.write_file("/f", os.urandom(3 * unit))
        fid = attr["ino"]
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        node = next(n for n in nodes if n.store.get(fid, 1) is not None and n is not primary)
        lagging = node.namespace.meta.snapshot()
        await c.truncate(fid, unit)
        fresh = os.urandom(unit)
        await c.write(fid, 2 * unit, fresh)  # made after the truncate: a higher version base
    old = os.urandom(unit)
    for whole, diverged in ((False, False), (False, True), (True, False)):
        node.namespace.restore(lagging, whole=True)  # as if it had heard neither op
        node.store.replace(StripeKey(fid, 1), memoryview(old), unit, (0, node.store.version_base() + 1))  # from before
        node.namespace.meta = Meta.restore(lagging)
        if diverged:  # an op of its own, never acknowledged, numbered as the truncate is
            node.namespace.meta.apply(node.namespace.meta.prepare({"op": "mkdir", "parent": 1, "name": "mine", "mode": 0o755}, 1))
            node.namespace.meta.tag -= 1
        node.namespace.restore(primary.namespace.meta.snapshot(), whole=whole)
        assert node.store.get(fid, 1) is None, (whole, diverged)
        if node.store.get(fid, 2) is not None:
            assert bytes(node.store.get(fid, 2).data[:unit]) == fresh


async def test_a_node_that_rejoins_holds_no_freeze_from_before(cluster):
    """A snapshot froze a node that was then cut off: the thaw never reached it, and it fenced.
    When it rejoins, that freeze is over (its freezer counted it gone): kept, it held every
    commit and replication there for 30 s after the node rejoined (chaos --views, seed 2)."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/f", os.urandom(1000))
        node = nodes[1]
        await node.rpc_freeze("n0:99", 30.0, epoch=node.cluster.roles.view_epoch)  # the snapshot's freeze; its thaw is lost
        node.serving.last_tick -= 10 * cfg.down_after  # as if stopped: it fences and rejoins
        assert (await node.rpc_heartbeat())["state"] == "syncing"
        with trio.fail_after(10):
            while node.state != "ready" or not node.serving.taken_over.is_set():
                await trio.sleep(0.01)
        assert node.barrier.frozen_by is None
        with trio.fail_after(5):  # commits there go on at once
            await c.paths.write_file("/g", os.urandom(3 * cfg.stripe_unit))


async def test_a_namespace_op_sent_again_while_its_first_attempt_is_under_way_is_applied_once(cluster):
    """A client gives up on a namespace call that is still under way on the primary (waiting for
    the lock, or for a slow replica) and sends it again under the same request id. The second
    attempt, which found no record of the id before the first one applied, must take the first
    one's answer once it holds the lock: applied again, a mkdir answered EEXIST and a rename
    ENOENT (chaos --views, seed 2)."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/a", b"x")
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
    ops = [
        {"op": "mkdir", "parent": 1, "name": "d", "mode": 0o755, "rid": "test:1"},
        {"op": "rename", "parent": 1, "name": "a", "new_parent": 1, "new_name": "b", "rid": "test:2"},
    ]
    for op in ops:
        answers = []

        async def attempt(op=op):
            answers.append(await primary.namespace.rpc_meta(dict(op), epoch=primary.cluster.roles.view_epoch))

        seq = primary.namespace.meta.seq
        async with trio.open_nursery() as n:
            n.start_soon(attempt)
            n.start_soon(attempt)
        assert len(answers) == 2 and answers[0] == answers[1]
        assert primary.namespace.meta.seq == seq + 1  # applied once
    assert primary.namespace.meta.lookup(1, "d") and primary.namespace.meta.lookup(1, "b")


async def test_a_snapshot_whose_coordinator_dies_before_the_copies_is_not_named(cluster):
    """The snapshot's coordinator dies after freezing every node and before the copies: no node
    names the snapshot (a retry takes it anew). Named before the copies, it read as zeros and
    the retry of its request was told it was taken (chaos --views, seed 2)."""
    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.write_file("/f", os.urandom(3 * cfg.stripe_unit))
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
    real = primary.namespace.freezer.call_node

    async def call_node(node, method, args):
        if method == "snap_copy":
            raise RuntimeError("the coordinator is killed here (test)")
        return await real(node, method, args)

    primary.namespace.freezer.call_node = call_node
    with pytest.raises(BaseException) as e:
        await primary.namespace.rpc_meta({"op": "snapshot", "name": "s", "rid": "test:9"}, epoch=primary.cluster.roles.view_epoch)
    assert "the coordinator is killed here" in repr(e.value) or any("killed here" in repr(x) for x in getattr(e.value, "exceptions", ()))
    assert all("s" not in n.namespace.meta.snapshots for n in nodes)
    assert all(n.barrier.frozen_by is None for n in nodes)


async def test_a_freeze_lifts_once_its_holder_is_gone(autojump_clock, nursery):
    """A snapshot's coordinator killed while every node is frozen never thaws them: each lifts
    the freeze once its view no longer names the coordinator (node.py hands the barrier that
    test), not 30 s later at its deadline (chaos --views, seed 2: every commit waited)."""
    from irdmafs.server.barrier import CommitBarrier

    gone: set[str] = set()
    barrier = CommitBarrier(lambda token: token.split(":")[0] in gone)
    await barrier.freeze("n1:5", 30.0, nursery)
    await trio.sleep(5)
    assert barrier.frozen_by == "n1:5"
    gone.add("n1")
    await trio.sleep(1)
    assert barrier.frozen_by is None


async def test_a_rebalance_whose_freeze_cannot_be_kept_ends_instead_of_copying_on(autojump_clock):
    """A rebalance extends its freeze every KEEPALIVE. An extension refused (a node in another
    view: ESTALE, or lost) ends it: that node thaws by itself and takes commits again, which
    the copy under way would miss and the switch then lose. It was logged and the copy went on."""
    from irdmafs.launch import rebalance as rb

    class Refusing:
        roles = type("Roles", (), {"view_epoch": 3})()

        async def call(self, node, method, args):
            assert method == "freeze" and args["epoch"] == 3
            if node == "n1":
                raise RemoteError("ESTALE", "sent in view 3; node n1 is in view 5")
            return {}

    with pytest.raises(rb.RebalanceError, match="freeze of n1 could not be kept"):
        await rb._keep_frozen(Refusing(), ["n0", "n1"], "rebalance:1")
    assert trio.current_time() >= rb.KEEPALIVE


async def test_an_op_whose_primary_resynced_while_it_waited_for_its_backups_is_not_acknowledged(cluster):
    """The metadata primary applies an op; its backups do not answer; meanwhile the primary is
    fenced and rejoins, its namespace taken from its peers (without the op); the backups answer
    then. The op is answered EAGAIN, not acknowledged: the primary no longer holds it, and its
    next op, on its peers' namespace, would replace the backups' copy that has it (fault
    simulator, mixed seed 631: a truncate acknowledged and lost, the file read back at its old
    size)."""
    cfg, nodes = cluster
    primary = next(n for n in nodes if n.name == nodes[0].cluster.roles.meta_primary())
    backups = [n for n in nodes if n is not primary]
    release = trio.Event()
    for n in backups:
        real = n.calls["meta_apply"]

        async def held(real=real, **kw):
            await release.wait()
            return await real(**kw)

        n.calls["meta_apply"] = held
    before = primary.namespace.meta.snapshot()
    op = {"op": "mkdir", "parent": 1, "name": "made", "mode": 0o755, "rid": "client:z:1"}
    answer: list = []

    async def make() -> None:
        try:
            answer.append(await primary.namespace.rpc_meta(op=dict(op), epoch=primary.cluster.roles.view_epoch))
        except RemoteError as exc:
            answer.append(exc)

    async with trio.open_nursery() as n:
        n.start_soon(make)
        with trio.fail_after(5):
            while "client:z:1" not in primary.meta.done:
                await trio.sleep(0.01)
        primary.serving.begin_join()  # fenced: it resyncs, its namespace its peers'
        primary.namespace.restore(before, whole=True)  # as a resync takes it
        primary.serving.became_ready()
        primary.serving.taken_over.set()
        release.set()
    assert len(answer) == 1 and isinstance(answer[0], RemoteError) and answer[0].code == "EAGAIN", answer


async def test_a_files_reads_spread_over_its_homes_by_bytes(nursery):
    """One reader, one stripe at a time (no load to tell the homes apart): each stripe is read
    from the home that served the reader the fewest bytes, so every node serves within a stripe
    of an even share of a file's bytes, whatever the ranking made its primaries."""
    cfg = config(n=4, r=2)
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        unit = cfg.stripe_unit
        await c.paths.write_file("/f", os.urandom(64 * unit))
        attr = await c.paths.resolve("/f")
        primaries = [c.cluster.roles.stripe_primary(attr["ino"], i) for i in range(64)]
        before = dict(c.cluster.peers.served)
        for i in range(64):
            await c.read(attr["ino"], i * unit, unit, attr)
        served = {n: c.cluster.peers.served[n] - before.get(n, 0) for n in cfg.names}
        assert sum(served.values()) == 64 * unit
        assert max(served.values()) - min(served.values()) <= 2 * unit, (served, {n: primaries.count(n) for n in cfg.names})


async def test_a_truncate_taken_with_a_whole_namespace_frees_its_stripes_too(cluster):
    """A node whose namespace stamp is not the op's ``prev`` (an op a former metadata primary
    applied and never got acknowledged) takes the truncate as the whole namespace
    (``meta_restore``): the stripes it freed go with it. Kept, the next write that grew the file
    landed on the old bytes as their primary, and sent the stripe whole to the backup: both homes
    read the truncated range back as its old bytes (CI's chaos soak, seed 3)."""
    cfg, nodes = cluster
    unit, by = cfg.stripe_unit, {n.name: n for n in nodes}
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        meta = c.cluster.roles.meta_primary()
        for i in range(50):  # a file whose stripe 2 is led by a node other than the metadata primary
            ino = (await c.paths.write_file(f"/f{i}", os.urandom(2 * unit + unit // 2)))["ino"]
            lead = rank(stripe_key(ino, 2), cfg.names)[0]
            if lead != meta:
                break
        assert lead != meta
        by[lead].namespace.meta.tag -= 1  # its stamp differs: the truncate reaches it whole
        await c.truncate(ino, unit + 100)
        assert [n.name for n in nodes if n.store.get(ino, 2)] == []
        await c.write(ino, 2 * unit + unit // 2 + 1000, b"new!")  # grows the file again
        gap = (await c.read(ino, 0, 3 * unit))[unit + 100 : 2 * unit + unit // 2 + 1000]
        assert gap == bytes(len(gap))


async def test_a_whole_namespace_taken_keeps_the_optimizer_state(cluster):
    """Optimizer state lives under snapshot ids below 0 (store.py): a namespace taken whole
    (``restore``) drops the snapshots it does not name, never that state."""
    cfg, nodes = cluster
    node, unit = nodes[1], cfg.stripe_unit
    node.store.install(StripeKey(999_999, 0, -1), 0, memoryview(b"\x07" * 64), unit)
    newer = dict(node.namespace.meta.snapshot(), seq=node.namespace.meta.seq + 1)
    node.namespace.restore(newer)
    assert node.namespace.meta.seq == newer["seq"]
    state = node.store.get(999_999, 0, -1)
    assert state is not None and bytes(state.data[:64]) == b"\x07" * 64


async def test_a_resync_that_does_not_fit_leaves_the_node_syncing_not_dead(cluster, caplog):
    """A rejoining node whose resync finds its memory full (NoSpace, one or several fetches at
    once) stays syncing, says why, and begins again; it never exits (a node loaded from disk
    whose every stripe looked older than its peers' died so: bench_snapshot --persist)."""
    from irdmafs.server.budget import NoSpace

    cfg, nodes = cluster
    node = nodes[2]
    real, tries = node.resync.resync, []

    async def full_once() -> None:
        tries.append(node.serving.state)
        if len(tries) == 1:
            raise ExceptionGroup("fetches", [NoSpace("node full: 1 bytes of stripes do not fit"), NoSpace("node full: 2 bytes")])
        await real()

    node.resync.resync = full_once
    with trio.fail_after(30):
        await node.membership.join()
    assert tries == ["syncing", "syncing"] and node.serving.state == "ready"
    assert any("its resync does not fit" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


async def test_stripe_versions_are_the_headers_one_call_per_node_and_a_node_that_cannot_say_is_read_one_sidedly(cluster, monkeypatch):
    """What a mount stamps a file with at an open (fs/pagecache.py): each stripe's version from
    ``stripe_versions``, one call per node (per VERSIONS_PER_CALL stripes), equal to what a
    one-sided read of its header says;
    a hole 0; moved by a training step, which moves no namespace version. A node that refuses
    (not caught up) leaves its stripes to the one-sided reads. Bad input is EINVAL."""
    cfg, nodes = cluster
    unit = cfg.stripe_unit
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        d = (await c.paths.resolve("/m"))["ino"]
        for k, v in (("sync", "asp"), ("workers", "1"), ("optimizer", "sgd lr=1")):
            await c.setxattr(d, f"user.irdma.{k}", v)
        a = await c.paths.save("/m/w.npy", np.zeros(3 * unit // 4, np.float32))  # 3 stripes and a header
        b = await c.paths.stat("/m/w.npy")
        await c.paths.makedirs("/f")
        await c.paths.write_file("/f/x", os.urandom(unit))
        x = await c.paths.stat("/f/x")
        files = [(b["ino"], b["size"], b["unit"]), (x["ino"], 3 * unit, x["unit"])]  # x: 2 stripes past its end (holes)

        def headers() -> list[tuple[int, ...]]:
            out = []
            for fid, size, u in files:
                v = []
                for idx in range(-(-size // u)):
                    held = [n.store.get(fid, idx) for n in nodes if n.store.get(fid, idx) is not None]
                    assert len({s.version for s in held}) <= 1, "the replicas agree"
                    v.append(held[0].version if held else 0)
                out.append(tuple(v))
            return out

        calls = {n.name: 0 for n in nodes}
        for n in nodes:
            real = n.calls["stripe_versions"]

            async def counted(_real=real, _name=n.name, **kw):
                calls[_name] += 1
                return await _real(**kw)

            n.calls["stripe_versions"] = counted
        before = await c.io.versions(files)
        assert before == headers() and before[1][1:] == (0, 0)
        assert all(k <= 1 for k in calls.values()), "one call per node"
        await c.training.push(a["ino"], 0, np.ones(3 * unit // 4, np.float32))  # asp: applied now
        after = await c.io.versions(files)
        assert after == headers() and after[0] != before[0] and after[1] == before[1]
        assert (await c.paths.stat("/m/w.npy"))["version"] == b["version"]  # the namespace did not move
        import irdmafs.client.stripe as stripe_mod

        monkeypatch.setattr(stripe_mod, "VERSIONS_PER_CALL", 2)  # a file of many stripes: several calls a node
        calls = dict.fromkeys(calls, 0)
        assert await c.io.versions(files) == after
        assert sum(calls.values()) == sum(-(-len(w) // 2) for w in _by_first_candidate(c, files).values())
        with pytest.raises(RemoteError) as err:
            await c.cluster.call(nodes[0].name, "stripe_versions", {"stripes": [[1, "a"]]})
        assert err.value.code == "EINVAL"

        async def refuse(**_):
            raise RemoteError("EAGAIN", "not caught up (test)")

        for n in nodes:  # no node can say: every stripe read one-sidedly, to the same versions
            n.calls["stripe_versions"] = refuse
        assert await c.io.versions(files) == after


def _by_first_candidate(c, files) -> dict[str, list]:
    """The stripes of ``files`` by the node a read would ask first (what ``versions`` asks)."""
    out: dict[str, list] = {}
    for fid, size, unit in files:
        for idx in range(-(-size // unit)):
            out.setdefault(c.cluster.roles.read_candidates(fid, idx)[0], []).append((fid, idx))
    return out


async def test_a_read_that_failed_over_holds_no_view_of_its_buffer_once_it_returned(cluster):
    """A short read (past the file's end) whose piece failed over (its first replica counted
    down) and then succeeded: the failure, kept by its traceback's frames round a cycle, holds
    views of the read's buffer until the cycle collector runs, and the read's ``del buf[n:]``
    raised BufferError. The read copies its bytes out instead of resizing. The collector is off
    here, so that the cycle is surely still there (review of the read plan's driver)."""
    import gc

    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        blob = os.urandom(1000)
        await c.paths.write_file("/f", blob)
        attr = await c.paths.stat("/f")
        real = c.cluster.peers.read_stripe
        failed = []

        async def read_stripe(node, *args, **kwargs):
            if not failed:
                failed.append(node)
                raise NodeDown(node, "lost once (test)")
            return await real(node, *args, **kwargs)

        c.cluster.peers.read_stripe = read_stripe
        gc.disable()
        try:
            assert await c.read(attr["ino"], 0, 5000) == blob
        finally:
            gc.enable()
        assert failed


async def _write_failing_to_backup(cluster, fails: int):
    """A file's stripe written while the first ``fails`` stagings of its bytes on the stripe's
    backup fail as a lost connection would, that backup's heartbeats answering all along: the
    primary, its backup, and the view after the write was acknowledged."""
    from irdmafs.errors import PeerLost

    cfg, nodes = cluster
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        f = await c.paths.write_file("/f", b"a" * 100)
        primary_name, backup_name = c.cluster.roles.targets(f["ino"], 0)[:2]
        primary = next(n for n in nodes if n.name == primary_name)
        real, failed = primary.cluster.peers.write, []

        async def write(name, rkey, offset, data, inc=None):
            if name == backup_name and len(failed) < fails:
                failed.append(name)
                raise PeerLost(f"{name}: write lost (test)")
            return await real(name, rkey, offset, data, inc)

        primary.cluster.peers.write = write
        try:
            await c.paths.write_file("/f", b"b" * 100)
        finally:
            primary.cluster.peers.write = real
        assert len(failed) == fails
        return primary, next(n for n in nodes if n.name == backup_name), primary.cluster.roles.view, f["ino"]


async def test_a_backup_heard_again_after_a_failed_send_is_sent_it_again_not_expelled(cluster):
    """A send to a backup that fails while its heartbeats answer (the fault healed while the
    send waited) is made once more before the backup is expelled: expelled a moment after it
    was back, its stripes had one copy, and a crash of that node lost them with every node up
    a moment before (fault simulator, mixed seed 1758162611)."""
    primary, backup, view, fid = await _write_failing_to_backup(cluster, fails=1)
    assert view.expelled == () and backup.name in view.active
    assert bytes(backup.store.get(fid, 0).data[:100]) == b"b" * 100  # the second send took


async def test_a_backup_that_fails_its_second_send_too_is_expelled(cluster):
    """The second chance is one: a backup whose probes answer but whose sends fail goes, and
    the change is acknowledged by its stand-in."""
    primary, backup, view, fid = await _write_failing_to_backup(cluster, fails=2)
    assert backup.name in view.expelled
    stand_in = next(n for n in cluster[1] if n is not primary and n is not backup)
    assert bytes(stand_in.store.get(fid, 0).data[:100]) == b"b" * 100
