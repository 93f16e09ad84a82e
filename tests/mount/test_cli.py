"""The irdmafs command as a user runs it."""

import json
import os
import signal
import subprocess
import sys

import pytest

from irdmafs import config as C
from irdmafs.launch.etcd_process import LocalEtcd, health_error, is_local_etcd
from irdmafs.launch.local import free_ports, pids_alive
from irdmafs.launch.mount import is_mounted

from ..conftest import fuse_unavailable

pytestmark = pytest.mark.mount


def irdmafs(*args, env=None, check=False, cwd=None):
    r = subprocess.run([sys.executable, "-m", "irdmafs", *map(str, args)], capture_output=True, text=True, env=env, timeout=120, cwd=cwd)
    if check and r.returncode:
        raise AssertionError(f"irdmafs {args} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state-home"))


def until(what, check, timeout=30.0):
    """Wait for ``check()`` to be truthy (polled), or fail saying ``what``; returns its value."""
    import time

    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)
    return got


def gone(pid):
    """Whether ``pid`` has ended (a zombie not reaped yet has)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def one_line(r):
    return r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


def test_up_status_down(tmp_path, env):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mp = tmp_path / "ps"
    r = irdmafs("up", mp, "--nodes", 3, "--replicas", 2, "--state", tmp_path / "st", env=env, check=True)
    extra = None
    try:
        assert is_mounted(mp) and "3 nodes (R=2)" in r.stdout
        assert "data in memory only (gone at 'down'; --persist keeps it)" in r.stdout  # what --persist means
        # the coordination service: a local etcd, started by 'up', named in the config it wrote
        etcd = json.loads(next((tmp_path / "state-home" / "irdmafs" / "mounts").glob("*.json")).read_text())["coordinator"]
        assert pids_alive([etcd["pid"]]) and is_local_etcd(etcd["pid"], tmp_path / "st" / "etcd")
        assert C.load(tmp_path / "st" / "cluster.toml").coordinator == [etcd["endpoint"]]
        assert health_error(etcd["endpoint"]) is None and f"coordinator {etcd['endpoint']}" in r.stdout
        (mp / "hello.txt").write_text("hi")
        doc = json.loads(irdmafs("status", mp, "--json", env=env, check=True).stdout)
        assert doc["config"] == str(tmp_path / "st" / "cluster.toml")
        assert doc["replicas"] == 2 and doc["transport"] == "shm"  # the nodes share this host
        assert [(n["name"], n["alive"]) for n in doc["nodes"]] == [("n1", True), ("n2", True), ("n3", True)]
        assert all(isinstance(n["pid"], int) for n in doc["nodes"])
        assert doc["coordinator"] == [{"endpoint": etcd["endpoint"], "reachable": True}]
        assert doc["whole"] is True and doc["whole_text"].startswith("yes")  # as the table says it
        (mp / "sub" / "deeper").mkdir(parents=True)  # status from inside the mount, no argument
        inside = irdmafs("status", env=env, cwd=mp / "sub" / "deeper")
        assert inside.returncode == 0 and f"config:    {tmp_path / 'st' / 'cluster.toml'}" in inside.stdout, inside.stderr
        assert "whole:     yes" in inside.stdout
        # a node started for a rebalance (a config of the same token, not 'up's): 'down' stops it too
        [port] = free_ports(1)
        grown = tmp_path / "st" / "grown.toml"
        grown.write_text((tmp_path / "st" / "cluster.toml").read_text() + f'\n[[nodes]]\nname = "n4"\nhost = "127.0.0.1"\nport = {port}\n')
        with open(tmp_path / "n4.log", "wb") as log:
            cmd = [sys.executable, "-m", "irdmafs.server.node", "--config", str(grown), "--node", "n4"]
            extra = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        table = irdmafs("status", "--config", tmp_path / "st" / "cluster.toml", env=env, check=True).stdout
        assert "n1" in table and "ready" in table
        assert f"coordinator {etcd['endpoint']}: reachable\n" in table
        again = irdmafs("up", mp, env=env)
        assert again.returncode == 2 and "already" in again.stderr
        os.kill(etcd["pid"], signal.SIGSTOP)  # a hung coordinator: status says so, within its 1 s
        try:
            table = irdmafs("status", mp, env=env).stdout
        finally:
            os.kill(etcd["pid"], signal.SIGCONT)
        assert f"coordinator {etcd['endpoint']}: UNREACHABLE (" in table
    finally:
        reg = next((tmp_path / "state-home" / "irdmafs" / "mounts").glob("*.json"))
        pids = [p for p in json.loads(reg.read_text())["node_pids"].values()]
        etcd_pid = json.loads(reg.read_text())["coordinator"]["pid"]
        down = irdmafs("down", mp, env=env)
        if extra is not None and extra.poll() is None:
            extra.kill()
    assert down.returncode == 0, down.stderr
    assert not is_mounted(mp) and not pids_alive(pids) and not pids_alive([etcd_pid])
    assert "coordinator (etcd) stopped" in down.stdout
    assert "4 node processes (n1, n2, n3, n4)" in down.stdout, down.stdout  # what it stopped, the rebalance's node too
    assert extra.wait(5) is not None
    assert "state kept" not in down.stdout and "the data are gone" in down.stdout, down.stdout  # no --persist
    assert irdmafs("down", mp, env=env).returncode == 2

    # the state dir has a 3-node R=2 config: other flags are refused, saying so, and nothing starts
    r = irdmafs("up", mp, "--nodes", 2, "--replicas", 1, "--state", tmp_path / "st", env=env)
    assert r.returncode == 2 and "has a 3-node R=2 config" in r.stderr and "--nodes 2 --replicas 1" in r.stderr, r.stderr
    assert "--state elsewhere" in r.stderr and one_line(r) and not is_mounted(mp)
    fresh = tmp_path / "fresh"  # a refused 'up' removes the mountpoint it made, and only that
    r = irdmafs("up", fresh / "a" / "mp", "--nodes", 2, "--state", tmp_path / "st", env=env)
    assert r.returncode == 2 and not fresh.exists() and tmp_path.exists()
    # data an earlier 'up --persist' kept: an 'up' without it would start empty, so it is refused
    (tmp_path / "st" / "data" / "n1").mkdir(parents=True)
    r = irdmafs("up", mp, "--state", tmp_path / "st", env=env)
    assert r.returncode == 2 and "--persist" in r.stderr and str(tmp_path / "st" / "data") in r.stderr and one_line(r), r.stderr
    assert not is_mounted(mp) and not list((tmp_path / "state-home" / "irdmafs" / "mounts").glob("*.json"))


@pytest.mark.long  # 22-25 s: the quick suite stays under ten minutes; CI runs it
def test_up_again_restarts_its_coordinator_and_leaves_another_alone(tmp_path, env):
    """A second 'up' of the same state starts the etcd its config names again (same endpoint);
    a config naming a coordinator run elsewhere gets none started; a config naming none is
    refused by 'up', 'mount' and 'serve' alike, saying how to get one, and starts nothing."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mp, st = tmp_path / "ps", tmp_path / "st"
    irdmafs("up", mp, "--nodes", 1, "--replicas", 1, "--state", st, env=env, check=True)
    [endpoint] = C.load(st / "cluster.toml").coordinator
    irdmafs("down", mp, env=env, check=True)
    assert health_error(endpoint, timeout=0.5) is not None
    r = irdmafs("up", mp, "--state", st, env=env, check=True)
    try:
        assert f"coordinator {endpoint}" in r.stdout and health_error(endpoint) is None
    finally:
        irdmafs("down", mp, env=env, check=True)
    with LocalEtcd(tmp_path / "elsewhere") as elsewhere:  # a coordinator 'up' did not start
        (st / "cluster.toml").write_text((st / "cluster.toml").read_text().replace(endpoint, elsewhere.endpoint))
        irdmafs("up", mp, "--state", st, env=env, check=True)
        try:
            assert "coordinator" not in json.loads(next((tmp_path / "state-home" / "irdmafs" / "mounts").glob("*.json")).read_text())
            assert health_error(endpoint, timeout=0.5) is not None
            assert f"coordinator {elsewhere.endpoint}: reachable" in irdmafs("status", mp, env=env).stdout
        finally:
            down = irdmafs("down", mp, env=env, check=True)
        assert "coordinator" not in down.stdout and elsewhere.running  # not 'up's to stop
    st2 = tmp_path / "st2"
    st2.mkdir()
    (st2 / "token").write_text((st / "token").read_text())
    lines = (st / "cluster.toml").read_text().splitlines()
    (st2 / "cluster.toml").write_text("\n".join(line for line in lines if not line.startswith("coordinator")) + "\n")
    for argv in (["up", mp, "--state", st2], ["mount", "--config", st2 / "cluster.toml", mp], ["serve", "--config", st2 / "cluster.toml", "--node", "n1"]):
        r = irdmafs(*argv, env=env)
        assert r.returncode == 2 and "coordinator: none named" in r.stderr and "irdmafs up" in r.stderr, (argv, r.stderr)
        assert "Traceback" not in r.stderr and not is_mounted(mp)
    assert not list((tmp_path / "state-home" / "irdmafs" / "mounts").glob("*.json"))
    r = irdmafs("up", mp, "--no-coordinator", env=env)  # the flag is gone with the routing it served
    assert r.returncode == 2 and "--no-coordinator" in r.stderr


@pytest.mark.long  # behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
def test_up_with_transport_tcp_forces_tcp(tmp_path, env):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mp = tmp_path / "ps"
    irdmafs("up", mp, "--nodes", 2, "--replicas", 1, "--transport", "tcp", "--state", tmp_path / "st", env=env, check=True)
    try:
        (mp / "x").write_bytes(b"tcp" * 1000)
        assert (mp / "x").read_bytes() == b"tcp" * 1000
        doc = json.loads(irdmafs("status", mp, "--json", env=env, check=True).stdout)
        assert doc["transport"] == "tcp"
        assert 'transport = ["tcp"]' in (tmp_path / "st" / "cluster.toml").read_text()
        assert "shared memory" not in (tmp_path / "st" / "mount.log").read_text()
        # a node killed: the one left is no majority and cannot expel it from the view, but the
        # mount's heartbeats hear nothing: the status says down, with no stale pid (it once
        # said ready, old pid, exit 0, 30 s after the kill)
        victim = next(n for n in doc["nodes"] if n["name"] == "n2")
        os.kill(victim["pid"], signal.SIGKILL)

        def n2_down():
            d = json.loads(irdmafs("status", mp, "--json", env=env).stdout)
            n2 = next(n for n in d["nodes"] if n["name"] == "n2")
            return d if not n2["alive"] else None

        doc = until("the status says n2 is down", n2_down)
        n2 = next(n for n in doc["nodes"] if n["name"] == "n2")
        assert n2["state"] == "down" and "pid" not in n2 and doc["whole"] is False and "n2 not answering" in doc["whole_text"]
        table = irdmafs("status", mp, env=env)
        assert table.returncode == 1 and "whole:     no: n2 not answering" in table.stdout
        [row] = [ln for ln in table.stdout.splitlines() if ln.startswith("n2 ")]
        assert row.split()[2:4] == ["-", "down"], row
    finally:
        down = irdmafs("down", mp, env=env)
    assert down.returncode == 0 and "1 node process (n1)" in down.stdout, down.stdout + down.stderr


@pytest.mark.long  # 22 s: the quick suite stays under ten minutes; CI runs it
def test_down_stops_nodes_restarted_by_hand_and_hung_ones(tmp_path, env):
    """A node killed and started again from its own command line is not the process 'up'
    started; one stopped with SIGSTOP answers no heartbeat. 'down' stops both."""
    import time

    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mp = tmp_path / "ps"
    irdmafs("up", mp, "--nodes", 3, "--replicas", 2, "--state", tmp_path / "st", env=env, check=True)
    reg = next((tmp_path / "state-home" / "irdmafs" / "mounts").glob("*.json"))
    started = json.loads(reg.read_text())["node_pids"]
    restarted = None
    try:
        cmdline = open(f"/proc/{started['n2']}/cmdline", "rb").read().split(b"\0")[:-1]
        os.kill(started["n2"], signal.SIGKILL)
        log = open(tmp_path / "n2-again.log", "wb")
        restarted = subprocess.Popen(cmdline, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the mount has heard the new process
            nodes = json.loads((mp / ".irdma" / "cluster").read_text())["nodes"]
            if any(n["name"] == "n2" and n.get("pid") == restarted.pid for n in nodes):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the mount never heard n2's new process: {nodes}")
        os.kill(started["n3"], signal.SIGSTOP)  # hung: no heartbeat answers from here on
    finally:
        down = irdmafs("down", mp, env=env)
    assert down.returncode == 0, down.stderr
    if restarted is not None:
        restarted.wait(15)  # it was stopped; wait() reaps it (it is this test's child)
        assert restarted.returncode is not None
    assert not is_mounted(mp) and not pids_alive(list(started.values()))


def test_mount_in_background_then_unmount(tmp_path, env, etcd_endpoints):
    """A mount in the background; before it, what a mount says of a wrong token and of a bad or
    busy --metrics (one line, exit 2, at once: a wrong token once meant "not mounted after 30.0s"
    and, with -f, a TimeoutError traceback); with it, metrics at /metrics only, the mount's
    errors by errno and its RSS, status from inside it, and its end at its first SIGTERM."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    import socket
    import time
    import urllib.error
    import urllib.request

    from irdmafs.launch.local import LocalCluster, write_config
    from irdmafs.launch.mount import unmount

    lc = LocalCluster(write_config(tmp_path / "c", 1, 1, transport=["tcp"], coordinator=etcd_endpoints))
    lc.start_all()
    mp = tmp_path / "m"
    mp.mkdir()
    bad = tmp_path / "c" / "bad.toml"  # the cluster's config with another token
    (tmp_path / "c" / "other-token").write_text("0" * 64)
    bad.write_text(lc.config_path.read_text().replace('token_file = "token"', 'token_file = "other-token"'))
    busy = socket.socket()
    try:
        irdmafs("status", "--config", lc.config_path, env=env)  # nodes answer once up
        t0 = time.monotonic()
        r = irdmafs("mount", "--config", bad, mp, env=env)
        assert r.returncode == 2 and "wrong cluster token" in r.stderr and "(log " in r.stderr and one_line(r), r.stderr
        assert time.monotonic() - t0 < 20 and not is_mounted(mp)
        r = irdmafs("mount", "--config", bad, mp, "-f", env=env)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("irdmafs: wrong cluster token: node n1")
        assert "Traceback" not in r.stderr and not is_mounted(mp)
        r = irdmafs("status", "--config", bad, env=env)
        assert r.returncode == 1 and "wrong cluster token" in r.stdout
        r = irdmafs("mount", "--config", lc.config_path, mp, "--metrics", "notaport", env=env)
        assert r.returncode == 2 and "[HOST:]PORT" in r.stderr and one_line(r), r.stderr
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = irdmafs("mount", "--config", lc.config_path, mp, "--metrics", f"127.0.0.1:{busy.getsockname()[1]}", env=env)
        assert r.returncode == 2 and "cannot listen" in r.stderr and one_line(r) and not is_mounted(mp), r.stderr

        [port] = free_ports(1)
        r = irdmafs("mount", "--config", lc.config_path, mp, "-o", "noatime,_netdev", "--metrics", f"127.0.0.1:{port}", env=env, check=True)
        assert is_mounted(mp) and "mounted on" in r.stdout
        pid = int(r.stdout.split("(pid ")[1].split(",")[0])
        (mp / "d").mkdir()
        (mp / "f").write_bytes(b"x" * 100)
        assert (mp / "f").read_bytes() == b"x" * 100
        assert not (mp / "d" / "missing").exists()  # an ENOENT answered
        inside = irdmafs("status", env=env, cwd=mp / "d")
        assert inside.returncode == 0 and "n1 " in inside.stdout, inside.stdout + inside.stderr
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'irdmafs_mount_errors_total{errno="ENOENT"}' in text and "process_resident_memory_bytes " in text
        assert "irdmafs_mount_lost_stripes 0.0" in text
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        assert caught.value.code == 404
        os.kill(pid, signal.SIGTERM)  # one SIGTERM ends the mount, and releases the mountpoint
        until("the mount's process ends at its first SIGTERM", lambda: gone(pid) and not is_mounted(mp), timeout=15)
    finally:
        busy.close()
        unmount(str(mp))
        lc.stop_all()
    assert not is_mounted(mp)


def test_serve_with_its_own_mount(tmp_path, env, etcd_endpoints):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    import time

    from irdmafs.launch.local import write_config
    from irdmafs.launch.mount import unmount

    cfg = write_config(tmp_path / "c", 1, 1, transport=["tcp"], coordinator=etcd_endpoints)
    mp = tmp_path / "m"
    mp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "irdmafs", "serve", "--config", str(cfg), "--node", "n1", "--mount", str(mp)], env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not is_mounted(mp):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (mp / "f").write_bytes(b"served")
        assert (mp / "f").read_bytes() == b"served"
        # SIGTERM while mounted: the mount catches it and ends; the node must end with it (it
        # once ran on, its SIGTERM spent)
        proc.terminate()
        assert proc.wait(20) == 0
        assert not is_mounted(mp)
    finally:
        unmount(str(mp), lazy=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(20)
    assert "Traceback" not in proc.stderr.read().decode()


@pytest.mark.parametrize(
    "text, message",
    [
        ("this is [not toml", "not valid TOML"),
        ('token = "longenoughtoken"\n', "need at least one [[nodes]]"),
        ('token = "longenoughtoken"\nreplicas = 5\n[[nodes]]\nname = "a"\nhost = "127.0.0.1"\nport = 7000\n', "replicas"),
        ('[[nodes]]\nname = "a"\nhost = "127.0.0.1"\nport = 7000\n', "token"),
        ('token = "longenoughtoken"\nstripe_unit = "3MiB"\n[[nodes]]\nname = "a"\nhost = "h"\nport = 1\n', "power of two"),
        ('token = "longenoughtoken"\nbogus = 1\n[[nodes]]\nname = "a"\nhost = "h"\nport = 1\n', "unknown key"),
        ('token = "longenoughtoken"\ncoordinator = "https://e:2379"\n[[nodes]]\nname = "a"\nhost = "h"\nport = 1\n', "coordinator: 'https://e:2379'"),
    ],
)
def test_bad_config_is_one_clear_line_and_exit_2(tmp_path, env, text, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    for args in (("status", "--config", cfg), ("mount", "--config", cfg, tmp_path), ("serve", "--config", cfg, "--node", "a")):
        r = irdmafs(*args, env=env)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr
        assert r.stderr.strip().count("\n") == 0  # one line


def test_missing_config_and_unknown_node(tmp_path, env):
    r = irdmafs("status", "--config", tmp_path / "nope.toml", env=env)
    assert r.returncode == 2 and "no such config file" in r.stderr
    cfg = tmp_path / "ok.toml"
    cfg.write_text('token = "longenoughtoken"\ncoordinator = "http://127.0.0.1:2379"\n[[nodes]]\nname = "a"\nhost = "127.0.0.1"\nport = 7000\n')
    r = irdmafs("serve", "--config", cfg, "--node", "zz", env=env)
    assert r.returncode == 2 and "no node named 'zz'" in r.stderr


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
def test_a_non_empty_mountpoint_is_refused_unless_nonempty(tmp_path, env):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mp = tmp_path / "checkout"
    mp.mkdir()
    (mp / "keep.txt").write_text("mine")
    r = irdmafs("up", mp, "--nodes", 3, "--replicas", 2, "--state", tmp_path / "st", env=env)
    assert r.returncode == 2 and "not empty" in r.stderr and "-o nonempty" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not is_mounted(mp) and not (tmp_path / "st" / "cluster.toml").exists()  # nothing started
    assert (mp / "keep.txt").read_text() == "mine"
    irdmafs("up", mp, "--nodes", 3, "--replicas", 2, "--state", tmp_path / "st", "-o", "nonempty", env=env, check=True)
    try:
        assert is_mounted(mp) and not (mp / "keep.txt").exists()  # hidden, as asked
    finally:
        irdmafs("down", mp, env=env, check=True)
    assert (mp / "keep.txt").read_text() == "mine"  # and there again


def test_mounting_without_pyfuse3_says_what_to_install(tmp_path, env):
    code = "import sys; sys.modules['pyfuse3'] = None; from irdmafs.launch.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "up", str(tmp_path / "ps")], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "pip install 'irdmafs[fuse]'" in r.stderr and "libfuse3-dev" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.long  # 17 s: the quick suite stays under ten minutes; CI runs it
def test_up_with_three_coordinators_runs_three_etcd_members_and_down_stops_them(tmp_path, env):
    """``--coordinators 3``: three local etcd members (their own ports and data dirs), every one
    named in the config; the cluster serves through one of them stopped; 'down' stops them all.
    An even count is refused before anything starts."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mp, st = tmp_path / "ps", tmp_path / "st"
    r = irdmafs("up", mp, "--coordinators", 2, "--state", st, env=env)
    assert r.returncode == 2 and "--coordinators must be an odd number" in r.stderr and not st.exists()
    irdmafs("up", mp, "--nodes", 2, "--replicas", 2, "--coordinators", 3, "--state", st, env=env, check=True)
    try:
        reg = json.loads(next((tmp_path / "state-home" / "irdmafs" / "mounts").glob("*.json")).read_text())
        members = reg["coordinator"]["members"]
        assert len(members) == 3 and len({m["data_dir"] for m in members}) == 3
        assert C.load(st / "cluster.toml").coordinator == [m["endpoint"] for m in members]
        assert all(pids_alive([m["pid"]]) and health_error(m["endpoint"]) is None for m in members)
        os.kill(members[0]["pid"], signal.SIGSTOP)  # one member hung: the other two serve
        try:
            (mp / "f").write_bytes(b"y" * 5000)
            assert (mp / "f").read_bytes() == b"y" * 5000
        finally:
            os.kill(members[0]["pid"], signal.SIGCONT)
    finally:
        down = irdmafs("down", mp, env=env, check=True)
    assert "coordinator (etcd) stopped" in down.stdout
    assert not pids_alive([m["pid"] for m in members])
