"""Shared fixtures: a real etcd, real PS node processes on loopback, and real FUSE mounts of them."""

import ast
import gc
import os
import shutil
import subprocess
import sys

import pytest

from irdmafs.launch.etcd_process import LocalEtcd
from irdmafs.launch.local import LocalCluster, wait_settled, write_config
from irdmafs.launch.mount import stop_background, wait_for_mount
from irdmafs import formats

# CPython 3.11 counts the AST constructor's recursion depth in state its threads share
# (python/cpython#106905): test threads that np.load side by side (numpy parses each header with
# ast.literal_eval) failed now and then with SystemError "AST constructor recursion depth
# mismatch" (test_training_failover, 2026-12-03). In the tests' own process, one at a time, as
# irdmafs.formats parses its own headers.
ast.literal_eval = formats.literal_eval


def pytest_collection_modifyitems(config, items):
    """Long runs (``@pytest.mark.long``) only with ``scripts/test --long`` (IRDMAFS_LONG=1): CI
    runs them; the quick start's test command stays under ten minutes."""
    if os.environ.get("IRDMAFS_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="a long run: scripts/test --long (IRDMAFS_LONG=1) runs it, as CI does")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _collected_and_frozen():
    """Each test starts with the run's garbage collected and every object still alive frozen
    (``gc.freeze``): the collector's full passes in the test see only the test's own objects.
    Without it a full pass walked everything the run had imported (torch, transformers,
    Hypothesis: 300,000-450,000 objects, 0.10-0.32 s on this VM), with the loop stopped; an
    in-process cluster's nodes (``down_after`` 0.3 s, one process) then all fenced themselves
    mid-test, and a test counting what a step's pulls do counted the resync's calls too."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory):
    """One etcd for the whole run: every cluster keeps its views under its own prefix (the hash
    of its token, server/leases.py), so clusters of different tests never meet. A test that
    stops or kills etcd starts its own (tests/cluster/test_coordinator.py)."""
    with LocalEtcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def etcd_endpoints(shared_etcd):
    """The coordinator a test's own config names (``write_config(..., coordinator=...)``)."""
    return [shared_etcd.endpoint]


@pytest.fixture
async def local_cluster(tmp_path, etcd_endpoints):
    """``await local_cluster(nodes=3, replicas=2, ...)``: node processes from a fresh config,
    coordinated by the run's etcd unless ``coordinator=`` names another."""
    clusters = []

    async def make(nodes=3, replicas=2, **kw):
        kw.setdefault("coordinator", etcd_endpoints)
        path = write_config(tmp_path / f"c{len(clusters)}", nodes, replicas, transport=["tcp"], heartbeat=0.2, down_after=1.0, **kw)
        lc = LocalCluster(path)
        clusters.append(lc)
        lc.start_all()
        await wait_settled(lc.cfg)
        return lc

    yield make
    for lc in clusters:
        lc.stop_all()


def fuse_unavailable() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if not shutil.which("fusermount3"):
        return "fusermount3 is not installed (apt-get install fuse3)"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        return f"pyfuse3 does not import: {exc}"
    return None


@pytest.fixture
async def mount(tmp_path, local_cluster):
    """``mount(cluster, name)``: ``irdmafs mount -f`` in a subprocess, live when it returns.
    Unmounted with ``fusermount3 -u -z`` afterwards, before the cluster stops (hence async and
    after local_cluster); a traceback in its log fails the test."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mounts = []

    def make(lc, name="mnt", options=None):
        mp = tmp_path / name
        mp.mkdir()
        log = tmp_path / f"{name}.log"
        cmd = [sys.executable, "-m", "irdmafs", "mount", "--config", str(lc.config_path), str(mp), "-f"]
        if options:
            cmd += ["-o", options]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        mounts.append((mp, proc, log))
        wait_for_mount(str(mp), proc, log_path=log)
        return mp

    yield make
    problems = []
    for mp, proc, log in mounts:
        stop_background(str(mp), proc)
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            problems.append(f"{log}:\n{text[-3000:]}")
    assert not problems, "\n".join(problems)
