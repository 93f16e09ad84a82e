"""The mount when nodes die or the cluster is full: the errno a user sees, and nothing lost."""

import errno
import os

import numpy as np
import pytest

pytestmark = pytest.mark.mount

MiB = 1 << 20


async def test_one_node_down_changes_nothing_for_the_user(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    m = mount(lc)
    arrays = {f"t{i}": np.random.default_rng(i).standard_normal(300_000 + i) for i in range(6)}
    os.mkdir(m / "model")
    for name, a in arrays.items():
        np.save(m / "model" / f"{name}.npy", a)
    lc.kill("n2")
    for name, a in arrays.items():  # no ENOTCONN, no EIO
        assert np.array_equal(np.load(m / "model" / f"{name}.npy"), a)
    np.save(m / "model" / "after.npy", np.arange(10))  # writes go on too
    assert np.array_equal(np.load(m / "model" / "after.npy"), np.arange(10))
    assert sorted(os.listdir(m / "model")) == sorted([f"{n}.npy" for n in arrays] + ["after.npy"])


async def test_every_replica_down_is_eio_with_a_log_line(local_cluster, mount):
    lc = await local_cluster(nodes=2, replicas=1, stripe_unit=MiB, op_timeout=1.0)
    m = mount(lc)
    (m / "f").write_bytes(os.urandom(4 * MiB))  # stripes on both nodes
    meta_primary = lc.cfg.names[0]
    victim = lc.cfg.names[1]  # keep the metadata primary: lookups work, data on n2 does not
    lc.kill(victim)
    with pytest.raises(OSError) as err:
        (m / "f").read_bytes()
    assert err.value.errno == errno.EIO
    log = (m.parent / "mnt.log").read_text()
    assert "no live replica holds it" in log and victim in log and meta_primary != victim


@pytest.mark.long  # half a minute of filling: scripts/test --long
async def test_cluster_full_is_enospc(local_cluster, mount):
    # the capacity counts the staging regions the mount's writes land in (server/budget.py)
    lc = await local_cluster(nodes=2, replicas=2, stripe_unit=MiB, capacity="24MiB")
    m = mount(lc)
    (m / "small").write_bytes(b"x" * MiB)
    with pytest.raises(OSError) as err:
        with open(m / "big", "wb") as f:
            f.write(os.urandom(48 * MiB))
    assert err.value.errno == errno.ENOSPC
    assert (m / "small").read_bytes() == b"x" * MiB


async def test_mount_process_killed_with_kill_9_leaves_no_hung_mountpoint_and_loses_nothing(local_cluster, tmp_path):
    """auto_unmount detaches the mount when its process dies; mounting again shows every file
    that was closed before the kill; a mount whose process died without auto_unmount is
    detached by the next mount over it."""
    import signal
    import subprocess
    import sys
    import time

    from irdmafs.launch.mount import clear_dead_mount, is_mounted, unmount, wait_for_mount

    lc = await local_cluster(nodes=2, replicas=2)
    mp = tmp_path / "ps"
    mp.mkdir()

    def start():
        proc = subprocess.Popen(
            [sys.executable, "-m", "irdmafs", "mount", "--config", str(lc.config_path), str(mp), "-f"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_mount(str(mp), proc)
        return proc

    proc = start()
    data = os.urandom(5 * MiB)
    (mp / "kept").write_bytes(data)
    f = open(mp / "open-at-kill", "wb")
    f.write(b"x" * 1000)  # never flushed: may be lost, and may not break anything
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while is_mounted(str(mp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_mounted(str(mp))  # detached by auto_unmount, so nothing can hang on it
    assert os.listdir(mp) == []  # the bare directory
    try:
        f.close()
    except OSError:
        pass
    proc = start()
    assert (mp / "kept").read_bytes() == data

    # without the helper that auto-unmounts (killed first), the mountpoint is left dead
    helper = subprocess.run(["pgrep", "-f", f"fusermount3.*{mp}"], capture_output=True, text=True).stdout.split()
    for pid in helper:
        os.kill(int(pid), signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if helper:
        assert is_mounted(str(mp))
        with pytest.raises(OSError) as err:
            os.listdir(mp)
        assert err.value.errno == errno.ENOTCONN  # not a hang: an error at once
    # what a user types: irdmafs mount over it detaches the dead mount first
    r = subprocess.run([sys.executable, "-m", "irdmafs", "mount", "--config", str(lc.config_path), str(mp)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        assert (mp / "kept").read_bytes() == data
    finally:
        unmount(str(mp))
    assert not clear_dead_mount(str(mp))  # nothing mounted: nothing to do


async def held_stripe_bytes(lc) -> int:
    """Stripe memory the nodes hold, as their budgets count it (server/budget.py)."""
    from irdmafs.launch.local import node_status

    total = 0
    for name in lc.cfg.names:
        total += (await node_status(lc.cfg, name))["held"].get("stripes", 0)
    return total


def allocated(root) -> int:
    """Bytes the files under ``root`` take, as ``du`` counts them (st_blocks)."""
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(root) for f in files)


async def test_a_write_that_fails_full_holds_no_space_past_the_files_end(local_cluster, mount):
    """ENOSPC in the middle of a new file, of an append and of an overwrite: the stripes the
    failed write committed past the file's end are freed (df and du agree), the file keeps its
    size, and what was acknowledged before reads back. The mount logs the ENOSPC once, naming
    what holds the memory."""
    lc = await local_cluster(nodes=2, replicas=1, stripe_unit=MiB, capacity="48MiB")
    m = mount(lc)
    kept = os.urandom(8 * MiB)
    (m / "kept").write_bytes(kept)
    base = await held_stripe_bytes(lc)
    assert base <= 8 * MiB + 2 * MiB and allocated(m) == 8 * MiB

    def fill(path, mode, nbytes):
        with pytest.raises(OSError) as err:
            with open(path, mode) as f:
                for _ in range(nbytes // MiB):
                    f.write(os.urandom(MiB))
        assert err.value.errno == errno.ENOSPC

    fill(m / "fill.bin", "wb", 200 * MiB)  # a new file
    assert (m / "fill.bin").stat().st_size == 0
    assert await held_stripe_bytes(lc) <= base + MiB, "space held past a failed file's end"
    fill(m / "kept", "ab", 200 * MiB)  # an append
    assert (m / "kept").stat().st_size == 8 * MiB and (m / "kept").read_bytes() == kept
    assert await held_stripe_bytes(lc) <= base + MiB
    assert allocated(m) == 8 * MiB
    log = (m.parent / "mnt.log").read_text()
    assert "ENOSPC" in log and "node full" in log, "the ENOSPC was not logged with what holds the memory"
    assert log.count("node full") <= 3, "ENOSPC logged once per write, not once per episode"
    from irdmafs.client.client import Client
    from irdmafs.client.nodes import stray_stripes

    async with Client.connect(lc.cfg) as c:
        assert await stray_stripes(c) == []  # no stripe past any file's end
    (m / "fill.bin").write_bytes(b"after")  # space is there again
    assert (m / "fill.bin").read_bytes() == b"after"
