"""A TCP connection's two sockets (transport/tcp.py): large WRITEs on one, everything else on the
other, so a read or a call never waits behind megabytes of pushes (issue 32: on a 500 Mbit/s
link a step's pulls waited a second behind its own pushes).

These test the Python data plane (tcp.py, the reference: engine="python"); the native engine's
answers to the same cases are in test_engine.py.
"""

import os

import pytest
import trio

import irdmafs.transport.tcp as tcp
from irdmafs.transport.base import Access
from irdmafs.errors import PeerLost

from .conftest import TOKEN, handler


@pytest.fixture
async def served(nursery):
    server = tcp.TcpTransport(TOKEN, engine="python")
    host, port = await nursery.start(server.serve, "127.0.0.1", 0, handler)
    region = server.alloc_region(8 << 20, Access.RW)
    conn = await tcp.TcpTransport(TOKEN, engine="python").connect(host, port, nursery=nursery)
    yield server, region, conn
    await conn.aclose()


async def test_reads_and_calls_go_on_while_a_large_write_is_stuck(served, monkeypatch):
    _, region, conn = served
    assert conn.bulk is not conn.sock
    stuck, real = trio.Event(), tcp._sendv

    async def sendv(sock, buffers, sent=None):
        if sock is conn.bulk:  # the bulk socket's link is full: its send does not finish
            await stuck.wait()
        await real(sock, buffers, sent)

    monkeypatch.setattr(tcp, "_sendv", sendv)
    data = os.urandom(4 << 20)
    done = []

    async def write():
        await conn.write(region.rkey, 0, data)
        done.append("write")

    async with trio.open_nursery() as n:
        n.start_soon(write)
        await trio.sleep(0.05)
        with trio.fail_after(5):  # one socket: both would wait for the write's bytes to leave
            assert (await conn.call("echo", {"x": 1})) == {"echo": {"x": 1}}
            small = bytearray(16)
            await conn.read(region.rkey, 0, small)
            await conn.write(region.rkey, 8 << 19, b"small writes go with the reads")
        assert not done
        stuck.set()
    assert done == ["write"]
    got = bytearray(len(data))
    await conn.read(region.rkey, 0, got)
    assert bytes(got) == data


async def test_a_write_lands_before_the_call_sent_after_its_answer(served):
    """What callers rely on across the two sockets: an operation sent once a WRITE has been
    answered sees the WRITE's bytes (a commit after its data)."""
    server, region, conn = served
    for k in range(20):
        data = os.urandom(tcp.BULK + k * 4096)
        await conn.write(region.rkey, 0, data)
        got = bytearray(len(data))
        await conn.read(region.rkey, 0, got)
        assert bytes(got) == data


async def test_either_socket_broken_fails_the_connection(served):
    _, region, conn = served
    conn.bulk.close()
    with pytest.raises(PeerLost):
        with trio.fail_after(5):
            await conn.write(region.rkey, 0, bytes(tcp.BULK))
    with pytest.raises(PeerLost):
        with trio.fail_after(5):
            await conn.call("echo", {})


async def test_an_answer_cut_off_midway_is_an_error_not_a_success(served, monkeypatch):
    """The connection breaks while a READ's bytes arrive: the read fails (PeerLost), never
    returns with part of the bytes."""
    _, region, conn = served
    real = tcp._recv_into

    async def recv_into(sock, view, **kw):
        if len(view) >= 1 << 20:  # the READ's payload: the peer vanishes in it
            raise trio.ClosedResourceError("cut off (test)")
        return await real(sock, view, **kw)

    monkeypatch.setattr(tcp, "_recv_into", recv_into)
    with pytest.raises(PeerLost):
        with trio.fail_after(5):
            await conn.read(region.rkey, 0, bytearray(2 << 20))


async def test_a_send_cancelled_midway_breaks_the_connection(served, monkeypatch):
    """Part of a frame went out and the sender was cancelled: the peer would read the next
    frame from the middle of this one, so the connection is dropped instead."""
    _, region, conn = served

    async def sendv(sock, buffers, sent=None):
        if sent is not None:
            sent[0] += 100  # some bytes left, then the link stalls
        await trio.sleep_forever()

    monkeypatch.setattr(tcp, "_sendv", sendv)
    with trio.move_on_after(0.1):
        await conn.write(region.rkey, 0, bytes(tcp.BULK))
    monkeypatch.undo()
    with pytest.raises(PeerLost):
        with trio.fail_after(5):
            await conn.call("echo", {})
