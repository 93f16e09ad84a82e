"""Synchronisation policies and the per-stripe training bookkeeping of a stripe's primary.

Every rank pushes its gradients in order (push k of rank r carries step k). A stripe's primary
keeps how many pushes each rank made and turns them into updates:

- ``bsp``: pushes of step k are summed; when every active rank has pushed step k, their average
  is applied, once. The stripe's clock is the number of rounds applied.
- ``asp``: every push is applied on arrival, scaled by 1/W so that a round of W pushes moves the
  parameters as far as one BSP round. The clock is the slowest active rank's push count.
- ``ssp:S``: applied like asp; a pull waits until the slowest rank is within S steps.
- ``r2sp`` (round-robin synchronous parallel): applied like asp, but in round-robin order: rank
  r's push of step k is applied once every active rank before r has pushed step k and every rank
  after r has pushed step k-1 (a push that comes early is held, already copied out of the
  sender's staging slot, and applied when its turn comes). A pull waits only for the previous
  round (staleness at most one step), so workers run phase-shifted instead of in lock-step. The
  pushes leave in evenly gapped slots: the period T is the slowest rank's step time, measured
  from push arrivals without the time spent waiting for a slot; the rank at position i of the
  active ranks pushes at T*i/W after position 0's push of the same step (``slot_in`` tells a
  pushing client how long to wait), so the PS link carries one push at a time instead of W.

The clock is written into the stripe header, so a pull waits for it with one-sided reads of the
header alone (``required_clock``). Pure: no I/O, no trio.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from .. import native
from ..policy import Policy

class RecordError(ValueError):
    """Push bookkeeping that is not a record ``StripeTraining.record`` made."""


@dataclass(frozen=True)
class Model:
    """What a stripe's primary needs to know about the model a stripe belongs to."""

    policy: Policy
    workers: int
    removed: frozenset = frozenset()

    @property
    def active(self) -> list[int]:
        return [r for r in range(self.workers) if r not in self.removed]


class Averaged(NamedTuple):
    """An update to apply: the gradient ``total / count`` (a bsp round's sum and the pushes in
    it; an asp push and W), divided in the optimizer's own pass (optim.step ``div``), never in
    one of its own. ``acc``: ``total`` is an accumulator of this stripe's (server/sums.py), its
    spare once applied (``StripeTraining.recycle``)."""

    total: np.ndarray
    count: int
    acc: bool = False

    def value(self) -> np.ndarray:
        """The averaged gradient itself (a new array; what the optimizer's pass reads)."""
        return self.total / self.count


class Sums(Protocol):
    """Where round accumulators come from: server/sums.py's ``RoundSums`` on a node (counted in
    its budget); ``PLAIN``, numpy's, where nothing counts (a test, the simulator)."""

    def make(self, count: int, dtype: np.dtype) -> np.ndarray:
        """An uninitialised flat accumulator."""

    def owns(self, a: np.ndarray) -> bool:
        """Whether ``make`` made ``a`` (only those become spares: sums.py S3)."""


class _Plain:
    def make(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype)

    def owns(self, a: np.ndarray) -> bool:
        return a.flags.owndata


PLAIN: Sums = _Plain()


def _made_from(src: np.ndarray, dtype: np.dtype, sums: Sums, into: np.ndarray | None = None) -> np.ndarray:
    """``src`` cast to ``dtype`` (the cast astype does: fp16 to fp32 is exact) in ``into``, or
    in a new accumulator from ``sums`` when ``into`` is None or does not fit (not writable: a
    cut froze it)."""
    if into is None or into.shape != src.shape or into.dtype != dtype or not into.flags.writeable:
        into = sums.make(src.size, dtype)
        if src.ndim != 1:  # (pushed gradients are flat: no view of a reshape in the way of ``owns``)
            into = into.reshape(src.shape)
    np.copyto(into, src)
    return into


def _own(a: np.ndarray, sums: Sums = PLAIN) -> np.ndarray:
    """``a``, or a copy of it (from ``sums``) to change when it is frozen: a hand-over's cut
    refers to it as it was (server/cuts.py C1)."""
    return a if a.flags.writeable else _made_from(a, a.dtype, sums)


EMA = 0.3  # weight of the newest sample in the moving averages of step and compute times


@dataclass
class StripeTraining:
    """Pushes per rank; under bsp the rounds being summed; under r2sp the pushes held for their
    turn and the timing of the slots."""

    pushed: dict[int, int] = field(default_factory=dict)
    rounds: dict[int, list] = field(default_factory=dict)  # step -> [sum, ranks]
    applied: int = 0  # bsp rounds applied
    span: tuple[int, int, int] = (0, 0, 0)  # (byte offset in the stripe, element count, stripe unit)
    busy: dict[int, float] = field(default_factory=dict)  # rank -> EMA of its compute time per step
    held: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # r2sp: rank -> step -> gradient
    arrived: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (step, time) of its last push
    cycle: dict[int, float] = field(default_factory=dict)  # rank -> EMA of its step time, slot waits excluded
    # the accumulator of the last round applied, for the next round's first push (sums.py S2);
    # never in a record: a record taken from a peer drops it (``restore``)
    spare: np.ndarray | None = field(default=None, repr=False, compare=False)

    def record(self, blobs: list | None = None) -> dict:
        """What a backup needs to carry on as primary with nothing lost or applied twice: each
        rank's push count, the bsp rounds being summed, the r2sp pushes held. Arrays are
        ``[dtype, base64]``, or with ``blobs`` ``[dtype, k]``: the array appended to ``blobs``
        as its k-th entry, to travel as raw bytes beside the record (no copy made here)."""

        def arr(a: np.ndarray) -> list:
            a = np.ascontiguousarray(a)
            if blobs is not None:
                blobs.append(a)
                return [a.dtype.str, len(blobs) - 1]
            return [a.dtype.str, base64.b64encode(a.tobytes()).decode()]

        return {
            "pushed": {str(r): n for r, n in self.pushed.items()},
            "applied": self.applied,
            "span": list(self.span),
            "rounds": {str(k): [arr(total), sorted(ranks)] for k, (total, ranks) in self.rounds.items()},
            "held": {str(r): {str(k): arr(g) for k, g in steps.items()} for r, steps in self.held.items() if steps},
        }

    @property
    def payload_bytes(self) -> int:
        """Bytes of arrays this bookkeeping holds (the bsp rounds' sums, r2sp's held pushes):
        what its record carries besides counts."""
        return sum(total.nbytes for total, _ in self.rounds.values()) + sum(g.nbytes for steps in self.held.values() for g in steps.values())

    @property
    def progress(self) -> int:
        """How many pushes this bookkeeping has taken (to tell an older record from a newer)."""
        return sum(self.pushed.values()) + sum(len(s) for s in self.held.values())

    @classmethod
    def from_record(cls, rec: dict, blobs: list | None = None) -> "StripeTraining":
        """The bookkeeping a record made by ``record`` holds (its raw arrays in ``blobs``, if it
        was made so); ``RecordError`` if ``rec`` is not such a record."""

        def arr(a: list) -> np.ndarray:
            if isinstance(a[1], int):
                if blobs is None or not 0 <= a[1] < len(blobs):
                    raise RecordError(f"record names array {a[1]} of {len(blobs or ())}")
                return np.frombuffer(blobs[a[1]], np.dtype(a[0])).copy()
            return np.frombuffer(base64.b64decode(a[1]), np.dtype(a[0])).copy()

        # a peer's input, read field by field: any way it does not fit is a RecordError
        try:
            span = tuple(int(x) for x in rec["span"])
            if len(span) != 3:
                raise RecordError(f"span {rec['span']!r} is not (offset, count, unit)")
            return cls(
                pushed={int(r): int(n) for r, n in rec["pushed"].items()},
                applied=int(rec["applied"]),
                span=span,
                rounds={int(k): [arr(v[0]), set(v[1])] for k, v in rec["rounds"].items()},
                held={int(r): {int(k): arr(g) for k, g in steps.items()} for r, steps in rec["held"].items()},
            )
        except RecordError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(f"malformed training record: {type(exc).__name__}: {exc}") from None

    def restore(self, rec: "dict | StripeTraining", blobs: list | None = None) -> None:
        """Take the bookkeeping of a record made by ``record`` (see ``from_record``), or of a
        ``StripeTraining`` read from one; a malformed record changes nothing."""
        src = rec if isinstance(rec, StripeTraining) else StripeTraining.from_record(rec, blobs)
        self.pushed, self.applied, self.span, self.rounds, self.held = src.pushed, src.applied, src.span, src.rounds, src.held
        self.spare = None

    def observe(self, rank: int, busy: float | None) -> None:
        """The compute time a rank reported with its push (for batch-size suggestions)."""
        if busy is not None and busy >= 0:
            self.busy[rank] = busy if rank not in self.busy else (1 - EMA) * self.busy[rank] + EMA * busy

    def next_step(self, rank: int) -> int:
        """The step of ``rank``'s next push: pushes applied plus pushes held."""
        return self.pushed.get(rank, 0) + len(self.held.get(rank, ()))

    def arrive(self, rank: int, step: int, now: float, paced: float = 0.0) -> None:
        """A push of ``step`` arrived at ``now`` after its sender waited ``paced`` seconds for
        its slot: the step time without that wait feeds the period."""
        last = self.arrived.get(rank)
        self.arrived[rank] = (step, now)
        if last is not None and step == last[0] + 1:
            natural = max(0.0, now - last[1] - max(0.0, paced))
            self.cycle[rank] = natural if rank not in self.cycle else (1 - EMA) * self.cycle[rank] + EMA * natural

    def period(self, model: Model) -> float:
        """The r2sp round period: the slowest active rank's step time (0 until measured)."""
        return max((self.cycle.get(r, 0.0) for r in model.active), default=0.0)

    def slot_in(self, model: Model, rank: int, now: float) -> float:
        """Seconds from ``now`` until ``rank``'s slot for its next push: position i of W active
        ranks pushes T*i/W after position 0's push of the same step. 0 when there is nothing to
        wait for (not r2sp, one rank, period or position 0 not measured yet)."""
        active = model.active
        period = self.period(model)
        if not model.policy.paced or len(active) < 2 or rank not in active or period <= 0 or active[0] not in self.arrived:
            return 0.0
        step0, t0 = self.arrived[active[0]]
        slot = t0 + (self.next_step(rank) - step0) * period + period * active.index(rank) / len(active)
        return min(max(0.0, slot - now), 2 * period)

    def clock(self, model: Model) -> int:
        """The stripe's clock as its policy counts (rounds applied, or the slowest rank's pushes)."""
        return model.policy.clock(self.applied, min((self.pushed.get(r, 0) for r in model.active), default=0))

    def admitted(self, model: Model, rank: int, step: int) -> bool:
        """Whether push ``step`` of ``rank`` may be applied now (under r2sp, its turn)."""
        return model.policy.admitted(self.pushed, model.active, rank, step)

    def take(self, model: Model, rank: int, step: int, grad: np.ndarray, sums: Sums = PLAIN) -> list[Averaged]:
        """Take push ``step`` of ``rank`` (its next, see ``next_step``): under r2sp held until
        its turn; returns the updates to apply now, in order (``sums``: where a round's
        accumulator comes from when its stripe has no spare)."""
        steps = self.held.setdefault(rank, {})
        steps[step] = grad
        out = self.release(model, sums)
        if steps.get(step) is grad:  # held past this push: ``grad`` may be a view of staging
            steps[step] = grad.copy()
        return out

    def release(self, model: Model, sums: Sums = PLAIN) -> list[Averaged]:
        """Accept every held push whose turn has come, in turn order (under other policies
        than r2sp, every one: a policy changed away from r2sp frees what it held)."""
        out: list[Averaged] = []
        progress = True
        while progress:
            progress = False
            for rank, steps in self.held.items():
                step = self.pushed.get(rank, 0)
                if step in steps and self.admitted(model, rank, step):
                    out += self.accept(model, rank, step, steps.pop(step), sums)
                    progress = True
        return out

    def accept(self, model: Model, rank: int, step: int, grad: np.ndarray, sums: Sums = PLAIN) -> list[Averaged]:
        """Record push ``step`` of ``rank``; returns the updates to apply now, in order (none,
        one, or several when a removed rank completes waiting rounds)."""
        work = np.dtype(np.float32) if grad.dtype == np.float16 else grad.dtype  # an fp16 push sums in fp32
        if not model.policy.rounds:  # applied on arrival, scaled so W pushes move it as one round
            self.pushed[rank] = step + 1
            # read where it lies (its staging slot) unless misaligned there: the C pass takes
            # only aligned arrays (native.can_run), and one copy is cheaper than numpy's passes
            read = grad.astype(work, copy=not grad.flags.aligned)
            return [Averaged(read, max(1, len(model.active)))]
        # the memory first (NoSpace: the push is not taken, nothing counted), then the counts
        entry = self.rounds.get(step)
        if entry is None:  # the round's first push: copied into the sum (one pass)
            entry = self.rounds[step] = [self._first_sum(grad, work, sums), set()]
        else:
            entry[0] = _own(entry[0], sums)
            if grad.dtype == np.float16:
                native.acc_f16(entry[0], grad)  # one pass, no float32 temporary
            else:
                entry[0] += grad
        entry[1].add(rank)
        self.pushed[rank] = step + 1
        return self.complete_rounds(model)

    def _first_sum(self, grad: np.ndarray, work: np.dtype, sums: Sums) -> np.ndarray:
        """A round's sum holding ``grad``: the stripe's spare if it fits (sums.py S2), else a new
        accumulator from ``sums``."""
        spare, self.spare = self.spare, None
        return _made_from(grad, work, sums, spare)

    def complete_rounds(self, model: Model) -> list[Averaged]:
        """The bsp rounds that every active rank has now pushed, in order, each its sum and
        count (a removed rank's push of the round still counts: divided by who pushed). The sum
        is not changed here (the optimizer's pass divides as it reads), so a sum a cut froze is
        applied as it is, without a copy."""
        out = []
        active = set(model.active)
        while self.applied in self.rounds and active and active <= self.rounds[self.applied][1]:
            total, ranks = self.rounds.pop(self.applied)
            out.append(Averaged(total, len(ranks), acc=True))
            self.applied += 1
        return out

    def recycle(self, applied: list[Averaged], sums: Sums = PLAIN) -> None:
        """``applied`` are applied: an accumulator ``sums`` made among them becomes the stripe's
        spare (sums.py S2, S3: never a frozen one, never a pushed gradient or a peer's sum)."""
        for u in applied:
            if u.acc and u.total.flags.writeable and sums.owns(u.total):
                self.spare = u.total
