"""Across real processes: 3 nodes, R=2, 100 files of 1 B to 64 MiB, two node losses."""

import hashlib
import os
import re

import numpy as np
import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.launch.local import wait_settled

pytestmark = pytest.mark.cluster


def file_sizes(n=100, seed=3):
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(0, np.log(64 << 20), n - 2)).astype(int).tolist()
    return [1, 64 << 20] + sizes


async def read_all_and_check(client, digests):
    for path, digest in digests.items():
        data = await client.paths.read_file(path)
        assert hashlib.sha256(data).hexdigest() == digest, path


async def test_kill_restart_resync_kill_another(local_cluster):
    lc = await local_cluster(nodes=3, replicas=2)
    rng = np.random.default_rng(7)
    digests = {}
    async with Client.connect(lc.cfg) as c:
        await c.paths.makedirs("/data")
        for i, size in enumerate(file_sizes()):
            blob = rng.integers(0, 256, size, dtype=np.uint8)
            await c.paths.write_file(f"/data/f{i:03d}", blob)
            digests[f"/data/f{i:03d}"] = hashlib.sha256(blob).hexdigest()
        total = sum(file_sizes())

        lc.kill("n2")  # kill -9
        await read_all_and_check(c, digests)

        # restart with the same command line: it resyncs before it serves
        lc.start("n2")
        await wait_settled(lc.cfg, timeout=120)
        log = lc.log_of("n2")
        assert "resync:" in log and re.search(r"resync: \d+/\d+ stripes", log), log[-2000:]
        assert "resync of node n2 done" in log

        lc.kill("n3")
        await read_all_and_check(c, digests)
        lc.check_alive()
    assert total > 100 << 20


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
async def test_status_says_not_whole_while_a_node_is_out_and_whole_once_it_caught_up(local_cluster):
    """A node killed leaves every stripe it is a home of with one serving copy: the nodes left
    count them degraded (server/health.py) and ``irdmafs status`` says "whole: no"; restarted,
    the node catches up, the count goes back to 0 and status says "whole: yes". The figure is
    the one ``wait_settled`` (the chaos soak's settle step) waits on."""
    import subprocess
    import sys

    from irdmafs.launch.local import node_status

    lc = await local_cluster(nodes=3, replicas=2)
    cfg = lc.cfg
    async with Client.connect(cfg) as c:
        for i in range(6):
            await c.paths.write_file(f"/f{i}", os.urandom(3 * cfg.stripe_unit // 2))
    victim = cfg.names[1]
    held = (await node_status(cfg, victim))["stripes"]
    assert held > 0
    lc.kill(victim)

    async def degraded() -> int:
        infos = [await node_status(cfg, n) for n in cfg.names if n != victim]
        return sum((i or {}).get("degraded", 0) for i in infos)

    with trio.fail_after(30):
        while await degraded() < held:  # every stripe the victim was a home of
            await trio.sleep(0.2)

    def status() -> str:
        r = subprocess.run([sys.executable, "-m", "irdmafs", "status", "--config", str(lc.config_path)], capture_output=True, text=True, timeout=60)
        return r.stdout

    assert "whole:     no" in status()
    lc.start(victim)
    await wait_settled(cfg, timeout=60)
    assert await degraded() == 0 and (await node_status(cfg, victim))["degraded"] == 0
    assert "whole:     yes" in status()
