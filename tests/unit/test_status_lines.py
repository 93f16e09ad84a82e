"""What the command line says, checked without a cluster (issue 55): the ``whole`` line and its
boolean (lost stripes, a refused token, a node a rebalance added), a mount found from inside it,
``--metrics`` addresses, the metrics endpoint (``/metrics`` only, the process's RSS, the mount's
errors by errno), and that SIGTERM ends a script the way Ctrl-C does."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from irdmafs.launch import cli
from irdmafs.fs.errnos import ANSWERED, errno_for
from irdmafs.errors import FsError
from irdmafs.metrics import parse_address, serve

ROOT = Path(__file__).resolve().parents[2]


def node(name, **kw):
    return {"name": name, "address": "127.0.0.1:1", "state": "ready", "alive": True, "caught_up": True, "degraded": 0, **kw}


def test_wholeness_says_why_and_as_a_boolean():
    assert cli.wholeness([node("n1"), node("n2")]) == (True, "yes (every stripe has its R copies serving)")
    ok, text = cli.wholeness([node("n1", lost={"stripes": 3, "bytes": 12 << 20}), node("n2", lost={"stripes": 0, "bytes": 0})])
    assert ok is False and "3 written stripes lost" in text and "n1" in text and "n2" not in text
    ok, text = cli.wholeness([node("n1"), node("n2", alive=False, state="down")])
    assert ok is False and text == "no: n2 not answering"
    ok, text = cli.wholeness([node("n1", alive=False, state="down", error="wrong cluster token (the node refused this config's token)")])
    assert ok is False and "wrong cluster token" in text
    ok, text = cli.wholeness([node("n1"), {k: v for k, v in node("n3").items() if k != "degraded"}])
    assert ok is None and text.startswith("unknown")
    assert cli.wholeness([node("n1", degraded=2)]) == (False, "no: 2 stripes with a copy not serving")
    assert cli.wholeness([node("n1", lost=None)])[0] is True  # a node from before 'lost' was reported


def test_mount_root_walks_up_to_the_mount(monkeypatch, tmp_path):
    import irdmafs.launch.mount

    root = tmp_path / "mnt"
    monkeypatch.setattr(irdmafs.launch.mount, "is_mounted", lambda p: p == str(root))
    assert cli.mount_root(str(root / "a" / "b")) == str(root)
    assert cli.mount_root(str(root)) == str(root)
    assert cli.mount_root(str(tmp_path / "elsewhere")) is None


@pytest.mark.parametrize("bad", ["notaport", "host:", "1:99999", "", "127.0.0.1:-1"])
def test_a_metrics_address_that_is_not_one_says_what_is_expected(bad):
    with pytest.raises(ValueError, match=r"\[HOST:\]PORT"):
        parse_address(bad)


def test_metrics_addresses():
    assert parse_address("9100") == ("0.0.0.0", 9100)
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_address("[::1]:9100") == ("::1", 9100)


def test_metrics_are_served_at_metrics_only_with_rss_and_errors_by_errno():
    ANSWERED.clear()
    assert errno_for(FsError(errno.ENOENT), "lookup") == errno.ENOENT
    assert errno_for(ExceptionGroup("g", [FsError(errno.ENOSPC)]), "write") == errno.ENOSPC  # a group counts once
    assert ANSWERED == {"ENOENT": 1, "ENOSPC": 1}
    samples = [("irdmafs_mount_errors_total", "counter", "errors", {"errno": k}, v) for k, v in ANSWERED.items()]
    host, port = serve("127.0.0.1:0", lambda: samples)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'irdmafs_mount_errors_total{errno="ENOENT"} 1.0' in text
    assert "process_resident_memory_bytes" in text
    for path in ("/", "/stats", "/metrics/x", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
        assert caught.value.code == 404
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
        serve(f"127.0.0.1:{port}", lambda: [])  # in use: no traceback from deep in a library


# a script that starts something, waits (plain or under trio), and stops it in a finally
SCRIPT = """
import subprocess, sys, time
from irdmafs.launch.local import end_on_sigterm
end_on_sigterm()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    print(child.pid, flush=True)  # in the try: a SIGTERM right after the line still cleans up
    if sys.argv[1] == "trio":
        import trio
        trio.run(trio.sleep_forever)
    else:
        time.sleep(600)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    raise
finally:
    child.terminate()
    child.wait(10)
    print("cleaned up", flush=True)
"""


@pytest.mark.parametrize("how", ["plain", "trio"])
def test_sigterm_runs_the_cleanup_ctrl_c_runs(tmp_path, how):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert "interrupted" in out and "cleaned up" in out, (out, err)
    assert "SIGTERM: stopping what it started" in err
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


STARTS = ("LocalCluster(", "LocalEtcd(", "LocalEtcdCluster(", "mount_background(", "local_cluster(", "mounted(", '"up", str(', 'irdmafs("up"')


def test_every_script_that_starts_a_cluster_stops_it_on_sigterm():
    """A benchmark ended by SIGTERM (``timeout 580 scripts/bench_snapshot.py``) left its etcd,
    nodes and mount running: every script that starts any (itself or through scripts/bench.py's
    helpers) makes SIGTERM unwind as ^C does: ``end_on_sigterm`` (chaos.py: SystemExit)."""
    missing = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        text = path.read_text()
        if any(s in text for s in STARTS) and "end_on_sigterm()" not in text and "signal.signal(signal.SIGTERM" not in text:
            missing.append(path.name)
    assert not missing, missing
