"""Spare stripe memory (server/spares.py): what a node keeps for its next copies on write.

Each test breaks one promise if the store breaks it: a dropped snapshot's memory, or a freed
live stripe's, is kept and becomes the next copy on write's or new stripe's (no fresh
allocation), never served again under its old key, every byte of it rewritten or zeroed; memory
a replication reads (a pin) or an operation in flight may still move is not used again until
they end; spare memory is counted and never makes a write ENOSPC; idle spares are released.
"""

import numpy as np
import trio
import trio.testing

from irdmafs.runtime.offload import Offload
from irdmafs.server import spares as spares_mod
from irdmafs.server.budget import NoSpace
from irdmafs.server.spares import SPARE
from irdmafs.regions import PENDING
from irdmafs.server.store import pinned
from irdmafs.server.updates import StripeKey
from irdmafs.transport.base import Access
from irdmafs.errors import AccessError

from .test_push_ids import bed  # noqa: F401  (the fixture)
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


async def test_a_freed_live_stripes_memory_becomes_a_new_stripe_that_reads_zeros_where_unwritten(nursery, monkeypatch):
    """An unlinked file's stripes (a rotated checkpoint) hold the next file's: the old keys are
    refused, and the new stripe reads its own bytes and zeros, header included (a hole)."""
    s = filled()
    await _reaping(s, nursery)
    for i in range(4):  # a clock published and a step pending in their headers
        s.install(StripeKey(1, i), 0, memoryview(b"AAAA"), UNIT, clock=7 | PENDING)
    old_keys = [s.get(1, i).region.rkey for i in range(4)]
    s.drop(1)
    assert s.spares.held == 4 * UNIT == s.budget.held[SPARE] and not s.behind.dying, "kept, not released"
    for rkey in old_keys:
        with pytest.raises(AccessError):
            s.transport.regions.check(rkey, 0, 8, Access.READ)
    allocs = Allocs(monkeypatch, s)
    for i in range(4):  # a full stripe's capacity, its last 10 bytes written
        s.install(StripeKey(2, i), UNIT - 10, memoryview(b"0123456789"), UNIT)
    assert allocs.n == 0 and s.spares.taken == 4 and s.spares.held == 0, "the new stripes took the kept memory"
    for i in range(4):
        st = s.get(2, i)
        assert bytes(st.data) == bytes(UNIT - 10) + b"0123456789", "nothing of the unlinked file's bytes"
        assert st.clock == 0 and not st.pending and st.version == 1
    assert s.used == 4 * UNIT and s.budget.held[SPARE] == 0


async def test_a_stripe_grown_onto_kept_memory_keeps_its_bytes_and_reads_zeros_past_them(nursery, monkeypatch):
    s = filled(n_stripes=1)
    await _reaping(s, nursery)
    s.drop(1)  # one kept region of UNIT bytes
    s.install(StripeKey(2, 0), 0, memoryview(b"a" * 1000), 2 * UNIT)  # GROW bytes (a fresh region)
    allocs = Allocs(monkeypatch, s)
    s.install(StripeKey(2, 0), UNIT - 5, memoryview(b"b" * 5), 2 * UNIT)  # grows to UNIT: the kept one
    assert allocs.n == 0 and s.spares.taken == 1
    assert bytes(s.get(2, 0).data) == b"a" * 1000 + bytes(UNIT - 1005) + b"b" * 5


async def test_memory_a_replication_reads_is_not_used_again_until_it_ends(nursery, monkeypatch):
    """A primary's Update reads its stripe's bytes when it sends them: a truncate meanwhile
    frees the stripe, but its memory keeps those bytes until the send is over."""
    s = filled(n_stripes=1)
    await _reaping(s, nursery)
    stripe = s.get(1, 0)
    allocs = Allocs(monkeypatch, s)
    with pinned(stripe):
        s.drop(1)
        assert s.spares.held == UNIT, "kept (counted) while pinned"
        s.install(StripeKey(2, 0), 0, memoryview(b"z" * UNIT), UNIT)
        assert allocs.n == 1 and s.spares.taken == 0 and s.spares.waited == 1, "fresh memory: the kept one is pinned"
        assert bytes(stripe.data) == b"A" * UNIT, "what the replication sends is the stripe's bytes"
    s.install(StripeKey(3, 0), 0, memoryview(b"y" * UNIT), UNIT)
    assert allocs.n == 1 and s.spares.taken == 1, "used again once the pin went"


async def test_memory_under_an_operation_in_flight_waits_for_it_to_drain(nursery, monkeypatch):
    """A key whose free leaves an operation in flight (a native engine's READ still sending)
    drains before its memory holds other bytes (the engine's own case: test_engine.py)."""
    s = filled(n_stripes=1)
    await _reaping(s, nursery)
    draining = {s.get(1, 0).region.rkey}
    real_free = s.transport.free_region
    monkeypatch.setattr(s.transport, "free_region", lambda region: real_free(region) and region.rkey not in draining)
    monkeypatch.setattr(s.transport, "settled", lambda rkey: rkey not in draining)
    s.drop(1)
    allocs = Allocs(monkeypatch, s)
    s.install(StripeKey(2, 0), 0, memoryview(b"z" * UNIT), UNIT)
    assert allocs.n == 1 and s.spares.taken == 0, "not while an operation may still move its bytes"
    draining.clear()  # the operation ended
    s.install(StripeKey(3, 0), 0, memoryview(b"y" * UNIT), UNIT)
    assert allocs.n == 1 and s.spares.taken == 1


async def test_idle_spares_are_released(nursery, autojump_clock):
    s = await _kept(nursery)
    assert s.spares.held == 4 * UNIT
    await trio.sleep(spares_mod.IDLE + 5)
    assert s.spares.held == 0 and s.budget.held[SPARE] == 0
    with trio.fail_after(30):
        while s.behind.dying:  # handed to the reaper's thread
            await trio.sleep(0.01)


async def test_a_batch_of_updates_pins_every_source_from_the_moment_it_is_sent():
    """A batch may carry an update whose own task was cancelled while the batch waits for a
    staging slot or its bytes leave (its task's pin gone, runtime/batching.py): the batch's
    send pins every source itself, before its first wait."""
    from types import SimpleNamespace

    from irdmafs.runtime.slots import Slot
    from irdmafs.server.replicator import Replicator
    from irdmafs.server.updates import StripeRange, Update

    s = filled()
    u = Update(StripeRange(StripeKey(1, 0), 0, 8, UNIT), s.get(1, 0).version, s.get(1, 0))
    seen: list[int] = []

    async def with_slot(peer, fn):
        await trio.sleep(0)  # waiting for a slot
        seen.append(u.source.memory.pins)
        return await fn(Slot(rkey=7, offset=0, inc=1))

    async def write(peer, rkey, offset, bufs, inc):
        seen.append(u.source.memory.pins)

    async def call(peer, method, args):
        return {}

    cluster = SimpleNamespace(peers=SimpleNamespace(write=write), call=call, roles=SimpleNamespace(view=SimpleNamespace(epoch=1)))
    slots = SimpleNamespace(slots=1, slot_size=1 << 20, with_slot=with_slot, forget=lambda *a: None)
    r = Replicator("n0", cluster, slots, dict, None)
    assert await r._fused("n1", u) == {}
    assert seen == [1, 1], "pinned while it waited for a slot and while its bytes left"
    assert u.source.memory.pins == 0, "and let go after"


async def test_a_persisted_stripe_on_kept_memory_never_writes_its_last_bytes_to_disk(nursery, tmp_path, monkeypatch):
    """With --persist the new stripe's file is written whole before its data lands (ensure):
    kept memory is zeroed whole, so the file never holds the unlinked file's bytes."""
    from irdmafs.server.persist import Persist

    from .test_snapshot_cow import store

    s = store(persist=Persist(tmp_path))
    for i in range(2):
        s.install(StripeKey(1, i), 0, memoryview(b"A" * UNIT), UNIT)
    await _reaping(s, nursery)
    s.drop(1)
    written: list[bytes] = []
    real = s.persist.write
    monkeypatch.setattr(s.persist, "write", lambda key, buf, *a, **kw: (written.append(bytes(buf)), real(key, buf, *a, **kw))[1])
    s.install(StripeKey(2, 0), UNIT - 4, memoryview(b"data"), UNIT)
    assert s.spares.taken == 1
    assert written and all(b"A" not in w for w in written), "no byte of the unlinked file reached the disk"
    assert bytes(s.get(2, 0).data) == bytes(UNIT - 4) + b"data"


async def test_commits_and_training_steps_pin_what_they_replicate(bed):  # noqa: F811
    """The primary's replication of a commit and of a training step holds the stripe's memory
    pinned for its whole send (datapath.py, training.py): a truncate meanwhile cannot hand that
    memory to another stripe."""
    c, nodes, _ = bed
    pins: list[int] = []
    for n in nodes:
        real = n.replicator.to_every_target

        async def recording(key, one, n=n, real=real):
            stripe = n.store.get(key.fid, key.idx)
            pins.append(stripe.memory.pins if stripe is not None else -1)
            return await real(key, one)

        n.replicator.to_every_target = recording
    ino = (await c.paths.save("/m/w.npy", np.zeros(256, np.float32)))["ino"]
    assert pins and all(p >= 1 for p in pins), f"a commit replicated unpinned: {pins}"
    pins.clear()
    await c.training.push(ino, 0, np.ones(256, np.float32))
    assert pins and all(p >= 1 for p in pins), f"a training step replicated unpinned: {pins}"
