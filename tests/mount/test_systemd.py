"""The systemd units in deploy/systemd started for real, under a systemd of the test's own.

No systemd runs this machine (PID 1 is not systemd), but one can run as PID 1 of a new PID and
mount namespace (``unshare --pid --mount``), as in a container: the test boots Debian's systemd
there with only the units it writes (``SYSTEMD_UNIT_PATH``: the deploy units, with the paths of
this checkout, and empty stand-ins for the targets they order against, so nothing else of the
machine starts), starts ``irdmafs-node@n1`` and ``irdmafs-node@n2`` (``Type=notify``: the start
returns once each node sent READY=1), then ``mnt-ps.mount`` (mount(8) -> mount.fuse.irdmafs ->
the package's helper), writes and reads a file through it, and stops everything with systemctl.

What the test changes in the units, and why: ``User=root`` (no ``irdmafs`` user here),
``ProtectHome=no`` only where the venv's python lives under /root or /home (pyenv),
``PYTHONPATH`` naming this checkout, the config path (``PrivateTmp=yes`` hides /tmp, so the
config lives under /var/lib for the test). Inside the namespace only, /usr/sbin gets the
mount.fuse.irdmafs link by an overlay and /mnt a tmpfs, so the machine's own are untouched.

A long run (``scripts/test --long``), as root; skips with the reason where systemd cannot boot."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from irdmafs.launch.etcd_process import LocalEtcd
from irdmafs.launch.local import write_config

from ..conftest import fuse_unavailable

pytestmark = [pytest.mark.mount, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "systemd"
SYSTEMD = Path("/lib/systemd/systemd")
# what the units order against; stand-ins, so that no unit of the machine itself is started
STANDINS = ("sysinit.target", "basic.target", "shutdown.target", "network.target", "network-online.target", "multi-user.target",
            "remote-fs.target", "remote-fs-pre.target", "local-fs.target", "local-fs-pre.target", "umount.target", "etcd.service")


def children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []


def processes_mentioning(text: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if text in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def units(d: Path, config: Path, venv_bin: Path) -> Path:
    u = d / "units"
    u.mkdir()
    for f in DEPLOY.iterdir():
        if f.suffix in (".service", ".mount"):
            text = f.read_text().replace("/opt/irdmafs/.venv/bin/python", str(venv_bin / "python"))
            (u / f.name).write_text(text.replace("/etc/irdmafs/cluster.toml", str(config)))
    env = f"Environment=PYTHONPATH={ROOT}\n"
    (u / "irdmafs-node@.service.d").mkdir()
    # no journald in the namespace: each node's output to a file of its own
    out = f"StandardOutput=append:{d}/node-%i.log\nStandardError=inherit\n"
    if Path(sys.executable).resolve().is_relative_to("/root") or Path(sys.executable).resolve().is_relative_to("/home"):
        out += "ProtectHome=no\n"  # ProtectHome=yes hides this interpreter (a pyenv python, say)
    (u / "irdmafs-node@.service.d" / "test.conf").write_text("[Service]\nUser=root\nGroup=root\n" + env + out)
    (u / "mnt-ps.mount.d").mkdir()
    (u / "mnt-ps.mount.d" / "test.conf").write_text("[Mount]\n" + env)
    for name in STANDINS:
        kind = name.rsplit(".", 1)[1]
        service = "[Service]\nType=oneshot\nExecStart=/bin/true\nRemainAfterExit=yes\n" if kind == "service" else ""
        (u / name).write_text("[Unit]\nDescription=stand-in\n" + service)
    (u / "system.slice").write_text("[Unit]\nDescription=system slice\n")
    (u / "irdmafs-test.target").write_text("[Unit]\nDescription=the test's boot target: nothing\nDefaultDependencies=no\n")
    return u


@pytest.fixture
def booted(tmp_path):
    """(systemctl, config, log): a systemd booted in its own PID and mount namespace."""
    if os.geteuid() != 0:
        pytest.skip("booting a systemd in a namespace needs root")
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    for tool in ("unshare", "nsenter", "systemctl", "mount"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    if not SYSTEMD.exists():
        pytest.skip(f"{SYSTEMD} not installed")
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "mount.irdmafs").exists():
        pytest.skip(f"no mount.irdmafs beside {sys.executable}")
    d = Path(tempfile.mkdtemp(prefix="irdmafs-systemd-", dir="/var/lib"))  # not /tmp: PrivateTmp hides it
    proc = None
    log = tmp_path / "systemd.log"
    try:
        with LocalEtcd(tmp_path / "etcd") as etcd:
            config = write_config(d / "c", 2, 2, transport=["tcp"], coordinator=[etcd.endpoint], heartbeat=0.2, down_after=1.0)
            unit_dir = units(d, config, venv_bin)
            (d / "sbin").mkdir()
            (d / "sbin" / "mount.fuse.irdmafs").symlink_to(venv_bin / "mount.irdmafs")
            (d / "work").mkdir()
            boot = (
                f"mount -t overlay overlay -o lowerdir={d / 'sbin'}:/usr/sbin /usr/sbin && mount -t tmpfs tmpfs /mnt && "
                f"exec env SYSTEMD_UNIT_PATH={unit_dir} container=irdmafs-test {SYSTEMD} --system --unit=irdmafs-test.target "
                "--log-target=console --log-level=info --show-status=no"
            )
            proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--mount-proc", "sh", "-c", boot],
                stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 30
            while not (init := children(proc.pid)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"systemd does not boot in a namespace here: {log.read_text()[-1500:]}")
                time.sleep(0.1)
            pid = init[0]

            def systemctl(*args, timeout=120, check=True):
                ctl = ["nsenter", "-t", str(pid), "-m", "-p", "systemctl", "--no-pager"]
                r = subprocess.run([*ctl, *args], capture_output=True, text=True, timeout=timeout)
                if check and r.returncode != 0:
                    status = subprocess.run([*ctl, "status", "--all"], capture_output=True, text=True, timeout=30).stdout
                    nodes = "".join(f"--- {f.name} ---\n{f.read_text()[-1500:]}" for f in sorted(d.glob("node-*.log")))
                    raise AssertionError(
                        f"systemctl {' '.join(args)}: exit {r.returncode}: {r.stdout}{r.stderr}\n--- status ---\n{status[-3000:]}\n"
                        f"{nodes}\n--- systemd ---\n{log.read_text()[-3000:]}"
                    )
                return r

            deadline = time.monotonic() + 60
            while systemctl("is-system-running", check=False).stdout.strip() not in ("running", "degraded"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"systemd does not come up in a namespace here: {log.read_text()[-1500:]}")
                time.sleep(0.2)
            yield systemctl, config, pid, log
    finally:
        if proc is not None:
            for pid in children(proc.pid):
                os.kill(pid, signal.SIGKILL)  # the namespace's init: everything in it goes too
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for pid in processes_mentioning(str(d)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(d, ignore_errors=True)


def test_the_node_units_and_the_mount_unit_start_serve_and_stop_under_systemd(booted):
    systemctl, config, init, log = booted
    nodes = ["irdmafs-node@n1.service", "irdmafs-node@n2.service"]
    systemctl("start", *nodes, timeout=180)  # Type=notify: returns once both sent READY=1
    for unit in nodes:
        assert systemctl("is-active", unit).stdout.strip() == "active"
    r = subprocess.run([sys.executable, "-m", "irdmafs", "status", "--config", str(config), "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    systemctl("start", "mnt-ps.mount", timeout=180)
    assert systemctl("is-active", "mnt-ps.mount").stdout.strip() == "active"
    inside = ["nsenter", "-t", str(init), "-m", "-p", "sh", "-c"]
    use = "echo through-systemd > /mnt/ps/hello && cat /mnt/ps/hello && grep ' /mnt/ps ' /proc/mounts"
    r = subprocess.run([*inside, use], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("through-systemd\n") and "fuse.irdmafs" in r.stdout, r.stdout + r.stderr

    systemctl("stop", "mnt-ps.mount", timeout=120)
    systemctl("stop", *nodes, timeout=120)
    for unit in ["mnt-ps.mount", *nodes]:
        assert systemctl("is-active", unit, check=False).stdout.strip() == "inactive"
    r = subprocess.run([*inside, "grep ' /mnt/ps ' /proc/mounts"], capture_output=True, text=True, timeout=60)
    assert r.stdout == ""
    deadline = time.monotonic() + 20  # the mount's process ends shortly after its unmount
    while processes_mentioning(str(config)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode() for p in processes_mentioning(str(config))]
    assert left == []
