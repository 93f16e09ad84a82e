"""Quick-start demo: a local cluster and a mount, used the way a training job and its operator would.

1. ``irdmafs up`` starts 3 PS nodes (R=2) on loopback and mounts them;
2. a model is written as .npy files with numpy, read back with numpy and, as one file, through the
   ``<model>.safetensors`` view;
3. a backup is taken with ``cp -r`` and a point-in-time snapshot with ``mkdir .snapshots/NAME``;
4. the model is damaged, then restored from the snapshot;
5. two workers train it for 5 bsp steps through the step streams (irdmafs.worker.steps); one node is
   killed and the model is still all there;
6. ``irdmafs down`` unmounts and stops everything.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def irdmafs(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "irdmafs", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"irdmafs {' '.join(args)} failed:\n{r.stderr}")
    return r.stdout.strip()


def step(text: str) -> None:
    print(f"\n== {text}")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mount", default=None, help="mountpoint (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up and mounted at the end")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="irdmafs-demo-"))
    mnt = Path(args.mount or work / "ps")

    step("irdmafs up: 3 nodes, 2 replicas, one mount")
    print(irdmafs("up", str(mnt), "--nodes", "3", "--replicas", "2", "--state", str(work / "state")))
    try:
        step("write a model with numpy")
        rng = np.random.default_rng(0)
        model = {
            "embed.weight": rng.standard_normal((30522, 128), dtype=np.float32),
            "encoder/layer.0.attn.weight": rng.standard_normal((128, 128), dtype=np.float32),
            "classifier.bias": np.zeros(2, np.float32),
        }
        for name, arr in model.items():
            path = mnt / "bert" / f"{name}.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, arr)
        subprocess.run(["ls", "-lR", str(mnt / "bert")], check=True)
        w = mnt / "bert" / "embed.weight.npy"
        derived = ("user.irdma.dtype", "user.irdma.shape", "user.irdma.version")  # read by name, never listed
        print("tensor xattrs:", {n: os.getxattr(w, n).decode() for n in derived})

        step("read it back: numpy, numpy mmap, and the whole model as one safetensors file")
        assert all(np.array_equal(np.load(mnt / "bert" / f"{n}.npy"), a) for n, a in model.items())
        assert np.array_equal(np.load(w, mmap_mode="r")[:10], model["embed.weight"][:10])
        from safetensors.numpy import load_file

        st = load_file(mnt / "bert.safetensors")
        assert sorted(st) == sorted(model) and all(np.array_equal(st[n], a) for n, a in model.items())
        print(f"bert.safetensors: {os.path.getsize(mnt / 'bert.safetensors')} bytes, tensors {sorted(st)}")

        step("snapshots: cp -r to local disk, and mkdir .snapshots/step-1000")
        subprocess.run(["cp", "-r", str(mnt / "bert"), str(work / "bert-backup")], check=True)
        os.mkdir(mnt / ".snapshots" / "step-1000")
        print("snapshots:", os.listdir(mnt / ".snapshots"), "| listing of the mount root:", os.listdir(mnt))

        step("damage the model, then restore it from the snapshot")
        np.save(mnt / "bert" / "classifier.bias.npy", np.full(2, np.nan, np.float32))
        assert np.isnan(np.load(mnt / "bert" / "classifier.bias.npy")).all()
        subprocess.run(["cp", "-r", str(mnt / ".snapshots" / "step-1000" / "bert") + "/.", str(mnt / "bert")], check=True)
        assert np.array_equal(np.load(mnt / "bert" / "classifier.bias.npy"), model["classifier.bias"])
        diff = subprocess.run(["diff", "-r", str(work / "bert-backup"), str(mnt / "bert")])
        print("restored; identical to the cp -r backup:", diff.returncode == 0)

        step("train: 2 workers, bsp, 5 steps, each a push and a pull of the whole model as one stream")
        from irdmafs.worker.steps import pull_arrays, push_arrays

        bert = mnt / "bert"
        for key, value in (("sync", "bsp"), ("workers", "2"), ("optimizer", "sgd lr=0.1")):
            os.setxattr(bert, f"user.irdma.{key}", value.encode())
        params = {r: {n: a.copy() for n, a in model.items()} for r in (0, 1)}
        t0 = time.perf_counter()
        for _ in range(5):
            with ThreadPoolExecutor(2) as pool:  # the two workers of a step, side by side
                list(pool.map(lambda r: push_arrays(mnt, "bert", r, {n: np.full_like(a, r + 1.0) for n, a in model.items()}), (0, 1)))
                list(pool.map(lambda r: pull_arrays(mnt, "bert", r, params[r]), (0, 1)))
        took = (time.perf_counter() - t0) / 5
        want = {n: a - 5 * 0.1 * 1.5 for n, a in model.items()}  # sgd on the mean of 1 and 2, 5 times
        assert all(np.allclose(params[r][n], want[n], atol=1e-5) for r in (0, 1) for n in model)
        mb = sum(a.nbytes for a in model.values()) / 1e6
        print(f"5 bsp steps of a {mb:.1f} MB model, {took * 1000:.0f} ms each: both workers hold the averaged SGD result")

        step("kill -9 one node: every tensor still reads back from its other replica")
        status = json.loads(irdmafs("status", str(mnt), "--json"))
        victim = status["nodes"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        assert all(np.allclose(np.load(mnt / "bert" / f"{n}.npy"), want[n], atol=1e-5) for n in model)
        print(f"killed {victim['name']} (pid {victim['pid']}); model intact")
        subprocess.run([sys.executable, "-m", "irdmafs", "status", str(mnt)])  # exits 1: a node is down
    finally:
        if args.keep:
            print(f"\nleft running: {mnt} (irdmafs down {mnt})")
        else:
            step("irdmafs down")
            print(irdmafs("down", str(mnt)))
            shutil.rmtree(work, ignore_errors=True)
    print("\ndemo finished: OK")


if __name__ == "__main__":
    main()
