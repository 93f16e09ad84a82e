"""The transport contract, run over every implementation (memory, tcp, verbs where a device is)."""

import logging
import os

import pytest
import trio

from irdmafs.errors import AccessError, AuthError, PeerLost, RemoteError, TimeoutError

from .conftest import ENGINE_REASON, TOKEN


async def test_write_then_read_round_trip(served, nursery):
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    data = os.urandom(3 << 20)
    await conn.write(served.rw.rkey, 12345, data)
    assert bytes(served.rw.buf[12345 : 12345 + len(data)]) == data  # one-sided: landed in the region
    back = bytearray(len(data))
    await conn.read(served.rw.rkey, 12345, back)
    assert back == data
    await conn.aclose()


async def test_read_only_region_is_readable_not_writable(served, nursery):
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    out = bytearray(4096)
    await conn.read(served.ro.rkey, 4096, out)
    assert out == bytes(served.ro.buf[4096:8192])
    before = bytes(served.ro.buf)
    with pytest.raises(AccessError):
        await conn.write(served.ro.rkey, 0, b"x" * 100)
    assert bytes(served.ro.buf) == before
    # the connection and server keep serving after a refusal
    await conn.read(served.ro.rkey, 0, out)
    assert out == before[:4096]


async def test_an_alias_is_the_same_memory_under_a_key_of_its_own(served, nursery):
    """``alias_region``: a second registration of a region's memory (a snapshot shares a live
    stripe this way). Both keys read the same bytes; freeing one refuses it alone; the memory
    lives while either key does."""
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    region = served.server.alloc_region(1 << 20, served.ro.access)
    region.buf[:] = os.urandom(len(region.buf))
    alias = served.server.alias_region(region)
    assert alias.rkey != region.rkey and alias.length == region.length
    out = bytearray(4096)
    await conn.read(alias.rkey, 8192, out)
    assert out == bytes(region.buf[8192 : 8192 + 4096])
    region.buf[8192:8196] = b"live"  # one memory: a change through either is seen through both
    await conn.read(alias.rkey, 8192, out)
    assert out[:4] == b"live"
    served.server.free_region(alias)
    with pytest.raises(AccessError):
        await conn.read(alias.rkey, 0, out)
    await conn.read(region.rkey, 8192, out)  # the other key reads on
    assert out[:4] == b"live"
    second = served.server.alias_region(region)
    served.server.free_region(region)  # the first key goes first: the memory stays for the alias
    with pytest.raises(AccessError):
        await conn.read(region.rkey, 0, out)
    await conn.read(second.rkey, 8192, out)
    assert out[:4] == b"live"
    served.server.free_region(second)
    await conn.aclose()


async def test_scatter_gather(served, nursery):
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    parts = [os.urandom(n) for n in (1, 4096, 100_000)]
    await conn.write(served.rw.rkey, 7, parts)
    assert bytes(served.rw.buf[7 : 7 + sum(map(len, parts))]) == b"".join(parts)
    outs = [bytearray(len(p)) for p in reversed(parts)]
    await conn.read(served.rw.rkey, 7, outs)
    assert b"".join(outs) == b"".join(parts)


async def test_many_operations_in_flight(served, nursery):
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    chunk = 64 << 10
    blobs = [os.urandom(chunk) for _ in range(64)]
    async with trio.open_nursery() as n:
        for i, blob in enumerate(blobs):
            n.start_soon(conn.write, served.rw.rkey, i * chunk, blob)
    results = [bytearray(chunk) for _ in blobs]
    async with trio.open_nursery() as n:
        for i, out in enumerate(results):
            n.start_soon(conn.read, served.rw.rkey, i * chunk, out)
        n.start_soon(conn.call, "echo", {"during": "io"})
    assert results == blobs


async def test_read_many_keeps_order(served, nursery):
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    served.rw.buf[:16] = bytes(range(16))
    a, b = bytearray(4), bytearray(8)
    await conn.read_many([(served.rw.rkey, 0, a), (served.rw.rkey, 8, b)])
    assert a == bytes(range(4)) and b == bytes(range(8, 16))


@pytest.mark.parametrize(
    "rkey_of, offset, length",
    [
        (lambda s: 999_999, 0, 10),  # unknown rkey
        (lambda s: s.rw.rkey, (8 << 20) - 5, 10),  # runs past the end
        (lambda s: s.rw.rkey, 8 << 20, 1),  # starts at the end
    ],
    ids=["bad-rkey", "past-end", "at-end"],
)
async def test_out_of_bounds_is_refused_and_server_goes_on(served, nursery, rkey_of, offset, length, caplog):
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    before = bytes(served.rw.buf[-64:])
    with pytest.raises(AccessError):
        await conn.read(rkey_of(served), offset, bytearray(length))
    with pytest.raises(AccessError):
        await conn.write(rkey_of(served), offset, b"z" * length)
    assert bytes(served.rw.buf[-64:]) == before
    assert (await conn.call("echo", {"still": "serving"}))["echo"] == {"still": "serving"}


async def test_control_calls_and_their_errors(served, nursery):
    conn = await served.client().connect(served.host, served.port, nursery=nursery)
    assert await conn.call("echo", {"a": [1, 2], "b": "x"}) == {"echo": {"a": [1, 2], "b": "x"}}
    with pytest.raises(RemoteError) as err:
        await conn.call("fail", {"code": "EEXIST"})
    assert err.value.code == "EEXIST"
    with pytest.raises(RemoteError) as err:
        await conn.call("crash")
    assert err.value.code == "EIO" and "ZeroDivisionError" in str(err.value)
    with pytest.raises(TimeoutError):
        await conn.call("slow", {"seconds": 5}, timeout=0.2)
    assert (await conn.call("echo", {}))["echo"] == {}


async def test_wrong_token_is_refused_before_any_data(served, nursery, caplog):
    caplog.set_level(logging.WARNING)
    with pytest.raises(AuthError, match="refused our cluster token"):
        await served.client(b"not-the-token").connect(served.host, served.port, nursery=nursery)
    await trio.sleep(0.05)
    assert any("wrong cluster token" in r.getMessage() for r in caplog.records)


async def test_peer_that_vanishes_gives_peer_lost(served, nursery):
    # A second server in its own nursery, which we then cancel: the peer disappears.
    server = type(served.server)(TOKEN) if served.kind != "verbs" else served.client()
    region = server.alloc_region(4096, 3)
    async with trio.open_nursery() as inner:
        host, port = await inner.start(server.serve, "127.0.0.1", 0, handlerless)
        conn = await served.client().connect(host, port, nursery=nursery)
        await conn.read(region.rkey, 0, bytearray(16))
        inner.cancel_scope.cancel()
    with pytest.raises(PeerLost):
        with trio.fail_after(5):
            while True:  # the close reaches the client asynchronously
                await conn.read(region.rkey, 0, bytearray(16))
                await trio.sleep(0.01)


async def handlerless(method, args):
    raise RemoteError("ENOSYS", method)


async def test_write_with_immediate_notifies_after_the_data_landed(nursery):
    """WRITE_IMM over each transport that serves notifications (memory, tcp, shm)."""
    from irdmafs.transport.memory import MemoryTransport
    from irdmafs.transport.shm import ShmTransport
    from irdmafs.transport.tcp import TcpTransport

    for kind in (MemoryTransport, TcpTransport, ShmTransport):
        server = kind(TOKEN)
        region = server.alloc_region(4096, 3)
        seen = []

        async def on_imm(r, offset, length, imm):
            seen.append((r.rkey, offset, length, imm, bytes(r.buf[offset : offset + length])))
            if imm == 0:
                raise RemoteError("EINVAL", "imm 0 refused")
            return {"sum": sum(r.buf[offset : offset + length])}

        host, port = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, handlerless, on_imm=on_imm, task_status=task_status))
        conn = await kind(TOKEN).connect(host, port, nursery=nursery)
        assert await conn.write_imm(region.rkey, 10, [b"\x01\x02", b"\x03"], 77) == {"sum": 6}
        assert seen == [(region.rkey, 10, 3, 77, b"\x01\x02\x03")]
        with pytest.raises(RemoteError):
            await conn.write_imm(region.rkey, 0, b"x", 0)
        with pytest.raises(AccessError):
            await conn.write_imm(region.rkey, 4095, b"xy", 1)


@pytest.mark.parametrize("engine", ["python", pytest.param("native", marks=pytest.mark.skipif(bool(ENGINE_REASON), reason=f"no engine: {ENGINE_REASON}"))])
async def test_a_notification_whose_region_was_freed_after_its_data_landed_is_staging_gone(nursery, monkeypatch, engine):
    """TCP lands a WRITE_IMM's data, then runs its notification as a task of its own: a region
    freed in between (a client's staging slot given up) reached the handler as None, and the
    push failed EINVAL "notification without a descriptor" to the user (chaos --model-gib 2).
    It is "unknown rkey" (runtime/slots.py ``staging_gone``: the sender takes a new slot and sends
    again), and the handler never runs. The native engine lands the data in its thread and the
    notification reaches Python as an event: the region is freed before that event is taken."""
    from irdmafs.runtime.slots import staging_gone
    from irdmafs.transport import engine as E
    from irdmafs.transport import tcp

    server = tcp.TcpTransport(TOKEN, engine=engine)
    region = server.alloc_region(4096, 3)
    seen = []

    async def on_imm(r, offset, length, imm):
        seen.append(r)
        return {}

    if engine == "python":
        land = tcp._Responder.land

        async def land_then_free(self, h):
            landed = await land(self, h)
            server.free_region(region)  # released before the notification's task runs
            return landed

        monkeypatch.setattr(tcp._Responder, "land", land_then_free)
    else:
        dispatch = E.Engine._dispatch

        def free_then_dispatch(self, ev):
            if ev[0] == E.EV_CALL and ev[2] == 6:  # the WRITE_IMM's notification, its data landed
                server.free_region(region)
            dispatch(self, ev)

        monkeypatch.setattr(E.Engine, "_dispatch", free_then_dispatch)
    host, port = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, handlerless, on_imm=on_imm, task_status=task_status))
    conn = await tcp.TcpTransport(TOKEN, engine=engine).connect(host, port, nursery=nursery)
    with pytest.raises(RemoteError) as caught:
        await conn.write_imm(region.rkey, 0, b"descriptor", 5)
    assert staging_gone(caught.value) and seen == []
    await conn.aclose()
