#!/usr/bin/env python3
"""The engine's completion latency and one-sided throughput, beside the Python data plane and a
raw socket, in one run.

    python scripts/bench_engine.py [--reads N] [--mib M] [--json FILE]

- **Latency**: N sequential 64-byte READs (each waits for the last), served by a node process
  on loopback, through the native engine (both sides) and through tcp.py's Python data plane
  (both sides); the median and the worst, each as a ratio to a raw socket's round trip of a
  40-byte request and a 104-byte answer between two processes, measured in the same run (the
  limit: no transport answers faster than the socket under it). The engine must hand a
  completion to its waiting task promptly (nothing sleeps to batch): its median is the figure.
- **Throughput**: one-sided READ and WRITE of M MiB in 1 MiB operations, 8 in flight, on an
  overwrite of the same region (the fresh pages of a first touch are paid before timing), for
  both data planes, against iperf3 on loopback (bench_transport.py's), in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from bench_transport import iperf3_gbps  # noqa: E402
from irdmafs.transport.base import Access  # noqa: E402
from irdmafs.transport.tcp import TcpTransport  # noqa: E402

TOKEN = b"bench-engine"
MiB = 1 << 20


def _node(engine: str, size: int, ready) -> None:
    async def main():
        server = TcpTransport(TOKEN, engine=engine)
        region = server.alloc_region(size, Access.RW)
        region.buf[:] = b"\x5a" * size  # touched: its pages exist before anything is timed

        async def handler(method, args):
            return {}

        async with trio.open_nursery() as n:
            host, port = await n.start(server.serve, "127.0.0.1", 0, handler)
            ready.send((port, region.rkey))

    trio.run(main)


def _echo(ready) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    ready.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    answer = b"a" * 104
    while True:
        got = 0
        while got < 40:
            b = conn.recv(40 - got)
            if not b:
                return
            got += len(b)
        conn.sendall(answer)


def raw_rtts(n: int) -> list[float]:
    a, b = mp.Pipe()
    p = mp.Process(target=_echo, args=(b,), daemon=True)
    p.start()
    port = a.recv()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req, out = b"r" * 40, []
    for _ in range(n):
        t = time.perf_counter()
        s.sendall(req)
        got = 0
        while got < 104:
            got += len(s.recv(104 - got))
        out.append(time.perf_counter() - t)
    s.close()
    p.join(5)
    p.kill()
    return out


def start_node(engine: str, size: int):
    a, b = mp.Pipe()
    p = mp.Process(target=_node, args=(engine, size, b), daemon=True)
    p.start()
    port, rkey = a.recv()
    return p, port, rkey


def transport_figures(engine: str, reads: int, mib: int) -> dict:
    p, port, rkey = start_node(engine, mib * MiB)
    res: dict = {}

    async def main():
        async with trio.open_nursery() as n:
            conn = await TcpTransport(TOKEN, engine=engine).connect("127.0.0.1", port, nursery=n)
            buf = bytearray(64)
            for _ in range(200):  # warm
                await conn.read(rkey, 0, buf)
            lat = []
            for _ in range(reads):
                t = time.perf_counter()
                await conn.read(rkey, 0, buf)
                lat.append(time.perf_counter() - t)
            res["latency"] = lat
            big = bytearray(mib * MiB)
            views = memoryview(big)

            async def moved(op) -> float:
                t = time.perf_counter()
                async with trio.open_nursery() as inner:
                    lanes = trio.Semaphore(8)

                    async def one(i):
                        async with lanes:
                            await op(rkey, i * MiB, views[i * MiB : (i + 1) * MiB])

                    for i in range(mib):
                        inner.start_soon(one, i)
                return mib * MiB / (time.perf_counter() - t) / 1e9

            await moved(conn.write)  # the first pass pays the pages of `big` and the region
            res["write_gbps"] = statistics.median([await moved(conn.write) for _ in range(3)])
            res["read_gbps"] = statistics.median([await moved(conn.read) for _ in range(3)])
            await conn.aclose()
            n.cancel_scope.cancel()

    trio.run(main)
    p.kill()
    p.join(5)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    raw = raw_rtts(args.reads)
    raw_med = statistics.median(raw)
    out: dict = {"raw_rtt_median_us": raw_med * 1e6, "raw_rtt_worst_us": max(raw) * 1e6}
    iperf = iperf3_gbps()
    out["iperf3_gbps"] = iperf
    for engine in ("native", "python"):
        f = transport_figures(engine, args.reads, args.mib)
        lat = f["latency"]
        out[f"{engine}_read64_median_us"] = statistics.median(lat) * 1e6
        out[f"{engine}_read64_worst_us"] = max(lat) * 1e6
        out[f"{engine}_read64_median_vs_raw_rtt"] = statistics.median(lat) / raw_med
        out[f"{engine}_read64_worst_vs_raw_rtt"] = max(lat) / raw_med
        out[f"{engine}_read_gbps"], out[f"{engine}_write_gbps"] = f["read_gbps"], f["write_gbps"]
        if iperf:
            out[f"{engine}_read_vs_iperf3"] = f["read_gbps"] / iperf
            out[f"{engine}_write_vs_iperf3"] = f["write_gbps"] / iperf
    print(f"raw socket round trip: median {out['raw_rtt_median_us']:.1f} us, worst {out['raw_rtt_worst_us']:.1f} us; iperf3 {iperf:.2f} GB/s")
    for engine in ("native", "python"):
        print(
            f"{engine:>6}: 64-byte READ median {out[f'{engine}_read64_median_us']:.1f} us ({out[f'{engine}_read64_median_vs_raw_rtt']:.2f}x the socket's), "
            f"worst {out[f'{engine}_read64_worst_us']:.0f} us ({out[f'{engine}_read64_worst_vs_raw_rtt']:.1f}x); "
            f"READ {out[f'{engine}_read_gbps']:.2f} GB/s ({out.get(f'{engine}_read_vs_iperf3', 0):.2f} of iperf3), "
            f"WRITE {out[f'{engine}_write_gbps']:.2f} GB/s ({out.get(f'{engine}_write_vs_iperf3', 0):.2f})"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
