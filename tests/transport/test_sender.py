"""One writer per socket (transport/sender.py): frames queued by many tasks leave together, whole
and in order; a cancelled sender takes back what was not taken and drops the connection if it
was; a broken socket fails every sender (issue 41: a heartbeat queued behind 150 senders on a
lock waited 0.7 s and the mount counted working nodes down)."""

import re

import pytest
import trio
import trio.testing

from irdmafs.transport.sender import GROUP, Sender

PATIENCE = 0.2  # how long a cancelled sender waits for its group


class FakeSocket:
    def __init__(self):
        self.sent: list[bytes] = []  # one entry per sendmsg batch
        self.gate: trio.Event | None = None
        self.error: Exception | None = None

    async def sendv(self, sock, buffers, sent=None):
        if self.gate is not None:
            if sent is not None and not self.gate.is_set():
                sent[0] += 1  # a byte went out, then the link stalled
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        self.sent.append(b"".join(bytes(b) for b in buffers))


async def stalled(nursery) -> tuple[FakeSocket, list, Sender]:
    """A sender with its writer running, over a socket whose sends wait for ``sock.gate``; and
    the list its ``torn`` appends to."""
    sock, torn = FakeSocket(), []
    s = Sender(sock, sock.sendv, lambda: torn.append(1), PATIENCE)
    await nursery.start(s.run)
    sock.gate = trio.Event()
    return sock, torn, s


async def test_frames_of_many_senders_leave_in_one_batch_in_order(nursery):
    sock, torn, s = await stalled(nursery)
    async with trio.open_nursery() as n:
        n.start_soon(s.send, [b"first"])
        await trio.testing.wait_all_tasks_blocked()  # the writer holds "first", the link stalled
        for i in range(300):
            n.start_soon(s.send, [b"<%d:" % i, b"%d>" % i])  # one frame of two buffers
        await trio.testing.wait_all_tasks_blocked()
        sock.gate.set()
    assert sock.sent[0] == b"first"
    assert len(sock.sent) == 2  # 300 senders, one sendmsg batch (a lock took 300 turns)
    frames = re.findall(rb"<(\d+):(\d+)>", sock.sent[1])
    assert len(sock.sent[1]) == sum(len(b"<%d:%d>" % (i, i)) for i in range(300))
    assert all(a == b for a, b in frames)  # each frame whole, its buffers together
    assert sorted(int(a) for a, _ in frames) == list(range(300))  # in the order their tasks ran
    assert torn == []


async def test_a_sender_cancelled_before_its_frames_were_taken_sends_nothing(nursery):
    sock, torn, s = await stalled(nursery)
    async with trio.open_nursery() as n:
        n.start_soon(s.send, [b"A"])
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            scope.cancel()
            await s.send([b"never"])  # queued behind A's batch, cancelled before taken
        sock.gate.set()
    await s.send([b"B"])
    assert sock.sent == [b"A", b"B"] and torn == []


async def test_a_sender_cancelled_midway_drops_the_connection(nursery):
    sock, torn, s = await stalled(nursery)
    scope = trio.CancelScope()

    async def send():
        with scope:
            await s.send([b"stuck in the kernel"])

    async with trio.open_nursery() as n:
        n.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()  # taken by the writer, its send stalled
        assert torn == []
        scope.cancel()
    assert torn == [1]


async def test_a_broken_socket_fails_every_sender_and_every_later_one(nursery):
    sock, torn, s = await stalled(nursery)
    failed = []

    async def send(x):
        with pytest.raises(trio.BrokenResourceError):
            await s.send([x])
        failed.append(x)

    async with trio.open_nursery() as n:
        for x in (b"a", b"b", b"c"):
            n.start_soon(send, x)
        await trio.testing.wait_all_tasks_blocked()
        sock.error = BrokenPipeError(32, "Broken pipe")
        sock.gate.set()
    assert sorted(failed) == [b"a", b"b", b"c"] and torn == [1]
    with pytest.raises(trio.BrokenResourceError, match="Broken pipe"):
        await s.send([b"later"])


@pytest.mark.parametrize("stalls", [False, True])
async def test_a_sender_cancelled_while_its_group_goes_out_waits_for_it_or_drops_the_connection(nursery, stalls):
    """Its buffers must stay as they are until the kernel has them: it waits (shielded) for its
    group; only a group stalled past ``patience`` drops the connection."""
    sock, torn, s = await stalled(nursery)
    first = sock.gate
    scope = trio.CancelScope()
    ended = []

    async def queued():
        with scope:
            await s.send([b"B"])
        ended.append(scope.cancelled_caught)

    async with trio.open_nursery() as n:
        n.start_soon(s.send, [b"A"])  # sent by its caller: the link stalls
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(queued)  # queued for the writer
        await trio.testing.wait_all_tasks_blocked()
        sock.gate = trio.Event()  # the writer's group (B) stalls in turn
        first.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sock.sent == [b"A"] and torn == []
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert ended == []  # still waiting for its group, shielded
        if not stalls:
            sock.gate.set()
    assert ended == [True]  # cancelled all the same
    assert torn == ([1] if stalls else [])
    assert sock.sent == ([b"A"] if stalls else [b"A", b"B"])


async def test_the_writer_sends_in_groups_of_bounded_size(nursery):
    sock, _, s = await stalled(nursery)
    big = bytes(GROUP // 2 + 1)
    async with trio.open_nursery() as n:
        n.start_soon(s.send, [b"A"])
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(3):
            n.start_soon(s.send, [big])
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(s.send, [b"small"])
        await trio.testing.wait_all_tasks_blocked()
        sock.gate.set()
    assert [len(x) for x in sock.sent] == [1, len(big), len(big), len(big) + 5]  # two bigs never share a group
