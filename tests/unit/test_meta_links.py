"""The namespace's links and special files, as the state machine applies them (server/meta.py)."""

import stat as S

import pytest

from irdmafs.names import NAME_MAX, ROOT
from irdmafs.server.meta import LINK_MAX, Meta
from irdmafs.errors import RemoteError

NOW = 1_700_000_000_000_000_000


def run(m: Meta, **op):
    """Prepare as the primary does, then apply (the clock moves 1 s per op)."""
    global NOW
    NOW += 1_000_000_000
    return m.apply(m.prepare(op, NOW))


def code(m: Meta, **op) -> str:
    before = m.snapshot()
    with pytest.raises(RemoteError) as e:
        run(m, **op)
    after = m.snapshot()
    assert after == before, "a refused op changed the namespace"
    return e.value.code


def test_hard_links_count_names_and_the_last_unlink_frees_the_file():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="a", mode=S.S_IFREG | 0o644, unit=1 << 20)["ino"]
    d = run(m, op="mkdir", parent=ROOT, name="d", mode=0o755)["ino"]
    ctime = m.inode(f)["ctime_ns"]
    assert run(m, op="link", ino=f, new_parent=d, new_name="b")["nlink"] == 2
    assert m.inode(f)["ctime_ns"] > ctime
    assert m.lookup(d, "b")["ino"] == f and m.inode(d)["mtime_ns"] == m.inode(f)["ctime_ns"]
    r = run(m, op="unlink", parent=ROOT, name="a")
    assert (r["freed"], r["nlink"]) == (None, 1) and m.lookup(d, "b")["nlink"] == 1
    assert run(m, op="unlink", parent=d, name="b")["freed"] == f
    assert f not in m.inodes


def test_link_refuses_directories_existing_names_and_the_limit():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="a", mode=S.S_IFREG | 0o644)["ino"]
    d = run(m, op="mkdir", parent=ROOT, name="d", mode=0o755)["ino"]
    assert code(m, op="link", ino=d, new_parent=ROOT, new_name="d2") == "EPERM"
    assert code(m, op="link", ino=f, new_parent=ROOT, new_name="d") == "EEXIST"
    assert code(m, op="link", ino=f, new_parent=f, new_name="x") == "ENOTDIR"
    assert code(m, op="link", ino=f, new_parent=ROOT, new_name="x" * (NAME_MAX + 1)) == "ENAMETOOLONG"
    m.inodes[f]["nlink"] = LINK_MAX
    assert code(m, op="link", ino=f, new_parent=ROOT, new_name="b") == "EMLINK"


def test_rename_onto_another_name_of_the_same_file_changes_nothing():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="a", mode=S.S_IFREG | 0o644)["ino"]
    run(m, op="link", ino=f, new_parent=ROOT, new_name="b")
    before = m.snapshot()
    assert run(m, op="rename", parent=ROOT, name="a", new_parent=ROOT, new_name="b") == {"ino": f, "freed": None}
    after = m.snapshot()
    assert after["inodes"] == before["inodes"] and after["entries"] == before["entries"]
    assert m.lookup(ROOT, "a")["nlink"] == 2


def test_rename_over_a_hard_link_drops_one_name_only():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="a", mode=S.S_IFREG | 0o644)["ino"]
    run(m, op="link", ino=f, new_parent=ROOT, new_name="b")
    g = run(m, op="create", parent=ROOT, name="c", mode=S.S_IFREG | 0o644)["ino"]
    assert run(m, op="rename", parent=ROOT, name="c", new_parent=ROOT, new_name="b")["freed"] is None
    assert m.lookup(ROOT, "a")["nlink"] == 1 and m.lookup(ROOT, "b")["ino"] == g


def test_symlinks_hold_their_target_and_its_length():
    m = Meta()
    target = "../blobs/\udcffé"  # bytes that are not UTF-8 travel as surrogate escapes
    a = run(m, op="create", parent=ROOT, name="l", mode=S.S_IFLNK | 0o777, target=target, unit=1 << 20)
    assert S.S_ISLNK(a["mode"]) and a["target"] == target and a["unit"] == 0
    assert a["size"] == len(target.encode(errors="surrogateescape"))
    assert code(m, op="create", parent=ROOT, name="e", mode=S.S_IFLNK | 0o777, target="") == "ENOENT"
    assert code(m, op="create", parent=ROOT, name="e", mode=S.S_IFLNK | 0o777, target="x" * 4096) == "ENAMETOOLONG"
    assert a["ino"] not in m.files()  # no stripes: nothing to place or rebalance


@pytest.mark.parametrize("kind", [S.S_IFIFO, S.S_IFSOCK, S.S_IFCHR, S.S_IFBLK])
def test_special_files_are_names_with_their_kind_and_device(kind):
    m = Meta()
    a = run(m, op="create", parent=ROOT, name="n", mode=kind | 0o640, rdev=(1 << 8) | 2, unit=1 << 20)
    assert S.S_IFMT(a["mode"]) == kind and S.S_IMODE(a["mode"]) == 0o640 and a["unit"] == 0
    assert a.get("rdev", 0) == ((1 << 8) | 2 if kind in (S.S_IFCHR, S.S_IFBLK) else 0)
    assert a["ino"] not in m.files()


def test_links_and_special_files_survive_snapshots_and_restore():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="a", mode=S.S_IFREG | 0o644)["ino"]
    run(m, op="link", ino=f, new_parent=ROOT, new_name="b")
    run(m, op="create", parent=ROOT, name="l", mode=S.S_IFLNK | 0o777, target="a")
    run(m, op="create", parent=ROOT, name="c", mode=S.S_IFCHR | 0o600, rdev=0x0102)
    sid = run(m, op="snapshot", name="s")["id"]
    run(m, op="unlink", parent=ROOT, name="l")
    run(m, op="unlink", parent=ROOT, name="b")
    frozen = m.view(sid)
    assert frozen.lookup(ROOT, "l")["target"] == "a" and frozen.lookup(ROOT, "b")["nlink"] == 2
    back = Meta.restore(m.snapshot())  # what --persist writes and reads
    assert back.view(sid).lookup(ROOT, "c")["rdev"] == 0x0102
    assert back.lookup(ROOT, "a")["nlink"] == 1 and back.lookup(ROOT, "c")["rdev"] == 0x0102


def test_lookup_of_a_name_too_long_says_so():
    m = Meta()
    with pytest.raises(RemoteError) as e:
        m.lookup(ROOT, "x" * (NAME_MAX + 1))
    assert e.value.code == "ENAMETOOLONG"
