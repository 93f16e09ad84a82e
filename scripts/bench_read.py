#!/usr/bin/env python3
"""Reading a checkpoint again: a snapshot and a live file through the mount against tmpfs, in one run.

    .venv/bin/python scripts/bench_read.py [--mib 256] [--reps 3] [--replicas 2] [--bert base|tiny|none] [--json FILE]
    sudo .venv/bin/python scripts/bench_read.py --link 500mbit [--readers 4] [--nodes 4] [--mib 256] [--json FILE]

A local cluster (etcd, 3 nodes on tcp, R as given) and a mount; a file of ``--mib`` MiB written
through it and a snapshot taken; the same bytes in a file on tmpfs (/dev/shm). Each file is read
whole with 1 MiB requests, as a loader reads a checkpoint: once, then again (the median of
``--reps`` reads). The references are the fastest read of the same bytes in a file on tmpfs, and
in a file on local disk (/var/tmp) once cached, of ``--reps`` + 1 reads before the mount's and as
many after, measured in this run: the issue's is tmpfs, but a cached local disk file reads faster
here (ext4's reads take the page cache's pages in batches, tmpfs's one by one), so the limit of a
read from the page cache is the faster of the two (``*_vs_page_cache``). Printed and written as a flat JSON object:

- ``snapshot_reread_vs_tmpfs``: a snapshot read again (its pages stay cached: it never changes);
- ``live_reread_vs_tmpfs``: a live file read again, unchanged (an open keeps its pages when the
  file's stamp is the one its last open took: irdmafs/fs/pagecache.py);
- ``snapshot_first_read_vs_tmpfs``: the snapshot's first read (from the nodes);
- with ``--bert``, ``model_live_second_read_vs_tmpfs`` and ``model_snapshot_second_read_vs_tmpfs``:
  the model's ``model.safetensors``, copied in with the directory, read twice, then a snapshot of
  it twice (``second_reads``; their ``first_read`` too).

With ``--link RATE`` (root), the fan-out instead: ``--readers`` hosts and ``--nodes`` PS nodes,
each a network namespace behind its own veth link shaped by tbf to RATE (bench_step.py's bed,
scripts/netns.py), each reader host with its own mount. A file of ``--mib`` MiB is written through
the first and published as a snapshot; then every reader reads it whole at once (1 MiB reads,
every byte checked). ``fanout_vs_links``: the readers' aggregate (readers x bytes / the slowest
reader's time) over readers x RATE, the most their links can take; ``fanout_node<j>_share``: the
part of the bytes each node sent; ``link_single_stream_vs_rate``: one TCP stream between two of
the namespaces, over RATE (the links are real if it is near 1).

Then loading as users load (``--bert base``, the default: a BERT-base-shaped model of 110 M
parameters, 438 MB of fp32, built by ``transformers`` with random weights and saved with
``save_pretrained``; ``--bert tiny`` for a smoke run, ``none`` to skip): the same directory on
local disk (/var/tmp) and in the mount, each loaded cold (its pages dropped with
``posix_fadvise(DONTNEED)``) and warm (right after), by ``safetensors.safe_open`` (every tensor
read) and by ``BertModel.from_pretrained``. Each ``*_time_vs_disk`` is the mount's time over the
local disk's, in this run (1.0: as fast as a local disk; larger: slower).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import MiB, gbps, local_cluster, med, mounted, read_file  # noqa: E402


def reads(path: Path, nbytes: int, reps: int, buf: memoryview) -> tuple[float, float]:
    """(first read, median of ``reps`` reads after it), in GB/s."""
    first = gbps(nbytes, read_file(path, nbytes, MiB, buf, cold=False))
    again = gbps(nbytes, med([read_file(path, nbytes, MiB, buf, cold=False) for _ in range(reps)]))
    return first, again


def run(tmp: Path, nbytes: int, reps: int, replicas: int, bert: str = "none") -> dict[str, float]:
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    buf = memoryview(bytearray(nbytes))
    res: dict[str, float] = {}
    shm = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="irdmafs-bench-read-")
    disk = tempfile.NamedTemporaryFile(dir="/var/tmp", prefix="irdmafs-bench-read-")
    for f in (shm, disk):
        f.write(data.tobytes())
        f.flush()

    def references() -> tuple[list[float], list[float]]:
        shm_times = [read_file(Path(shm.name), nbytes, MiB, buf, cold=False) for _ in range(reps + 1)]
        return shm_times, [read_file(Path(disk.name), nbytes, MiB, buf, cold=False) for _ in range(reps + 1)]

    tmpfs, local = references()
    with shm, disk, local_cluster(tmp / "ps", replicas, tmp) as lc, mounted(lc, tmp / "mnt") as mnt:
        (mnt / "ckpt.bin").write_bytes(data.tobytes())
        os.mkdir(mnt / ".snapshots" / "bench")
        snap = mnt / ".snapshots" / "bench" / "ckpt.bin"
        res["snapshot_first_read_gbps"], res["snapshot_reread_gbps"] = reads(snap, nbytes, reps, buf)
        if bytes(buf) != data.tobytes():
            raise RuntimeError("the snapshot read back other bytes")
        _, res["live_reread_gbps"] = reads(mnt / "ckpt.bin", nbytes, reps, buf)
        if bytes(buf) != data.tobytes():
            raise RuntimeError("the live file read back other bytes")
        if bert != "none":
            res |= loaders(mnt, bert)
        again = references()
        tmpfs, local = tmpfs + again[0], local + again[1]
    res["tmpfs_reread_gbps"] = ref = gbps(nbytes, min(tmpfs))  # the best, before and after
    res["page_cache_reread_gbps"] = best = max(ref, gbps(nbytes, min(local)))  # tmpfs or a local disk's file: the limit
    for name in ("snapshot_reread", "live_reread", "snapshot_first_read"):
        res[f"{name}_vs_tmpfs"] = res[f"{name}_gbps"] / ref
        res[f"{name}_vs_page_cache"] = res[f"{name}_gbps"] / best
    return res


BERTS = {
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128),
}


def drop_pages(directory: Path) -> None:
    """Drop the kernel's cached pages of every file in ``directory`` (local or the mount's)."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_times(directory: Path) -> dict[str, float]:
    """Seconds: safe_open reading every tensor, then from_pretrained, each cold then warm."""
    import torch
    from safetensors import safe_open
    from transformers import BertModel

    def safe_open_all() -> dict:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    out: dict[str, float] = {}
    for loader, fn in (("safe_open", safe_open_all), ("from_pretrained", lambda: BertModel.from_pretrained(str(directory)))):
        for temp in ("cold", "warm"):
            if temp == "cold":
                drop_pages(directory)
            t0 = time.perf_counter()
            got = fn()
            out[f"{loader}_{temp}"] = time.perf_counter() - t0
            if loader == "safe_open" and not all(isinstance(v, torch.Tensor) for v in got.values()):
                raise RuntimeError("safe_open returned something else than tensors")
    return out


def second_reads(live: Path, snapshot: Path, source: Path) -> dict[str, float]:
    """A model file copied in (converted to its tensors at the copy's close), read whole twice
    with 1 MiB requests, and then a snapshot of it: each read against the fastest read of the
    same bytes on tmpfs in this run, of four before and four after (issue 43: the second read of
    a live model.safetensors, its pages kept and its open taking the file's stamp
    (fs/pagecache.py), was 0.23 of it). ``source``: the file it was copied from, copied to tmpfs."""
    nbytes = live.stat().st_size
    buf = memoryview(bytearray(nbytes))
    took: dict[str, float] = {}
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="irdmafs-bench-read-") as shm:
        shutil.copyfile(source, shm.name)
        want = Path(shm.name).read_bytes()
        tmpfs = [read_file(Path(shm.name), nbytes, MiB, buf, cold=False) for _ in range(4)]
        os.mkdir(snapshot)
        for name, path in (("model_live", live), ("model_snapshot", snapshot / live.relative_to(snapshot.parent.parent))):
            for which in ("first", "second"):
                took[f"{name}_{which}_read"] = read_file(path, nbytes, MiB, buf, cold=False)
                if bytes(buf) != want:
                    raise RuntimeError(f"{path} read back other bytes")
        tmpfs += [read_file(Path(shm.name), nbytes, MiB, buf, cold=False) for _ in range(4)]
    return {f"{k}_vs_tmpfs": min(tmpfs) / t for k, t in took.items()}


def loaders(mnt: Path, size: str) -> dict[str, float]:
    """``load_times`` of one saved model on local disk and in the mount, as ratios."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(**BERTS[size]))
    local = Path(tempfile.mkdtemp(prefix="irdmafs-bench-read-", dir="/var/tmp"))
    try:
        model.save_pretrained(local)
        shutil.copytree(local, mnt / "bert")  # cp -r, as a user publishes a checkpoint
        res = second_reads(mnt / "bert" / "model.safetensors", mnt / ".snapshots" / "bert-read", local / "model.safetensors")
        want = model.state_dict()
        back = BertModel.from_pretrained(str(mnt / "bert")).state_dict()
        if any(not torch.equal(want[k], back[k]) for k in want):
            raise RuntimeError("the model loaded from the mount differs from the one saved")
        disk, mount = load_times(local), load_times(mnt / "bert")
    finally:
        shutil.rmtree(local)
    res |= {f"{k}_time_vs_disk": mount[k] / disk[k] for k in disk}
    res["model_bytes"] = float((mnt / "bert" / "model.safetensors").stat().st_size)
    return res


def fanout(tmp: Path, rate: str, readers: int, nodes: int, replicas: int, nbytes: int) -> dict[str, float]:
    """``--link``: one published version read by ``readers`` hosts at once, each through its own
    mount, from ``nodes`` nodes, every host behind its own shaped link (bench_step.py's bed)."""
    from bench_step import LinkBed, bed
    from netns import link_bytes

    data = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    digest = hashlib.sha256(data).digest()
    res: dict[str, float] = {"fanout_readers": readers, "fanout_nodes": nodes, "fanout_replicas": replicas}
    with ExitStack() as stack:
        link = LinkBed(max(readers, nodes), rate, stack)
        res["link_single_stream_vs_rate"] = link.single_stream(2.0)
        b = stack.enter_context(bed(tmp, readers, replicas, link, nodes=nodes))
        (b.mounts[0] / "ckpt.bin").write_bytes(data)  # published as a snapshot: a version that stays
        os.mkdir(b.mounts[0] / ".snapshots" / "v1")
        paths = [m / ".snapshots" / "v1" / "ckpt.bin" for m in b.mounts]
        start = threading.Barrier(readers + 1)
        took: list[float | None] = [None] * readers
        same = [False] * readers

        def reader(i: int) -> None:
            buf, h = bytearray(MiB), hashlib.sha256()
            start.wait(timeout=60)
            t0 = time.perf_counter()
            with open(paths[i], "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    h.update(memoryview(buf)[:n])
            took[i] = time.perf_counter() - t0
            same[i] = h.digest() == digest

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(readers)]
        for t in threads:
            t.start()
        before = [link_bytes(link.ps_dev(j))[1] for j in range(nodes)]  # rx at the root end: what a node sent
        start.wait(timeout=60)
        for t in threads:
            t.join(timeout=600)
        sent = [link_bytes(link.ps_dev(j))[1] - before[j] for j in range(nodes)]
    if not all(same) or None in took:
        raise RuntimeError(f"readers that read other bytes or did not finish: {[i for i in range(readers) if not same[i]]}")
    slowest = max(took)  # type: ignore[type-var]
    res["fanout_aggregate_gbps"] = readers * nbytes / slowest / 1e9
    res["fanout_vs_links"] = readers * nbytes / slowest / (readers * link.rate_bits / 8)
    res["fanout_fastest_reader_vs_link"] = nbytes / min(took) / (link.rate_bits / 8)  # type: ignore[type-var]
    for j, n in enumerate(sent):
        res[f"fanout_node{j + 1}_share"] = n / max(1, sum(sent))
    return res


def main() -> int:
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="the file's size in MiB")
    ap.add_argument("--reps", type=int, default=3, help="reads after the first, their median counts")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--bert", choices=["base", "tiny", "none"], default="base", help="the model loaded by safe_open and from_pretrained")
    ap.add_argument("--link", metavar="RATE", help="(root) the fan-out instead: reader hosts and nodes behind links shaped to RATE, e.g. 500mbit")
    ap.add_argument("--readers", type=int, default=4, help="--link: reader hosts, each with its own mount")
    ap.add_argument("--nodes", type=int, default=4, help="--link: PS nodes, each on its own host")
    ap.add_argument("--json", help="write the flat JSON object here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="irdmafs-bench-read-") as tmp:
        if args.link:
            res = fanout(Path(tmp), args.link, args.readers, args.nodes, args.replicas, args.mib * MiB)
        else:
            res = run(Path(tmp), args.mib * MiB, args.reps, args.replicas, args.bert)
    for k, v in res.items():
        print(f"{k:32s} {v:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
