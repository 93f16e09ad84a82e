"""Stripe read-ahead of the mount: whole stripes ahead of a sequential reader, small peeks as
asked, errors to the read that needs the bytes, concurrent reads."""

import pytest
import trio

from irdmafs.fs.readahead import AHEAD, ReadAhead
from irdmafs.errors import RemoteError

UNIT = 1024
STRIPES = AHEAD + 8  # more than a read-ahead's worth
DATA = bytes(range(256)) * 4 * STRIPES  # a stripe of UNIT bytes each


class FakeClient:
    def __init__(self):
        self.reads: list[tuple[int, int]] = []
        self.fail: set[int] = set()

    async def fetch(self, offset, into):
        self.reads.append((offset, len(into)))
        await trio.sleep(0.001)
        if offset in self.fail:
            raise RemoteError("EIO", "no live replica holds it")
        n = max(0, min(len(into), len(DATA) - offset))
        into[:n] = DATA[offset : offset + n]
        return n


ATTR = (len(DATA), UNIT)


async def test_a_sequential_reader_gets_whole_stripes_fetched_ahead():
    c = FakeClient()
    r = ReadAhead(c.fetch)
    got = b""
    for off in range(0, len(DATA), 512):
        got += bytes(await r.read(off, 512, *ATTR))
    assert got == DATA
    assert sorted(c.reads) == [(i * UNIT, UNIT) for i in range(STRIPES)]  # each stripe once, whole
    r2 = ReadAhead(c.fetch)
    c.reads.clear()
    await r2.read(0, 512, *ATTR)
    assert sorted(o for o, _ in c.reads) == [i * UNIT for i in range(AHEAD + 1)]


async def test_a_small_peek_elsewhere_is_fetched_as_asked_and_reads_past_the_end_are_empty():
    c = FakeClient()
    r = ReadAhead(c.fetch)
    assert bytes(await r.read(5000, 10, *ATTR)) == DATA[5000:5010]
    assert c.reads == [(5000, 10)]
    assert await r.read(len(DATA), 100, *ATTR) == b""
    assert bytes(await r.read(len(DATA) - 100, 4096, *ATTR)) == DATA[-100:]


async def test_an_error_reaches_the_read_that_needs_it_and_the_next_read_tries_again():
    c = FakeClient()
    c.fail = {2 * UNIT}
    r = ReadAhead(c.fetch)
    assert bytes(await r.read(0, UNIT, *ATTR)) == DATA[:UNIT]  # stripe 2 failed ahead: unseen
    assert bytes(await r.read(UNIT, UNIT, *ATTR)) == DATA[UNIT : 2 * UNIT]
    with pytest.raises(RemoteError):
        await r.read(2 * UNIT, UNIT, *ATTR)
    c.fail.clear()
    assert bytes(await r.read(2 * UNIT, UNIT, *ATTR)) == DATA[2 * UNIT : 3 * UNIT]


async def test_concurrent_reads_at_scattered_offsets_all_get_their_bytes():
    c = FakeClient()
    r = ReadAhead(c.fetch)
    out = {}

    async def one(off):
        out[off] = bytes(await r.read(off, 2 * UNIT, *ATTR))

    async with trio.open_nursery() as n:
        for off in (0, 2 * UNIT, 7 * UNIT, 2 * UNIT + 5, 9 * UNIT, UNIT // 2):
            n.start_soon(one, off)
    assert all(v == DATA[k : k + 2 * UNIT] for k, v in out.items())
