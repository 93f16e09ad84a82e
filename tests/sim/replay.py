"""Replay simulator schedules: ``python -m tests.sim.replay [--kinds crash,drop] (--seed N | --seeds K)``.

One seed prints its events (faults, failed operations) and the invariants it broke; ``--seeds K``
runs seeds 0..K-1 and prints each failing one. PYTHONHASHSEED is fixed (0, as scripts/test does)
so a seed replays as it ran in the suite.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

if os.environ.get("PYTHONHASHSEED") != "0":  # string hashing (set order) must match the suite's
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, "-m", "tests.sim.replay", *sys.argv[1:]])

import hypothesis  # noqa: E402,F401  (its trio plugin makes trio's scheduling deterministic)

from .harness import KINDS, simulate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, of {', '.join(KINDS)}")
    ap.add_argument("--faults", type=int, default=6)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--seed", type=int)
    group.add_argument("--seeds", type=int)
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    logging.basicConfig(level=logging.CRITICAL)
    if args.seed is not None:
        w = simulate(args.seed, kinds, args.faults)
        print("\n".join(w.events))
        print(f"{len(w.grads)} pushes, {sum(v is not None for v in w.files.values())} files checked")
        print("\n".join(w.errors) or "invariants hold")
        return 1 if w.errors else 0
    failing = 0
    for seed in range(args.seeds):
        w = simulate(seed, kinds, args.faults)
        if w.errors:
            failing += 1
            print(f"seed {seed}: {w.errors[0]}", flush=True)
    print(f"{failing} of {args.seeds} schedules of {','.join(kinds)} broke an invariant")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
