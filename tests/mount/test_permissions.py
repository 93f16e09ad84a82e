"""Mode bits and other users: a non-root user (nobody, through setpriv) against a real mount."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from irdmafs.launch.mount import unmount, wait_for_mount

pytestmark = pytest.mark.mount

NOBODY = 65534


def as_nobody(*cmd):
    """Run ``cmd`` as uid/gid 65534 with no supplementary groups; (exit status, stderr)."""
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd], capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture
def root_with_setpriv():
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to act as another user")


@pytest.fixture
def public_mount(tmp_path):
    """``public_mount(lc, options)``: a mount on a directory other users can reach (pytest's
    tmp_path sits below a 0700 directory), unmounted afterwards."""
    made = []

    def make(lc, options=None):
        mp = Path(tempfile.mkdtemp(prefix="irdmafs-perm-"))
        os.chmod(mp, 0o755)
        cmd = [sys.executable, "-m", "irdmafs", "mount", "--config", str(lc.config_path), str(mp), "-f"] + (["-o", options] if options else [])
        log = open(tmp_path / f"{mp.name}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        made.append((mp, proc, log))
        wait_for_mount(str(mp), proc)
        return mp

    yield make
    for mp, proc, log in made:
        unmount(str(mp), lazy=True)
        proc.terminate()
        proc.wait(10)
        log.close()
        mp.rmdir()


async def test_other_users_are_kept_out_without_allow_other(root_with_setpriv, local_cluster, public_mount):
    lc = await local_cluster(nodes=1, replicas=1)
    m = public_mount(lc)
    (m / "f").write_text("root's")
    os.chmod(m / "f", 0o644)
    os.chmod(m, 0o755)
    rc, _, err = as_nobody("cat", str(m / "f"))
    assert rc != 0 and "Permission denied" in err  # FUSE refuses other users outright


async def test_with_allow_other_mode_bits_decide(root_with_setpriv, local_cluster, public_mount):
    lc = await local_cluster(nodes=1, replicas=1)
    m = public_mount(lc, options="allow_other")
    os.chmod(m, 0o755)
    (m / "public").write_text("everyone reads")
    os.chmod(m / "public", 0o644)
    (m / "secret").write_text("root only")
    os.chmod(m / "secret", 0o600)
    (m / "shared").mkdir()
    os.chmod(m / "shared", 0o777)

    rc, out, err = as_nobody("cat", str(m / "public"))
    assert rc == 0 and out == "everyone reads", err
    rc, _, err = as_nobody("cat", str(m / "secret"))
    assert rc != 0 and "Permission denied" in err
    rc, _, err = as_nobody("sh", "-c", f"echo x > {m / 'public'}")
    assert rc != 0 and "Permission denied" in err  # 0644: not writable by others
    rc, _, err = as_nobody("touch", str(m / "mine"))
    assert rc != 0 and "Permission denied" in err  # the root dir is 0755, owned by root
    rc, _, err = as_nobody("sh", "-c", f"echo hers > {m / 'shared' / 'x'}")
    assert rc == 0, err  # a 0777 directory takes new files
    st = os.stat(m / "shared" / "x")
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)  # owned by who made it
    rc, _, err = as_nobody("chmod", "600", str(m / "public"))
    assert rc != 0 and "Operation not permitted" in err  # only the owner (or root) may chmod
    assert (m / "public").read_text() == "everyone reads" and (m / "secret").read_text() == "root only"
