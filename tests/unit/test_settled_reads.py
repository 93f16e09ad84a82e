"""A settled read (StripeIO.read_settled) gives a tensor all of one version: never the stripes of
a step half applied, whatever the order its stripes move in. The stripes' clocks are set on the
nodes' stores directly here, so each case is the exact state it names."""

import numpy as np
import trio

from irdmafs.client.client import Client
from irdmafs.client import stripe as stripe_io
from irdmafs.client.stripe import Extent
from irdmafs.server.updates import StripeKey, StripeRange
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster

UNIT = 4096
N = 3 * UNIT // 4  # float32 elements: three stripes


def set_stripe(nodes, fid: int, idx: int, value: float, clock: int) -> None:
    """Every replica of stripe ``idx`` holds ``value`` everywhere and has applied ``clock``."""
    data = memoryview(np.full(UNIT // 4, value, np.float32)).cast("B")
    for node in nodes:
        if node.store.get(fid, idx) is not None:
            node.store.install(StripeKey(fid, idx), 0, data, UNIT, clock=clock)


async def tensor(nursery):
    cfg = config(unit=UNIT)
    nodes = await start_cluster(nursery, cfg)
    client = await nursery.start(_client, cfg)
    attr = await client.paths.write_file("/t", np.zeros(N, np.float32).tobytes())
    for idx in range(3):
        set_stripe(nodes, attr["ino"], idx, 1.0, clock=1)
    return nodes, client, attr


async def _client(cfg, task_status=trio.TASK_STATUS_IGNORED):
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        task_status.started(c)
        await trio.sleep_forever()


async def settled(client, attr, out, timeout=5.0):
    return await client.io.read_settled(Extent(attr["ino"], attr["size"], attr["unit"]), 0, memoryview(out).cast("B"), timeout=timeout)


async def test_a_step_half_applied_is_waited_out(nursery):
    nodes, client, attr = await tensor(nursery)
    fid = attr["ino"]
    set_stripe(nodes, fid, 0, 2.0, clock=2)  # step 2 landed on stripe 0 only, so far
    out = np.empty(N, np.float32)
    async with trio.open_nursery() as n:
        n.start_soon(settled, client, attr, out)
        await trio.sleep(stripe_io.SETTLE / 4)  # the read waits for stripes 1 and 2
        set_stripe(nodes, fid, 1, 2.0, clock=2)
        set_stripe(nodes, fid, 2, 2.0, clock=2)
    assert (out == 2.0).all()
    # a plain read at the half-applied moment is the mix the settled read never returns
    set_stripe(nodes, fid, 0, 3.0, clock=3)
    mixed = np.frombuffer(await client.read(fid, 0, attr["size"], attr), np.float32)
    assert (mixed[: N // 3] == 3.0).all() and (mixed[N // 3 :] == 2.0).all()


def install_pending(nodes, fid: int, idx: int, value: float) -> None:
    """Stripe ``idx``'s primary has installed a step (``value``) and not yet published its clock:
    it replicates it (server/training.py, ``_settle``)."""
    data = np.full(UNIT // 4, value, np.float32)
    for node in nodes:
        if node.store.get(fid, idx) is not None and node.cluster.roles.stripe_primary(fid, idx) == node.name:
            fill = lambda view: view.cast("B").__setitem__(slice(None), memoryview(data).cast("B"))  # noqa: E731
            node.store.update(StripeRange(StripeKey(fid, idx), 0, UNIT, UNIT), fill, pending=True)
            return
    raise AssertionError(f"no primary holds stripe {idx}")


def only_primaries(nodes, client, fid: int) -> None:
    """Every read goes to the primaries, which hold a step first: backups drop their copies."""
    for idx in range(3):
        for node in nodes:
            if node.store.get(fid, idx) is not None and node.cluster.roles.stripe_primary(fid, idx) != node.name:
                node.store.drop_keys([(fid, idx, 0)])
    client.io.forget(fid)


async def test_a_step_installed_but_not_yet_published_is_waited_out(nursery):
    """A primary installs a step, replicates it, then publishes its clock: in between its bytes
    are a step ahead of its clock, and equal clocks do not mean one version (two workers
    training a checkpoint in place: a reader got one stripe of the next step beside two of this
    one, in CI)."""
    nodes, client, attr = await tensor(nursery)
    fid = attr["ino"]
    only_primaries(nodes, client, fid)
    install_pending(nodes, fid, 0, 2.0)
    primary0 = next(n for n in nodes if n.store.get(fid, 0) is not None)
    assert primary0.store.get(fid, 0).pending and primary0.store.get(fid, 0).clock == 1
    out = np.empty(N, np.float32)
    async with trio.open_nursery() as n:
        n.start_soon(settled, client, attr, out)
        await trio.sleep(stripe_io.SETTLE / 4)  # the read waits: stripe 0 is pending
        for idx in (1, 2):
            set_stripe(nodes, fid, idx, 2.0, clock=2)
        primary0.store.publish_clock(fid, 0, 2)
    assert not primary0.store.get(fid, 0).pending
    assert (out == 2.0).all(), out
    # the plain read at the pending moment is the mix the settled read never returns
    install_pending(nodes, fid, 0, 3.0)
    mixed = np.frombuffer(await client.read(fid, 0, attr["size"], attr), np.float32)
    assert (mixed[: N // 3] == 3.0).all() and (mixed[N // 3 :] == 2.0).all()


async def test_a_push_that_leaves_the_clock_is_waited_for_until_published(nursery):
    """Under asp, ssp and r2sp most pushes apply without moving the clock: the stripe is pending
    at the clock it had, then published at that same clock. A settled read waits for the flag
    to clear, not for a next clock that does not come (it waited out SETTLE at every turn and,
    while pushes kept coming, answered EAGAIN)."""
    nodes, client, attr = await tensor(nursery)
    fid = attr["ino"]
    only_primaries(nodes, client, fid)
    primary0 = next(n for n in nodes if n.store.get(fid, 0) is not None and n.cluster.roles.stripe_primary(fid, 0) == n.name)
    stop = trio.Event()

    async def pushes():
        """asp pushes on stripe 0, back to back: pending, then published at clock 1, again."""
        value = 1.0
        while not stop.is_set():
            value += 1.0
            install_pending(nodes, fid, 0, value)
            await trio.sleep(stripe_io.SETTLE / 8)
            primary0.store.publish_clock(fid, 0, 1)
            await trio.sleep(stripe_io.SETTLE / 8)

    out = np.empty(N, np.float32)
    async with trio.open_nursery() as n:
        n.start_soon(pushes)
        await trio.sleep(0.01)
        await settled(client, attr, out, timeout=2 * stripe_io.SETTLE)
        stop.set()
    assert (out[N // 3 :] == 1.0).all() and out[0] >= 2.0 and (out[: N // 3] == out[0]).all()


async def test_stripes_at_rest_with_different_clocks_are_read_as_they_are(nursery):
    """Stripes trained apart (a file grown after training): nothing in flight, no wait for ever."""
    nodes, client, attr = await tensor(nursery)
    set_stripe(nodes, attr["ino"], 2, 5.0, clock=0)
    out = np.empty(N, np.float32)
    with trio.fail_after(4 * stripe_io.SETTLE + 2):
        await settled(client, attr, out)
    assert (out[: 2 * N // 3] == 1.0).all() and (out[2 * N // 3 :] == 5.0).all()


async def test_stripes_that_never_agree_answer_eagain(nursery):
    nodes, client, attr = await tensor(nursery)
    fid = attr["ino"]

    async def churn():
        """The stripes leapfrog: whichever a read waits for has jumped past the others."""
        for k in range(1, 10_000):
            set_stripe(nodes, fid, 0, float(2 * k + 1), clock=2 * k + 1)
            await trio.sleep(stripe_io.SETTLE / 4)
            for idx in (1, 2):
                set_stripe(nodes, fid, idx, float(2 * k + 2), clock=2 * k + 2)
            await trio.sleep(stripe_io.SETTLE / 4)

    out = np.empty(N, np.float32)
    async with trio.open_nursery() as n:
        n.start_soon(churn)
        try:
            await settled(client, attr, out, timeout=2 * stripe_io.SETTLE)
            raise AssertionError("a read that never settled returned")
        except Exception as exc:  # RemoteError EAGAIN
            assert getattr(exc, "code", None) == "EAGAIN", exc
        n.cancel_scope.cancel()
