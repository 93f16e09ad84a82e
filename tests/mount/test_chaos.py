"""The chaos soak in CI: scripts/chaos.py for 100 seconds on a real cluster and mount (a long run:
``scripts/test --long``, which CI runs).

Two runs, each drawn from a fixed seed while its workers check every byte they read back (the
cluster's views in a local etcd the soak starts); each must see no error outside the documented
window and lose no byte:
- node kills with restarts from the node's own command line and mount kills with remounts (no
  root needed), once on the default one-host cluster (shared memory, 4 MiB stripes) and once on
  the Python data plane (``IRDMAFS_ENGINE=0``), and once with every node and mount on the engine
  built with AddressSanitizer and UBSan (``scripts/sanitize --run``: no report allowed);
- every fault kind: kills, ``SIGSTOP``, mount kills, partitions and
  node-link cuts in network namespaces (a second mount on the minority side), and on three etcd
  members: one stopped or killed, the leader killed, a node reaching only one member. It needs root for the namespaces; 30-minute runs of it are in the README.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import fuse_unavailable

pytestmark = pytest.mark.mount

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def _chaos_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_lost_write_prints_the_logs_of_its_stripe_and_who_served(tmp_path):
    """A red CI run's state directory is gone: what the logs said of the stripe read back wrong
    and of the views comes with the run's output (``log_excerpt``)."""
    (tmp_path / "n1.log").write_text(
        "INFO view 9: serving n1, n2\n"
        "INFO stripe 123:0 from n3 failed: EIO\n"
        "INFO stripe 1123:0 from n3 failed: EIO\n"
        "INFO stripe 123:01 is someone else's\n"
        "INFO 4 pushes taken\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "n3.log").write_text("WARNING node n3 fenced: its lease ended; it serves nothing until it has resynced\n")
    lines = _chaos_module().log_excerpt(tmp_path, {"123:0"})
    assert lines == [
        "n1.log: INFO view 9: serving n1, n2",
        "n1.log: INFO stripe 123:0 from n3 failed: EIO",
        "n3.log: WARNING node n3 fenced: its lease ended; it serves nothing until it has resynced",
    ]
    assert len(_chaos_module().log_excerpt(tmp_path, {"123:0"}, limit=2)) == 2


def test_the_same_seed_replays_the_same_faults():
    def schedule(seed):
        r = subprocess.run([sys.executable, str(SCRIPT), "--seed", str(seed), "--schedule", "40"], capture_output=True, text=True, timeout=60, check=True)
        return json.loads(r.stdout)

    first = schedule(11)
    assert first == schedule(11) and first != schedule(12)
    assert {f["kind"] for f in first} >= {"kill", "stop", "mount"}
    assert all(f["target"] == "mount" if f["kind"] == "mount" else f["target"].startswith("n") for f in first)


# the data planes a soak drives (issue 60): the engine over TCP between namespaces (the other
# runs), the default one-host cluster (shared memory, 4 MiB stripes), the Python data plane
# runtime, and the engine built with AddressSanitizer and UBSan in every node and mount
# (scripts/sanitize --run: any report fails the run)
MODES = {"shm-4mib": ["--transport", "shm", "--stripe-unit", "4", "--no-netns"], "python-engine": ["--engine", "python"], "sanitized-engine": []}
SANITIZE = Path(__file__).resolve().parents[2] / "scripts" / "sanitize"


@pytest.mark.long
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_100_second_soak_of_kills_and_remounts_sees_no_error_and_loses_nothing(tmp_path, mode):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(SCRIPT), "--minutes", str(100 / 60), "--seed", "3", "--faults", "kill,mount", "--json", str(out), *MODES[mode]]
    if mode == "sanitized-engine":
        cmd = [str(SANITIZE), "--run", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if mode == "sanitized-engine" and r.returncode == 77:
        pytest.skip(f"the sanitizers are not available here: {r.stderr.strip()[-300:]}")
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    said = r.stdout[-3000:] + r.stderr[-3000:] + "\n".join(result.get("log_excerpt", []))
    assert r.returncode == 0 and result["errors"] == 0 and result["lost"] == 0, said
    assert result["faults"].get("kill", 0) >= 3 and result["faults"].get("mount", 0) >= 3
    assert result["operations"]["file_check"] > 100 and result["operations"]["train_pull"] > 50
    assert result["checked_bytes"] > 100 << 20
    assert result["operations"]["garbage"] > 10  # broken frames after a handshake: the nodes went on


@pytest.mark.long
def test_a_soak_with_every_fault_kind_sees_no_error_and_loses_nothing(tmp_path):
    reason = fuse_unavailable()
    if os.geteuid() != 0 or not shutil.which("ip"):
        reason = reason or "partitions and cuts need network namespaces: root and iproute2"
    if not shutil.which("etcd"):
        reason = reason or "etcd is not installed (apt-get install etcd-server: scripts/setup)"
    if reason:
        pytest.skip(reason)
    out = tmp_path / "chaos.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--minutes", "3", "--seed", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    result = json.loads(out.read_text())
    assert r.returncode == 0 and result["errors"] == 0 and result["lost"] == 0, r.stdout[-3000:] + r.stderr[-3000:]
    kinds = {"kill", "stop", "mount", "partition", "cut", "etcd-stop", "etcd-kill", "etcd-leader-kill", "etcd-minority"}
    assert all(result["faults"].get(k, 0) >= 1 for k in kinds), result["faults"]
    assert result["operations"]["file_check"] > 100 and result["operations"]["minority_file_check"] > 10
    assert result["operations"]["garbage"] > 10
