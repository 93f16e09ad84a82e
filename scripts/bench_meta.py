#!/usr/bin/env python3
"""Where should the namespace live? File creates on the nodes' replicated namespace against the
same creates as etcd transactions, in one run on this machine.

    python scripts/bench_meta.py [--files N] [--concurrency C] [--json FILE]

Measures, alternating the two sides in rounds so that noise lands on both alike:
  (a) the namespace as it is: ``Client.create`` on a local cluster of 3 node processes (R=2, TCP
      on loopback), which the metadata primary applies and forwards to every node before it
      answers;
  (b) the namespace in etcd: one create as one etcd transaction, as a namespace kept there would
      need at least: "the entry does not exist" compared, then the directory entry and the inode
      record put (``Coordinator.create_all``), against a local single-member etcd (Debian's
      etcd-server, fsync on as etcd always does) through its v3 JSON gateway.
Each side runs ``--files`` creates one at a time (latency), looks each of them up once, then runs
``--files`` creates with ``--concurrency`` in flight (throughput). Printed: creates per second and
median latencies of each, and etcd over nodes as ratios (above 1: etcd is faster). The reference for the decision is
the nodes' own namespace, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from irdmafs.client.client import Client  # noqa: E402
from irdmafs.coord.etcd import EtcdCoord  # noqa: E402
from irdmafs.launch.etcd_process import LocalEtcd  # noqa: E402
from irdmafs.launch.local import LocalCluster, wait_settled, write_config  # noqa: E402
from irdmafs.names import ROOT  # noqa: E402


async def timed(create, names: list[str], concurrency: int) -> tuple[float, list[float]]:
    """Run ``create(name)`` for every name, ``concurrency`` at a time: (seconds, latencies)."""
    latencies: list[float] = []
    todo = iter(names)

    async def worker() -> None:
        for name in todo:
            t = time.perf_counter()
            await create(name)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(concurrency):
            n.start_soon(worker)
    return time.perf_counter() - t0, latencies


async def measure(args, cfg, etcd: LocalEtcd) -> dict:
    coord = EtcdCoord([etcd.endpoint], timeout=10.0)
    out: dict[str, list] = {k: [] for k in ("node_seq", "node_par", "etcd_seq", "etcd_par", "node_lat", "etcd_lat", "node_look", "etcd_look")}
    async with Client.connect(cfg) as client:
        async def on_nodes(prefix: str):
            d = (await client.mkdir(ROOT, prefix))["ino"]
            return (lambda name: client.create(d, name)), (lambda name: client.lookup(d, name))

        async def in_etcd(prefix: str):
            async def create(name: str) -> None:
                ok, _ = await coord.create_all({f"/ns/{prefix}/e/{name}": b'{"ino": 0}', f"/ns/{prefix}/i/{name}": b'{"mode": 33188, "size": 0}'})
                assert ok, name

            async def lookup(name: str) -> None:
                assert await coord.get(f"/ns/{prefix}/e/{name}") is not None, name

            return create, lookup

        for r in range(args.rounds):
            for side, make in (("node", on_nodes), ("etcd", in_etcd)) if r % 2 == 0 else (("etcd", in_etcd), ("node", on_nodes)):
                names = [f"f{i:06d}" for i in range(args.files)]
                create, lookup = await make(f"{side}-seq-{r}")
                seconds, lat = await timed(create, names, 1)
                out[f"{side}_seq"].append(args.files / seconds)
                out[f"{side}_lat"].extend(lat)
                _, lat = await timed(lookup, names, 1)
                out[f"{side}_look"].extend(lat)
                create, _ = await make(f"{side}-par-{r}")
                seconds, _ = await timed(create, names, args.concurrency)
                out[f"{side}_par"].append(args.files / seconds)
    await coord.aclose()
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "files": args.files,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "node_creates_per_s_one_at_a_time": round(med["node_seq"], 1),
        "etcd_creates_per_s_one_at_a_time": round(med["etcd_seq"], 1),
        f"node_creates_per_s_{args.concurrency}_in_flight": round(med["node_par"], 1),
        f"etcd_creates_per_s_{args.concurrency}_in_flight": round(med["etcd_par"], 1),
        "node_median_latency_ms": round(1000 * med["node_lat"], 3),
        "etcd_median_latency_ms": round(1000 * med["etcd_lat"], 3),
        "node_lookup_median_latency_ms": round(1000 * med["node_look"], 3),
        "etcd_lookup_median_latency_ms": round(1000 * med["etcd_look"], 3),
        "etcd_vs_nodes_one_at_a_time": round(med["etcd_seq"] / med["node_seq"], 3),
        "etcd_vs_nodes_lookup_latency": round(med["node_look"] / med["etcd_look"], 3),
        f"etcd_vs_nodes_{args.concurrency}_in_flight": round(med["etcd_par"] / med["node_par"], 3),
    }


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="irdmafs-bench-meta-") as tmp, LocalEtcd(Path(tmp) / "etcd") as etcd:
        path = write_config(Path(tmp) / "c", 3, 2, transport=["tcp"], coordinator=[etcd.endpoint])
        lc = LocalCluster(path, log_dir=Path(tmp))
        lc.start_all()
        try:
            trio.run(lambda: wait_settled(lc.cfg, timeout=60))
            result = trio.run(measure, args, lc.cfg, etcd)
        finally:
            lc.stop_all()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
