"""Pushes with ids (issue 20, item 4): a push is (tensor, rank, step) with the step from the
client's own count, never renumbered from a server's; a duplicate is answered as one; a step
ahead of the server, and a step someone else pushed, are loud errors; an open push is sent again
once per id. Over an in-process cluster."""

import base64
import numpy as np
import pytest
import trio
import trio.testing

from irdmafs.client.client import Client
from irdmafs.errors import RemoteError
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster


@pytest.fixture
async def bed(nursery):
    cfg = config(unit=64 << 10)
    nodes = await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        d = await c.paths.resolve("/m")
        await c.setxattr(d["ino"], "user.irdma.sync", "asp")
        await c.setxattr(d["ino"], "user.irdma.workers", "1")
        await c.setxattr(d["ino"], "user.irdma.optimizer", "sgd lr=1")
        yield c, nodes, cfg


def records(nodes, ino):
    return [(n.name, idx, st) for n in nodes for (f, idx), st in n.records.by_stripe.items() if f == ino]


async def bsp_of_two(c, nodes, path: str):
    """A tensor of 1,000 zeros under bsp with two ranks: (its values, inode, the node primary of
    its stripe, the stripe's backups)."""
    d = (await c.paths.resolve("/m"))["ino"]
    await c.setxattr(d, "user.irdma.sync", "bsp")
    await c.setxattr(d, "user.irdma.workers", "2")
    w = np.zeros(1000, np.float32)
    ino = (await c.paths.save(path, w))["ino"]
    primary = next(n for n in nodes if n.name == c.cluster.roles.stripe_primary(ino, 0))
    backups = [n for n in nodes if n.name in c.cluster.roles.targets(ino, 0) and n.name != primary.name]
    assert backups, "a stripe of R=2 has a backup"
    return w, ino, primary, backups


async def test_a_server_count_set_back_is_a_loud_error_not_a_renumbering(bed):
    """A stale record restored on the primary sets rank 0's count back from 3 to 1: the client
    pushes step 3 anyway and is told EINVAL (out of order); it never sends the gradient as step 1,
    which would take the place of the push the server lost without anyone noticing."""
    c, nodes, _ = bed
    w = np.zeros(1000, np.float32)
    ino = (await c.paths.save("/m/w.npy", w))["ino"]
    for _ in range(3):
        await c.training.push(ino, 0, np.ones_like(w))
    for _, _, st in records(nodes, ino):
        st.pushed[0] = 1  # what a resync that kept an old record leaves
    c.training._train[(ino, 0)]["fetched"] = -float("inf")  # a refresh of the server's count is due
    with pytest.raises(RemoteError) as err:
        await c.training.push(ino, 0, np.full_like(w, 5.0))
    assert err.value.code == "EINVAL" and "out of order" in err.value.message
    assert np.array_equal(await c.paths.load("/m/w.npy"), w - 3)  # the 5s were applied nowhere
    assert c.training.next_step(ino, 0, await c.training.train_info(ino, 0)) == 3


async def test_a_step_someone_else_pushed_is_an_error_not_a_silent_drop(bed):
    """Two clients push as rank 0: the second one's first push carries a step the first one
    already pushed. The server answers it as a duplicate; the client says EINVAL rather than
    dropping its gradient."""
    c, _, cfg = bed
    w = np.zeros(100, np.float32)
    ino = (await c.paths.save("/m/v.npy", w))["ino"]
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as other:
        await other.training.train_info(ino, 0)  # it learns rank 0's count (0) now
        await c.training.push(ino, 0, np.ones_like(w))  # step 0, from the first client
        with pytest.raises(RemoteError) as err:
            await other.training.push(ino, 0, np.full_like(w, 7.0))  # its own count says step 0
        assert err.value.code == "EINVAL" and "taken before this client sent it" in err.value.message
    assert np.array_equal(await c.paths.load("/m/v.npy"), w - 1)


async def test_a_retried_push_is_taken_once(bed):
    """The same piece sent twice (a retry after a lost answer) is applied once."""
    c, _, _ = bed
    w = np.zeros(10, np.float32)
    ino = (await c.paths.save("/m/r.npy", w))["ino"]
    sent = []
    real = c.training._fused

    async def twice(node, desc, payload, *more):
        sent.append(desc["step"])
        r = await real(node, desc, payload, *more)
        if len(sent) == 1:  # the answer is lost: the client retries the same piece
            from irdmafs.errors import NodeDown

            raise NodeDown(node, "answer lost (test)")
        return r

    c.training._fused = twice
    await c.training.push(ino, 0, np.ones_like(w))
    assert sent == [0, 0]
    assert np.array_equal(await c.paths.load("/m/r.npy"), w - 1)
    await c.training.push(ino, 0, np.ones_like(w))
    assert np.array_equal(await c.paths.load("/m/r.npy"), w - 2)


async def test_a_tensor_written_anew_restarts_at_the_servers_count(bed):
    """Rewriting a tensor (a new version, its counts reset on the nodes) restarts the client's
    count at the server's, so training goes on after a publish."""
    c, _, _ = bed
    w = np.zeros(10, np.float32)
    ino = (await c.paths.save("/m/p.npy", w))["ino"]
    await c.training.push(ino, 0, np.ones_like(w))
    await c.training.push(ino, 0, np.ones_like(w))
    ino2 = (await c.paths.save("/m/p.npy", w))["ino"]  # the same shape: the nodes keep their counts
    c.training.forget_training(ino2)
    info = await c.training.train_info(ino2, 0)
    assert info["attr"]["version"] != c.training._steps[(ino, 0)][0]
    assert await c.training.push(ino2, 0, np.ones_like(w)) == info["pushed"]
    assert np.array_equal(await c.paths.load("/m/p.npy"), w - 1)


async def test_an_open_push_is_sent_again_once_per_id(bed):
    """Two checks of the same stalled stripe at once (pulls of two tensors sharing it, a timer
    and a pull) send the kept piece once."""
    c, _, _ = bed
    t = c.training
    payload = memoryview(bytes(40))
    t._open[(99, 0, 1)] = [{"fid": 99, "idx": 0, "step": 4, "rank": 1}, payload, None]
    sends = []

    async def call(node, method, args, **_):
        await trio.sleep(0.05)  # the primary answers after a while: both checks are under way
        return {"next": 4}

    async def push_piece(desc, payload, replies, *, resent=False, order=None):
        sends.append((desc["step"], resent))
        return {}

    t.cluster.call = call
    t._push_piece = push_piece
    async with trio.open_nursery() as n:
        n.start_soon(t._repush_open, 99, 0)
        n.start_soon(t._repush_open, 99, 0)
    assert sends == [(4, True)]


async def test_a_pull_sees_a_round_closed_only_once_every_backup_holds_it(bed):
    """The primary publishes a step's clock (what pulls wait for) only after its backups hold
    the step: while a backup's apply is held, the primary's clock stays at the round before,
    so no pull can take the round for closed (and its pushers forget their pieces) while the
    primary alone holds it. Without this, a primary killed then took the round with it (CI's
    soak: "push 13 is out of order")."""
    c, nodes, _ = bed
    w, ino, primary, backups = await bsp_of_two(c, nodes, "/m/b.npy")
    release, held = trio.Event(), trio.Event()
    real_apply = {b.name: b.calls["apply"] for b in backups}

    def holding(name):
        async def apply(**kw):
            held.set()
            await release.wait()
            return await real_apply[name](**kw)

        return apply

    for b in backups:
        b.calls["apply"] = holding(b.name)
    saved = primary.store.get(ino, 0).version
    async with trio.open_nursery() as n:
        n.start_soon(c.training.push, ino, 0, np.ones_like(w))
        n.start_soon(c.training.push, ino, 1, np.ones_like(w))  # the second push closes round 0
        with trio.fail_after(5):
            await held.wait()
        await trio.sleep(0.1)  # the primary has applied the step here and waits on its backups
        assert primary.store.get(ino, 0).version > saved  # the parameters hold the step here...
        assert primary.store.get(ino, 0).clock == 0  # ...but no pull may see the round closed yet
        release.set()
    # a push that closes a round is answered once taken, its round settled after: wait for it
    await c.training.wait_applied(ino, 0)
    assert primary.store.get(ino, 0).clock == 1
    assert all(b.store.get(ino, 0).clock == 1 for b in backups)
    assert np.array_equal(await c.paths.load("/m/b.npy"), w - 1)  # the mean of the round, lr=1


def hold_applies(backups) -> tuple[trio.Event, trio.Event]:
    """The ``apply`` calls of ``backups`` wait for the first event; the second is set when one
    came."""
    release, came = trio.Event(), trio.Event()
    for b in backups:

        async def apply(_real=b.calls["apply"], **kw):
            came.set()
            await release.wait()
            return await _real(**kw)

        b.calls["apply"] = apply
    return release, came


async def test_the_push_closing_a_round_is_answered_once_every_replica_holds_it(bed, nursery):
    """A push that closes a bsp round (not ``early``: through a rank's file) is answered once
    the backups hold the round, so that once every rank's push returned, a plain read of the
    model, which may go to a backup, sees the whole round (a checkpoint copied after training's
    last step had stripes one round behind the others: the kill -9 training test, under load)."""
    c, nodes, _ = bed
    w, ino, primary, backups = await bsp_of_two(c, nodes, "/m/s.npy")
    await c.training.push(ino, 0, np.ones_like(w))  # opens the round: answered at once
    release, came = hold_applies(backups)
    answered = trio.Event()

    async def close_round() -> None:
        await c.training.push(ino, 1, np.full_like(w, 3.0))
        answered.set()

    nursery.start_soon(close_round)
    await came.wait()  # the primary applied the round and sends it to a backup
    await trio.testing.wait_all_tasks_blocked()
    assert not answered.is_set(), "answered before the backups held the round"
    release.set()
    await answered.wait()
    for node in (primary, *backups):  # no pull: the answer alone says every replica holds it
        held = np.frombuffer(node.store.get(ino, 0).data, np.float32, w.size, offset=128)
        assert np.array_equal(held, w - 2.0), node.name  # the mean of 1 and 3, lr=1


async def test_the_push_closing_a_round_is_answered_before_the_backups_hold_it_and_kept_when_a_pull_follows(bed):
    """With ``early`` (a step through the door, whose pull follows at once), the push that
    closes a bsp round of two ranks is answered once the round is applied on the primary, while
    its copy to the backups is still on its way (it waited for that copy, holding its staging
    slot, and the rank that closed each round fell behind the others: issue 42); its answer
    names the clock readers see, so its pusher keeps it, as the first pusher does, until a pull
    sees the round closed, and could send it again to a new primary."""
    c, nodes, _ = bed
    w, ino, primary, backups = await bsp_of_two(c, nodes, "/m/k.npy")
    release, _ = hold_applies(backups)
    with trio.fail_after(10):  # both answered while every backup's apply is held
        await c.training.push(ino, 0, np.ones_like(w), early=True)
        await c.training.push(ino, 1, np.ones_like(w), early=True)
    assert primary.store.get(ino, 0).clock == 0  # not readable as closed yet
    assert {(ino, 0, 0), (ino, 0, 1)} <= set(c.training._open)  # both pushers keep theirs
    release.set()
    out = np.empty_like(w)
    await c.training.pull_into(ino, 1, out)
    assert np.array_equal(out, w - 1)
    assert (ino, 0, 1) not in c.training._open  # seen closed: forgotten


async def test_the_push_closing_a_round_that_cannot_be_applied_is_answered_enospc(bed):
    """The early answer waits for the round's install here: a round that does not fit (NoSpace
    from the store) is the closing pusher's error, never an OK for a round that was not applied
    (a later settle would publish its clock over unchanged parameters)."""
    from irdmafs.server.budget import NoSpace

    c, nodes, _ = bed
    w, ino, primary, _ = await bsp_of_two(c, nodes, "/m/n.npy")
    real = primary.store.update

    def full(where, *args, **kw):
        if where.key.fid == ino:
            raise NoSpace("no room for the round (test)")
        return real(where, *args, **kw)

    primary.store.update = full
    await c.training.push(ino, 0, np.ones_like(w), early=True)  # opens the round: nothing applied yet
    with pytest.raises(RemoteError) as err:
        await c.training.push(ino, 1, np.ones_like(w), early=True)
    assert err.value.code == "ENOSPC"
    assert primary.store.get(ino, 0).clock == 0


async def test_a_push_answered_eagain_is_on_every_replica_before_its_retry_is_answered(bed):
    """A backup refuses the step of a push once (ESTALE: it counts the primary down), so the
    primary, which applied it, answers EAGAIN and leaves the step's clock unpublished; the
    client sends the push again, and the primary, finding it taken, sends the step to the
    backups again and publishes it before it answers "duplicate". Answered at once, as it was,
    the retry acknowledged a step only the primary held."""
    c, nodes, _ = bed
    w = np.zeros(1000, np.float32)
    ino = (await c.paths.save("/m/e.npy", w))["ino"]
    primary_name = c.cluster.roles.stripe_primary(ino, 0)
    primary = next(n for n in nodes if n.name == primary_name)
    backups = [n for n in nodes if n.name in c.cluster.roles.targets(ino, 0) and n.name != primary_name]
    refused = []
    for b in backups:
        real = b.calls["apply"]

        def refusing_once(real=real):
            async def apply(**kw):
                if not refused and kw.get("record") is not None:
                    refused.append(kw["where"])
                    raise RemoteError("ESTALE", "counted down here (test)")
                return await real(**kw)

            return apply

        b.calls["apply"] = refusing_once()
    with trio.fail_after(20):
        await c.training.push(ino, 0, np.ones_like(w))
    assert refused, "a backup refused the step once"
    p = primary.store.get(ino, 0)
    assert p.clock == 1
    for b in backups:  # the step, its clock and its bookkeeping on every replica
        s = b.store.get(ino, 0)
        assert s.clock == 1 and bytes(s.data[: w.nbytes]) == bytes(p.data[: w.nbytes]), b.name
        assert b.records.by_stripe[(ino, 0)].next_step(0) == 1
    assert np.array_equal(await c.paths.load("/m/e.npy"), w - 1)


async def test_a_recheck_whose_step_is_not_replicated_does_not_end_the_node(bed):
    """``recheck`` (the set of active ranks changed) runs in the node's own nursery: a step it
    completes that does not reach every replica (EAGAIN) is logged and left for the next push,
    not raised there, where it ended the node."""
    c, nodes, _ = bed
    w = np.zeros(100, np.float32)
    ino = (await c.paths.save("/m/k.npy", w))["ino"]
    await c.training.push(ino, 0, np.ones_like(w))
    primary = next(n for n in nodes if n.name == c.cluster.roles.stripe_primary(ino, 0))

    async def not_replicated(*args):
        raise RemoteError("EAGAIN", "not on every replica (test)")

    primary.training._settle = not_replicated
    await primary.training.recheck()  # returns: nothing raised into the node's nursery
    assert primary.state == "ready"



async def test_a_push_whose_staging_region_was_replaced_meanwhile_is_sent_again(bed):
    """Another call of this client was given up and its staging region on the node replaced
    (irdmafs/runtime/slots.py) while a push held the old one. Over verbs and shm a push's data goes
    one-sidedly and its notification (transport/base.py, ``serve_imm_call``) then finds the
    region gone: EINVAL "unknown rkey". The client sends it again in a new region, applied
    once; it reached the pusher as EINVAL."""
    c, nodes, _ = bed
    w = np.zeros(1000, np.float32)
    ino = (await c.paths.save("/m/w.npy", w))["ino"]
    await c.training.push(ino, 0, np.ones_like(w))
    primary = c.cluster.roles.stripe_primary(ino, 0)
    node = next(n for n in nodes if n.name == primary)
    write_imm, refused = c.cluster.write_imm, []

    async def region_replaced_first(name, rkey, offset, data, imm, inc=None):
        if not refused:
            refused.append(rkey)
            await node.rpc_staging(owner=c.owner, size=4096, replace=True)
            raise RemoteError("EINVAL", f"unknown rkey {rkey}")  # as serve_imm_call answers
        return await write_imm(name, rkey, offset, data, imm, inc)

    c.cluster.write_imm = region_replaced_first
    await c.training.push(ino, 0, np.ones_like(w))
    assert refused and np.array_equal(await c.paths.load("/m/w.npy"), w - 2)


async def test_a_node_not_yet_caught_up_answers_train_info_eagain_not_enoent(bed):
    """A node a view has just named, its namespace not yet handed over, must not answer
    ``train_info`` from its old namespace: it lacked a tensor made while it was away, and the
    pusher got ENOENT "no inode" (chaos --views seeds 7 and 11). It answers EAGAIN, which the
    client waits out, as for every other call a node takes before it has caught up."""
    c, nodes, cfg = bed
    w = np.zeros(100, np.float32)
    ino = (await c.paths.save("/m/w.npy", w))["ino"]
    node = next(n for n in nodes if n.name == c.cluster.roles.stripe_primary(ino, 0))
    node.serving.taken_over = trio.Event()  # rejoining: the hand-over not done
    node.namespace.meta.inodes.pop(ino)  # its namespace from before the tensor was made
    cfg.op_timeout = 0.2
    with pytest.raises(RemoteError) as err:
        await node.calls["train_info"](fid=ino, rank=0, epoch=node.cluster.roles.view_epoch)
    assert err.value.code == "EAGAIN"


async def test_a_rank_taken_back_by_another_client_pushes_again_once_its_info_is_due(bed):
    """A push takes cached tensor info at any age (the primary's reply refreshes it), but a
    rank the cache says is not active asks the primary again before refusing: a rank removed
    and taken back through another mount pushes again (within TRAIN_INFO_TTL, as a policy
    change is seen), instead of being refused by its own stale cache for good."""
    c, _, cfg = bed
    w = np.zeros(10, np.float32)
    ino = (await c.paths.save("/m/k.npy", w))["ino"]
    d = (await c.paths.resolve("/m"))["ino"]
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as other:
        await other.setxattr(d, "user.irdma.workers", "2")
        await trio.sleep(1.1)  # the TTL: the change is seen
        await c.training.push(ino, 1, np.ones_like(w))
        await other.setxattr(d, "user.irdma.removed", "1")
        with pytest.raises(RemoteError) as err:  # refused by the primary, whose reply says so
            await c.training.push(ino, 1, np.ones_like(w))
        assert err.value.code == "EINVAL"
        await other.setxattr(d, "user.irdma.removed", "")
        await trio.sleep(1.1)
        await c.training.push(ino, 1, np.ones_like(w))  # taken back: pushes again
    assert np.array_equal(await c.paths.load("/m/k.npy"), w - 1)  # two pushes taken, each 1/workers of its gradient


async def test_a_record_of_other_bytes_is_not_taken_with_these(bed):
    """A resync or a hand-over takes a peer's push bookkeeping only with the bytes it describes.
    A primary cut off while it applied a push held a record counting it (its replication failed:
    the push was not acknowledged) over bytes nobody else holds; the new primary took that record
    with its own bytes, which lack the push, answered the client's retry as a duplicate, and the
    gradient was lost (fault simulator, mixed seed 1988)."""
    from irdmafs.server.rounds import StripeTraining

    c, nodes, _ = bed
    w = np.zeros(100, np.float32)
    ino = (await c.paths.save("/m/r.npy", w))["ino"]
    for _ in range(2):
        await c.training.push(ino, 0, np.ones_like(w))
    b = next(n for n in nodes if n.name in c.cluster.roles.targets(ino, 0) and n.name != c.cluster.roles.stripe_primary(ino, 0))
    fid, idx, rec, stamp = next(r for r in b.records.wire_records()[0] if r[:2] == [ino, 0])
    assert tuple(stamp) == b.store.get(ino, 0).stamp and b.records.by_stripe[(ino, 0)].next_step(0) == 2
    ahead = StripeTraining.from_record(rec)
    ahead.pushed[0] += 1  # a third push taken where the bytes moved on to another version
    other = [stamp[0], stamp[1] + 1]
    await b.records.take_records([[ino, 0, ahead.record(), other]])
    assert b.records.by_stripe[(ino, 0)].next_step(0) == 2  # not taken: not these bytes
    await b.records.take_records([[ino, 0, ahead.record(), None]])  # a peer holding no bytes
    assert b.records.by_stripe[(ino, 0)].next_step(0) == 2
    await b.records.take_records([[ino, 0, ahead.record(), stamp]])  # these bytes, further along
    assert b.records.by_stripe[(ino, 0)].next_step(0) == 3
    b.records.by_stripe[(ino, 0)].pushed[0] = 2  # (as it was, for the push below)
    await c.training.push(ino, 0, np.ones_like(w))
    assert np.array_equal(await c.paths.load("/m/r.npy"), w - 3)


async def open_rounds(c):
    """A tensor of 4 MiB (64 stripes of 64 KiB) of a bsp model of 2 workers that rank 0 alone
    pushed to: every stripe's round stays open, holding its sum."""
    d = await c.paths.resolve("/m")
    await c.setxattr(d["ino"], "user.irdma.sync", "bsp")
    await c.setxattr(d["ino"], "user.irdma.workers", "2")
    w = np.zeros((4 << 20) // 4, np.float32)
    ino = (await c.paths.save("/m/big.npy", w))["ino"]
    await c.training.push(ino, 0, np.ones_like(w))
    return ino, w


async def test_push_bookkeeping_travels_in_pages_that_fit_a_control_frame(bed, monkeypatch):
    """A model of GBs in the middle of a bsp round holds its gradients' sums in its records:
    hundreds of MB, which one ``train_records`` answer neither fits (16 MiB a control frame) nor
    encodes without holding the loop (chaos.py --model-gib 1). Pages of ``RECORDS_PAGE`` bytes
    of arrays, in key order, cover every record once; a malformed ``after`` is EINVAL."""
    from irdmafs.server import records as T
    from irdmafs.errors import RemoteError

    c, nodes, _ = bed
    ino, w = await open_rounds(c)
    node = max(nodes, key=lambda n: sum(st.payload_bytes for st in n.records.by_stripe.values()))
    held = {k for k, st in node.records.by_stripe.items() if st.payload_bytes}
    assert len(held) > 4
    monkeypatch.setattr(T, "RECORDS_PAGE", 3 * (64 << 10))
    seen, pages, after = [], 0, None
    while True:
        page = await node.records.rpc_train_records(after=after)
        pages += 1
        assert sum(T.StripeTraining.from_record(r[2]).payload_bytes for r in page["records"]) <= 3 * (64 << 10)
        seen += [tuple(r[:2]) for r in page["records"]]
        after = page["next"]
        if not after:
            break
    assert pages > 1 and len(seen) == len(set(seen)) and held <= set(seen)
    with pytest.raises(RemoteError) as exc:
        await node.records.rpc_train_records(after="3:4")
    assert exc.value.code == "EINVAL"


async def test_a_handover_of_large_records_is_its_instant_fetched_in_pages(bed, monkeypatch):
    """A hand-over's records are its answer's instant, however large their arrays (a GB model
    mid-round: hundreds of MB, which encoded into the answer held the loop for seconds and could
    not fit a control frame, so a node never rejoined; chaos --model-gib 1). Arrays beyond a
    page stay in a cut on the peer, frozen: a push after the answer into a round of the cut
    works on a copy, and the joiner fetches exactly what the answer saw, page by page; a
    released cut is ESTALE (server/cuts.py)."""
    from irdmafs.server import membership as M
    from irdmafs.server import records as T
    from irdmafs.errors import RemoteError

    c, nodes, _ = bed
    ino, w = await open_rounds(c)
    page = 3 * (64 << 10)
    monkeypatch.setattr(M, "RECORDS_PAGE", page)
    peer = max(nodes, key=lambda n: sum(st.payload_bytes for st in n.records.by_stripe.values()))
    joiner = next(n for n in nodes if n is not peer)
    answer = await peer.membership.rpc_handover(name=joiner.name, epoch=peer.cluster.roles.view_epoch)
    assert "cut" in answer and "arrays" not in answer
    assert sum(answer["cut"]["sizes"]) > page
    await c.training.push(ino, 1, np.full_like(w, 3))  # rank 1: the rounds complete and apply
    assert not any(st.rounds for st in peer.records.by_stripe.values())
    cut = answer["cut"]["id"]
    pages, at = 0, [0, 0]
    while at is not None:
        got = await peer.membership.rpc_handover_arrays(cut=cut, at=at)
        assert sum(len(base64.b64decode(p[2])) for p in got["pieces"]) <= page
        pages, at = pages + 1, got["next"]
    assert pages > 1
    arrays = await joiner.membership._arrays_of(peer.name, answer)  # through the transport, released after
    for _, _, rec, _ in answer["records"]:
        st = T.StripeTraining.from_record(rec, arrays)
        assert st.rounds and all(np.array_equal(total, np.ones_like(total)) for total, _ in st.rounds.values())
    with pytest.raises(RemoteError) as exc:
        await peer.membership.rpc_handover_arrays(cut=cut, at=[0, 0])
    assert exc.value.code == "ESTALE"
    assert np.allclose(await c.training.pull_into(ino, 0, np.empty_like(w)), -2.0)  # (1 + 3) / 2, lr 1
