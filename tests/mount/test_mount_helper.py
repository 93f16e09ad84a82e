"""``mount -t fuse.irdmafs`` and an fstab line, through the mount.irdmafs helper, for real."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from irdmafs.launch.local import write_config
from irdmafs.launch.mount import is_mounted, unmount
from irdmafs.launch.mount_helper import fuse_mount_options

from ..conftest import fuse_unavailable

pytestmark = pytest.mark.mount

LINK = Path("/sbin/mount.fuse.irdmafs")
HELPER = Path(sys.executable).parent / "mount.irdmafs"


def test_mount_options_drop_what_only_mount8_and_systemd_use():
    opts = "defaults,_netdev,nofail,noauto,user,users,rw,x-systemd.automount,comment=x,allow_other,ro".split(",")
    assert fuse_mount_options(opts) == ["allow_other", "ro"]


@pytest.fixture
def helper_link():
    """/sbin/mount.fuse.irdmafs -> this environment's mount.irdmafs, for the test's duration."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mount(8) with a helper in /sbin needs root and util-linux")
    if not HELPER.exists():
        pytest.skip(f"{HELPER} not installed (pip install -e .)")
    made = False
    if not LINK.exists():
        LINK.symlink_to(HELPER)
        made = True
    elif LINK.resolve() != HELPER.resolve():
        pytest.skip(f"{LINK} exists and points elsewhere")
    yield
    if made:
        LINK.unlink()


@pytest.fixture
def mountpoints(tmp_path):
    made = []

    def make(name):
        mp = tmp_path / name
        mp.mkdir()
        made.append(mp)
        return mp

    yield make
    for mp in made:
        unmount(str(mp), lazy=True)


async def test_mount_t_fuse_irdmafs_returns_with_the_mount_live(local_cluster, helper_link, mountpoints):
    lc = await local_cluster(nodes=2, replicas=2)
    mp = mountpoints("ps")
    r = subprocess.run(["mount", "-t", "fuse.irdmafs", str(lc.config_path), str(mp), "-o", "nofail,_netdev,noauto"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert is_mounted(str(mp))  # live as soon as mount(8) returns
    (mp / "hello.txt").write_text("through mount(8)")
    assert (mp / "hello.txt").read_text() == "through mount(8)"
    assert "fuse.irdmafs" in Path("/proc/self/mounts").read_text()
    r = subprocess.run(["umount", str(mp)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while is_mounted(str(mp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_mounted(str(mp))


async def test_an_fstab_line_mounts_by_mountpoint(local_cluster, helper_link, mountpoints, tmp_path):
    lc = await local_cluster(nodes=2, replicas=2)
    mp = mountpoints("fstab-ps")
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{lc.config_path} {mp} fuse.irdmafs defaults,_netdev,allow_other 0 0\n")
    r = subprocess.run(["mount", "-T", str(fstab), str(mp)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if f" {mp} " in ln)
    assert "allow_other" in line  # kept; _netdev and defaults were not passed to FUSE
    (mp / "x").write_bytes(b"1" * 1000)
    assert (mp / "x").stat().st_size == 1000


async def test_a_bad_config_or_mountpoint_is_one_line_and_exit_1(tmp_path):
    r = subprocess.run([str(HELPER), str(tmp_path / "missing.toml"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("mount.irdmafs: ") and "Traceback" not in r.stderr
    cfg = write_config(tmp_path / "c", 1, 1, coordinator=["http://127.0.0.1:2379"])  # not reached: the mountpoint is refused first
    r = subprocess.run([str(HELPER), str(cfg), str(tmp_path / "nodir")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not a directory" in r.stderr
