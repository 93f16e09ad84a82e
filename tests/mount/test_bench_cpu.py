"""scripts/bench_cpu.py runs (small): every ratio it names is there, positive and finite, from
bytes it checked (a smoke test: no figure is held to its target, these machines are shared)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import fuse_unavailable

pytestmark = [pytest.mark.mount, pytest.mark.cluster, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_quick(tmp_path):
    reason = fuse_unavailable() or (None if shutil.which("iperf3") else "iperf3 is not installed (scripts/setup installs it)")
    if reason:
        pytest.skip(reason)
    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_cpu.py"), "--mib", "32", "--reps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for tag in ("r1", "r2"):
        keys = [f"node_read_cpu_vs_iperf3_{tag}", f"node_write_cpu_vs_iperf3_{tag}", f"mount_read_cpu_vs_iperf3_fuse_{tag}",
                f"mount_write_cpu_vs_iperf3_fuse_{tag}", f"node_write_fresh_cpu_vs_iperf3_{tag}", f"mount_write_fresh_cpu_vs_iperf3_fuse_{tag}",
                f"iperf3_send_cpu_s_per_gb_{tag}", f"iperf3_recv_cpu_s_per_gb_{tag}", f"fuse_read_cpu_s_per_gb_{tag}",
                f"fuse_write_cpu_s_per_gb_{tag}", f"client_pull_cpu_vs_iperf3_{tag}", f"client_push_cpu_vs_iperf3_{tag}"]
        for key in keys:
            assert math.isfinite(res[key]) and res[key] > 0, (key, res.get(key))
    assert res["targets_named"] == 12 and 0 <= res["targets_held"] <= 12
    assert "holds" in r.stdout and "node serving reads" in r.stdout and "Client pulling" in r.stdout
