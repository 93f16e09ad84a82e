#!/usr/bin/env python3
"""Snapshots at a model's size: what taking one costs against what a plain mkdir costs, in one run.

    .venv/bin/python scripts/bench_snapshot.py [--gib 0.5,1,2,4] [--replicas 2] [--recover] [--json FILE] [--plot FILE]
    .venv/bin/python scripts/bench_snapshot.py --train [--model-gib 1] [--steps 8] [--json FILE]

A local cluster (etcd, 3 nodes on shared memory, as ``irdmafs up`` makes on one host, R as
given, capacities sized to this machine) and a mount. Files of 512 MiB are written through the
mount (``dd``-like 4 MiB writes) until the live data reaches each size of ``--gib`` (logical
bytes, before replication); at each size a snapshot is taken (``mkdir .snapshots/sN``) with the
earlier ones still held, while a writer beside it saves a 1 MB ``.npy`` in a loop. Then one
512 MiB file is overwritten, to see what the snapshots come to hold. Printed and written as a
flat JSON object, per size (suffix ``_<GiB>g``):

- ``snapshot_s``: the ``mkdir`` of the snapshot, in seconds (issue 41's target: <= 0.2 s with
  4 GiB live); ``snapshot_vs_mkdir``: over a plain ``mkdir`` in the same mount, timed just
  before (the median of 5);
- ``writer_worst_s`` and ``writer_worst_vs_median``: the slowest save that overlapped the
  snapshot, in seconds and over the median save before it (target: <= 0.2 s);
- ``held_fraction``: memory held by snapshots alone (every node's ``held.snapshots``) over the
  bytes they froze (the live data times R) right after the snapshot (target: < 1%); and
  ``held_after_overwrite_fraction``: the same after 512 MiB were overwritten (copy-on-write:
  about 512 MiB x R over what they froze);
- ``loop_lag_worst_s``: the worst any node's loop ran late so far (runtime/looplag.py; target 0.2 s), and
  ``loop_busy_worst_s``: the part of such a lag the node's own work held its loop (the rest the
  host did not run it);
- ``fenced``: how many times any node fenced itself (its log), 0 throughout.

With ``--recover``, then: a node killed (SIGKILL) with the largest size live and started again,
``recover_whole_s`` until every node has caught up (the restarted one's resync), its loop's
worst lag over it (``recover_loop_lag_worst_s``, ``recover_loop_busy_worst_s``), the writer's
worst save meanwhile and the fences.

With ``--rebalance``, then: a fourth node started and added by ``irdmafs rebalance`` with the
largest size live: ``rebalance_s`` (the command), ``rebalance_loop_lag_worst_s`` (the worst of
every node's loop so far, the new node's included), the writer's worst save meanwhile, fences,
and ``rebalance_whole`` (every node of the new membership caught up after it).

With ``--persist``, every node writes its stripes through to disk (``irdmafs serve --persist``):
the same figures with the data persisted, and with ``--recover`` the killed node loads its data
from disk before it resyncs.

With ``--train``: a model of ``--model-gib`` GiB (float32 tensors of 16 MiB) trained by 2
workers through the step streams (bsp, sgd), a snapshot taken after every step and the one before
it dropped. ``step_worst_vs_median``: the worst step over the median (target <= 2.0);
``step_snapshot_vs_plain``: the median step with snapshots over the median step without, in the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import local_cluster, mounted  # noqa: E402

from irdmafs.launch.local import node_status  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
FILE = 512 * MiB
WRITER_SECONDS = 600.0  # the writer beside the snapshots stops by itself after this, at the latest


class Writer(threading.Thread):
    """Saves a 1 MB .npy into the mount in a loop, recording (start, seconds) of each save."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.saves, self.stop = path, [], threading.Event()
        self.array = np.random.default_rng(2).random(MiB // 8)

    def run(self) -> None:
        deadline = time.monotonic() + WRITER_SECONDS
        while not self.stop.is_set() and time.monotonic() < deadline and len(self.saves) < 1_000_000:
            t0 = time.monotonic()
            np.save(self.path, self.array)
            self.saves.append((t0, time.monotonic() - t0))
            time.sleep(0.01)

    def overlapping(self, start: float, end: float) -> list[float]:
        return [d for t0, d in list(self.saves) if t0 <= end and t0 + d >= start]


def write_file(path: Path, block: memoryview, nbytes: int) -> None:
    with open(path, "wb", buffering=0) as f:
        for off in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - off)])


def nodes_status(cfg) -> list[dict]:
    async def ask():
        return [await node_status(cfg, n, timeout=5.0) or {} for n in cfg.names]

    return trio.run(ask)


def held_by_snapshots(cfg) -> int:
    return sum(s.get("held", {}).get("snapshots", 0) for s in nodes_status(cfg))


def loop_lag(cfg, what: str = "loop_lag") -> float:
    """The worst any node's loop ran late so far; ``loop_busy``: the part of it the node's own
    work held the loop (runtime/looplag.py)."""
    return max((s.get(what, 0.0) for s in nodes_status(cfg)), default=0.0)


def fenced(log_dir: Path) -> int:
    return sum(len(re.findall(r"fenced", p.read_text(errors="replace"))) for p in log_dir.glob("*.log"))


def report_slow_steps(log_dir: Path) -> None:
    """The nodes' lines on a late loop (and, with IRDMAFS_SLOW_STEPS set, the task steps that
    held it: runtime/looplag.py), to stderr."""
    for p in sorted(log_dir.glob("n*.log")):
        for line in p.read_text(errors="replace").splitlines():
            if "held the loop" in line or "ran " in line and " late" in line:
                print(f"{p.stem}: {line}", file=sys.stderr)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def recovery(lc, writer: Writer, live: int) -> dict[str, float]:
    """A node killed (SIGKILL) with ``live`` bytes live and started again: how long until every
    node has caught up (its resync), the worst lag of the restarted node's loop over all of it
    (its own worst since it started: the resync), the writer's worst save meanwhile, fences."""
    victim = lc.cfg.names[1]
    fences = fenced(lc.log_dir)
    t0 = time.monotonic()
    lc.kill(victim)
    lc.start(victim)
    deadline = t0 + 600
    while time.monotonic() < deadline:
        status = nodes_status(lc.cfg)
        if all(s.get("caught_up") for s in status):
            break
        time.sleep(0.2)
    whole = time.monotonic() - t0
    mine = next(s for n, s in zip(lc.cfg.names, status) if n == victim)
    return {
        "recover_live_gib": round(live / GiB, 2),
        "recover_whole_s": round(whole, 2),
        "recover_loop_lag_worst_s": mine.get("loop_lag", -1.0),
        "recover_loop_busy_worst_s": mine.get("loop_busy", -1.0),
        "recover_writer_worst_s": round(max(writer.overlapping(t0, t0 + whole), default=0.0), 4),
        "recover_fenced": fenced(lc.log_dir) - fences,
        "recover_whole": int(all(s.get("caught_up") for s in status)),
    }


def grown(lc, writer: Writer, live: int) -> dict[str, float]:
    """A fourth node started and added by ``irdmafs rebalance`` with ``live`` bytes live: how
    long the command took, every node's worst loop lag so far (the new one's included), the
    writer's worst save meanwhile, fences, and whether the new membership is whole after it."""
    from irdmafs import config as C
    from irdmafs.launch.local import LocalCluster, free_ports, wait_settled

    [port] = free_ports(1)
    doc = tomllib.loads(lc.config_path.read_text())  # the same cluster with a node more
    doc["nodes"].append({"name": "n4", "host": lc.cfg.nodes[0].host, "port": port})
    new = lc.config_path.parent / "grown.toml"
    new.write_text(C.dump(C.from_dict(doc, base=new.parent)))
    lc4 = LocalCluster(new, log_dir=lc.log_dir, persist=lc.persist)
    lc4.start("n4")
    fences = fenced(lc.log_dir)
    try:
        trio.run(lambda: wait_settled(lc4.cfg, ["n4"], timeout=120, whole_too=False))
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "irdmafs", "rebalance", "--quiet", "--from", str(lc.config_path), "--to", str(new)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        took = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"rebalance failed: {r.stderr.strip()[-2000:]}")
        trio.run(lambda: wait_settled(lc4.cfg, timeout=300))
        return {
            "rebalance_live_gib": round(live / GiB, 2),
            "rebalance_s": round(took, 2),
            "rebalance_loop_lag_worst_s": loop_lag(lc4.cfg),
            "rebalance_loop_busy_worst_s": loop_lag(lc4.cfg, "loop_busy"),
            "rebalance_writer_worst_s": round(max(writer.overlapping(t0, t0 + took), default=0.0), 4),
            "rebalance_fenced": fenced(lc.log_dir) - fences,
            "rebalance_whole": int(all(s.get("caught_up") for s in nodes_status(lc4.cfg))),
        }
    finally:
        lc4.stop_all()


def scale(tmp: Path, sizes: list[float], replicas: int, recover: bool = False, rebalance: bool = False, persist: bool = False) -> dict[str, float]:
    res: dict[str, float] = {}
    block = memoryview(np.random.default_rng(1).integers(0, 255, 4 * MiB, dtype=np.uint8).tobytes())
    with local_cluster(tmp / "c", replicas, tmp, "shm", tmp / "disk" if persist else None) as lc, mounted(lc, tmp / "mnt") as mnt:
        logs = tmp / "c"
        (mnt / "data").mkdir()
        writer = Writer(mnt / "writer.npy")
        writer.start()
        live = 0
        try:
            for i, gib in enumerate(sizes):
                while live < gib * GiB:
                    write_file(mnt / "data" / f"f{live // FILE}.bin", block, FILE)
                    live += FILE
                tag = f"{gib:g}g"
                plain = statistics.median(timed(lambda j=j: (mnt / f"plain-{i}-{j}").mkdir()) for j in range(5))
                before = [d for _, d in list(writer.saves)[-50:]]
                t0 = time.monotonic()
                took = timed(lambda: (mnt / ".snapshots" / f"s{i}").mkdir())
                time.sleep(0.2)  # a save that began during the snapshot has ended by now
                waits = writer.overlapping(t0, t0 + took)
                froze = live * replicas
                res[f"snapshot_s_{tag}"] = round(took, 4)
                res[f"snapshot_vs_mkdir_{tag}"] = round(took / plain, 2)
                res[f"writer_worst_s_{tag}"] = round(max(waits, default=0.0), 4)
                res[f"writer_worst_vs_median_{tag}"] = round(max(waits, default=0.0) / statistics.median(before or [1.0]), 2)
                res[f"held_fraction_{tag}"] = round(held_by_snapshots(lc.cfg) / froze, 5)
                res[f"loop_lag_worst_s_{tag}"] = loop_lag(lc.cfg)
                res[f"fenced_{tag}"] = fenced(Path(logs))
                print(json.dumps({k: v for k, v in res.items() if k.endswith(tag)}), flush=True)
            write_file(mnt / "data" / "f0.bin", memoryview(bytes(block)[::-1]), FILE)  # an overwrite: copy-on-write
            res["held_after_overwrite_fraction"] = round(held_by_snapshots(lc.cfg) / (live * replicas), 4)
            res["overwrite_fraction_of_live"] = round(FILE / live, 4)
            res["loop_lag_worst_s"] = loop_lag(lc.cfg)
            res["loop_busy_worst_s"] = loop_lag(lc.cfg, "loop_busy")
            res["fenced"] = fenced(Path(logs))
            res["whole"] = int(all(s.get("caught_up") for s in nodes_status(lc.cfg)))
            if recover:
                res.update(recovery(lc, writer, live))
            if rebalance:
                res.update(grown(lc, writer, live))
            report_slow_steps(Path(logs))
        finally:
            writer.stop.set()
            writer.join()
    return res


def train(tmp: Path, model_gib: float, steps: int, replicas: int, transport: str = "shm") -> dict[str, float]:
    from irdmafs.worker import steps as S

    tensor = 16 * MiB
    n = max(1, int(model_gib * GiB) // tensor)
    names = [f"t{i}" for i in range(n)]
    res: dict[str, float] = {"model_bytes": n * tensor}
    with local_cluster(tmp / "c", replicas, tmp, transport) as lc, mounted(lc, tmp / "mnt") as mnt:
        model = mnt / "m"
        model.mkdir()
        os.setxattr(model, "user.irdma.workers", b"2")
        os.setxattr(model, "user.irdma.sync", b"bsp")
        rng = np.random.default_rng(3)
        for name in names:
            np.save(model / f"{name}.npy", rng.random(tensor // 4, dtype=np.float32))
        grads = {name: np.full(tensor // 4, 1e-3, dtype=np.float32) for name in names}

        def run(count: int, snapshots: bool) -> list[float]:
            times: list[float] = []
            outs = [{name: np.empty(tensor // 4, dtype=np.float32) for name in names} for _ in range(2)]
            errors: list[BaseException] = []

            def step(rank: int) -> None:
                try:
                    S.step_arrays(str(mnt), "m", rank, grads, outs[rank])
                except BaseException as exc:  # noqa: BLE001 - raised below, in the main thread
                    errors.append(exc)

            for k in range(count):
                t0 = time.perf_counter()
                ws = [threading.Thread(target=step, args=(r,)) for r in range(2)]
                for w in ws:
                    w.start()
                for w in ws:
                    w.join()
                if errors:
                    raise errors[0]
                if snapshots:
                    (mnt / ".snapshots" / f"step-{k}").mkdir()
                    if k:
                        (mnt / ".snapshots" / f"step-{k - 1}").rmdir()
                times.append(time.perf_counter() - t0)
            return times

        res["loop_lag_after_publish_s"] = loop_lag(lc.cfg)
        run(2, False)  # warm: doors open, caches filled
        plain = run(steps, False)
        res["loop_lag_after_plain_steps_s"] = loop_lag(lc.cfg)
        snap = run(steps, True)
        res["steps_plain_s"] = [round(t, 3) for t in plain]
        res["steps_snapshot_s"] = [round(t, 3) for t in snap]  # the first copies on write into memory this step touches first
        res["step_plain_median_s"] = round(statistics.median(plain), 3)
        res["step_snapshot_median_s"] = round(statistics.median(snap), 3)
        res["step_worst_vs_median"] = round(max(snap) / statistics.median(snap), 2)
        res["step_snapshot_vs_plain"] = round(statistics.median(snap) / statistics.median(plain), 2)
        res["loop_lag_worst_s"] = loop_lag(lc.cfg)
        res["loop_busy_worst_s"] = loop_lag(lc.cfg, "loop_busy")
        res["fenced"] = fenced(tmp / "c")
        S.close_doors()
        report_slow_steps(tmp / "c")
    return res


def plot(res: dict, sizes: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(sizes, [res[f"snapshot_s_{g:g}g"] for g in sizes], "o-", label="mkdir of a snapshot")
    a.plot(sizes, [res[f"writer_worst_s_{g:g}g"] for g in sizes], "s-", label="a writer's worst save beside it")
    a.plot(sizes, [res[f"loop_lag_worst_s_{g:g}g"] for g in sizes], "^-", label="a node loop's worst lag so far")
    a.axhline(0.2, color="grey", ls="--", label="target 0.2 s")
    a.set_xlabel("live data, GiB (before replication)")
    a.set_ylabel("seconds")
    a.legend(fontsize=8)
    b.plot(sizes, [100 * res[f"held_fraction_{g:g}g"] for g in sizes], "o-")
    b.set_xlabel("live data, GiB")
    b.set_ylabel("held by snapshots alone, % of frozen")
    b.set_ylim(bottom=0)
    fig.suptitle("copy-on-write snapshots, 3 nodes R=2 (scripts/bench_snapshot.py)", y=0.99)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", default="0.5,1,2,4", help="live sizes in GiB, ascending")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--model-gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--transport", default="shm", help="shm or tcp (--train)")
    ap.add_argument("--recover", action="store_true", help="then a node killed and started again: its resync at the largest size")
    ap.add_argument("--rebalance", action="store_true", help="then a fourth node added by irdmafs rebalance at the largest size")
    ap.add_argument("--persist", action="store_true", help="nodes write their data through to disk (serve --persist)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="irdmafs-bench-snapshot-") as tmp:
        if args.train:
            res = train(Path(tmp), args.model_gib, args.steps, args.replicas, args.transport)
        else:
            sizes = [float(g) for g in args.gib.split(",")]
            res = scale(Path(tmp), sizes, args.replicas, args.recover, args.rebalance, args.persist)
            if args.plot:
                plot(res, sizes, args.plot)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
