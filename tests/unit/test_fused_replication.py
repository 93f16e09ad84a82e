"""Replication fused per peer (server/replicator.py, ``_fused``; issue 32): the updates a step
sends one backup travel together, and each keeps its own answer and retry. Over an in-process
cluster."""

import numpy as np
import pytest
import trio

from irdmafs.errors import RemoteError

from .test_push_ids import bed  # noqa: F401  (the fixture)

TENSORS = 48


async def _many(c, prefix: str) -> list[int]:
    return [(await c.paths.save(f"/m/{prefix}{i}.npy", np.zeros(256, np.float32)))["ino"] for i in range(TENSORS)]


async def _push_all(c, inos: list[int]) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for ino in inos:
                n.start_soon(c.training.push, ino, 0, np.ones(256, np.float32))


def _held_everywhere(nodes, c, inos: list[int]) -> None:
    """Every target of every tensor's stripe holds the step: bytes, clock, push count."""
    by_name = {n.name: n for n in nodes}
    for ino in inos:
        first = None
        for name in c.cluster.roles.targets(ino, 0):
            s = by_name[name].store.get(ino, 0)
            assert s is not None and s.clock == 1, (ino, name)
            assert by_name[name].records.of(ino, 0).next_step(0) == 1, (ino, name)
            data = bytes(s.data[128 : 128 + 1024])
            assert first is None or data == first, (ino, name)
            first = data


async def test_a_step_of_many_small_tensors_reaches_the_backups_in_batches(bed):  # noqa: F811
    c, nodes, _ = bed
    inos = await _many(c, "t")
    before = sum(n.counters["apply"] for n in nodes)
    await _push_all(c, inos)
    _held_everywhere(nodes, c, inos)
    batches = sum(n.counters["apply_batch"] for n in nodes)
    applies = sum(n.counters["apply"] for n in nodes) - before
    assert batches >= 1, "no two updates to one backup travelled together"
    assert applies >= TENSORS  # each update is still applied as its own ``apply``
    for ino in inos:
        assert np.array_equal(await c.paths.load(f"/m/t{inos.index(ino)}.npy"), np.full(256, -1, np.float32))


async def test_an_update_refused_inside_a_batch_is_sent_again_alone_and_the_others_stand(bed):  # noqa: F811
    """A backup refuses one update of a batch (ESTALE, once): that update is sent again after
    the primary reads the view, the others of its batch are answered at once, and every push is
    acknowledged with its step on every replica, none applied twice."""
    c, nodes, _ = bed
    inos = await _many(c, "r")
    refused: list = []
    in_batch: list[bool] = []
    for b in nodes:
        real = b.calls["apply"]

        def refusing_once(real=real, b=b):
            async def apply(**kw):
                if not refused and kw.get("record") is not None and b.counters["apply_batch"]:
                    refused.append(kw["where"])
                    in_batch.append(True)
                    raise RemoteError("ESTALE", "counted down here (test)")
                return await real(**kw)

            return apply

        b.calls["apply"] = refusing_once()
    await _push_all(c, inos)
    assert refused and in_batch, "no update was refused inside a batch"
    _held_everywhere(nodes, c, inos)
    for i in range(TENSORS):
        assert np.array_equal(await c.paths.load(f"/m/r{i}.npy"), np.full(256, -1, np.float32))


async def test_a_malformed_apply_batch_is_einval_and_a_bad_entry_is_refused_alone(bed):  # noqa: F811
    _, nodes, _ = bed
    node = nodes[0]
    for bad in ("x", [1], [{"where": [1, 0, 0, 0, 1, 1], "sender": "n9"}]):
        with pytest.raises(RemoteError) as err:
            await node.handle("apply_batch", {"updates": bad})
        assert err.value.code == "EINVAL"
    r = await node.handle("apply_batch", {"updates": [{"where": "nowhere"}, {"nonsense": 1}], "sender": "", "epoch": 0})
    assert [e.get("error") for e in r["results"]] == ["EINVAL", "EINVAL"]
