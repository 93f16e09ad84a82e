"""Synchronisation policies and the per-stripe training bookkeeping of a stripe's primary.

Every rank pushes its gradients in order (push k of rank r carries step k). A stripe's primary
keeps how many pushes each rank made and turns them into updates:

- ``bsp``: pushes of step k are summed; when every active rank has pushed step k, their average
  is applied, once. The stripe's clock is the number of rounds applied.
- ``asp``: every push is applied on arrival, scaled by 1/W so that a round of W pushes moves the
  parameters as far as one BSP round. The clock is the slowest active rank's push count.
- ``ssp:S``: applied like asp; a pull waits until the slowest rank is within S steps.
- ``r2sp``: applied like asp, but in round-robin order: rank r's push of step k is admitted once
  every active rank before r has pushed step k and every rank after r has pushed step k-1, so the
  PS link carries the pushes of a round one after another instead of W at once; a pull waits
  for its round, as under bsp. (Adaptive, evenly gapped slot timing is not implemented yet.)

The clock is written into the stripe header, so a pull waits for it with one-sided reads of the
header alone (``required_clock``). Pure: no I/O, no trio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FORMS = "bsp | asp | ssp:S (S >= 0) | r2sp"


class PolicyError(ValueError):
    """A sync string that is not one of the accepted forms."""


@dataclass(frozen=True)
class Policy:
    kind: str
    staleness: int = 0

    def __str__(self) -> str:
        return f"ssp:{self.staleness}" if self.kind == "ssp" else self.kind


def parse_policy(text: str) -> Policy:
    text = text.strip()
    if text in ("bsp", "asp", "r2sp"):
        return Policy(text)
    kind, sep, s = text.partition(":")
    if kind == "ssp" and sep and s.isdigit():
        return Policy("ssp", int(s))
    raise PolicyError(f"unknown sync policy {text!r}; accepted: {FORMS}")


def required_clock(policy: Policy, own_pushes: int) -> int:
    """The stripe clock a pull by a rank that has pushed ``own_pushes`` times must wait for."""
    if policy.kind in ("bsp", "r2sp"):
        return own_pushes
    if policy.kind == "ssp":
        return max(0, own_pushes - policy.staleness)
    return 0


@dataclass(frozen=True)
class Model:
    """What a stripe's primary needs to know about the model a stripe belongs to."""

    policy: Policy
    workers: int
    removed: frozenset = frozenset()

    @property
    def active(self) -> list[int]:
        return [r for r in range(self.workers) if r not in self.removed]


@dataclass
class StripeTraining:
    """Pushes per rank and, under bsp, the rounds being summed."""

    pushed: dict[int, int] = field(default_factory=dict)
    rounds: dict[int, list] = field(default_factory=dict)  # step -> [sum, ranks]
    applied: int = 0  # bsp rounds applied
    span: tuple[int, int, int] = (0, 0, 0)  # (byte offset in the stripe, element count, stripe unit)
    busy: dict[int, float] = field(default_factory=dict)  # rank -> EMA of its compute time per step

    def observe(self, rank: int, busy: float | None) -> None:
        """The compute time a rank reported with its push (for batch-size suggestions)."""
        if busy is not None and busy >= 0:
            self.busy[rank] = busy if rank not in self.busy else 0.7 * self.busy[rank] + 0.3 * busy

    def clock(self, model: Model) -> int:
        if model.policy.kind == "bsp":
            return self.applied
        return min((self.pushed.get(r, 0) for r in model.active), default=0)

    def admitted(self, model: Model, rank: int, step: int) -> bool:
        """Under r2sp, whether it is rank's turn to push ``step``; always True otherwise."""
        if model.policy.kind != "r2sp":
            return True
        for r in model.active:
            need = step if r < rank else step - 1 if r > rank else None
            if need is not None and self.pushed.get(r, 0) < need + 1 and need >= 0:
                return False
        return True

    def accept(self, model: Model, rank: int, step: int, grad: np.ndarray) -> list[np.ndarray]:
        """Record push ``step`` of ``rank``; returns the averaged gradients to apply now, in
        order (none, one, or several when a removed rank completes waiting rounds)."""
        self.pushed[rank] = step + 1
        if model.policy.kind != "bsp":
            return [grad / max(1, len(model.active))]
        entry = self.rounds.setdefault(step, [np.zeros_like(grad), set()])
        entry[0] += grad
        entry[1].add(rank)
        return self.complete_rounds(model)

    def complete_rounds(self, model: Model) -> list[np.ndarray]:
        """The bsp rounds that every active rank has now pushed, averaged, in order."""
        out = []
        active = set(model.active)
        while self.applied in self.rounds and active and active <= self.rounds[self.applied][1]:
            total, ranks = self.rounds.pop(self.applied)
            # a removed rank's push of this round still counts, so divide by who pushed
            out.append(total / len(ranks))
            self.applied += 1
        return out
