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


@pytest.mark.long
async def test_bench_step_quick(tmp_path, mount):  # ``mount``: skips where FUSE is unavailable
    pytest.importorskip("torch")
    out = tmp_path / "step.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--quick", "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("step_vs_ddp_resnet50_w2", "irdmafs_push_s_resnet50_w2", "irdmafs_pull_s_resnet50_w2", "irdmafs_apply_s_resnet50_w2", "ddp_comm_s_resnet50_w2"):
        assert res[key] > 0, key
    assert res["tensors_resnet50"] == 161


@pytest.mark.long  # 20-33 s: the quick suite stays under ten minutes; CI runs it
def test_bench_step_link_quick(tmp_path):
    """``--link --quick``: W=2 workers and 2 PS nodes, each in a network namespace behind a
    shaped link, DDP across the same kind of namespaces; the run completes, the workers' SGD
    check passes, and both sides' link bounds are printed and positive."""
    import os
    import shutil

    from ..conftest import fuse_unavailable

    if os.geteuid() != 0:
        pytest.skip("--link needs root (network namespaces, veth links, tc)")
    missing = [t for t in ("ip", "tc", "nsenter") if not shutil.which(t)]
    if missing:
        pytest.skip(f"--link needs {', '.join(missing)}")
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("torch")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        pytest.skip("ip netns is not available here")
    out = tmp_path / "link.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--link", "--quick", "--json", str(out), "--trace-plot", str(tmp_path / "trace.png")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["link_irdmafs_param_err_tiny_w2"] <= 1e-5  # the workers' check (the run fails otherwise)
    for key in (
        "link_irdmafs_bound_s_tiny_w2",
        "link_ddp_bound_s_tiny_w2",
        "link_step_vs_bound_tiny_w2",
        "link_step_vs_ddp_tiny_w2",
        "link_cpu_vs_ddp_tiny_w2",
        "link_irdmafs_step_s_tiny_w2",
        "link_ddp_comm_s_tiny_w2",
        "link_single_stream_vs_rate",
    ):
        assert res[key] > 0, key
    for key in ("link_step_vs_bound_tiny_w2", "link_step_vs_ddp_tiny_w2", "link_cpu_vs_ddp_tiny_w2"):
        assert key in r.stdout, key
    # the links' trace: each timed step cut out of it, with what its busiest link carried
    steps = res["link_trace_steps_tiny_w2"]
    assert [t["step"] for t in steps] == [0, 1]
    assert all(0 < max(t["in"], t["out"]) <= 1.2 and 0 <= t["both"] <= 1 for t in steps), steps
    assert (tmp_path / "trace-tiny-w2.png").stat().st_size > 0
    assert not subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("irdstep")  # all removed
