"""runtime/routing.py: who leads, where a write lands and whom a read asks, on any ranking, R and states
(Hypothesis), and the cases that forced the rules."""

from hypothesis import given
from hypothesis import strategies as st

from irdmafs.runtime import routing

NAMES = [f"n{i}" for i in range(7)]
states = st.sampled_from(["ready", "syncing", "down"])


@st.composite
def stripes(draw):
    ranking = draw(st.permutations(NAMES))[: draw(st.integers(1, len(NAMES)))]
    replicas = draw(st.integers(1, 4))
    state = dict(zip(ranking, draw(st.lists(states, min_size=len(ranking), max_size=len(ranking)))))
    return ranking, replicas, state


@given(stripes())
def test_the_primary_is_the_first_ready_node_and_every_write_reaches_it(stripe):
    ranking, replicas, state = stripe
    lead = routing.primary(ranking, state.get)
    ready = [n for n in ranking if state[n] == "ready"]
    assert lead == (ready[0] if ready else None)
    targets = routing.targets(ranking, replicas, state.get)
    assert len(targets) <= replicas and len(set(targets)) == len(targets)
    assert all(state[n] in ("ready", "syncing") for n in targets)
    assert lead is None or lead in targets


@given(stripes())
def test_a_read_asks_the_ready_homes_only_or_the_targets_when_none_is_ready(stripe):
    ranking, replicas, state = stripe
    load = {n: i for i, n in enumerate(reversed(ranking))}
    asked = routing.read_candidates(ranking, replicas, state.get, load.get)
    homes = [n for n in ranking[:replicas] if state[n] == "ready"]
    if homes:
        assert sorted(asked) == sorted(homes) and asked == sorted(homes, key=load.get)
    else:
        assert asked == routing.targets(ranking, replicas, state.get)


def test_a_stand_in_is_not_read_while_a_home_serves():
    """R=2 on ranking n1 n2 n3: n1 expelled (down), n2 serving. n3 stood in for writes; a read
    asks n2 alone (a mount that also asked n3 read a write back old: chaos seed 7)."""
    state = {"n1": "down", "n2": "ready", "n3": "ready"}.get
    assert routing.targets(["n1", "n2", "n3"], 2, state) == ["n2", "n3"]
    assert routing.read_candidates(["n1", "n2", "n3"], 2, state, lambda n: 0) == ["n2"]


def test_a_resyncing_home_takes_writes_but_leads_and_serves_reads_only_once_ready():
    state = {"n1": "syncing", "n2": "ready", "n3": "ready"}.get
    assert routing.primary(["n1", "n2", "n3"], state) == "n2"
    assert routing.targets(["n1", "n2", "n3"], 2, state) == ["n1", "n2"]
    assert routing.read_candidates(["n1", "n2", "n3"], 2, state, lambda n: 0) == ["n2"]
