"""Real node processes report what serves their data plane, each its own (runtime/dataplane.py):
n1 is started with IRDMAFS_NATIVE=0 and IRDMAFS_ENGINE=0, n2 without either (as this machine
runs when not told); their
status (the heartbeat ``irdmafs status`` asks), ``irdmafs status`` and their one line at start
say so per node, with why for what is not native."""

import importlib.util
import json
import subprocess
import sys

import pytest
import trio

from irdmafs.launch.local import LocalCluster, node_status, wait_settled, write_config

pytestmark = pytest.mark.cluster

FORCED = ["env", "IRDMAFS_NATIVE=0", "IRDMAFS_ENGINE=0"]  # n1's launcher
UNTOLD = ["env", "-u", "IRDMAFS_NATIVE", "-u", "IRDMAFS_ENGINE"]  # n2's, whatever this run was told


def untold_kernels() -> dict:
    """What the kernels are in an interpreter not told IRDMAFS_NATIVE (n2's)."""
    code = "import json; from irdmafs.runtime import dataplane; print(json.dumps(dataplane.kernels()))"
    r = subprocess.run([*UNTOLD, sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def plane(shared_etcd, tmp_path_factory):
    """The cluster, each node's status, and ``irdmafs status --config`` as text and as JSON."""
    path = write_config(tmp_path_factory.mktemp("plane"), 2, 2, transport=["tcp"], heartbeat=0.2, down_after=1.0, coordinator=[shared_etcd.endpoint])
    lc = LocalCluster(path)
    lc.launcher["n1"], lc.launcher["n2"] = FORCED, UNTOLD
    lc.start_all()
    try:
        trio.run(wait_settled, lc.cfg)

        async def statuses():
            return {name: await node_status(lc.cfg, name) for name in lc.cfg.names}

        status = trio.run(statuses)

        def cli(*args):
            r = subprocess.run([sys.executable, "-m", "irdmafs", "status", "--config", str(path), *args], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
            return r.stdout

        yield lc, status, cli(), json.loads(cli("--json"))
    finally:
        lc.stop_all()


def test_each_node_reports_its_kernels_with_why_and_status_prints_them_per_node(plane):
    lc, status, table, doc = plane
    n1, n2 = status["n1"], status["n2"]
    assert n1["transport"] == n2["transport"] == "tcp"
    assert n1["kernels"] == {"native": False, "why": "IRDMAFS_NATIVE=0"}
    untold = untold_kernels()
    assert n2["kernels"] == untold  # as this machine builds them
    for n in (n1, n2):
        assert n["engine"]["name"] in ("native", "python") and n["engine"]["why"]
    lines = [ln for ln in table.splitlines() if ln.startswith("data plane ")]
    assert len(lines) == 2, table
    assert lines[0].startswith("data plane n1: transport tcp, engine ")
    assert lines[0].endswith(", kernels numpy (IRDMAFS_NATIVE=0)"), table
    want = "kernels native C" if untold["native"] else f"kernels numpy ({untold['why']})"
    assert lines[1].startswith("data plane n2: transport tcp, engine ") and lines[1].endswith(want), table
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert by_name["n1"]["kernels"] == n1["kernels"] and by_name["n2"]["kernels"] == n2["kernels"]
    assert by_name["n1"]["engine"] == n1["engine"] and by_name["n2"]["engine"] == n2["engine"]
    # its one line at start says the same
    [started] = [ln for ln in lc.log_of("n1").splitlines() if " listening on " in ln]
    assert "(transport tcp, engine python (" in started and started.endswith("kernels numpy (IRDMAFS_NATIVE=0))"), started


NO_ENGINE = importlib.util.find_spec("irdmafs.transport.engine") is None


@pytest.mark.skipif(NO_ENGINE, reason="irdmafs/transport/engine.py (the engine's Python side) is not there yet")
def test_a_node_told_irdmafs_engine_0_runs_python_and_says_why(plane):
    lc, status, table, doc = plane
    assert status["n1"]["engine"] == {"name": "python", "why": "IRDMAFS_ENGINE=0"}
    assert "data plane n1: transport tcp, engine python (IRDMAFS_ENGINE=0), kernels numpy (IRDMAFS_NATIVE=0)" in table.splitlines(), table
    n2 = status["n2"]["engine"]  # not told: native where the engine loads, else python and why
    if n2["name"] == "native":
        assert n2["why"] == "built" and "data plane n2: transport tcp, engine native, " in table, table
    else:
        assert n2["name"] == "python" and n2["why"] not in ("", "IRDMAFS_ENGINE=0"), n2
        assert f"data plane n2: transport tcp, engine python ({n2['why']}), " in table, table
