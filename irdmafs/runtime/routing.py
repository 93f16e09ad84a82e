"""Who does what for a stripe: pure functions of a stripe's ranking, the replication factor and
each node's state (``ready`` or ``syncing`` as the view makes it, anything else not serving).
Every process that holds the same view and membership computes the same answers (runtime/roles.py
asks these with its view; tests/unit/test_routing.py checks the rules on any input).

- the *primary* is the first ready node of the ranking: it leads the stripe (numbers versions,
  applies pushes, acknowledges writes);
- the *targets* of a write are the first R nodes of the ranking that serve or resync, always
  including the primary: every one of them holds the write before it is acknowledged;
- the *homes* are the first R nodes of the ranking; a read asks the ready ones, and only when
  none is ready the targets (stand-ins hold only what they took while they stood in: a mount
  that read a stand-in while a home was active read a write back old, chaos seed 7).
"""

from __future__ import annotations

from typing import Callable, Sequence

READY, SYNCING = "ready", "syncing"

State = Callable[[str], str]  # a node's state as this process sees it


def primary(ranking: Sequence[str], state: State) -> str | None:
    """The first ready node of the stripe's ranking, or None."""
    return next((n for n in ranking if state(n) == READY), None)


def targets(ranking: Sequence[str], replicas: int, state: State) -> list[str]:
    """Where a write of the stripe must land: the first ``replicas`` nodes of its ranking that
    serve or resync, always including the primary (in place of the last if it is further down)."""
    lead = primary(ranking, state)
    chosen = [n for n in ranking if state(n) in (READY, SYNCING)][:replicas]
    if lead is not None and lead not in chosen:
        chosen = chosen[:-1] + [lead]
    return chosen


def read_candidates(ranking: Sequence[str], replicas: int, state: State, order: Callable[[str], object]) -> list[str]:
    """Nodes a read asks, in turn: the ready homes sorted by ``order`` (least loaded, one this
    process cannot reach last), or the targets when no home is ready."""
    homes = sorted((n for n in ranking[:replicas] if state(n) == READY), key=order)
    return homes or targets(ranking, replicas, state)
