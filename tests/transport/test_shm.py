"""What the same-host transport adds to the shared contract: copies with no serving CPU, the
kernel refusing writable mappings of read-only regions, freed keys, the token on the Unix
socket, and falling back to TCP where no shared memory is offered."""

import mmap
import os
import socket

import pytest
import trio

from irdmafs.transport.base import Access, client_proof
from irdmafs.errors import AccessError, PeerLost
from irdmafs.transport.shm import ShmConnection, ShmTransport, WELCOME
from irdmafs.transport.engine import NativeConnection
from irdmafs.transport.tcp import TcpConnection, TcpTransport

TOKEN = b"shm-test-token"


async def echo(method, args):
    return {"echo": args}


async def start(nursery, kind=ShmTransport):
    server = kind(TOKEN)
    host, port = await nursery.start(server.serve, "127.0.0.1", 0, echo)
    return server, host, port


async def test_same_host_connection_copies_without_the_server(nursery):
    server, host, port = await start(nursery)
    region = server.alloc_region(1 << 20, Access.RW)
    conn = await ShmTransport(TOKEN).connect(host, port, nursery=nursery)
    assert isinstance(conn, ShmConnection)
    data = os.urandom(300_000)
    await conn.write(region.rkey, 1000, data)
    assert bytes(region.buf[1000 : 1000 + len(data)]) == data
    region.buf[0:4] = b"abcd"  # the server's own store is seen by the peer at once
    out = bytearray(4)
    await conn.read(region.rkey, 0, out)
    assert out == b"abcd"
    assert server.served == {}  # no responder served a byte of it
    assert (await conn.call("echo", {"x": 1})) == {"echo": {"x": 1}}


async def test_a_read_only_region_cannot_be_mapped_writable_anywhere(nursery):
    server, host, port = await start(nursery)
    region = server.alloc_region(8192, Access.READ)
    fd = server._fds[region.rkey]
    with pytest.raises(PermissionError):  # the kernel's seal, not our check
        mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    conn = await ShmTransport(TOKEN).connect(host, port, nursery=nursery)
    with pytest.raises(AccessError):
        await conn.write(region.rkey, 0, b"x")
    region.buf[:5] = b"hello"  # the owner still writes through its own mapping
    out = bytearray(5)
    await conn.read(region.rkey, 0, out)
    assert out == b"hello"


async def test_a_freed_key_is_refused_and_its_slot_reuse_does_not_leak(nursery):
    server, host, port = await start(nursery)
    old = server.alloc_region(4096, Access.RW)
    conn = await ShmTransport(TOKEN).connect(host, port, nursery=nursery)
    await conn.write(old.rkey, 0, b"old!")
    server.free_region(old)
    new = server.alloc_region(4096, Access.RW)  # takes the freed slot
    with pytest.raises(AccessError):
        await conn.write(old.rkey, 0, b"bad!")
    with pytest.raises(AccessError):
        await conn.read(old.rkey, 0, bytearray(4))
    assert bytes(new.buf[:4]) == b"\0\0\0\0"
    await conn.write(new.rkey, 0, b"new!")
    assert bytes(new.buf[:4]) == b"new!"


async def test_a_wrong_token_gets_no_descriptor(nursery):
    server, host, port = await start(nursery)
    s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with s, trio.fail_after(5):
        await s.connect("\0" + server.socket_name)
        nonce = await s.recv(32)
        cnonce = os.urandom(32)
        await s.send(cnonce + client_proof(b"not-the-token", nonce, cnonce))
        data, anc, _, _ = await s.recvmsg(WELCOME.size, socket.CMSG_SPACE(16))
        assert data[0] == 1 and anc == []  # refused, and nothing attached
        assert await s.recv(16) == b""  # and the connection is closed


async def test_a_plain_tcp_server_gets_a_tcp_connection(nursery):
    server, host, port = await start(nursery, TcpTransport)
    region = server.alloc_region(4096, Access.RW)
    conn = await ShmTransport(TOKEN).connect(host, port, nursery=nursery)
    assert isinstance(conn, (TcpConnection, NativeConnection))  # the socket transport, on either data plane
    await conn.write(region.rkey, 0, b"tcp")
    assert bytes(region.buf[:3]) == b"tcp"


async def test_a_node_that_dies_gives_peer_lost_though_its_memory_is_mapped(nursery):
    server = ShmTransport(TOKEN)
    region = server.alloc_region(4096, Access.RW)
    async with trio.open_nursery() as inner:
        host, port = await inner.start(server.serve, "127.0.0.1", 0, echo)
        conn = await ShmTransport(TOKEN).connect(host, port, nursery=nursery)
        await conn.read(region.rkey, 0, bytearray(8))
        inner.cancel_scope.cancel()
    with pytest.raises(PeerLost):
        with trio.fail_after(5):
            while True:
                await conn.read(region.rkey, 0, bytearray(8))
                await trio.sleep(0.01)


async def test_a_cancelled_read_leaves_the_next_one_its_own_region(nursery):
    """A caller cancelled while its region is being asked for must not leave the answer to the
    next asker (it would get another region's memory)."""
    server, host, port = await start(nursery)
    a = server.alloc_region(4096, Access.RW)
    b = server.alloc_region(4096, Access.RW)
    a.buf[:4], b.buf[:4] = b"aaaa", b"bbbb"
    conn = await ShmTransport(TOKEN).connect(host, port, nursery=nursery)
    for delay in range(5):  # cancel at different points of the first ask
        async with trio.open_nursery() as n:
            n.start_soon(conn.read, a.rkey, 0, bytearray(4))
            for _ in range(delay):
                await trio.lowlevel.checkpoint()
            n.cancel_scope.cancel()
        out = bytearray(4)
        await conn.read(b.rkey, 0, out)
        assert out == b"bbbb"
        await conn.write(b.rkey, 0, b"BBBB")
        assert bytes(a.buf[:4]) == b"aaaa" and bytes(b.buf[:4]) == b"BBBB"
        b.buf[:4] = b"bbbb"
        conn._maps.clear()  # ask again next round
