"""client/readplan.py: a read's replica choice and retry rules, on generated worlds (Hypothesis:
the view, the cache, each node's answers and the clock drawn action by action), and the cases
that forced the rules (client/stripe.py, docs/reliability.md).

The invariants: the plan asks only nodes the view names that have not answered "hole", "lost",
down or EAGAIN since the view was last waited for, in the view's order with the nodes behind
last; bytes come back only from a node whose clock was seen at the one waited for; zeros only
when every home said "a hole here" and none said "lost"; EIO, never zeros, when no replica
answers, exactly once the bound on silence (op_timeout, counted from none left after the last
answer, and from a resyncing node's last progress) has run out; a refusal but EAGAIN, the 11th
stale key and a read torn past op_timeout are raised as they came; and every read ends."""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irdmafs.client import readplan as rp
from irdmafs.client.readplan import Key, Lost, ReadPlan, Want
from irdmafs.errors import Unavailable

# half the examples in the quick suite, all of them with --long (CI): 10 min 45 s on 2026-12-03
LONG = os.environ.get("IRDMAFS_LONG") == "1"

OP = 3.0  # op_timeout
SLICE = 1.0  # a clock wait's slice (stripe.CLOCK_SLICE)
NODES = ("a", "b", "c")
QUIET_STEPS = 5000  # a read of a silent world ends within this many actions

TERMINAL = (rp.Done, rp.Fail, rp.Reraise)


class Ended(Exception):
    """The world ended the read itself (a clock wait past its deadline: trio.TooSlowError)."""


def subsets(nodes: list[str], ordered: bool = False):
    """Some of ``nodes``: in their order, or in any."""
    if ordered:
        return st.lists(st.booleans(), min_size=len(nodes), max_size=len(nodes)).map(lambda keep: [n for n, k in zip(nodes, keep) if k])
    return st.permutations(nodes).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: list(p[:k])))


def entries(want: Want, calm: bool = False):
    """What a node's stripe_info may say: a hole, lost, or a key (mostly, when calm, one
    covering the piece)."""
    keys = st.builds(Key, st.integers(1, 9), st.integers(0, want.offset + want.length + 4), st.just(1), st.just(0))
    if calm:
        return st.one_of(keys, st.builds(Key, st.integers(1, 9), st.just(want.offset + want.length + 4), st.just(1), st.just(0)))
    return st.one_of(st.none(), st.builds(Lost, st.sampled_from(["no copy", "restarted empty"])), keys, keys, keys)


class World:
    """Answers a plan's actions from ``data`` for ``budget`` actions, then goes silent (every
    node down, no progress), and checks the invariants on the way."""

    def __init__(self, data, want: Want, every_home: list[str], budget: int, calm: bool = False):
        self.data, self.want, self.every_home, self.budget = data, want, every_home, budget
        self.calm = calm  # nodes that mostly answer: more reads get as far as the bytes
        self.now = 0.0
        self.steps = 0
        self.trace: list = []
        # what the plan has been told, as the invariants need it
        self.view: list[str] = list(every_home)
        self.active: list[str] = list(every_home)
        self.out: set[str] = set()  # hole, down or EAGAIN since the last wait
        self.holes: set[str] = set()  # "a hole here" since the last wait
        self.gone: set[str] = set()  # "lost here", for the whole read
        self.behind: list[str] = []
        self.looked_up: set[str] = set()
        self.stale = 0
        self.answered = False  # a node answered since the last look at the candidates
        self.t0: float | None = None  # none left since (after the last answer)
        self.reports: dict = {}
        self.t_move = -math.inf
        self.work = {n: 0 for n in NODES}
        self.key_from_lookup = False
        self.key: Key | None = None
        self.clock_seen = False  # the clock was seen at min_clock (and settled) for the key in use
        self.settled_seen = False
        self.last_clock = None
        self.last_failure = ""

    @property
    def quiet(self) -> bool:
        return self.steps > self.budget

    def draw(self, strategy, quiet_value):
        return quiet_value if self.quiet else self.data.draw(strategy)

    def run(self, plan: ReadPlan):
        action = plan.start()
        for _ in range(self.budget + QUIET_STEPS):
            self.steps += 1
            self.trace.append(action)
            if isinstance(action, TERMINAL):
                self.check_end(action)
                return action
            try:
                action = self.answer(plan, action)
            except Ended:
                return None
        raise AssertionError(f"no end after {len(self.trace)} actions: {self.trace[-20:]}")

    # -- answers -------------------------------------------------------------------------------
    def answer(self, plan: ReadPlan, action):
        if isinstance(action, rp.Look):
            if self.answered:
                self.t0, self.reports, self.t_move = None, {}, -math.inf
            self.answered = False
            self.view = self.draw(subsets(self.every_home), self.view)
            return self.chose(plan.candidates(list(self.view)))
        if isinstance(action, rp.Homes):
            self.active = self.draw(subsets(self.every_home, ordered=True), self.active)
            if self.t0 is None:
                self.t0 = self.now
            return plan.homes(self.now, list(self.every_home), [n for n in self.every_home if n in self.active])
        if isinstance(action, rp.Wait):
            bound = max(self.t0, self.t_move) + OP
            assert self.now < bound, "waited past the bound on silence"
            assert action.short == (self.now - self.t0 < OP)
            self.now += 0.05 if action.short else self.draw(st.floats(0.01, 0.5), 0.5)
            for n in NODES:
                self.work[n] += self.draw(st.integers(0, 1), 0)
            work = {n: self.work[n] for n in action.heed}
            for n, w in work.items():
                if n in self.reports and self.reports[n] != w:
                    self.t_move = self.now
                self.reports[n] = w
            self.out.clear()
            self.holes.clear()
            return self.expect_look(plan.waited(self.now, work))
        if isinstance(action, rp.Check):
            self.asking(action.node)
            present = self.draw(st.booleans(), False)
            entry = self.draw(entries(self.want, self.calm), None) if present else None
            usable = present and self.draw(st.booleans(), False)
            return self.took_key(action.node, plan.cached(present, usable, entry, self.eager()), entry, looked=False)
        if isinstance(action, rp.Lookup):
            self.asking(action.node)
            self.now += self.draw(st.floats(0, 0.2), 0.01)
            outcome = self.draw(self.outcomes(["ok", rp.DOWN, "EAGAIN", rp.STALE, rp.REFUSED], [12, 3, 3, 3, 1]), rp.DOWN)
            if outcome != "ok":
                return self.failed(plan, outcome)
            entry = self.data.draw(entries(self.want, self.calm))
            self.looked_up.add(action.node)
            self.answered = True
            return self.took_key(action.node, plan.looked(entry, self.eager()), entry, looked=True)
        if isinstance(action, rp.Forget):
            return self.expect_look(plan.forgot()) if self.stale <= rp.STALE_KEYS else self.reraise(plan.forgot())
        if isinstance(action, rp.WaitClock):
            return self.wait_clock(plan, action)
        if isinstance(action, rp.Read):
            self.asking(action.node)
            assert action.k == max(0, min(self.want.length, action.key.capacity - self.want.offset)) > 0
            self.now += self.draw(st.floats(0, 0.05), 0.01)
            outcome = self.draw(self.outcomes(["ok", rp.DOWN, rp.STALE, rp.TORN], [3, 1, 1, 1]), rp.DOWN)
            if outcome != "ok":
                return self.failed(plan, outcome)
            self.last_clock = self.data.draw(st.integers(0, self.want.min_clock + 1))
            return plan.got(self.last_clock)
        if isinstance(action, rp.Behind):
            return self.expect_look(plan.told())
        assert isinstance(action, rp.Pause), action
        assert self.last_failure == rp.TORN and self.now < OP
        self.now += action.seconds
        return self.expect_look(plan.paused())

    def outcomes(self, names: list[str], weights: list[int]):
        """One of ``names`` by ``weights`` (the first, success, ten times as likely when calm)."""
        weights = [weights[0] * (10 if self.calm else 1)] + weights[1:]
        return st.sampled_from([n for n, w in zip(names, weights) for _ in range(w)])

    def eager(self) -> bool:
        return self.draw(st.booleans(), False)

    def chose(self, action):
        """The node chosen at a look: the first candidate not out, the ones behind last."""
        left = [n for n in self.view if n not in self.out | self.gone]
        if not left:
            assert isinstance(action, rp.Homes), action
            return action
        left.sort(key=lambda n: self.behind.index(n) + 1 if n in self.behind else 0)
        assert action == rp.Check(left[0]), (action, left)
        return action

    def asking(self, node: str) -> None:
        assert node in self.view, f"asked {node}, which the view does not name"
        assert node not in self.out, f"asked {node}, counted down (or a hole, or EAGAIN) since the last wait"
        assert node not in self.gone, f"asked {node}, which lost the stripe"

    def took_key(self, node: str, action, entry, looked: bool):
        if isinstance(action, rp.Lookup):
            return action
        self.key_from_lookup = node in self.looked_up
        self.clock_seen = self.settled_seen = False
        if entry is None:
            self.out.add(node)
            self.holes.add(node)
            return self.expect_look(action)
        if isinstance(entry, Lost):
            self.gone.add(node)
            return self.expect_look(action)
        if isinstance(action, rp.Forget):
            assert not self.key_from_lookup and self.want.offset + self.want.length > entry.capacity
            return action
        self.key = entry
        return action

    def wait_clock(self, plan: ReadPlan, action: rp.WaitClock):
        self.asking(action.node)
        assert action.min_clock == self.want.min_clock and action.deadline == self.want.wait
        outcome = self.draw(self.outcomes(["reached", "behind", rp.DOWN, rp.STALE], [3, 2, 1, 1]), rp.DOWN)
        for _ in range(self.draw(st.integers(1 if outcome in ("reached", "behind") else 0, 2), 0)):
            plan.heard()
            self.answered = True
        if outcome == "reached":
            self.now += self.draw(st.floats(0, SLICE), 0.01)
            self.clock_seen, self.settled_seen = True, self.settled_seen or action.settled
            return plan.reached_clock()
        if outcome == "behind":
            give_up = min(action.deadline, self.now + SLICE)
            self.now = max(self.now, give_up)
            if give_up >= action.deadline:
                raise Ended  # trio.TooSlowError
            if action.node in self.behind:
                self.behind.remove(action.node)
            self.behind.append(action.node)
            return plan.failed(rp.BEHIND, self.now)
        return self.failed(plan, outcome)

    def failed(self, plan: ReadPlan, why: str):
        node = plan.node
        self.last_failure = why
        if why == "EAGAIN":
            got = plan.failed(rp.REFUSED, self.now, "EAGAIN")
            self.out.add(node)
            return self.expect_look(got)
        if why == rp.REFUSED:
            return self.reraise(plan.failed(rp.REFUSED, self.now, "EIO"))
        got = plan.failed(why, self.now)
        if why == rp.DOWN:
            self.out.add(node)
            return self.expect_look(got)
        if why == rp.STALE:
            self.stale += 1
            assert got == rp.Forget(node)
            return got
        assert why == rp.TORN
        if self.now >= OP:
            return self.reraise(got)
        assert got == rp.Pause(node, rp.TORN_PAUSE)
        return got

    @staticmethod
    def expect_look(action):
        assert isinstance(action, rp.Look), action
        return action

    def reraise(self, action):
        assert isinstance(action, rp.Reraise), action
        return action

    # -- how it ended --------------------------------------------------------------------------
    def check_end(self, action) -> None:
        asked_homes = len(self.trace) > 1 and isinstance(self.trace[-2], rp.Homes)
        if isinstance(action, rp.Reraise):
            assert self.last_failure in (rp.REFUSED, rp.STALE, rp.TORN)
            if self.last_failure == rp.STALE:
                assert self.stale == rp.STALE_KEYS + 1
            return
        if isinstance(action, rp.Fail):
            assert asked_homes and isinstance(action.error, Unavailable)
            if "lost (" in str(action.error):
                assert self.gone and set(self.every_home) <= self.holes | self.gone
            else:
                assert self.now >= max(self.t0, self.t_move) + OP, "gave up before the bound on silence"
            return
        assert isinstance(action, rp.Done)
        if asked_homes:  # a hole: every home said so, none lost it
            assert action == rp.Done(0, record=False)
            assert not self.gone, "zeros for a stripe a home lost"
            assert set(self.homes()) <= self.holes, "zeros while a home did not say 'a hole here'"
            return
        assert self.key is not None
        k = max(0, min(self.want.length, self.key.capacity - self.want.offset))
        assert action.k == k and action.record == (k > 0)
        if k < self.want.length:  # zeros past the stripe's end: only as a key this read asked for says
            assert self.key_from_lookup
        if self.want.min_clock and k:  # bytes only at the clock waited for
            assert self.clock_seen or self.last_clock >= self.want.min_clock
        if (self.want.min_clock or self.want.settled) and not k:
            assert self.clock_seen
        if self.want.settled and not self.want.min_clock:
            assert self.settled_seen

    def homes(self) -> list[str]:
        return [n for n in self.every_home if n in self.active] or self.every_home


@st.composite
def wants(draw):
    offset, length = draw(st.integers(0, 8)), draw(st.integers(1, 8))
    min_clock = draw(st.sampled_from([0, 0, 3]))
    settled = draw(st.booleans()) if not min_clock else False
    wait = draw(st.sampled_from([2.0, 5.0, 30.0])) if (min_clock or settled) else 0.0
    return Want(7, 1, offset, length, min_clock, settled, wait)


@settings(max_examples=300 if LONG else 150, deadline=None)
@given(wants(), st.integers(1, 3), st.integers(0, 200), st.booleans(), st.data())
def test_every_read_follows_the_rules_and_ends(want, replicas, budget, calm, data):
    world = World(data, want, list(NODES[:replicas]), budget, calm)
    world.run(ReadPlan(want, 0.0, OP))


@settings(max_examples=100 if LONG else 50, deadline=None)
@given(wants(), st.integers(1, 3), st.data())
def test_a_silent_world_ends_in_eio_never_zeros(want, replicas, data):
    """No node answers anything (every ask down): EIO once the bound ran out, never zeros."""
    world = World(data, want, list(NODES[:replicas]), 0)
    end = world.run(ReadPlan(want, 0.0, OP))
    assert isinstance(end, rp.Fail) and "unavailable" in str(end.error) and world.now >= OP


# -- named cases -------------------------------------------------------------------------------

A, B = "a", "b"
KEY = Key(5, 16, 1, 0)


def plan(**kw) -> ReadPlan:
    return ReadPlan(Want(7, 1, kw.pop("offset", 0), kw.pop("length", 8), **kw), 0.0, OP)


def none_left(p: ReadPlan, now: float, active=(A, B)):
    assert p.candidates([]) == rp.Homes()
    return p.homes(now, [A, B], list(active))


def test_a_hole_is_every_home_saying_so():
    p = plan()
    assert p.start() == rp.Look()
    assert p.candidates([A, B]) == rp.Check(A)
    assert p.cached(True, True, None, False) == rp.Look()
    assert p.candidates([A, B]) == rp.Check(B)
    assert p.cached(False, False, None, False) == rp.Lookup(B)
    assert p.looked(None, False) == rp.Look()
    assert none_left(p, 0.1) == rp.Done(0, record=False)


def test_two_resyncing_homes_are_not_a_hole_but_eio_once_nothing_moves():
    """Found by the chaos soak: two homes answering EAGAIN once read as zeros."""
    p = plan()
    for node in (A, B):
        p.candidates([A, B])
        p.cached(False, False, None, False)
        assert p.failed(rp.REFUSED, 0.0, "EAGAIN") == rp.Look()
    assert none_left(p, 0.0) == rp.Wait(short=True, heed=tuple(p.syncing))
    assert set(p.syncing) == {A, B}
    assert p.waited(0.05, {A: 1, B: 1}) == rp.Look()
    # both refuse again, their work still; the bound runs out 3 s after none was left
    for now in (1.0, 2.99):
        for node in (A, B):
            p.candidates([A, B])
            p.cached(False, False, None, False)
            p.failed(rp.REFUSED, now, "EAGAIN")
        assert isinstance(none_left(p, now), rp.Wait)
        p.waited(now, {A: 1, B: 1})
    for node in (A, B):
        p.candidates([A, B])
        p.cached(False, False, None, False)
        p.failed(rp.REFUSED, 3.0, "EAGAIN")
    end = none_left(p, 3.0)
    assert isinstance(end, rp.Fail) and "unavailable" in str(end.error)
    assert end.log[0].startswith("stripe %d:%d: no live replica holds it")


def test_a_resyncing_home_that_moves_is_waited_for():
    p = plan()
    for step in range(10):
        now = step * 1.0
        p.candidates([A])
        p.cached(False, False, None, False)
        p.failed(rp.REFUSED, now, "EAGAIN")
        action = none_left(p, now, active=[A])
        assert isinstance(action, rp.Wait), (now, action)
        assert action.short == (now < OP)
        p.waited(now + 0.05, {A: step})  # its resync moves
    p.candidates([A])
    p.cached(False, False, None, False)
    p.failed(rp.REFUSED, 13.1, "EAGAIN")
    assert isinstance(none_left(p, 13.1, active=[A]), rp.Fail)


def test_the_bound_starts_over_after_an_answer():
    """1 GiB soaks: a read that found no home for an instant, then waited on a home that
    answered, ended in EIO at once when it lost it."""
    p = plan()
    assert isinstance(none_left(p, 0.0), rp.Wait)
    p.waited(0.05, {})
    p.candidates([A])
    p.cached(False, False, None, False)
    assert p.looked(KEY, False) == rp.Read(A, KEY, 8)  # it answered at 0.05...
    assert p.failed(rp.DOWN, 5.0) == rp.Look()  # ...and was lost seconds later
    assert isinstance(none_left(p, 5.0), rp.Wait)  # counted from now, not from 0
    p.waited(7.9, {})
    assert isinstance(none_left(p, 7.9), rp.Wait)
    p.waited(8.0, {})
    assert isinstance(none_left(p, 8.0), rp.Fail)


def test_a_lost_stripe_is_eio_naming_it_never_zeros():
    p = plan()
    p.candidates([A, B])
    assert p.cached(True, True, Lost("came back without it"), False) == rp.Look()
    assert p.candidates([A, B]) == rp.Check(B)
    p.cached(True, True, None, False)
    end = none_left(p, 0.0)
    assert isinstance(end, rp.Fail) and str(end.error) == "stripe 1 of file 7: lost (a: came back without it)"


def test_a_lost_answer_waits_for_a_home_that_may_still_come_back_with_it():
    p = plan()
    p.candidates([A])
    p.cached(True, True, Lost("empty"), False)
    assert isinstance(none_left(p, 0.0, active=[A]), rp.Wait)  # b is down, not an answer
    p.waited(3.5, {})
    assert p.candidates([A]) == rp.Homes()  # a stays out: it lost the stripe
    end = p.homes(3.5, [A, B], [A])
    assert isinstance(end, rp.Fail) and str(end.error) == "stripe 1 of file 7: replicas ['b'] unavailable; lost on a"


def test_a_node_counted_down_is_not_asked_again_until_the_view_is():
    p = plan()
    p.candidates([A, B])
    p.cached(False, False, None, False)
    assert p.failed(rp.DOWN, 0.0) == rp.Look()
    assert p.candidates([A, B]) == rp.Check(B)
    p.cached(False, False, None, False)
    p.failed(rp.DOWN, 0.0)
    assert p.candidates([A, B]) == rp.Homes()
    p.homes(0.0, [A, B], [A, B])
    p.waited(0.05, {})
    assert p.candidates([A, B]) == rp.Check(A)


def test_a_node_behind_is_asked_last():
    p = plan(min_clock=3, wait=10.0)
    p.candidates([A, B])
    assert p.cached(True, True, KEY, False) == rp.WaitClock(A, KEY, 3, False, 10.0)
    assert p.failed(rp.BEHIND, 1.0) == rp.Behind(A)
    assert p.told() == rp.Look()
    assert p.candidates([A, B]) == rp.Check(B)
    p.cached(True, True, KEY, False)
    p.failed(rp.BEHIND, 2.0)
    p.told()
    assert p.candidates([A, B]) == rp.Check(A)  # a fell behind first


def test_an_eager_read_that_guessed_wrong_waits_and_reads_once_more():
    p = plan(min_clock=3, wait=10.0)
    p.candidates([A])
    assert p.cached(True, True, KEY, True) == rp.Read(A, KEY, 8)  # no header first
    assert p.got(2) == rp.WaitClock(A, KEY, 3, False, 10.0)
    assert p.reached_clock() == rp.Read(A, KEY, 8)
    assert p.got(3) == rp.Done(8, record=True)


def test_a_settled_read_waits_for_the_flag_before_reading():
    p = plan(settled=True, wait=0.5)
    p.candidates([A])
    assert p.cached(True, True, KEY, False) == rp.WaitClock(A, KEY, 0, True, 0.5)
    assert p.reached_clock() == rp.Read(A, KEY, 8)
    assert p.got(0) == rp.Done(8, record=True)


def test_a_key_of_another_lease_is_asked_for_once():
    p = plan()
    p.candidates([A])
    assert p.cached(True, False, KEY, False) == rp.Lookup(A)
    assert p.looked(KEY, False) == rp.Read(A, KEY, 8)
    assert p.failed(rp.TORN, 0.1) == rp.Pause(A, rp.TORN_PAUSE)
    assert p.paused() == rp.Look()
    p.candidates([A])
    assert p.cached(True, False, KEY, False) == rp.Read(A, KEY, 8)  # this read's own


def test_a_key_cached_short_is_asked_for_again_and_then_believed():
    """fsx: a stripe grown since its key was cached read as zeros past the old end."""
    short = Key(5, 4, 1, 0)
    p = plan()
    p.candidates([A])
    assert p.cached(True, True, short, False) == rp.Forget(A)
    assert p.forgot() == rp.Look()
    p.candidates([A])
    assert p.cached(False, False, None, False) == rp.Lookup(A)
    assert p.looked(short, False) == rp.Read(A, short, 4)
    assert p.got(0) == rp.Done(4, record=True)  # the rest zeros, as the node says


def test_the_eleventh_stale_key_is_raised():
    p = plan()
    for n in range(rp.STALE_KEYS + 1):
        p.candidates([A])
        p.cached(False, False, None, False)
        p.looked(KEY, False)
        assert p.failed(rp.STALE, 0.0) == rp.Forget(A)
        assert p.forgot() == (rp.Look() if n < rp.STALE_KEYS else rp.Reraise())


def test_a_read_torn_past_op_timeout_is_raised_and_another_refusal_at_once():
    p = plan()
    p.candidates([A])
    p.cached(True, True, KEY, False)
    assert p.failed(rp.TORN, OP) == rp.Reraise()
    p = plan()
    p.candidates([A])
    p.cached(False, False, None, False)
    assert p.failed(rp.REFUSED, 0.0, "ENOENT") == rp.Reraise()


def test_the_plan_is_pure():
    """No trio, no I/O: the module imports the error types alone of the package."""
    tree = ast.parse(Path(rp.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "collections.abc", "dataclasses", "typing", "errors"}, imported
    assert "await" not in Path(rp.__file__).read_text()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
