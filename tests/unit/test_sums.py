"""Round sums (server/sums.py S1-S3) and the round's one pass: accumulators counted in the node's
budget and reused from round to round, never one a hand-over's cut froze, a round that does not
fit refused before anything is taken; the averaging done in the optimizer's pass, the state
changed in place, bit for bit what the numpy reference gives. Pure, then over an in-process
cluster."""

import gc

import numpy as np
import pytest

from irdmafs.policy import Asp, Bsp
from irdmafs.regions import VERSION_SHIFT
from irdmafs.server import optim
from irdmafs.server.budget import Budget, NoSpace
from irdmafs.server.cuts import Cuts
from irdmafs.server.rounds import Model, StripeTraining
from irdmafs.server.sums import KIND, RoundSums

from .test_push_ids import bed  # noqa: F401 (the fixture: an in-process cluster and a client, /m made)

N = 10_001


def grads(rounds: int, workers: int, dtype, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(N, dtype=np.float32).astype(dtype) for _ in range(workers)] for _ in range(rounds)]


def run_rounds(pushes, sums=None, opt_text="sgd lr=0.1 momentum=0.9", native=True, cut=None):
    """Every round of ``pushes`` (rank order) into one stripe's bookkeeping, each round applied
    as a node applies it (the optimizer's pass divides); the parameters and state after."""
    opt = optim.parse(opt_text)
    model = Model(Bsp(), len(pushes[0]))
    st = StripeTraining()
    param = np.linspace(-1, 1, N, dtype=np.float32)
    state = {k: np.zeros(N, np.float32) for k in opt.state_names}
    t = 0
    kw = {} if sums is None else {"sums": sums}
    for k, round_ in enumerate(pushes):
        out = []
        for rank, g in enumerate(round_):
            out += st.take(model, rank, k, g, **kw)
            if cut is not None and k == 1 and rank == 0:
                cut(st.rounds[1][0])  # a hand-over's answer in the middle of round 1
        for u in out:
            t += 1
            optim.step(opt, param, u.total, state, t, div=u.count, native=native)
        st.recycle(out, **kw)
    return param, state, st


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32-pushes", "fp16-pushes"])
def test_rounds_after_the_first_reuse_their_accumulator_counted_and_give_the_numpy_bits(dtype):
    pushes = grads(6, 3, dtype)
    budget = Budget(1 << 30)
    sums = RoundSums(budget)
    param, state, st = run_rounds(pushes, sums)
    assert sums.made == 1, "one accumulator for six rounds (S2)"
    assert budget.held[KIND] == N * 4 and st.spare is not None  # the spare, counted (S1)
    # the reference: numpy's passes, a fresh sum each round, the average taken apart
    opt = optim.parse("sgd lr=0.1 momentum=0.9")
    ref = np.linspace(-1, 1, N, dtype=np.float32)
    ref_state = {"buf": np.zeros(N, np.float32)}
    for t, round_ in enumerate(pushes, 1):
        total = round_[0].astype(np.float32)
        for g in round_[1:]:
            total += g.astype(np.float32)
        total /= len(round_)
        optim.step(opt, ref, total, ref_state, t, native=False)
    assert np.array_equal(param.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(state["buf"].view(np.uint32), ref_state["buf"].view(np.uint32))
    del st
    gc.collect()
    assert budget.held[KIND] == 0, "given back once nothing holds it (S1)"


async def test_a_sum_a_cut_froze_is_never_written_again():
    pushes = grads(5, 2, np.float32, seed=1)
    cuts, frozen = Cuts(), []

    def cut(a):
        frozen.append((a, a.copy()))
        cuts.take([a])

    sums = RoundSums(Budget(1 << 30))
    param, _, st = run_rounds(pushes, sums, cut=cut)
    [(a, at_cut)] = frozen
    assert not a.flags.writeable and np.array_equal(a, at_cut), "the cut's array is as it was at the answer (S3)"
    assert st.spare is not a
    ref, _, _ = run_rounds(pushes, native=False)
    assert np.array_equal(param.view(np.uint32), ref.view(np.uint32)), "the round went on, on a copy"


def test_a_round_that_does_not_fit_is_refused_and_takes_nothing():
    model = Model(Bsp(), 2)
    budget = Budget(N * 4 - 1)  # one sum does not fit
    sums = RoundSums(budget)
    st = StripeTraining()
    g = np.ones(N, np.float32)
    with pytest.raises(NoSpace, match="round's sum"):
        st.take(model, 0, 0, g, sums)
    assert st.pushed == {} and st.rounds == {} and st.next_step(0) == 0 and budget.held[KIND] == 0
    budget.capacity = N * 4
    assert st.take(model, 0, 0, g, sums) == [] and st.next_step(0) == 1  # the same push, taken on retry
    [u] = st.take(model, 1, 0, 3 * g, sums)
    assert np.array_equal(u.value(), 2 * g) and u.count == 2


def test_asp_pushes_are_averaged_in_the_pass_and_never_kept_as_spares():
    model = Model(Asp(), 4)
    sums = RoundSums(Budget(1 << 30))
    st = StripeTraining()
    g = np.full(N, 2.0, np.float32)
    [u] = st.take(model, 0, 0, g, sums)
    assert u.total is g and u.count == 4 and not u.acc  # no copy, no division of its own
    st.recycle([u], sums)
    assert st.spare is None and sums.made == 0  # a pushed gradient (a view of staging) is not ours (S3)
    raw = np.zeros(4 * N + 1, np.uint8)
    odd = np.frombuffer(raw.data[1:], np.float32)  # a push at an odd offset of its slot
    [v] = st.take(model, 0, 1, odd, sums)
    assert v.total.flags.aligned and v.total is not odd  # copied once: the C pass reads it


@pytest.mark.parametrize("opt_text", ["sgd lr=0.1 momentum=0.9 weight_decay=1e-4", "adam lr=1e-2"])
async def test_a_nodes_rounds_match_the_numpy_reference_reuse_their_sums_and_keep_state_in_place(bed, opt_text):
    """Four bsp steps of two ranks over a tensor of three 64 KiB stripes: the parameters and the
    optimizer state every replica holds are numpy's bits; the primary made one accumulator per
    stripe (steps 2-4 reuse them), counted in its budget; the state stripes' versions moved."""
    c, nodes, _ = bed
    d = (await c.paths.resolve("/m"))["ino"]
    for name, value in (("sync", "bsp"), ("workers", "2"), ("optimizer", opt_text)):
        await c.setxattr(d, f"user.irdma.{name}", value)
    n = 3 * (64 << 10) // 4 - 100
    w = np.linspace(-1, 1, n, dtype=np.float32)
    ino = (await c.paths.save("/m/w.npy", w))["ino"]
    rng = np.random.default_rng(7)
    opt = optim.parse(opt_text)
    ref, ref_state, t = w.copy(), {k: np.zeros(n, np.float32) for k in opt.state_names}, 0
    versions = {}
    for step in range(4):
        g0, g1 = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
        await c.training.push(ino, 0, g0)
        await c.training.push(ino, 1, g1)
        await c.training.wait_applied(ino, 0)
        total = g0 + g1
        total /= 2
        t += 1
        optim.step(opt, ref, total, ref_state, t, native=False)
        if step == 0:
            versions = {(nd.name, k): s.version for nd in nodes for k, s in nd.store.stripes.items() if k[0] == ino and k[2] < 0}
    got = await c.paths.load("/m/w.npy")
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    unit = 64 << 10
    header = (await c.paths.stat("/m/w.npy"))["size"] - n * 4  # the .npy header before the data
    made = 0
    for nd in nodes:
        made += nd.training.sums.made
        for (fid, idx, snap), s in nd.store.stripes.items():
            if fid != ino or snap >= 0:
                continue
            assert s.clock == 4, f"{nd.name} {fid}:{idx}:{snap} counts {s.clock} steps"
            assert s.version > versions[(nd.name, (fid, idx, snap))], "the state changed in place, its version moved"
            # made with the version base a new stripe takes (a truncate's cuts compare with it)
            assert s.version >> VERSION_SHIFT >= nd.store.get(fid, idx).version >> VERSION_SHIFT > 0
            offset, count, _ = next(x.records.of(fid, idx).span for x in nodes if x.records.of(fid, idx).span[2])
            first = (idx * unit + offset - header) // 4  # the tensor's element at the state's start
            mine = np.frombuffer(s.data[: count * 4], np.float32)
            want = ref_state[opt.state_names[-snap - 1]][first : first + count]
            assert np.array_equal(mine.view(np.uint32), want.view(np.uint32)), f"{nd.name}: state of {fid}:{idx} is numpy's"
    assert made == 3, "one accumulator per stripe, on its primary, for four steps (S2)"
    for nd in nodes:
        held = sum(st.spare.nbytes for (f, _), st in nd.records.by_stripe.items() if f == ino and st.spare is not None)
        assert nd.store.budget.held[KIND] == held, "every accumulator alive is counted (S1)"
