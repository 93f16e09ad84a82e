"""A node restarted under a live mount: what the mount cached of the old process is dropped.

The sequence (issue 13): kill -9 node A, write, restart A from its own command line, wait until
it is ready again, kill -9 node B, then write: those writes land on the restarted A, through
region keys and staging slots the mount must fetch again from A's new incarnation (before, it
used the old ones: EIO, "unknown rkey" in its log). Once for a data node, once for the metadata
primary; plain file writes checked byte for byte, then fio with its own crc32c verification.
"""

import shutil
import subprocess

import numpy as np
import pytest

from irdmafs.launch.local import wait_settled

pytestmark = pytest.mark.mount

MiB = 1 << 20


def _files(m, tag: str, n: int = 6) -> dict:
    """Files of several stripes each (with 1 MiB stripes), on every node; returns their content."""
    rng = np.random.default_rng(len(tag) * 100 + n)
    out = {}
    for i in range(n):
        data = rng.bytes(int(rng.integers(1, 5 * MiB)))
        (m / f"{tag}{i}").write_bytes(data)
        out[f"{tag}{i}"] = data
    return out


# one case behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
@pytest.mark.parametrize("victim", ["data", pytest.param("meta", marks=pytest.mark.long)])
async def test_writes_after_a_restart_then_another_kill_land_and_verify(local_cluster, mount, victim):
    if not shutil.which("fio"):
        pytest.skip("fio is not installed (scripts/setup installs it)")
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    m = mount(lc)
    written = _files(m, "before")  # the mount now holds staging slots and keys on every node
    names = lc.cfg.names
    a = names[0] if victim == "meta" else names[1]  # n1 is the metadata primary
    b = next(n for n in names if n != a and n != names[0]) if victim == "data" else names[1]
    lc.kill(a)
    written |= _files(m, "while_down")
    lc.start(a)  # the same command line, as a user would run it again
    await wait_settled(lc.cfg)  # resynced: everything written meanwhile is on A again
    lc.kill(b)
    written |= _files(m, "after")
    for name, data in written.items():
        assert (m / name).read_bytes() == data, name
    fio = subprocess.run(
        ["fio", "--name=v", f"--directory={m}", "--rw=randwrite", "--bs=64k", "--size=16m", "--numjobs=2", "--verify=crc32c", "--verify_state_save=0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fio.returncode == 0, fio.stdout[-3000:] + fio.stderr[-3000:]
    assert "err= 0" in fio.stdout and "verify:" not in fio.stdout
    log = (m.parent / "mnt.log").read_text()
    assert "unknown rkey" not in log
    assert f"node {a} restarted (incarnation" in log  # the mount saw the new incarnation
