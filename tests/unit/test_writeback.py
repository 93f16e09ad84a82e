"""Write-behind of the mount: stripe-sized background writes, their order, their errors."""

import pytest
import trio

from irdmafs.fs.writeback import WriteBehind
from irdmafs.errors import RemoteError

UNIT = 16


class FakeClient:
    """Records the writes that reach 'the cluster'; a write may be slowed or made to fail."""

    def __init__(self):
        self.data = bytearray(256)
        self.writes: list[tuple[int, int]] = []
        self.slow: dict[int, float] = {}
        self.fail_at: int | None = None
        self.active = self.most_active = 0  # writes under way at once

    async def write(self, ino, offset, view, attr, *, extend):
        assert extend is False
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await trio.sleep(self.slow.get(offset, 0))
            if offset == self.fail_at:
                raise RemoteError("ENOSPC", "node full")
            self.data[offset : offset + len(view)] = bytes(view)  # a Gather of the writes' buffers
            self.writes.append((offset, len(view)))
        finally:
            self.active -= 1


def behind(client, slots=4):
    return WriteBehind(client, 7, {"unit": UNIT, "size": 0}, trio.Semaphore(slots))


async def test_writes_leave_as_whole_stripes_and_drain_sends_the_rest():
    c = FakeClient()
    w = behind(c)
    for off in range(0, 40, 8):  # five 8-byte writes: two whole stripes and a half
        await w.write(off, bytes([off]) * 8)
    await trio.sleep(0.01)
    assert sorted(c.writes) == [(0, 16), (16, 16)]  # the tail waits for more
    await w.drain()
    assert sorted(c.writes) == [(0, 16), (16, 16), (32, 8)]
    assert bytes(c.data[:40]) == b"".join(bytes([o]) * 8 for o in range(0, 40, 8))


async def test_an_overlapping_write_waits_for_the_one_in_flight():
    c = FakeClient()
    c.slow[0] = 0.2  # the first version of stripe 0 is slow to land
    w = behind(c)
    await w.write(0, b"a" * 16)
    await w.write(0, b"b" * 16)  # not contiguous with the run: the first is in flight
    await w.drain()
    assert c.writes == [(0, 16), (0, 16)] and bytes(c.data[:16]) == b"b" * 16


async def test_a_background_error_is_raised_by_later_calls_and_at_drain():
    c = FakeClient()
    c.fail_at = 16
    w = behind(c)
    await w.write(0, b"x" * 16)
    await w.write(16, b"x" * 16)
    with pytest.raises(RemoteError, match="ENOSPC|node full"):
        await w.drain()
    with pytest.raises(RemoteError):  # sticky: the file lost that write
        await w.write(32, b"y" * 4)
    assert (0, 16) in c.writes and all(off != 16 for off, _ in c.writes)


async def test_writes_in_flight_are_bounded_by_the_slots():
    c = FakeClient()
    for off in range(0, 128, 16):
        c.slow[off] = 0.05
    slots = trio.Semaphore(2)
    w = WriteBehind(c, 7, {"unit": UNIT}, slots)
    for off in range(0, 128, 16):  # eight stripes, each complete at once
        await w.write(off, b"z" * 16)
    await w.drain()
    assert c.most_active == 2 and len(c.writes) == 8


async def test_a_drain_waits_for_a_write_still_waiting_for_its_turn():
    """Two drains at once (two reads): the second must not return while the first's send waits
    for an overlapping earlier write, its bytes out of the run and not yet in the cluster."""
    c = FakeClient()
    c.slow[0] = 0.05
    w = behind(c)
    await w.write(0, b"a" * 8)
    await w.write(4, b"b" * 8)  # not contiguous: the first leaves; this one overlaps it
    order = []

    async def drain(name):
        await w.drain()
        order.append((name, bytes(c.data[:12])))

    async with trio.open_nursery() as n:
        n.start_soon(drain, "first")
        await trio.sleep(0)
        n.start_soon(drain, "second")
    assert order and all(data == b"aaaa" + b"b" * 8 for _, data in order), order
