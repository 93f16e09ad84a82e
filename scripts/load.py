#!/usr/bin/env python3
"""Load: many client processes reading and writing against a local cluster, for a bounded time.

    .venv/bin/python scripts/load.py [--clients 16] [--seconds 60] [--nodes 3] [--mib 1] [--json F]

Each client process has its own Client (its own connections), and loops: write a random block of
--mib MiB into one of its files, read it back, compare; count operations, bytes and errors (any
exception or a mismatch). RSS of every client and node process is sampled after a warm-up (a
sixth of the run) and at the end. Prints throughput, errors and the RSS figures; exit 1 on any
error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from irdmafs import config as C  # noqa: E402
from irdmafs.client.client import Client  # noqa: E402
from irdmafs.launch.etcd_process import LocalEtcd  # noqa: E402
from irdmafs.launch.local import LocalCluster, wait_settled, write_config  # noqa: E402


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def client(cfg_path: str, me: int, seconds: float, nbytes: int, out: mp.Queue) -> None:
    async def main() -> dict:
        cfg = C.load(cfg_path)
        rng = np.random.default_rng(me)
        stats = {"ops": 0, "bytes": 0, "errors": 0, "first_error": None}
        deadline = time.monotonic() + seconds
        async with Client.connect(cfg) as c:
            await c.paths.makedirs(f"/load/{me}")
            n = 0
            while time.monotonic() < deadline and n < 1_000_000:
                path = f"/load/{me}/f{n % 8}"
                data = rng.integers(0, 255, nbytes, dtype=np.uint8)
                try:
                    attr = await c.paths.write_file(path, data)
                    back = np.frombuffer(await c.read(attr["ino"], 0, nbytes), np.uint8)
                    if not np.array_equal(back, data):
                        raise AssertionError(f"{path}: read back different bytes")
                    stats["ops"] += 2
                    stats["bytes"] += 2 * nbytes
                except Exception as exc:  # noqa: BLE001 -- every failure counts
                    stats["errors"] += 1
                    stats["first_error"] = stats["first_error"] or repr(exc)
                n += 1
        return stats

    out.put((me, trio.run(main)))


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--mib", type=float, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    nbytes = int(args.mib * (1 << 20))
    with tempfile.TemporaryDirectory(prefix="irdmafs-load-") as tmp, LocalEtcd(Path(tmp) / "etcd") as etcd:
        path = write_config(Path(tmp), args.nodes, min(2, args.nodes), transport=["tcp"], coordinator=[etcd.endpoint])
        lc = LocalCluster(path)
        lc.start_all()
        try:
            trio.run(wait_settled, lc.cfg)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            procs = [ctx.Process(target=client, args=(str(path), i, args.seconds, nbytes, q)) for i in range(args.clients)]
            t0 = time.monotonic()
            for p in procs:
                p.start()
            time.sleep(args.seconds / 6)
            watched = {f"client{i}": p.pid for i, p in enumerate(procs)} | {f"node {n}": p.pid for n, p in lc.procs.items()}
            rss_start = {k: rss_kib(pid) for k, pid in watched.items()}
            time.sleep(max(0.0, args.seconds - (time.monotonic() - t0) - 0.5))
            rss_end = {k: rss_kib(pid) for k, pid in watched.items()}
            results = dict(q.get(timeout=args.seconds + 120) for _ in procs)
            elapsed = time.monotonic() - t0
            for p in procs:
                p.join(30)
            lc.check_alive()
        finally:
            lc.stop_all()
    total = {k: sum(r[k] for r in results.values()) for k in ("ops", "bytes", "errors")}
    res = {
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "ops": total["ops"],
        "errors": total["errors"],
        "first_error": next((r["first_error"] for r in results.values() if r["first_error"]), None),
        "throughput_mb_s": round(total["bytes"] / elapsed / 1e6, 1),
        "client_rss_kib_start_end": [
            sum(rss_start[k] for k in rss_start if k.startswith("client")),
            sum(rss_end[k] for k in rss_end if k.startswith("client")),
        ],
        "node_rss_kib": {k: [rss_start[k], rss_end[k]] for k in rss_start if k.startswith("node")},
        "max_client_rss_growth_kib": max(rss_end[k] - rss_start[k] for k in rss_start if k.startswith("client")),
    }
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 1 if total["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
