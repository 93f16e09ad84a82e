"""A real mount says what serves its data plane (runtime/dataplane.py): its one line at start, its
``.irdma/cluster``, ``irdmafs status`` from it (the mount's line and one per node) and its
metrics (``irdmafs_data_plane_info{role="mount"}``); started with IRDMAFS_NATIVE=0, it says numpy
and why while its nodes say what they run."""

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from irdmafs import native
from irdmafs.launch.local import free_ports
from irdmafs.launch.mount import mount_background, stop_background

from ..conftest import fuse_unavailable

pytestmark = pytest.mark.mount


def info_samples(port: int) -> list[dict]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [s.labels | {"value": s.value} for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "irdmafs_data_plane_info"]


async def test_a_mount_reports_its_data_plane_and_status_prints_the_nodes_too(tmp_path, local_cluster):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    lc = await local_cluster(nodes=2, replicas=2)
    [port] = free_ports(1)
    mp = tmp_path / "mnt"
    mp.mkdir()
    log = tmp_path / "mnt.log"
    proc = mount_background(str(lc.config_path), str(mp), [], log, metrics=f"127.0.0.1:{port}", launcher=["env", "IRDMAFS_NATIVE=0"])
    try:
        doc = json.loads((mp / ".irdma" / "cluster").read_text())
        assert doc["transport"] == "tcp"
        assert doc["kernels"] == {"native": False, "why": "IRDMAFS_NATIVE=0"}
        assert doc["engine"]["name"] in ("native", "python") and doc["engine"]["why"]
        deadline = time.monotonic() + 20
        while not all("kernels" in n for n in doc["nodes"]):  # the mount's heartbeats bring them
            assert time.monotonic() < deadline, doc["nodes"]
            time.sleep(0.2)
            doc = json.loads((mp / ".irdma" / "cluster").read_text())
        assert all(n["kernels"] == {"native": native.NATIVE, "why": native.WHY} for n in doc["nodes"])  # not the mount's

        r = subprocess.run([sys.executable, "-m", "irdmafs", "status", str(mp)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("data plane ")]
        assert len(lines) == 3, r.stdout
        assert lines[0].startswith(f"data plane mount {mp}: transport tcp, engine ") and lines[0].endswith("kernels numpy (IRDMAFS_NATIVE=0)")
        want = "kernels native C" if native.NATIVE else f"kernels numpy ({native.WHY})"
        assert [ln.split(":")[0] for ln in lines[1:]] == ["data plane n1", "data plane n2"]
        assert all(ln.endswith(want) for ln in lines[1:]), r.stdout

        [info] = info_samples(port)
        assert info["role"] == "mount" and info["transport"] == "tcp" and info["value"] == 1
        assert info["kernels"] == "numpy" and info["kernels_why"] == "IRDMAFS_NATIVE=0"
        assert info["engine"] == doc["engine"]["name"] and info["engine_why"] == doc["engine"]["why"]

        [started] = [ln for ln in log.read_text().splitlines() if "mounted " in ln]
        assert "(transport tcp, engine " in started and "kernels numpy (IRDMAFS_NATIVE=0); 2 nodes, R=2)" in started, started
    finally:
        stop_background(str(mp), proc)
