"""A node's stripes written through to disk (server/persist.py) read back with the header they
had: version, clock and the pending flag (regions.py), whatever range a change touched."""

from irdmafs.regions import clock_word
from irdmafs.server.persist import Persist
from irdmafs.server.store import Store
from irdmafs.server.updates import StripeKey, StripeRange
from irdmafs.transport.memory import MemoryTransport

UNIT = 4096


def reloaded(persist: Persist, capacity: int = 1 << 20) -> Store:
    """A store loaded from ``persist`` as a restarted node loads it (node.py)."""
    store = Store(MemoryTransport("test-token-123"), capacity)
    _, stripes = persist.load()
    for key, nbytes, same_as in stripes:
        buf = store.load(key, nbytes, same_as, persist.tags.get(key, 0))
        if buf is not None:
            persist.read_into(key, buf)
    return store


def on_disk(persist: Persist) -> dict:
    """Each stripe file's bytes (None for a hard link to an earlier one) and that one's key."""
    out = {}
    for key, nbytes, same_as in persist.load()[1]:
        raw = None
        if same_as is None:
            raw = memoryview(bytearray(nbytes))
            persist.read_into(key, raw)
        out[key] = (None if raw is None else bytes(raw), same_as)
    return out


def test_a_change_at_data_offset_zero_persists_its_header(tmp_path):
    """A range that starts at the data's first byte changes the header too: it was written
    without it, so a node loaded from disk had the old version under the new bytes."""
    persist = Persist(tmp_path)
    store = Store(MemoryTransport("test-token-123"), 1 << 20, persist)
    store.install(StripeKey(1, 0), 0, memoryview(b"a" * 100), UNIT)
    store.install(StripeKey(1, 0), 0, memoryview(b"b" * 100), UNIT, clock=3)
    store.update(StripeRange(StripeKey(1, 0), 0, 100, UNIT), lambda view: view.__setitem__(slice(None), b"c" * 100), pending=True)
    live = store.get(1, 0)
    back = reloaded(persist).get(1, 0)
    assert bytes(back.data[:100]) == b"c" * 100
    assert (back.version, back.clock, back.pending) == (live.version, live.clock, live.pending) == (3, 3, True)
    store.publish_clock(1, 0, 4)
    back = reloaded(persist).get(1, 0)
    assert (back.version, back.clock, back.pending) == (3, 4, False)


def test_a_whole_copy_keeps_the_clock_word_it_was_given(tmp_path):
    """A resync's copy of a stripe whose step is not yet published stays pending (resync.py)."""
    store = Store(MemoryTransport("test-token-123"), 1 << 20)
    store.replace(StripeKey(1, 0), memoryview(b"d" * 100), UNIT, (0, 7), clock=clock_word(5, True))
    copy = store.get(1, 0)
    assert (copy.version, copy.clock, copy.pending) == (7, 5, True)


def test_a_stripe_loads_with_the_tag_of_its_version(tmp_path):
    """Replicas compare (tag, version): a stripe loaded with tag 0 was older than every peer's
    copy, and a restarted node's resync fetched all of them again (at 4 GiB with a snapshot
    held, twice its data's memory: ENOSPC). Tags go to tags.log when they change; a snapshot's
    link has its live stripe's; a torn last line is skipped; the log is compacted at load."""
    persist = Persist(tmp_path)
    epoch = [3]
    store = Store(MemoryTransport("test-token-123"), 1 << 20, persist, epoch=lambda: epoch[0])
    store.install(StripeKey(1, 0), 0, memoryview(b"a" * 100), UNIT)
    store.install(StripeKey(1, 1), 0, memoryview(b"b" * 100), UNIT, stamp=(9, 4))  # a backup's: the primary's tag
    store.take_snapshot(2)
    epoch[0] = 5
    store.install(StripeKey(1, 0), 0, memoryview(b"c" * 100), UNIT)  # the live stripe's next version, in view 5
    store.install(StripeKey(1, 0), 0, memoryview(b"d" * 100), UNIT)
    with open(tmp_path / "tags.log", "a") as f:
        f.write("1 0 0")  # torn
    lines = (tmp_path / "tags.log").read_text().count("\n")
    back = reloaded(persist)
    assert {k: s.stamp for k, s in back.stripes.items()} == {k: s.stamp for k, s in store.stripes.items()}
    assert back.get(1, 0).stamp == (5, 3) and back.get(1, 0, 2).stamp == (3, 1) and back.get(1, 1, 2).stamp == (9, 4)
    assert lines == 6 and (tmp_path / "tags.log").read_text().count("\n") == 4  # compacted: one line a file
