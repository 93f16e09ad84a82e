"""The deterministic fault simulator (tests/sim/harness.py) in the suite: schedules of node
crashes and restarts, with the invariants checked after each; a seed replays exactly; and the
link faults the heartbeat design still loses pushes under (issue 20), kept as a strict xfail so
that the redesign that fixes them has to say so."""

import os

import hypothesis  # noqa: F401  (its trio plugin makes trio's scheduling deterministic)
import pytest

from .harness import simulate

LONG = os.environ.get("IRDMAFS_LONG") == "1"


# Crash schedules the heartbeat design still loses a push in (issue 20), found by the long run:
# a restarted node refused a replication with a key of its previous incarnation twice, was
# counted down though healthy, and the ESTALE refusals that followed left the next primary of a
# stripe without the last pushes it had acknowledged. Kept as strict xfails: the redesign that
# fixes them must say so.
KNOWN_LOSSES = {22, 119}


def _seeds(n: int) -> list:
    loss = pytest.mark.xfail(strict=True, reason="issue 20: an acknowledged push lost after a restart (see KNOWN_LOSSES)")
    return [pytest.param(s, marks=loss) if s in KNOWN_LOSSES else s for s in range(n)]


@pytest.mark.parametrize("seed", _seeds(200 if LONG else 6))
def test_crash_schedules_keep_every_acknowledged_write_and_push(seed):
    w = simulate(seed, ("crash",), faults=6)
    assert w.errors == [], "\n".join(w.events + w.errors)
    assert len(w.grads) > 10 and sum(v is not None for v in w.files.values()) >= 4  # the workload ran


def test_a_seed_replays_exactly():
    a = simulate(5, ("crash", "drop", "delay", "hold", "isolate"), faults=4)
    b = simulate(5, ("crash", "drop", "delay", "hold", "isolate"), faults=4)
    assert a.events == b.events and a.links.crossings == b.links.crossings and len(a.grads) == len(b.grads)
    assert [g.tolist() for g in a.grads] == [g.tolist() for g in b.grads]


@pytest.mark.xfail(strict=True, reason="issue 20: under link faults the heartbeat design still loses acknowledged pushes (views and epochs fix it)")
@pytest.mark.parametrize("kind", ["drop", "hold"])
def test_link_faults_keep_every_acknowledged_push(kind):
    bad = [seed for seed in range(2) if simulate(seed, (kind,), faults=6).errors]
    assert bad == []
