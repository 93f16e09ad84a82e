#!/usr/bin/env python3
"""Checkpoints as training jobs save and load them: through the mount against tmpfs, in one run.

    .venv/bin/python scripts/bench_ckpt.py [--gib 1] [--transport shm,tcp] [--replicas 1,2]
                                           [--reps 2] [--rotations 5] [--json FILE]

For each transport and R given, a local cluster (etcd, 3 nodes, 4 MiB stripes: the default
``irdmafs up`` makes, whose transport on one host is shared memory) and a mount. One
model-shaped state dict of ``--gib`` GiB of float32 (a few large matrices and many small
vectors, as a transformer's) is saved and loaded three ways, each into a fresh directory of the
mount and of tmpfs (/dev/shm), alternated:

- ``torch``: ``torch.save`` of the state dict, ``torch.load(weights_only=True)``;
- ``safetensors``: ``safetensors.torch.save_file`` and ``load_file``;
- ``dcp``: ``torch.distributed.checkpoint`` with two ranks (two processes, gloo), each saving and
  loading its half of the state (its own keys), as a sharded job checkpoints.

Each save is loaded twice: first as the job that saved it would (``warm``: whatever the save
left in the page cache is used), then cold, after the saved files' cached pages were dropped
(``posix_fadvise(DONTNEED)``: through the mount the bytes then come from the nodes; tmpfs keeps
them, which is its best case). A load is timed until every tensor was copied once (``clone``:
``safetensors`` maps the file and reads nothing until a tensor is used) and checked against
the saved tensors. The first save of each way on each side lands on fresh memory; the figure is
the best of ``--reps`` saves (once memory is reused, issue 59), the loads their median.

Then ``--rotations`` rotated saves (``safetensors``, as a Trainer with ``save_total_limit=2``
does): save N into ``ckpt-N``, remove ``ckpt-(N-2)``, 2 s apart; ``rotate_fresh_pages_per_byte``
is the minor page faults the nodes and the mount took during the saves after the first two (on
shared memory the mount writes into the nodes' regions and faults their pages in), in bytes
(4 KiB each), per byte those saves stored, divided by R (1.0: every replica's every byte on
fresh pages; issue 59's target is <= 0.10), and apart, ``rotate_nodes_...`` and
``rotate_mount_...``.

Printed and written as a flat JSON object, keys prefixed ``<transport>_r<R>_``:
``<way>_save_vs_tmpfs``, ``<way>_load_warm_vs_tmpfs``, ``<way>_load_vs_tmpfs`` (cold), the
mount's time over tmpfs's (1.0: as fast as tmpfs), and the seconds of each; and where the best
save through the mount spent CPU, ``<way>_save_cpu_<nodes|mount|writer>_s`` (user and system
seconds, /proc/PID/stat; the writer is this process, so not for DCP, whose ranks write).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import local_cluster, mounted, report  # noqa: E402

TARGET = 1.5  # issue 59: a save (memory reused) and a warm load on shared memory within 1.5x tmpfs
ROTATE_GAP = 2.0  # seconds between rotated saves
WAYS = ("torch", "safetensors", "dcp")


def state_dict(gib: float) -> dict:
    """About ``gib`` GiB of float32 shaped like a transformer's layers: per layer four d x d
    attention matrices, two d x 4d MLP matrices and eight d-vectors (biases, norms)."""
    import torch

    d = 1024
    per_layer = (4 * d * d + 2 * 4 * d * d + 8 * d) * 4
    layers = max(1, round(gib * (1 << 30) / per_layer))
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        for name, shape in (("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)), ("up", (4 * d, d)), ("down", (d, 4 * d))):
            out[f"layer{i}.{name}.weight"] = torch.randn(shape, generator=g)
        for name in ("q", "k", "v", "o", "norm1", "norm2", "norm1b", "norm2b"):
            out[f"layer{i}.{name}.bias"] = torch.randn(d, generator=g)
    return out


def drop_pages(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def save(way: str, state: dict, directory: Path) -> float:
    """Seconds to save ``state`` into ``directory`` (made, empty)."""
    import torch

    directory.mkdir()
    if way == "dcp":
        return dcp_run(directory, "save")["save"]
    t0 = time.perf_counter()
    if way == "torch":
        torch.save(state, directory / "model.pt")
    else:
        from safetensors.torch import save_file

        save_file(state, str(directory / "model.safetensors"))
    return time.perf_counter() - t0


def load(way: str, state: dict, directory: Path, cold: bool) -> float:
    """Seconds to load what ``save`` left in ``directory`` (its pages dropped first if ``cold``);
    RuntimeError if what loads is not what was saved."""
    import torch

    if way == "dcp":
        return dcp_run(directory, "load_cold" if cold else "load")["load"]
    if cold:
        drop_pages(directory)
    t0 = time.perf_counter()
    if way == "torch":
        back = torch.load(directory / "model.pt", weights_only=True)
    else:
        from safetensors.torch import load_file

        back = load_file(str(directory / "model.safetensors"))
    back = {k: v.clone() for k, v in back.items()}  # every byte read: safetensors maps the file lazily
    took = time.perf_counter() - t0
    if not same(state, back):
        raise RuntimeError(f"{way}: what loaded from {directory} is not what was saved")
    return took


_RANK = r"""
import os, sys, time, json
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
sys.path.insert(0, sys.argv[5])
from bench_ckpt import state_dict, drop_pages
from pathlib import Path
rank, world, directory, gib, what = int(sys.argv[1]), 2, Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + str(directory.parent / (directory.name + f".{what}.rendezvous")), rank=rank, world_size=world)
full = state_dict(gib)
keys = sorted(full)[rank::world]  # each rank its half, its own keys: both write
mine = {k: full[k] for k in keys}
del full
out = {"ok": True}
if what == "save":
    dist.barrier(); t0 = time.perf_counter()
    dcp.save(mine, checkpoint_id=str(directory))
    dist.barrier(); out["save"] = time.perf_counter() - t0
else:
    if what == "load_cold" and rank == 0:
        drop_pages(directory)
    dist.barrier(); t0 = time.perf_counter()
    back = {k: torch.empty_like(v) for k, v in mine.items()}
    dcp.load(back, checkpoint_id=str(directory))
    back = {k: v.clone() for k, v in back.items()}  # as the other ways are timed
    dist.barrier(); out["load"] = time.perf_counter() - t0
    out["ok"] = all(torch.equal(mine[k], back[k]) for k in mine)
print(json.dumps(out))
dist.destroy_process_group()
"""


def dcp_run(directory: Path, what: str) -> dict:
    """Two ranks (processes, gloo) saving or loading their halves with
    torch.distributed.checkpoint; the slower rank's seconds."""
    import subprocess

    here = str(Path(__file__).resolve().parent)
    argv = [str(directory), str(ARGS.gib), what, here]
    env = {**os.environ, **RANK_ENV}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), *argv], stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs) or not all(o["ok"] for o in outs):
        raise RuntimeError(f"dcp {what}: a rank failed or loaded other bytes: {outs}")
    return {k: max(o[k] for o in outs) for k in outs[0] if k != "ok"}


# the DCP ranks' allocator as this process's (``keep_freed_memory``); the cluster and the mount
# run with the environment they were given, as a user's do
RANK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 62)}


def keep_freed_memory() -> None:
    """This process and the DCP ranks it starts (the loaders, on both sides alike) keep the
    memory they free for their next allocations (glibc: no mmap'd chunks, no trim). This VM
    hands freed memory back to its host and a first touch of fresh memory costs about 0.75 s
    per GB: without this, whichever load came first after a save paid for the memory its
    tensors land in (a warm load on tmpfs took 4x the cold one after it), which is the loader's
    allocator, not the file system. Not the nodes' or the mount's: they run as a user runs them."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (its largest: a tensor of up to 32 MiB from the heap)
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: -1, never trim


def _stat(pids: list[int], *fields: int) -> int:
    """The sum over processes ``pids`` of the /proc/PID/stat ``fields`` (numbered as proc(5) does)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            after = f.read().rsplit(")", 1)[1].split()  # field 3 (state) is after[0]
        total += sum(int(after[n - 3]) for n in fields)
    return total


def minor_faults(pids: list[int]) -> int:
    """Minor page faults taken so far by the processes ``pids`` (field 10)."""
    return _stat(pids, 10)


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds taken so far by the processes ``pids`` (fields 14, 15)."""
    return _stat(pids, 14, 15) / os.sysconf("SC_CLK_TCK")


def rotated(state: dict, mnt: Path, groups: dict[str, list[int]], rotations: int, replicas: int) -> dict[str, float]:
    """Fresh pages each group of processes (``groups``: name -> pids) took per byte stored by
    rotated saves past the first two, over R."""
    from safetensors.torch import save_file

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    faults, counted = dict.fromkeys(groups, 0), 0
    for n in range(rotations):
        if n >= 2:
            shutil.rmtree(mnt / f"ckpt-{n - 2}")
            time.sleep(ROTATE_GAP)  # as a job's saves are apart: what is kept for reuse must last
        (mnt / f"ckpt-{n}").mkdir()
        before = {g: minor_faults(pids) for g, pids in groups.items()}
        save_file(state, str(mnt / f"ckpt-{n}" / "model.safetensors"))
        if n >= 2:
            for g, pids in groups.items():
                faults[g] += minor_faults(pids) - before[g]
            counted += nbytes
    for n in range(max(0, rotations - 2), rotations):
        shutil.rmtree(mnt / f"ckpt-{n}")
    return {g: f * 4096 / counted / replicas if counted else float("nan") for g, f in faults.items()}


def run(tmp: Path, state: dict, transport: str, replicas: int, reps: int, rotations: int) -> dict[str, float]:
    tag = f"{transport}_r{replicas}_"
    times: dict[str, list[float]] = {}
    res: dict[str, float] = {}
    mount: list = []
    cpu: dict[str, list[dict[str, float]]] = {}  # way -> per save through the mount, CPU seconds per group
    with local_cluster(tmp / tag, replicas, tmp, transport) as lc, mounted(lc, tmp / f"mnt-{tag}", mount) as mnt:
        groups = {"nodes": [p.pid for p in lc.procs.values()], "mount": [p.pid for p in mount], "writer": [os.getpid()]}
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="irdmafs-bench-ckpt-") as shm:
            for rep in range(reps):
                for way in WAYS:
                    for where, base in (("tmpfs", Path(shm)), ("mount", mnt)):  # alternated: noise lands on both
                        d = base / f"{way}-{rep}"
                        before = {g: cpu_seconds(pids) for g, pids in groups.items()}
                        times.setdefault(f"{way}_save_{where}", []).append(save(way, state, d))
                        if where == "mount":
                            cpu.setdefault(way, []).append({g: cpu_seconds(pids) - before[g] for g, pids in groups.items()})
                        times.setdefault(f"{way}_load_warm_{where}", []).append(load(way, state, d, cold=False))
                        times.setdefault(f"{way}_load_{where}", []).append(load(way, state, d, cold=True))
                        shutil.rmtree(d)
        if rotations > 2:
            got = rotated(state, mnt, {g: groups[g] for g in ("nodes", "mount")}, rotations, replicas)
            res[tag + "rotate_fresh_pages_per_byte"] = sum(got.values())
            res |= {f"{tag}rotate_{g}_fresh_pages_per_byte": v for g, v in got.items()}
    for way in WAYS:
        for op in ("save", "load_warm", "load"):
            pick = min if op == "save" else statistics.median  # a save: the best, once memory is reused
            mount, ref = pick(times[f"{way}_{op}_mount"]), pick(times[f"{way}_{op}_tmpfs"])
            if op == "save":
                res[f"{tag}{way}_first_save_vs_tmpfs"] = times[f"{way}_save_mount"][0] / times[f"{way}_save_tmpfs"][0]
                best = cpu[way][times[f"{way}_save_mount"].index(mount)]
                for g, v in best.items():  # (DCP's writers are its ranks, not this process)
                    if g != "writer" or way != "dcp":
                        res[f"{tag}{way}_save_cpu_{g}_s"] = v
            res[f"{tag}{way}_{op}_mount_s"], res[f"{tag}{way}_{op}_tmpfs_s"] = mount, ref
            res[f"{tag}{way}_{op}_vs_tmpfs"] = mount / ref
    return res


ARGS = argparse.Namespace(gib=1.0)


def main() -> int:
    global ARGS
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="the state's size in GiB")
    ap.add_argument("--transport", default="shm", help="comma-separated: shm (the default cluster's, one host), tcp")
    ap.add_argument("--replicas", default="2", help="comma-separated R values")
    ap.add_argument("--reps", type=int, default=2, help="saves and loads of each way on each side")
    ap.add_argument("--rotations", type=int, default=5, help="rotated saves (0: none; the first two are not counted)")
    ap.add_argument("--json", help="write the flat JSON object here")
    ARGS = ap.parse_args()
    transports, replicas = ARGS.transport.split(","), [int(r) for r in ARGS.replicas.split(",")]
    if ARGS.gib <= 0 or ARGS.reps < 1 or not set(transports) <= {"shm", "tcp"} or not all(1 <= r <= 3 for r in replicas):
        ap.error("--gib and --reps must be positive, --transport shm and/or tcp, --replicas 1 to 3")
    keep_freed_memory()
    state = state_dict(ARGS.gib)
    res: dict[str, float] = {"state_bytes": float(sum(t.numel() * t.element_size() for t in state.values())), "tensors": float(len(state))}
    with tempfile.TemporaryDirectory(prefix="irdmafs-bench-ckpt-") as tmp:
        for transport in transports:
            for r in replicas:
                res |= run(Path(tmp), state, transport, r, ARGS.reps, ARGS.rotations)
    counted = [k for k in res if k.endswith("_vs_tmpfs") and k.startswith("shm_") and "_first_" not in k and not k.endswith("_load_vs_tmpfs")]
    report(res, counted, TARGET, ARGS.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
