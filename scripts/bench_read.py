#!/usr/bin/env python3
"""Reading a checkpoint again: a snapshot and a live file through the mount against tmpfs, in one run.

    .venv/bin/python scripts/bench_read.py [--mib 256] [--reps 3] [--replicas 2] [--json FILE]

A local cluster (etcd, 3 nodes on tcp, R as given) and a mount; a file of ``--mib`` MiB written
through it and a snapshot taken; the same bytes in a file on tmpfs (/dev/shm). Each file is read
whole with 1 MiB requests, as a loader reads a checkpoint: once, then again (the median of
``--reps`` reads). The reference is the second read of the tmpfs file: the page cache at its best
here, measured in this run. Printed and written as a flat JSON object:

- ``snapshot_reread_vs_tmpfs``: a snapshot read again (its pages stay cached: it never changes);
- ``live_reread_vs_tmpfs``: a live file read again, unchanged (an open keeps its pages when the
  file's stamp is the one its last open took: irdmafs/fs/pagecache.py);
- ``snapshot_first_read_vs_tmpfs``: the snapshot's first read (from the nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import MiB, gbps, local_cluster, med, mounted, read_file  # noqa: E402


def reads(path: Path, nbytes: int, reps: int, buf: memoryview) -> tuple[float, float]:
    """(first read, median of ``reps`` reads after it), in GB/s."""
    first = gbps(nbytes, read_file(path, nbytes, MiB, buf))
    again = gbps(nbytes, med([read_file(path, nbytes, MiB, buf) for _ in range(reps)]))
    return first, again


def run(tmp: Path, nbytes: int, reps: int, replicas: int) -> dict[str, float]:
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    buf = memoryview(bytearray(nbytes))
    res: dict[str, float] = {}
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="irdmafs-bench-read-") as shm:
        shm.write(data.tobytes())
        shm.flush()
        _, res["tmpfs_reread_gbps"] = reads(Path(shm.name), nbytes, reps, buf)
    with local_cluster(tmp / "ps", replicas, tmp) as lc, mounted(lc, tmp / "mnt") as mnt:
        (mnt / "ckpt.bin").write_bytes(data.tobytes())
        os.mkdir(mnt / ".snapshots" / "bench")
        snap = mnt / ".snapshots" / "bench" / "ckpt.bin"
        res["snapshot_first_read_gbps"], res["snapshot_reread_gbps"] = reads(snap, nbytes, reps, buf)
        if bytes(buf) != data.tobytes():
            raise RuntimeError("the snapshot read back other bytes")
        _, res["live_reread_gbps"] = reads(mnt / "ckpt.bin", nbytes, reps, buf)
        if bytes(buf) != data.tobytes():
            raise RuntimeError("the live file read back other bytes")
    ref = res["tmpfs_reread_gbps"]
    res["snapshot_reread_vs_tmpfs"] = res["snapshot_reread_gbps"] / ref
    res["live_reread_vs_tmpfs"] = res["live_reread_gbps"] / ref
    res["snapshot_first_read_vs_tmpfs"] = res["snapshot_first_read_gbps"] / ref
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="the file's size in MiB")
    ap.add_argument("--reps", type=int, default=3, help="reads after the first, their median counts")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--json", help="write the flat JSON object here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="irdmafs-bench-read-") as tmp:
        res = run(Path(tmp), args.mib * MiB, args.reps, args.replicas)
    for k, v in res.items():
        print(f"{k:32s} {v:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
