"""Network namespaces with shaped veth links, for the benchmarks that need a real network.

``namespaces(n, rate)`` makes n namespaces ``<prefix>0..n-1``, each joined to the root namespace
by a veth pair whose both ends are shaped by tbf to ``rate`` (``rate=None``: not shaped), and
yields their addresses (10.<net>.i.2; the root end is 10.<net>.i.1 and forwards between them).
Everything it made is removed at the end, and ip_forward is put back once no namespace is left. Needs root and iproute2.
Traffic only ever goes to these addresses.

Helpers for running inside them: ``enter(ns)`` is a command prefix that enters only the network
namespace (``nsenter --net``; ``ip netns exec`` also makes a new mount namespace, so a FUSE mount
made under it is invisible outside), ``setns(ns)`` moves the calling process into it (a child's
first call, before it opens any socket), ``link_bytes`` reads a root-side veth end's counters,
``single_stream`` measures what one TCP stream between two of the namespaces achieves.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

CLONE_NEWNET = 0x40000000


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or f'exit status {r.returncode}'}")


def rate_bits(rate: str) -> int:
    """tc's rate in bits per second: ``1gbit`` is 10**9 (tc's units are SI; only ``bit`` units
    are taken here, not tc's ``mbps`` = megabytes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 500mbit or 1gbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def burst_for(rate: str) -> str:
    """A tbf burst that does not cap below ``rate``: it must cover a timer tick's worth of bytes
    (rate / HZ; 4 ms at HZ=250), taken twice for HZ=100 kernels, never under 256 KiB."""
    return f"{max(256 << 10, rate_bits(rate) // 8 // 50)}b"


@contextmanager
def namespaces(n: int, rate: str | None, *, prefix: str, net: int, mtu: int = 1500, burst: str = "256kb"):
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    old_forward = forward.read_text().strip()
    made = []
    try:
        forward.write_text("1")
        for i in range(n):
            ns, here, there = f"{prefix}{i}", f"{prefix}h{i}", f"{prefix}n{i}"
            sh("ip", "netns", "add", ns)
            made.append(i)
            sh("ip", "link", "add", here, "mtu", str(mtu), "type", "veth", "peer", "name", there, "mtu", str(mtu))
            sh("ip", "link", "set", there, "netns", ns)
            sh("ip", "addr", "add", f"10.{net}.{i}.1/24", "dev", here)
            sh("ip", "link", "set", here, "up")
            for cmd in (
                ["ip", "link", "set", "lo", "up"],
                ["ip", "addr", "add", f"10.{net}.{i}.2/24", "dev", there],
                ["ip", "link", "set", there, "up"],
                ["ip", "route", "add", "default", "via", f"10.{net}.{i}.1"],
            ):
                sh("ip", "netns", "exec", ns, *cmd)
            if rate:
                # burst must cover rate / HZ, or tbf itself caps below the rate
                sh("tc", "qdisc", "add", "dev", here, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", there, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")
        yield [f"10.{net}.{i}.2" for i in range(n)]
    finally:
        for i in made:
            subprocess.run(["ip", "netns", "del", f"{prefix}{i}"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{prefix}h{i}"], capture_output=True)
        # put ip_forward back only when no other namespaces are left: a run beside this one (a
        # test and a benchmark at once) would lose its routes mid-run (seen: a chaos test's nodes
        # cut off from each other when a benchmark ended)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip()
        if not left:
            forward.write_text(old_forward)


def enter(ns: str) -> list[str]:
    """A command prefix running a program in network namespace ``ns`` only (the mount namespace
    stays: its FUSE mounts are everyone's)."""
    return ["nsenter", f"--net=/run/netns/{ns}"]


def setns(ns: str) -> None:
    """Move the calling (single-threaded) process into network namespace ``ns``, nothing else."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def link_bytes(dev: str) -> tuple[int, int]:
    """(tx, rx) bytes so far of a root-namespace interface: for a namespace's root-side veth end
    ``<prefix>h<i>``, tx is what went into the namespace and rx what came out of it."""
    base = Path("/sys/class/net") / dev / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


_RECEIVER = r"""
import json, socket, sys, time
host, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_server((host, port))
s.settimeout(limit)
print("listening", flush=True)
c, _ = s.accept()
c.settimeout(limit)
buf = bytearray(1 << 20)
n = c.recv_into(buf)
t0, got = time.perf_counter(), 0
deadline = t0 + limit
while n and time.perf_counter() < deadline:
    n = c.recv_into(buf)
    got += n
print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
c = socket.create_connection((host, port), timeout=10)
buf = b"\0" * (1 << 20)
end = time.perf_counter() + seconds
while time.perf_counter() < end:
    c.sendall(buf)
c.close()
"""


def single_stream(src_ns: str, dst_ns: str, dst_addr: str, seconds: float = 2.0, port: int = 5399) -> float:
    """Bytes per second one TCP stream (Python, 1 MiB sends) moves from ``src_ns`` to
    ``dst_addr`` in ``dst_ns`` over ``seconds``, measured at the receiver from its first byte."""
    limit = seconds + 20
    recv = subprocess.Popen([*enter(dst_ns), sys.executable, "-c", _RECEIVER, dst_addr, str(port), str(limit)], stdout=subprocess.PIPE, text=True)
    try:
        if recv.stdout.readline().strip() != "listening":
            raise RuntimeError("single_stream: the receiver did not start")
        subprocess.run([*enter(src_ns), sys.executable, "-c", _SENDER, dst_addr, str(port), str(seconds)], check=True, timeout=limit)
        out, _ = recv.communicate(timeout=limit)
        r = json.loads(out.strip().splitlines()[-1])
        return r["bytes"] / r["seconds"]
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(10)
