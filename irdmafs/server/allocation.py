"""Which inode number a new regular file gets: the one that puts its first stripe on the node
leading the fewest bytes of its directory (issue 32: placement by bytes, as far as a pure
placement allows).

Placement is a pure function of (file id, stripe, nodes) (runtime/placement.py): rendezvous hashing,
which every process computes alike and which moves about 1/N of the stripes when a node comes
or goes. Hashing spreads a model's bytes evenly only when its stripes are many and alike; a
model whose bytes sit in a few dozen tensors of one to three stripes (ResNet-50: 161 tensors,
102 MB) left the busiest of 4 nodes leading 1.40x a fair share of them, and that node's link
decided a step. The metadata primary picks the number of each new file (its ``create``), the
one decision that places a file's stripes without changing the placement rule: it takes the
first number from the next free one whose stripe 0 the node that now leads the fewest bytes of
the directory's files leads (of nodes tied, the one hashing would give the next free number, so
that an empty directory's first file gets that number as before), trying at most TRIES
numbers. Its stripes past the first stay where hashing puts them: their size is unknown when
the file is made.

Invariants: an inode number is never reused (the choice starts at ``next_ino`` and only moves
forward); the choice is the primary's alone, carried in the op (``ino``), so every replica
applies the same number; nothing else about the placement changes, so no stripe anywhere
moves because of this, and a membership change moves what it moved before. Measured on the
shapes of scripts/bench_step.py (docs/benchmarks.md): the busiest node's share of ResNet-50's
bytes falls from 1.41x to 1.09x a fair share on 3 nodes, and from 1.40x to 1.18x on 4.
"""

from __future__ import annotations

from typing import Sequence

from ..runtime.placement import rank, stripe_key

TRIES = 64  # numbers tried for one file; each hits a given node with probability about 1/N


def led_bytes(files: list[tuple[int, int, int]], nodes: Sequence[str]) -> dict[str, int]:
    """Bytes of ``files`` (file id, size, stripe unit) each of ``nodes`` leads: the first of each
    stripe's ranking."""
    led = {n: 0 for n in nodes}
    for fid, size, unit in files:
        if unit <= 0:
            continue
        for idx in range(-(-size // unit)):
            led[rank(stripe_key(fid, idx), nodes)[0]] += min(unit, size - idx * unit)
    return led


def balanced_ino(first: int, siblings: list[tuple[int, int, int]], nodes: Sequence[str]) -> int:
    """The number of a new file of a directory whose files are ``siblings`` (file id, size,
    unit): from ``first`` (the next free number) on, the first whose stripe 0 the node leading
    the fewest of their bytes leads; ``first`` if none of TRIES numbers does, or with one node."""
    if len(nodes) < 2:
        return first
    led = led_bytes(siblings, nodes)
    target = min(rank(stripe_key(first, 0), nodes), key=lambda n: led[n])  # ties: as hashing would place it
    for ino in range(first, first + TRIES):
        if rank(stripe_key(ino, 0), nodes)[0] == target:
            return ino
    return first
