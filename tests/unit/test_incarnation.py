"""Incarnations: a key cached from one process of a node never reaches the next one.

In-process on the memory transport, with the worst case forced: the restarted node hands out a
region under the very rkey the old one had (random keys rarely collide; RDMA hardware keys are
often reused across a process restart). A write with the old key must be refused before it is
sent (StaleKey), the caches built from the old process dropped, and the new region untouched.
"""

import pytest
import trio

from irdmafs.runtime.cluster import Cluster
from irdmafs.runtime.slots import StagingPool
from irdmafs.config import from_dict
from irdmafs.transport.base import Access, Region
from irdmafs.errors import AccessError, StaleKey
from irdmafs.transport.memory import MemoryTransport


def config():
    return from_dict(
        {
            "nodes": [{"name": "a", "host": "mem", "port": 9501}],
            "token": "test-token-123",
            "replicas": 1,
            "transport": ["memory"],
            "coordinator": ["http://127.0.0.1:2379"],  # never reached: no node here reads views
            "heartbeat": 0.05,
            "down_after": 0.3,
        }
    )


async def handler(method, args):
    if method == "heartbeat":
        return {"state": "ready"}
    if method == "staging":
        return {"rkey": 77}
    raise AssertionError(method)


async def serve(nursery, transport):
    return await nursery.start(transport.serve, "mem", 9501, handler)


async def test_a_key_from_an_earlier_incarnation_is_refused_before_it_is_sent():
    cfg = config()
    async with trio.open_nursery() as nursery:
        old = MemoryTransport(cfg.token)
        region = old.regions.add(memoryview(bytearray(64)), Access.RW)
        scope = trio.CancelScope()

        async def run_old(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await old.serve("mem", 9501, handler, task_status=task_status)

        await nursery.start(run_old)
        cluster = Cluster(cfg, MemoryTransport(cfg.token), nursery)
        pool = StagingPool(cluster, "t", 16)
        dropped = []
        cluster.peers.on_restart.append(dropped.append)
        reply, inc = await cluster.call_on("a", "staging", {})
        assert inc == old.incarnation
        await pool._region("a")
        await cluster.peers.write("a", region.rkey, 0, b"old", inc)  # the right incarnation: lands
        assert bytes(region.buf[:3]) == b"old"

        scope.cancel()  # the process dies ...
        await trio.sleep(0)
        new = MemoryTransport(cfg.token)  # ... and a new one starts, reusing the same key
        assert new.incarnation != old.incarnation
        new.regions._regions[region.rkey] = Region(region.rkey, memoryview(bytearray(64)), Access.RW)
        await serve(nursery, new)
        cluster.mark_down("a", "gone")  # as a failed operation or a heartbeat would

        with pytest.raises(StaleKey):
            await cluster.peers.write("a", region.rkey, 0, b"stale", inc)
        assert bytes(new.regions.get(region.rkey).buf[:5]) == bytes(5)  # nothing reached it
        assert dropped == ["a"] and cluster.peers.restarts_seen == 1
        assert "a" not in pool._regions  # the staging region of the old process is forgotten
        assert isinstance(StaleKey("x"), AccessError)  # every path that refreshes on AccessError does here
        await cluster.peers.write("a", region.rkey, 0, b"new", cluster.peers.incarnation["a"])  # a key of the new one lands
        assert bytes(new.regions.get(region.rkey).buf[:3]) == b"new"
        nursery.cancel_scope.cancel()


async def test_a_failure_on_an_old_staging_region_does_not_drop_the_new_one():
    """Two sends to a restarted node fail on its old staging region. The first asks for a new
    region (which replaces the old one on the node); the second's failure, on the old region,
    must not drop the new one: asking again would replace it under the first send's retry, which
    then failed too and counted a healthy node down (fault simulator, heartbeat crash seed 22)."""
    cfg = config()
    given = []

    async def staging_handler(method, args):
        if method == "heartbeat":
            return {"state": "ready"}
        if method == "staging":
            given.append(len(given) + 100)
            return {"rkey": given[-1]}
        raise AssertionError(method)

    async with trio.open_nursery() as nursery:
        await nursery.start(MemoryTransport(cfg.token).serve, "mem", 9501, staging_handler)
        pool = StagingPool(Cluster(cfg, MemoryTransport(cfg.token), nursery), "t", 16, slots=2)
        first_failed, second_may_fail = trio.Event(), trio.Event()
        used = []

        async def send(slot, fail_after=None):
            used.append(slot.rkey)
            if slot.rkey == 100:  # the region of the process before the restart
                if fail_after is not None:
                    await fail_after.wait()
                raise AccessError(f"unknown rkey {slot.rkey}")
            return slot.rkey

        async def first():
            with pytest.raises(AccessError):
                await pool.with_slot("a", send)
            first_failed.set()
            assert await pool.with_slot("a", send) == 101  # a new region, asked for once
            second_may_fail.set()
            await trio.sleep(0.01)
            assert await pool.with_slot("a", send) == 101  # still the new one after the second failure

        async def second():
            with pytest.raises(AccessError):
                await pool.with_slot("a", lambda slot: send(slot, second_may_fail))

        await pool._region("a")
        async with trio.open_nursery() as n:
            n.start_soon(second)
            await trio.sleep(0)
            n.start_soon(first)
        assert given == [100, 101], given  # the region was replaced once, not twice
        pool.forget("a", 100)  # a late failure on the old region: the new one stays
        assert pool._regions["a"].rkey == 101
        pool.forget("a")  # a restart: gone whatever it was
        assert "a" not in pool._regions
        nursery.cancel_scope.cancel()


async def test_a_node_that_accepts_but_never_answers_is_down_within_the_op_timeout(nursery):
    """A stopped node's kernel still accepts connections: the connect must give up after the op
    timeout and count the node down, not wait out the transport's 10-second handshake (a read
    that tried a stopped node again waited that long under views, in the chaos soak)."""
    from irdmafs.errors import NodeDown
    from irdmafs.transport.tcp import HANDSHAKE_TIMEOUT, TcpTransport

    silent = trio.socket.socket()
    await silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: the kernel completes the handshake, nobody speaks
    port = silent.getsockname()[1]
    cfg = from_dict(
        {
            "nodes": [{"name": "a", "host": "127.0.0.1", "port": port}],
            "token": "test-token-123",
            "replicas": 1,
            "transport": ["tcp"],
            "op_timeout": 0.5,
            "coordinator": ["http://127.0.0.1:2379"],
        }
    )
    assert cfg.op_timeout < HANDSHAKE_TIMEOUT
    cluster = Cluster(cfg, TcpTransport(cfg.token), nursery)
    with trio.fail_after(HANDSHAKE_TIMEOUT / 2):  # a hang guard: the handshake timeout is not what ends it
        with pytest.raises(NodeDown) as err:
            await cluster.call("a", "stripes")
    assert "no handshake within 0.5s" in str(err.value)
    assert cluster.liveness.state.get("a") == "down"
    silent.close()


async def test_an_answer_acknowledged_in_a_newer_view_brings_that_view_before_it_returns():
    """A commit (or namespace op, or push) acknowledged in view 7, while this client still holds
    view 6: the client learns view 7 before the call returns. View 7 may have expelled a replica
    view 6 still names, which lacks the change: a client going on by view 6 reads the write back
    old from it, or pushes to it a tensor it never heard of (chaos --views seed 11: ENOENT)."""
    cfg = config()
    epoch = [6]

    async def views_node(method, args):
        if method == "heartbeat":
            return {"state": "ready", "view": epoch[0], "view_serving": {"a": 1}, "view_expelled": []}
        if method == "commit":
            epoch[0] = 7  # a view came (a replica expelled) while the commit waited for it
            return {"version": 3, "acked_in": 7}
        raise AssertionError(method)

    async with trio.open_nursery() as nursery:
        await nursery.start(MemoryTransport(cfg.token).serve, "mem", 9501, views_node)
        cluster = Cluster(cfg, MemoryTransport(cfg.token), nursery)  # no heartbeat loop: only what calls bring
        await cluster.heartbeats.refresh()
        assert cluster.roles.view_epoch == 6
        assert (await cluster.call("a", "commit", {}))["version"] == 3
        assert cluster.roles.view_epoch == 7
        nursery.cancel_scope.cancel()
