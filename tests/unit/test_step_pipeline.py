"""A step's pushes and pulls as a pipeline (issue 32): pushes leave in the model's order whatever
order the scheduler runs their tasks in (``PushPull.push(order=)``), and a pull waiting for a
round is told by the node when it closes (``clock_wait``: server/clocks.py,
client/clockwait.py) instead of polling the stripe's clock word. Over an in-process cluster,
bsp with two ranks."""

import json
import random

import numpy as np
import pytest
import trio

from irdmafs.errors import RemoteError

from .test_pull_many import SIZE, TENSORS, Counted, bed  # noqa: F401  (bed: the same cluster and model)


async def _push_all(c, inos, rank: int, value: float, order=None) -> None:
    async with trio.open_nursery() as n:
        for k, ino in enumerate(inos):
            n.start_soon(lambda ino=ino, k=k: c.training.push(ino, rank, np.full(SIZE, value, np.float32), order=order[k] if order else float("inf")))


async def test_a_steps_pushes_leave_in_the_models_order_whatever_order_their_tasks_run(bed, monkeypatch):
    c, _, inos = bed
    await _push_all(c, inos, 1, 1.0)  # the staging regions and tensor info in place
    await _push_all(c, inos, 0, 1.0)
    sent = Counted(monkeypatch, c.training, "_send_batch")
    place = list(range(TENSORS))
    random.Random(7).shuffle(place)  # the model's order: not the order the tasks start in
    await _push_all(c, inos, 1, 1.0, order=place)
    by_node: dict[str, list[int]] = {}
    for node, batch in sent.calls:
        by_node.setdefault(node, []).extend(place[inos.index(desc["fid"])] for desc, *_ in batch)
    assert sum(map(len, by_node.values())) == TENSORS
    for node, order in by_node.items():
        assert order == sorted(order), f"{node} was sent {order}: not the model's order"


async def test_without_an_order_pushes_leave_as_they_came(bed, monkeypatch):
    c, _, inos = bed
    await _push_all(c, inos, 1, 1.0)
    sent = Counted(monkeypatch, c.training, "_send_batch")
    for ino in inos:  # one after the other: each is sent before the next begins
        await c.training.push(ino, 0, np.full(SIZE, 1.0, np.float32))
    assert [desc["fid"] for _, batch in sent.calls for desc, *_ in batch] == inos


async def _pull_while_open(c, ino: int, out: np.ndarray, seconds: float, close) -> None:
    """Rank 0 pulls ``ino`` while its round stays open ``seconds`` (it must still wait then);
    ``close()`` closes the round, and the pull must land within 2 s."""
    done = trio.Event()

    async def pull():
        await c.training.pull_into(ino, 0, out)
        done.set()

    async with trio.open_nursery() as n:
        n.start_soon(pull)
        await trio.sleep(seconds)
        assert not done.is_set()
        await close()
        with trio.fail_after(2):
            await done.wait()


async def test_a_pull_waiting_for_its_round_is_told_when_it_closes_not_polling(bed, monkeypatch):
    c, _, inos = bed
    out = np.empty(SIZE, np.float32)
    await c.training.push(inos[0], 0, np.full(SIZE, 1.0, np.float32))
    await c.training.push(inos[0], 1, np.full(SIZE, 3.0, np.float32))
    await c.training.pull_into(inos[0], 0, out)  # keys looked up, the first round read
    await c.training.push(inos[0], 0, np.full(SIZE, 1.0, np.float32))
    headers = Counted(monkeypatch, c.cluster.peers, "read_header")
    calls = c.io.clock_waits.calls
    # rank 1 computes for 0.6 s (below CLOCK_SLICE), then pushes
    await _pull_while_open(c, inos[0], out, 0.6, lambda: c.training.push(inos[0], 1, np.full(SIZE, 3.0, np.float32)))
    assert np.array_equal(out, np.full(SIZE, -4.0, np.float32))
    assert c.io.clock_waits.calls - calls >= 1
    # polling (backing off from 0.5 ms to 20 ms) read the header about 35 times in 0.6 s
    assert len(headers.calls) <= 4, f"{len(headers.calls)} header reads while the round was open"


async def test_the_pulls_of_a_step_waiting_together_share_their_calls(bed, monkeypatch):
    c, _, inos = bed
    outs = [np.empty(SIZE, np.float32) for _ in inos]
    await _push_all(c, inos, 0, 1.0)
    await _push_all(c, inos, 1, 3.0)
    async with trio.open_nursery() as n:
        for ino, out in zip(inos, outs):
            n.start_soon(c.training.pull_into, ino, 0, out)
    await _push_all(c, inos, 0, 1.0)
    calls = c.io.clock_waits.calls
    async with trio.open_nursery() as n:
        for ino, out in zip(inos, outs):
            n.start_soon(c.training.pull_into, ino, 0, out)
        await trio.sleep(0.3)
        await _push_all(c, inos, 1, 3.0, order=list(range(TENSORS)))  # as a step pushes (step_stream)
    assert all(np.array_equal(o, np.full(SIZE, -4.0, np.float32)) for o in outs)
    nodes = len(c.cluster.roles.members.names)
    assert 1 <= c.io.clock_waits.calls - calls <= 3 * nodes, "a call per node (and per wake-up), not per tensor"


async def test_more_waits_than_one_call_names_go_in_several(bed, monkeypatch):
    import irdmafs.client.clockwait as clockwait

    c, _, inos = bed
    monkeypatch.setattr(clockwait, "CLOCK_WAITS", 4)
    outs = [np.empty(SIZE, np.float32) for _ in inos]
    sizes = []
    real = c.io.clock_waits._call

    async def call(node, method, args, **kw):
        sizes.append(len(args["stripes"]))
        return await real(node, method, args, **kw)

    monkeypatch.setattr(c.io.clock_waits, "_call", call)
    await _push_all(c, inos, 0, 1.0)
    async with trio.open_nursery() as n:
        for ino, out in zip(inos, outs):
            n.start_soon(c.training.pull_into, ino, 0, out)
        await trio.sleep(0.3)
        await _push_all(c, inos, 1, 3.0)
    assert all(np.array_equal(o, np.full(SIZE, -2.0, np.float32)) for o in outs)
    assert sizes and max(sizes) <= 4


async def test_a_node_that_cannot_tell_is_polled_and_the_pull_still_lands(bed, monkeypatch):
    c, nodes, inos = bed
    for node in nodes:  # a node from before clock waits: the call is unknown there (ENOSYS)
        monkeypatch.delitem(node.calls, "clock_wait")
    out = np.empty(SIZE, np.float32)
    await c.training.push(inos[0], 0, np.full(SIZE, 1.0, np.float32))
    await _pull_while_open(c, inos[0], out, 0.3, lambda: c.training.push(inos[0], 1, np.full(SIZE, 3.0, np.float32)))
    assert np.array_equal(out, np.full(SIZE, -2.0, np.float32))
    assert c.io.clock_waits._untold, "the node that answered ENOSYS is polled for a while"


# -- the node's side ---------------------------------------------------------------------------


def _key(node, fid: int):
    stripe = node.store.get(fid, 0)
    return stripe.region.rkey, node.transport.incarnation, stripe.clock


async def _holder(nodes, fid):
    return next(n for n in nodes if n.store.get(fid, 0) is not None)


@pytest.mark.parametrize(
    "args",
    [
        {"stripes": "all", "timeout": 1},
        {"stripes": [[1, 2, 3]], "timeout": 1},
        {"stripes": [[1, 2, -3, False]], "timeout": 1},
        {"stripes": [[1, 2, 3, "yes"]], "timeout": 1},
        {"stripes": [[1.5, 2, 3, False]], "timeout": 1},
        {"stripes": [], "timeout": -1},
        {"stripes": [], "timeout": 60},
        {"stripes": [], "timeout": "soon"},
        {"stripes": []},
        {"stripes": [[1, 2, 3, False]] * 4097, "timeout": 1},  # more than CLOCK_WAITS
    ],
)
async def test_a_malformed_clock_wait_gets_einval(bed, args):
    _, nodes, _ = bed
    with pytest.raises(RemoteError) as err:
        await nodes[0].handle("clock_wait", args)
    assert err.value.code == "EINVAL"


async def test_the_node_answers_a_clock_wait_when_the_clock_moves_or_the_key_is_stale(bed):
    c, nodes, inos = bed
    node = await _holder(nodes, inos[0])
    rkey, inc, clock = _key(node, inos[0])
    # reached already, and a key to look at again (another incarnation, no such region): at once
    r = await node.handle("clock_wait", {"stripes": [[rkey, inc, clock + 1, False], [rkey, inc, clock, False]], "timeout": 5})
    assert r == {"reached": [1]}
    r = await node.handle("clock_wait", {"stripes": [[rkey, inc + 1, clock + 1, False], [rkey ^ 1, inc, clock + 1, False]], "timeout": 5})
    assert r == {"reached": [0, 1]}
    with trio.fail_after(2):  # none reached: nothing after the timeout
        assert await node.handle("clock_wait", {"stripes": [[rkey, inc, clock + 1, False]], "timeout": 0.05}) == {"reached": []}
    got = []

    async def wait():
        got.append(await node.handle("clock_wait", {"stripes": [[rkey, inc, clock + 1, False]], "timeout": 5}))

    async with trio.open_nursery() as n:
        n.start_soon(wait)
        await trio.sleep(0.1)
        assert not got
        with trio.fail_after(2):
            node.store.publish_clock(inos[0], 0, clock + 1)
    assert got == [{"reached": [0]}]


@pytest.mark.parametrize("wire", [True, False])
async def test_pushes_are_fused_in_smaller_batches_over_a_network(bed, monkeypatch, wire):
    """Over a network a batch's rounds are answered once all of it has arrived: smaller batches
    there (PUSH_BATCH), larger in shared memory (LOCAL_BATCH)."""
    import irdmafs.client.training as training

    c, _, inos = bed
    await _push_all(c, inos, 1, 1.0)
    monkeypatch.setattr(training, "PUSH_BATCH", 2 * SIZE * 4)  # two tensors' gradients
    monkeypatch.setattr(training, "LOCAL_BATCH", 6 * SIZE * 4)
    monkeypatch.setattr(c.cluster.peers, "over_wire", lambda node: wire)
    sent = Counted(monkeypatch, c.training, "_send_batch")
    await _push_all(c, inos, 0, 1.0)
    # what a batch puts in its staging slot: its descriptors (as _send_batch encodes them) and gradients
    sizes = [len(json.dumps([dict(e[0], at=0) for e in batch], separators=(",", ":"))) + sum(len(e[1]) for e in batch) for _, batch in sent.calls]
    limit = 2 * SIZE * 4 if wire else 6 * SIZE * 4
    assert max(sizes) <= limit, "a batch counts its descriptors too: it always fits its slot"
    assert max(sizes) > 2 * SIZE * 4 or wire, "in shared memory the larger batches were used"
