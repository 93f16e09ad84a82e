"""A live TCP node fed bad frames over a raw socket: each gets its answer, the node goes on."""

import logging
import socket

import pytest
import trio

from irdmafs.transport import protocol as P
from irdmafs.transport.base import Access, client_proof, new_nonce
from irdmafs.transport.tcp import TcpTransport

from .conftest import TOKEN, handler


def _recv_exactly(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return buf
        buf += chunk
    return buf


def raw_session(port, token=TOKEN):
    """A blocking socket that has passed the handshake (the test plays the client by hand)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    h = P.unpack(_recv_exactly(s, 40))
    snonce = _recv_exactly(s, h.length)
    cnonce = new_nonce()
    s.sendall(P.pack(P.Header(P.Op.AUTH, length=64)) + cnonce + client_proof(token, snonce, cnonce))
    h = P.unpack(_recv_exactly(s, 40))
    payload = _recv_exactly(s, h.length)
    return s, h, payload


def answer(s):
    h = P.unpack(_recv_exactly(s, 40))
    return h, _recv_exactly(s, P.payload_size(h))


@pytest.fixture
async def node(nursery):
    t = TcpTransport(TOKEN)
    region = t.alloc_region(1 << 16, Access.RW)
    host, port = await nursery.start(t.serve, "127.0.0.1", 0, handler)
    return t, region, port


async def still_serves(t, port, nursery):
    conn = await t.connect("127.0.0.1", port, nursery=nursery)
    assert (await conn.call("echo", {"ok": 1}))["echo"] == {"ok": 1}


async def test_wrong_token_gets_clear_refusal_and_no_data(node, nursery, caplog):
    t, region, port = node

    def attempt():
        s, h, payload = raw_session(port, token=b"wrong")
        # after the refusal the server closes: nothing else (no rkey, no data) ever comes
        rest = s.recv(100)
        s.close()
        return h, payload, rest

    h, payload, rest = await trio.to_thread.run_sync(attempt)
    assert h.status == P.Status.AUTH and b"wrong cluster token" in payload and rest == b""
    await still_serves(t, port, nursery)


async def test_unknown_opcode_is_answered_and_the_connection_goes_on(node, nursery):
    t, region, port = node

    def attempt():
        s, h, _ = raw_session(port)
        assert h.status == P.Status.OK
        s.sendall(P.pack(P.Header(0x3F, req_id=7, length=5)) + b"hello")
        bad = answer(s)
        s.sendall(P.pack(P.Header(P.Op.READ, req_id=8, rkey=region.rkey, length=4)))
        good = answer(s)
        s.close()
        return bad, good

    region.buf[:4] = b"abcd"
    (bad, msg), (good, data) = await trio.to_thread.run_sync(attempt)
    assert bad.status == P.Status.BAD_REQUEST and bad.req_id == 7 and b"unknown opcode" in msg
    assert good.status == P.Status.OK and data == b"abcd"


@pytest.mark.parametrize(
    "frame",
    [
        b"GARBAGE!" * 5,  # bad magic
        P.pack(P.Header(P.Op.CALL, length=P.MAX_CONTROL + 1)),  # oversized
        P.pack(P.Header(P.Op.WRITE, length=100))[:17],  # truncated header, then the peer vanishes
        P.pack(P.Header(P.Op.WRITE, rkey=1, length=100)) + b"x" * 10,  # truncated payload
    ],
    ids=["garbage", "oversized", "truncated-header", "truncated-payload"],
)
async def test_broken_frames_close_that_connection_only(node, nursery, frame, caplog):
    caplog.set_level(logging.INFO)
    t, region, port = node
    region.buf[:] = b"\0" * len(region.buf)

    def attempt():
        s, _, _ = raw_session(port)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        rest = s.recv(1000)  # the server ends this connection
        s.close()
        return rest

    await trio.to_thread.run_sync(attempt)
    await still_serves(t, port, nursery)
    # the truncated WRITE landed at most its own 10 bytes inside the region, nowhere else
    assert bytes(region.buf[10:]) == b"\0" * (len(region.buf) - 10)
    with trio.fail_after(30):  # the node logs once it has seen the connection end (the engine: an event)
        while not any(r.name == "irdmafs.transport.tcp" for r in caplog.records):
            await trio.sleep(0.01)


async def test_peer_vanishing_mid_request_fails_pending_ops(nursery):
    """A server that accepts, authenticates, then dies with requests in flight."""
    from irdmafs.errors import PeerLost

    t = TcpTransport(TOKEN)
    async with trio.open_nursery() as inner:
        host, port = await inner.start(t.serve, "127.0.0.1", 0, handler)
        conn = await t.connect(host, port, nursery=nursery)
        results = []

        async def slow():
            try:
                await conn.call("slow", {"seconds": 10})
            except PeerLost as exc:
                results.append(exc)

        nursery.start_soon(slow)
        await trio.sleep(0.1)
        inner.cancel_scope.cancel()
    with trio.fail_after(5):
        while not results:
            await trio.sleep(0.01)
    assert isinstance(results[0], PeerLost)


@pytest.mark.parametrize("method", ["echo", "fail", "crash"])
async def test_a_caller_gone_before_its_answers_ends_only_those_answers(node, method):
    """Calls whose caller closed the connection before their answers went out: the first
    answer provokes a reset, the next ones fail with EPIPE. That must end the connection, not
    the node. Found by scripts/chaos.py: a node resumed from SIGSTOP found a mount's calls
    queued behind the mount's close, answered the first with EAGAIN (it had just fenced), and
    the broken pipe of the second error answer killed the node."""
    _, _, port = node
    s, _, _ = await trio.to_thread.run_sync(raw_session, port)
    body = P.encode_call(method, {})
    s.sendall(b"".join(P.pack(P.Header(P.Op.CALL, req_id=i, length=len(body))) + body for i in range(1, 9)))
    s.close()  # before the node has read any of them: it reads the calls, then the end
    await trio.sleep(0.5)
    s2, _, _ = await trio.to_thread.run_sync(raw_session, port)  # the node still serves
    body = P.encode_call("echo", {"x": 1})
    s2.sendall(P.pack(P.Header(P.Op.CALL, req_id=99, length=len(body))) + body)
    h, payload = await trio.to_thread.run_sync(answer, s2)
    assert h.req_id == 99 and h.status == P.Status.OK
    s2.close()
