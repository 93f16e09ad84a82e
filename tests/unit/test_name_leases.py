"""The metadata primary's name cache leases (server/namecache.py; docs/caching.md C1-C7): a
change is answered only once every other caching mount dropped what it touched or lost its
lease; a new lead waits a lease out; what a change touches; bad calls refused."""

from dataclasses import replace

import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.server.namecache import MAX_QUEUED, NameLeases, Touch, changer_of, touched_by
from irdmafs.errors import RemoteError
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_lead_waits_a_lease_out_only_if_a_mount_recorded_before_it_may_cache():
    clock = Clock()
    names = NameLeases(4.0, clock)
    names.leads(7, cachers=set(), gen=1)
    assert names.in_grace() == 0  # nobody cached before this lead: no lease of another primary
    names.end(8)
    names.leads(9, cachers={"m"}, gen=1)  # a new lead, and m may hold another primary's lease
    assert names.in_grace() == pytest.approx(4.4)
    clock.now += 2
    names.leads(12, cachers={"m"}, gen=1)  # still ready and primary: the same lead goes on
    assert names.in_grace() == pytest.approx(2.4)
    clock.now += 2.5
    assert names.in_grace() == 0
    names.leads(13, cachers={"m"}, gen=2)  # ready anew since (a fence, a rejoin): a new lead
    assert names.in_grace() == pytest.approx(4.4)
    clock.now += 5
    assert names.stale({"m"}) == []
    clock.now += 3 * 4.0
    assert names.stale({"m"}) == ["m"]  # never heard from in three leases: its record goes


async def test_a_change_is_queued_for_every_live_lease_but_its_changers():
    clock = Clock()
    names = NameLeases(4.0, clock)
    names.leads(1, set(), 1)
    for owner in ("a", "b", "c"):
        with trio.move_on_after(0):  # the first call of each: a lease, nothing to drop
            await names.wait(owner, 0, 0)
        names.leases[owner].until = clock.now + 4
    names.leases["c"].until = clock.now - 1  # ended
    owed = names.touched("a", Touch(5, ((1, "x"),), (1,)))
    assert owed == ["b"] and names.leases["a"].queue == [] and names.leases["c"].queue == []
    for seq in range(6, 6 + MAX_QUEUED + 1):
        names.touched("a", Touch(seq, ((1, "x"),)))
    assert names.leases["b"].queue == [Touch(6 + MAX_QUEUED, everything=True)]  # bounded (C6)


def test_what_each_change_touches():
    t = touched_by(3, {"op": "rename", "parent": 1, "name": "a", "new_parent": 2, "new_name": "b"}, {"ino": 9, "freed": 8})
    assert set(t.entries) == {(1, "a"), (2, "b")} and set(t.inodes) == {1, 2, 8, 9} and not t.everything
    assert set(touched_by(4, {"op": "setattr", "ino": 5, "attrs": {"mode": 0o600}}, {}).inodes) == {5}
    assert touched_by(5, {"op": "pack", "bucket": 3, "tensors": [], "count": 0, "final": True}, {}).everything
    assert touched_by(6, {"op": "cacher", "owner": "m", "on": True}, {}) is None
    assert changer_of({"op": "mkdir", "rid": "client:12:ab12cd34:7"}) == "client:12:ab12cd34"
    assert changer_of({"op": "mkdir"}) is None and changer_of({"op": "mkdir", "rid": 5}) is None


@pytest.fixture
async def leased(nursery):
    cfg = replace(config(), name_lease=8.0)
    nodes = await start_cluster(nursery, cfg)
    return cfg, nodes


async def test_a_change_is_answered_once_another_caching_mount_dropped_what_it_touched(leased, nursery):
    cfg, nodes = leased
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        primary = c.cluster.roles.meta_primary()
        node = next(n for n in nodes if n.name == primary)

        async def wait(owner, acked):
            return await c.cluster.call(primary, "cache_wait", {"owner": owner, "acked": acked, "epoch": c.cluster.roles.view_epoch})

        first = await wait("other", 0)  # held a moment, then a lease with nothing to drop
        assert first["fresh"] and first["inval"] == [] and first["lease"] > 0
        assert "other" in node.meta.cachers and all("other" in n.meta.cachers for n in nodes)
        own = await wait(c.owner, 0)  # the changer's own lease: never waited for (C5)
        made = trio.Event()

        async def mkdir():
            await c.mkdir(1, "d", 0o755)
            made.set()

        nursery.start_soon(mkdir)
        told = await wait("other", first["acked"])  # answered at once: what the mkdir touched
        seq, entries, inodes, everything = told["inval"][0]
        assert [1, "d"] in entries and 1 in inodes and not everything
        assert not made.is_set()  # not answered: "other" has not acknowledged, its lease runs
        assert node.namespace.names.waits >= 1
        nursery.start_soon(wait, "other", seq)  # the acknowledgement
        with trio.fail_after(5):
            await made.wait()
        assert node.namespace.names.leases[c.owner].queue == [] and own["inval"] == []


async def test_a_mount_that_stops_asking_holds_a_change_up_only_until_its_lease_ends(nursery):
    cfg = replace(config(), name_lease=1.0)
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        primary = c.cluster.roles.meta_primary()
        r = await c.cluster.call(primary, "cache_wait", {"owner": "gone", "acked": 0, "epoch": c.cluster.roles.view_epoch})
        ends = trio.current_time() + r["lease"]  # not before this, by the primary's clock either
        await c.mkdir(1, "d", 0o755)
        assert trio.current_time() >= ends - 0.05


async def test_a_new_lead_refuses_changes_until_a_lease_has_passed(nursery):
    cfg = replace(config(), name_lease=2.0)
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        await c.cluster.call(primary.name, "cache_wait", {"owner": "m", "acked": 0, "epoch": c.cluster.roles.view_epoch})
        names = primary.namespace.names
        names._led = None  # as after a restart or a lead it lost track of
        names.leads(c.cluster.roles.view_epoch, primary.meta.cachers, primary.serving.gen)
        ends = trio.current_time() + names.in_grace()
        with pytest.raises(RemoteError) as err:
            await c.cluster.call(primary.name, "meta", {"op": {"op": "mkdir", "parent": 1, "name": "x", "mode": 0o755}, "epoch": c.cluster.roles.view_epoch})
        assert err.value.code == "EAGAIN"
        await c.mkdir(1, "x", 0o755)  # the client follows EAGAIN: answered after the grace
        assert trio.current_time() >= ends - 0.05


async def test_cache_wait_refuses_bad_calls_and_answers_only_on_the_primary(leased):
    cfg, nodes = leased
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        primary = c.cluster.roles.meta_primary()
        other = next(n.name for n in nodes if n.name != primary)
        for args in ({"owner": "", "acked": 0}, {"owner": "m", "acked": "1"}, {"owner": 5}):
            with pytest.raises(RemoteError) as err:
                await c.cluster.call(primary, "cache_wait", args)
            assert err.value.code == "EINVAL", args
        with pytest.raises(RemoteError) as err:
            await c.cluster.call(other, "cache_wait", {"owner": "m", "acked": 0, "epoch": c.cluster.roles.view_epoch})
        assert err.value.code == "ENOTPRIMARY"


async def test_with_caching_off_cache_wait_is_enosys(nursery):
    cfg = replace(config(), name_lease=0.0)
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        with pytest.raises(RemoteError) as err:
            await c.meta.cache_wait(0)
        assert err.value.code == "ENOSYS"


def test_a_lead_goes_on_across_the_views_it_learns_and_ends_at_one_naming_another():
    clock = Clock()
    names = NameLeases(4.0, clock)
    names.view(3, True, {"m"}, 1)
    clock.now += 10  # past any grace
    for epoch in (4, 6, 9):  # views learnt (some skipped), this node primary and ready in each
        names.view(epoch, True, {"m"}, 1)
        assert names.in_grace() == 0
    names.view(10, False, {"m"}, 1)  # another node leads in view 10
    names.view(11, True, {"m"}, 1)  # primary again: a new lead, which waits out 10's leases
    assert names.in_grace() == pytest.approx(4.4)


async def test_a_mount_that_gives_its_lease_up_holds_no_change_up_and_leaves_no_record(leased):
    """A clean unmount (fs/namelease.py, ``release``): the ``cacher`` op drops the owner's
    record on every node and its lease on the primary, so the next change waits for nobody."""
    cfg, nodes = leased
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        primary = next(n for n in nodes if n.name == c.cluster.roles.meta_primary())
        await c.cluster.call(primary.name, "cache_wait", {"owner": "m", "acked": 0, "epoch": c.cluster.roles.view_epoch})
        assert "m" in primary.namespace.names.leases
        await c.meta.op(op="cacher", owner="m", on=False)
        assert all("m" not in n.meta.cachers for n in nodes) and "m" not in primary.namespace.names.leases
        waits = primary.namespace.names.waits
        await c.mkdir(1, "d", 0o755)
        assert primary.namespace.names.waits == waits  # nobody to wait for


async def test_a_mount_acknowledges_only_what_it_dropped_and_hands_out_nothing_after_a_fault(caplog):
    """fs/namelease.py: an invalidation that could not be applied is not acknowledged (the
    primary's lease of the mount runs out instead) and the mount gives the kernel no timeout
    until one is; applied, it is acknowledged by the next call."""
    from irdmafs.fs.namelease import NameLease

    answers = [
        {"lease": 4.0, "held": 0.0, "fresh": True, "acked": 10, "inval": []},
        {"lease": 4.0, "held": 0.0, "fresh": False, "acked": 10, "inval": [[11, [[1, "x"]], [1], False]]},
        {"lease": 4.0, "held": 0.0, "fresh": False, "acked": 10, "inval": [[11, [[1, "x"]], [1], False]]},
    ]
    acks, dropped, fail = [], [], [True]

    class FakeClient:
        async def cache_wait(self, acked):
            acks.append(acked)
            if not answers:
                await trio.sleep_forever()
            return answers.pop(0)

    def drop(entries, inodes):
        if fail.pop(0) if fail else False:
            raise RuntimeError("the kernel said no")
        dropped.append((entries, inodes))

    lease = NameLease(FakeClient(), forget=lambda *a: None)
    async with trio.open_nursery() as n:
        n.start_soon(lease.run, drop)
        with trio.fail_after(5):
            while len(acks) < 4:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert acks == [0, 10, 10, 11]  # 11 acknowledged only after the second, successful drop
    assert "invalidations not applied" in caplog.text


async def test_a_mount_forgets_what_it_handed_out_two_leases_ago_and_caches_again(monkeypatch, autojump_clock):
    """fs/namelease.py: no kernel timeout outlives a span (the longest a lease allowed), so what
    went out two spans ago has left the kernel and stops counting against ``MAX_GIVEN``: a
    mount that walked more names than the bound caches again a little later, for good."""
    from irdmafs.fs import namelease
    from irdmafs.fs.namelease import NameLease

    monkeypatch.setattr(namelease, "MAX_GIVEN", 4)
    lease = NameLease(client=None, forget=lambda *a: None)

    def renewed():
        lease.until, lease.span, lease.margin = trio.current_time() + 4.0, 4.0, 0.4

    def handout(i):
        return lease.entry({"st_ino": 100 + i}, 1, f"f{i}", lease.begin())

    renewed()
    assert all(handout(i)["entry_timeout"] > 0 for i in range(2))  # 2 names, 2 inodes: the bound
    assert "entry_timeout" not in handout(2)
    await trio.sleep(4.5)
    renewed()
    assert "entry_timeout" not in handout(2) and (1, "f0") in lease.given  # one span: may still be in the kernel
    await trio.sleep(4.5)
    renewed()
    assert handout(2)["entry_timeout"] > 0 and (1, "f0") not in lease.given
