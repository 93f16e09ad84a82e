"""A TCP connection's read window (transport/window.py): a burst of READs of any size goes out as
earlier answers arrive, so another read never waits behind the whole burst, and the burst is bounded
by silence between answers, never by its size (issue 41: a 1 GiB model's pull, one burst of
hundreds of MB per node, held the heartbeats behind it for seconds and the mount counted
working nodes down).

These test the Python data plane (tcp.py, the reference: engine="python"); the native engine's
answers to the same cases are in test_engine.py.
"""

import os

import pytest
import trio
import trio.testing

import irdmafs.transport.tcp as tcp
from irdmafs.transport.base import Access
from irdmafs.errors import PeerLost, TimeoutError
from irdmafs.transport.window import Window

from .conftest import TOKEN, handler

MiB = 1 << 20


async def _served(nursery, op_timeout=30.0):
    server = tcp.TcpTransport(TOKEN, engine="python")
    host, port = await nursery.start(server.serve, "127.0.0.1", 0, handler)
    region = server.alloc_region(8 * MiB, Access.RW)
    region.buf[:] = os.urandom(len(region.buf))
    conn = await tcp.TcpTransport(TOKEN, op_timeout=op_timeout, engine="python").connect(host, port, nursery=nursery)
    return region, conn


def _gate_reads(monkeypatch) -> trio.Event:
    """Every READ a node serves waits for the event (patched before a connection binds it)."""
    gate = trio.Event()
    real = tcp._Responder.on_read

    async def held_read(self, h):
        await gate.wait()
        await real(self, h)

    monkeypatch.setattr(tcp._Responder, "on_read", held_read)
    return gate


async def test_a_read_is_answered_while_a_burst_larger_than_the_window_goes_on(nursery):
    region, conn = await _served(nursery)
    into = bytearray(MiB)
    ops = [(region.rkey, (i % 8) * MiB, into) for i in range(64 * tcp.READ_WINDOW // MiB)]  # 64 windows
    order = []

    async def burst():
        await conn.read_many(ops)
        order.append("burst")

    async with trio.open_nursery() as n:
        n.start_soon(burst)
        while conn.window.used == 0:  # the burst is on its way
            await trio.sleep(0)
        small = bytearray(64)
        await conn.read(region.rkey, 0, small)  # another task's read, on the same socket
        assert bytes(small) == bytes(region.buf[:64])
        order.append("read")
    assert order == ["read", "burst"]  # without the window the read waited for all 64 windows
    assert conn.window.peak <= tcp.READ_WINDOW
    assert conn.window.used == 0
    assert bytes(into) == bytes(region.buf[7 * MiB :])  # the last READ's bytes, whole


async def test_a_burst_of_small_reads_is_bounded_by_count_too(nursery):
    """A node serves each READ with a pass of its loop: thousands of header reads in flight held
    a heartbeat behind them as surely as megabytes did."""
    region, conn = await _served(nursery)
    outs = [bytearray(64) for _ in range(4000)]
    order = []

    async def burst():
        await conn.read_many([(region.rkey, (i % 100) * 64, out) for i, out in enumerate(outs)])
        order.append("burst")

    async with trio.open_nursery() as n:
        n.start_soon(burst)
        while conn.window.used == 0:
            await trio.sleep(0)
        small = bytearray(64)
        await conn.read(region.rkey, 64, small)
        order.append("read")
    assert order == ["read", "burst"]
    assert conn.window.peak <= tcp.READ_WINDOW  # at most READ_WINDOW // READ_COST reads at once
    assert all(bytes(out) == bytes(region.buf[(i % 100) * 64 : (i % 100) * 64 + 64]) for i, out in enumerate(outs))


async def test_every_read_of_a_burst_lands_in_its_own_buffer(nursery):
    region, conn = await _served(nursery)
    outs = [bytearray(MiB // 2) for _ in range(3 * tcp.READ_WINDOW // (MiB // 2))]
    await conn.read_many([(region.rkey, (i * 3 % 16) * (MiB // 2), out) for i, out in enumerate(outs)])
    for i, out in enumerate(outs):
        at = (i * 3 % 16) * (MiB // 2)
        assert bytes(out) == bytes(region.buf[at : at + MiB // 2])


async def test_a_burst_is_bounded_by_silence_between_answers_not_by_its_size(nursery, monkeypatch):
    """Answers 20 ms apart: 100 of them take 2 s, twice the op_timeout, and the burst completes
    (it timed out at 1 s before); a peer that goes silent still times the burst out."""
    real = tcp._Responder.on_read
    served = [0]
    silent_from = [None]

    async def slow_read(self, h):
        served[0] += 1
        if silent_from[0] is not None and served[0] >= silent_from[0]:
            await trio.sleep_forever()
        await trio.sleep(0.02)
        await real(self, h)

    monkeypatch.setattr(tcp._Responder, "on_read", slow_read)  # before the connection binds it
    region, conn = await _served(nursery, op_timeout=1.0)
    into = bytearray(4096)
    await conn.read_many([(region.rkey, 0, into)] * 100)
    assert bytes(into) == bytes(region.buf[:4096])
    silent_from[0] = served[0] + 5
    with pytest.raises(TimeoutError):
        await conn.read_many([(region.rkey, 0, into)] * 10)


async def test_a_connection_that_breaks_wakes_the_burst_waiting_for_room(nursery, monkeypatch):
    gate = _gate_reads(monkeypatch)
    region, conn = await _served(nursery)
    into = bytearray(MiB)
    failed = []

    async def burst():
        with pytest.raises(PeerLost):
            await conn.read_many([(region.rkey, 0, into)] * (2 * tcp.READ_WINDOW // MiB))
        failed.append(True)

    async with trio.open_nursery() as n:
        n.start_soon(burst)
        while conn.window.used < tcp.READ_WINDOW:  # the window is full: the rest wait for room
            await trio.sleep(0)
        await conn.aclose()
    assert failed == [True]
    assert conn.window.used == 0


async def test_the_window_gives_room_in_turn_and_lets_a_large_request_through_alone():
    w = Window(10)
    await w.take(6, 1.0)
    assert not w.try_take(5)  # does not fit
    assert w.try_take(4)
    got = []

    async def want(n, name):
        await w.take(n, 5.0)
        got.append(name)

    async with trio.open_nursery() as n:
        n.start_soon(want, 25, "large")  # more than the window: once it is empty
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(want, 1, "small")  # would fit beside the 6 and 4, but waits its turn
        await trio.testing.wait_all_tasks_blocked()
        assert got == [] and not w.try_take(1)  # nobody jumps the line
        w.give(6)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        w.give(4)
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["large"] and w.used == 25  # alone in the window
        w.give(25)
    assert got == ["large", "small"]
    assert w.used == 1 and w.peak == 25


async def test_a_waiter_for_room_times_out_only_when_nothing_is_freed():
    w = Window(4)
    await w.take(4, 1.0)
    with pytest.raises(TimeoutError):
        await w.take(1, 0.05)
    w.close(PeerLost("gone"))
    with pytest.raises(PeerLost):
        await w.take(1, 5.0)


async def test_a_call_is_answered_while_the_node_is_stuck_serving_reads(nursery, monkeypatch):
    """Calls have a socket of their own: a heartbeat never waits for the node to get through
    the reads sent before it (a node serves one socket's frames in order)."""
    gate = _gate_reads(monkeypatch)
    region, conn = await _served(nursery)
    into = bytearray(MiB)
    async with trio.open_nursery() as n:
        n.start_soon(conn.read, region.rkey, 0, into)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(10):  # one socket: the call waited for the gate forever
            assert (await conn.call("echo", {"x": 1})) == {"echo": {"x": 1}}
        gate.set()
    assert bytes(into) == bytes(region.buf[:MiB])
