"""Copies in and out of a real mount with the tools people use (issue 55): rsync -aHAX and cp -a
copy nothing twice and stamp nothing the mount made up; a backup and a restore through a
snapshot keep bytes and modes; a bad policy fails setfattr at once, with the reason in the log."""

import errno
import os
import re
import stat as S
import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.mount

MiB = 1 << 20


@pytest.fixture
async def ps(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    return lc, mount(lc)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def xattrs(path) -> dict:
    return {n: os.getxattr(path, n, follow_symlinks=False) for n in os.listxattr(path, follow_symlinks=False)}


def tree(top) -> dict:
    """``top`` and every entry under it: kind, mode, mtime (not a link's), its bytes or target,
    its count of names (a file's), and the attributes listxattr lists with their values."""
    st = os.stat(top)
    out = {".": (S.S_IFMT(st.st_mode), S.S_IMODE(st.st_mode), st.st_mtime_ns, None, 0, xattrs(top))}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, top)
            what = os.readlink(p) if S.S_ISLNK(st.st_mode) else open(p, "rb").read() if S.S_ISREG(st.st_mode) else None
            mtime = None if S.S_ISLNK(st.st_mode) else st.st_mtime_ns
            out[rel] = (S.S_IFMT(st.st_mode), S.S_IMODE(st.st_mode), mtime, what, st.st_nlink if S.S_ISREG(st.st_mode) else 0, xattrs(p))
    return out


def source(root):
    """A model directory as a checkpoint holds it: tensors, a plain file with a user attribute,
    a hard link, a symbolic link, a subdirectory of its own mode; the model's policies set."""
    model = root / "bert"
    (model / "enc").mkdir(parents=True)
    np.save(model / "w.npy", np.arange(300_000, dtype=np.float32))  # > 1 stripe
    np.save(model / "enc" / "b.npy", np.ones(7, np.float64))
    (model / "config.json").write_text('{"layers": 2}')
    os.setxattr(model / "config.json", "user.note", b"kept")
    os.link(model / "config.json", model / "config.hard")
    os.symlink("w.npy", model / "latest")
    os.chmod(model / "enc", 0o750)
    os.chmod(model / "w.npy", 0o640)
    for k, v in {"sync": "ssp:2", "workers": "2", "optimizer": "sgd lr=0.1", "compress": "fp16", "timeout": "30"}.items():
        os.setxattr(model, f"user.irdma.{k}", v.encode())
    # times of its own, from before: rsync compares times to the second, so a directory whose
    # time is within the second of the copy's last rename is not set again (on any file system)
    for k, p in enumerate(sorted(model.rglob("*"), reverse=True) + [model]):
        if not p.is_symlink():
            os.utime(p, ns=(1_600_000_000_000_000_000 + k * 1_000_001, 1_600_000_000_000_000_000 + k * 1_000_001))
    return model


def rsync(a, b) -> list[str]:
    """rsync -aHAX ``a``/ to ``b``/ (exit 0); its itemized changes: what it copied or set."""
    r = run(["rsync", "-aHAXi", "--stats", f"{a}/", f"{b}/"])
    assert r.returncode == 0, r.stdout + r.stderr
    items = [line for line in r.stdout.splitlines() if re.match(r"[<>ch.][fdLDS]\S{9} |\*deleting ", line)]
    assert ("Number of regular files transferred: 0" in r.stdout) == (not [i for i in items if i[1] == "f" and i[0] in "<>"])
    return items


async def test_rsync_aHAX_and_cp_a_in_and_out_copy_nothing_twice_and_stamp_nothing(ps, tmp_path):
    _, m = ps
    src = source(tmp_path / "src")
    want = tree(src)
    # in: everything once, then nothing (no attribute to set again, none refused)
    assert rsync(src, m / "bert")
    assert rsync(src, m / "bert") == []
    assert tree(m / "bert") == want  # what the mount lists is what came in
    assert os.getxattr(m / "bert" / "w.npy", "user.irdma.shape") == b"[300000]"  # read by name
    # out: the same, and no attribute the mount made up on any copy
    out = tmp_path / "out"
    assert rsync(m / "bert", out)
    assert rsync(m / "bert", out) == []
    assert tree(out) == want
    # cp -a out: stamps nothing but the model's own policies; and back in, the same again
    r = run(["cp", "-a", m / "bert", tmp_path / "cp"])
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert tree(tmp_path / "cp") == want
    r = run(["cp", "-a", tmp_path / "cp", m / "again"])
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert tree(m / "again") == want
    assert rsync(tmp_path / "cp", m / "again") == []


async def test_a_backup_and_a_restore_through_a_snapshot_keep_bytes_and_modes(ps, tmp_path):
    _, m = ps
    model = source(m)
    os.chmod(model / "config.json", 0o600)
    os.mkdir(m / ".snapshots" / "s")
    snap = m / ".snapshots" / "s" / "bert"
    for p in ("", "enc", "w.npy", "config.json"):  # its own modes (the write bits were stripped)
        assert S.S_IMODE(os.stat(snap / p).st_mode) == S.S_IMODE(os.stat(model / p).st_mode) != 0o444, p
    want = tree(model)
    assert tree(snap) == want  # and times, owners, bytes, listed attributes
    # every change inside gets EROFS (the write bits show: the mount says no, not the kernel)
    f = snap / "config.json"
    changes = {
        "write": lambda: open(f, "r+b"),
        "O_TRUNC": lambda: os.close(os.open(f, os.O_RDONLY | os.O_TRUNC)),
        "create": lambda: open(snap / "new", "wb"),
        "mkdir": lambda: os.mkdir(snap / "new"),
        "unlink": lambda: os.unlink(f),
        "rmdir": lambda: os.rmdir(snap / "enc"),
        "rename": lambda: os.rename(f, snap / "moved"),
        "chmod": lambda: os.chmod(f, 0o644),
        "utime": lambda: os.utime(f, ns=(1, 1)),
        "truncate": lambda: os.truncate(f, 0),
        "setxattr": lambda: os.setxattr(snap, "user.note", b"x"),
        "removexattr": lambda: os.removexattr(snap, "user.irdma.sync"),
        "symlink": lambda: os.symlink("x", snap / "new"),
        "link": lambda: os.link(m / "bert" / "config.json", snap / "new"),
    }
    for what, change in changes.items():
        with pytest.raises(OSError) as err:
            change()
        assert err.value.errno == errno.EROFS, what
    # backups with rsync -a, cp -a and tar: byte- and mode-exact
    run(["rsync", "-aHX", f"{snap}/", f"{tmp_path / 'rsync'}/"], check=True)
    run(["cp", "-a", snap, tmp_path / "cp"], check=True)
    run(["tar", "--format=posix", "--xattrs", "--xattrs-include=user.*", "-C", snap.parent, "-cf", tmp_path / "b.tar", "bert"], check=True)
    (tmp_path / "tar").mkdir()
    run(["tar", "--xattrs", "--xattrs-include=user.*", "-C", tmp_path / "tar", "-xpf", tmp_path / "b.tar"], check=True)
    for b in ("rsync", "cp"):
        assert tree(tmp_path / b) == want, b
    assert tree(tmp_path / "tar" / "bert") == want
    # the live model changed, then restored from the snapshot: as it was
    os.chmod(model / "w.npy", 0o666)
    np.save(model / "w.npy", np.zeros(300_000, np.float32))
    os.unlink(model / "latest")
    run(["rsync", "-aHX", "--delete", f"{snap}/", f"{model}/"], check=True)
    assert tree(model) == want
    run(["cp", "-a", snap, m / "restored"], check=True)
    assert tree(m / "restored") == want
    os.mkdir(m / "untarred")
    run(["tar", "--xattrs", "--xattrs-include=user.*", "-C", m / "untarred", "-xpf", tmp_path / "b.tar"], check=True)
    assert tree(m / "untarred" / "bert") == want


async def test_setfattr_of_a_bad_policy_fails_at_once_and_the_mount_log_says_why(ps):
    _, m = ps
    os.mkdir(m / "net")
    bad = [("sync", "nonsense"), ("sync", "ssp:-1"), ("workers", "abc"), ("optimizer", "rmsprop"), ("compress", "fp17"), ("timeout", "abc"), ("timeout", "-5")]
    for k, v in bad:
        r = run(["setfattr", "-n", f"user.irdma.{k}", "-v", v, m / "net"])
        assert r.returncode != 0 and "Invalid argument" in r.stderr, (k, v, r.stderr)
    r = run(["setfattr", "-n", "user.irdma.bogus", "-v", "1", m / "net"])
    assert r.returncode != 0 and "Operation not supported" in r.stderr, r.stderr
    assert run(["getfattr", "-d", "-m", "-", m / "net"]).stdout == ""  # nothing kept
    run(["setfattr", "-n", "user.irdma.workers", "-v", "2", m / "net"], check=True)
    assert "user.irdma.workers=\"2\"" in run(["getfattr", "-d", m / "net"], check=True).stdout
    run(["setfattr", "-x", "user.irdma.workers", m / "net"], check=True)  # back to the default
    log = (m.parent / "mnt.log").read_text()
    for k, v in bad:
        assert log.count(f"user.irdma.{k}={v!r}") == 1, (k, v)
    assert "user.irdma.bogus" in log
