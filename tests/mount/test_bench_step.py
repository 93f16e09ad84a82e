"""The step benchmark runs end to end (CI's smoke test of scripts/bench_step.py; no timing is
asserted: these machines are shared). Its workers check that the parameters they pulled are what
SGD over the pushed gradients gives, so a run that exits 0 moved the right bytes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mount, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]


async def test_bench_step_quick(tmp_path, mount):  # ``mount``: skips where FUSE is unavailable
    pytest.importorskip("torch")
    out = tmp_path / "step.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--quick", "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("step_vs_ddp_resnet50_w2", "irdmafs_push_s_resnet50_w2", "irdmafs_pull_s_resnet50_w2", "irdmafs_apply_s_resnet50_w2", "ddp_comm_s_resnet50_w2"):
        assert res[key] > 0, key
    assert res["tensors_resnet50"] == 161
