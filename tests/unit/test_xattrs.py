"""Extended attributes tools can copy, policies checked when set, snapshots that keep modes: the
VFS awaited directly over an in-process cluster (issue 55).

Tools copy what listxattr lists and set it on the copy (cp -a, rsync -X), and rsync -X removes
from its copy what the source does not list: the derived attributes are read by name and never
listed, and what is listed may be set back. A policy's value is checked with the parser the
training path reads it with, when it is set, by the mount and by the node."""

import errno
import logging
import os
import stat as S

import numpy as np
import pytest

from irdmafs import policy
from irdmafs.client import compress
from irdmafs.fs import inodes as I
from irdmafs.fs import vfs as V
from irdmafs.server import optim
from irdmafs.errors import RemoteError

from .test_vfs import fs, npy, read_all, write_file  # noqa: F401 (fs: the fixture)

W = os.O_WRONLY
DERIVED = ["user.irdma.dtype", "user.irdma.shape", "user.irdma.version"]
# the values issue 55 found taken without a word, each refused at the first push or never
BAD = [
    ("user.irdma.sync", "nonsense"),
    ("user.irdma.sync", "ssp:-1"),
    ("user.irdma.workers", "abc"),
    ("user.irdma.workers", "0"),
    ("user.irdma.optimizer", "rmsprop"),
    ("user.irdma.optimizer", "sgd lr=-1"),
    ("user.irdma.compress", "fp17"),
    ("user.irdma.timeout", "abc"),
    ("user.irdma.timeout", "-5"),
    ("user.irdma.removed", "one,two"),
    ("user.irdma.safetensors_metadata", "[1, 2]"),
]
GOOD = {
    "user.irdma.sync": "ssp:2",
    "user.irdma.workers": "4",
    "user.irdma.optimizer": "adam lr=1e-3 betas=0.9,0.99",
    "user.irdma.compress": "fp16,chunks=0.25",
    "user.irdma.timeout": "2.5",
    "user.irdma.removed": "1,3",
    "user.irdma.safetensors_metadata": '{"step": "7"}',
}


async def code_of(call) -> int:
    with pytest.raises((V.FsError, RemoteError)) as err:
        await call
    return getattr(err.value, "errno", None) or getattr(errno, err.value.code)


def test_the_parsers_the_mount_checks_with_are_the_training_paths():
    """One parser per policy, shared (irdmafs/policy.py): the node's optimizer and the client's
    compression read the forms with the very functions a set value is checked with."""
    assert optim.parse is policy.parse_optimizer and compress.parse is policy.parse_compress
    assert set(policy.POLICIES) == {f"user.irdma.{k}" for k in ("sync", "workers", "optimizer", "compress", "timeout", "removed")}
    for name, text in BAD:
        if name in policy.POLICIES:
            with pytest.raises(policy.PolicyError):
                policy.check(name, text)
    for name, text in GOOD.items():
        if name in policy.POLICIES:
            policy.check(name, text)
    assert policy.parse_timeout("2.5") == 2.5 and policy.parse_workers("4") == 4 and policy.parse_removed("3, 1") == {1, 3}


async def test_derived_and_the_mounts_own_xattrs_are_read_by_name_and_never_listed(fs):
    d = (await fs.mkdir(1, "m", 0o755, 0, 0))["st_ino"]
    ino = await write_file(fs, d, "w.npy", npy(np.arange(6, dtype=np.float32).reshape(2, 3)))
    assert [await fs.getxattr(ino, n) for n in DERIVED] == [b"<f4", b"[2, 3]", b"1"]
    assert await fs.listxattr(ino) == []  # read by name only: a copy is stamped with none
    for name in DERIVED:  # and never set or removed
        for value in (b"x", None):
            assert await code_of(fs.setxattr(ino, name, value)) == errno.EPERM
    # what is listed may be set back as it is: the policies, a view's metadata, a user's own
    for name, text in GOOD.items():
        await fs.setxattr(d, name, text.encode())
    await fs.setxattr(d, "user.note", b"mine")
    assert await fs.listxattr(d) == sorted([*GOOD, "user.note"])
    for name in await fs.listxattr(d):
        await fs.setxattr(d, name, await fs.getxattr(d, name))  # what rsync -X / cp -a do with them
    # a rank's batch size is the mount's (written through .irdma): read by name, never listed
    await fs.client.setxattr(1, "user.irdma.batch.0", "32")
    assert await fs.getxattr(1, "user.irdma.batch.0") == b"32" and await fs.listxattr(1) == []
    assert await code_of(fs.setxattr(1, "user.irdma.batch.0", b"64")) == errno.EPERM
    # a symbolic link (and any other kind): none listed (the kernel refuses user.* on them)
    link = await fs.symlink(d, "latest", "w.npy", 0, 0)
    assert await fs.listxattr(link["st_ino"]) == []
    # the mount's own entries keep none; a snapshot's inodes list what the live ones did
    assert await fs.listxattr(I.IRDMA_DIR) == [] and await fs.listxattr(I.SNAPSHOTS_DIR) == []
    snap = await fs.mkdir(I.SNAPSHOTS_DIR, "s", 0o755, 0, 0)
    sd = await fs.lookup(snap["st_ino"], "m")
    assert await fs.listxattr(sd["st_ino"]) == sorted([*GOOD, "user.note"])
    assert await fs.listxattr((await fs.lookup(sd["st_ino"], "w.npy"))["st_ino"]) == []
    assert await fs.getxattr((await fs.lookup(sd["st_ino"], "w.npy"))["st_ino"], "user.irdma.shape") == b"[2, 3]"


async def test_policy_xattrs_are_checked_when_set_and_a_bad_one_is_logged_once(fs, caplog):
    caplog.set_level(logging.WARNING, logger="irdmafs.fs.xattrs")
    d = (await fs.mkdir(1, "m", 0o755, 0, 0))["st_ino"]
    for name, text in BAD:
        caplog.clear()
        assert await code_of(fs.setxattr(d, name, text.encode())) == errno.EINVAL, (name, text)
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(lines) == 1 and name in lines[0] and repr(text) in lines[0], lines
        assert await code_of(fs.getxattr(d, name)) == errno.ENODATA  # nothing kept
    # a user.irdma.* name that is none of the mount's is refused (a misspelt policy), and logged
    caplog.clear()
    assert await code_of(fs.setxattr(d, "user.irdma.bogus", b"1")) == errno.ENOTSUP
    assert await code_of(fs.setxattr(d, "user.irdma.synch", b"bsp")) == errno.ENOTSUP
    assert "user.irdma.bogus" in caplog.text and "user.irdma.synch" in caplog.text
    # a good value is kept; removed, the policy is back to its default
    await fs.setxattr(d, "user.irdma.workers", b"2")
    assert await fs.getxattr(d, "user.irdma.workers") == b"2"
    await fs.setxattr(d, "user.irdma.workers", None)
    assert await code_of(fs.getxattr(d, "user.irdma.workers")) == errno.ENODATA
    assert await code_of(fs.setxattr(d, "user.irdma.workers", None)) == errno.ENODATA  # not set
    # on a model file too (mirrored on its tensors' directory): checked before anything changes
    from safetensors.numpy import save

    f = await write_file(fs, 1, "x.safetensors", save({"w": np.ones(4, np.float32)}))
    assert await code_of(fs.setxattr(f, "user.irdma.optimizer", b"rmsprop")) == errno.EINVAL
    await fs.setxattr(f, "user.irdma.optimizer", b"sgd lr=0.5")
    assert await fs.getxattr(f, "user.irdma.optimizer") == b"sgd lr=0.5"


async def test_the_node_refuses_a_bad_policy_from_any_client(fs):
    """The Client API reaches the node's setxattr op without the mount: it checks as well."""
    c = fs.client
    d = (await c.mkdir(1, "m"))["ino"]
    for name, text in BAD:
        if name != "user.irdma.safetensors_metadata":  # (the mount's to check: a view's)
            with pytest.raises(RemoteError) as err:
                await c.setxattr(d, name, text)
            assert err.value.code == "EINVAL" and name in str(err.value), (name, text)
    assert (await c.getattr(d))["xattrs"] == {}
    await c.setxattr(d, "user.irdma.sync", "asp")
    await c.setxattr(d, "user.irdma.sync", None)  # removal is no value to check


async def test_a_snapshot_keeps_modes_owners_and_times_and_refuses_every_change_with_erofs(fs):
    d = await fs.mkdir(1, "m", 0o750, 1000, 1001)
    fh, st = await fs.create(d["st_ino"], "f", 0o640, W, 1000, 1001)
    await fs.write(fh, 0, b"frozen")
    await fs.release(fh)
    await fs.setattr(st["st_ino"], {"mtime_ns": 123_000_000_000})
    sub = await fs.mkdir(d["st_ino"], "sub", 0o700, 1000, 1001)
    await fs.symlink(d["st_ino"], "l", "f", 1000, 1001)
    snap = await fs.mkdir(I.SNAPSHOTS_DIR, "s", 0o755, 0, 0)
    sd = await fs.lookup(snap["st_ino"], "m")
    frozen = {n: await fs.lookup(sd["st_ino"], n) for n in ("f", "sub", "l")}
    keys = ("st_mode", "st_uid", "st_gid", "st_mtime_ns", "st_size", "st_nlink")
    live = {n: await fs.lookup(d["st_ino"], n) for n in frozen}
    for n in frozen:
        assert {k: frozen[n][k] for k in keys} == {k: live[n][k] for k in keys}, n
    assert S.S_IMODE(frozen["f"]["st_mode"]) == 0o640 and S.S_IMODE(sd["st_mode"]) == 0o750
    assert {k: sd[k] for k in keys} == {k: (await fs.getattr(d["st_ino"]))[k] for k in keys}
    f, sdir, ino = frozen["f"]["st_ino"], sd["st_ino"], st["st_ino"]
    changes = {
        "open for writing": fs.open(f, W),
        "open for reading and writing": fs.open(f, os.O_RDWR),
        "open with O_TRUNC": fs.open(f, os.O_RDONLY | os.O_TRUNC),
        "create": fs.create(sdir, "new", 0o644, W, 0, 0),
        "mkdir": fs.mkdir(sdir, "new", 0o755, 0, 0),
        "mknod": fs.mknod(sdir, "fifo", S.S_IFIFO | 0o644, 0, 0, 0),
        "symlink": fs.symlink(sdir, "new", "f", 0, 0),
        "link into it": fs.link(ino, sdir, "new"),
        "unlink": fs.unlink(sdir, "f"),
        "rmdir": fs.rmdir(sdir, "sub"),
        "rename inside": fs.rename(sdir, "f", sdir, "g", 0),
        "rename out": fs.rename(sdir, "f", d["st_ino"], "g", 0),
        "rename in": fs.rename(d["st_ino"], "f", sdir, "g", 0),
        "truncate": fs.setattr(f, {"size": 0}),
        "chmod": fs.setattr(f, {"mode": S.S_IFREG | 0o600}),
        "chmod a directory": fs.setattr(frozen["sub"]["st_ino"], {"mode": S.S_IFDIR | 0o755}),
        "chown": fs.setattr(f, {"uid": 0}),
        "utime": fs.setattr(sdir, {"mtime_ns": 1}),
        "setxattr": fs.setxattr(f, "user.note", b"x"),
        "removexattr": fs.setxattr(sdir, "user.note", None),
    }
    for what, call in changes.items():
        assert await code_of(call) == errno.EROFS, what
    assert await code_of(fs.link(f, d["st_ino"], "g")) == errno.EXDEV  # a name in the live tree
    assert await read_all(fs, f) == b"frozen"
    assert [n for n, _ in await fs.readdir(sdir)] == ["f", "l", "sub"]
    assert sub["st_ino"] != frozen["sub"]["st_ino"]  # (the snapshot's own inode numbers)
