"""server/health.py: a stripe is whole only while each of its R homes serves (active in the
view and caught up); each node counts the stripes it leads."""

from hypothesis import given
from hypothesis import strategies as st

from irdmafs.runtime.placement import rank, stripe_key
from irdmafs.server.health import degraded

NODES = ["n1", "n2", "n3", "n4"]


def homes(fid, idx, r=2):
    return rank(stripe_key(fid, idx), NODES)[:r]


def test_every_home_serving_is_whole_and_one_not_serving_degrades_exactly_its_stripes():
    led = [(7, i) for i in range(40)]
    assert degraded(led, homes, lambda n: True) == 0
    out = "n3"
    expected = sum(out in homes(f, i) for f, i in led)
    assert 0 < expected < len(led)
    assert degraded(led, homes, lambda n: n != out) == expected
    assert degraded(led, homes, lambda n: False) == len(led)


@given(st.sets(st.sampled_from(NODES)), st.lists(st.tuples(st.integers(1, 10**6), st.integers(0, 50)), max_size=60, unique=True))
def test_degraded_counts_the_stripes_with_a_home_among_the_ones_out(out, led):
    assert degraded(led, homes, lambda n: n not in out) == sum(bool(out & set(homes(f, i))) for f, i in led)
