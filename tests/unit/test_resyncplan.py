"""server/resyncplan.py: what a pull takes from its peers and what its outcomes mean, on
generated peers, stores and fetch outcomes (Hypothesis), and the cases that forced the rules
(server/resync.py's docstrings: fault simulator mixed seeds 15, 48, 1663, 1846; chaos --views
seed 1).

The invariants: the newest copy wins, its holders asked in listing order until one gives it;
a resync that ends without an error has every stripe it should hold that a peer held newer
either fetched or freed by every holder (never lost); a copy this node holds is replaced only
by one at least as new from an epoch not older than its own, and dropped as freed only when
every other home listed completely and none holds it, it did not change meanwhile and it lies
outside its file; strict pulls fail on any peer not listed or stripe not fetched; every pull
ends, asking each holder of a stripe once at most."""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from irdmafs.errors import RemoteError
from irdmafs.server import resyncplan as rsp
from irdmafs.server.resyncplan import Fetch, PullPlan, StripePull, Tally

# half the examples in the quick suite, all of them with --long (CI): 10 min 45 s on 2026-12-03
LONG = os.environ.get("IRDMAFS_LONG") == "1"

ME = "me"
PEERS = ["p1", "p2", "p3"]
FILES = {0: {1, 2}, -1: {1, 2}, -2: {1, 2}, 5: {1}}  # file 3 is gone; snapshot 5 holds file 1
KEYS = [(f, i, s) for f in (1, 2, 3) for i in (0, 1) for s in (0, 5)]
stamps = st.tuples(st.integers(1, 2), st.integers(1, 3))  # few: equal copies on several peers are common


def homes_of(fid: int, idx: int) -> list[str]:
    return [ME, PEERS[(fid + idx) % len(PEERS)]] if (fid + idx) % 2 == 0 else [PEERS[(fid + idx) % len(PEERS)], PEERS[(fid + idx + 1) % 3]]


def mine(fid: int, idx: int) -> bool:
    return ME in homes_of(fid, idx)


@st.composite
def worlds(draw):
    """Peers' listings (or a failure to list), this node's store, what it led lately."""
    listings = {}
    for peer in PEERS:
        if draw(st.integers(0, 4)) == 0:
            listings[peer] = None  # cannot be listed
            continue
        keys = draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=len(KEYS)))
        rows = [[f, i, s, v, draw(st.sampled_from([16, 32])), t] for (f, i, s) in keys for (t, v) in [draw(stamps)]]
        listings[peer] = (rows, draw(st.booleans()))
    held = {k: draw(stamps) for k in draw(st.lists(st.sampled_from(KEYS), unique=True))}
    led = {k: draw(st.sampled_from([0.0, 10.0])) for k in held}
    in_extent = {k: draw(st.booleans()) for k in KEYS}
    return listings, held, led, in_extent


def listed(plan: PullPlan, listings: dict) -> list[str]:
    """Feed the listings; the peers that could not be listed."""
    failed = []
    for peer, got in listings.items():
        if got is None:
            failed.append(peer)
            assert (plan.unlisted(peer, OSError("down")) is not None) == plan.strict
        else:
            plan.took(peer, *got)
    return failed


def fetch_all(plan: PullPlan, todo: list[Fetch], outcome) -> tuple[dict, list, list]:
    """Run each stripe's pull with ``outcome(item, peer)``; (what was asked of whom, errors,
    drops)."""
    asked, errors, drops = {}, [], []
    for item in todo:
        pull = StripePull(item)
        asks = []
        while (peer := pull.next()) is not None:
            assert len(asks) < len(item.holders), "a holder asked twice"
            asks.append(peer)
            pull.outcome(outcome(item, peer))
        asked[item[:3]] = (asks, pull.outcomes)
        end = plan.settle(pull)
        if end.drop:
            drops.append(item[:3])
        if end.error is not None:
            errors.append(end.error)
    return asked, errors, drops


@settings(max_examples=400 if LONG else 200, deadline=None)
@given(worlds(), st.booleans(), st.booleans(), st.booleans(), st.data())
def test_a_pull_takes_the_newest_copy_and_never_loses_one(world, strict, converge, newer_or_fail, data):
    listings, held, led, in_extent = world
    before = dict(held) if converge else {}
    plan = PullPlan("resync", strict=strict, converge=converge, newer_or_fail=newer_or_fail)
    unlisted = listed(plan, listings)
    rows = {p: got[0] for p, got in listings.items() if got is not None}

    # newest wins; every peer listing it holds it, in listing order
    for key, (stamp, holders, _) in plan.newest.items():
        offers = {p: (r[5], r[3]) for p, rs in rows.items() for r in rs if tuple(r[:3]) == key}
        assert stamp == max(offers.values())
        assert holders == [p for p in PEERS if offers.get(p) == stamp]
    assert plan.listed == {p for p, got in listings.items() if got is not None and got[1]}

    todo = plan.todo(held.get, FILES, mine, before, led, 5.0)
    for item in todo:
        key, (stamp, holders, cap) = item[:3], plan.newest[item[:3]]
        assert item.holders == holders and item.cap == cap and item.had == held.get(key)
        if item.instead is None:  # newer there, of a file the namespace has, and this node's
            assert item.fid in FILES[item.snap] and mine(item.fid, item.idx)
            assert item.had is None or item.had < stamp
        else:  # a copy to take instead: only in a resync, never of an older epoch than its own
            assert converge and item.instead == held[key] == before[key] and stamp[0] >= held[key][0]
            assert held[key] > stamp or led[key] >= 5.0
    chosen = {item[:3] for item in todo}
    for key, (stamp, _, _) in plan.newest.items():
        if key[0] in FILES.get(key[2], ()) and mine(key[0], key[1]) and (key not in held or held[key] < stamp):
            assert key in chosen, "a stripe newer on a peer is not fetched"

    if converge:
        gone, kept = plan.freed(ME, before, held.get, homes_of, in_extent.__getitem__)
        for key in gone + kept:
            others = [n for n in homes_of(key[0], key[1]) if n != ME]
            assert key not in plan.newest and ME in homes_of(key[0], key[1]) and others
            assert set(others) <= plan.listed, "dropped while a home that may hold it did not list"
        assert all(not in_extent[k] for k in gone) and all(in_extent[k] for k in kept)
        assert not set(gone) & chosen

    outcomes = data.draw(st.dictionaries(st.sampled_from(PEERS), st.sampled_from([True, None, False])))
    asked, errors, drops = fetch_all(plan, todo, lambda item, peer: outcomes.get(peer, True))
    for item in todo:
        asks, got = asked[item[:3]]
        assert asks == item.holders[: len(asks)], "holders asked out of listing order"
        assert (True in got) == (got[-1] is True) and (True in got or asks == item.holders)
        if item[:3] in drops:  # this node's copy goes: only when every holder freed it
            assert item.had is not None and all(o is None for o in got)
    assert sorted(plan.fetched) == sorted(k for k, (_, got) in asked.items() if True in got)
    failed = [item for item in todo if False in asked[item[:3]][1] and True not in asked[item[:3]][1]]
    if strict:
        assert len(errors) == len(failed) and all(e.code == "EAGAIN" for e in errors)
    else:
        assert not errors
        verdict = plan.verdict()
        lost = [item for item in failed if item.instead is None]
        assert (verdict is not None) == bool(newer_or_fail and lost)
        if verdict is None and newer_or_fail:  # a resync that ends: nothing a peer held newer is lost
            for item in todo:
                if item.instead is None:
                    got = asked[item[:3]][1]
                    assert True in got or all(o is None for o in got)
    if strict and unlisted:
        assert plan.unlisted(unlisted[0], OSError("x")).code == "EAGAIN"


# -- named cases -------------------------------------------------------------------------------


def test_of_equal_copies_every_holder_is_asked_in_turn_if_the_first_freed_it():
    plan = PullPlan("resync")
    plan.took("p1", [[1, 0, 0, 3, 16, 1]], True)
    plan.took("p2", [[1, 0, 0, 3, 16, 1], [1, 1, 0, 2, 16, 1]], True)
    plan.took("p3", [[1, 1, 0, 1, 16, 2]], True)  # a newer epoch wins over a higher version
    assert plan.newest[(1, 0, 0)] == ((1, 3), ["p1", "p2"], 16)
    assert plan.newest[(1, 1, 0)] == ((2, 1), ["p3"], 16)
    (item, _) = plan.todo({}.get, FILES, lambda f, i: True, {}, {}, math.inf)
    pull = StripePull(item)
    assert pull.next() == "p1"
    pull.outcome(None)
    assert pull.next() == "p2"
    pull.outcome(True)
    assert pull.next() is None
    assert plan.settle(pull) == rsp.Settle(True, False, None) and plan.fetched == [(1, 0, 0)]


def test_a_failed_copy_asks_the_next_holder():
    plan = PullPlan("rebalance", strict=True)
    plan.took("p1", [[1, 0, 0, 3, 16, 1]], True)
    plan.took("p2", [[1, 0, 0, 3, 16, 1]], True)
    (item,) = plan.todo({}.get, FILES, lambda f, i: True, {}, {}, math.inf)
    pull = StripePull(item)
    pull.outcome(False)
    assert pull.next() == "p2"
    pull.outcome(True)
    assert plan.settle(pull) == rsp.Settle(True, False, None)


def test_a_copy_to_take_instead_that_cannot_be_fetched_does_not_fail_the_resync():
    """f69fbd7: every node fenced at once (the coordinator out): the peers cannot give it, and
    this node's copy stays."""
    key = (1, 0, 0)
    plan = PullPlan("resync", converge=True, newer_or_fail=True)
    plan.took("p1", [[*key, 3, 16, 2]], True)
    (item,) = plan.todo({key: (2, 3)}.get, FILES, lambda f, i: True, {key: (2, 3)}, {key: 10.0}, 5.0)
    assert item.instead == (2, 3)
    pull = StripePull(item)
    pull.outcome(False)
    assert plan.settle(pull) == rsp.Settle(False, False, None) and plan.verdict() is None


def test_a_copy_every_holder_freed_meanwhile_goes_here_too():
    """chaos --views seed 1: kept, it came back as the file grew again."""
    plan = PullPlan("resync", converge=True, newer_or_fail=True)
    plan.took("p1", [[1, 0, 0, 3, 16, 1]], True)
    (item,) = plan.todo({(1, 0, 0): (1, 2)}.get, FILES, lambda f, i: True, {}, {}, math.inf)
    pull = StripePull(item)
    pull.outcome(None)
    assert plan.settle(pull) == rsp.Settle(False, True, None) and plan.verdict() is None


def test_a_stripe_newer_on_a_peer_not_fetched_fails_the_resync_once_all_were_tried():
    """c80d939: a node that said ready without it served zeros or old bytes."""
    plan = PullPlan("resync", converge=True, newer_or_fail=True)
    plan.took("p1", [[1, 0, 0, 3, 16, 1], [2, 0, 0, 1, 16, 1]], True)
    todo = plan.todo({}.get, FILES, lambda f, i: True, {}, {}, math.inf)
    assert len(todo) == 2
    for item in todo:
        pull = StripePull(item)
        pull.outcome(False if item.fid == 1 else True)
        assert plan.settle(pull).error is None  # not strict: the others are still tried
    error = plan.verdict()
    assert isinstance(error, RemoteError) and error.code == "EAGAIN"
    assert str(error) == "EAGAIN: resync: 1 stripes newer on a peer not fetched (first 1:0 (snapshot 0))"


def test_a_rebalance_fails_on_any_stripe_or_peer_it_cannot_take():
    plan = PullPlan("rebalance", strict=True)
    assert str(plan.unlisted("p2", OSError("gone"))) == "EAGAIN: rebalance: cannot list p2: gone"
    plan.took("p1", [[1, 0, 0, 3, 16, 1]], True)
    (item,) = plan.todo({}.get, FILES, lambda f, i: True, {}, {}, math.inf)
    pull = StripePull(item)
    pull.outcome(False)
    end = plan.settle(pull)
    assert str(end.error) == "EAGAIN: rebalance: stripe 1:0 (snapshot 0) not fetched from p1"
    assert PullPlan("rebalance pre-copy").unlisted("p2", OSError("gone")) is None


def test_a_copy_led_here_before_the_fence_is_replaced_by_theirs_but_never_by_an_older_epoch():
    """Mixed seed 15: a stand-in's copy of an older epoch must not take an acknowledged one's
    place; a copy this node led under suspicion is the peers' to settle."""
    key = (1, 0, 0)
    for theirs, ours, led, taken in [
        ((2, 3), (2, 3), 10.0, True),  # same stamp, led since the suspicion: theirs
        ((2, 3), (2, 3), 1.0, False),  # same stamp, led before: kept with its bookkeeping
        ((2, 3), (2, 5), 1.0, True),  # higher here: theirs
        ((1, 9), (2, 1), 10.0, False),  # theirs from an older epoch: never
    ]:
        plan = PullPlan("resync", converge=True)
        plan.took("p1", [[*key, theirs[1], 16, theirs[0]]], True)
        todo = plan.todo({key: ours}.get, FILES, lambda f, i: True, {key: ours}, {key: led}, 5.0)
        assert bool(todo) == taken, (theirs, ours, led)
        if taken:
            assert todo[0].instead == ours == todo[0].had
    plan = PullPlan("resync", converge=True)  # changed since the listing began: kept
    plan.took("p1", [[*key, 3, 16, 2]], True)
    assert plan.todo({key: (2, 5)}.get, FILES, lambda f, i: True, {key: (2, 4)}, {key: 10.0}, 5.0) == []


def test_a_stripe_no_other_home_holds_is_dropped_only_outside_its_file_and_when_each_listed():
    """Mixed seed 1663: a home restarted empty (not caught up once) lists nothing; seed 1846:
    the last copy of an acknowledged write, inside its file, is kept."""
    key = (2, 0, 0)  # homes: me and p3
    assert homes_of(2, 0) == [ME, "p3"]
    for complete, extent, dropped, kept in [(False, False, [], []), (True, False, [key], []), (True, True, [], [key])]:
        plan = PullPlan("resync", converge=True)
        plan.took("p3", [], complete)
        assert plan.freed(ME, {key: (1, 1)}, {key: (1, 1)}.get, homes_of, lambda k: extent) == (dropped, kept)
    plan = PullPlan("resync", converge=True)
    plan.took("p3", [], True)
    assert plan.freed(ME, {key: (1, 1)}, {key: (1, 2)}.get, homes_of, lambda k: False) == ([], [])  # written meanwhile


def test_progress_is_logged_each_second_and_at_the_end():
    tally = Tally(3, 48, now=0.0)
    tally.count(16)
    assert not tally.due(0.5)
    tally.count(16)
    assert tally.due(1.6) and not tally.due(2.0)
    tally.count(16)
    assert tally.due(2.1) and (tally.stripes, tally.bytes) == (3, 48)


def test_the_plan_is_pure():
    source = Path(rsp.__file__).read_text()
    tree = ast.parse(source)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "collections.abc", "math", "typing", "errors"}, imported
    assert "await" not in source
