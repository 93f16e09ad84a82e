"""Real PS node processes on loopback, started from a generated config."""

import pytest

from irdmafs.local import LocalCluster, wait_settled, write_config


@pytest.fixture
async def local_cluster(tmp_path):
    clusters = []

    async def make(nodes=3, replicas=2, **kw):
        path = write_config(tmp_path / f"c{len(clusters)}", nodes, replicas, transport=["tcp"], heartbeat=0.2, down_after=1.0, **kw)
        lc = LocalCluster(path)
        clusters.append(lc)
        lc.start_all()
        await wait_settled(lc.cfg)
        return lc

    yield make
    for lc in clusters:
        lc.stop_all()
