#!/usr/bin/env python3
"""Transport benchmark: one-sided READ/WRITE and Client striping beside a raw socket, in one run.

    python scripts/bench_transport.py [--json FILE] [--reps N]

Measures, each between two processes on loopback:
  (a) raw socket: a plain blocking sendall / recv_into loop (the reference);
  (b) one-sided READ of 64 MiB and 256 MiB from a node's registered region (TCP transport);
  (c) one-sided WRITE of the same;
  (d) Client striped read and write of a 256 MiB file over 3 local node processes (R=1), and the
      write again with R=2.
Every figure is the median of --reps runs, printed in GB/s and as a ratio to the socket limit:
the larger of (a) and iperf3 (Debian's iperf3) on loopback, measured in the same run. Each timed
run follows a raw-socket transfer of the same size, and (a) is the median of all of those, so
noise on these shared machines lands on both sides of every ratio alike.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from irdmafs.client.client import Client  # noqa: E402
from irdmafs.launch.etcd_process import LocalEtcd  # noqa: E402
from irdmafs.launch.local import LocalCluster, wait_settled, write_config  # noqa: E402
from irdmafs.transport.base import Access  # noqa: E402
from irdmafs.transport.tcp import SOCKET_BUFFER, TcpTransport  # noqa: E402

MiB = 1 << 20
TOKEN = b"bench-token-0123456789"


# -- (a) raw socket -------------------------------------------------------------------------------
def _raw_sender(port: int, nbytes: int) -> None:
    buf = memoryview(bytearray(nbytes))
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    while s.recv(1) == b"g":  # one transfer per "go"; anything else ends it
        s.sendall(buf)
    s.close()


class RawSocket:
    """A sender process and a receiving socket; ``once()`` times one transfer."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        self.proc = mp.Process(target=_raw_sender, args=(ls.getsockname()[1], nbytes), daemon=True)
        self.proc.start()
        self.conn, _ = ls.accept()
        ls.close()
        self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        self.buf = memoryview(bytearray(nbytes))

    def once(self) -> float:
        t0 = time.perf_counter()
        self.conn.send(b"g")
        got = 0
        while got < self.nbytes:
            got += self.conn.recv_into(self.buf[got:])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.conn.send(b"q")
        self.conn.close()
        self.proc.join(5)


def iperf3_gbps(seconds: float = 2.0) -> float:
    """What iperf3 (Debian's iperf3) moves over loopback in one TCP stream at its best, in GB/s: with the
    raw socket above, the socket limit every transport figure is compared with (the larger of
    the two). 0.0, with a line on stderr, if iperf3 is not installed."""
    import shutil
    import subprocess

    if shutil.which("iperf3") is None:
        print("bench: iperf3 not installed (apt-get install iperf3); socket limit from the raw socket alone", file=sys.stderr)
        return 0.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def run(*opts: str) -> float:
        for _ in range(50):  # until the server listens: a client refused at once tries again
            out = subprocess.run(
                ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-J", *opts], capture_output=True, text=True, timeout=seconds + 30
            )
            doc = json.loads(out.stdout or "{}")
            if "sum_received" in doc.get("end", {}):
                return doc["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
            time.sleep(0.1)
        raise RuntimeError(f"iperf3 on loopback gave no figure: {doc.get('error', out.stderr[-300:])}")

    try:
        # its defaults (128 KiB writes) and its best here: the largest block it takes (1 MiB)
        # with the socket buffers the transport asks for; the limit is the better of the two
        return max(run(), run("-l", "1M", "-w", str(SOCKET_BUFFER)))
    finally:
        server.kill()
        server.wait()


# -- (b, c) one-sided READ / WRITE against a node process -----------------------------------------
def _region_server(port_q: mp.Queue, nbytes: int) -> None:
    async def main() -> None:
        t = TcpTransport(TOKEN)
        region = t.alloc_region(nbytes, Access.RW)
        region.buf[:] = os.urandom(1 << 20) * (nbytes >> 20)

        async def handler(method: str, args: dict) -> dict:
            return {"rkey": region.rkey}

        async with trio.open_nursery() as n:
            _, port = await n.start(t.serve, "127.0.0.1", 0, handler)
            port_q.put(port)

    trio.run(main)


async def one_sided(port: int, sizes: list[int], reps: int, raw: RawSocket) -> dict[str, list[float]]:
    """READ and WRITE timings, each rep interleaved with a raw-socket transfer (key ``raw``), so
    noise on this shared machine lands on both sides of every ratio alike."""
    t = TcpTransport(TOKEN)
    out: dict[str, list[float]] = {"raw": []}
    async with trio.open_nursery() as n:
        conn = await t.connect("127.0.0.1", port, nursery=n)
        rkey = (await conn.call("rkey"))["rkey"]
        for size in sizes:
            buf = memoryview(bytearray(size))
            await conn.read(rkey, 0, buf)  # warm-up: page in both sides
            for op in ("read", "write"):
                times = []
                for _ in range(reps):
                    out["raw"].append(raw.once())
                    t0 = time.perf_counter()
                    if op == "read":
                        await conn.read(rkey, 0, buf)
                    else:
                        await conn.write(rkey, 0, buf)
                    times.append(time.perf_counter() - t0)
                out[f"{op}_{size // MiB}"] = times
        await conn.aclose()
        n.cancel_scope.cancel()
    return out


# -- (d) Client striping over 3 node processes ------------------------------------------------------
async def client_striped(state: Path, replicas: int, nbytes: int, reps: int, raw: RawSocket) -> dict[str, list[float]]:
    etcd = LocalEtcd(state / "etcd", log_path=state / "etcd.log")  # the views' coordinator
    etcd.start()
    path = write_config(state, 3, replicas, transport=["tcp"], coordinator=[etcd.endpoint])
    lc = LocalCluster(path)
    lc.start_all()
    try:
        await wait_settled(lc.cfg)
        data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
        out = np.empty_like(data)
        times: dict[str, list[float]] = {"write": [], "read": [], "raw": []}
        async with Client.connect(lc.cfg) as c:
            attr = await c.paths.write_file("/bench", data)  # warm-up: allocates every stripe
            for _ in range(reps):
                times["raw"].append(raw.once())
                t0 = time.perf_counter()
                await c.write(attr["ino"], 0, data, attr)
                times["write"].append(time.perf_counter() - t0)
            attr = await c.getattr(attr["ino"])
            await c.read_into(attr["ino"], 0, memoryview(out), attr)  # warm-up: fault in `out`
            for _ in range(reps):
                times["raw"].append(raw.once())
                t0 = time.perf_counter()
                await c.read_into(attr["ino"], 0, memoryview(out), attr)
                times["read"].append(time.perf_counter() - t0)
            assert np.array_equal(out, data), "striped read returned different bytes"
        return times
    finally:
        lc.stop_all()
        etcd.stop()


def gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the flat JSON result here")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    big = 256 * MiB

    res: dict[str, float] = {}
    raw = RawSocket(big)
    raw.once()  # warm-up
    q: mp.Queue = mp.Queue()
    server = mp.Process(target=_region_server, args=(q, big), daemon=True)
    server.start()
    try:
        port = q.get(timeout=30)
        os_res = trio.run(one_sided, port, [64 * MiB, big], args.reps, raw)
    finally:
        server.kill()
    raw_times = os_res.pop("raw")
    for key, times in os_res.items():
        op, mib = key.split("_")
        res[f"{op}_{mib}mib_gbps"] = gbps(int(mib) * MiB, times)
    res["read_gbps"] = res["read_256mib_gbps"]
    res["write_gbps"] = res["write_256mib_gbps"]

    with tempfile.TemporaryDirectory() as tmp:
        r1 = trio.run(client_striped, Path(tmp) / "r1", 1, big, args.reps, raw)
        r2 = trio.run(client_striped, Path(tmp) / "r2", 2, big, args.reps, raw)
    raw.close()
    raw_times += r1.pop("raw") + r2.pop("raw")
    res["raw_socket_gbps"] = gbps(big, raw_times)
    res["iperf3_gbps"] = iperf3_gbps()
    res["socket_limit_gbps"] = max(res["raw_socket_gbps"], res["iperf3_gbps"])
    res["client_read_gbps"] = gbps(big, r1["read"])
    res["client_write_gbps"] = gbps(big, r1["write"])
    res["client_write_r2_gbps"] = gbps(big, r2["write"])
    res["client_read_r2_gbps"] = gbps(big, r2["read"])

    raw = res["socket_limit_gbps"]  # a reference is a limit: the best of the two, this run
    res["read_ratio"] = res["read_gbps"] / raw
    res["write_ratio"] = res["write_gbps"] / raw
    res["client_read_ratio"] = res["client_read_gbps"] / raw
    res["client_write_ratio"] = res["client_write_gbps"] / raw

    rows = [
        ("socket limit: max(raw socket, iperf3)", "socket_limit_gbps"),
        ("raw socket sendall/recv_into 256 MiB", "raw_socket_gbps"),
        ("iperf3 on loopback, one stream", "iperf3_gbps"),
        ("one-sided READ 64 MiB", "read_64mib_gbps"),
        ("one-sided READ 256 MiB", "read_256mib_gbps"),
        ("one-sided WRITE 64 MiB", "write_64mib_gbps"),
        ("one-sided WRITE 256 MiB", "write_256mib_gbps"),
        ("Client striped read 256 MiB, 3 nodes, R=1", "client_read_gbps"),
        ("Client striped write 256 MiB, 3 nodes, R=1", "client_write_gbps"),
        ("Client striped read 256 MiB, 3 nodes, R=2", "client_read_r2_gbps"),
        ("Client striped write 256 MiB, 3 nodes, R=2", "client_write_r2_gbps"),
    ]
    print(f"{'measurement':48} {'GB/s':>7} {'vs limit':>8}")
    for label, key in rows:
        print(f"{label:48} {res[key]:7.2f} {res[key] / raw:7.2f}")
    print(f"read_ratio {res['read_ratio']:.2f} (target >= 0.85), client_read_ratio {res['client_read_ratio']:.2f} (target >= 0.70)")
    res = {k: round(v, 4) for k, v in res.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
