"""Many small reads at once (a safetensors view's tensors): a burst per node, or read alone."""

import numpy as np
import pytest

from irdmafs.client.client import Client
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster

UNIT = 64 << 10


@pytest.fixture
async def client(nursery):
    cfg = config(unit=UNIT)
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        yield c


async def test_small_files_are_read_in_bursts_and_the_rest_alone(client, monkeypatch):
    c = client
    rng = np.random.default_rng(3)
    files = []
    for i in range(40):  # small ones, and one across three stripes
        data = rng.integers(0, 255, 3 * UNIT - 7 if i == 0 else 100 + i * 37, dtype=np.uint8).tobytes()
        files.append(((await c.paths.write_file(f"/t{i}", data)), data))
    alone = []
    read = c.io.read

    async def counted(extent, *args, **kw):
        alone.append(extent.fid)
        return await read(extent, *args, **kw)

    monkeypatch.setattr(c.io, "read", counted)

    def wants():
        outs = [bytearray(len(d) - 5) for _, d in files]
        return outs, [(a["ino"], 5, memoryview(o), a) for (a, _), o in zip(files, outs)]

    outs, reads = wants()
    await c.data.read_many(reads)  # no key cached yet: each read alone, which caches them
    assert sorted(alone) == sorted(a["ino"] for a, _ in files)
    assert all(bytes(o) == d[5:] for o, (_, d) in zip(outs, files))
    alone.clear()
    outs, reads = wants()
    await c.data.read_many(reads)  # now in a burst per node
    assert alone == [] and all(bytes(o) == d[5:] for o, (_, d) in zip(outs, files))
    c.io.forget(files[7][0]["ino"])  # a key no longer cached: that one alone
    hole = await c.paths.write_file("/hole", b"")
    hole = await c.truncate(hole["ino"], 2 * UNIT)  # no region anywhere: zeros
    await c.read_into(hole["ino"], 0, memoryview(bytearray(2 * UNIT)))
    alone.clear()
    out_hole = bytearray(b"x" * UNIT)
    outs, reads = wants()
    reads.append((hole["ino"], UNIT, memoryview(out_hole), hole))
    await c.data.read_many(reads)
    assert sorted(alone) == sorted([files[7][0]["ino"], hole["ino"]])
    assert all(bytes(o) == d[5:] for o, (_, d) in zip(outs, files)) and out_hole == bytes(UNIT)
