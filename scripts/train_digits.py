#!/usr/bin/env python3
"""Train a softmax-regression classifier on scikit-learn's bundled digits through an irdmafs mount.

    python scripts/train_digits.py --workers 2 --sync bsp [--compress MODE] [--mount DIR] [--steps 150]

N worker processes each loop: pull the parameters (read ``.workers/<rank>/<model>.safetensors``,
the step stream, which waits as the model's sync policy says), compute a gradient on their shard
of the training set, push it (write the same path; ``irdmafs.worker.steps``). The PS averages each round over the workers and applies
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
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from irdmafs.worker.steps import pull_arrays, push_arrays  # noqa: E402

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
    # one step stream per direction: .workers/<rank>/<model>.safetensors (irdmafs/worker/steps.py)
    W, b = np.load(Path(mount) / model / "W.npy"), np.load(Path(mount) / model / "b.npy")
    curve, step_times = [], []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            ts = time.perf_counter()
            pull_arrays(mount, model, rank, {"W": W, "b": b})  # pull: waits as the policy requires
            idx = rng.integers(0, len(Xs), batch)
            gW, gb = gradients(W, b, Xs[idx], ys[idx])
            push_arrays(mount, model, rank, {"W": gW.astype(W.dtype, copy=False), "b": gb.astype(b.dtype, copy=False)})
            step_times.append(time.perf_counter() - ts)
            if rank == 0 and (step % 10 == 0 or step == steps - 1):
                curve.append((time.perf_counter() - t0, accuracy(W, b, Xte, yte)))
        out.put({"rank": rank, "ok": True, "curve": curve, "step_times": step_times})
    except BaseException as exc:  # reported to the coordinator, which fails loudly
        out.put({"rank": rank, "ok": False, "error": repr(exc)})


def worker_torch(mount: str, model: str, rank: int, workers: int, steps: int, batch: int, out: mp.Queue) -> None:
    """The same loop with a torch module: parameters pulled into it, its .grads pushed."""
    import torch

    from irdmafs.worker.torch import ParameterServer

    torch.set_num_threads(1)
    Xtr, ytr, Xte, yte = load_data()
    Xs, ys = torch.from_numpy(Xtr[rank::workers]), torch.from_numpy(ytr[rank::workers])
    net = torch.nn.Linear(FEATURES, CLASSES)
    ps = ParameterServer(mount, model, rank)
    rng = np.random.default_rng(100 + rank)
    curve, step_times = [], []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            ts = time.perf_counter()
            ps.pull(net)
            idx = torch.from_numpy(rng.integers(0, len(Xs), batch))
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(Xs[idx]), ys[idx]).backward()
            ps.push(net)
            step_times.append(time.perf_counter() - ts)
            if rank == 0 and (step % 10 == 0 or step == steps - 1):
                W, b = net.weight.detach().numpy().T, net.bias.detach().numpy()
                curve.append((time.perf_counter() - t0, accuracy(W, b, Xte, yte)))
        out.put({"rank": rank, "ok": True, "curve": curve, "step_times": step_times})
    except BaseException as exc:
        out.put({"rank": rank, "ok": False, "error": repr(exc)})
    finally:
        ps.close()


def irdmafs(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "irdmafs", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"irdmafs {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def train(mount: str, args) -> dict:
    model = f"digits-{args.sync.replace(':', '')}-{args.workers}w-{uuid.uuid4().hex[:8]}"
    d = Path(mount) / model
    d.mkdir()
    for key, value in (("sync", args.sync), ("workers", str(args.workers)), ("optimizer", args.optimizer), ("timeout", "120"), ("compress", args.compress)):
        os.setxattr(d, f"user.irdma.{key}", value.encode())
    if args.framework == "torch":  # torch.nn.Linear's own names and layout
        np.save(d / "weight.npy", np.zeros((CLASSES, FEATURES), np.float32))
        np.save(d / "bias.npy", np.zeros(CLASSES, np.float32))
    else:
        np.save(d / "W.npy", np.zeros((FEATURES, CLASSES), np.float32))
        np.save(d / "b.npy", np.zeros(CLASSES, np.float32))
    stats0 = json.loads((Path(mount) / ".irdma" / "stats").read_text())

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.perf_counter()
    target = worker_torch if args.framework == "torch" else worker
    procs = [ctx.Process(target=target, args=(mount, model, r, args.workers, args.steps, args.batch, q)) for r in range(args.workers)]
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
    if args.framework == "torch":
        W, b = np.load(d / "weight.npy").T, np.load(d / "bias.npy")
    else:
        W, b = np.load(d / "W.npy"), np.load(d / "b.npy")
    _, _, Xte, yte = load_data()
    steps = [t for r in results for t in r["step_times"]]
    curve = next(r["curve"] for r in results if r["rank"] == 0)
    return {
        "sync": args.sync,
        "framework": args.framework,
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


POLICIES = ["bsp", "asp", "ssp:2", "r2sp"]
COMPRESSION = ["none", "fp16", "chunks=0.25,chunk=4", "fp16,chunks=0.25,chunk=4", "chunks=0.1,chunk=16"]


def compare(mount: str, args, png: str) -> dict:
    """Every policy, then every compression mode (bsp), on one mount: a PNG of test accuracy
    against wall time per policy, and a table of bytes per step and accuracy per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for policy in POLICIES:
        runs[policy] = train(mount, argparse.Namespace(**{**vars(args), "sync": policy, "compress": "none"}))
    table = []
    for mode in COMPRESSION:
        r = runs["bsp"] if mode == "none" else train(mount, argparse.Namespace(**{**vars(args), "sync": "bsp", "compress": mode}))
        table.append({"compress": mode, "bytes_per_step": r["bytes_pushed"] / (args.workers * args.steps), "test_accuracy": r["test_accuracy"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, r in runs.items():
        t, a = zip(*r["curve"])
        ax.plot(t, a, marker=".", label=f"{policy} ({r['test_accuracy']:.3f})")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy (rank 0's view)")
    ax.set_title(f"digits, softmax regression, {args.workers} workers through irdmafs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    base = table[0]["bytes_per_step"]
    print(f"{'compress':28} {'bytes/step':>10} {'vs none':>8} {'accuracy':>9}")
    for row in table:
        print(f"{row['compress']:28} {row['bytes_per_step']:10.0f} {row['bytes_per_step'] / base:8.2f} {row['test_accuracy']:9.4f}")
    return {
        "policies": {p: {k: r[k] for k in ("test_accuracy", "seconds", "mean_step_seconds", "bytes_pushed")} for p, r in runs.items()},
        "compression": table,
        "plot": png,
    }


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sync", default="bsp", help="bsp | asp | ssp:S | r2sp")
    ap.add_argument("--mount", help="an irdmafs mount to use (default: bring up a local one)")
    ap.add_argument("--steps", type=int, default=150, help="steps per worker")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--optimizer", default="sgd lr=0.5 momentum=0.9")
    ap.add_argument("--compare", metavar="PNG", help="run every policy and compression mode; write this plot and print the table")
    ap.add_argument("--framework", choices=["numpy", "torch"], default="numpy")
    ap.add_argument("--compress", default="none", help="none | fp16 | chunks=F[,chunk=N] | fp16,chunks=F (user.irdma.compress)")
    args = ap.parse_args()
    run = (lambda m: compare(m, args, args.compare)) if args.compare else (lambda m: train(m, args))
    if args.mount:
        result = run(args.mount)
    else:
        with tempfile.TemporaryDirectory(prefix="irdmafs-digits-") as tmp:
            mount = os.path.join(tmp, "ps")
            irdmafs("up", mount, "--nodes", "3", "--replicas", "2", "--state", os.path.join(tmp, "state"))
            try:
                result = run(mount)
            finally:
                irdmafs("down", mount)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
