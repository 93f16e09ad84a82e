"""Node loss while training through the mount: 3 nodes, R=2, 2 workers under BSP, a node killed
with kill -9 mid-run. Training finishes, no call on the mount fails, and every push is applied
exactly once: the final parameters equal a numpy replay of the same steps (to float tolerance:
the PS sums a round in arrival order). (Restarting the node mid-training and killing another is
not yet safe: see the README's Reliability section.)"""

import os
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.mount

N = 100_000  # float32: 400 KB, 7 stripes of 64 KiB spread over the nodes
STEPS = 30
LR = 0.1


def grad(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    return (0.01 * w + np.float32((rank + 1) * np.sin(step + 1))).astype(np.float32)


def replay(w0: np.ndarray) -> np.ndarray:
    w = w0.copy()
    for step in range(STEPS):
        g = (grad(w, 0, step) + grad(w, 1, step)) / np.float32(2)
        w = (w - np.float32(LR) * g).astype(np.float32)
    return w


async def test_kill_9_a_node_mid_training_and_every_push_counts_once(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=64 << 10)
    m = mount(lc)
    (m / "net").mkdir()
    for k, v in (("sync", "bsp"), ("workers", "2"), ("optimizer", f"sgd lr={LR}"), ("timeout", "60")):
        os.setxattr(m / "net", f"user.irdma.{k}", v.encode())
    w0 = np.linspace(-1, 1, N, dtype=np.float32)
    np.save(m / "net" / "w.npy", w0)
    progress = [0, 0]
    errors = []

    def worker(rank):
        path = m / ".workers" / str(rank) / "net" / "w.npy"
        try:
            for step in range(STEPS):
                w = np.load(path)  # waits for the round before
                np.save(path, grad(w, rank, step))
                progress[rank] = step + 1
        except Exception as exc:  # noqa: BLE001 -- any failure on the mount fails the test
            errors.append(f"rank {rank} step {progress[rank]}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()

    def wait_for(step):
        deadline = time.monotonic() + 120
        while min(progress) < step and not errors and time.monotonic() < deadline:
            time.sleep(0.01)

    wait_for(8)
    lc.kill("n2")  # kill -9, mid-run: some pushes in flight, partial rounds on its stripes
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert progress == [STEPS, STEPS]
    final = np.load(m / "net" / "w.npy")
    assert np.allclose(final, replay(w0), rtol=1e-5, atol=1e-6)
