"""Replay simulator schedules: ``python -m tests.sim.replay [--kinds crash,drop] [--timing fast|default] (--seed N | --seeds K [--first F] [--jobs J])``.

One seed prints its events (faults, failed operations) and the invariants it broke; ``--seeds K``
runs seeds F..F+K-1 (``--jobs J`` processes at once, default one per core) and prints each
failing one, then how many broke an invariant and how long the search took. PYTHONHASHSEED is
fixed (0, as scripts/test does) so a seed replays as it ran in the suite; each seed runs under
the heartbeat timing it draws (harness.py ``timing_of``) unless ``--timing`` names one.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time

if os.environ.get("PYTHONHASHSEED") != "0":  # string hashing (set order) must match the suite's
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, "-m", "tests.sim.replay", *sys.argv[1:]])

import hypothesis  # noqa: E402,F401  (its trio plugin makes trio's scheduling deterministic)

from .harness import KINDS, TIMINGS, simulate  # noqa: E402


def _first_error(job: tuple[int, tuple[str, ...], int, str | None]) -> tuple[int, str | None]:
    seed, kinds, faults, timing = job
    logging.disable(logging.CRITICAL)
    try:
        w = simulate(seed, kinds, faults, timing)
    except BaseException as exc:  # noqa: BLE001  a schedule that crashed the simulation fails, and the search goes on
        return seed, f"the simulation crashed: {exc!r}"
    if w.errors:
        return seed, w.errors[0]
    checked = sum(v is not None for v in w.files.values())
    if len(w.grads) <= 10 or checked < 4:  # a schedule that checked next to nothing proves nothing
        return seed, f"the workload barely ran: {len(w.grads)} pushes, {checked} files checked"
    return seed, None


def search(
    seeds: range, kinds: tuple[str, ...] = KINDS, faults: int = 6, jobs: int | None = None, on_fail=None, timing: str | None = None
) -> list[tuple[int, str]]:
    """Run every schedule of ``seeds`` in ``jobs`` worker processes (forked: each runs its
    seeds one after the other, each in a trio run of its own, exactly as alone); the failing
    ones as (seed, the first invariant it broke), in seed order."""
    failing = []
    work = [(s, tuple(kinds), faults, timing) for s in seeds]
    with multiprocessing.get_context("fork").Pool(jobs or os.cpu_count() or 1) as pool:
        for seed, error in pool.imap_unordered(_first_error, work, chunksize=4):
            if error is not None:
                failing.append((seed, error))
                if on_fail is not None:
                    on_fail(seed, error)
    return sorted(failing)


def search_for(seconds: float, start: int, kinds: tuple[str, ...] = KINDS, faults: int = 6, jobs: int | None = None) -> tuple[range, list[tuple[int, str]]]:
    """Seeds from ``start`` on, in batches over ``jobs`` processes, until ``seconds`` have
    passed (a batch begun is finished) or a batch had a failing seed: the range searched, and
    the failing ones (CI's fresh seeds: a search of the same seeds every run finds nothing new)."""
    jobs = jobs or os.cpu_count() or 1
    began, end, failing = time.monotonic(), start, []
    while not failing and time.monotonic() - began < seconds:
        failing = search(range(end, end + 40 * jobs), kinds, faults, jobs)
        end += 40 * jobs
    return range(start, end), failing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, of {', '.join(KINDS)}")
    ap.add_argument("--faults", type=int, default=6, help="faults in each schedule")
    ap.add_argument("--first", type=int, default=0, help="the first seed of --seeds")
    ap.add_argument("--jobs", type=int, default=None, help="processes for --seeds (default: one per core)")
    ap.add_argument("--timing", choices=sorted(TIMINGS), default=None, help="heartbeat timing (default: each seed's own)")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--seed", type=int, help="replay this seed and print what happened")
    group.add_argument("--seeds", type=int, help="run this many seeds and print the failing ones")
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    logging.basicConfig(level=logging.CRITICAL)
    if args.seed is not None:
        w = simulate(args.seed, kinds, args.faults, args.timing)
        print("\n".join(w.events))
        print(f"{len(w.grads)} pushes, {sum(v is not None for v in w.files.values())} files checked")
        print("\n".join(w.errors) or "invariants hold")
        return 1 if w.errors else 0
    began = time.monotonic()
    seeds = range(args.first, args.first + args.seeds)
    failing = search(seeds, kinds, args.faults, args.jobs, on_fail=lambda s, e: print(f"seed {s}: {e}", flush=True), timing=args.timing)
    took = time.monotonic() - began
    print(f"{len(failing)} of {args.seeds} schedules of {','.join(kinds)} broke an invariant "
          f"(seeds {seeds.start}-{seeds.stop - 1}, {took:.0f} s, {took / max(1, args.seeds):.3f} s a schedule)")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
