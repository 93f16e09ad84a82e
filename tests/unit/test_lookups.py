"""What lookups fetched, for the open that follows: fresh, once, and never across a change."""

import os
import stat as S

import trio

from irdmafs.fs.lookups import Lookups

from .test_vfs import W, fs  # noqa: F401  (the fixture)


async def test_an_entry_serves_once_while_fresh_and_never_across_a_change(autojump_clock):
    lk = Lookups()
    lk.note("a", 1, lk.begin())
    assert lk.take("a") == 1 and lk.take("a") is None  # once
    lk.note("a", 2, lk.begin())
    await trio.sleep(Lookups.FRESH)
    assert lk.take("a") is None  # too old
    begun = lk.begin()
    lk.changed()  # this mount changed something while the lookup ran
    lk.note("a", 3, begun)
    assert lk.take("a") is None
    lk.note("b", 4, lk.begin())
    lk.changed()  # ... or after it: dropped
    assert lk.take("b") is None
    for i in range(Lookups.KEEP + 10):  # a burst of lookups nobody opens: bounded
        lk.note(i, i, lk.begin())
    assert len(lk._seen) <= Lookups.KEEP


async def test_an_open_after_this_mounts_change_does_not_take_the_lookup_before_it(fs):  # noqa: F811
    fh, st = await fs.create(1, "f", 0o644, W, 0, 0)
    await fs.write(fh, 0, b"x" * 1000)
    await fs.release(fh)
    assert (await fs.lookup(1, "f"))["st_size"] == 1000
    await fs.setattr(st["st_ino"], {"size": 10})  # this mount truncates between lookup and open
    fh = await fs.open(st["st_ino"], os.O_RDONLY)
    assert bytes(await fs.read(fh, 0, 4096)) == b"x" * 10
    await fs.release(fh)
    calls = fs.client.cluster.peers.calls
    assert S.S_ISREG((await fs.lookup(1, "f"))["st_mode"])
    fh = await fs.open(st["st_ino"], os.O_RDONLY)  # right after its lookup: no call of its own
    assert fs.client.cluster.peers.calls - calls == 1  # the lookup's
    await fs.release(fh)
