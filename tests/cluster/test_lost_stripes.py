"""Real node processes on loopback: a node that comes back without its data (restarted without
``--persist``, or its persisted directory gone) never serves zeros for the stripes it lost. At
R=1 every read of them gets EIO naming the stripe and the node, and the node's status counts
them; at R=2 it resyncs them from the other home first; restarted with its data, nothing is
lost (server/missing.py)."""

import os
import shutil
import signal

import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.errors import Unavailable
from irdmafs.launch.local import LocalCluster, node_status, wait_settled, write_config
from irdmafs.util import leaves

pytestmark = pytest.mark.cluster

MiB = 1 << 20


async def read_or_eio(c: Client, path: str) -> bytes | str:
    """The file's bytes, or the message of the EIO its read got."""
    try:
        return await c.paths.read_file(path)
    except (Unavailable, BaseExceptionGroup) as exc:
        errors = list(leaves(exc)) if isinstance(exc, BaseExceptionGroup) else [exc]
        assert all(isinstance(e, Unavailable) for e in errors), errors
        return str(errors[0])


async def holder_of(c: Client, lc: LocalCluster, fid: int, stripes: int) -> str:
    """A node that holds stripes of file ``fid`` (as its stripe listing says)."""
    for name in lc.cfg.names:
        listing = (await c.cluster.call(name, "stripes"))["stripes"]
        if any(f == fid and snap == 0 and idx < stripes for f, idx, snap, *_ in listing):
            return name
    raise AssertionError("no node holds the file")


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_node_back_without_its_data_never_serves_zeros(tmp_path, etcd_endpoints, replicas):
    path = write_config(tmp_path / "c", 3, replicas, stripe_unit=MiB, transport=["tcp"], heartbeat=0.2, down_after=1.0, coordinator=etcd_endpoints)
    lc = LocalCluster(path, persist=tmp_path / "data")
    lc.start_all()
    try:
        await wait_settled(lc.cfg)
        data = os.urandom(12 * MiB + 5)
        async with Client.connect(lc.cfg) as c:
            fid = (await c.paths.write_file("/model.bin", data))["ino"]
            victim = await holder_of(c, lc, fid, 13)
        # 1. killed and restarted with its data (--persist): nothing lost
        lc.kill(victim, signal.SIGKILL)
        lc.start(victim)
        await wait_settled(lc.cfg)
        async with Client.connect(lc.cfg) as c:
            assert await read_or_eio(c, "/model.bin") == data
        assert (await node_status(lc.cfg, victim))["lost"] == {"stripes": 0, "bytes": 0}
        # 2. killed and restarted without it (its directory gone, as a node without --persist)
        lc.kill(victim, signal.SIGKILL)
        shutil.rmtree(lc.persist / victim)
        lc.start(victim)
        await wait_settled(lc.cfg, whole_too=False)
        status = await node_status(lc.cfg, victim)
        async with Client.connect(lc.cfg) as c:
            got = await read_or_eio(c, "/model.bin")
            if replicas == 2:  # resynced from the other home before it served
                assert got == data and status["lost"] == {"stripes": 0, "bytes": 0}
            else:
                assert isinstance(got, str), "a lost stripe read back as bytes"
                assert f"of file {fid}: lost" in got and f"node {victim}" in got
                assert status["lost"]["stripes"] >= 1 and status["lost"]["bytes"] == status["lost"]["stripes"] * MiB
                assert f"node {victim} came back without" in lc.log_of(victim)
                await c.paths.write_file("/model.bin", data)  # written again: whole
                assert await read_or_eio(c, "/model.bin") == data
                assert (await node_status(lc.cfg, victim))["lost"] == {"stripes": 0, "bytes": 0}
    finally:
        lc.stop_all()
