#!/usr/bin/env python3
"""R2SP against BSP under contention: PS nodes behind rate-limited links, 4 workers.

    sudo .venv/bin/python scripts/bench_r2sp.py [--rate 200mbit] [--steps 24] [--mib 8] [--json FILE]

Each PS node runs in a network namespace of its own, reached over a veth pair whose both ends are
shaped by tbf to --rate, so that the workers' simultaneous pushes saturate the PS links. The
mount and the workers stay in the root namespace (which routes between the node namespaces). Each
worker loops: pull the model, compute (a sleep of --compute seconds standing in for the gradient
computation), push a gradient of --mib MiB. The script prints the mean step time under each policy
and their ratio. Every namespace and link it made is removed at the end. Needs root, iproute2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from netns import namespaces  # noqa: E402

from irdmafs import config as C  # noqa: E402
from irdmafs.launch.etcd_process import LocalEtcd  # noqa: E402
from irdmafs.launch.local import wait_settled  # noqa: E402
from irdmafs.launch.mount import mount_background, unmount  # noqa: E402

PREFIX = "irdr2sp"


def worker(mount: str, model: str, rank: int, steps: int, compute: float, out: mp.Queue) -> None:
    base = Path(mount) / ".workers" / str(rank) / model / "w.npy"
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            w = np.load(base)
            time.sleep(compute)
            np.save(base, np.full_like(w, 1e-6))
            times.append(time.perf_counter() - t0)
        out.put((rank, times))
    except BaseException as exc:
        out.put((rank, repr(exc)))


def run_policy(mount: str, policy: str, workers: int, steps: int, compute: float, mib: int) -> float:
    model = f"m-{policy}-{os.getpid()}"
    d = Path(mount) / model
    d.mkdir()
    for k, v in (("sync", policy), ("workers", str(workers)), ("optimizer", "sgd lr=0.01"), ("timeout", "300")):
        os.setxattr(d, f"user.irdma.{k}", v.encode())
    np.save(d / "w.npy", np.zeros(mib * (1 << 20) // 4, np.float32))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(mount, model, r, steps, compute, q)) for r in range(workers)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=steps * 120) for _ in procs)
    for p in procs:
        p.join(30)
    bad = {r: v for r, v in results.items() if isinstance(v, str)}
    if bad:
        raise SystemExit(f"{policy}: workers failed: {bad}")
    # the first third warms caches and connections and lets r2sp's slot period converge (it
    # starts from step times measured under contention): leave it out
    if os.environ.get("IRDMAFS_BENCH_DEBUG"):
        print(policy, {r: [round(t, 2) for t in v] for r, v in results.items()}, file=sys.stderr)
    return float(np.mean([t for v in results.values() for t in v[len(v) // 3 :]]))


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="200mbit", help="tbf rate of every PS link, each way")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--mib", type=int, default=8, help="model (and gradient) size")
    ap.add_argument("--compute", type=float, default=0.5, help="seconds of computation per step")
    ap.add_argument("--json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_r2sp: needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    with (
        tempfile.TemporaryDirectory(prefix="irdmafs-r2sp-") as tmp,
        namespaces(args.nodes, args.rate, prefix=PREFIX, net=77) as hosts,
        # etcd (the views) on the root namespace's end of node 0's link, which every namespace routes to
        LocalEtcd(Path(tmp) / "etcd", host="10.77.0.1", log_path=Path(tmp) / "etcd.log") as etcd,
    ):
        state = Path(tmp)
        (state / "token").write_text(os.urandom(16).hex())
        doc = {
            "nodes": [{"name": f"n{i}", "host": h, "port": 7100} for i, h in enumerate(hosts)],
            "token_file": "token",
            "replicas": 1,
            "transport": ["tcp"],
            "op_timeout": 60.0,
            "down_after": 5.0,
            "coordinator": [etcd.endpoint],
        }
        cfg_path = state / "cluster.toml"
        cfg_path.write_text(C.dump(C.from_dict(doc, base=state)))
        cfg = C.load(cfg_path)
        nodes = []
        for i in range(args.nodes):
            log = open(state / f"n{i}.log", "wb")
            nodes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", f"{PREFIX}{i}", sys.executable, "-m", "irdmafs.server.node", "--config", str(cfg_path), "--node", f"n{i}"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        mnt = state / "ps"
        mnt.mkdir()
        mount = None
        try:
            trio.run(wait_settled, cfg)
            mount = mount_background(str(cfg_path), str(mnt), [], state / "mount.log")
            res = {}
            for policy in ("bsp", "r2sp"):
                res[f"{policy}_step_seconds"] = run_policy(str(mnt), policy, args.workers, args.steps, args.compute, args.mib)
                print(f"{policy:5} mean step {res[f'{policy}_step_seconds']:.3f} s", flush=True)
            res["r2sp_vs_bsp"] = res["r2sp_step_seconds"] / res["bsp_step_seconds"]
            res.update(rate=args.rate, nodes=args.nodes, workers=args.workers, mib=args.mib, compute=args.compute)
            print(f"r2sp step time / bsp step time: {res['r2sp_vs_bsp']:.2f} (below 1: r2sp is faster)")
        finally:
            unmount(str(mnt), lazy=True)
            if mount is not None:
                mount.terminate()
            for p in nodes:
                p.terminate()
                p.wait(10)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
