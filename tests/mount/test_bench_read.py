"""scripts/bench_read.py runs (small): every figure it names is there, from bytes it checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mount, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_read_quick(tmp_path):
    out = tmp_path / "read.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_read.py"), "--mib", "8", "--reps", "1", "--bert", "tiny", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("snapshot_reread_vs_tmpfs", "live_reread_vs_tmpfs", "snapshot_first_read_vs_tmpfs", "tmpfs_reread_gbps", "model_bytes"):
        assert res[key] > 0, key
    for loader in ("safe_open", "from_pretrained"):
        for temp in ("cold", "warm"):
            assert res[f"{loader}_{temp}_time_vs_disk"] > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="--link makes network namespaces: root only")
def test_bench_read_fanout_quick(tmp_path):
    """--link: two reader hosts and two nodes behind shaped links read one snapshot at once; the
    ratio and each node's share of the bytes are there (the readers checked every byte)."""
    out = tmp_path / "fanout.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_read.py"), "--link", "500mbit", "--readers", "2", "--nodes", "2",
                        "--mib", "8", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["fanout_vs_links"] > 0 and res["link_single_stream_vs_rate"] > 0
    assert abs(res["fanout_node1_share"] + res["fanout_node2_share"] - 1) < 1e-9
