"""Spare stripe memory (server/spares.py): what a node keeps for its next copies on write.

Each test breaks one promise if the store breaks it: a dropped snapshot's memory is kept and
becomes the next copy on write's (no fresh allocation), never served again under its old key,
and every byte of it rewritten; spare memory is counted and never makes a write ENOSPC; idle
spares are released.
"""

import trio
import trio.testing

from irdmafs.runtime.offload import Offload
from irdmafs.server import spares as spares_mod
from irdmafs.server.budget import NoSpace
from irdmafs.server.spares import SPARE
from irdmafs.server.updates import StripeKey
from irdmafs.transport.base import Access
from irdmafs.errors import AccessError

from .test_snapshot_cow import UNIT, filled, remote_read

import pytest


class Allocs:
    """Counts the store's fresh regions."""

    def __init__(self, monkeypatch, s):
        self.n = 0
        real = s.transport.alloc_region

        def counted(*args, **kw):
            self.n += 1
            return real(*args, **kw)

        monkeypatch.setattr(s.transport, "alloc_region", counted)


async def _reaping(s, nursery):
    nursery.start_soon(s.behind.reap, Offload())
    await trio.testing.wait_all_tasks_blocked()
    assert s.behind.reaping


async def _kept(nursery):
    """A reaping store whose dropped snapshot left 4 stripes' copies kept."""
    s = filled()
    await _reaping(s, nursery)
    s.take_snapshot(1)
    for i in range(4):
        s.install(StripeKey(1, i), 0, memoryview(b"x"), UNIT)
    s.drop_snapshot(1)
    return s


async def test_a_dropped_snapshots_memory_becomes_the_next_copy_on_write(nursery, monkeypatch):
    s = filled()
    await _reaping(s, nursery)
    s.take_snapshot(1)
    for i in range(4):
        s.install(StripeKey(1, i), 0, memoryview(b"one!"), UNIT)  # snapshot 1 holds 4 copies alone
    old_keys = [s.get(1, i, 1).region.rkey for i in range(4)]
    s.drop_snapshot(1)
    assert s.spares.held == 4 * UNIT == s.budget.held[SPARE] and not s.behind.dying, "kept, not released"
    for rkey in old_keys:  # never served again under the key readers were told
        with pytest.raises(AccessError):
            s.transport.regions.check(rkey, 0, 8, Access.READ)
    allocs = Allocs(monkeypatch, s)
    s.take_snapshot(2)
    for i in range(4):
        s.install(StripeKey(1, i), 0, memoryview(b"two!"), UNIT)
    assert allocs.n == 0 and s.spares.taken == 4 and s.spares.held == 0, "the copies took the kept memory"
    for i in range(4):  # each copy is the stripe as snapshot 2 froze it, whole: nothing of snapshot 1's
        assert remote_read(s, 1, i, 2, 4) == b"one!" and remote_read(s, 1, i, 0, 4) == b"two!"
        assert bytes(s.get(1, i, 2).data[:UNIT]) == b"one!" + bytes([65 + i]) * (UNIT - 4)
        assert s.get(1, i, 2).version == s.get(1, i, 0).version - 1, "the header is the frozen one's too"
    assert s.budget.held[SPARE] == 0 and s.snapshot_bytes == 4 * UNIT


async def test_spare_memory_never_makes_a_write_enospc(nursery):
    s = filled(n_stripes=4, capacity=8 * UNIT)
    s.spares.limit = 8 * UNIT
    await _reaping(s, nursery)
    s.take_snapshot(1)
    for i in range(4):
        s.install(StripeKey(1, i), 0, memoryview(b"x"), UNIT)  # 4 live + 4 frozen: the node is full
    s.drop_snapshot(1)
    assert s.spares.held == 4 * UNIT
    for i in range(4, 8):  # new stripes (zeroed memory, not spares): the spares make room
        s.install(StripeKey(2, i), 0, memoryview(b"y"), UNIT)
    assert s.spares.held == 0 and s.budget.held[SPARE] == 0 and s.used == 8 * UNIT
    with pytest.raises(NoSpace):  # and full is still full
        s.install(StripeKey(3, 0), 0, memoryview(b"z"), UNIT)


async def test_spares_last_while_in_use_on_the_real_clock(nursery):
    """Kept memory is not idle the moment it is kept (trio's clock starts anywhere)."""
    s = await _kept(nursery)
    assert s.spares.held == 4 * UNIT and not s.spares.idle(), "kept just now: not idle"


async def test_a_live_stripes_memory_is_never_kept(nursery):
    """A change being replicated may still read a freed live stripe's memory: not reused."""
    s = filled()
    await _reaping(s, nursery)
    s.drop(1)
    assert s.spares.held == 0 and s.budget.held[SPARE] == 0 and len(s.behind.dying) == 4


async def test_idle_spares_are_released(nursery, autojump_clock):
    s = await _kept(nursery)
    assert s.spares.held == 4 * UNIT
    await trio.sleep(spares_mod.IDLE + 5)
    assert s.spares.held == 0 and s.budget.held[SPARE] == 0
    with trio.fail_after(30):
        while s.behind.dying:  # handed to the reaper's thread
            await trio.sleep(0.01)
