"""Round sums' memory on a PS node: ``RoundSums``, the accumulators bsp rounds are summed in.

A bsp round's first push is copied into an accumulator, the others are added to it, and the
optimizer pass reads it once with its count of pushes (rounds.py ``Averaged``). The invariants:

- S1. Counted: every accumulator made here counts as ``rounds`` in the node's budget
  (budget.py) from its making until it is collected, whichever path drops it (its round applied
  and its stripe's spare replaced, a record taken from a peer, a tensor forgotten): a
  ``weakref.finalize`` gives its bytes back. A round that would not fit is ``NoSpace`` (ENOSPC
  to its pusher, nothing taken), never the kernel's OOM killer.
- S2. Reused: once a round is applied, its accumulator stays with its stripe as the spare the
  next round's first push is copied into (``StripeTraining.spare``): a step after the first
  touches no fresh memory for its sums (on this VM a first touch costs ~0.75 s per GB).
- S3. Never under a reader: an accumulator a hand-over's cut froze (server/cuts.py C1,
  ``writeable`` off) is never reused; neither is a gradient that is not an accumulator (an asp
  push, a view of its sender's staging slot). Only what ``make`` made goes back as a spare.

Sums taken from a peer's record (a resync, a backup taking over) are decoded by numpy and not
counted: they are the rounds open at that instant, at most one per stripe and rank.

Concurrency: the node's trio thread (finalizers run where the last reference goes, on it too).
"""

from __future__ import annotations

import weakref

import numpy as np

from .budget import Budget

KIND = "rounds"


class RoundSums:
    """Makes the node's round accumulators, counted in its budget (S1)."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.made = 0  # accumulators made (a steady training job stops making them: S2)
        self._alive: dict[int, weakref.finalize] = {}  # id -> the finalizer of each one alive

    def make(self, count: int, dtype: np.dtype) -> np.ndarray:
        """An uninitialised accumulator of ``count`` items of ``dtype``, counted until collected."""
        nbytes = count * np.dtype(dtype).itemsize
        self.budget.take(KIND, nbytes, "; a training round's sum")
        try:
            acc = np.empty(count, dtype)
        except MemoryError:
            self.budget.give(KIND, nbytes)
            raise
        self._alive[id(acc)] = weakref.finalize(acc, self._gone, id(acc), nbytes)
        self.made += 1
        return acc

    def owns(self, a: np.ndarray) -> bool:
        """Whether ``make`` made ``a`` (and it is alive: it is)."""
        f = self._alive.get(id(a))
        held = f.peek() if f is not None else None
        return held is not None and held[0] is a

    def _gone(self, key: int, nbytes: int) -> None:
        self._alive.pop(key, None)
        self.budget.give(KIND, nbytes)
