"""What a TCP connection says it waits on (``Connection.waits``): the line a heartbeat that went
unanswered logs (runtime/heartbeats.py). In the hour-long soak at a GB model a mount counted a serving
node down for one unanswered heartbeat while neither loop ran late, and nothing said what the
heartbeat had waited behind; the next soak's log must.

These test the Python data plane (tcp.py, the reference: engine="python"); the native engine's
answers to the same cases are in test_engine.py.
"""

import re

import trio

import irdmafs.transport.tcp as tcp

from .conftest import TOKEN


async def test_a_connection_says_what_it_waits_on_and_when_each_socket_last_answered(nursery):
    release, holding = trio.Event(), trio.Event()

    async def handler(method, args):
        if method == "hold":
            holding.set()
            await release.wait()
        return {"ok": method}

    server = tcp.TcpTransport(TOKEN, engine="python")
    host, port = await nursery.start(server.serve, "127.0.0.1", 0, handler)
    conn = await tcp.TcpTransport(TOKEN, engine="python").connect(host, port, nursery=nursery)
    assert conn.waits().startswith("0 requests unanswered")
    assert "calls: 0 frames (0 bytes) queued to send, last answer never" in conn.waits()

    held = trio.Event()

    async def hold():
        await conn.call("hold")
        held.set()

    nursery.start_soon(hold)
    await holding.wait()  # the held call is sent, and the node holds it
    assert conn.waits().startswith("1 requests unanswered")
    assert "calls: 0 frames (0 bytes) queued to send, last answer never" in conn.waits()

    assert await conn.call("echo") == {"ok": "echo"}  # answered past the held one
    said = conn.waits()
    assert said.startswith("1 requests unanswered")
    ago = float(re.search(r"calls: .*?last answer ([0-9.]+) s ago", said).group(1))
    assert ago < 60
    assert "data: 0 frames (0 bytes) queued to send, last answer never" in said
    release.set()
    await held.wait()
    assert conn.waits().startswith("0 requests unanswered")
