"""Network namespaces with shaped veth links, for the benchmarks that need a real network.

``namespaces(n, rate)`` makes n namespaces ``<prefix>0..n-1``, each joined to the root namespace
by a veth pair whose both ends are shaped by tbf to ``rate`` (``rate=None``: not shaped), and
yields their addresses (10.<net>.i.2; the root end is 10.<net>.i.1 and forwards between them).
Everything it made is removed at the end, and ip_forward is put back. Needs root and iproute2.
Traffic only ever goes to these addresses.
"""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


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
            for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"10.{net}.{i}.2/24", "dev", there], ["ip", "link", "set", there, "up"], ["ip", "route", "add", "default", "via", f"10.{net}.{i}.1"]):
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
        forward.write_text(old_forward)
