#!/usr/bin/env python3
"""A whole training step's communication through the mount, against PyTorch DDP, in one run.

    .venv/bin/python scripts/bench_step.py [--json FILE] [--plot PNG] [--steps N] [--quick]
        [--models resnet50,transformer,many,few] [--workers 2,4] [--mounts per-worker|shared]
    sudo .venv/bin/python scripts/bench_step.py --link [RATE] [--quick] ...   # cluster-shaped

(``./scripts/bench_step`` installs the ``bench`` extra and runs it.)

Both sides train the same parameter shapes with W worker processes on this machine:

- **DDP**: ``torch.nn.parallel.DistributedDataParallel`` with the gloo backend (25 MB buckets,
  its defaults). Its communication time is isolated as a backward with DDP's all-reduce minus
  the same backward under ``no_sync()`` (no communication), each a median over the steps; the
  forward is one multiply-add per parameter, so the backward itself is cheap and DDP's overlap
  of communication with it hides almost nothing. Second row: the same with DDP's
  ``fp16_compress_hook``.
- **irdmafs**: a 3-node local cluster (real node processes; the default config's transport,
  shared memory between processes of this host, or TCP on loopback with ``--transport tcp``),
  R=2, the model directory under ``bsp`` with W workers and SGD. Each worker process pushes
  every gradient and pulls every parameter with ``irdmafs.worker.torch.ParameterServer`` through a
  real FUSE mount (one per worker by default, as on a cluster where each worker host mounts;
  ``--mounts shared`` puts every worker on one), through the mount's shared-memory door
  (``--no-door``: the stream files). By default a worker calls ``ps.step`` (push and pull in one
  request the mount overlaps), timed whole as "push" (pull 0); ``--separate`` calls ``ps.push``
  then ``ps.pull`` (which includes waiting for the slowest rank's push to be applied: that is
  bsp), timed apart. Also the nodes' apply time (optimizer and install, summed over the nodes,
  per step). Second row: ``user.irdma.compress = fp16``.

Keys: ``step_vs_ddp_<model>_w<W>`` (irdmafs step / DDP communication; target <= 1.0) and
``step_vs_ddp_fp16_<model>_w<W>``; ``irdmafs_<phase>_s_...`` and ``ddp_comm_s_...`` the medians
behind them. ``--models many,few``: a model of 1,004 tensors (1,000 of 8 KB beside 4 of 8 MB)
against the same bytes in 10 tensors, ``many_vs_few_w<W>`` their steps' ratio (what a step pays
per tensor; target <= 1.5). Every figure is from this run; the ratios are between figures of
this run only.
Every worker checks that the parameters it pulled are what SGD over the pushed gradients gives,
and every DDP rank that its all-reduced gradients are the ranks' mean, so a fast wrong answer
fails the run.

**--link RATE** (root): the same comparison shaped like a cluster. Every host is a network
namespace of its own behind a veth link whose both directions are shaped by tbf to RATE (9000-byte
frames, as a training fabric; scripts/netns.py), the root namespace routing between them as a
switch would. For each W: W worker namespaces and W PS namespaces (as many PS nodes as workers,
R=--replicas, TCP transport only). A node runs in its PS namespace; a worker's mount runs in the
worker's namespace (entered with ``nsenter --net`` only, so the mount stays in this mount
namespace) and so does the worker process (``setns`` into it before anything else); DDP's rank i
runs in worker namespace i, gloo on its veth, MASTER_ADDR rank 0's namespace address. Each side's
*link bound* is the bytes its busiest link carried per timed step, in its busier direction (each
direction is a RATE pipe of its own), divided by RATE: the veths' counters (headers included, as
tbf counts them) read before and after the timed steps, with every rank held at the edges of
that window. Printed and written: ``link_step_vs_bound_<model>_w<W>`` (irdmafs step / its own link
bound; target <= 1.15), ``link_step_vs_ddp_<model>_w<W>`` (irdmafs step / DDP's communication;
target <= 1.0 at W=4, 0.85 at W=8), ``link_cpu_vs_ddp_<model>_w<W>`` (the nodes' and mounts' CPU
per step / DDP's; target <= 2.0), the bounds and steps behind them (``link_irdmafs_bound_s_...``,
``link_ddp_bound_s_...``), and ``link_single_stream_vs_rate``: one TCP stream between two of the
namespaces at the start of the run, over the rate (below ~0.95 the bound is not real: the links
or the CPU cap below RATE). The CPU busy fraction of each side is printed beside its step.

The default RATE is 500mbit, the fastest at which the cores are not what limits. tbf itself is
exact: one Python TCP stream over the shaped veths (through two shaped links, 9000-byte frames)
gets 1.002x the rate at 0.5, 1, 2 and 4 Gbit/s (0.966x with 1500-byte frames: the headers). What
decides is the processes behind the links, on 2 cores. Measured (CPU from /proc over the timed
steps; ResNet-50, R=2): irdmafs's nodes, mounts and workers use 2.9-3.1 CPU-s per W=4 step, about
1.5 s of the two cores; its link bound is 1.42 s at 1 Gbit/s and 2.84 s at 500 Mbit/s. So at
1 Gbit/s a W=4 step could not reach its bound even with perfect overlap (the cores would be the
limit), at 500 Mbit/s it could with the cores half idle (W=2: 1.4-1.7 CPU-s per step, a bound of
2.7 s). DDP's gloo needs 15% of the cores at 500 Mbit/s and runs at 0.99 of its bound. The irdmafs
step was 1.73x its bound at 1 Gbit/s and 1.70x at 500 Mbit/s (W=4): what it misses by is not CPU.

Everything --link creates (namespaces, veths, tbf qdiscs, mounts, processes) is removed at the
end, also on ^C, SIGTERM and errors; traffic only goes to the 10.86.x.2 addresses of the
namespaces it made; every wait is bounded (a rank that dies fails the run at once).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import peers  # noqa: E402
import link_trace  # noqa: E402
from link_trace import LinkTrace  # noqa: E402
from netns import burst_for, enter, link_bytes, namespaces, rate_bits, setns, single_stream  # noqa: E402

from irdmafs import config as C  # noqa: E402
from irdmafs.launch.etcd_process import LocalEtcd  # noqa: E402
from irdmafs.launch.local import LocalCluster, node_status, wait_settled, write_config  # noqa: E402
from irdmafs.launch.mount import mount_background, stop_background, wait_for_mount  # noqa: E402

LR = 0.01
SEPARATE = os.environ.get("IRDMAFS_BENCH_SEPARATE") == "1"  # --separate, inherited by the workers
TIMEOUT = 900.0  # the longest any one wait of this script may take
DEFAULT_RATE = "500mbit"  # see the docstring: at 1gbit a W=4 step is CPU-bound here
LINK_PREFIX, LINK_NET, LINK_MTU = "irdstep", 86, 9000  # namespaces irdstep0.., addresses 10.86.i.2
NODE_PORT, DDP_PORTS = 7500, itertools.count(29500)  # in namespaces this script made: no one else listens there


# -- models -------------------------------------------------------------------------------------
def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    from bench import resnet50_shapes as shapes

    return shapes()


def transformer_shapes(layers: int = 8, d: int = 384, ffn: int = 1536, vocab: int = 30522, seq: int = 512) -> list[tuple[str, tuple[int, ...]]]:
    """A BERT-shaped encoder (names and shapes as Hugging Face's BertModel): embeddings, then per
    layer q/k/v/output projections, two layer norms and the feed-forward pair (16 tensors)."""
    shapes = [
        ("embeddings.word_embeddings.weight", (vocab, d)),
        ("embeddings.position_embeddings.weight", (seq, d)),
        ("embeddings.token_type_embeddings.weight", (2, d)),
        ("embeddings.LayerNorm.weight", (d,)),
        ("embeddings.LayerNorm.bias", (d,)),
    ]
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


def tiny_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Smoke runs: a two-layer MLP, 4 tensors, 1.3 M parameters (5.3 MB)."""
    return [("fc1.weight", (1024, 256)), ("fc1.bias", (1024,)), ("fc2.weight", (1024, 1024)), ("fc2.bias", (1024,))]


def many_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """What a step costs per tensor: 1,000 small tensors (2,048 floats, as batch-norm and bias
    vectors) beside 4 large ones (2,048 x 1,024): 10.4 M parameters (41.7 MB)."""
    return [(f"small.{i}", (2048,)) for i in range(1000)] + [(f"large.{i}", (2048, 1024)) for i in range(4)]


def few_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The bytes of ``many_shapes`` in 10 tensors: its reference in the same run."""
    total = sum(int(np.prod(s)) for _, s in many_shapes())
    sizes = [total // 10] * 9 + [total - 9 * (total // 10)]
    return [(f"part.{i}", (n,)) for i, n in enumerate(sizes)]


MODELS = {"resnet50": resnet50_shapes, "transformer": transformer_shapes, "tiny": tiny_shapes, "many": many_shapes, "few": few_shapes}


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


# -- lining ranks up around the timed steps -----------------------------------------------------
class Gate:
    """Holds the ranks at the two edges of the timed steps (0: before the first, 1: after the
    last) until this process has read the links' counters: a rank calls ``wait(k)``, this
    process ``open(k, ...)``."""

    def __init__(self, ctx) -> None:
        self.arrived = ctx.Queue()
        self.go = [ctx.Event(), ctx.Event()]

    def wait(self, k: int) -> None:
        self.arrived.put(k)
        if not self.go[k].wait(TIMEOUT):
            raise TimeoutError(f"gate {k} not opened within {TIMEOUT}s")

    def open(self, k: int, procs: list, read=None):
        collect(self.arrived, len(procs), procs, f"ranks at gate {k}")
        value = read() if read else None
        self.go[k].set()
        return value


def collect(q, n: int, procs: list, what: str, timeout: float = TIMEOUT) -> list:
    """``n`` items from ``q``; fails as soon as one of ``procs`` died, or after ``timeout``."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n:
        try:
            got.append(q.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: a rank process exited with {dead[0]}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {len(got)} of {n} after {timeout}s") from None
    return got


def reap(procs: list, grace: float) -> None:
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join(10)


# -- DDP ----------------------------------------------------------------------------------------
def _ddp_rank(rank: int, world: int, init: str, netns: tuple[str, str] | None, model: str, steps: int, fp16: bool, gate: Gate, out) -> None:
    if netns:  # before anything opens a socket: this rank's host is that namespace
        setns(netns[0])
        os.environ["GLOO_SOCKET_IFNAME"] = netns[1]
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # not: "the hostname ... cannot be retrieved"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    module = make_module(MODELS[model]())
    ddp = DDP(module)
    if fp16:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    times = {"sync": [], "nosync": []}
    err = 0.0
    for i in range(steps + 1):
        if i == 1:
            gate.wait(0)
            cpu0 = time.process_time()
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
            if mode == "sync" and i == steps:  # the all-reduced gradient is the ranks' mean
                want = np.mean([1e-3 * (r + 1) * (1 + i % 3) for r in range(world)])
                err = max(err, max(float((p.grad - want).abs().max()) for p in module.parameters()))
    cpu = (time.process_time() - cpu0) / steps
    gate.wait(1)
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, {k: statistics.median(v) for k, v in times.items()}, err, cpu))


def ddp(model: str, world: int, steps: int, fp16: bool, link: LinkBed | None = None) -> dict:
    ctx = mp.get_context("spawn")
    q, gate = ctx.Queue(), Gate(ctx)
    if link:
        init = f"tcp://{link.worker_hosts[0]}:{next(DDP_PORTS)}"
        nets = [(link.worker_ns(r), link.worker_ifname(r)) for r in range(world)]
    else:
        init, nets = f"tcp://127.0.0.1:{peers._free_port()}", [None] * world
    procs = [ctx.Process(target=_ddp_rank, args=(r, world, init, nets[r], model, steps, fp16, gate, q)) for r in range(world)]
    for p in procs:
        p.start()
    ok = False
    try:
        devs = [link.worker_dev(r) for r in range(world)] if link else []
        before = gate.open(0, procs, lambda: counters(devs))
        after = gate.open(1, procs, lambda: counters(devs))
        results = sorted(collect(q, world, procs, "DDP ranks"))
        ok = True
    finally:
        reap(procs, 60 if ok else 1)
    tol = 1e-5 if fp16 else 1e-6
    err = max(r[2] for r in results)
    if not err <= tol:
        raise RuntimeError(f"DDP {model} W={world}: all-reduced gradients differ from the ranks' mean by {err:g}")
    times = results[0][1]  # rank 0's medians
    res = {"comm": max(times["sync"] - times["nosync"], 1e-9), "sync": times["sync"], "nosync": times["nosync"], "cpu": sum(r[3] for r in results), "err": err}
    if link:
        res |= busiest(before, after, steps, link)
    return res


# -- irdmafs ------------------------------------------------------------------------------------
def _irdmafs_rank(rank: int, world: int, mount: str, netns: str | None, model: str, tag: str, steps: int, gate: Gate, out) -> None:
    if netns:  # the worker runs where its mount runs
        setns(netns)
    import torch

    from irdmafs.worker.torch import ParameterServer

    torch.set_num_threads(1)
    shapes = MODELS[model]()
    module = make_module(shapes)
    ps = ParameterServer(mount, tag, rank)
    ps.pull(module)  # step 0's parameters (as published)
    published = {k: getattr(module, k).detach().numpy().copy() for k, _ in module.names}
    times = {"push": [], "pull": []}
    marks = []  # each timed step's (start, end), CLOCK_MONOTONIC: the link trace's clock too
    for i in range(steps + 1):
        if i == 1:
            gate.wait(0)
            cpu0 = time.process_time()
        x = torch.tensor(1e-3 * (rank + 1) * (1 + i % 3))
        module.zero_grad(set_to_none=False)
        module(x).backward()
        t0, m0 = time.perf_counter(), time.monotonic()
        if SEPARATE:
            ps.push(module)
            t1 = time.perf_counter()
            ps.pull(module)
        else:  # one request the mount overlaps: the whole step is counted as "push"
            ps.step(module)
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        if i:
            times["push"].append(t1 - t0)
            times["pull"].append(t2 - t1)
            marks.append((m0, time.monotonic()))
    cpu = (time.process_time() - cpu0) / steps
    gate.wait(1)
    # bsp + sgd: p = p0 - lr * sum over steps of the ranks' mean gradient
    total = sum(np.mean([1e-3 * (r + 1) * (1 + i % 3) for r in range(world)]) for i in range(steps + 1))
    worst = max(float(np.max(np.abs(getattr(module, k).detach().numpy() - (published[k] - LR * total)))) for k, _ in module.names)
    ps.close()
    out.put((rank, {k: statistics.median(v) for k, v in times.items()}, worst, cpu, marks))


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


def irdmafs_step(bed: Bed, world: int, model: str, steps: int, compress: str, link: LinkBed | None = None, fmt: str = "npy", run: int = 0) -> dict:
    """Publish the model (a directory of .npy tensors, or with ``fmt`` "safetensors" one
    safetensors file written by safetensors itself: fs/models.py), run ``steps`` bsp steps
    with ``world`` worker processes; medians."""
    from irdmafs.worker.torch import ParameterServer

    lc, mounts = bed.lc, bed.mounts[:world] if len(bed.mounts) > 1 else bed.mounts
    tag = f"{model}-w{world}-{compress}" + (f"-{fmt}-{run}" if fmt != "npy" or run else "")
    shapes = MODELS[model]()
    if fmt == "safetensors":  # the file first: the model is then its tensor directory
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in make_module(shapes).named_parameters()}, str(mounts[0] / f"{tag}.safetensors"))
    ps = ParameterServer(mounts[0], tag, 0)
    ps.configure(sync="bsp", workers=str(world), optimizer=f"sgd lr={LR}", compress=compress)
    if fmt == "npy":
        ps.publish(make_module(shapes))
    ps.close()
    ctx = mp.get_context("spawn")
    q, gate = ctx.Queue(), Gate(ctx)
    nets = [link.worker_ns(r) for r in range(world)] if link else [None] * world
    procs = [ctx.Process(target=_irdmafs_rank, args=(r, world, str(mounts[r % len(mounts)]), nets[r], model, tag, steps, gate, q)) for r in range(world)]
    for p in procs:
        p.start()
    node_pids, mount_pids = [p.pid for p in lc.procs.values()], [p.pid for p in bed.procs]
    devs = [link.worker_dev(r) for r in range(world)] + [link.ps_dev(j) for j in range(len(lc.cfg.names))] if link else []
    trace = LinkTrace(devs)
    ok = False
    try:

        def edge():
            return {"applied": apply_seconds(lc.cfg), "nodes": cpu_seconds(node_pids), "mounts": cpu_seconds(mount_pids), "links": counters(devs)}

        def first():
            e = edge()
            if link:
                trace.start()
            return e

        def last():
            if link:
                trace.stop()
                time.sleep(0.2)  # a last replication lands
            return edge()

        before = gate.open(0, procs, first)
        after = gate.open(1, procs, last)
        results = sorted(collect(q, world, procs, "irdmafs workers"))
        ok = True
    finally:
        reap(procs, 60 if ok else 1)
    # nodes, mounts and workers: CPU per step over the timed steps
    cpu = {
        "cpu_nodes": (after["nodes"] - before["nodes"]) / steps,
        "cpu_mounts": (after["mounts"] - before["mounts"]) / steps,
        "cpu_workers": sum(r[3] for r in results),
    }
    tol = 1e-5 if compress == "none" else 1e-3  # fp16 gradients round
    worst = max(r[2] for r in results)
    if worst > tol:
        raise RuntimeError(f"{tag}: pulled parameters differ from SGD's by {worst:g}")
    push = max(r[1]["push"] for r in results)
    pull = max(r[1]["pull"] for r in results)
    res = {
        "push": push,
        "pull": pull,
        "step": statistics.median([r[1]["push"] + r[1]["pull"] for r in results]),
        "apply": (after["applied"] - before["applied"]) / steps,
        "err": worst,
    } | cpu
    if link:
        res |= busiest(before["links"], after["links"], steps, link)
        marks = [r[4] for r in results]
        res["trace_steps"] = link_trace.steps(trace, marks, link.rate_bits, link.label)
        res["trace"] = (trace, marks)
    return res


# -- the links ----------------------------------------------------------------------------------
def counters(devs: list[str]) -> dict[str, tuple[int, int]]:
    return {d: link_bytes(d) for d in devs}


def busiest(before: dict, after: dict, steps: int, link: LinkBed) -> dict:
    """The busiest link's bytes per step in its busier direction, and that over the rate."""
    best = (-1, "")
    for dev in before:
        tx, rx = (after[dev][k] - before[dev][k] for k in (0, 1))  # tx: into the namespace
        best = max(best, (tx, f"{link.label(dev)} in"), (rx, f"{link.label(dev)} out"))
    per_step = best[0] / steps
    return {"link_bytes": per_step, "link_bound": per_step * 8 / link.rate_bits, "link_where": best[1]}


class LinkBed:
    """2 x max(W) namespaces behind shaped links: workers' hosts 0..W-1, PS hosts W..2W-1."""

    def __init__(self, wmax: int, rate: str, stack: ExitStack) -> None:
        self.wmax, self.rate, self.rate_bits = wmax, rate, rate_bits(rate)
        hosts = stack.enter_context(namespaces(2 * wmax, rate, prefix=LINK_PREFIX, net=LINK_NET, mtu=LINK_MTU, burst=burst_for(rate)))
        self.worker_hosts, self.ps_hosts = hosts[:wmax], hosts[wmax:]

    def worker_ns(self, r: int) -> str:
        return f"{LINK_PREFIX}{r}"

    def ps_ns(self, j: int) -> str:
        return f"{LINK_PREFIX}{self.wmax + j}"

    def worker_ifname(self, r: int) -> str:
        return f"{LINK_PREFIX}n{r}"  # the namespace's own end

    def worker_dev(self, r: int) -> str:
        return f"{LINK_PREFIX}h{r}"  # the root namespace's end: its counters

    def ps_dev(self, j: int) -> str:
        return f"{LINK_PREFIX}h{self.wmax + j}"

    def label(self, dev: str) -> str:
        i = int(dev.removeprefix(f"{LINK_PREFIX}h"))
        return f"worker{i}" if i < self.wmax else f"ps{i - self.wmax}"

    def single_stream(self, seconds: float) -> float:
        """One TCP stream from worker host 0 to PS host 0 (two shaped links), over the rate."""
        return single_stream(self.worker_ns(0), self.ps_ns(0), self.ps_hosts[0], seconds) * 8 / self.rate_bits


class Bed:
    """Node processes and mounts: ``lc``, ``mounts``, ``procs`` (the mounts' processes)."""

    def __init__(self, lc: LocalCluster, mounts: list[Path], procs: list) -> None:
        self.lc, self.mounts, self.procs = lc, mounts, procs


@contextmanager
def bed(tmp: Path, mounts: int, replicas: int, link: LinkBed | None = None, nodes: int = 3, transport: str = "auto"):
    """A local cluster with its views in a local etcd (as `irdmafs up` runs one) and its mounts;
    with ``link``, ``nodes`` nodes in the PS namespaces and mount i in worker namespace i (etcd on
    the root namespace's end of PS host 0's link, which every namespace routes to). Everything
    started is stopped at the end, whatever happens."""
    state = tmp / (f"cluster-w{mounts}" if link else "cluster")
    with ExitStack() as stack:
        state.mkdir(parents=True, exist_ok=True)
        etcd_host = f"10.{LINK_NET}.{link.wmax}.1" if link else "127.0.0.1"
        etcd = LocalEtcd(state / "etcd", host=etcd_host, log_path=state / "etcd.log")
        etcd.start()
        stack.callback(etcd.stop)
        if link:
            (state / "token").write_text(os.urandom(16).hex())
            doc = {
                "nodes": [{"name": f"n{j + 1}", "host": link.ps_hosts[j], "port": NODE_PORT} for j in range(nodes)],
                "token_file": "token",
                "replicas": replicas,
                "stripe_unit": int(os.environ.get("IRDMAFS_BENCH_UNIT", 4 << 20)),
                "transport": ["tcp"],
                "coordinator": [etcd.endpoint],
            }
            path = state / "cluster.toml"
            path.write_text(C.dump(C.from_dict(doc, base=state)))
        else:
            # auto: the config's default (shared memory with the nodes of this host); tcp: forced
            path = write_config(state, nodes, replicas, transport=None if transport == "auto" else [transport], coordinator=[etcd.endpoint])
        lc = LocalCluster(path)
        if link:
            lc.launcher = {name: enter(link.ps_ns(j)) for j, name in enumerate(lc.cfg.names)}
        stack.callback(lc.stop_all)
        lc.start_all()
        trio.run(lambda: wait_settled(lc.cfg, timeout=60))
        b = Bed(lc, [state / f"mnt{i}" for i in range(mounts)], [])
        for i, m in enumerate(b.mounts):
            m.mkdir()
            proc = mount_in(link.worker_ns(i), path, m, state / f"mount{i}.log") if link else mount_background(str(path), str(m), [], state / f"mount{i}.log")
            stack.callback(stop_background, str(m), proc)
            b.procs.append(proc)
        yield b


def mount_in(ns: str, config: Path, mnt: Path, log: Path) -> subprocess.Popen:
    """``irdmafs mount -f`` in network namespace ``ns`` (only: the mount is everyone's)."""
    cmd = [*enter(ns), sys.executable, "-m", "irdmafs", "mount", "--config", str(config), str(mnt), "-f"]
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_mount(str(mnt), proc, log_path=log)
    except BaseException:
        stop_background(str(mnt), proc)
        raise
    return proc


# -- report -------------------------------------------------------------------------------------
def plot(res: dict, path: str, models: list[str], workers: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{m}\nW={w}" for m in models for w in workers]
    x = np.arange(len(labels))
    link = "link_" if "link_rate_bits" in res else ""
    rows = [
        ("DDP (gloo)", "ddp_comm_s_{m}_w{w}"),
        ("irdmafs", "irdmafs_step_s_{m}_w{w}"),
        ("DDP fp16 hook", "ddp_fp16_comm_s_{m}_w{w}"),
        ("irdmafs fp16", "irdmafs_fp16_step_s_{m}_w{w}"),
    ]
    width = 0.2
    for k, (name, key) in enumerate(rows):
        ax.bar(x + (k - 1.5) * width, [res.get(link + key.format(m=m, w=w), 0) * 1000 for m in models for w in workers], width, label=name)
    ax.set_xticks(x, labels)
    ax.set_ylabel("communication per step (ms)")
    where = f"W PS nodes behind {res.get('link_rate', '')} links" if link else "3 nodes"
    ax.set_title(f"A training step's communication: irdmafs (bsp, {where}) vs DDP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report_loopback(res: dict, m: str, w: int, prefix: str, compress: str, d: dict, r: dict) -> None:
    key = f"{m}_w{w}"
    res[f"ddp_{prefix}comm_s_{key}"] = d["comm"]
    res[f"ddp_{prefix}backward_s_{key}"] = d["sync"]
    res[f"ddp_{prefix}backward_nosync_s_{key}"] = d["nosync"]
    for phase in ("push", "pull", "step", "apply", "cpu_nodes", "cpu_mounts", "cpu_workers"):
        res[f"irdmafs_{prefix}{phase}_s_{key}"] = r[phase]
    res[f"step_vs_ddp_{prefix}{key}"] = r["step"] / d["comm"]
    print(f"{m:12s} W={w} {compress:5s}: irdmafs step {r['step'] * 1000:7.1f} ms "
          f"(push {r['push'] * 1000:6.1f}, pull {r['pull'] * 1000:6.1f}, nodes' apply {r['apply'] * 1000:6.1f})"
          f"  DDP comm {d['comm'] * 1000:7.1f} ms  -> step_vs_ddp_{prefix}{key} = {res[f'step_vs_ddp_{prefix}{key}']:.2f}\n"
          f"{'':23}CPU per step: nodes {r['cpu_nodes'] * 1000:6.1f} ms, mounts {r['cpu_mounts'] * 1000:6.1f} ms, "
          f"workers {r['cpu_workers'] * 1000:6.1f} ms", flush=True)  # fmt: skip


def report_link(res: dict, m: str, w: int, prefix: str, compress: str, d: dict, r: dict) -> None:
    key = f"{prefix}{m}_w{w}"
    ncpu = os.cpu_count() or 1
    busy_i = (r["cpu_nodes"] + r["cpu_mounts"] + r["cpu_workers"]) / (ncpu * r["step"])
    busy_d = d["cpu"] / (ncpu * (d["sync"] + d["nosync"]))
    figures = {
        "irdmafs_step_s": r["step"], "irdmafs_push_s": r["push"], "irdmafs_pull_s": r["pull"], "irdmafs_apply_s": r["apply"],
        "irdmafs_bound_s": r["link_bound"], "irdmafs_link_bytes": r["link_bytes"], "irdmafs_cpu_busy": busy_i, "irdmafs_param_err": r["err"],
        "irdmafs_cpu_nodes_s": r["cpu_nodes"], "irdmafs_cpu_mounts_s": r["cpu_mounts"], "irdmafs_cpu_workers_s": r["cpu_workers"], "ddp_cpu_s": d["cpu"],
        "ddp_comm_s": d["comm"], "ddp_backward_s": d["sync"], "ddp_backward_nosync_s": d["nosync"],
        "ddp_bound_s": d["link_bound"], "ddp_link_bytes": d["link_bytes"], "ddp_cpu_busy": busy_d, "ddp_grad_err": d["err"],
    }  # fmt: skip
    for k, v in figures.items():
        res[f"link_{k}_{key}"] = v
    res[f"link_step_vs_bound_{key}"] = r["step"] / r["link_bound"]
    res[f"link_ddp_vs_bound_{key}"] = d["comm"] / d["link_bound"]
    res[f"link_step_vs_ddp_{key}"] = r["step"] / d["comm"]
    res[f"link_cpu_vs_ddp_{key}"] = (r["cpu_nodes"] + r["cpu_mounts"]) / d["cpu"]  # nodes' and mounts' CPU / DDP's
    print(f"{m:12s} W={w} {compress:5s} over {res['link_rate']} links:\n"
          f"  irdmafs step {r['step'] * 1000:8.1f} ms (push {r['push'] * 1000:.1f}, pull {r['pull'] * 1000:.1f}, nodes' apply {r['apply'] * 1000:.1f}); "
          f"link bound {r['link_bound'] * 1000:8.1f} ms"
          f" ({r['link_bytes'] / 1e6:.1f} MB/step on {r['link_where']}); CPU busy {busy_i:.0%}"
          f"  -> link_step_vs_bound_{key} = {res[f'link_step_vs_bound_{key}']:.2f}\n"
          f"{'':4}CPU per step: nodes {r['cpu_nodes'] * 1000:.0f} ms, mounts {r['cpu_mounts'] * 1000:.0f} ms, workers {r['cpu_workers'] * 1000:.0f} ms\n"
          f"  DDP comm     {d['comm'] * 1000:8.1f} ms; link bound {d['link_bound'] * 1000:8.1f} ms "
          f"({d['link_bytes'] / 1e6:.1f} MB/step on {d['link_where']}); CPU busy {busy_d:.0%}"
          f"  -> ddp comm / its bound = {res[f'link_ddp_vs_bound_{key}']:.2f}\n"
          f"  link_step_vs_ddp_{key} = {res[f'link_step_vs_ddp_{key}']:.2f}; "
          f"link_cpu_vs_ddp_{key} = {res[f'link_cpu_vs_ddp_{key}']:.2f}", flush=True)  # fmt: skip
    res[f"link_trace_steps_{key}"] = r["trace_steps"]
    if r["trace_steps"]:
        res[f"link_both_busy_{key}"] = statistics.mean(t["both"] for t in r["trace_steps"])
    for t in r["trace_steps"]:
        print(f"    step {t['step']}: {t['seconds'] * 1000:.0f} ms; its busiest link, {t['link']}: in {t['in']:.0%} of the rate, out {t['out']:.0%}; "
              f"both over half the rate in {t['both']:.0%} of its {link_trace.PERIOD * 1000:.0f} ms bins", flush=True)  # fmt: skip


def run_loopback(args, models, workers, rows, res) -> None:
    mounts = max(workers) if args.mounts == "per-worker" else 1
    with (
        tempfile.TemporaryDirectory(prefix="irdmafs-step-") as tmp,
        bed(Path(tmp), mounts, args.replicas, transport=args.transport) as b,
    ):
        for m in models:
            for w in workers:
                for prefix, compress in rows:
                    d = {"comm": float("nan"), "sync": float("nan"), "nosync": float("nan")} if args.no_ddp else ddp(m, w, args.steps, fp16=bool(prefix))
                    r = irdmafs_step(b, w, m, args.steps, compress)
                    report_loopback(res, m, w, prefix, compress, d, r)


def run_safetensors(args, models, workers, res) -> None:
    """The same step for a model published as one safetensors file and as .npy tensors, in
    the same bed, alternating (npy, st, st, npy) so that drift on a shared machine hits both."""
    mounts = max(workers) if args.mounts == "per-worker" else 1
    with (
        tempfile.TemporaryDirectory(prefix="irdmafs-step-st-") as tmp,
        bed(Path(tmp), mounts, args.replicas, transport=args.transport) as b,
    ):
        for m in models:
            for w in workers:
                steps: dict[str, list[float]] = {"npy": [], "safetensors": []}
                for run, fmt in enumerate(("npy", "safetensors", "safetensors", "npy")):
                    steps[fmt].append(irdmafs_step(b, w, m, args.steps, "none", fmt=fmt, run=run)["step"])
                key = f"{m}_w{w}"
                res[f"irdmafs_npy_step_s_{key}"] = statistics.mean(steps["npy"])
                res[f"irdmafs_safetensors_step_s_{key}"] = statistics.mean(steps["safetensors"])
                res[f"safetensors_vs_npy_{key}"] = res[f"irdmafs_safetensors_step_s_{key}"] / res[f"irdmafs_npy_step_s_{key}"]
                print(f"{m:12s} W={w}: step {res[f'irdmafs_safetensors_step_s_{key}'] * 1000:7.1f} ms as one safetensors file, "
                      f"{res[f'irdmafs_npy_step_s_{key}'] * 1000:7.1f} ms as .npy tensors"
                      f"  -> safetensors_vs_npy_{key} = {res[f'safetensors_vs_npy_{key}']:.2f}", flush=True)  # fmt: skip


def run_link(args, models, workers, rows, res) -> None:
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="irdmafs-step-link-")))
        link = LinkBed(max(workers), args.link, stack)
        res["link_rate_bits"] = float(link.rate_bits)
        res["link_single_stream_vs_rate"] = link.single_stream(0.5 if args.quick else 2.0)
        print(
            f"links: {2 * max(workers)} namespaces behind {args.link} tbf links ({LINK_MTU}-byte frames); "
            f"one TCP stream gets {res['link_single_stream_vs_rate']:.3f} of the rate",
            flush=True,
        )
        if res["link_single_stream_vs_rate"] < 0.95:
            print(
                f"warning: one stream gets only {res['link_single_stream_vs_rate']:.2f} of {args.link}: the link bounds below are not real bounds", flush=True
            )
        for w in workers:
            with bed(tmp, w, min(args.replicas, w), link, nodes=w) as b:
                for m in models:
                    for prefix, compress in rows:
                        d = ddp(m, w, args.steps, fp16=bool(prefix), link=link)
                        r = irdmafs_step(b, w, m, args.steps, compress, link=link)
                        report_link(res, m, w, prefix, compress, d, r)
                        if args.trace_json:
                            trace, marks = r["trace"]
                            path = str(Path(args.trace_json).with_suffix("")) + f"-{prefix}{m}-w{w}.json"
                            labels = {d: link.label(d) for d in trace.devs}
                            Path(path).write_text(json.dumps({"rate_bits": link.rate_bits, "labels": labels, "marks": marks, "samples": trace.samples}))
                        if args.trace_plot:
                            trace, marks = r["trace"]
                            kinds = ("ps", "worker")
                            devs = [(d, link.label(d)) for k in kinds if (d := link_trace.busiest(trace, lambda d, k=k: link.label(d).startswith(k)))]
                            path = str(Path(args.trace_plot).with_suffix("")) + f"-{prefix}{m}-w{w}.png"
                            title = f"irdmafs steps, {m}, W={w}, R={min(args.replicas, w)}, {args.link} links: the busiest PS and worker links"
                            link_trace.plot(trace, devs, marks, link.rate_bits, title, path)


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default="resnet50,transformer")
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--mounts", choices=("per-worker", "shared"), default="per-worker")
    ap.add_argument("--replicas", type=int, default=2, help="R of the irdmafs cluster (default 2)")
    ap.add_argument(
        "--transport", choices=("auto", "tcp"), default="auto", help="loopback runs: auto (shared memory with the nodes, the default config) or tcp (forced)"
    )
    ap.add_argument("--no-door", action="store_true", help="workers use the stream files, not the mount's shared-memory door")
    ap.add_argument(
        "--separate", action="store_true", help="workers call ps.push then ps.pull (timed apart) instead of ps.step (one request the mount overlaps)"
    )
    ap.add_argument("--no-fp16", action="store_true", help="skip the fp16 rows")
    ap.add_argument("--no-ddp", action="store_true", help="irdmafs only (for profiling it; no ratios)")
    ap.add_argument(
        "--link",
        nargs="?",
        const=DEFAULT_RATE,
        metavar="RATE",
        help=f"cluster-shaped: every host in a network namespace behind RATE links (default {DEFAULT_RATE}; root)",
    )
    ap.add_argument("--trace-json", metavar="JSON", help="--link: each raw link trace (every link's counters, the steps' edges) to JSON-<model>-w<W>.json")
    ap.add_argument("--trace-plot", metavar="PNG", help="--link: each run's link trace (busiest PS and worker links) to PNG-<model>-w<W>.png")
    ap.add_argument("--quick", action="store_true", help="a smoke run: resnet50 (with --link: tiny), 2 workers, 2 steps")
    ap.add_argument(
        "--safetensors",
        action="store_true",
        help="irdmafs only: the model published as one safetensors file against .npy tensors (safetensors_vs_npy_*, target <= 1.0 within noise)",
    )
    args = ap.parse_args()
    if args.no_door:
        os.environ["IRDMAFS_DOOR"] = "0"  # the worker processes inherit it (irdmafs/worker/steps.py)
    if args.separate:
        os.environ["IRDMAFS_BENCH_SEPARATE"] = "1"
    models = args.models.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    if args.quick:
        models, workers, args.steps, args.no_fp16 = ["tiny" if args.link else "resnet50"], [2], 2, True
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (know {', '.join(MODELS)})")
    if args.steps < 1 or min(workers) < 1 or args.replicas < 1:
        ap.error("--steps, --workers and --replicas must be at least 1")
    if args.link:
        try:
            rate_bits(args.link)
        except ValueError as exc:
            ap.error(str(exc))
        if os.geteuid() != 0:
            print("bench_step --link: needs root (network namespaces, veth links, tc); run it with sudo", file=sys.stderr)
            return 2
        missing = [t for t in ("ip", "tc", "nsenter", "fusermount3") if not shutil.which(t)]
        if missing:
            print(f"bench_step --link: needs {', '.join(missing)} (apt-get install iproute2 util-linux fuse3)", file=sys.stderr)
            return 2
        if args.no_ddp or args.mounts == "shared":
            ap.error("--link runs DDP and one mount per worker")
    rows = [("", "none")] + ([] if args.no_fp16 else [("fp16_", "fp16")])
    res: dict = {}
    for m in models:
        res[f"tensors_{m}"] = len(MODELS[m]())
        res[f"bytes_{m}"] = sum(int(np.prod(s)) * 4 for _, s in MODELS[m]())
    if args.safetensors:
        if args.link:
            ap.error("--safetensors runs on one host")
        run_safetensors(args, models, workers, res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
        worst = max(v for k, v in res.items() if k.startswith("safetensors_vs_npy_"))
        print(f"target (safetensors_vs_npy_* <= 1.10, no slower within this machine's noise): {'met' if worst <= 1.10 else 'missed'} (worst {worst:.2f})")
        return 0
    if args.link:
        res["link_rate"] = args.link
        run_link(args, models, workers, rows, res)
    else:
        run_loopback(args, models, workers, rows, res)
        res["mounts_per_worker"] = float(args.mounts == "per-worker")
    prefix = "link_irdmafs_" if args.link else "irdmafs_"
    for w in workers if {"many", "few"} <= set(models) else []:  # what a step pays per tensor
        many, few = res[f"{prefix}step_s_many_w{w}"], res[f"{prefix}step_s_few_w{w}"]
        res[f"many_vs_few_w{w}"] = many / few
        print(f"W={w}: 1,004 tensors step in {many * 1000:.1f} ms, the same bytes in 10 tensors in {few * 1000:.1f} ms"
              f"  -> many_vs_few_w{w} = {many / few:.2f} (target <= 1.5)", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    if args.plot:
        plot(res, args.plot, models, workers)
    if args.no_ddp:
        print("targets: not judged (--no-ddp: no DDP figures, no ratios)")
        return 0
    if args.link:
        # issue 42: the step within 1.15x its own link bound and no slower than DDP (W=8: 0.85x);
        # the nodes' and mounts' CPU at most twice DDP's
        targets = [("link_step_vs_bound_", 1.15), ("link_step_vs_ddp_", 1.0), ("link_cpu_vs_ddp_", 2.0)]
    else:
        # the targets: one host with the door and shared memory <= 1.0; tcp <= 2.0
        targets = [("step_vs_ddp_", 1.0 if args.transport == "auto" and not args.no_door else 2.0)]
    targets.append(("many_vs_few_", 1.5))
    for start, bound in targets:
        judged = {k: v for k, v in res.items() if k.startswith(start) and isinstance(v, float)}
        if not judged:
            continue  # not measured in this run (many_vs_few needs --models many,few)
        missed = [k for k, v in judged.items() if not v <= (0.85 if start == "link_step_vs_ddp_" and k.endswith("_w8") else bound)]
        w8 = ", W=8: 0.85" if start == "link_step_vs_ddp_" else ""
        print(f"targets ({start}* <= {bound}{w8}):", "all met" if not missed else "missed: " + ", ".join(missed))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_step: interrupted (everything it started is stopped and removed)", file=sys.stderr)
        sys.exit(130)
