"""The native engine (transport/engine.py, native/engine/) against the invariants it must keep
by construction (docs/engine.md): a region never freed under an operation in flight, a caller's
buffer never written after its call returned, a peer that stops reading costs only its own
connection, one connection's READs served in order (the seqlock read stays untorn while an
install runs beside the engine's thread), keys never drawn twice, completions in batches.

The socket faults the fault simulator cannot reach (it runs over the in-memory transport): a
connection cut mid-frame, a peer that stalls mid-payload, a region freed under a READ. Each case
waits for the event it checks; ``fail_after`` only bounds a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import struct

import numpy as np
import pytest
import trio
import trio.testing

from irdmafs.errors import AccessError, PeerLost, TimeoutError
from irdmafs.transport import engine as E
from irdmafs.transport import protocol as P
from irdmafs.transport import tcp
from irdmafs.transport.base import Access, KeyStream

from .conftest import ENGINE_REASON, TOKEN, handler

pytestmark = pytest.mark.skipif(bool(ENGINE_REASON), reason=f"the native engine is not built here: {ENGINE_REASON}")

MiB = 1 << 20
HANG = 60  # seconds after which a case that waits for an event has hung


async def _server(nursery, engine="native", **kw):
    server = tcp.TcpTransport(TOKEN, engine=engine, **kw)
    host, port = await nursery.start(server.serve, "127.0.0.1", 0, handler)
    return server, host, port


async def _raw(host, port):
    """An authenticated socket to the node with nothing behind it: the test sends its frames."""
    sock, _ = await tcp.TcpTransport(TOKEN, engine="python")._open(host, port)
    return sock


async def _until(predicate):
    with trio.fail_after(HANG):
        while not predicate():
            await trio.sleep(0.005)


async def test_a_region_freed_under_a_read_keeps_its_memory_until_the_read_is_sent(nursery):
    server, host, port = await _server(nursery)
    region = server.alloc_region(32 * MiB, Access.READ)
    data = os.urandom(32 * MiB)
    region.buf[:] = data
    rkey = region.rkey
    sock = await _raw(host, port)
    await tcp._sendv(sock, [P.pack(P.Header(P.Op.READ, req_id=1, rkey=rkey, length=32 * MiB))])
    await _until(lambda: server.native.stats()["read"][0] == 1)  # queued, and the peer reads nothing yet
    server.free_region(region)
    assert server.native.stats()["pinned"] == 1  # held by the READ in flight
    del region  # the Python side lets go too: only the engine's hold keeps the memory
    hdr = await tcp._recv_bytes(sock, P.HEADER.size)
    h = P.unpack(hdr)
    assert (h.status, h.length) == (P.Status.OK, 32 * MiB)
    got = await tcp._recv_bytes(sock, 32 * MiB)
    assert got == data  # the memory lived until its last byte was sent
    await _until(lambda: server.native.settled(rkey))
    assert server.native.stats()["pinned"] == 0
    # and the key is refused from now on, on the same connection
    await tcp._sendv(sock, [P.pack(P.Header(P.Op.READ, req_id=2, rkey=rkey, length=16))])
    h = P.unpack(await tcp._recv_bytes(sock, P.HEADER.size))
    assert h.status == P.Status.ACCESS
    assert b"unknown rkey" in await tcp._recv_bytes(sock, h.length)
    sock.close()


async def test_a_peer_that_stops_reading_costs_only_its_own_connection(nursery):
    server, host, port = await _server(nursery)
    region = server.alloc_region(64 * MiB, Access.READ)
    region.buf[:] = os.urandom(len(region.buf))
    stalled = await _raw(host, port)
    asks = [P.pack(P.Header(P.Op.READ, req_id=i + 1, rkey=region.rkey, offset=(i % 64) * MiB, length=MiB)) for i in range(256)]
    await tcp._sendv(stalled, asks)  # 256 MiB asked for, none of it read
    await _until(lambda: server.native.stats()["read"][0] >= 8)  # the engine is serving it (and is stuck on it)
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    out = bytearray(8 * MiB)
    with trio.fail_after(HANG):
        await conn.read(region.rkey, 3 * MiB, out)
        assert (await conn.call("echo", {"x": 1}))["echo"] == {"x": 1}
    assert out == bytes(region.buf[3 * MiB : 11 * MiB])
    # the stalled peer's READs stopped at the connection's output bound (OUT_LIMIT, 8 MiB, plus
    # what the kernel's buffers hold): the engine did not queue the other 200 MiB it asked for
    assert server.native.stats()["read"][0] - 8 < 64
    stalled.close()
    await conn.aclose()


async def test_a_write_cut_off_mid_payload_closes_that_connection_only(nursery, caplog):
    caplog.set_level(logging.INFO)
    server, host, port = await _server(nursery)
    region = server.alloc_region(4 * MiB, Access.RW)
    sock = await _raw(host, port)
    await tcp._sendv(sock, [P.pack(P.Header(P.Op.WRITE, req_id=1, rkey=region.rkey, length=2 * MiB)), b"x" * MiB])
    sock.close()  # half the payload, then gone (close delivers what was sent, then the FIN)
    await _until(lambda: any("closed mid-frame" in r.getMessage() for r in caplog.records))
    # the half that came landed (the engine reads a socket to its end before it sees the FIN; it
    # may wait for more than half a payload first, under SO_RCVLOWAT, so the test waits for the close)
    assert bytes(region.buf[:MiB]) == b"x" * MiB and bytes(region.buf[MiB : 2 * MiB]) == bytes(MiB)
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    await conn.write(region.rkey, 0, b"after")
    assert bytes(region.buf[:5]) == b"after"
    await conn.aclose()


async def test_a_garbage_frame_after_the_handshake_closes_that_connection_with_a_log_line(nursery, caplog):
    caplog.set_level(logging.WARNING)
    server, host, port = await _server(nursery)
    region = server.alloc_region(MiB, Access.RW)
    good = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    bad = await _raw(host, port)
    await tcp._sendv(bad, [b"GARBAGE!" * 5])
    with trio.fail_after(HANG):
        assert await bad.recv(1) == b""  # closed by the node
    await _until(lambda: any("protocol error" in r.getMessage() and "bad magic" in r.getMessage() for r in caplog.records))
    await good.write(region.rkey, 0, b"still")  # another connection, and the region, unharmed
    assert bytes(region.buf[:5]) == b"still"
    await good.aclose()


def _gate_reads(monkeypatch):
    """A Python node whose READ answers wait for ``gate``; ``halfway`` makes it send the header
    and half the data first."""
    gate, started = trio.Event(), trio.Event()
    state = {"halfway": False}

    async def held_read(self, h):
        view = self.regions.check(h.rkey, h.offset, h.length, Access.READ)
        started.set()
        resp = P.pack(h._replace(opcode=h.opcode | P.RESPONSE, status=P.Status.OK, length=h.length))
        if state["halfway"]:
            await self.sender.send([resp, view[: h.length // 2]])
            await gate.wait()
            await self.sender.send([view[h.length // 2 :]])
        else:
            await gate.wait()
            await self.sender.send([resp, view])

    monkeypatch.setattr(tcp._Responder, "on_read", held_read)
    return gate, started, state


async def test_a_stripe_freed_under_a_read_is_not_a_new_stripe_until_the_read_is_sent(nursery):
    """The store keeps a freed stripe's memory for the next stripe (server/spares.py), but not
    while the engine may still send a READ's bytes from it: the READ gets the old bytes, the
    new stripe fresh memory, and the kept memory is used again once the engine let it go."""
    from irdmafs.regions import HEADER
    from irdmafs.runtime.offload import Offload
    from irdmafs.server.store import Store
    from irdmafs.server.updates import StripeKey

    server, host, port = await _server(nursery)
    store = Store(server, 256 * MiB)
    nursery.start_soon(store.behind.reap, Offload())
    await trio.testing.wait_all_tasks_blocked()
    unit = 32 * MiB
    old = os.urandom(unit)
    store.install(StripeKey(1, 0), 0, memoryview(old), unit)
    rkey = store.get(1, 0).region.rkey
    sock = await _raw(host, port)
    await tcp._sendv(sock, [P.pack(P.Header(P.Op.READ, req_id=1, rkey=rkey, offset=HEADER, length=unit))])
    await _until(lambda: server.native.stats()["read"][0] == 1)  # queued, and the peer reads nothing yet
    store.drop(1)
    assert not server.native.settled(rkey) and store.spares.held == unit
    store.install(StripeKey(2, 0), 0, memoryview(b"n" * unit), unit)
    assert store.spares.taken == 0 and store.spares.waited == 1, "fresh memory while the READ may still send"
    h = P.unpack(await tcp._recv_bytes(sock, P.HEADER.size))
    assert (h.status, h.length) == (P.Status.OK, unit)
    assert await tcp._recv_bytes(sock, unit) == old, "the READ sent the bytes it was answered from"
    await _until(lambda: server.native.settled(rkey))
    store.install(StripeKey(3, 0), 0, memoryview(b"m" * unit), unit)
    assert store.spares.taken == 1, "used again once the engine let it go"
    sock.close()


async def test_a_read_given_up_before_its_answer_leaves_its_buffer_alone(nursery, monkeypatch):
    gate, started, _ = _gate_reads(monkeypatch)
    server, host, port = await _server(nursery, engine="python")
    region = server.alloc_region(MiB, Access.RW)
    region.buf[:] = b"\xab" * MiB
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    out = bytearray(MiB)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as n:
            n.start_soon(conn.read, region.rkey, 0, out)
            await started.wait()
            scope.cancel()
    assert scope.cancelled_caught
    gate.set()  # the answer comes now: drained by the engine, never landed
    conn2 = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    probe = bytearray(16)
    await conn.read(region.rkey, 0, probe)  # the same connection goes on, after the drained answer
    assert probe == b"\xab" * 16
    assert out == bytes(MiB)  # never written
    await conn.aclose()
    await conn2.aclose()


async def test_a_peer_that_stalls_mid_payload_times_out_and_never_writes_the_buffer_after(nursery, monkeypatch):
    gate, started, state = _gate_reads(monkeypatch)
    state["halfway"] = True
    server, host, port = await _server(nursery, engine="python")
    region = server.alloc_region(8 * MiB, Access.RW)
    region.buf[:] = b"\xcd" * len(region.buf)
    conn = await tcp.TcpTransport(TOKEN, op_timeout=0.5).connect(host, port, nursery=nursery)
    out = bytearray(8 * MiB)
    with pytest.raises((TimeoutError, PeerLost)):
        await conn.read(region.rkey, 0, out)
    await _until(lambda: conn.lost is not None)  # given up while its bytes were arriving: closed
    snapshot = bytes(out)
    came = len(snapshot.rstrip(b"\0"))  # what of the half sent had landed (the rest sat in the kernel)
    assert came <= 4 * MiB and snapshot[:came] == b"\xcd" * came
    gate.set()  # the node sends the rest now: it must land nowhere
    await trio.sleep(0)
    with pytest.raises(PeerLost):
        await conn.read(region.rkey, 0, bytearray(4))
    assert bytes(out) == snapshot


async def test_either_socket_broken_fails_the_connection(nursery):
    server, host, port = await _server(nursery)
    region = server.alloc_region(MiB, Access.RW)
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    assert isinstance(conn, E.NativeConnection)
    conn.engine.native.close(conn.bulk)
    await _until(lambda: conn.lost is not None)
    with pytest.raises(PeerLost):
        await conn.call("echo", {})
    with pytest.raises(PeerLost):
        await conn.read(region.rkey, 0, bytearray(4))


async def test_reads_and_calls_go_on_while_a_large_write_is_stuck(nursery, monkeypatch):
    stuck, landing = trio.Event(), trio.Event()
    land = tcp._Responder.land

    async def slow_land(self, h):
        if h.length >= MiB:
            landing.set()
            await stuck.wait()
        return await land(self, h)

    monkeypatch.setattr(tcp._Responder, "land", slow_land)
    server, host, port = await _server(nursery, engine="python")
    region = server.alloc_region(64 * MiB, Access.RW)
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    big = os.urandom(48 * MiB)
    async with trio.open_nursery() as n:
        n.start_soon(conn.write, region.rkey, 0, big)
        await landing.wait()
        with trio.fail_after(HANG):
            out = bytearray(16)
            await conn.read(region.rkey, 60 * MiB, out)
            await conn.call("echo", {})
        stuck.set()
    assert bytes(region.buf[: len(big)]) == big


async def test_reads_of_a_stripe_stay_untorn_while_installs_run_beside_the_engine(nursery):
    """The seqlock read (regions.py): header, data, header in one burst, served in order by the
    engine's thread while the node's loop installs (version odd, data, version even). Every read
    whose two headers agree on an even version holds that version's bytes, never a mix."""
    server, host, port = await _server(nursery)
    size = 4 * MiB
    region = server.alloc_region(16 + size, Access.READ)
    data = np.frombuffer(region.buf, dtype=np.uint8, offset=16)
    word = region.buf[:8].cast("Q")
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    version = 0

    def install():
        nonlocal version
        word[0] = 2 * version + 1
        data.fill(version & 0xFF)  # numpy: a pass over the stripe with the GIL released
        word[0] = 2 * (version + 1)
        version += 1

    async def installs_during(k):
        for _ in range(k):  # while the engine's thread is sending the burst
            await trio.sleep(0)
            install()

    install()  # version 1 holds bytes 0
    whole = mixed = 0
    for i in range(120):
        h1, body, h2 = bytearray(8), bytearray(size), bytearray(8)
        async with trio.open_nursery() as n:
            n.start_soon(installs_during, i % 3)  # none, one or two installs beside the read
            await conn.read_many([(region.rkey, 0, h1), (region.rkey, 16, body), (region.rkey, 0, h2)])
        v1, v2 = struct.unpack("<Q", h1)[0], struct.unpack("<Q", h2)[0]
        if v1 == v2 and v1 % 2 == 0:
            whole += 1
            expect = (v1 // 2 - 1) & 0xFF
            assert body == bytes([expect]) * size, f"a read of version {v1 // 2} held other bytes"
        else:
            mixed += 1
    assert whole >= 40  # every read with no install beside it, at least, was checked whole
    assert version >= 100


async def test_completions_reach_trio_many_per_wake_up(nursery):
    server, host, port = await _server(nursery)
    region = server.alloc_region(MiB, Access.READ)
    region.buf[:] = os.urandom(MiB)
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    engine = conn.engine
    outs = [bytearray(64) for _ in range(1000)]
    before_wakeups, before_events = engine.wakeups, engine.events
    await conn.read_many([(region.rkey, i * 64, out) for i, out in enumerate(outs)])
    assert b"".join(outs) == bytes(region.buf[: 64 * 1000])
    wakeups, events = engine.wakeups - before_wakeups, engine.events - before_events
    assert events >= 1000 and wakeups * 4 <= events, (wakeups, events)


def test_region_keys_are_never_drawn_twice_and_never_zero():
    keys = KeyStream()
    drawn = [keys.next() for _ in range(100_000)]
    assert len({k for k, _ in drawn}) == len(drawn) and all(k for k, _ in drawn)
    assert [g for _, g in drawn][:3] == [0, 1, 2] or drawn[0][1] >= 0
    sample = [keys.permute(n) for n in range(1 << 16)]
    assert len(set(sample)) == 1 << 16  # a permutation: distinct inputs, distinct keys


async def test_a_freed_key_is_never_handed_out_again(nursery):
    server, host, port = await _server(nursery)
    seen = set()
    for _ in range(2000):
        region = server.alloc_region(64, Access.READ)
        assert region.rkey not in seen
        seen.add(region.rkey)
        server.free_region(region)
    assert server.native.stats()["regions"] == 0


async def test_the_engine_refuses_what_the_python_table_refuses(nursery):
    """The engine's table is the Python table's mirror: same keys, same bounds and access."""
    server, host, port = await _server(nursery)
    ro = server.alloc_region(4096, Access.READ)
    wo = server.alloc_region(4096, Access.WRITE)
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    for rkey, offset, n, op in [(ro.rkey, 0, 8, "write"), (wo.rkey, 0, 8, "read"), (ro.rkey, 4090, 8, "read"), (ro.rkey, 2**63, 8, "read")]:
        with pytest.raises(AccessError):
            if op == "read":
                await conn.read(rkey, offset, bytearray(n))
            else:
                await conn.write(rkey, offset, b"x" * n)
        with pytest.raises(AccessError):
            server.regions.check(rkey, offset, n, Access.READ if op == "read" else Access.WRITE)
    await conn.write(wo.rkey, 4088, b"12345678")
    assert bytes(wo.buf[4088:]) == b"12345678"


async def test_an_answer_larger_than_a_control_document_closes_the_connection(nursery, monkeypatch, caplog):
    """frame.c lets an OK WRITE answer claim up to 1 GiB of payload; the calling side takes at
    most a control document (16 MiB) for anything but a READ's data: a hostile node cannot make
    a client allocate a GiB."""
    caplog.set_level(logging.WARNING)

    async def huge_answer(self, h):
        await tcp._drain(self.sock, h.length)
        resp = h._replace(opcode=h.opcode | P.RESPONSE, status=P.Status.OK, length=P.MAX_CONTROL + 1)
        await self.sender.send([P.pack(resp)])

    monkeypatch.setattr(tcp._Responder, "on_write", huge_answer)
    server, host, port = await _server(nursery, engine="python")
    region = server.alloc_region(MiB, Access.RW)
    conn = await tcp.TcpTransport(TOKEN).connect(host, port, nursery=nursery)
    with pytest.raises(PeerLost):
        await conn.write(region.rkey, 0, b"x" * 16)
    await _until(lambda: conn.lost is not None)
    assert "protocol error" in str(conn.lost)


def test_a_forked_child_never_touches_its_parents_engine():
    """multiprocessing forks processes that hold transports (tests, the ranks of a job): the
    I/O thread stays in the parent, and a child that collected an engine joined a thread it does
    not have (a segfault in the quick suite). The child is refused every use and leaves it."""
    import multiprocessing as mp

    transport = tcp.TcpTransport(TOKEN, engine="native")
    transport.alloc_region(4096, Access.RW)

    def child(out):
        try:
            transport.alloc_region(64, Access.RW)
            out.send("used")
        except Exception as exc:  # noqa: BLE001
            out.send(type(exc).__name__)
        transport.native.native.stop()
        try:  # stopped in the child, still its parent's: no lock of the parent's thread taken
            transport.free_region(next(iter(transport.regions._regions.values())))
            out.send("freed")
        except Exception as exc:  # noqa: BLE001
            out.send(type(exc).__name__)
        import gc

        gc.collect()
        out.send("done")

    a, b = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=child, args=(b,))
    p.start()
    assert [a.recv(), a.recv(), a.recv()] == ["EngineError", "EngineError", "done"]
    p.join(30)
    assert p.exitcode == 0
    assert transport.native.stats()["regions"] == 1  # the parent's engine goes on


def test_each_adopted_connection_gets_its_own_id_even_when_closed_at_once():
    """A peer whose garbage is waiting before the handover is served, closed and freed by the
    I/O thread at once: adopt's answer must not read the connection after handing it over (it
    once returned a freed conn's first word as the id, so the node never saw that connection
    end; test_tcp_bad_input failed in CI). Every id is the next one, and each one closes."""
    import select
    import time

    engine = E.Engine()
    n = 10000
    ids = []
    try:
        for _ in range(n):
            mine, peer = socket.socketpair()
            peer.sendall(b"GARBAGE!" * 5)
            peer.close()
            ids.append(engine.native.adopt(mine.detach(), True, False))
        closed = {}
        end = time.monotonic() + HANG
        while len(closed) < n and time.monotonic() < end:
            select.select([engine.native.fileno()], [], [], 1.0)
            for ev in engine.native.poll():
                if ev[0] == E.EV_CLOSED:
                    closed[ev[1]] = ev[2]
    finally:
        engine.native.stop()
    assert ids == list(range(ids[0], ids[0] + n))
    assert sorted(closed) == ids
    assert all(why.startswith("protocol error") for why in closed.values()), set(closed.values())


# -- the budget of call documents, and probes, on the engine itself (no Python data plane) ------
DOC = 14 << 20  # five of them pass the engine's budget of call documents (64 MiB)


def _tcp_pair():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    peer = socket.create_connection(listener.getsockname())
    mine, _ = listener.accept()
    listener.close()
    return mine, peer


def _call(req_id, doc, imm=0):
    return P.pack(P.Header(P.Op.CALL, req_id=req_id, imm=imm, length=len(doc))) + doc


def _wait(predicate, what):
    import time

    end = time.monotonic() + HANG
    while not predicate():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.005)


def _events(engine, kinds, want, got=None):
    """Poll until ``want(got)`` holds, collecting the events of ``kinds``."""
    import select
    import time

    got = [] if got is None else got
    end = time.monotonic() + HANG
    while not want(got):
        assert time.monotonic() < end, f"events so far: {[e[:2] for e in got]}"
        select.select([engine.fileno()], [], [], 0.5)
        got.extend(ev for ev in engine.poll() if ev[0] in kinds)
    return got


def _sender(sock, data):
    import threading

    t = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    t.start()
    return t


def test_documents_past_the_budget_together_are_each_read_to_their_end():
    """Five documents begun at once claim 70 MiB; a document begun is read to its end, so
    each reaches Python (the engine once stopped reading all of them halfway, for good)."""
    engine = E.Engine().native
    pairs = [_tcp_pair() for _ in range(5)]
    try:
        conns = [engine.adopt(mine.detach(), True, False) for mine, _ in pairs]
        docs = [bytes([65 + i]) * DOC for i in range(5)]
        for i, (_, peer) in enumerate(pairs):
            peer.sendall(_call(i + 1, docs[i])[: 40 + 1000])
        _wait(lambda: engine.stats()["buffered"] == 5 * DOC, "all five headers taken")
        senders = [_sender(peer, _call(i + 1, docs[i])[40 + 1000 :]) for i, (_, peer) in enumerate(pairs)]
        got = _events(engine, (E.EV_CALL, E.EV_CLOSED), lambda g: len(g) == 5)
        assert sorted((ev[1], ev[3], ev[-1] == docs[ev[3] - 1]) for ev in got) == [(c, i + 1, True) for i, c in enumerate(conns)]
        for t in senders:
            t.join(HANG)
    finally:
        engine.stop()
        for mine, peer in pairs:
            peer.close()


def test_an_idle_connection_stays_open_when_the_budget_was_passed():
    """A connection serviced while the budget is passed wants no events (nothing to send, no
    frame to begin); the engine once took that for "never registered", added it again, got
    EEXIST and closed it."""
    engine = E.Engine().native
    (a, a_peer), (b, b_peer) = _tcp_pair(), _tcp_pair()
    try:
        ca, cb = engine.adopt(a.detach(), True, False), engine.adopt(b.detach(), True, False)
        sender = _sender(b_peer, b"".join(_call(i + 1, b"x" * DOC) for i in range(5)))
        _wait(lambda: engine.stats()["buffered"] == 5 * DOC, "B's documents past the budget")
        answer = P.pack(P.Header(P.Op.CALL | P.RESPONSE, req_id=7, length=2)) + b"{}"
        engine.send(ca, answer)  # A serviced now, paused, with nothing left to send
        assert _recv_all(a_peer, len(answer)) == answer
        got = _events(engine, (E.EV_CALL, E.EV_CLOSED), lambda g: sum(ev[0] == E.EV_CALL for ev in g) == 5)  # taken: A looked at again
        a_peer.sendall(_call(8, b'{"m":"echo","a":{}}'))
        _events(engine, (E.EV_CALL, E.EV_CLOSED), lambda g: any(ev[1] == ca for ev in g), got)
        assert [ev[0] for ev in got if ev[1] == ca] == [E.EV_CALL] and all(ev[1] == cb for ev in got[:5])
        sender.join(HANG)
    finally:
        engine.stop()
        a_peer.close()
        b_peer.close()


def test_a_connection_closed_mid_document_lets_the_paused_ones_read_again():
    """A connection that ends halfway through a document gives its share of the budget back;
    the connections waiting on the budget must be looked at again then, not at Python's next
    poll (which may never come: nothing is left for it)."""
    engine = E.Engine().native
    (a, a_peer), (c, c_peer), (d, d_peer) = _tcp_pair(), _tcp_pair(), _tcp_pair()
    try:
        ca, cc, cd = (engine.adopt(s.detach(), True, False) for s in (a, c, d))
        sender = _sender(d_peer, b"".join(_call(i + 1, b"d" * DOC) for i in range(4)))
        _wait(lambda: engine.stats()["buffered"] == 4 * DOC, "D's four documents begun")
        c_peer.sendall(_call(1, b"c" * DOC)[: 40 + 1000])
        _wait(lambda: engine.stats()["buffered"] == 5 * DOC, "C's document begun: the budget passed")
        a_peer.sendall(_call(9, b'{"m":"echo","a":{}}'))  # a whole frame, not begun while paused
        sender.join(HANG)
        assert engine.conn_info(ca)[3] == -1.0  # not read: the budget is passed
        c_peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c_peer.close()  # a reset halfway through C's document
        _wait(lambda: engine.conn_info(ca)[3] >= 0.0, "A's frame read once C's share came back")
        got = _events(engine, (E.EV_CALL, E.EV_CLOSED), lambda g: any(ev[0] == E.EV_CALL and ev[1] == ca for ev in g))
        assert any(ev[0] == E.EV_CLOSED and ev[1] == cc for ev in got) or engine.conn_info(cc) is None
        assert engine.conn_info(cd) is not None  # D goes on
    finally:
        engine.stop()
        a_peer.close()
        d_peer.close()


def test_a_probe_is_answered_from_the_published_status_ahead_of_queued_answers():
    """A probe's answer goes ahead of every answer not yet begun (one half sent stays whole and
    first); its document reaches Python after it; a withdrawn status sends probes to Python."""
    engine = E.Engine().native
    mine, peer = _tcp_pair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    try:
        conn = engine.adopt(mine.detach(), True, False)
        engine.publish_status(b'{"state":"ready"}', 60.0)
        frames = [P.pack(P.Header(P.Op.READ | P.RESPONSE, req_id=i, length=1 << 20)) + bytes([i]) * (1 << 20) for i in (1, 2, 3)]
        for f in frames:
            engine.send(conn, f)
        probe_doc = b'{"m":"heartbeat","a":{"owner":"m1"}}'
        peer.sendall(_call(77, probe_doc, imm=P.CALL_PROBE))
        _wait(lambda: engine.stats()["probes"] == 1, "the probe answered")
        order = []
        for _ in range(4):
            h = P.unpack(_recv_all(peer, 40))
            body = _recv_all(peer, h.length)
            order.append(h.req_id)
            if h.req_id == 77:
                assert body == b'{"state":"ready"}' and h.status == P.Status.OK and h.imm == 0
            else:
                assert body == bytes([h.req_id]) * (1 << 20)  # whole, never cut by the probe's answer
        assert order in ([1, 77, 2, 3], [77, 1, 2, 3]), order
        got = _events(engine, (E.EV_PROBED, E.EV_CALL), lambda g: len(g) == 1)
        assert got == [(E.EV_PROBED, conn, probe_doc)]
        engine.publish_status(b'{"state":"ready"}', 0.0)  # withdrawn: Python answers
        peer.sendall(_call(78, probe_doc, imm=P.CALL_PROBE))
        got = _events(engine, (E.EV_PROBED, E.EV_CALL), lambda g: len(g) == 1)
        assert got[0][0] == E.EV_CALL and got[0][3] == 78 and got[0][-1] == probe_doc
        assert engine.stats()["probes"] == 1
    finally:
        engine.stop()
        peer.close()


def _recv_all(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, f"closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)
