"""Buckets as the namespace keeps them (server/buckets.py; docs/buckets.md B1, B4, B6, B8): the
two steps of a pack, unpack, and what every other op may do to a packed tensor or a bucket."""

import stat as S

import pytest

from irdmafs.names import LAYOUT_CHANGED, PACK_LEASE_NS, ROOT
from irdmafs.packing import in_force, pointer
from irdmafs.server.meta import Meta
from irdmafs.errors import RemoteError

NOW = 1_700_000_000_000_000_000
HEADER = 128


def run(m: Meta, *, at: int | None = None, **op):
    """Prepare as the primary does, then apply (the clock moves 1 s per op, or to ``at``)."""
    global NOW
    NOW = at if at is not None else NOW + 1_000_000_000
    return m.apply(m.prepare(op, NOW))


def code(m: Meta, **op) -> str:
    before = m.snapshot()
    with pytest.raises(RemoteError) as e:
        run(m, **op)
    assert m.snapshot() == before, "a refused op changed the namespace"
    return e.value.code


def model(m: Meta, n: int = 4, elems: int = 16) -> tuple[int, list[int], int]:
    """A directory of ``n`` float32 tensors of ``elems`` each and a new bucket file in it."""
    d = run(m, op="mkdir", parent=ROOT, name="m", mode=0o755)["ino"]
    tensors = []
    for i in range(n):
        t = run(m, op="create", parent=d, name=f"t{i}.npy", mode=S.S_IFREG | 0o644, unit=1 << 20)["ino"]
        run(m, op="extend", ino=t, size=HEADER + 4 * elems)
        run(m, op="settensor", ino=t, tensor={"dtype": "<f4", "shape": [elems], "offset": HEADER, "fortran": False})
        tensors.append(t)
    b = run(m, op="create", parent=d, name=".irdmafs-bucket-1", mode=S.S_IFREG | 0o600, unit=256 << 10)["ino"]
    return d, tensors, b


def rows(m: Meta, tensors: list[int], elems: int = 16) -> list[list[int]]:
    return [[t, 4 * elems * i, m.inode(t)["version"]] for i, t in enumerate(tensors)]


def packed(m: Meta, n: int = 4, elems: int = 16) -> tuple[int, list[int], int]:
    d, tensors, b = model(m, n, elems)
    r = rows(m, tensors, elems)
    run(m, op="pack", bucket=b, tensors=r, count=n * elems, final=False)
    run(m, op="extend", ino=b, size=4 * n * elems)
    run(m, op="pack", bucket=b, tensors=rows(m, tensors, elems), count=n * elems, final=True)
    return d, tensors, b


def test_a_pack_is_in_force_only_once_its_second_step_lands_and_moves_every_version():
    m = Meta()
    d, tensors, b = model(m)
    before = {t: m.inode(t)["version"] for t in tensors}
    run(m, op="pack", bucket=b, tensors=rows(m, tensors), count=64, final=False)
    assert all(pointer(m.inode(t)) and not in_force(m.inode(t)) for t in tensors)
    assert {t: m.inode(t)["version"] for t in tensors} == before  # reads still go to their own bytes
    run(m, op="extend", ino=b, size=256)
    bucket_version = m.inode(b)["version"]
    run(m, op="pack", bucket=b, tensors=rows(m, tensors), count=64, final=True)
    for i, t in enumerate(tensors):
        assert in_force(m.inode(t)) == {"fid": b, "at": 64 * i, "size": 256, "unit": 256 << 10}
        assert m.inode(t)["version"] == before[t] + 1
    assert m.inode(b)["tensor"] == {"dtype": "<f4", "shape": [64], "offset": 0, "fortran": False, "members": sorted(tensors)}
    assert m.inode(b)["version"] > bucket_version


def test_the_second_step_is_refused_after_a_change_or_once_the_lease_ran_out():
    m = Meta()
    d, tensors, b = model(m)
    run(m, op="pack", bucket=b, tensors=rows(m, tensors), count=64, final=False)
    run(m, op="extend", ino=b, size=256)
    stale = rows(m, tensors)
    run(m, op="extend", ino=tensors[2], size=HEADER + 64)  # a write landed meanwhile
    assert code(m, op="pack", bucket=b, tensors=stale, count=64, final=True) == "EBUSY"
    m2 = Meta()
    d, tensors, b = model(m2)
    run(m2, op="pack", bucket=b, tensors=rows(m2, tensors), count=64, final=False)
    run(m2, op="extend", ino=b, size=256)
    assert code(m2, op="pack", bucket=b, tensors=rows(m2, tensors), count=64, final=True, at=NOW + PACK_LEASE_NS + 1) == "EBUSY"
    # the lease ran out: another pack may take the tensors
    b2 = run(m2, op="create", parent=d, name=".irdmafs-bucket-2", mode=S.S_IFREG | 0o600, unit=256 << 10)["ino"]
    run(m2, op="pack", bucket=b2, tensors=rows(m2, tensors), count=64, final=False)
    assert all(pointer(m2.inode(t))["fid"] == b2 for t in tensors)


def test_a_pack_refuses_what_cannot_share_a_bucket():
    m = Meta()
    d, tensors, b = model(m)
    r = rows(m, tensors)
    assert code(m, op="pack", bucket=b, tensors=[r[0], [r[1][0], 32, r[1][2]]], count=64, final=False) == "EINVAL"  # overlap
    assert code(m, op="pack", bucket=b, tensors=r, count=63, final=False) == "EINVAL"  # past the end
    assert code(m, op="pack", bucket=b, tensors=[r[0], r[0]], count=64, final=False) == "EINVAL"
    assert code(m, op="pack", bucket=b, tensors=[[r[0][0], 0, r[0][2] + 1]], count=64, final=False) == "EBUSY"
    assert code(m, op="pack", bucket=b, tensors=r, count=64, final=True) == "EBUSY"  # no first step
    run(m, op="setxattr", ino=tensors[1], name="user.irdma.sync", value="asp")  # a policy of its own (B6)
    assert code(m, op="pack", bucket=b, tensors=rows(m, tensors), count=64, final=False) == "EBUSY"
    other = run(m, op="create", parent=ROOT, name="x.npy", mode=S.S_IFREG | 0o644, unit=1 << 20)["ino"]
    run(m, op="extend", ino=other, size=HEADER + 64)
    run(m, op="settensor", ino=other, tensor={"dtype": "<f4", "shape": [16], "offset": HEADER, "fortran": False})
    assert code(m, op="pack", bucket=b, tensors=[[other, 0, m.inode(other)["version"]]], count=64, final=False) == "EXDEV"
    run(m, op="settensor", ino=tensors[0], tensor={"dtype": "<i8", "shape": [8], "offset": HEADER, "fortran": False})
    assert code(m, op="pack", bucket=b, tensors=[rows(m, tensors)[0]], count=64, final=False) == "EBUSY"  # not float


def test_what_other_ops_may_do_to_a_packed_tensor():
    m = Meta()
    d, tensors, b = packed(m)
    t = tensors[0]
    assert code(m, op="extend", ino=t, size=HEADER + 64) == LAYOUT_CHANGED  # a writer opened before the pack
    assert code(m, op="setattr", ino=t, attrs={"size": HEADER + 8}) == "EBUSY"  # a partial truncate: unpack first
    assert code(m, op="settensor", ino=t, tensor=None) == "EBUSY"
    assert code(m, op="setxattr", ino=t, name="user.irdma.sync", value="asp") == "EBUSY"
    assert code(m, op="rename", parent=d, name="t0.npy", new_parent=ROOT, new_name="t0.npy") == "EXDEV"
    assert code(m, op="link", ino=t, new_parent=ROOT, new_name="t0.npy") == "EXDEV"
    assert code(m, op="unlink", parent=d, name=".irdmafs-bucket-1") == "EBUSY"
    assert code(m, op="setattr", ino=b, attrs={"size": 0}) == "EPERM"
    same = {k: v for k, v in m.inode(t)["tensor"].items() if k != "bucket"}
    run(m, op="settensor", ino=t, tensor=same)  # a flush that found the header it had
    assert in_force(m.inode(t))
    run(m, op="rename", parent=d, name="t0.npy", new_parent=d, new_name="u0.npy")  # in its directory
    run(m, op="setxattr", ino=t, name="user.note", value="x")
    assert in_force(m.inode(t))


def test_the_op_that_drops_the_last_member_frees_the_bucket():
    m = Meta()
    d, tensors, b = packed(m)
    r = run(m, op="setattr", ino=tensors[0], attrs={"size": 0})  # O_TRUNC: a whole rewrite
    assert not pointer(m.inode(tensors[0])) and r.get("freed_buckets") is None
    assert m.inode(b)["tensor"]["members"] == tensors[1:]
    assert run(m, op="unlink", parent=d, name="t1.npy").get("freed_buckets") is None
    run(m, op="rename", parent=d, name="t0.npy", new_parent=d, new_name="t2.npy")  # over a packed tensor
    assert m.inode(b)["tensor"]["members"] == [tensors[3]]
    assert run(m, op="unpack", bucket=b, tensors=[[tensors[3], -1]])["freed_buckets"] == [b]
    assert b not in m.inodes and ".irdmafs-bucket-1" not in m.entries[d]
    assert not pointer(m.inode(tensors[3]))


def test_rmdir_takes_a_bucket_a_cut_short_pack_left_and_nothing_else():
    m = Meta()
    d, tensors, b = model(m)
    run(m, op="pack", bucket=b, tensors=rows(m, tensors), count=64, final=False)  # then the mount died
    for i in range(4):
        run(m, op="unlink", parent=d, name=f"t{i}.npy")
    assert run(m, op="rmdir", parent=ROOT, name="m")["freed_buckets"] == [b]
    assert b not in m.inodes
    # the bare file a pack created before its first step (the mount died, or its removal failed)
    d, tensors, b = model(m, n=1)
    run(m, op="unlink", parent=d, name="t0.npy")
    run(m, op="create", parent=d, name="x", mode=S.S_IFREG | 0o644)
    assert code(m, op="rmdir", parent=ROOT, name="m") == "ENOTEMPTY"  # a file of the user's
    run(m, op="unlink", parent=d, name="x")
    assert run(m, op="rmdir", parent=ROOT, name="m")["freed_buckets"] == [b]
    assert b not in m.inodes
    m2 = Meta()
    d, tensors, b = packed(m2)
    assert code(m2, op="rmdir", parent=ROOT, name="m") == "ENOTEMPTY"
    run(m2, op="create", parent=ROOT, name="f", mode=S.S_IFREG | 0o644)
    assert code(m2, op="rmdir", parent=ROOT, name="f") == "ENOTDIR"  # (not taken for an empty directory)
