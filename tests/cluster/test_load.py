"""A short version of scripts/load.py: several client processes reading and writing at once
against real node processes, every block read back and compared: no error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long  # behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
def test_six_clients_for_six_seconds_see_no_error(tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "load.py"), "--clients", "6", "--seconds", "6", "--mib", "0.5", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["errors"] == 0 and res["ops"] > 6 * 2  # every client wrote and read back
