#!/usr/bin/env python3
"""An fsx-style file system exerciser: random reads, writes, truncates, mmap reads and writes,
fsyncs and close/reopens on one file, each checked against an in-memory copy of what the file
must hold.

This is the method of fsx (xfstests' ltp/fsx.c, written again here, not copied: neither
xfstests, LTP nor pjdfstest is packaged in Debian bookworm or on PyPI, so no script can build
them on these machines). Like fsx it prints the last operations and the first differing byte on
a mismatch and exits 1; it checks the file's size after every operation and the whole file at
the end. Every run is bounded by ``--ops`` and ``--seconds``.

    python scripts/fsx.py /mnt/ps/fsx.dat --ops 10000 --seed 1
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import sys
import time
from collections import deque

OPS = ("read", "write", "truncate", "mapread", "mapwrite", "fsync", "closeopen")


class Mismatch(Exception):
    pass


class Fsx:
    def __init__(self, path: str, *, maxlen: int, maxop: int, seed: int, mmap_ops: bool, closeopen: float, paranoid: bool = False):
        self.path, self.maxlen, self.maxop = path, maxlen, maxop
        self.rng = random.Random(seed)
        self.model = bytearray()  # what the file must hold
        self.log: deque[str] = deque(maxlen=30)
        self.counts = dict.fromkeys(OPS, 0)
        self.weights = {"read": 4, "write": 4, "truncate": 1, "mapread": 2 if mmap_ops else 0, "mapwrite": 2 if mmap_ops else 0, "fsync": 1, "closeopen": 0}
        self.closeopen = closeopen
        self.paranoid = paranoid
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    # -- checks --------------------------------------------------------------------------------
    def _check(self, offset: int, got: bytes, what: str) -> None:
        want = bytes(self.model[offset : offset + len(got)])
        if got != want:
            at = next(i for i in range(min(len(got), len(want))) if got[i] != want[i]) if len(got) == len(want) else min(len(got), len(want))
            raise Mismatch(
                f"{what}: byte {offset + at} is {got[at:at + 1].hex() or 'missing'}, should be {want[at:at + 1].hex() or 'missing'} "
                f"({len(got)} bytes read, {len(want)} expected)"
            )

    def _check_size(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != len(self.model):
            raise Mismatch(f"size is {size}, should be {len(self.model)}")

    # -- operations ----------------------------------------------------------------------------
    def _span(self, limit: int) -> tuple[int, int]:
        offset = self.rng.randrange(max(limit, 1))
        return offset, self.rng.randrange(1, self.maxop + 1)

    def read(self) -> str:
        size = len(self.model)
        offset, length = self._span(size + self.maxop // 4)  # now and then past the end
        got = os.pread(self.fd, length, offset)
        self._check(offset, got, f"read {offset}+{length}")
        return f"read {offset}+{length} -> {len(got)}"

    def write(self) -> str:
        offset, length = self._span(self.maxlen)
        length = min(length, self.maxlen - offset)
        data = self.rng.randbytes(length)
        if offset > len(self.model):  # a hole: zeros
            self.model.extend(bytes(offset - len(self.model)))
        self.model[offset : offset + length] = data
        assert os.pwrite(self.fd, data, offset) == length
        return f"write {offset}+{length}"

    def truncate(self) -> str:
        size = self.rng.randrange(self.maxlen + 1)
        os.ftruncate(self.fd, size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))
        return f"truncate {size}"

    def mapread(self) -> str:
        size = len(self.model)
        if size == 0:
            return "mapread skipped (empty)"
        offset, length = self._span(size)
        length = min(length, size - offset)
        with mmap.mmap(self.fd, size, prot=mmap.PROT_READ) as m:
            got = m[offset : offset + length]
        self._check(offset, got, f"mapread {offset}+{length}")
        return f"mapread {offset}+{length}"

    def mapwrite(self) -> str:
        offset, length = self._span(self.maxlen)
        length = min(length, self.maxlen - offset)
        end = offset + length
        if end > len(self.model):  # as fsx: grow the file first, a mapping cannot
            os.ftruncate(self.fd, end)
            self.model.extend(bytes(end - len(self.model)))
        data = self.rng.randbytes(length)
        with mmap.mmap(self.fd, end) as m:
            m[offset:end] = data
            m.flush()  # msync
        self.model[offset:end] = data
        return f"mapwrite {offset}+{length}"

    def fsync(self) -> str:
        os.fsync(self.fd)
        return "fsync"

    def reopen(self) -> str:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)
        return "close/open"

    # -- the run -------------------------------------------------------------------------------
    def run(self, ops: int, seconds: float) -> int:
        names = [n for n in self.weights if self.weights[n]]
        weights = [self.weights[n] for n in names]
        deadline = time.monotonic() + seconds
        done = 0
        for done in range(1, ops + 1):
            name = self.rng.choices(names, weights)[0]
            self.log.append(f"{done}: {getattr(self, name)()}")
            self.counts[name] += 1
            if self.closeopen and self.rng.random() < self.closeopen:
                self.log.append(f"{done}: {self.reopen()}")
                self.counts["closeopen"] += 1
            self._check_size()
            if self.paranoid:  # the whole file after every operation: finds the one that broke it
                self._check(0, os.pread(self.fd, len(self.model) + 1, 0), f"whole file after operation {done}")
            if time.monotonic() > deadline:
                break
        self._check(0, os.pread(self.fd, len(self.model) + 1, 0), "final read of the whole file")
        os.close(self.fd)
        return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="the test file (created or truncated)")
    ap.add_argument("--ops", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=300.0, help="stop after this long, whatever --ops says")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--maxlen", type=int, default=1 << 20, help="largest file size")
    ap.add_argument("--maxop", type=int, default=64 << 10, help="largest read or write")
    ap.add_argument("--closeopen", type=float, default=0.05, help="chance of a close and reopen after each op")
    ap.add_argument("--no-mmap", action="store_true")
    ap.add_argument("--paranoid", action="store_true", help="read the whole file back after every operation")
    args = ap.parse_args(argv)
    fsx = Fsx(args.path, maxlen=args.maxlen, maxop=args.maxop, seed=args.seed, mmap_ops=not args.no_mmap, closeopen=args.closeopen, paranoid=args.paranoid)
    try:
        done = fsx.run(args.ops, args.seconds)
    except (Mismatch, OSError) as exc:
        print(f"fsx: FAILED after {sum(fsx.counts.values())} operations (seed {args.seed}): {exc}", file=sys.stderr)
        print("last operations:\n  " + "\n  ".join(fsx.log), file=sys.stderr)
        return 1
    counts = ", ".join(f"{n} {c}" for n, c in fsx.counts.items())
    print(f"fsx: {done} operations passed (seed {args.seed}; {counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
