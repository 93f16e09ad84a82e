"""Names and attributes cached by the kernel under a lease, across two real mounts of one
cluster (docs/caching.md): what one mount's kernel holds is dropped before another mount's
change returns, so close-to-open holds as it did with nothing cached."""

import errno
import json
import os
import stat as S

import pytest
import trio


def figures(m) -> dict:
    return json.loads((m / ".irdma" / "stats").read_text())


async def holding_a_lease(m) -> None:
    """Until mount ``m`` holds a name cache lease (its long-poll's first answer)."""
    with trio.fail_after(30):
        while figures(m)["names"]["lease_left"] <= 0:
            await trio.sleep(0.05)


def lookups(m) -> int:
    return figures(m)["fuse"].get("lookup", 0)


async def test_a_name_cached_by_one_mount_is_dropped_before_another_mounts_change_returns(local_cluster, mount):
    lc = await local_cluster()
    a, b = mount(lc, "a"), mount(lc, "b")
    await holding_a_lease(a)
    await holding_a_lease(b)
    os.mkdir(a / "d")
    (a / "d" / "f").write_bytes(b"old bytes")
    (a / "d" / "g").write_bytes(b"the new file's bytes")
    old = os.stat(b / "d" / "f")
    assert old.st_size == 9
    # cached: the kernel asks mount b nothing for the same path again
    first = lookups(b)
    reading = lookups(b) - first  # what reading the figures itself looks up (.irdma/stats)
    before = lookups(b)
    for _ in range(20):
        assert os.stat(b / "d" / "f").st_ino == old.st_ino
    assert lookups(b) - before == reading, "b's kernel looked the cached names up again"
    assert figures(b)["names"]["given"] >= 2
    # a rename over it through a: b sees the new file at once, by path and by content
    os.rename(a / "d" / "g", a / "d" / "f")
    new = os.stat(b / "d" / "f")
    assert new.st_ino != old.st_ino and new.st_size == len(b"the new file's bytes")
    assert (b / "d" / "f").read_bytes() == b"the new file's bytes"
    assert not os.path.exists(b / "d" / "g")
    # attributes: a chmod through a shows on b at once
    os.stat(b / "d" / "f")
    os.chmod(a / "d" / "f", 0o600)
    assert S.S_IMODE(os.stat(b / "d" / "f").st_mode) == 0o600
    # an unlink through a: gone on b at once
    os.unlink(a / "d" / "f")
    with pytest.raises(FileNotFoundError):
        os.stat(b / "d" / "f")
    # a directory renamed: the old path is gone, its files reachable under the new one
    (a / "d" / "h").write_bytes(b"h")
    assert (b / "d" / "h").read_bytes() == b"h"
    os.rename(a / "d", a / "e")
    with pytest.raises(OSError) as err:
        os.stat(b / "d" / "h")
    assert err.value.errno == errno.ENOENT
    assert (b / "e" / "h").read_bytes() == b"h"
    assert figures(b)["names"]["applied"] >= 4


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
async def test_a_listing_kept_by_one_mount_follows_another_mounts_changes(local_cluster, mount):
    """Past a few lookups in a directory the mount lists it whole and answers its names from
    the listing (fs/listings.py); every change through another mount is still seen at once."""
    lc = await local_cluster()
    a, b = mount(lc, "a"), mount(lc, "b")
    await holding_a_lease(a)
    await holding_a_lease(b)
    os.mkdir(a / "d")
    for i in range(20):
        (a / "d" / f"f{i}").write_bytes(b"x" * i)
    sizes = [os.stat(b / "d" / f"f{i}").st_size for i in range(20)]
    assert sizes == list(range(20))
    assert figures(b)["names"]["listing_hits"] >= 10  # most were answered from the listing
    (a / "d" / "f3").write_bytes(b"longer now")  # a size changed at a's close
    os.chmod(a / "d" / "f4", 0o600)
    os.rename(a / "d" / "f5", a / "d" / "f50")
    os.unlink(a / "d" / "f6")
    (a / "d" / "new").write_bytes(b"new")
    assert os.stat(b / "d" / "f3").st_size == len(b"longer now")
    assert (b / "d" / "f3").read_bytes() == b"longer now"  # an open answered from the listing: its size now
    (a / "d" / "f7").write_bytes(b"seven, rewritten")  # changed again, not looked at on b since
    assert (b / "d" / "f7").read_bytes() == b"seven, rewritten"
    assert S.S_IMODE(os.stat(b / "d" / "f4").st_mode) == 0o600
    assert not os.path.exists(b / "d" / "f5") and os.stat(b / "d" / "f50").st_size == 5
    assert not os.path.exists(b / "d" / "f6")
    assert (b / "d" / "new").read_bytes() == b"new"
    assert sorted(os.listdir(b / "d")) == sorted([f"f{i}" for i in range(20) if i not in (5, 6)] + ["f50", "new"])
