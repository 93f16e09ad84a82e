"""A heartbeat whose timeout this process saw late (its own loop held past the deadline) does not
count the node down: the node is asked once more (runtime/heartbeats.py ``_probe``). A mount on a busy host
counted working nodes down and dropped their connections with hundreds of reads in flight
(issue 41, chaos --model-gib 1); a node that is really silent is still counted down."""

import time

import trio

from irdmafs.runtime.cluster import Cluster
from irdmafs.transport.memory import MemoryTransport

from .onenode import one_node_config

DOWN_AFTER = 0.5


def config(port):
    return one_node_config(port, down_after=DOWN_AFTER)


async def heard(nursery, cfg, node):
    """Node "a" served by ``node``, a Cluster that has heard it once (ready), and the list of
    nodes it counts down from then on."""
    await nursery.start(MemoryTransport(cfg.token).serve, "mem", cfg.nodes[0].port, node)
    cluster = Cluster(cfg, MemoryTransport(cfg.token), nursery)
    downs: list[str] = []
    cluster.liveness.on_down.append(downs.append)
    await cluster.heartbeats.refresh()
    assert cluster.liveness.state["a"] == "ready"
    return cluster, downs


async def test_a_heartbeat_timed_out_while_this_loop_was_held_asks_again():
    cfg = config(9611)
    asked = []

    async def node(method, args):
        asked.append(method)
        if len(asked) == 2:
            await trio.sleep(0.05)  # the answer is under way when this process stalls
        return {"state": "ready"}

    async with trio.open_nursery() as nursery:
        cluster, downs = await heard(nursery, cfg, node)

        async def stall():
            await trio.sleep(0.01)
            time.sleep(DOWN_AFTER * 1.5)  # the loop held (the host did not run us): past the deadline

        nursery.start_soon(stall)
        await cluster.heartbeats.refresh()
        assert asked == ["heartbeat"] * 3  # asked again, not counted down
        assert cluster.liveness.state["a"] == "ready" and downs == []
        nursery.cancel_scope.cancel()


async def test_a_node_silent_past_the_deadline_is_still_counted_down():
    cfg = config(9612)

    silent = trio.Event()

    async def node(method, args):
        if silent.is_set():
            await trio.sleep_forever()
        return {"state": "ready"}

    async with trio.open_nursery() as nursery:
        cluster, downs = await heard(nursery, cfg, node)
        silent.set()
        await cluster.heartbeats.refresh()
        assert downs == ["a"]
        nursery.cancel_scope.cancel()


async def test_refreshes_at_once_send_one_heartbeat_a_node():
    """A pull's reads each ask every node again while a replica is out (stripe.py); a refresh
    that finds a probe of the node under way waits for it instead of sending another. Hundreds
    of heartbeats at once timed out behind one another and counted working nodes down
    (chaos --model-gib 2)."""
    cfg = config(9613)
    asked = []

    async def node(method, args):
        asked.append(method)
        await trio.sleep(0.05)
        return {"state": "ready"}

    async with trio.open_nursery() as nursery:
        cluster, downs = await heard(nursery, cfg, node)
        asked.clear()
        async with trio.open_nursery() as n:
            for _ in range(200):
                n.start_soon(cluster.heartbeats.refresh)
        assert asked == ["heartbeat"]  # one probe, every refresh waited for it
        await cluster.heartbeats.refresh()  # and the next refresh asks again
        assert asked == ["heartbeat"] * 2 and downs == []
        nursery.cancel_scope.cancel()


async def test_a_node_silent_on_a_live_tcp_connection_is_logged_with_what_it_waited_on(caplog):
    """A heartbeat unanswered while its connection stays up logs what that connection waited
    on (``Connection.waits``): in the GB soak a mount counted a serving node down for one such
    heartbeat, and nothing said why (docs/reliability.md, soak items)."""
    from dataclasses import replace

    from irdmafs.config import NodeSpec
    from irdmafs.transport.tcp import TcpTransport

    silent = trio.Event()

    async def node(method, args):
        if silent.is_set():
            await trio.sleep_forever()
        return {"state": "ready"}

    cfg = config(9614)  # its node's address is replaced by where the TCP node listens
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(TcpTransport(cfg.token).serve, "127.0.0.1", 0, node)
        cfg = replace(cfg, nodes=[NodeSpec("a", host, port)])
        cluster = Cluster(cfg, TcpTransport(cfg.token), nursery)
        downs: list[str] = []
        cluster.liveness.on_down.append(downs.append)
        await cluster.heartbeats.refresh()
        assert cluster.liveness.state["a"] == "ready"
        silent.set()
        with caplog.at_level("WARNING", logger="irdmafs.runtime.heartbeats"):
            await cluster.heartbeats.refresh()
        assert downs == ["a"]
        [line] = [r.getMessage() for r in caplog.records if r.name == "irdmafs.runtime.heartbeats"]
        assert line.startswith("heartbeat to a unanswered in ")
        assert "(its connection: 0 requests unanswered; calls: 0 frames (0 bytes) queued to send, last answer " in line
        nursery.cancel_scope.cancel()
