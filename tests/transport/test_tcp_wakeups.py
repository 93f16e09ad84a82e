"""How the TCP transport receives a large payload (tcp.py ``_recv_into``, ``_wake_at``): the
kernel wakes the reader once the payload's bytes have come (``SO_RCVLOWAT``), not for every few
packets, over real loopback sockets; and no wait hangs on bytes that will not come: a payload
larger than the receive buffer, a peer that closes mid-payload, a small frame after a large one."""

from __future__ import annotations

import socket

import pytest
import trio

from irdmafs.transport import tcp
from irdmafs.errors import PeerLost


class Counted:
    """A trio socket whose ``recv_into`` calls are counted (the reader's wake-ups, at most)."""

    def __init__(self, sock):
        self.sock, self.recvs = sock, 0

    async def recv_into(self, view):
        self.recvs += 1
        return await self.sock.recv_into(view)

    def setsockopt(self, *args):
        return self.sock.setsockopt(*args)


async def pair(rcvbuf: int | None = None):
    """A connected pair of trio TCP sockets on loopback: (sender, receiver)."""
    lst = trio.socket.socket()
    await lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    out = trio.socket.socket()
    if rcvbuf is not None:
        out.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await out.connect(lst.getsockname())
    inc, _ = await lst.accept()
    lst.close()
    if rcvbuf is not None:
        inc.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return out, inc


async def trickle(sock, data: bytes, pieces: int, then_close: bool = False) -> None:
    """Send ``data`` in ``pieces`` sends with a pause between: a payload arriving over a slow link."""
    step = len(data) // pieces
    for i in range(0, len(data), step):
        await sock.send(data[i : i + step])
        await trio.sleep(0.002)
    if then_close:
        sock.close()


async def test_a_payload_trickling_in_wakes_its_reader_a_few_times_not_once_a_piece():
    out, inc = await pair()
    data = bytes(range(256)) * (2 << 12)  # 2 MiB
    got = bytearray(len(data))
    counted = Counted(inc)
    async with trio.open_nursery() as n:
        n.start_soon(trickle, out, data, 64)
        await tcp._recv_into(counted, memoryview(got))
    assert got == data
    # 64 pieces 2 ms apart: woken at every piece, the reader would call recv_into about 64 times
    assert counted.recvs <= 4, counted.recvs
    # and a small frame right after is woken at its first byte, not held for a large one
    async with trio.open_nursery() as n:
        n.start_soon(out.send, b"x" * 40)
        small = bytearray(40)
        with trio.fail_after(30):
            await tcp._recv_into(counted, memoryview(small))
    assert small == b"x" * 40
    assert inc.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    out.close()
    inc.close()


async def test_a_payload_larger_than_the_receive_buffer_is_received_whole():
    """The wake-up mark is capped by the kernel (half the buffer) and a full window wakes the
    reader anyway: a payload four times the buffer never waits for bytes that cannot fit."""
    out, inc = await pair(rcvbuf=64 << 10)
    data = b"\x5a" * (tcp.LOWAT_MAX + (1 << 20))
    got = bytearray(len(data))
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(tcp._sendv, out, [data])
            await tcp._recv_into(inc, memoryview(got))
    assert got == data
    out.close()
    inc.close()


async def test_a_peer_closing_mid_payload_is_peer_lost_at_once():
    out, inc = await pair()
    got = bytearray(4 << 20)
    with trio.fail_after(30):  # EOF wakes a reader whatever its mark
        async with trio.open_nursery() as n:
            n.start_soon(trickle, out, b"\x01" * (1 << 20), 8, True)
            with pytest.raises(PeerLost, match="mid-frame"):
                await tcp._recv_into(inc, memoryview(got))
    inc.close()
