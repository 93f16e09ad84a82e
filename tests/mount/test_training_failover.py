"""Node loss while training through the mount: 3 nodes, R=2, 2 workers under BSP.

1. A node killed with kill -9 mid-run: training finishes, no call on the mount fails, and every
   push is applied exactly once: the final parameters equal a numpy replay of the same steps (to
   float tolerance: the PS sums a round in arrival order).
2. The same, then the node restarted with the same command line while training goes on (it
   resyncs and takes its stripes back from the stand-ins: the hand-over), then a different node
   killed; with momentum, so optimizer state that went missing or was applied twice would show.
"""

import os
import threading
import time

import numpy as np
import pytest

from irdmafs.launch.local import wait_settled

pytestmark = pytest.mark.mount

N = 100_000  # float32: 400 KB, 7 stripes of 64 KiB spread over the nodes
STRIPE = 64 << 10
LR = 0.1


def grad(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    return (0.01 * w + np.float32((rank + 1) * np.sin(step + 1))).astype(np.float32)


def replay(w0: np.ndarray, steps: int, momentum: float) -> np.ndarray:
    """The undisturbed run, in numpy: SGD with (PyTorch-style) momentum on the mean gradient."""
    w, buf = w0.copy(), None
    for step in range(steps):
        g = (grad(w, 0, step) + grad(w, 1, step)) / np.float32(2)
        buf = g if buf is None else np.float32(momentum) * buf + g
        w = (w - np.float32(LR) * (buf if momentum else g)).astype(np.float32)
    return w


class Training:
    """Two worker threads training one tensor through the mount under BSP."""

    def __init__(self, m, steps: int, momentum: float = 0.0):
        self.m, self.steps, self.momentum = m, steps, momentum
        (m / "net").mkdir()
        opt = f"sgd lr={LR}" + (f" momentum={momentum}" if momentum else "")
        for k, v in (("sync", "bsp"), ("workers", "2"), ("optimizer", opt), ("timeout", "60")):
            os.setxattr(m / "net", f"user.irdma.{k}", v.encode())
        self.w0 = np.linspace(-1, 1, N, dtype=np.float32)
        np.save(m / "net" / "w.npy", self.w0)
        self.progress = [0, 0]
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._worker, args=(r,)) for r in (0, 1)]
        for t in self.threads:
            t.start()

    def _worker(self, rank: int) -> None:
        path = self.m / ".workers" / str(rank) / "net" / "w.npy"
        try:
            for step in range(self.steps):
                w = np.load(path)  # waits for the round before
                np.save(path, grad(w, rank, step))
                self.progress[rank] = step + 1
        except Exception as exc:  # noqa: BLE001 -- any failure on the mount fails the test
            self.errors.append(f"rank {rank} step {self.progress[rank]}: {exc!r}")

    def wait_for(self, step: int) -> None:
        deadline = time.monotonic() + 120
        while min(self.progress) < step and not self.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.errors, self.errors
        assert min(self.progress) >= step, f"training stuck at {self.progress}"

    def finish_and_check(self) -> None:
        for t in self.threads:
            t.join(180)
        assert not self.errors, self.errors
        assert self.progress == [self.steps, self.steps]
        final = np.load(self.m / "net" / "w.npy")
        want = replay(self.w0, self.steps, self.momentum)
        assert np.allclose(final, want, rtol=1e-5, atol=1e-6), differences(final, want, replay(self.w0, self.steps - 1, self.momentum))


def differences(got: np.ndarray, want: np.ndarray, before: np.ndarray) -> str:
    """Which stripes of 64 KiB differ from the replay ``want``, and by how many of its last
    step's updates (``want - before``: a round missing, or applied twice, shows as about one)."""
    bad = ~np.isclose(got, want, rtol=1e-5, atol=1e-6)
    stripes = sorted({(128 + 4 * int(i)) // STRIPE for i in np.flatnonzero(bad)})  # (np.save's header: 128 bytes)
    step = np.abs(want - before) + np.float32(1e-12)
    worst = float(np.max(np.abs(got - want)[bad] / step[bad]))
    return f"{int(bad.sum())} parameters differ, in stripes {stripes} (of {-(-(128 + got.nbytes) // STRIPE)}); worst by {worst:.2f} of the last step's update"


async def test_kill_9_a_node_mid_training_and_every_push_counts_once(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=STRIPE)
    run = Training(mount(lc), steps=30)
    run.wait_for(8)
    lc.kill("n2")  # kill -9, mid-run: some pushes in flight, partial rounds on its stripes
    run.finish_and_check()


# n1 is also the metadata primary: its namespace role is handed back too
# one case behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
# both behind --long since 2026-12-03 (the quick suite at 10 min 19 s): the quick suite keeps its
# siblings, a kill mid-training (test_kill_9_...) and a restart, resync and second kill without
# training (tests/cluster/test_failover.py)
@pytest.mark.parametrize(("first", "then"), [pytest.param("n2", "n3", marks=pytest.mark.long), pytest.param("n1", "n2", marks=pytest.mark.long)])
async def test_kill_restart_mid_training_then_kill_another(local_cluster, mount, first, then):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=STRIPE)
    run = Training(mount(lc), steps=60, momentum=0.9)
    run.wait_for(6)
    lc.kill(first)
    run.wait_for(min(run.progress) + 4)  # the stand-ins take over
    lc.start(first)  # same command line: resyncs while training goes on, then takes its stripes back
    await wait_settled(lc.cfg, timeout=120)
    assert f"resync of node {first} done" in lc.log_of(first)
    run.wait_for(min(run.progress) + 4)  # it is a primary again
    lc.kill(then)
    run.finish_and_check()
    lc.check_alive()
