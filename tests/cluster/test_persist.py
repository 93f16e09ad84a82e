"""--persist: the whole cluster stopped (SIGTERM, then kill -9) and started again with the same
command lines: every file, tensor, xattr and snapshot comes back bit-identical."""

import signal
import stat as S

import numpy as np
import pytest

from irdmafs.client.client import Client
from irdmafs.launch.local import LocalCluster, wait_settled, write_config

pytestmark = pytest.mark.cluster

MiB = 1 << 20


async def snapshot_of(c: Client) -> dict:
    """Every file's bytes and attributes that matter, live and in snapshot 'before'."""
    out = {}

    async def walk(ino: int, path: str, snap: int = 0) -> None:
        for name, attr in await c.readdir(ino, snap):
            p = f"{path}/{name}"
            if attr["mode"] & 0o040000:
                out[p] = ("dir", attr["mode"], dict(attr["xattrs"]))
                await walk(attr["ino"], p, snap)
            elif not S.S_ISREG(attr["mode"]):  # links and special files: what they are and name
                out[p] = ("node", attr["mode"], attr["nlink"], attr.get("target"), attr.get("rdev"))
            else:
                data = await c.read(attr["ino"], 0, attr["size"], attr, snap)
                out[p] = ("file", attr["mode"], attr["size"], attr["nlink"], dict(attr["xattrs"]), attr.get("tensor"), data)

    await walk(1, "")
    snaps = await c.snapshots()
    for name, s in snaps.items():
        await walk(1, f"@{name}", s["id"])
    return out


# sigterm behind --long: the quick suite took 10 min 45 s on 2026-12-03 (docs/testing.md)
@pytest.mark.parametrize("stop", [pytest.param(signal.SIGTERM, marks=pytest.mark.long), signal.SIGKILL], ids=["sigterm", "kill-9"])
async def test_whole_cluster_restart_brings_everything_back(tmp_path, stop, etcd_endpoints):
    path = write_config(tmp_path / "c", 3, 2, stripe_unit=MiB, transport=["tcp"], heartbeat=0.2, down_after=1.0, coordinator=etcd_endpoints)
    lc = LocalCluster(path, persist=tmp_path / "data")
    lc.start_all()
    try:
        await wait_settled(lc.cfg)
        rng = np.random.default_rng(3)
        async with Client.connect(lc.cfg) as c:
            await c.paths.makedirs("/model/layer1")
            d = await c.paths.resolve("/model")
            await c.setxattr(d["ino"], "user.irdma.sync", "bsp")
            await c.paths.save("/model/layer1/w.npy", rng.standard_normal((300, 700)).astype(np.float32))
            await c.paths.save("/model/b.npy", np.arange(10, dtype=np.float64))
            await c.paths.write_file("/blob", rng.integers(0, 255, 5 * MiB + 3, dtype=np.uint8))
            blob = await c.paths.resolve("/blob")
            await c.link(blob["ino"], 1, "blob-again")
            await c.symlink(1, "latest", "model/b.npy")
            await c.mknod(1, "fifo", S.S_IFIFO | 0o600)
            await c.mknod(1, "dev", S.S_IFCHR | 0o600, rdev=(1 << 8) | 3)
            await c.take_snapshot("before")
            await c.paths.write_file("/blob", rng.integers(0, 255, 2 * MiB, dtype=np.uint8))  # after the snapshot
            await c.paths.write_file("/small", np.frombuffer(b"tiny", np.uint8))
            before = await snapshot_of(c)
        for name in list(lc.procs):
            lc.kill(name, stop)
        lc.start_all()  # the same command lines
        await wait_settled(lc.cfg)
        async with Client.connect(lc.cfg) as c:
            after = await snapshot_of(c)
            w = await c.paths.load("/model/layer1/w.npy")
        assert after == before and w.shape == (300, 700)
        assert after["/latest"][3] == "model/b.npy" and after["/dev"][4] == (1 << 8) | 3 and after["/blob-again"][3] == 2
        assert "@before/blob" in after and after["@before/blob"][2] == 5 * MiB + 3 and after["/blob"][2] == 2 * MiB
    finally:
        lc.stop_all()
