"""A directory's small tensors in buckets of at most BUCKET_MAX_BYTES each (client/buckets.py
``bucket_parts``): a bucket is pushed, pulled, copied and unpacked whole, so its size bounds what
each costs. Over an in-process cluster with the limit set small."""

import numpy as np
import pytest

from irdmafs.client import buckets
from irdmafs.client.client import Client
from irdmafs.packing import in_force
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster


def attrs(sizes: list[int]) -> list[dict]:
    return [{"ino": i, "tensor": {"dtype": "<f4", "shape": [n // 4]}} for i, n in enumerate(sizes)]


def test_parts_keep_the_order_and_stay_within_the_limit():
    sizes = [4096] * 10 + [16384, 4096, 12288]
    parts = buckets.bucket_parts(attrs(sizes), 16384)
    assert [a["ino"] for p in parts for a in p] == list(range(len(sizes)))  # in order, each once
    assert [sum(sizes[a["ino"]] for a in p) for p in parts] == [16384, 16384, 8192, 16384, 16384]
    assert buckets.bucket_parts(attrs([100] * 5), 1 << 20) == [attrs([100] * 5)]


@pytest.fixture
async def client(nursery):
    cfg = config(unit=64 << 10)
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        yield c


async def test_a_directory_past_the_limit_packs_into_several_buckets_and_reads_the_same(client, monkeypatch):
    c = client
    monkeypatch.setattr(buckets, "BUCKET_MAX_BYTES", 16 * 1024)  # 16 tensors of 1 KiB a bucket
    await c.paths.makedirs("/m")
    d = (await c.paths.resolve("/m"))["ino"]
    values = {f"t{i:02d}": np.arange(256, dtype=np.float32) + 1000 * i for i in range(40)}
    for name, v in values.items():
        await c.paths.save(f"/m/{name}.npy", v)
    listed = dict(await c.readdir(d))
    assert await c.buckets.pack(d, [dict(listed[f"{name}.npy"]) for name in values])
    now = dict(await c.readdir(d))
    where = {name: in_force(now[f"{name}.npy"]) for name in values}
    fids = [w["fid"] if w else None for w in where.values()]
    assert fids[:16] == [fids[0]] * 16 and fids[16:32] == [fids[16]] * 16 and fids[0] != fids[16]
    assert fids[32:] == [None] * 8  # the last 8: fewer than PACK_MIN_TENSORS, left alone
    assert all(w["size"] <= 16 * 1024 for w in where.values() if w)
    for name, v in values.items():
        assert np.array_equal(await c.paths.load(f"/m/{name}.npy"), v), name
