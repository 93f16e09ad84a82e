"""Push and pull through the Client over an in-process cluster: policies, optimizer, bad input."""

import numpy as np
import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.policy import Asp, Bsp, R2sp, Ssp, parse_policy
from irdmafs.errors import PolicyError, RemoteError
from irdmafs.server.rounds import Model, StripeTraining
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster


def test_policy_forms():
    assert parse_policy("ssp:3") == Ssp(3) and parse_policy("bsp").kind == "bsp"
    for bad in ("", "ssp", "ssp:-1", "bsp2", "sync"):
        with pytest.raises(PolicyError, match="accepted"):
            parse_policy(bad)


def test_bsp_round_is_averaged_once_complete():
    m = Model(Bsp(), 2)
    st = StripeTraining()
    assert st.accept(m, 0, 0, np.array([1.0, 2.0])) == []
    assert st.clock(m) == 0
    [avg] = st.accept(m, 1, 0, np.array([3.0, 4.0]))
    assert np.array_equal(avg.value(), [2.0, 3.0]) and avg.count == 2 and st.clock(m) == 1


def test_r2sp_turns_are_round_robin():
    m = Model(R2sp(), 3)
    st = StripeTraining()
    assert st.admitted(m, 0, 0) and not st.admitted(m, 1, 0)
    st.accept(m, 0, 0, np.zeros(1))
    assert st.admitted(m, 1, 0) and not st.admitted(m, 0, 1) and not st.admitted(m, 2, 0)
    st.accept(m, 1, 0, np.zeros(1))
    st.accept(m, 2, 0, np.zeros(1))
    assert st.admitted(m, 0, 1)


def test_r2sp_holds_an_early_push_until_its_turn():
    m = Model(R2sp(), 3)
    st = StripeTraining()
    assert st.take(m, 1, 0, np.array([3.0])) == []  # rank 0 has not pushed step 0: held
    assert st.next_step(1) == 1 and st.pushed.get(1, 0) == 0
    assert st.take(m, 2, 0, np.array([6.0])) == []
    # rank 0's push lets 1's and then 2's through, in turn order, each scaled by 1/W
    assert [u.value().tolist() for u in st.take(m, 0, 0, np.array([9.0]))] == [[3.0], [1.0], [2.0]]
    assert st.pushed == {0: 1, 1: 1, 2: 1} and st.clock(m) == 1
    # a removed rank no longer holds the others up
    assert st.take(m, 1, 1, np.array([3.0])) == []
    assert [u.value().tolist() for u in st.release(Model(R2sp(), 3, frozenset({0})))] == [[1.5]]


def test_r2sp_pulls_wait_for_the_previous_round_only():

    assert R2sp().required_clock(0) == 0 and R2sp().required_clock(5) == 4
    assert Bsp().required_clock(5) == 5 and Ssp(2).required_clock(5) == 3


def test_r2sp_slots_are_evenly_gapped_over_the_measured_period():
    m = Model(R2sp(), 4)
    st = StripeTraining()
    assert st.slot_in(m, 1, 0.0) == 0.0  # nothing measured yet: no wait
    # every rank steps once a second; rank 3 waited 0.5 s for a slot, which is not its step time
    for r in range(4):
        st.arrive(r, 0, 10.0)
        st.arrive(r, 1, 11.0 + (0.5 if r == 3 else 0.0), paced=0.5 if r == 3 else 0.0)
    assert st.period(m) == pytest.approx(1.0)
    # position 0 pushed step 1 at t=11; rank i's step 1 slot is 11 + i/4, its step 2 slot 12 + i/4
    for r in range(4):
        st.pushed[r] = 1
    st.pushed[0] = 2
    assert st.slot_in(m, 2, 11.0) == pytest.approx(0.5)
    assert st.slot_in(m, 0, 11.0) == pytest.approx(1.0)
    assert st.slot_in(m, 3, 11.5) == pytest.approx(0.25)
    assert st.slot_in(m, 1, 20.0) == 0.0  # a late rank pushes at once
    assert st.slot_in(Model(Asp(), 4), 2, 11.0) == 0.0  # other policies never wait


@pytest.fixture
async def trained(nursery):
    cfg = config(unit=64 << 10)
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        yield c


async def set_policy(c, **xattrs):
    d = await c.paths.resolve("/m")
    for k, v in xattrs.items():
        await c.setxattr(d["ino"], f"user.irdma.{k}", v)


async def test_bsp_two_workers_sgd_matches_numpy(trained):
    c = trained
    await set_policy(c, sync="bsp", workers="2", optimizer="sgd lr=0.5")
    w0 = np.linspace(-1, 1, 50_000).astype(np.float32)  # several stripes
    attr = await c.paths.save("/m/w.npy", w0)
    g0, g1 = np.full_like(w0, 1.0), np.full_like(w0, 3.0)
    out = np.empty_like(w0)
    await c.training.push(attr["ino"], 0, g0)
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(0.3):  # bsp: rank 0's pull waits for rank 1's push
            await c.training.pull_into(attr["ino"], 0, out)
    await c.training.push(attr["ino"], 1, g1)
    await c.training.pull_into(attr["ino"], 0, out)
    assert np.allclose(out, w0 - 0.5 * (g0 + g1) / 2)
    assert np.array_equal(await c.paths.load("/m/w.npy"), out)


async def test_asp_applies_each_push_and_adam_state_survives(trained):
    c = trained
    await set_policy(c, sync="asp", workers="2", optimizer="adam lr=0.1")
    w0 = np.ones(1000, np.float32)
    attr = await c.paths.save("/m/a.npy", w0)
    out = np.empty_like(w0)
    await c.training.push(attr["ino"], 0, np.ones_like(w0))
    await c.training.pull_into(attr["ino"], 0, out)  # asp: no waiting
    assert np.allclose(out, 1 - 0.1)  # adam's first step moves by lr whatever the scale
    await c.training.push(attr["ino"], 0, np.ones_like(w0))
    await c.training.pull_into(attr["ino"], 0, out)
    assert np.allclose(out, 1 - 0.2, atol=1e-5)  # second step with state carried over


async def test_bad_pushes_and_pulls_change_nothing(trained):
    c = trained
    await set_policy(c, sync="bsp", workers="2")
    w0 = np.zeros((10, 10), np.float32)
    attr = await c.paths.save("/m/b.npy", w0)
    cases = [
        (c.training.push(attr["ino"], 0, np.zeros((10, 9), np.float32)), "EINVAL"),  # shape
        (c.training.push(attr["ino"], 0, np.zeros((10, 10), np.float64)), "EINVAL"),  # dtype
        (c.training.push(attr["ino"], 5, np.zeros((10, 10), np.float32)), "EINVAL"),  # rank beyond workers
        (c.training.pull_into(attr["ino"], 2, np.empty_like(w0)), "EINVAL"),
    ]
    for coro, code in cases:
        with pytest.raises(RemoteError) as err:
            await coro
        assert err.value.code == code
    with pytest.raises(RemoteError) as err:  # a bad policy is refused when set, not at the push
        await set_policy(c, sync="lockstep")
    assert err.value.code == "EINVAL" and "accepted" in err.value.message
    c.training.forget_training()
    assert np.array_equal(await c.paths.load("/m/b.npy"), w0)


def test_compress_forms_and_sparsifier_keeps_what_it_does_not_send():
    from irdmafs.client import compress

    assert compress.parse("fp16,chunks=0.25,chunk=4") == compress.Mode(True, 0.25, 4)
    for bad in ("zip", "chunks=0", "chunks=2", "chunk=x"):
        with pytest.raises(compress.CompressError, match="accepted"):
            compress.parse(bad)
    sp = compress.Sparsifier(16, np.float32)
    g = np.arange(16, dtype=np.float32)
    chosen, full = sp.select(g, compress.Mode(False, 0.25, 4))
    assert list(chosen) == [3]  # the chunk with the largest L1 norm
    assert np.array_equal(sp.residual[:12], g[:12]) and not sp.residual[12:].any()
    chosen, full = sp.select(np.zeros(16, np.float32), compress.Mode(False, 0.25, 4))
    assert list(chosen) == [2] and np.array_equal(full[:12], g[:12])  # the residual is sent later


@pytest.mark.parametrize("mode", ["fp16", "chunks=0.5,chunk=1000", "fp16,chunks=0.5,chunk=1000"])
async def test_compressed_pushes(trained, mode):
    c = trained
    await set_policy(c, sync="bsp", workers="1", optimizer="sgd lr=1", compress=mode)
    w0 = np.zeros(40_000, np.float32)  # spans stripes of 64 KiB
    attr = await c.paths.save("/m/c.npy", w0)
    g = np.linspace(-1, 1, 40_000).astype(np.float32)
    before = c.io.bytes_pushed
    await c.training.push(attr["ino"], 0, g)
    sent = c.io.bytes_pushed - before
    out = np.empty_like(w0)
    await c.training.pull_into(attr["ino"], 0, out)
    if "chunks" in mode:
        # half the chunks (the largest) went; after a second push of zeros the rest follows
        assert np.count_nonzero(out) <= 20_000 + 1000
        await c.training.push(attr["ino"], 0, np.zeros_like(g))
        await c.training.pull_into(attr["ino"], 0, out)
    assert np.allclose(out, -g, atol=1e-3)  # everything arrives, fp16 to its precision
    assert sent < g.nbytes * (0.55 if "chunks" in mode else 1) * (0.5 if "fp16" in mode else 1) + 1000


def test_batch_suggestions_follow_throughput():
    from irdmafs.client.training import PushPull

    c = PushPull.__new__(PushPull)
    c.busy = {"0": 0.1, "1": 0.2}  # rank 1 computes twice as long for the same batch
    assert c.suggest_batch(0, {0: 32, 1: 32}) == 43 and c.suggest_batch(1, {0: 32, 1: 32}) == 21
    c.busy = {"0": 0.1}
    assert c.suggest_batch(0, {0: 32, 1: 32}) is None  # not every rank measured yet
