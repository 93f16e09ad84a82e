#!/usr/bin/env python3
"""CPU-seconds per GB of irdmafs's data plane against the tools underneath it, in one run.

    .venv/bin/python scripts/bench_cpu.py [--mib 2048] [--reps 3] [--replicas 1,2]
                                          [--transports tcp[,shm]] [--json FILE]

What is measured (GB = 1e9 bytes, the bytes the user moved: a file's size, whatever R is):

- irdmafs: 3 local node processes (``--transport tcp``, or shm; R=1 and R=2, 4 MiB stripes: as
  ``irdmafs up`` makes them, through scripts/bench.py's ``local_cluster``) and a mount of them
  (``irdmafs mount -f``, its own process). A file of --mib MiB is created through the mount (a
  new file: the nodes fault in fresh pages of this VM for it, so that first write is reported
  apart, with no target), then each rep overwrites it in 1 MiB writes (the mount sends writes
  of a write-only open straight through, around the page cache) and reads it cold in 1 MiB
  reads (its cached pages dropped first with POSIX_FADV_DONTNEED: a targeted drop, not the whole
  machine's ``drop_caches``; the overwrite's open drops them as well, fs/pagecache.py), every
  byte checked. Over each transfer, the user + system CPU time of the node processes (serving
  one-sided reads / taking writes, replicating them at R=2) and of the mount's process.
- iperf3 (Debian's) on loopback moving the same bytes (``-n``; counted per byte it moved: with
  ``-R`` it may send one block more) with 1 MiB writes and the transport's socket buffers: its
  long-lived server's CPU over a run where it receives (the receiver) and over one with ``-R``
  where it sends (the sender). The client's own CPU (from
  its rusage at exit: it includes its start) and iperf3's own ``cpu_utilization_percent`` are
  kept beside them as a check.
- the pyfuse3 ceiling daemon, scripts/memfs.py (as scripts/bench.py mounts it: direct_io and
  through the page cache), its process's CPU over a dd-like write and a cold read of the same
  bytes in 1 MiB requests through it; per operation the cheaper of its two modes counts.
- the Client API (irdmafs.client, in this process, with its own engine thread): each rep
  overwrites a file of --mib MiB from one array (``Client.write``) and pulls it into another
  (``read_into``), every byte checked; this process's CPU clock over each (its threads only: the
  processes it started have clocks of their own).

CPU time: each process's CPU clock (``clock_gettime`` of the process's CPUCLOCK_SCHED: the
thread group's user + system time, threads that ended included, in ns: the same counter
/proc/<pid>/stat's utime + stime are made from, which rounds each to a 10 ms tick), of the
process and its children, read before and after each transfer; /proc/<pid>/stat is read too
and the run's totals by both ways are compared (``proc_stat_vs_clock``, about 1).

The references are timed interleaved with each cluster's transfers, rep by rep, in ABBA order,
and each cluster's ratios are between medians of its own reps and of the references timed with
them (keys ``..._<tag>``: ``r1``, ``r2`` on tcp, ``shm_r1``, ``shm_r2`` on shared memory).
Targets (each printed with whether it holds):

    node_read_cpu_vs_iperf3_<tag>        node CPU/GB serving reads  <= 1.3 x iperf3 sender
    node_write_cpu_vs_iperf3_<tag>       node CPU/GB taking writes  <= 1.3 x (R x receiver + (R-1) x sender)
    mount_read_cpu_vs_iperf3_fuse_<tag>  mount CPU/GB reading       <= 1.3 x (iperf3 receiver + pyfuse3 read)
    mount_write_cpu_vs_iperf3_fuse_<tag> mount CPU/GB writing       <= 1.3 x (iperf3 sender + pyfuse3 write)
    client_pull_cpu_vs_iperf3_<tag>      Client CPU/GB pulling      <= 1.3 x iperf3 receiver
    client_push_cpu_vs_iperf3_<tag>      Client CPU/GB pushing      <= 1.3 x iperf3 sender

and, apart, the new file's first write by the same references (``..._fresh_..._<tag>``).
Raw CPU s/GB are printed and written beside every ratio (``..._cpu_s_per_gb_...``). Everything
started (etcd, nodes, mounts, memfs, iperf3) is stopped and unmounted on any end, Ctrl-C and
SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import drop_cached, local_cluster  # noqa: E402

import trio  # noqa: E402

from irdmafs.client.client import Client  # noqa: E402
from irdmafs.launch.local import end_on_sigterm  # noqa: E402
from irdmafs.launch.mount import mount_background, stop_background, unmount, wait_for_mount  # noqa: E402
from irdmafs.transport.tcp import SOCKET_BUFFER  # noqa: E402

MiB = 1 << 20
GB = 1e9
HERE = Path(__file__).resolve().parent
BOUND = 1.3  # every target: irdmafs's CPU per GB at most 1.3 x its reference's
PATTERN = 64 * MiB  # the distinct bytes the files are made of (chunks arranged per rep)
TICK = os.sysconf("SC_CLK_TCK")


def transfer_deadline(nbytes: int) -> float:
    """Seconds any one transfer may take before the run gives up (20 MB/s at the least)."""
    return 60.0 + nbytes / 20e6


# -- CPU accounting --------------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree(pids: list[int]) -> list[int]:
    """``pids`` and their descendants alive now (a node or a mount forks none on its data path;
    the mount's fusermount3 -- auto_unmount -- is counted, and is idle)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f:
                parent[int(entry)] = int(f[1])
    out, todo = [], list(pids)
    while todo and len(out) < 10_000:  # bounded: a pid loop cannot happen, but never spin
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def clock_ns(pid: int) -> int:
    """The process's CPU clock (user + system, all its threads, ended ones included), in ns."""
    return time.clock_gettime_ns(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def proc_ticks(pid: int) -> int:
    f = _stat_fields(pid)
    return int(f[11]) + int(f[12]) if f else 0  # utime + stime, in clock ticks


class Meter:
    """The CPU seconds of a fixed set of processes (their trees, as at the start) over a window:
    ``with meter.window() as w: ...``, then ``w.seconds``. Totals by /proc ticks and by the
    clocks are kept for ``proc_stat_vs_clock``."""

    totals = {"clock": 0.0, "proc": 0.0}

    def __init__(self, pids: list[int]):
        self.roots = list(pids)

    @contextlib.contextmanager
    def window(self):
        pids = tree(self.roots)
        w = _Window()
        c0 = {p: clock_ns(p) for p in pids}
        t0 = {p: proc_ticks(p) for p in pids}
        try:
            yield w
        finally:
            # a process that ended in the window (it must not: the run then fails) counts 0
            clock = sum(max(0, _safe(clock_ns, p) - c0[p]) for p in pids) / 1e9
            ticks = sum(max(0, proc_ticks(p) - t0[p]) for p in pids) / TICK
            w.seconds = clock
            Meter.totals["clock"] += clock
            Meter.totals["proc"] += ticks


class _Window:
    seconds = 0.0


@contextlib.contextmanager
def own_window():
    """This process's CPU seconds (all its threads, none of its children) over the block."""
    w = _Window()
    t0 = time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID)
    try:
        yield w
    finally:
        w.seconds = (time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID) - t0) / 1e9


def _safe(fn, pid: int) -> int:
    try:
        return fn(pid)
    except OSError:
        return 0


# -- transfers -------------------------------------------------------------------------------------
class Pattern:
    """Random bytes, PATTERN long; chunk ``i`` of a file at arrangement ``k`` is the pattern's
    MiB ``(i * 7 + k) % count``: each rep's overwrite changes every MiB, no bytes generated."""

    def __init__(self):
        self.buf = np.random.default_rng(0).integers(0, 256, PATTERN, dtype=np.uint8)
        self.count = PATTERN // MiB

    def chunk(self, i: int, k: int) -> np.ndarray:
        j = (i * 7 + k) % self.count
        return self.buf[j * MiB : (j + 1) * MiB]


def write_through(path: Path, nbytes: int, pat: Pattern, k: int, flags: int = 0) -> float:
    """Write ``path`` whole in 1 MiB writes (its open and close -- the flush -- included);
    seconds."""
    t0 = time.perf_counter()
    deadline = t0 + transfer_deadline(nbytes)
    fd = os.open(path, os.O_WRONLY | flags, 0o644)
    try:
        for i in range(nbytes // MiB):
            view = memoryview(pat.chunk(i, k))
            done = 0
            while done < MiB:  # bounded: each pass writes at least a byte or raises
                done += os.pwrite(fd, view[done:], i * MiB + done) or _short("write", path, i * MiB + done)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{path}: write past {transfer_deadline(nbytes):.0f} s")
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_through(path: Path, nbytes: int, pat: Pattern | None, k: int, buf: bytearray) -> float:
    """Read ``path`` whole in 1 MiB reads (open and close included), each MiB checked against
    arrangement ``k`` unless ``pat`` is None; seconds."""
    t0 = time.perf_counter()
    deadline = t0 + transfer_deadline(nbytes)
    view = memoryview(buf)
    arr = np.frombuffer(buf, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(nbytes // MiB):
            got = 0
            while got < MiB:  # bounded: each pass reads at least a byte or raises
                got += os.preadv(fd, [view[got:]], i * MiB + got) or _short("read", path, i * MiB + got)
            if pat is not None and not np.array_equal(arr, pat.chunk(i, k)):
                raise RuntimeError(f"{path}: MiB {i} is not what was written")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{path}: read past {transfer_deadline(nbytes):.0f} s")
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def recycle_cache(path: Path, nbytes: int, buf: bytearray) -> None:
    """Before a cold read of ``path``: read it once (not timed, not checked) and drop its cached
    pages, so the page cache's folios the timed read fills are the ones just freed, for the
    ceiling daemon and the mount alike. Without this the mount's read came after an overwrite
    whose open had dropped its pages seconds earlier, and this VM had handed that memory back to
    its host by then (free page reporting, ``reported_kib``): its read paid the first touch of
    ~2 GB of fresh folios in the kernel's FUSE copy (2-3x its CPU at 2 GiB), the ceiling none."""
    read_through(path, nbytes, None, 0, buf)
    drop_cached(path)


def reported_mib() -> float | None:
    """MiB this VM has handed back to its host so far (free page reporting); None where the
    kernel does not report (no such counter: not "nothing handed back")."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text()) / 1024
    except (OSError, ValueError):
        return None


def _short(op: str, path: Path, off: int) -> int:
    raise RuntimeError(f"{path}: {op} returned 0 at offset {off}")


# -- references ------------------------------------------------------------------------------------
class Iperf3:
    """A long-lived iperf3 server on loopback, measured as a receiver (a client sends to it)
    and as a sender (``-R``)."""

    def __init__(self, tmp: Path):
        if shutil.which("iperf3") is None:
            raise SystemExit("bench_cpu: iperf3 is not installed (scripts/setup installs it; or apt-get install iperf3)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.out = tmp / "iperf3-client.json"
        self.server = subprocess.Popen(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(self.port)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.meter = Meter([self.server.pid])

    def once(self, nbytes: int, reverse: bool) -> dict[str, float]:
        """One run moving ``nbytes``: the server's CPU seconds (``server``), the client's
        (``client``: its rusage at exit), and what iperf3 says of the server (``self_remote``:
        its cpu_utilization_percent of the test's seconds)."""
        cmd = ["iperf3", "-c", "127.0.0.1", "-p", str(self.port), "-n", str(nbytes), "-l", "1M", "-w", str(SOCKET_BUFFER), "-J"]
        cmd += ["-R"] if reverse else []
        doc: dict = {}
        for _ in range(50):  # until the server listens and is free: a refused client tries again
            if self.server.poll() is not None:
                raise RuntimeError(f"iperf3 server exited with {self.server.returncode}")
            with self.meter.window() as w:
                client_cpu, code = self._client(cmd, transfer_deadline(nbytes))
            doc = json.loads(self.out.read_text() or "{}") if self.out.exists() else {}
            end = doc.get("end", {})
            if code == 0 and "sum_received" in end and "sum_sent" in end:
                secs = end["sum_received"]["seconds"]
                cpu = end.get("cpu_utilization_percent", {})
                return {
                    "server": w.seconds,
                    "client": client_cpu,
                    "self_remote": cpu.get("remote_total", 0.0) / 100 * secs,
                    "bytes": end["sum_sent"]["bytes"],  # (its receiver's sum stops short of the last bytes)
                }
            time.sleep(0.1)
        raise RuntimeError(f"iperf3 on loopback gave no figure: {doc.get('error', '(no output)')}")

    def _client(self, cmd: list[str], limit: float) -> tuple[float, int]:
        """Run the client to its end (killed after ``limit`` s); its user + system seconds
        (wait4's rusage) and exit code."""
        with open(self.out, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + limit
        try:
            while True:  # bounded by the deadline
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    return ru.ru_utime + ru.ru_stime, proc.returncode
                if time.monotonic() > deadline:
                    raise TimeoutError(f"iperf3 client still running after {limit:.0f} s")
                time.sleep(0.01)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait(10)

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.kill()
        self.server.wait(10)


class MemFs:
    """scripts/memfs.py mounted in both its modes (direct_io; through the page cache) for the
    run, each a file of ``nbytes``; its daemon's CPU over a write and a cold read."""

    MODES = ("direct", "cached")

    def __init__(self, tmp: Path, nbytes: int, pat: Pattern, buf: bytearray):
        self.nbytes, self.pat, self.buf = nbytes, pat, buf
        self.mounts: dict[str, tuple[Path, subprocess.Popen, Meter]] = {}
        try:
            for mode in self.MODES:
                mnt = tmp / f"memfs-{mode}"
                mnt.mkdir()
                cmd = [sys.executable, str(HERE / "memfs.py"), str(mnt), str(nbytes)] + (["--cached"] if mode == "cached" else [])
                proc = subprocess.Popen(cmd, start_new_session=True)
                self.mounts[mode] = (mnt, proc, Meter([proc.pid]))
                wait_for_mount(str(mnt), proc)
                write_through(mnt / "data", nbytes, pat, 0)  # its buffer's pages faulted in
                read_through(mnt / "data", nbytes, pat, 0, buf)  # and it gives back what it took
        except BaseException:
            self.close()
            raise

    def once(self, op: str) -> dict[str, float]:
        """CPU seconds of the daemon, per mode, over one ``op`` (read|write) of the file."""
        out = {}
        for mode, (mnt, proc, meter) in self.mounts.items():
            if proc.poll() is not None:
                raise RuntimeError(f"memfs ({mode}) exited with {proc.returncode}")
            path = mnt / "data"
            if op == "read":
                recycle_cache(path, self.nbytes, self.buf)
            with meter.window() as w:
                if op == "read":
                    read_through(path, self.nbytes, None, 0, self.buf)
                else:
                    write_through(path, self.nbytes, self.pat, 0)
            out[mode] = w.seconds
        return out

    def close(self) -> None:
        for mnt, proc, _ in self.mounts.values():
            stop_background(str(mnt), proc)
        self.mounts.clear()


# -- irdmafs ---------------------------------------------------------------------------------------
class ClientRun:
    """The Client API's push and pull of one file of ``nbytes`` (``/client.bin``), from
    ``self.data`` into ``self.out``: arrays of this process, filled before the clock starts."""

    def __init__(self, cfg, nbytes: int, pat: Pattern):
        self.cfg, self.nbytes, self.pat = cfg, nbytes, pat
        self.data = np.empty(nbytes, np.uint8)
        self.out = np.zeros(nbytes, np.uint8)  # (calloc'd: the untimed first pull faults its pages in)
        self.attr: dict | None = None

    def arrange(self, k: int) -> None:
        for i in range(self.nbytes // MiB):
            self.data[i * MiB : (i + 1) * MiB] = self.pat.chunk(i, k)

    def once(self, k: int) -> tuple[float, float, float, float]:
        """(push CPU s, pull CPU s, push wall s, pull wall s) of the file at arrangement ``k``."""
        self.arrange(k)
        self.out[:: 1 << 16] ^= 0xFF  # every byte is overwritten by the pull: a stale one fails the check
        got = trio.run(self._once)
        if not np.array_equal(self.out, self.data):
            raise RuntimeError("the Client's pull returned bytes other than its push wrote")
        return got

    async def _once(self) -> tuple[float, float, float, float]:
        with trio.fail_after(2 * transfer_deadline(self.nbytes)):
            async with Client.connect(self.cfg) as c:
                if self.attr is None:
                    self.attr = await c.paths.open_file("/client.bin", create=True, truncate=True)
                attr = self.attr
                t0 = time.perf_counter()
                with own_window() as push:
                    attr = self.attr = await c.write(attr["ino"], 0, self.data, attr) or attr  # its new size
                t1 = time.perf_counter()
                with own_window() as pull:
                    n = await c.read_into(attr["ino"], 0, memoryview(self.out), attr)
                t2 = time.perf_counter()
                if n != self.nbytes:
                    raise RuntimeError(f"the Client's pull read {n} bytes of {self.nbytes}")
                return push.seconds, pull.seconds, t1 - t0, t2 - t1


@contextlib.contextmanager
def mounted(lc, mnt: Path):
    """``irdmafs mount -f`` of ``lc`` on ``mnt`` (made), its process yielded; unmounted and
    ended (killed after 10 s) afterwards."""
    mnt.mkdir()
    proc = mount_background(str(lc.config_path), str(mnt), [], mnt.parent / f"{mnt.name}.log")
    try:
        yield proc
    finally:
        stop_background(str(mnt), proc)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def per_gb(seconds: float, nbytes: int) -> float:
    return seconds / (nbytes / GB)


def one_cluster(tmp: Path, transport: str, replicas: int, nbytes: int, reps: int, pat: Pattern, buf: bytearray,
                iperf: Iperf3, memfs: MemFs, step) -> dict[str, float]:
    """One cluster's figures and the references timed with them (keys ending ``_<tag>``)."""
    tag = f"r{replicas}" if transport == "tcp" else f"{transport}_r{replicas}"
    res: dict[str, float] = {}
    with local_cluster(tmp / tag, replicas, tmp, transport) as lc, mounted(lc, tmp / tag / "mnt") as mount:
        nodes, mnt = Meter([p.pid for p in lc.procs.values()]), Meter([mount.pid])
        path = tmp / tag / "mnt" / "cpu.bin"

        def alive() -> None:
            lc.check_alive()
            if mount.poll() is not None:
                raise RuntimeError(f"the mount exited with {mount.returncode}")

        def irdmafs_op(op: str, k: int) -> tuple[float, float, float, float | None]:
            """(nodes' CPU s, mount's CPU s, wall s, MiB the VM handed back meanwhile) over one
            overwrite or cold read."""
            alive()
            if op == "read":
                recycle_cache(path, nbytes, buf)
            r0 = reported_mib()
            with nodes.window() as wn, mnt.window() as wm:
                t = write_through(path, nbytes, pat, k) if op == "write" else read_through(path, nbytes, pat, k, buf)
            alive()
            r1 = reported_mib()
            return wn.seconds, wm.seconds, t, (r1 - r0 if r0 is not None and r1 is not None else None)

        step(f"{tag}: idle CPU over 1 s, then a new file of {nbytes // MiB} MiB (fresh pages)")
        with nodes.window() as wn, mnt.window() as wm, own_window() as wc:
            time.sleep(1.0)
        res[f"nodes_idle_cpu_s_per_s_{tag}"] = wn.seconds
        res[f"mount_idle_cpu_s_per_s_{tag}"] = wm.seconds
        res[f"client_idle_cpu_s_per_s_{tag}"] = wc.seconds
        k = 0
        with nodes.window() as wn, mnt.window() as wm:
            t = write_through(path, nbytes, pat, k, os.O_CREAT | os.O_TRUNC)
        fresh = {"node": wn.seconds, "mount": wm.seconds, "wall": t}
        alive()
        k += 1
        irdmafs_op("write", k)  # warm-ups, not counted: the first overwrite and the first cold read
        irdmafs_op("read", k)
        step(f"{tag}: the Client's file of {nbytes // MiB} MiB, written and read once (not counted)")
        client = ClientRun(lc.cfg, nbytes, pat)
        client.once(k)  # its first write fills fresh pages of the nodes, as the mount's did
        samples: dict[str, list[float]] = {}

        def add(key: str, v: float) -> None:
            samples.setdefault(key, []).append(v)

        def mine() -> None:
            nonlocal k
            k += 1
            for op in ("write", "read"):
                n_s, m_s, t, handed = irdmafs_op(op, k)
                add(f"node_{op}", n_s)
                add(f"mount_{op}", m_s)
                add(f"{op}_wall", t)
                if handed is not None:
                    add(f"{op}_reported_mib", handed)
            alive()
            push, pull, t_push, t_pull = client.once(k)
            alive()
            add("client_push", push)
            add("client_pull", pull)
            add("push_wall", t_push)
            add("pull_wall", t_pull)

        def refs() -> None:
            for reverse, side in ((False, "recv"), (True, "send")):
                r = iperf.once(nbytes, reverse)
                if r["bytes"] < nbytes:
                    raise RuntimeError(f"iperf3 moved {r['bytes']} bytes, not {nbytes}")
                scale = nbytes / r["bytes"]  # it may send a block more than -n asks (-R): per byte it moved
                add(f"iperf3_{side}", r["server"] * scale)
                add(f"iperf3_client_{'send' if side == 'recv' else 'recv'}", r["client"] * scale)  # the other side
                add(f"iperf3_self_{side}", r["self_remote"] * scale)  # the server's, as iperf3 says
            for op in ("write", "read"):
                for mode, s in memfs.once(op).items():
                    add(f"fuse_{op}_{mode}", s)

        for i in range(reps):  # ABBA: what one leaves behind lands on the other alike
            step(f"{tag}: rep {i + 1} of {reps}")
            if i % 2:
                refs()
                mine()
            else:
                mine()
                refs()

    g = {key: per_gb(med(v), nbytes) for key, v in samples.items() if not key.endswith(("_wall", "_reported_mib"))}
    for mode_op in ("write", "read"):
        g[f"fuse_{mode_op}"] = min(g[f"fuse_{mode_op}_{m}"] for m in MemFs.MODES)
    R = replicas
    refs_of = {
        "node_read": ("iperf3 sender", g["iperf3_send"]),
        "node_write": (f"{R} x receiver + {R - 1} x sender" if R > 1 else "iperf3 receiver", R * g["iperf3_recv"] + (R - 1) * g["iperf3_send"]),
        "mount_read": ("iperf3 receiver + pyfuse3 read", g["iperf3_recv"] + g["fuse_read"]),
        "mount_write": ("iperf3 sender + pyfuse3 write", g["iperf3_send"] + g["fuse_write"]),
        "client_pull": ("iperf3 receiver", g["iperf3_recv"]),
        "client_push": ("iperf3 sender", g["iperf3_send"]),
    }
    for what, (label, ref) in refs_of.items():
        vs = "iperf3_fuse" if what.startswith("mount") else "iperf3"
        res[f"{what}_cpu_s_per_gb_{tag}"] = g[what]
        res[f"{what}_ref_cpu_s_per_gb_{tag}"] = ref
        res[f"{what}_cpu_vs_{vs}_{tag}"] = g[what] / ref
        who = what.split("_")[0]
        idle = res[f"{'nodes' if who == 'node' else who}_idle_cpu_s_per_s_{tag}"]
        res[f"{what}_idle_cpu_s_per_gb_{tag}"] = idle * med(samples[f"{what.split('_')[1]}_wall"]) / (nbytes / GB)  # of the figure: idle's
    res[f"node_write_fresh_cpu_s_per_gb_{tag}"] = per_gb(fresh["node"], nbytes)
    res[f"mount_write_fresh_cpu_s_per_gb_{tag}"] = per_gb(fresh["mount"], nbytes)
    res[f"node_write_fresh_cpu_vs_iperf3_{tag}"] = res[f"node_write_fresh_cpu_s_per_gb_{tag}"] / refs_of["node_write"][1]
    res[f"mount_write_fresh_cpu_vs_iperf3_fuse_{tag}"] = res[f"mount_write_fresh_cpu_s_per_gb_{tag}"] / refs_of["mount_write"][1]
    res[f"write_fresh_gbps_{tag}"] = nbytes / fresh["wall"] / GB
    res[f"write_gbps_{tag}"] = nbytes / med(samples["write_wall"]) / GB
    res[f"read_gbps_{tag}"] = nbytes / med(samples["read_wall"]) / GB
    for op in ("write", "read"):
        if f"{op}_reported_mib" in samples:
            res[f"{op}_reported_mib_max_{tag}"] = max(samples[f"{op}_reported_mib"])
    res[f"client_push_gbps_{tag}"] = nbytes / med(samples["push_wall"]) / GB
    res[f"client_pull_gbps_{tag}"] = nbytes / med(samples["pull_wall"]) / GB
    for key in ("iperf3_send", "iperf3_recv", "iperf3_client_send", "iperf3_client_recv", "iperf3_self_send", "iperf3_self_recv",
                "fuse_read", "fuse_write", *(f"fuse_{op}_{m}" for op in ("read", "write") for m in MemFs.MODES)):
        res[f"{key}_cpu_s_per_gb_{tag}"] = g[key]
    res[f"_labels_{tag}"] = {what: label for what, (label, _) in refs_of.items()}  # for the table; dropped from the JSON
    return res


# -- report ------------------------------------------------------------------------------------------
ROWS = (
    ("node serving reads", "node_read", "iperf3"),
    ("node taking writes", "node_write", "iperf3"),
    ("mount reading", "mount_read", "iperf3_fuse"),
    ("mount writing", "mount_write", "iperf3_fuse"),
    ("Client pulling", "client_pull", "iperf3"),
    ("Client pushing", "client_push", "iperf3"),
)


def table(res: dict, tags: list[str]) -> tuple[str, int, int]:
    """The table, and how many targets it names and how many hold."""
    head = f"{'cluster':8} {'what':28} {'CPU s/GB':>8} {'(idle)':>7} {'ref s/GB':>8}  {'reference':32} {'ratio':>6}"
    lines = [head + "  target  holds"]
    named = held = 0
    for tag in tags:
        labels = res[f"_labels_{tag}"]
        for name, what, vs in ROWS:
            ratio = res[f"{what}_cpu_vs_{vs}_{tag}"]
            ok = ratio <= BOUND
            named, held = named + 1, held + ok
            lines.append(f"{tag:8} {name:28} {res[f'{what}_cpu_s_per_gb_{tag}']:8.3f} {res[f'{what}_idle_cpu_s_per_gb_{tag}']:7.3f} "
                         f"{res[f'{what}_ref_cpu_s_per_gb_{tag}']:8.3f}  {labels[what]:32} {ratio:6.2f}  <= {BOUND}  {'yes' if ok else 'NO'}")
    lines += ["", "apart: a new file (the nodes fault in fresh pages of this VM), no target:"]
    for tag in tags:
        for name, what, vs in (("node taking writes, new file", "node_write", "iperf3"), ("mount writing, new file", "mount_write", "iperf3_fuse")):
            lines.append(f"{tag:8} {name:28} {res[f'{what}_fresh_cpu_s_per_gb_{tag}']:8.3f} {'':7} {res[f'{what}_ref_cpu_s_per_gb_{tag}']:8.3f}  "
                         f"{res[f'_labels_{tag}'][what]:32} {res[f'{what}_fresh_cpu_vs_{vs}_{tag}']:6.2f}")
    lines += ["", "(idle): what the processes burn idle (heartbeats, leases) over as long as the transfer took, part of CPU s/GB",
              "", "references timed with each cluster, CPU s/GB (pyfuse3: the cheaper of its two modes; iperf3: its server's):"]
    lines.append(f"{'cluster':8} {'iperf3 send':>11} {'iperf3 recv':>11} {'fuse read':>10} {'fuse write':>10}   "
                 f"{'client send/recv':>17}   {'iperf3 says send/recv':>21}")
    for tag in tags:
        r = {k: res[f"{k}_cpu_s_per_gb_{tag}"] for k in ("iperf3_send", "iperf3_recv", "fuse_read", "fuse_write", "iperf3_client_send",
                                                       "iperf3_client_recv", "iperf3_self_send", "iperf3_self_recv")}
        lines.append(f"{tag:8} {r['iperf3_send']:11.3f} {r['iperf3_recv']:11.3f} {r['fuse_read']:10.3f} {r['fuse_write']:10.3f}   "
                     f"{r['iperf3_client_send']:8.3f} / {r['iperf3_client_recv']:6.3f}   {r['iperf3_self_send']:12.3f} / {r['iperf3_self_recv']:6.3f}")
    lines += ["", f"{'cluster':8} {'write GB/s':>10} {'read GB/s':>10} {'new file GB/s':>14} {'Client push/pull GB/s':>22} "
              f"{'nodes idle CPU s/s':>19} {'mount idle CPU s/s':>19}"]
    for tag in tags:
        lines.append(f"{tag:8} {res[f'write_gbps_{tag}']:10.3f} {res[f'read_gbps_{tag}']:10.3f} {res[f'write_fresh_gbps_{tag}']:14.3f} "
                     f"{res[f'client_push_gbps_{tag}']:12.3f} / {res[f'client_pull_gbps_{tag}']:7.3f} "
                     f"{res[f'nodes_idle_cpu_s_per_s_{tag}']:19.3f} {res[f'mount_idle_cpu_s_per_s_{tag}']:19.3f}")
    if all(f"{op}_reported_mib_max_{tag}" in res for tag in tags for op in ("write", "read")):
        lines += ["", "MiB this VM handed back to its host during the timed overwrites / reads (the most of any rep; "
                  "pages touched again cost ~0.75 s/GB): " + ", ".join(
                      f"{tag} {res[f'write_reported_mib_max_{tag}']:.0f} / {res[f'read_reported_mib_max_{tag}']:.0f}" for tag in tags)]
    else:
        lines += ["", "no free page reporting here (/sys/module/page_reporting): memory handed back to a host is not known"]
    return "\n".join(lines), named, held


def main() -> int:
    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048, help="the file's size in MiB (and what each reference moves)")
    ap.add_argument("--reps", type=int, default=3, help="timed reps per cluster (after one warm-up)")
    ap.add_argument("--replicas", default="1,2", help="the R of each cluster, comma separated")
    ap.add_argument("--transports", default="tcp", help="the nodes' transports, comma separated: tcp, shm")
    ap.add_argument("--json", help="write every figure here, as a flat JSON object")
    args = ap.parse_args()
    if args.mib < 1 or args.reps < 1:
        ap.error("--mib and --reps must be at least 1")
    transports = [t for t in args.transports.split(",") if t]
    replicas = [int(r) for r in args.replicas.split(",") if r]
    if not set(transports) <= {"tcp", "shm"} or not replicas or not set(replicas) <= {1, 2, 3}:
        ap.error("--transports: tcp and/or shm; --replicas: of 1, 2, 3 (3 nodes)")
    try:
        clock_ns(os.getpid())
    except OSError as exc:
        raise SystemExit(f"bench_cpu: no CPU clock of a process here ({exc})")
    nbytes = args.mib * MiB

    def step(what: str) -> None:
        print(f"bench_cpu: {what}", file=sys.stderr, flush=True)

    pat = Pattern()
    buf = bytearray(MiB)
    res: dict = {"mib": args.mib, "reps": args.reps}
    tags: list[str] = []
    with tempfile.TemporaryDirectory(prefix="irdmafs-bench-cpu-") as tmp_s:
        tmp = Path(tmp_s)
        iperf = memfs = None
        try:
            iperf = Iperf3(tmp)
            step(f"the pyfuse3 ceiling daemon: two mounts of {args.mib} MiB")
            memfs = MemFs(tmp, nbytes, pat, buf)
            for transport in transports:
                for r in replicas:
                    step(f"3 nodes on {transport}, R={r}")
                    got = one_cluster(tmp, transport, r, nbytes, args.reps, pat, buf, iperf, memfs, step)
                    tags.append(next(k for k in got if k.startswith("_labels_")).removeprefix("_labels_"))
                    res |= got
        finally:
            if memfs is not None:
                memfs.close()
            if iperf is not None:
                iperf.close()
            for mode in MemFs.MODES:  # a memfs that never got far enough to be closed
                if (tmp / f"memfs-{mode}").exists():
                    unmount(str(tmp / f"memfs-{mode}"), lazy=True)
    res["proc_stat_vs_clock"] = Meter.totals["proc"] / Meter.totals["clock"] if Meter.totals["clock"] else 0.0
    text, named, held = table(res, tags)
    print(text)
    print(f"\nCPU by /proc/<pid>/stat ticks over the run's windows, against the CPU clocks: {res['proc_stat_vs_clock']:.3f}")
    print(f"targets: {held} of {named} hold (each <= {BOUND} x its reference; {args.mib} MiB, median of {args.reps} reps)")
    res["targets_named"], res["targets_held"] = named, held
    out = {k: v for k, v in res.items() if not k.startswith("_")}
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    if bad:
        print(f"bench_cpu: not finite: {', '.join(bad)}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what it started is stopped by now
        print("bench_cpu: interrupted; everything it started is stopped and unmounted", file=sys.stderr)
        sys.exit(130)
