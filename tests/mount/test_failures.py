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


async def test_cluster_full_is_enospc(local_cluster, mount):
    lc = await local_cluster(nodes=2, replicas=2, stripe_unit=MiB, capacity="2MiB")
    m = mount(lc)
    (m / "small").write_bytes(b"x" * MiB)
    with pytest.raises(OSError) as err:
        with open(m / "big", "wb") as f:
            f.write(os.urandom(4 * MiB))
    assert err.value.errno == errno.ENOSPC
    assert (m / "small").read_bytes() == b"x" * MiB
