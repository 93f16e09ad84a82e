"""Copy-on-write snapshots in a node's store (server/store.py; docs/design.md, "Snapshots").

Each test breaks one rule if the store breaks it: taking a snapshot copies nothing; a snapshot's
bytes never change and its old key is refused once the live stripe moved on; a change copies a
stripe once, for every snapshot sharing it; a freed or grown live stripe leaves its memory to the
snapshots; a copy that does not fit is ENOSPC before anything changed; memory is counted once;
persisted snapshots share again after a reload. Reads go through the serving side's own check
(``RegionTable.check``), as a peer's one-sided READ would.
"""

import pytest

from irdmafs.runtime.offload import Offload
from irdmafs.regions import HEADER
from irdmafs.server.persist import Persist
from irdmafs.server.store import NoSpace, Store
from irdmafs.server.updates import StripeKey, StripeRange
from irdmafs.transport.base import Access
from irdmafs.errors import AccessError
from irdmafs.transport.memory import MemoryTransport

from .test_store_persist import on_disk, reloaded

UNIT = 64 << 10


def store(capacity=1 << 20, persist=None) -> Store:
    return Store(MemoryTransport("test-token-123"), capacity, persist)


def remote_read(s: Store, fid: int, idx: int, snap: int = 0, n: int = 8) -> bytes:
    """What a peer reads through the key ``stripe_info`` hands out now."""
    rkey = s.get(fid, idx, snap).region.rkey
    return bytes(s.transport.regions.check(rkey, HEADER, n, Access.READ))


def filled(n_stripes=4, capacity=1 << 20, persist=None) -> Store:
    s = store(capacity, persist)
    for i in range(n_stripes):
        s.install(StripeKey(1, i), 0, memoryview(bytes([65 + i]) * UNIT), UNIT)
    return s


def test_taking_a_snapshot_copies_nothing_and_gives_keys_of_its_own():
    s = filled()
    used = s.used
    assert s.take_snapshot(7) == 4 * UNIT
    assert s.used == used and s.snapshot_bytes == 0
    for i in range(4):
        live, snap = s.get(1, i), s.get(1, i, 7)
        assert snap.region.rkey != live.region.rkey
        assert snap.version == live.version
        assert remote_read(s, 1, i, 7) == bytes([65 + i]) * 8


def test_a_write_after_a_snapshot_copies_that_stripe_once_and_its_old_key_is_refused():
    s = filled()
    s.take_snapshot(7)
    s.take_snapshot(8)
    live_key = s.get(1, 2).region.rkey
    old_snap_key = s.get(1, 2, 7).region.rkey
    used = s.used
    s.install(StripeKey(1, 2), 0, memoryview(b"new!"), UNIT)
    assert s.used == used + UNIT, "one copy for both snapshots"
    assert s.snapshot_bytes == UNIT
    assert s.get(1, 2).region.rkey == live_key, "the live stripe keeps its key"
    assert remote_read(s, 1, 2) == b"new!CCCC"
    for snap in (7, 8):
        assert remote_read(s, 1, 2, snap) == b"CCCCCCCC"
        assert s.get(1, 2, snap).version == 1
    with pytest.raises(AccessError):
        s.transport.regions.check(old_snap_key, 0, 8, Access.READ)
    s.install(StripeKey(1, 2), 0, memoryview(b"more"), UNIT)  # the second write copies nothing
    assert s.used == used + UNIT
    assert remote_read(s, 1, 3, 7) == b"DDDDDDDD"  # the others still share
    s.drop_snapshot(7)
    assert s.used == used + UNIT  # snapshot 8 still holds the copy
    s.drop_snapshot(8)
    assert s.used == used and s.snapshot_bytes == 0


def test_a_training_step_in_place_is_a_change_like_any_other():
    s = filled()
    s.take_snapshot(3)
    s.update(StripeRange(StripeKey(1, 0), 0, 4, UNIT), lambda view: view.__setitem__(slice(None), b"step"), pending=True)
    assert remote_read(s, 1, 0) == b"stepAAAA"
    assert remote_read(s, 1, 0, 3) == b"AAAAAAAA"
    assert not s.get(1, 0, 3).pending


def test_a_freed_or_grown_live_stripe_leaves_its_memory_to_the_snapshot():
    s = store()
    s.install(StripeKey(1, 0), 0, memoryview(b"a" * 1000), UNIT)  # smaller than the unit: it grows later
    s.install(StripeKey(1, 1), 0, memoryview(b"b" * UNIT), UNIT)
    s.take_snapshot(5)
    used = s.used
    small = s.get(1, 0).capacity
    s.install(StripeKey(1, 0), 60000, memoryview(b"c" * 100), UNIT)  # grows into a new region
    assert s.used == used + s.get(1, 0).capacity, "the grown stripe's region, and no copy"
    assert remote_read(s, 1, 0, 5) == b"aaaaaaaa" and s.get(1, 0, 5).capacity == small
    s.drop(1)  # unlink: the live stripes go, the snapshot keeps their bytes
    assert s.get(1, 0) is None and s.get(1, 1) is None
    assert remote_read(s, 1, 1, 5) == b"bbbbbbbb"
    assert s.used == used
    s.drop_snapshot(5)
    assert s.used == 0 and not s.stripes and not s.sharers


def test_a_copy_that_does_not_fit_is_no_space_and_changes_nothing():
    s = filled(n_stripes=4, capacity=4 * UNIT)
    s.take_snapshot(2)
    version = s.get(1, 1).version
    with pytest.raises(NoSpace, match="snapshots \\[2\\] hold"):
        s.install(StripeKey(1, 1), 0, memoryview(b"zzzz"), UNIT)
    assert remote_read(s, 1, 1) == b"BBBBBBBB" and s.get(1, 1).version == version
    assert remote_read(s, 1, 1, 2) == b"BBBBBBBB"
    s.drop_snapshot(2)
    s.install(StripeKey(1, 1), 0, memoryview(b"zzzz"), UNIT)  # room again once the snapshot went
    assert remote_read(s, 1, 1) == b"zzzzBBBB"


def test_a_snapshot_stripe_of_the_live_stamp_is_shared_not_copied():
    """A resync or rebalance bringing a snapshot's stripe that is the live one here."""
    s = filled(n_stripes=1)
    live = s.get(1, 0)
    used = s.used
    s.replace(StripeKey(1, 0, 9), memoryview(bytes(live.data)), UNIT, (live.tag, live.version), clock=0)
    assert s.used == used and 9 in s.sharers[(1, 0)]
    s.replace(StripeKey(1, 0, 9), memoryview(b"x" * 10), UNIT, (live.tag, live.version + 5), clock=0)  # another stamp: its own
    assert s.used == used + s.get(1, 0, 9).capacity
    assert remote_read(s, 1, 0) == b"AAAAAAAA" and remote_read(s, 1, 0, 9) == b"xxxxxxxx"


def test_persisted_snapshots_share_again_after_a_reload(tmp_path):
    persist = Persist(tmp_path)
    s = filled(n_stripes=3, persist=persist)
    s.take_snapshot(4)
    s.install(StripeKey(1, 0), 0, memoryview(b"live"), UNIT)
    s.drop(1, 2)  # the last stripe freed live, kept by the snapshot
    back = reloaded(persist)
    assert back.used == s.used == 4 * UNIT  # 2 live (one shared), 1 copy, 1 kept by the snapshot alone
    assert remote_read(back, 1, 0) == b"liveAAAA" and remote_read(back, 1, 0, 4) == b"AAAAAAAA"
    assert remote_read(back, 1, 1, 4) == b"BBBBBBBB" and back.get(1, 1, 4).memory is back.get(1, 1).memory
    assert remote_read(back, 1, 2, 4) == b"CCCCCCCC" and back.get(1, 2) is None
    back.install(StripeKey(1, 1), 0, memoryview(b"next"), UNIT)  # still copy-on-write after the reload
    assert remote_read(back, 1, 1, 4) == b"BBBBBBBB"


async def test_freed_memory_is_released_off_the_loop_while_the_reaper_runs():
    """With ``reap`` running (a node), dropping a snapshot hands its memory to a worker thread:
    the loop only unregisters. Without it, the memory goes at once, as before. (No room for
    spares here: what a node keeps instead of releasing is test_spares.py's.)"""
    import trio
    import trio.testing

    s = filled()
    s.spares.limit = 0
    s.take_snapshot(1)
    for i in range(4):
        s.install(StripeKey(1, i), 0, memoryview(b"copy"), UNIT)  # the snapshot holds 4 copies alone
    async with trio.open_nursery() as n:
        n.start_soon(s.behind.reap, Offload())
        await trio.testing.wait_all_tasks_blocked()
        assert s.behind.reaping
        s.drop_snapshot(1)
        assert len(s.behind.dying) == 4 and s.snapshot_bytes == 0  # handed over, not released here
        with trio.fail_after(30):
            while s.behind.dying:  # until the reaper took them
                await trio.sleep(0.001)
        n.cancel_scope.cancel()
    assert not s.behind.reaping
    s.drop(1)
    assert not s.behind.dying and s.used == 0  # without the reaper: released where freed


async def test_a_snapshots_files_are_written_behind_in_order_with_the_writes_after_it(tmp_path):
    """With ``--persist`` a snapshot's hard links (one per stripe) and a drop's removals are
    queued and done in a worker thread (``write_behind``), never on the loop; a stripe written,
    grown or freed and made again while its link still waits gets the link done first, so the
    snapshot's file keeps the bytes it froze, while the thread drains the rest concurrently."""
    import threading

    import trio
    import trio.testing

    persist = Persist(tmp_path)
    n = 64
    s = store(capacity=4 * n * UNIT, persist=persist)
    for i in range(n):
        s.install(StripeKey(1, i), 0, memoryview(bytes([i]) * UNIT), UNIT)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.behind.write_behind, Offload())
        await trio.testing.wait_all_tasks_blocked()
        loop_thread = threading.get_ident()
        s.take_snapshot(3)
        assert persist.pending == n  # queued, not done on the loop
        drained = threading.Thread(target=persist.drain)
        drained.start()  # a second drainer, as the node's task and a snapshot's answer may be
        for i in range(n):  # the loop changes every stripe while both threads link
            if i % 3 == 0:
                s.install(StripeKey(1, i), 0, memoryview(b"\xff" * UNIT), UNIT)
            elif i % 3 == 1:
                s.drop_keys([(1, i, 0)])
                s.install(StripeKey(1, i), 0, memoryview(b"\xee" * 100), UNIT)  # freed and made again
            else:
                s.install(StripeKey(1, i), UNIT - 4, memoryview(b"tail"), UNIT)
        await s.behind.persisted(Offload())
        drained.join()
        assert persist.pending == 0 and threading.get_ident() == loop_thread
        frozen = {key: raw for key, (raw, _) in on_disk(persist).items() if key[2] == 3}
        assert all(frozen[(1, i, 3)][HEADER : HEADER + UNIT] == bytes([i]) * UNIT for i in range(n))
        s.drop_snapshot(3)  # its files removed behind too
        await s.behind.persisted(Offload())
        nursery.cancel_scope.cancel()
    files = {key: raw for key, (raw, _) in on_disk(persist).items()}
    assert not any(k[2] == 3 for k in files)
    for i in range(n):
        live = files[(1, i, 0)][HEADER:]
        want = b"\xff" * UNIT if i % 3 == 0 else b"\xee" * 100 if i % 3 == 1 else bytes([i]) * (UNIT - 4) + b"tail"
        assert live[: len(want)] == want, i


def test_a_snapshot_written_behind_keeps_what_it_froze_on_disk(tmp_path):
    """The same without a drainer running: the write that comes first does the link."""
    persist = Persist(tmp_path)
    s = filled(n_stripes=3, persist=persist)
    s.behind.writing_behind = True  # as under a node's write_behind, which has not run yet
    s.take_snapshot(5)
    assert persist.pending == 3
    s.install(StripeKey(1, 0), 0, memoryview(b"new!"), UNIT)  # does stripe 0's link first
    s.drop(1, 2)
    assert persist.pending == 3  # stripes 1 and 2's links wait, and the removal queued behind them
    persist.drain()
    files = on_disk(persist)
    assert files[(1, 0, 0)][0][HEADER : HEADER + 4] == b"new!" and files[(1, 0, 5)][0][HEADER : HEADER + 4] == b"AAAA"
    assert files[(1, 1, 5)][1] == (1, 1, 0)  # still one file: shared
    assert files[(1, 2, 5)][0][HEADER : HEADER + 4] == b"CCCC" and (1, 2, 0) not in files
