"""scripts/bench_ckpt.py and scripts/bench_names.py run (small): every figure they name is there,
from loads they checked against what was saved."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mount, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ckpt_quick(tmp_path):
    out = tmp_path / "ckpt.json"
    argv = ["--gib", "0.05", "--reps", "1", "--rotations", "3", "--transport", "shm", "--replicas", "2", "--json", str(out)]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ckpt.py"), *argv], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["state_bytes"] > 40 << 20
    for way in ("torch", "safetensors", "dcp"):
        for op in ("save", "load_warm", "load"):
            assert res[f"shm_r2_{way}_{op}_vs_tmpfs"] > 0 and res[f"shm_r2_{way}_{op}_mount_s"] > 0, (way, op)
    assert res["shm_r2_rotate_fresh_pages_per_byte"] >= 0


def test_bench_names_quick(tmp_path):
    out = tmp_path / "names.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_names.py"), "--files", "1000", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    passes = ("first", "second") if os.geteuid() == 0 else ("second",)
    for op in ("stat", "ls_l", "rsync"):
        for name in passes:
            assert res[f"{op}_{name}_vs_disk"] > 0 and res[f"{op}_{name}_mount_s"] > 0, (op, name)
