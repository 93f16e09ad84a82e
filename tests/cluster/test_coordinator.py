"""Node processes with a real etcd as their coordination service (server/leases.py): a node serves
only while it holds its lease and a view names it; etcd stopped: nodes serve until their leases
end, then stop, and no view is made; a stopped node is dropped from the view only after its lease
ended, and serves again only under a new lease, named by a newer view. Nothing written is lost.
The views choose every stripe's primary and replicas."""

import os
import signal

import numpy as np
import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.coord.etcd import EtcdCoord
from irdmafs.launch.etcd_process import LocalEtcd, LocalEtcdCluster
from irdmafs.coord.views import View, prefix_of
from irdmafs.launch.local import node_status, wait_settled
from irdmafs.server.leases import cluster_id, lease_ttl

pytestmark = pytest.mark.cluster


@pytest.fixture
def etcd(tmp_path):
    with LocalEtcd(tmp_path / "etcd") as server:
        yield server


async def committed_view(etcd, cfg) -> View:
    return await committed_view_of(etcd, cfg)


async def committed_view_of(etcd, cfg) -> View:
    """The view in etcd (one member or several: the first that answers)."""
    e = await EtcdCoord([u for u in etcd.endpoints if u], timeout=2).get(prefix_of(cluster_id(cfg)) + "view")
    return View.decode(e.value, e.mod_revision) if e else View()


async def statuses(cfg) -> dict:
    return {n: await node_status(cfg, n) for n in cfg.names}


async def until(predicate, timeout, every=0.1):
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(every)


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
async def test_nodes_serve_in_views_and_stop_while_etcd_is_unreachable(local_cluster, etcd):
    lc = await local_cluster(nodes=3, replicas=2, coordinator=[etcd.endpoint], lease_ttl=2)
    cfg = lc.cfg
    ttl = lease_ttl(cfg)
    view = await committed_view(etcd, cfg)
    assert view.names == tuple(cfg.names) and view.epoch > 0
    infos = await statuses(cfg)
    for name, info in infos.items():
        assert info["state"] == "ready" and info["coordinator"] == "reachable" and info["in_view"], info
        assert info["view"] <= view.epoch
    blob = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    async with Client.connect(cfg) as c:
        await c.paths.write_file("/kept", blob)

    etcd.pause()  # SIGSTOP: etcd answers nothing
    try:
        async def all_stopped():
            infos = await statuses(cfg)
            return all(i is not None and i["state"] != "ready" for i in infos.values())

        await until(all_stopped, ttl + 10)
        infos = await statuses(cfg)
        assert all(i["coordinator"].startswith("UNREACHABLE") and not i["lease_held"] for i in infos.values()), infos
        for name in cfg.names:
            assert "its coordination lease ended" in lc.log_of(name)
    finally:
        etcd.resume()
    await wait_settled(cfg, timeout=60)
    after = await committed_view(etcd, cfg)
    assert after.epoch > view.epoch and after.names == tuple(cfg.names)
    assert all(after.lease_of(n) != view.lease_of(n) for n in cfg.names)  # every node under a new lease
    async with Client.connect(cfg) as c:
        assert await c.paths.read_file("/kept") == blob


@pytest.mark.long  # behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
async def test_a_stopped_node_leaves_the_view_after_its_lease_and_returns_under_a_new_one(local_cluster, etcd):
    lc = await local_cluster(nodes=3, replicas=2, coordinator=[etcd.endpoint], lease_ttl=2)
    cfg = lc.cfg
    ttl = lease_ttl(cfg)
    before = await committed_view(etcd, cfg)
    victim = cfg.names[1]
    blob = np.random.default_rng(2).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    async with Client.connect(cfg) as c:
        await c.paths.write_file("/a", blob)
        pid = lc.procs[victim].pid
        os.kill(pid, signal.SIGSTOP)
        stopped = trio.current_time()
        try:
            async def dropped():
                return victim not in (await committed_view(etcd, cfg)).names

            await until(dropped, 20)
            assert trio.current_time() - stopped >= ttl  # not before its lease ended
            await c.paths.write_file("/b", blob[::-1])  # the others go on
        finally:
            os.kill(pid, signal.SIGCONT)
        await wait_settled(cfg, timeout=60)
        after = await committed_view(etcd, cfg)
        assert victim in after.names and after.lease_of(victim) != before.lease_of(victim)
        assert "lease" in lc.log_of(victim) and "resync" in lc.log_of(victim)
        assert await c.paths.read_file("/a") == blob
        assert await c.paths.read_file("/b") == blob[::-1]


@pytest.mark.long  # behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
async def test_an_etcd_outage_shorter_than_the_lease_ttl_fences_nobody(local_cluster, etcd):
    """etcd stopped for 6 s, less than the default lease TTL (10 s): every node serves on, no view
    is made, reads and writes go on, and the nodes keep their leases (the TTL was ``down_after``
    rounded up, 2 s here, and a 3-second etcd restart in the chaos soak fenced every node)."""
    lc = await local_cluster(nodes=3, replicas=2, coordinator=[etcd.endpoint])
    cfg = lc.cfg
    assert lease_ttl(cfg) == 10 and cfg.down_after < 6
    await wait_settled(cfg, timeout=60)
    view = await committed_view(etcd, cfg)
    blob = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    async with Client.connect(cfg) as c:
        etcd.pause()
        try:
            await trio.sleep(2)
            await c.paths.write_file("/during", blob)
            assert await c.paths.read_file("/during") == blob
            await trio.sleep(4)  # past the etcd client's timeout (half the TTL): it says so
            infos = await statuses(cfg)
            assert all(i["state"] == "ready" and i["coordinator"].startswith("UNREACHABLE") and i["lease_held"] for i in infos.values()), infos
        finally:
            etcd.resume()
        await wait_settled(cfg, timeout=60)
        assert await committed_view(etcd, cfg) == view  # the same view, the same leases
        assert await c.paths.read_file("/during") == blob
    for name in cfg.names:
        assert "fenced" not in lc.log_of(name)


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
async def test_a_node_stopped_in_a_quiet_cluster_is_expelled_by_its_peers_heartbeats(local_cluster, etcd):
    """Nothing is written while a node is stopped, so no replication fails to expel it: its
    peers, whose heartbeats no longer hear it, expel it (server/membership.py, ``expel_loop``)
    instead of waiting for its lease (10 s) and a TTL more, and its stripes can be written."""
    lc = await local_cluster(nodes=3, replicas=2, coordinator=[etcd.endpoint])
    cfg = lc.cfg
    await wait_settled(cfg, timeout=60)
    victim = cfg.names[0]
    blob = np.random.default_rng(4).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
    pid = lc.procs[victim].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        async def expelled():
            return victim in (await committed_view(etcd, cfg)).expelled

        await until(expelled, 20)
        assert "not heard for" in "".join(lc.log_of(n) for n in cfg.names if n != victim)
        async with Client.connect(cfg) as c:
            await c.paths.write_file("/while", blob)  # its namespace primary and stripes moved
            assert await c.paths.read_file("/while") == blob
    finally:
        os.kill(pid, signal.SIGCONT)
    await wait_settled(cfg, timeout=60)
    async with Client.connect(cfg) as c:
        assert await c.paths.read_file("/while") == blob


@pytest.fixture
def etcd3(tmp_path):
    """Three etcd members, as a real cluster runs them (``irdmafs up --coordinators 3``)."""
    with LocalEtcdCluster(tmp_path / "etcd3", 3, log_dir=tmp_path) as members:
        yield members


@pytest.mark.long  # three etcd members, twice: scripts/test --long
async def test_three_members_ride_out_a_member_stopped_and_the_leader_killed(local_cluster, etcd3):
    """With three members one can hang (SIGSTOP) and the leader be killed, one after the other:
    the other two keep a majority, every node keeps its lease (none fences: its serving
    generation does not move), writes go on meanwhile, and a view change still happens (a node
    killed is expelled and comes back under a new lease)."""
    # the default lease TTL (10 s): a leader election (1-2 s here) is shorter
    lc = await local_cluster(nodes=3, replicas=2, coordinator=etcd3.endpoints)
    cfg = lc.cfg
    before = await statuses(cfg)
    blob = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    async with Client.connect(cfg) as c:
        await c.paths.write_file("/kept", blob)
        follower = next(m for m in etcd3.members if m is not etcd3.leader())
        follower.pause()
        try:
            for i in range(10):  # longer than a lease: keepalives reach the other members
                await c.paths.write_file(f"/during-pause-{i}", blob[: 1 << 20])
                await trio.sleep(0.5)
        finally:
            follower.resume()
        leader = etcd3.leader()
        assert leader is not None
        leader.kill()
        try:
            for i in range(10):
                await c.paths.write_file(f"/during-kill-{i}", blob[: 1 << 20])
                await trio.sleep(0.5)
            # a view change with the leader gone: a node killed is expelled by a new view
            view = await committed_view_of(etcd3, cfg)
            victim = cfg.names[-1]
            lc.kill(victim)

            async def expelled():
                return victim not in (await committed_view_of(etcd3, cfg)).active

            await until(expelled, lease_ttl(cfg) + 15)
            lc.start(victim)
        finally:
            leader.start()
        await wait_settled(cfg, timeout=60)
        after = await committed_view_of(etcd3, cfg)
        assert after.epoch > view.epoch and after.names == tuple(cfg.names)
        assert after.lease_of(victim) != view.lease_of(victim)
        infos = await statuses(cfg)
        for name in cfg.names[:-1]:  # the nodes not killed never fenced
            assert infos[name]["gen"] == before[name]["gen"] and "its coordination lease ended" not in lc.log_of(name), name
        assert await c.paths.read_file("/kept") == blob
        assert await c.paths.read_file("/during-kill-9") == blob[: 1 << 20]


@pytest.mark.long
async def test_a_minority_of_members_left_fences_every_node_after_its_lease_until_a_majority_returns(local_cluster, etcd3):
    """Two of three members stopped: the one left has no leader and serves nothing (the client
    tries each endpoint). Nodes serve until their leases end by their own clocks, then fence (as
    with etcd out), and no view is made meanwhile; with a majority back each resyncs and serves
    again (a new serving generation), in a view naming all of them, and every byte written
    before is there. (etcd renews every lease when a new leader is elected, so the nodes may come
    back under their old leases and the view from before: nothing changed while nobody could
    make a view.)"""
    lc = await local_cluster(nodes=3, replicas=2, coordinator=etcd3.endpoints, lease_ttl=2)
    cfg = lc.cfg
    view = await committed_view_of(etcd3, cfg)
    blob = np.random.default_rng(3).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
    async with Client.connect(cfg) as c:
        await c.paths.write_file("/kept", blob)
    before = await statuses(cfg)
    gone = etcd3.members[1:]
    for m in gone:
        m.stop()
    try:
        async def all_stopped():
            infos = await statuses(cfg)
            return all(i is not None and i["state"] != "ready" for i in infos.values())

        await until(all_stopped, lease_ttl(cfg) + 15)
        for name in cfg.names:
            assert "its coordination lease ended" in lc.log_of(name)
    finally:
        for m in gone:
            m.start()
    await wait_settled(cfg, timeout=60)
    after = await committed_view_of(etcd3, cfg)
    assert after.epoch >= view.epoch and after.active == tuple(cfg.names)
    infos = await statuses(cfg)
    assert all(infos[n]["gen"] > before[n]["gen"] and infos[n]["in_view"] for n in cfg.names), infos
    async with Client.connect(cfg) as c:
        assert await c.paths.read_file("/kept") == blob
