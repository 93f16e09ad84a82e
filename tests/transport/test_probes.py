"""Liveness probes answered ahead of queued work (transport/probes.py, docs/design.md P2).

The serving side runs its own trio loop on a thread of its own, so the test can hold that loop
(a call whose handler blocks it, as a busy node's work does) while the client, on the test's
loop, probes it over real loopback sockets. Every wait is for an event; ``fail_after`` only
bounds a hang.
"""

from __future__ import annotations

import json
import logging
import threading
from functools import partial

import pytest
import trio

from irdmafs.transport import protocol as P
from irdmafs.transport.probes import StatusBoard
from irdmafs.transport.shm import ShmTransport
from irdmafs.transport.tcp import TcpTransport

from .conftest import ENGINE_REASON, TOKEN
from .test_tcp_bad_input import _recv_exactly as _recv, raw_session

HANG = 60
needs_engine = pytest.mark.skipif(bool(ENGINE_REASON), reason=f"the native engine is not built here: {ENGINE_REASON}")
ENGINES = [pytest.param("tcp-native", marks=needs_engine), "tcp-python", pytest.param("shm-native", marks=needs_engine), "shm-python"]


class Node:
    """A serving transport with a status board, on a thread running its own trio loop.

    ``hold`` blocks that whole loop (not a task: the loop) until ``release`` is set, and sets
    ``holding`` first; ``heartbeat`` is the ordinary handler, counted."""

    def __init__(self, kind: str, valid_for: float) -> None:
        family, engine = kind.split("-")
        self.transport = (TcpTransport if family == "tcp" else ShmTransport)(TOKEN, engine=engine)
        self.valid_for = valid_for
        self.holding, self.release = threading.Event(), threading.Event()
        self.ordinary = 0  # heartbeats that reached the handler
        self.heard: list[tuple[str, dict]] = []
        self.heard_event = threading.Event()
        self.address: tuple[str, int] | None = None
        self.ready = threading.Event()
        self._stop: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    def _heard(self, method: str, args: dict) -> None:
        self.heard.append((method, args))
        self.heard_event.set()

    async def handler(self, method: str, args: dict) -> dict:
        if method == "hold":
            self.holding.set()
            self.release.wait(HANG)  # the loop itself is held, as by a busy node's work
            return {"held": True}
        if method == "heartbeat":
            self.ordinary += 1
            return {"state": "checked now"}
        return {"echo": args}

    async def _main(self) -> None:
        self.board = StatusBoard(self._heard)
        self.board.publish({"state": "ready", "from": "board"}, self.valid_for)
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._stop:
            async with trio.open_nursery() as nursery:
                serve = partial(self.transport.serve, "127.0.0.1", 0, self.handler, board=self.board)
                self.address = await nursery.start(lambda task_status: serve(task_status=task_status))
                self.ready.set()

    def start(self) -> "Node":
        self.thread.start()
        assert self.ready.wait(HANG)
        return self

    async def run(self, fn, *args):
        """``fn(*args)`` on the node's loop, its result back (the board is the loop's alone)."""
        return await trio.to_thread.run_sync(lambda: trio.from_thread.run_sync(fn, *args, trio_token=self._token))

    def stop(self) -> None:
        self.release.set()
        if self._token is not None:
            try:
                trio.from_thread.run_sync(self._stop.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self.thread.join(HANG)


@pytest.fixture
def node_factory():
    made = []

    def make(kind, valid_for=60.0):
        made.append(Node(kind, valid_for).start())
        return made[-1]

    yield make
    for n in made:
        n.stop()


def _client(kind):
    family, engine = kind.split("-")
    return (TcpTransport if family == "tcp" else ShmTransport)(TOKEN, engine=engine)


async def _hold(conn, node, nursery):
    """A call that holds the node's loop, begun; returns once the node is holding."""
    done = trio.Event()

    async def call():
        assert await conn.call("hold", {}) == {"held": True}
        done.set()

    nursery.start_soon(call)
    assert await trio.to_thread.run_sync(node.holding.wait, HANG)
    return done


@pytest.mark.parametrize("kind", [pytest.param("tcp-native", marks=needs_engine), pytest.param("shm-native", marks=needs_engine)])
async def test_the_engine_answers_a_probe_while_the_nodes_loop_is_held(node_factory, kind, nursery):
    node = node_factory(kind)
    conn = await _client(kind).connect(*node.address, nursery=nursery)
    held = await _hold(conn, node, nursery)
    # queued behind the hold: calls the node's loop will take only once it runs again
    queued = [trio.Event() for _ in range(20)]

    async def echo(i):
        assert await conn.call("echo", {"i": i}) == {"echo": {"i": i}}
        queued[i].set()

    for i in range(20):
        nursery.start_soon(echo, i)
    with trio.fail_after(HANG):
        status = await conn.call("heartbeat", {"from": "test", "owner": "m1"}, probe=True)
    assert status == {"state": "ready", "from": "board"}
    assert not held.is_set() and not any(e.is_set() for e in queued)  # the loop never ran for it
    node.release.set()
    with trio.fail_after(HANG):
        await held.wait()
        for e in queued:
            await e.wait()
    assert await trio.to_thread.run_sync(node.heard_event.wait, HANG)
    assert node.heard == [("heartbeat", {"from": "test", "owner": "m1"})]  # heard after, as sent
    assert node.ordinary == 0


@pytest.mark.parametrize("kind", ["tcp-python", "shm-python"])
async def test_the_python_reader_answers_a_probe_without_a_task_or_the_handler(node_factory, kind, nursery):
    node = node_factory(kind)
    conn = await _client(kind).connect(*node.address, nursery=nursery)
    held = await _hold(conn, node, nursery)
    got = []

    async def probe():
        got.append(await conn.call("heartbeat", {"from": "test"}, probe=True))

    nursery.start_soon(probe)
    node.release.set()  # the Python data plane needs the loop: it reads the probe once it runs
    with trio.fail_after(HANG):
        await held.wait()
        while not got:
            await trio.sleep(0.01)
    assert got == [{"state": "ready", "from": "board"}]
    assert await trio.to_thread.run_sync(node.heard_event.wait, HANG)
    assert node.ordinary == 0 and await node.run(lambda: node.board.answered) == 1


@pytest.mark.parametrize("kind", ENGINES)
async def test_a_probe_without_a_valid_copy_is_the_heartbeat_call(node_factory, kind, nursery):
    node = node_factory(kind, valid_for=0.0)  # published, but valid for no time at all
    conn = await _client(kind).connect(*node.address, nursery=nursery)
    assert await conn.call("heartbeat", {}, probe=True) == {"state": "checked now"}
    await node.run(node.board.publish, {"state": "ready", "from": "board"}, 60.0)
    assert await conn.call("heartbeat", {}, probe=True) == {"state": "ready", "from": "board"}
    await node.run(node.board.withdraw)
    assert await conn.call("heartbeat", {}, probe=True) == {"state": "checked now"}
    assert await conn.call("heartbeat", {}) == {"state": "checked now"}  # no flag: the call, always
    assert node.ordinary == 3


@pytest.mark.parametrize("junk", [b"{not json", b"[" * 100_000, b'{"m":"heartbeat","a":[]}'], ids=["not-json", "nested-past-the-parser", "wrong-types"])
@pytest.mark.parametrize("kind", ENGINES)
async def test_a_malformed_probe_is_answered_and_its_document_dropped_with_a_log_line(node_factory, kind, junk, caplog, nursery):
    caplog.set_level(logging.WARNING, logger="irdmafs.transport.probes")
    node = node_factory(kind)

    def attempt():
        s, h, _ = raw_session(node.address[1])
        assert h.status == P.Status.OK
        s.sendall(P.pack(P.Header(P.Op.CALL, req_id=9, status=7, imm=P.CALL_PROBE, length=len(junk))) + junk)
        head = P.unpack(_recv(s, 40))
        body = _recv(s, head.length)
        s.close()
        return head, body

    head, body = await trio.to_thread.run_sync(attempt)
    assert head.req_id == 9 and head.status == P.Status.OK and head.opcode == P.Op.CALL | P.RESPONSE
    assert json.loads(body) == {"state": "ready", "from": "board"}
    with trio.fail_after(HANG):
        while not any("a probe's document dropped" in r.getMessage() for r in caplog.records):
            await trio.sleep(0.01)
    assert node.heard == [] and node.ordinary == 0
    conn = await _client(kind).connect(*node.address, nursery=nursery)
    assert await conn.call("echo", {"x": 1}) == {"echo": {"x": 1}}  # the node goes on serving

