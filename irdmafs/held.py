"""Pure: which stripes of a file hold bytes someone wrote, as sorted runs ``[lo, hi)`` of stripe
indices (both sides of the namespace agree on them: the client sends the runs it wrote with the
``extend`` that acknowledges them, every node records them in the file's inode).

Why the namespace keeps them (docs/filesystem.md, "A stripe no node holds"): a stripe a node
should hold but does not is either a *hole* (never written: it reads as zeros, as a sparse
file's holes do) or *lost* (written, acknowledged, then gone with the node that held it, which
came back without its data). Only the namespace, which every node holds whole, can tell the two
apart; a node that lost a stripe says so, and a read of it gets EIO instead of zeros. The runs
also give a file's allocation (``st_blocks``: ``du`` and ``cp --sparse`` see holes).

A file's runs may reach past its size for a moment (a write committed whose ``extend`` has not
come yet); a truncate cuts them at the stripe that holds the new end. An inode without runs
(``None``: a namespace written before they were kept) knows nothing: its missing stripes are
holes, as they always were.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

from .names import MODEL_XATTR

__all__ = ["MAX_RUNS", "add", "blocks", "check", "cut", "contains", "extent_end", "runs_of", "total"]

MAX_RUNS = 1 << 16  # runs one ``extend`` may carry (a file written every other stripe: 2**17 stripes)

Runs = list[list[int]]


def runs_of(idxs: Iterable[int]) -> Runs:
    """The runs that cover exactly the stripe indices ``idxs``."""
    out: Runs = []
    for i in sorted(set(idxs)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def check(runs: object) -> Runs:
    """``runs`` as sent by a client, or ValueError naming what is wrong with it."""
    if not isinstance(runs, list) or len(runs) > MAX_RUNS:
        raise ValueError(f"stripes is a list of at most {MAX_RUNS} [lo, hi] runs")
    for r in runs:
        if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] < r[1]):
            raise ValueError(f"stripes: {r!r} is not a run [lo, hi] with 0 <= lo < hi")
    return runs


def add(runs: Sequence[Sequence[int]], more: Sequence[Sequence[int]]) -> Runs:
    """The union of two sets of runs, sorted and merged (touching runs become one)."""
    out: Runs = []
    for lo, hi in sorted([list(r) for r in runs] + [list(r) for r in more]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def cut(runs: Sequence[Sequence[int]], end: int) -> Runs:
    """The runs below stripe ``end`` (a truncate to a size that ends in stripe ``end - 1``)."""
    return [[lo, min(hi, end)] for lo, hi in runs if lo < end]


def contains(runs: Sequence[Sequence[int]], idx: int) -> bool:
    return any(lo <= idx < hi for lo, hi in runs)


def total(runs: Sequence[Sequence[int]]) -> int:
    """How many stripes the runs cover."""
    return sum(hi - lo for lo, hi in runs)


def blocks(runs: Sequence[Sequence[int]] | None, size: int, unit: int) -> int:
    """512-byte blocks the file's written stripes take, each counted up to the file's size
    (``st_blocks``); with no runs known, the file's size in blocks (every byte taken)."""
    if runs is None or not unit:
        return (size + 511) // 512
    nbytes = sum(max(0, min(hi * unit, size) - lo * unit) for lo, hi in runs)
    return (nbytes + 511) // 512


def extent_end(node: dict) -> int:
    """Where a file's bytes end as its namespace record says: its size, or a model file's
    tensors' start (``setmodel`` drops the stripes past it: they live in its tensor files)."""
    end = node.get("size", 0)
    model = node.get("xattrs", {}).get(MODEL_XATTR)
    if model:
        try:
            end = min(end, int(json.loads(model).get("start", end)))
        except (ValueError, TypeError, AttributeError):
            pass
    return end
