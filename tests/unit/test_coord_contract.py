"""The coordination service's contract (irdmafs/coord/contract.py), run on a real etcd (Debian's
etcd-server, started here on loopback) and on the in-memory model: the model must promise no more
than etcd does. Then views (coord/views.py) on the real etcd, with etcd stopped under them."""

import pytest
import trio

from irdmafs.config import Members, NodeSpec
from irdmafs.errors import LeaseGone, CoordUnavailable as Unavailable
from irdmafs.coord.etcd import EtcdCoord
from irdmafs.launch.etcd_process import LocalEtcd
from irdmafs.coord.memory import MemoryCoord
from irdmafs.coord.views import ViewKeeper


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with LocalEtcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(params=["etcd", "memory"])
def coord(request):
    if request.param == "memory":
        return MemoryCoord()
    return EtcdCoord([request.getfixturevalue("etcd").endpoint])


async def test_put_get_range_delete_and_revisions(coord):
    r1 = await coord.put("/t/a", b"1")
    r2 = await coord.put("/t/b", b"\x00\xff")
    assert r2 == r1 + 1
    a = await coord.get("/t/a")
    assert (a.key, a.value, a.mod_revision, a.lease) == ("/t/a", b"1", r1, 0)
    entries, revision = await coord.range("/t/")
    assert [e.key for e in entries] == ["/t/a", "/t/b"] and entries[1].value == b"\x00\xff" and revision == r2
    assert await coord.get("/t/none") is None
    assert await coord.delete("/t/a") == r2 + 1
    assert await coord.get("/t/a") is None
    assert await coord.delete("/t/a") == r2 + 1  # nothing deleted: no new revision
    await coord.delete("/t/b")


async def test_compare_and_set(coord):
    ok, created = await coord.cas("/t/view", 0, b"v1")
    assert ok
    ok, revision = await coord.cas("/t/view", 0, b"again")  # exists now
    assert not ok and revision == created
    ok, r2 = await coord.cas("/t/view", created, b"v2")
    assert ok and r2 > created
    ok, _ = await coord.cas("/t/view", created, b"stale")
    assert not ok
    e = await coord.get("/t/view")
    assert (e.value, e.mod_revision) == (b"v2", r2)
    await coord.delete("/t/view")


async def test_create_all_is_one_step_and_all_or_nothing(coord):
    ok, revision = await coord.create_all({"/t/ns/e/a": b"entry", "/t/ns/i/a": b"inode"})
    assert ok
    e, i = await coord.get("/t/ns/e/a"), await coord.get("/t/ns/i/a")
    assert e.mod_revision == i.mod_revision == revision and (e.value, i.value) == (b"entry", b"inode")
    ok, after = await coord.create_all({"/t/ns/e/b": b"x", "/t/ns/i/a": b"again"})  # one exists
    assert not ok and after == revision
    assert await coord.get("/t/ns/e/b") is None and (await coord.get("/t/ns/i/a")).value == b"inode"
    for k in ("/t/ns/e/a", "/t/ns/i/a"):
        await coord.delete(k)


async def test_lease_keys_go_with_the_lease(coord):
    lease = await coord.grant(2)
    assert await coord.keepalive(lease) >= 2
    await coord.put("/t/alive/x", b"", lease=lease)
    assert (await coord.get("/t/alive/x")).lease == lease
    await coord.revoke(lease)
    assert await coord.get("/t/alive/x") is None
    assert await coord.keepalive(lease) == 0
    with pytest.raises(LeaseGone):
        await coord.put("/t/alive/x", b"", lease=lease)
    await coord.revoke(lease)  # ended already: nothing


async def lease_ends_unless_kept_alive(coord):
    lease = await coord.grant(2)
    await coord.put("/t/alive/y", b"", lease=lease)
    await trio.sleep(1.2)
    assert await coord.keepalive(lease) >= 2  # renewed: 2 s from now
    await trio.sleep(1.2)
    assert await coord.get("/t/alive/y") is not None  # 2.4 s after the grant, kept alive
    await trio.sleep(2.5)
    assert await coord.get("/t/alive/y") is None
    assert await coord.keepalive(lease) == 0


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
async def test_a_lease_not_kept_alive_ends_with_its_keys(etcd):
    await lease_ends_unless_kept_alive(EtcdCoord([etcd.endpoint]))


async def test_a_lease_not_kept_alive_ends_with_its_keys_in_the_model(autojump_clock):
    await lease_ends_unless_kept_alive(MemoryCoord())


async def test_an_unreachable_etcd_is_unavailable():
    coord = EtcdCoord(["http://127.0.0.1:9"], timeout=0.5)
    with pytest.raises(Unavailable, match="127.0.0.1:9"):
        await coord.get("/x")


async def test_an_etcd_that_resets_the_connection_mid_answer_is_unavailable():
    """etcd killed while it answered: the connection is reset (RST) as the client reads. That
    is Unavailable like any outage; it was trio's BrokenResourceError, which ended the node's
    view task and the node with it (chaos --views, seed 2)."""
    import socket
    import struct

    async def reset(stream):
        await stream.receive_some(65536)  # the request
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()  # RST, not FIN

    async with trio.open_nursery() as n:
        listeners = await n.start(trio.serve_tcp, reset, 0)
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(Unavailable):
            await EtcdCoord([f"http://127.0.0.1:{port}"], timeout=5).range("/x/")
        n.cancel_scope.cancel()


def test_endpoints_are_checked():
    for bad in ([], ["https://h:1"], ["http://h"], ["h:1"]):
        with pytest.raises(ValueError):
            EtcdCoord(bad)


@pytest.mark.long  # behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
async def test_views_on_a_real_etcd_through_its_outage(etcd, nursery):
    """Three keepers on the real etcd: one view names them; one stops and is dropped after
    its lease ended; etcd stopped (SIGSTOP): everyone stops serving within the TTL and no view
    is made; etcd back: new leases, one new view naming all."""
    coord = EtcdCoord([etcd.endpoint], timeout=0.5)
    names = ["a", "b", "c"]
    keepers = {n: ViewKeeper(coord, "live", n, lambda: Members(tuple(NodeSpec(m, "host", 0) for m in names), 2), ttl=2) for n in names}
    scopes = {}

    async def node(k, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            scopes[k.name] = scope
            async with trio.open_nursery() as n:
                await n.start(k.run)
                task_status.started()
                while True:
                    if k.lease.held() and not k.announced:
                        try:
                            await k.announce()
                        except (LeaseGone, Unavailable):
                            pass
                    await trio.sleep(0.2)

    async def until(predicate, timeout):
        with trio.fail_after(timeout):
            while not predicate():
                await trio.sleep(0.05)

    for k in keepers.values():
        await nursery.start(node, k)
    # every keeper serving, and every one's newest view naming all three (a keeper may still
    # hold an older view that names only itself and one other)
    await until(lambda: all(k.serving() and set(k.view.names) == set(names) for k in keepers.values()), 15)
    first = keepers["a"].view
    scopes["c"].cancel()
    stopped = trio.current_time()
    await until(lambda: "c" not in keepers["a"].view.names, 20)
    assert trio.current_time() - stopped >= 2 and keepers["a"].view.epoch > first.epoch
    etcd.pause()
    try:
        paused = trio.current_time()
        before = keepers["a"].view
        await until(lambda: not any(k.serving() for k in keepers.values()), 5)
        assert trio.current_time() - paused <= 2 + 0.5
        assert keepers["a"].view == before and keepers["a"].reader.unreachable_since < trio.current_time()
    finally:
        etcd.resume()
    await until(lambda: keepers["a"].serving() and keepers["b"].serving(), 30)
    assert keepers["a"].view.epoch > before.epoch
