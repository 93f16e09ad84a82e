"""Slurm for real: munged, slurmctld and slurmd on this machine, from a minimal config written in
a temporary directory, run ``deploy/slurm/irdmafs-train.sbatch`` as a user would submit it; the
job starts its etcd, a PS node set and a mount, and torchrun runs two workers that train a small
model through the mount. The test waits for the job, checks its output, and that nothing the job
started is left running or mounted afterwards.

Everything runs in a network namespace of its own with only a loopback device (and a veth pair between its own two ends): Slurm's daemons,
the job's etcd (which the script has listen on every interface) and torchrun's rendezvous store
are reachable from nowhere else. One Slurm node, so one PS node (R=1) and two workers on it.

A long run (``scripts/test --long``), as root: installs slurm-wlm and munge when missing."""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from irdmafs.launch.local import free_ports

from ..conftest import fuse_unavailable
from ..packages import missing

pytestmark = [pytest.mark.mount, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "irdmafs-train.sbatch"
JOB_TIMEOUT = 300  # seconds: the job itself takes about 30 here
STEPS = 8

TRAIN = textwrap.dedent(
    f"""
    # Two torchrun workers train a linear regression through the mount (bsp, SGD on the PS).
    import os, sys, time
    from pathlib import Path
    import torch
    from irdmafs.worker.torch import ParameterServer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mount = Path(os.environ["IRDMAFS_MOUNT"])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(rank))
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1)
    ready = mount / "reg.published"
    if rank == 0:
        (mount / "reg").mkdir()
        ps = ParameterServer(mount, "reg", rank)
        ps.configure(sync="bsp", workers=str(world), optimizer="sgd lr=0.05")
        ps.publish(model)
        ready.write_text("yes")
    else:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "rank 0 never published the model"
            time.sleep(0.1)
        ps = ParameterServer(mount, "reg", rank)
    ps.pull(model)
    losses = []
    for step in range({STEPS}):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        ps.step(model)
    ps.close()
    w = ",".join(f"{{v:.6f}}" for v in model.weight.detach().flatten().tolist())
    sys.stdout.write(f"\\nrank {{rank}} of {{world}} losses {{losses[0]:.3f}} -> {{losses[-1]:.3f}} weight {{w}}\\n")
    sys.stdout.flush()
    """
)


def inside(netns: str) -> list[str]:
    """The command prefix that runs in the network namespace only: not ``ip netns exec``, which
    also mounts a sysfs of its own, without the cgroup file system slurmd needs."""
    return ["nsenter", f"--net=/run/netns/{netns}", "--"]


def run(netns: str, *cmd, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([*inside(netns), *map(str, cmd)], capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))}: exit {r.returncode}: {r.stdout} {r.stderr}")
    return r


def slurm_conf(d: Path, ctld_port: int, slurmd_port: int, munge_socket: Path) -> str:
    return textwrap.dedent(
        f"""
        ClusterName=irdmafs-test
        SlurmctldHost={os.uname().nodename.split('.')[0]}(127.0.0.1)
        SlurmctldPort={ctld_port}
        SlurmdPort={slurmd_port}
        SlurmUser=root
        SlurmdUser=root
        AuthType=auth/munge
        CredType=cred/munge
        AuthInfo=socket={munge_socket}
        StateSaveLocation={d}/state
        SlurmdSpoolDir={d}/spool
        SlurmctldPidFile={d}/slurmctld.pid
        SlurmdPidFile={d}/slurmd.pid
        SlurmctldLogFile={d}/slurmctld.log
        SlurmdLogFile={d}/slurmd.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        SchedulerType=sched/backfill
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        MpiDefault=none
        ReturnToService=2
        KillWait=5
        NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
        PartitionName=test Nodes=localhost Default=YES MaxTime=30 State=UP OverSubscribe=YES
        """
    )


def stop(pidfile: Path, proc: subprocess.Popen | None = None) -> None:
    """Stop one daemon we started: by the pid it wrote (it forks), else by its Popen."""
    pids = []
    if pidfile.exists() and pidfile.read_text().strip():
        pids.append(int(pidfile.read_text().split()[0]))
    if proc is not None:
        pids.append(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 15
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc is not None:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def processes_mentioning(text: str) -> list[str]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{p.name}: {cmd}")
    return out


def mounts_under(path: Path) -> list[str]:
    return [ln for ln in Path("/proc/mounts").read_text().splitlines() if str(path) in ln]


@pytest.fixture
def slurm(tmp_path):
    """munged, slurmctld and slurmd in a loopback-only network namespace; yields (netns, env)."""
    if os.geteuid() != 0:
        pytest.skip("Slurm's daemons and a network namespace need root")
    reason = fuse_unavailable() or missing(["slurm-wlm", "munge"], ["slurmctld", "slurmd", "sbatch", "munged"])
    if reason:
        pytest.skip(reason)
    if not shutil.which("ip"):
        pytest.skip("ip (iproute2) not installed: no network namespace")
    if not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip(f"no torchrun beside {sys.executable} (the test extra's torch)")
    d = tmp_path / "slurm"
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir(parents=True)
    os.chmod(tmp_path, 0o755)  # the job's files below are read by slurmd's children
    os.chmod(d / "munge", 0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge" / "munge.socket"
    ctld_port, slurmd_port = free_ports(2)
    conf = d / "slurm.conf"
    conf.write_text(slurm_conf(d, ctld_port, slurmd_port, sock))
    env = dict(os.environ, SLURM_CONF=str(conf))
    netns = f"irdmafs-slurm-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True, timeout=30)
    munged = None
    try:
        run(netns, "ip", "link", "set", "lo", "up")
        # a device with an address that reaches nothing (a veth pair, both ends in here):
        # getaddrinfo's AI_ADDRCONFIG answers nothing where loopback is the only device, and
        # Slurm's daemons ask that way (the kernel here has no dummy device)
        run(netns, "ip", "link", "add", "irdmafs0", "type", "veth", "peer", "name", "irdmafs1")
        run(netns, "ip", "addr", "add", "10.254.254.1/32", "dev", "irdmafs0")
        run(netns, "ip", "link", "set", "irdmafs0", "up")
        munged = subprocess.Popen(
            [*inside(netns), "munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={d / 'munge' / 'munged.pid'}", f"--log-file={d / 'munge' / 'munged.log'}", f"--seed-file={d / 'munge' / 'seed'}"],
            stdout=subprocess.DEVNULL, stderr=open(d / "munged.err", "wb"),
        )
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert munged.poll() is None, (d / "munged.err").read_text()
            assert time.monotonic() < deadline, "munged made no socket"
            time.sleep(0.1)
        run(netns, "slurmctld", "-c", env=env)  # -c: a clean start, no state from before
        run(netns, "slurmd", "-N", "localhost", env=env)
        deadline = time.monotonic() + 60
        while True:
            r = run(netns, "sinfo", "-h", "-N", "-o", "%N %t", env=env, check=False)
            if r.returncode == 0 and r.stdout.split()[1:2] == ["idle"]:
                break
            assert time.monotonic() < deadline, f"the Slurm node never came up: {r.stdout} {r.stderr} {(d / 'slurmctld.log').read_text()[-2000:]}"
            time.sleep(0.5)
        yield netns, env, d
    finally:
        subprocess.run([*inside(netns), "scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
        stop(d / "slurmd.pid")
        stop(d / "slurmctld.pid")
        # slurmstepd of a job that outlived its slurmd: found by our config's path
        for line in processes_mentioning(str(d)):
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if munged is not None:
            stop(d / "munge" / "munged.pid", munged)
        subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30)


def test_the_sbatch_script_trains_two_workers_through_the_mount_and_leaves_nothing(slurm, tmp_path):
    netns, env, d = slurm
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(TRAIN)
    mnt = job / "mnt"
    shared = job / "shared"
    ps_port, etcd_port, rdzv_port = free_ports(3)
    env = dict(
        env,
        IRDMAFS=str(Path(sys.executable).parent),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PS_NODES="1",
        GPUS_PER_NODE="2",  # two workers on the one Slurm node
        IRDMAFS_PORT=str(ps_port),
        IRDMAFS_ETCD_PORT=str(etcd_port + 1 if etcd_port == 65535 else etcd_port),
        ETCD_DIR=str(job / "etcd"),
        RDZV_PORT=str(rdzv_port),
        MNT=str(mnt),
        SHARED=str(shared),
        ETCD_LISTEN="127.0.0.1",
    )
    out = job / "slurm-%j.out"
    r = run(
        netns, "sbatch", "--parsable", "--wait", "--nodes=1", "--time=10", f"--output={out}", f"--chdir={job}",
        str(SBATCH), str(job / "train.py"),
        env=env, timeout=JOB_TIMEOUT, check=False,
    )
    [log] = list(job.glob("slurm-*.out")) or [None]
    text = log.read_text() if log else "(no job output)"
    assert r.returncode == 0, f"sbatch: {r.stdout} {r.stderr}\n--- job output ---\n{text[-4000:]}\n--- slurmd ---\n{(d / 'slurmd.log').read_text()[-2000:]}"

    # the two workers' lines may come through srun interleaved with other output: match, not split
    found = {m[0]: m[1:] for m in re.findall(r"rank (\d) of 2 losses ([\d.]+) -> ([\d.]+) weight ([-\d.,]+)", text)}
    assert set(found) == {"0", "1"}, text[-4000:]
    for rank, (first, last, _) in found.items():
        assert float(last) < float(first), (rank, first, last)  # SGD on the PS moved what the workers pulled
    assert found["0"][2] == found["1"][2], found  # bsp: both pulled the same parameters

    # nothing left: no job, no process of the job, no mount, the job's files gone
    q = run(netns, "squeue", "-h", env=env)
    assert q.stdout.strip() == ""
    deadline = time.monotonic() + 30
    while processes_mentioning(str(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(job)) == []
    assert mounts_under(job) == []
    assert not shared.exists() and not (job / "etcd").exists()
