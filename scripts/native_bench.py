"""The native kernels' gain over their numpy fallbacks, for scripts/bench.py.

Each kernel runs on 16 M float32 elements (64 MiB), C and numpy interleaved, median of --reps;
the figure is numpy time / C time (above 1: the C kernel is faster); ``acc_f16_f16c`` is the C
kernel's scalar conversion against its F16C one, where the CPU has it.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from irdmafs import native
from irdmafs.server import optim

N = 16 << 20


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def speedups(reps: int) -> dict[str, float]:
    if not native.NATIVE:
        print(f"bench: native kernels not built ({native.WHY}): no speedups to show")
        return {}
    rng = np.random.default_rng(3)
    p, g = rng.standard_normal(N, dtype=np.float32), rng.standard_normal(N, dtype=np.float32)
    h = g.astype(np.float16)
    acc = np.zeros(N, np.float32)
    cases = {
        "acc_f16": lambda nat: native.acc_f16(acc, h, native=nat),
    }
    if native.F16C:  # the F16C conversion against the C kernel's own scalar one
        cases["acc_f16_f16c"] = lambda vec: native.acc_f16(acc, h, native=True, vector=vec)
    for text, key in (("sgd lr=0.01 momentum=0.9 weight_decay=1e-4", "sgd_momentum"), ("adam lr=1e-3 weight_decay=1e-4", "adam")):
        opt = optim.parse(text)
        state = {k: np.zeros(N, np.float32) for k in opt.state_names}
        # a bsp round of 4 pushes: the sum divided in the kernel's pass (numpy: a pass of its own)
        cases[key] = lambda nat, opt=opt, state=state: optim.step(opt, p, g, state, 3, div=4, native=nat)
    res = {}
    for key, fn in cases.items():
        fn(True), fn(False)  # warm-up: page in
        c, n = [], []
        for _ in range(reps):
            c.append(_time(lambda: fn(True)))
            n.append(_time(lambda: fn(False)))
        res[f"native_{key}_speedup"] = statistics.median(n) / statistics.median(c)
    return res


if __name__ == "__main__":
    print(speedups(5))
