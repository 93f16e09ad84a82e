#!/usr/bin/env python3
"""A whole training step's communication through the mount, against PyTorch DDP, in one run.

    .venv/bin/python scripts/bench_step.py [--json FILE] [--plot PNG] [--steps N] [--quick]
        [--models resnet50,transformer] [--workers 2,4] [--mounts per-worker|shared]

(``./scripts/bench_step`` installs the ``bench`` extra and runs it.)

Both sides train the same parameter shapes with W worker processes on this machine:

- **DDP**: ``torch.nn.parallel.DistributedDataParallel`` with the gloo backend (25 MB buckets,
  its defaults). Its communication time is isolated as a backward with DDP's all-reduce minus
  the same backward under ``no_sync()`` (no communication), each a median over the steps; the
  forward is one multiply-add per parameter, so the backward itself is cheap and DDP's overlap
  of communication with it hides almost nothing. Second row: the same with DDP's
  ``fp16_compress_hook``.
- **irdmafs**: a 3-node local cluster (real node processes, TCP on loopback), R=2, the model
  directory under ``bsp`` with W workers and SGD. Each worker process pushes every gradient and
  pulls every parameter with ``irdmafs.torch.ParameterServer`` through a real FUSE mount (one
  per worker by default, as on a cluster where each worker host mounts; ``--mounts shared`` puts
  every worker on one). Phases: push (``ps.push``), pull (``ps.pull``, which includes waiting for
  the slowest rank's push to be applied: that is bsp), and the nodes' apply time (optimizer and
  install, summed over the nodes, per step). Second row: ``user.irdma.compress = fp16``.

Keys: ``step_vs_ddp_<model>_w<W>`` (irdmafs step / DDP communication; target <= 1.0) and
``step_vs_ddp_fp16_<model>_w<W>``; ``irdmafs_<phase>_s_...`` and ``ddp_comm_s_...`` the medians
behind them. Every figure is from this run; the ratios are between figures of this run only.
Every worker checks that the parameters it pulled are what SGD over the pushed gradients gives,
so a fast wrong answer fails the run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import peers  # noqa: E402
from irdmafs.local import LocalCluster, node_status, wait_settled, write_config  # noqa: E402
from irdmafs.mount import mount_background, unmount  # noqa: E402

LR = 0.01


# -- models -------------------------------------------------------------------------------------
def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    from bench import resnet50_shapes as shapes

    return shapes()


def transformer_shapes(layers: int = 8, d: int = 384, ffn: int = 1536, vocab: int = 30522, seq: int = 512) -> list[tuple[str, tuple[int, ...]]]:
    """A BERT-shaped encoder (names and shapes as Hugging Face's BertModel): embeddings, then per
    layer q/k/v/output projections, two layer norms and the feed-forward pair (16 tensors)."""
    shapes = [("embeddings.word_embeddings.weight", (vocab, d)), ("embeddings.position_embeddings.weight", (seq, d)), ("embeddings.token_type_embeddings.weight", (2, d)), ("embeddings.LayerNorm.weight", (d,)), ("embeddings.LayerNorm.bias", (d,))]
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes += [(f"{p}.{name}.weight", (d, d)), (f"{p}.{name}.bias", (d,))]
        shapes += [(f"{p}.attention.output.LayerNorm.weight", (d,)), (f"{p}.attention.output.LayerNorm.bias", (d,))]
        shapes += [(f"{p}.intermediate.dense.weight", (ffn, d)), (f"{p}.intermediate.dense.bias", (ffn,))]
        shapes += [(f"{p}.output.dense.weight", (d, ffn)), (f"{p}.output.dense.bias", (d,))]
        shapes += [(f"{p}.output.LayerNorm.weight", (d,)), (f"{p}.output.LayerNorm.bias", (d,))]
    shapes += [("pooler.dense.weight", (d, d)), ("pooler.dense.bias", (d,))]
    return shapes


MODELS = {"resnet50": resnet50_shapes, "transformer": transformer_shapes}


def make_module(shapes, seed: int = 0):
    """A module with exactly these named parameters; forward touches each once."""
    import torch

    class Shapes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.names = []
            for name, shape in shapes:
                key = name.replace(".", "__")
                self.register_parameter(key, torch.nn.Parameter(torch.randn(shape, generator=g) * 0.01))
                self.names.append((key, name))

        def forward(self, x):
            # one multiply-add per parameter: dL/dp = x * (rank-dependent constant), cheap
            return sum((getattr(self, k) * x).sum() for k, _ in self.names)

    return Shapes()


def expected_grad(shape, rank: int, step: int) -> np.ndarray:
    """What every side's backward gives for ``rank`` at ``step``: a constant gradient."""
    return np.full(shape, 1e-3 * (rank + 1) * (1 + step % 3), np.float32)


# -- DDP ----------------------------------------------------------------------------------------
def _ddp_rank(rank: int, world: int, port: int, model: str, steps: int, fp16: bool, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    module = make_module(MODELS[model]())
    ddp = DDP(module)
    if fp16:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    times = {"sync": [], "nosync": []}
    for i in range(steps + 1):
        for mode in ("sync", "nosync"):
            x = torch.tensor(1e-3 * (rank + 1) * (1 + i % 3))
            ddp.zero_grad(set_to_none=False)
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "sync":
                ddp(x).backward()
            else:
                with ddp.no_sync():
                    ddp(x).backward()
            dt = time.perf_counter() - t0
            if i:
                times[mode].append(dt)
    # the all-reduced gradient is the average over ranks
    want = np.mean([1e-3 * (r + 1) * (1 + steps % 3) for r in range(world)])
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in times.items()} | {"check": float(want)})


def ddp(model: str, world: int, steps: int, fp16: bool) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = peers._free_port()
    procs = [ctx.Process(target=_ddp_rank, args=(r, world, port, model, steps, fp16, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=900)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return {"comm": max(res["sync"] - res["nosync"], 1e-9), "sync": res["sync"], "nosync": res["nosync"]}


# -- irdmafs ------------------------------------------------------------------------------------
def _irdmafs_rank(rank: int, world: int, mount: str, model: str, tag: str, steps: int, start, out) -> None:
    import torch

    from irdmafs.torch import ParameterServer

    torch.set_num_threads(1)
    shapes = MODELS[model]()
    module = make_module(shapes)
    ps = ParameterServer(mount, tag, rank)
    start.wait()
    ps.pull(module)  # step 0's parameters (as published)
    published = {k: getattr(module, k).detach().numpy().copy() for k, _ in module.names}
    times = {"push": [], "pull": []}
    cpu0 = time.process_time()
    for i in range(steps + 1):
        x = torch.tensor(1e-3 * (rank + 1) * (1 + i % 3))
        module.zero_grad(set_to_none=False)
        module(x).backward()
        t0 = time.perf_counter()
        ps.push(module)
        t1 = time.perf_counter()
        ps.pull(module)
        t2 = time.perf_counter()
        if i:
            times["push"].append(t1 - t0)
            times["pull"].append(t2 - t1)
    cpu = (time.process_time() - cpu0) / (steps + 1)
    # bsp + sgd: p = p0 - lr * sum over steps of the ranks' mean gradient
    total = sum(np.mean([1e-3 * (r + 1) * (1 + i % 3) for r in range(world)]) for i in range(steps + 1))
    worst = max(float(np.max(np.abs(getattr(module, k).detach().numpy() - (published[k] - LR * total)))) for k, _ in module.names)
    ps.close()
    out.put((rank, {k: statistics.median(v) for k, v in times.items()}, worst, cpu))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time so far of these processes (from /proc; kernel copies for sockets
    and FUSE count as system time of the process that makes them)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def apply_seconds(cfg) -> float:
    async def total() -> float:
        s = 0.0
        for name in cfg.names:
            st = await node_status(cfg, name)
            s += (st or {}).get("apply_seconds", 0.0)
        return s

    return trio.run(total)


def irdmafs_step(lc: LocalCluster, mounts: list[Path], model: str, world: int, steps: int, compress: str, mount_pids: list[int]) -> dict:
    """Publish the model, run ``steps`` bsp steps with ``world`` worker processes; medians."""
    from irdmafs.torch import ParameterServer

    tag = f"{model}-w{world}-{compress}"
    shapes = MODELS[model]()
    ps = ParameterServer(mounts[0], tag, 0)
    ps.configure(sync="bsp", workers=str(world), optimizer=f"sgd lr={LR}", compress=compress)
    ps.publish(make_module(shapes))
    ps.close()
    ctx = mp.get_context("spawn")
    q, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_irdmafs_rank, args=(r, world, str(mounts[r % len(mounts)]), model, tag, steps, start, q)) for r in range(world)]
    for p in procs:
        p.start()
    applied0 = apply_seconds(lc.cfg)
    node_pids = [p.pid for p in lc.procs.values()]
    cpu0 = (cpu_seconds(node_pids), cpu_seconds(mount_pids))
    start.set()
    try:
        results = [q.get(timeout=900) for _ in procs]
        cpu1 = (cpu_seconds(node_pids), cpu_seconds(mount_pids))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    applied = (apply_seconds(lc.cfg) - applied0) / (steps + 1)
    # nodes and mounts: from /proc over the whole run, the first pull (step 0's parameters)
    # counted as one more step; workers: their own CPU over the steps (backward included)
    cpu = {"cpu_nodes": (cpu1[0] - cpu0[0]) / (steps + 2), "cpu_mounts": (cpu1[1] - cpu0[1]) / (steps + 2), "cpu_workers": sum(r[3] for r in results)}
    tol = 1e-5 if compress == "none" else 1e-3  # fp16 gradients round
    worst = max(r[2] for r in results)
    if worst > tol:
        raise RuntimeError(f"{tag}: pulled parameters differ from SGD's by {worst:g}")
    push = max(r[1]["push"] for r in results)
    pull = max(r[1]["pull"] for r in results)
    return {"push": push, "pull": pull, "step": statistics.median([r[1]["push"] + r[1]["pull"] for r in results]), "apply": applied} | cpu


class Bed:
    """A 3-node local cluster with R=2 and its mounts."""

    def __init__(self, tmp: Path, mounts: int) -> None:
        self.state = tmp / "cluster"
        path = write_config(self.state, 3, 2, transport=["tcp"])
        self.lc = LocalCluster(path)
        self.path = path
        self.mounts = [self.state / f"mnt{i}" for i in range(mounts)]
        self.procs = []

    def __enter__(self) -> "Bed":
        self.lc.start_all()
        trio.run(wait_settled, self.lc.cfg)
        for i, m in enumerate(self.mounts):
            m.mkdir()
            self.procs.append(mount_background(str(self.path), str(m), [], self.state / f"mount{i}.log"))
        return self

    def __exit__(self, *exc) -> None:
        for m in self.mounts:
            unmount(str(m), lazy=True)
        for p in self.procs:
            p.terminate()
            p.wait(10)
        self.lc.stop_all()


# -- report -------------------------------------------------------------------------------------
def plot(res: dict, path: str, models: list[str], workers: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{m}\nW={w}" for m in models for w in workers]
    x = np.arange(len(labels))
    rows = [("DDP (gloo)", "ddp_comm_s_{m}_w{w}"), ("irdmafs", "irdmafs_step_s_{m}_w{w}"), ("DDP fp16 hook", "ddp_fp16_comm_s_{m}_w{w}"), ("irdmafs fp16", "irdmafs_fp16_step_s_{m}_w{w}")]
    width = 0.2
    for k, (name, key) in enumerate(rows):
        ax.bar(x + (k - 1.5) * width, [res.get(key.format(m=m, w=w), 0) * 1000 for m in models for w in workers], width, label=name)
    ax.set_xticks(x, labels)
    ax.set_ylabel("communication per step (ms)")
    ax.set_title("A training step's communication: irdmafs (bsp, R=2, 3 nodes) vs DDP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default="resnet50,transformer")
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--mounts", choices=("per-worker", "shared"), default="per-worker")
    ap.add_argument("--no-fp16", action="store_true", help="skip the fp16 rows")
    ap.add_argument("--no-ddp", action="store_true", help="irdmafs only (for profiling it; no ratios)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: resnet50, 2 workers, 2 steps")
    args = ap.parse_args()
    models = args.models.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    if args.quick:
        models, workers, args.steps, args.no_fp16 = ["resnet50"], [2], 2, True
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (know {', '.join(MODELS)})")
    rows = [("", "none")] + ([] if args.no_fp16 else [("fp16_", "fp16")])
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="irdmafs-step-") as tmp:
        with Bed(Path(tmp), max(workers) if args.mounts == "per-worker" else 1) as bed:
            for m in models:
                res[f"tensors_{m}"] = len(MODELS[m]())
                res[f"bytes_{m}"] = sum(int(np.prod(s)) * 4 for _, s in MODELS[m]())
                for w in workers:
                    for prefix, compress in rows:
                        d = {"comm": float("nan"), "sync": float("nan"), "nosync": float("nan")} if args.no_ddp else ddp(m, w, args.steps, fp16=bool(prefix))
                        mounts = bed.mounts[:w] if args.mounts == "per-worker" else bed.mounts
                        r = irdmafs_step(bed.lc, mounts, m, w, args.steps, compress, [p.pid for p in bed.procs])
                        key = f"{m}_w{w}"
                        res[f"ddp_{prefix}comm_s_{key}"] = d["comm"]
                        res[f"ddp_{prefix}backward_s_{key}"] = d["sync"]
                        res[f"ddp_{prefix}backward_nosync_s_{key}"] = d["nosync"]
                        for phase in ("push", "pull", "step", "apply", "cpu_nodes", "cpu_mounts", "cpu_workers"):
                            res[f"irdmafs_{prefix}{phase}_s_{key}"] = r[phase]
                        res[f"step_vs_ddp_{prefix}{key}"] = r["step"] / d["comm"]
                        print(f"{m:12s} W={w} {compress:5s}: irdmafs step {r['step'] * 1000:7.1f} ms (push {r['push'] * 1000:6.1f}, pull {r['pull'] * 1000:6.1f}, nodes' apply {r['apply'] * 1000:6.1f})"
                              f"  DDP comm {d['comm'] * 1000:7.1f} ms  -> step_vs_ddp_{prefix}{key} = {res[f'step_vs_ddp_{prefix}{key}']:.2f}\n"
                              f"{'':23}CPU per step: nodes {r['cpu_nodes'] * 1000:6.1f} ms, mounts {r['cpu_mounts'] * 1000:6.1f} ms, workers {r['cpu_workers'] * 1000:6.1f} ms", flush=True)  # fmt: skip
    res["mounts_per_worker"] = float(args.mounts == "per-worker")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    if args.plot:
        plot(res, args.plot, models, workers)
    if args.no_ddp:
        print("targets: not judged (--no-ddp: no DDP figures, no ratios)")
        return 0
    missed = [k for k, v in res.items() if k.startswith("step_vs_ddp_") and not v <= 1.0]
    print("targets (step_vs_ddp_* <= 1.0):", "all met" if not missed else "missed: " + ", ".join(missed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
