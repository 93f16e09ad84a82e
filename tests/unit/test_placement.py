"""Placement properties: determinism, distinct replicas, even spread, minimal movement."""

from collections import Counter

from hypothesis import assume, given, settings, strategies as st

from irdmafs.runtime.placement import placement

node_sets = st.lists(st.text("abcdefghij0123456789", min_size=1, max_size=6), min_size=1, max_size=8, unique=True)


@given(node_sets, st.integers(0, 2**40), st.integers(0, 10_000), st.integers(1, 4))
def test_distinct_deterministic_and_order_free(nodes, fid, idx, r):
    got = placement(fid, idx, nodes, r)
    assert len(got) == min(r, len(nodes)) == len(set(got))
    assert set(got) <= set(nodes)
    assert placement(fid, idx, list(reversed(nodes)), r) == got


@settings(max_examples=10, deadline=None)
@given(st.integers(3, 8), st.integers(1, 3), st.integers(0, 2**32))
def test_spread_within_ten_percent_over_10k_stripes(n, r, seed):
    nodes = [f"node{seed % 97}-{i}" for i in range(n)]
    counts = Counter()
    for s in range(10_000):
        counts.update(placement(seed, s, nodes, r))
    mean = 10_000 * r / n
    assert all(abs(c - mean) <= 0.10 * mean for c in counts.values()), (counts, mean)


@settings(max_examples=10, deadline=None)
@given(st.integers(3, 8), st.integers(1, 3))
def test_adding_or_removing_a_node_moves_about_one_nth(n, r):
    assume(r < n)  # with r >= n every node holds everything: nothing can move
    nodes = [f"n{i}" for i in range(n)]
    grown = nodes + ["new"]
    stripes = range(10_000)
    moved_add = sum(len(set(placement(7, s, grown, r)) - set(placement(7, s, nodes, r))) for s in stripes)
    moved_del = sum(len(set(placement(7, s, nodes[1:], r)) - set(placement(7, s, nodes, r))) for s in stripes)
    total = 10_000 * r
    # adding the (n+1)th node takes 1/(n+1) of the replicas; removing one of n moves the 1/n it held
    assert 0.8 / (n + 1) <= moved_add / total <= 1.2 / (n + 1)
    assert 0.8 / n <= moved_del / total <= 1.2 / n
