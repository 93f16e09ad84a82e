"""Prometheus endpoints of real node processes and a real mount, scraped over HTTP; the same
figures in .irdma/stats and the status table."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from irdmafs.launch.local import LocalCluster, free_ports, wait_settled, write_config
from irdmafs.launch.mount import unmount, wait_for_mount

from ..conftest import fuse_unavailable

pytestmark = pytest.mark.mount


class MetricsCluster(LocalCluster):
    """Each node also serves metrics, on ports chosen up front."""

    def __init__(self, path, ports):
        super().__init__(path)
        self.metrics = dict(zip(self.cfg.names, ports))

    def command(self, name):
        return super().command(name) + ["--metrics", f"127.0.0.1:{self.metrics[name]}"]


def scrape(port: int) -> dict:
    """{(name, frozenset(labels)): value} of every sample."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
async def metered(tmp_path, etcd_endpoints):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    *node_ports, mount_port = free_ports(3)
    lc = MetricsCluster(write_config(tmp_path / "c", 2, 2, transport=["tcp"], heartbeat=0.2, down_after=1.0, coordinator=etcd_endpoints), node_ports)
    lc.start_all()
    mp = tmp_path / "mnt"
    mp.mkdir()
    log = open(tmp_path / "mnt.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "irdmafs", "mount", "--config", str(lc.config_path), str(mp), "-f", "--metrics", f"127.0.0.1:{mount_port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        await wait_settled(lc.cfg)
        wait_for_mount(str(mp), proc, log_path=tmp_path / "mnt.log")
        yield lc, mp, mount_port
    finally:
        unmount(str(mp), lazy=True)
        proc.terminate()
        proc.wait(10)
        log.close()
        lc.stop_all()


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
async def test_nodes_and_mount_serve_prometheus_metrics(metered):
    lc, mp, mount_port = metered
    (mp / "m").mkdir()
    for k, v in (("sync", "bsp"), ("workers", "1"), ("optimizer", "sgd lr=0.1")):
        os.setxattr(mp / "m", f"user.irdma.{k}", v.encode())
    np.save(mp / "m" / "w.npy", np.zeros(1 << 18, np.float32))  # 1 MiB
    for _ in range(3):
        np.load(mp / ".workers" / "0" / "m" / "w.npy")
        np.save(mp / ".workers" / "0" / "m" / "w.npy", np.ones(1 << 18, np.float32))
    assert np.allclose(np.load(mp / "m" / "w.npy"), -0.3)

    nodes = {name: await trio.to_thread.run_sync(scrape, port) for name, port in lc.metrics.items()}
    assert sum(value(s, "irdmafs_node_bytes") for s in nodes.values()) >= 2 * (1 << 20)  # R=2
    assert all(value(s, "irdmafs_node_up", state="ready") == 1 for s in nodes.values())
    assert sum(s.get(("irdmafs_node_calls_total", frozenset({("method", "commit")})), 0) for s in nodes.values()) >= 1
    assert sum(s.get(("irdmafs_node_served_bytes_total", frozenset({("op", "read")})), 0) for s in nodes.values()) >= 3 * (1 << 20)
    pushes = [v for s in nodes.values() for (n, lab), v in s.items() if n == "irdmafs_worker_pushes" and dict(lab)["rank"] == "0"]
    assert pushes and max(pushes) == 3  # rank 0's clock on the tensor's primaries
    assert any(n == "irdmafs_node_call_seconds_count" for s in nodes.values() for n, _ in s)
    assert all(value(s, "irdmafs_node_replicas_behind") == 0 for s in nodes.values())
    assert all(value(s, "irdmafs_node_lost_stripes") == 0 and value(s, "irdmafs_node_lost_bytes") == 0 for s in nodes.values())

    m = await trio.to_thread.run_sync(scrape, mount_port)
    assert value(m, "irdmafs_mount_bytes_total", dir="pushed") == 3 * (1 << 20)
    assert value(m, "irdmafs_mount_bytes_total", dir="read") >= 4 * (1 << 20)
    assert value(m, "irdmafs_mount_op_seconds_count", op="read") >= 1
    # a heartbeat missed on this loaded machine may count a node down for a moment: settle first
    with trio.move_on_after(15):
        while value(m, "irdmafs_mount_nodes", state="ready") != 2:
            await trio.sleep(0.2)
            m = await trio.to_thread.run_sync(scrape, mount_port)
    assert value(m, "irdmafs_mount_nodes", state="ready") == 2

    stats = json.loads((mp / ".irdma" / "stats").read_text())
    assert stats["metrics"]["irdmafs_mount_bytes_total"][2] == {"labels": {"dir": "pushed"}, "value": 3 * (1 << 20)}
    assert json.loads((mp / ".irdma" / "cluster").read_text())["metrics"] == f"http://127.0.0.1:{mount_port}/metrics"


@pytest.mark.long  # behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
async def test_status_table_shows_the_node_figures(metered):
    lc, mp, _ = metered
    (mp / "f").write_bytes(b"x" * 100_000)
    time.sleep(0.5)  # a heartbeat carries the new figures
    r = subprocess.run([sys.executable, "-m", "irdmafs", "status", str(mp)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    header, *rows = [ln for ln in r.stdout.splitlines() if ln.startswith(("node ", "n"))]
    assert header.split()[-5:] == ["calls", "served", "behind", "degraded", "lost"]
    # lost: "-" from a node that does not report it
    assert len(rows) == 2 and all(row.split()[-1] in ("0", "-") and row.split()[-2] == "0" and row.split()[-3] == "0" for row in rows)
    assert all(int(row.split()[-5]) > 0 for row in rows)
    assert "whole:     yes" in r.stdout
