"""Prometheus for real: Debian's prometheus scrapes a local cluster's endpoints (3 node
processes, R=2, a local etcd as coordinator, and a mount, each with ``--metrics``) from a config
the test writes, and its HTTP API must show a step counter (``irdmafs_worker_pushes``) and a
node's bytes served (``irdmafs_node_served_bytes_total``) moving during a short training run;
``promtool check metrics`` passes on every endpoint's output, and the Grafana dashboard in
deploy/ queries only names the endpoints export.

A long run (``scripts/test --long``): installs prometheus when missing (as root; else skips)."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import trio

from irdmafs.launch.etcd_process import LocalEtcd
from irdmafs.launch.local import free_ports, wait_settled, write_config
from irdmafs.launch.mount import unmount, wait_for_mount
from irdmafs.worker.steps import pull_arrays, push_arrays

from ..conftest import fuse_unavailable
from ..packages import missing
from ..unit.test_dashboard import DASHBOARD, dashboard_exprs, queried_names
from .test_metrics import MetricsCluster

pytestmark = [pytest.mark.mount, pytest.mark.long]

STEPS = 6
SCRAPE_MS = 500  # between scrapes: a short run still sees several


def http_json(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def query(prom: str, expr: str) -> list[dict]:
    doc = http_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def by_instance(prom: str, expr: str) -> dict[str, float]:
    return {r["metric"].get("instance", ""): float(r["value"][1]) for r in query(prom, expr)}


def until(what: str, check, timeout: float):
    """Poll ``check()`` until it answers truthy, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.25)


@pytest.fixture
def prometheus_bin():
    reason = missing(["prometheus"], ["prometheus", "promtool"])
    if reason:
        pytest.skip(reason)
    return shutil.which("prometheus")


@pytest.fixture
async def scraped(tmp_path, prometheus_bin):
    """A cluster with metrics, a mount with metrics, and prometheus scraping all four."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    *node_ports, mount_port, prom_port = free_ports(5)
    procs: list[subprocess.Popen] = []
    mp = tmp_path / "mnt"
    mp.mkdir()
    with LocalEtcd(tmp_path / "etcd") as etcd:
        cfg_path = write_config(tmp_path / "c", 3, 2, transport=["tcp"], coordinator=[etcd.endpoint], heartbeat=0.2, down_after=1.0)
        lc = MetricsCluster(cfg_path, node_ports)
        try:
            lc.start_all()
            log = open(tmp_path / "mnt.log", "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "irdmafs", "mount", "--config", str(lc.config_path), str(mp), "-f", "--metrics", f"127.0.0.1:{mount_port}"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            await wait_settled(lc.cfg)
            wait_for_mount(str(mp), procs[0], log_path=tmp_path / "mnt.log")
            targets = {"node": [f"127.0.0.1:{p}" for p in node_ports], "mount": [f"127.0.0.1:{mount_port}"]}
            conf = tmp_path / "prometheus.yml"
            conf.write_text(
                json.dumps(  # YAML is a superset of JSON
                    {
                        "global": {"scrape_interval": f"{SCRAPE_MS}ms", "scrape_timeout": f"{SCRAPE_MS}ms"},
                        "scrape_configs": [{"job_name": f"irdmafs-{job}", "static_configs": [{"targets": t}]} for job, t in targets.items()],
                    }
                )
            )
            r = subprocess.run(["promtool", "check", "config", str(conf)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
            plog = open(tmp_path / "prometheus.log", "wb")
            procs.append(
                subprocess.Popen(
                    [
                        prometheus_bin,
                        f"--config.file={conf}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prom_port}",  # loopback only
                        "--log.level=warn",
                    ],
                    stdout=plog,
                    stderr=subprocess.STDOUT,
                )
            )
            prom = f"http://127.0.0.1:{prom_port}"
            yield lc, mp, mount_port, prom, tmp_path
        finally:
            for p in reversed(procs[1:]):
                p.terminate()
            unmount(str(mp), lazy=True)
            if procs:
                procs[0].terminate()
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            lc.stop_all()


def prometheus_ready(prom: str, proc_log: Path):
    """Wait until prometheus scrapes all four targets; on failure say which are down and why."""

    def up():
        try:
            return [r for r in query(prom, "up") if r["value"][1] == "1"]
        except OSError:
            return None

    try:
        return until("prometheus scraping every target", lambda: len(up() or []) == 4, 60)
    except AssertionError as e:
        try:
            targets = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in http_json(f"{prom}/api/v1/targets")["data"]["activeTargets"]]
        except OSError as exc:
            targets = f"prometheus does not answer: {exc}"
        raise AssertionError(f"{e}; targets: {targets}; prometheus log: {proc_log.read_text(errors='replace')[-2000:]}") from None


async def test_prometheus_scrapes_steps_and_node_bytes_moving_during_training(scraped):
    lc, mp, mount_port, prom, tmp_path = scraped
    await trio.to_thread.run_sync(prometheus_ready, prom, tmp_path / "prometheus.log")

    (mp / "m").mkdir()
    for k, v in (("sync", "bsp"), ("workers", "1"), ("optimizer", "sgd lr=0.1")):
        os.setxattr(mp / "m", f"user.irdma.{k}", v.encode())
    w = np.zeros(1 << 18, np.float32)  # 1 MiB: stripes on more than one node
    np.save(mp / "m" / "w.npy", w)
    # a first step, so the step counter exists, and a scrape after it: the baseline
    pull_arrays(str(mp), "m", 0, {"w": w})
    push_arrays(str(mp), "m", 0, {"w": np.ones_like(w)})
    first = await trio.to_thread.run_sync(
        until, "a first scrape of the step counter", lambda: by_instance(prom, "max by (instance) (irdmafs_worker_pushes)"), 30
    )
    served_before = by_instance(prom, 'sum by (instance) (irdmafs_node_served_bytes_total{job="irdmafs-node"})')

    for _ in range(STEPS):
        pull_arrays(str(mp), "m", 0, {"w": w})
        push_arrays(str(mp), "m", 0, {"w": np.ones_like(w)})
    pull_arrays(str(mp), "m", 0, {"w": w})
    assert np.allclose(w, -0.1 * (STEPS + 1))

    def moved():
        steps = by_instance(prom, "max by (instance) (irdmafs_worker_pushes)")
        served = by_instance(prom, 'sum by (instance) (irdmafs_node_served_bytes_total{job="irdmafs-node"})')
        grew = {i: v - served_before.get(i, 0) for i, v in served.items() if v > served_before.get(i, 0)}
        return (steps, grew) if steps and max(steps.values()) == STEPS + 1 and grew else None

    steps, grew = await trio.to_thread.run_sync(until, "the step counter and a node's bytes moving in prometheus", moved, 30)
    assert max(first.values()) == 1 and max(steps.values()) == STEPS + 1
    assert max(grew.values()) >= 1 << 20  # at least one pull's stripes served by one node
    assert set(grew) <= {f"127.0.0.1:{p}" for p in lc.metrics.values()}


async def test_promtool_passes_on_every_endpoint_and_the_dashboard_names_exist(scraped):
    lc, mp, mount_port, prom, tmp_path = scraped
    (mp / "m").mkdir()
    for k, v in (("sync", "bsp"), ("workers", "1")):
        os.setxattr(mp / "m", f"user.irdma.{k}", v.encode())
    w = np.zeros(1 << 16, np.float32)
    np.save(mp / "m" / "w.npy", w)
    push_arrays(str(mp), "m", 0, {"w": np.ones_like(w)})
    pull_arrays(str(mp), "m", 0, {"w": w})
    names = set()
    for port in [*lc.metrics.values(), mount_port]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
        assert r.returncode == 0, (port, r.stdout.decode() + r.stderr.decode())
        names |= {ln.split("{")[0].split(" ")[0] for ln in text.decode().splitlines() if ln and not ln.startswith("#")}
    queried = queried_names(dashboard_exprs(json.loads(DASHBOARD.read_text())))
    assert sorted(queried - names) == []
