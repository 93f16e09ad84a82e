#!/usr/bin/env python3
"""Train a softmax-regression classifier on scikit-learn's bundled digits through an irdmafs mount.

    python scripts/train_digits.py --workers 2 --sync bsp [--compress MODE] [--mount DIR] [--steps 150]

N worker processes each loop: pull the parameters (read ``.workers/<rank>/<model>/*.npy``, which
waits as the model's sync policy says), compute a gradient on their shard of the training set,
push it (``np.save`` to the same path). The PS averages each round over the workers and applies
its optimizer (``user.irdma.optimizer``) on the stripe primaries. Without ``--mount`` a local
cluster (3 nodes, R=2) is brought up with ``irdmafs up`` and taken down after.

The last line of output is one JSON object: test_accuracy, seconds, bytes_pushed, steps, ...
Nothing is downloaded: the digits data set ships inside scikit-learn.
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

CLASSES, FEATURES = 10, 64


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(X))
    X, y = X[order], y[order]
    cut = int(0.8 * len(X))
    return X[:cut], y[:cut], X[cut:], y[cut:]


def gradients(W, b, X, y):
    """Softmax cross-entropy gradients, averaged over the batch."""
    logits = X @ W + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return (X.T @ p).astype(np.float32), p.sum(axis=0).astype(np.float32)


def accuracy(W, b, X, y) -> float:
    return float(((X @ W + b).argmax(axis=1) == y).mean())


def worker(mount: str, model: str, rank: int, workers: int, steps: int, batch: int, out: mp.Queue) -> None:
    Xtr, ytr, Xte, yte = load_data()
    Xs, ys = Xtr[rank::workers], ytr[rank::workers]  # this rank's shard
    rng = np.random.default_rng(100 + rank)
    base = Path(mount) / ".workers" / str(rank) / model
    curve, step_times = [], []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            ts = time.perf_counter()
            W = np.load(base / "W.npy")  # pull: waits as the policy requires
            b = np.load(base / "b.npy")
            idx = rng.integers(0, len(Xs), batch)
            gW, gb = gradients(W, b, Xs[idx], ys[idx])
            np.save(base / "W.npy", gW)  # push
            np.save(base / "b.npy", gb)
            step_times.append(time.perf_counter() - ts)
            if rank == 0 and (step % 10 == 0 or step == steps - 1):
                curve.append((time.perf_counter() - t0, accuracy(W, b, Xte, yte)))
        out.put({"rank": rank, "ok": True, "curve": curve, "step_times": step_times})
    except BaseException as exc:  # reported to the coordinator, which fails loudly
        out.put({"rank": rank, "ok": False, "error": repr(exc)})


def irdmafs(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "irdmafs.cli", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"irdmafs {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def train(mount: str, args) -> dict:
    model = f"digits-{args.sync.replace(':', '')}-{args.workers}w-{os.getpid()}"
    d = Path(mount) / model
    d.mkdir()
    for key, value in (("sync", args.sync), ("workers", str(args.workers)), ("optimizer", args.optimizer), ("timeout", "120"), ("compress", args.compress)):
        os.setxattr(d, f"user.irdma.{key}", value.encode())
    np.save(d / "W.npy", np.zeros((FEATURES, CLASSES), np.float32))
    np.save(d / "b.npy", np.zeros(CLASSES, np.float32))
    stats0 = json.loads((Path(mount) / ".irdma" / "stats").read_text())

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=worker, args=(mount, model, r, args.workers, args.steps, args.batch, q)) for r in range(args.workers)]
    for p in procs:
        p.start()
    results = [q.get(timeout=args.steps * 10 + 120) for _ in procs]
    for p in procs:
        p.join(30)
    seconds = time.perf_counter() - t0
    failed = [r for r in results if not r["ok"]]
    if failed:
        raise SystemExit(f"workers failed: {failed}")

    stats1 = json.loads((Path(mount) / ".irdma" / "stats").read_text())
    W, b = np.load(d / "W.npy"), np.load(d / "b.npy")
    _, _, Xte, yte = load_data()
    steps = [t for r in results for t in r["step_times"]]
    curve = next(r["curve"] for r in results if r["rank"] == 0)
    return {
        "sync": args.sync,
        "workers": args.workers,
        "steps": args.steps,
        "batch": args.batch,
        "optimizer": args.optimizer,
        "compress": args.compress,
        "test_accuracy": round(accuracy(W, b, Xte, yte), 4),
        "seconds": round(seconds, 3),
        "mean_step_seconds": round(float(np.mean(steps)), 5),
        "bytes_pushed": stats1["bytes_pushed"] - stats0["bytes_pushed"],
        "control_calls": stats1["control_calls"] - stats0["control_calls"],
        "curve": [(round(t, 3), round(a, 4)) for t, a in curve],
        "model": model,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sync", default="bsp", help="bsp | asp | ssp:S | r2sp")
    ap.add_argument("--mount", help="an irdmafs mount to use (default: bring up a local one)")
    ap.add_argument("--steps", type=int, default=150, help="steps per worker")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--optimizer", default="sgd lr=0.5 momentum=0.9")
    ap.add_argument("--compress", default="none", help="none | fp16 | chunks=F[,chunk=N] | fp16,chunks=F (user.irdma.compress)")
    args = ap.parse_args()
    if args.mount:
        result = train(args.mount, args)
    else:
        with tempfile.TemporaryDirectory(prefix="irdmafs-digits-") as tmp:
            mount = os.path.join(tmp, "ps")
            irdmafs("up", mount, "--nodes", "3", "--replicas", "2", "--state", os.path.join(tmp, "state"))
            try:
                result = train(mount, args)
            finally:
                irdmafs("down", mount)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
