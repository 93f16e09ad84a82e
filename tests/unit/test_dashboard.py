"""The Grafana dashboard in deploy/ queries only metric names the endpoints export.

The names exported are read from ``irdmafs/metrics.py`` (a node's samples) and
``irdmafs/fs/status.py`` (a mount's): every sample they make, with the names
Prometheus' text format gives them: a histogram's ``_bucket``, ``_sum`` and ``_count``); the long
test ``tests/mount/test_prometheus.py`` checks the dashboard again against a live scrape."""

import json
import re
from pathlib import Path

from irdmafs import metrics
from irdmafs.fs import status

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "irdmafs.json"


def exported_names() -> set[str]:
    source = Path(metrics.__file__).read_text() + Path(status.__file__).read_text()
    names = set()
    for name, kind in re.findall(r'\(\s*"(irdmafs_\w+)",\s*"(counter|gauge|histogram)"', source):
        names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    for name in re.findall(r'latency_samples\(\s*"(irdmafs_\w+)"', source):
        names |= {name + s for s in ("_bucket", "_sum", "_count")}
    return names


def dashboard_exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def queried_names(exprs: list[str]) -> set[str]:
    return {n for e in exprs for n in re.findall(r"\birdmafs_\w+", e)}


def test_the_metric_names_are_read_from_the_sources():
    names = exported_names()
    assert {"irdmafs_node_up", "irdmafs_worker_pushes", "irdmafs_mount_bytes_total", "irdmafs_node_call_seconds_bucket"} <= names


def test_the_dashboard_queries_only_exported_metric_names():
    doc = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(doc)
    assert exprs and all(queried_names([e]) for e in exprs)
    assert sorted(queried_names(exprs) - exported_names()) == []


def test_the_dashboard_shows_steps_and_bytes_per_node():
    queried = queried_names(dashboard_exprs(json.loads(DASHBOARD.read_text())))
    assert {"irdmafs_worker_pushes", "irdmafs_node_bytes", "irdmafs_node_served_bytes_total"} <= queried
