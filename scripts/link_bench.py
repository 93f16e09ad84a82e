"""Link utilisation for scripts/bench.py: how much of the PS links a striped read fills.

4 PS nodes, each in a network namespace of its own behind a veth link shaped by tbf to 1 Gbit/s
each way, and a client in a fifth namespace (its link not shaped) reading a 1 GiB file striped
over the 4 nodes through the Client API. The figure is the achieved rate over the sum of the 4
link rates, with the default R=2 (a read goes to the less busy of a stripe's two homes) and with
R=1 (each stripe has one home, so the node that rendezvous hashing gave the most stripes sets the
pace: 256 stripes over 4 nodes land 51-75 per node). The links carry 9000-byte frames, as the fabric of a training cluster does
(RoCE and InfiniBand use 4 KiB MTUs): with 1500-byte frames, TCP/IP headers alone take 4.4%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import trio

from netns import namespaces

from irdmafs import config as C
from irdmafs.launch.etcd_process import LocalEtcd
from irdmafs.launch.local import wait_settled

NODES = 4
RATE_BITS = 1_000_000_000
GiB = 1 << 30
PREFIX = "irdlink"

# Run in the client's namespace: write the file once, read it --reps times, print the seconds.
CLIENT = r"""
import json, sys, time
import numpy as np, trio
from irdmafs import config as C
from irdmafs.client.client import Client

async def main(path, nbytes, reps):
    cfg = C.load(path)
    data = np.random.default_rng(7).integers(0, 255, nbytes, dtype=np.uint8)
    out = np.empty_like(data)
    async with Client.connect(cfg) as c:
        attr = await c.paths.write_file("/striped", data)
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            await c.read_into(attr["ino"], 0, memoryview(out), attr)
            if i:
                times.append(time.perf_counter() - t0)
        assert np.array_equal(out, data), "striped read returned different bytes"
    print(json.dumps(times))

trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""


def run(tmp: Path, reps: int, nbytes: int = GiB, replicas: int = 2) -> dict[str, float]:
    state = tmp / f"link-r{replicas}"
    state.mkdir()
    (state / "token").write_text(os.urandom(16).hex())
    # etcd (the views) on the root namespace's end of node 0's link, which every namespace routes to
    with (
        namespaces(NODES + 1, None, prefix=PREFIX, net=78, mtu=9000) as hosts,
        LocalEtcd(state / "etcd", host="10.78.0.1", log_path=state / "etcd.log") as etcd,
    ):
        # shape the node links only: the client's link is the sum of theirs
        for i in range(NODES):
            for ns_cmd in ([], ["ip", "netns", "exec", f"{PREFIX}{i}"]):
                dev = f"{PREFIX}h{i}" if not ns_cmd else f"{PREFIX}n{i}"
                subprocess.run(
                    [*ns_cmd, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "1gbit", "burst", "1mb", "latency", "100ms"],
                    check=True,
                    capture_output=True,
                )
        doc = {
            "nodes": [{"name": f"n{i}", "host": hosts[i], "port": 7200} for i in range(NODES)],
            "token_file": "token",
            "replicas": replicas,
            "transport": ["tcp"],
            "capacity": 2 * GiB,
            "op_timeout": 60.0,
            "coordinator": [etcd.endpoint],
        }
        cfg_path = state / "cluster.toml"
        cfg_path.write_text(C.dump(C.from_dict(doc, base=state)))
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=root)
        procs = []
        try:
            for i in range(NODES):
                with open(state / f"n{i}.log", "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            ["ip", "netns", "exec", f"{PREFIX}{i}", sys.executable, "-m", "irdmafs.server.node", "--config", str(cfg_path), "--node", f"n{i}"],
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                        )
                    )
            trio.run(wait_settled, C.load(cfg_path))
            r = subprocess.run(
                ["ip", "netns", "exec", f"{PREFIX}{NODES}", sys.executable, "-c", CLIENT, str(cfg_path), str(nbytes), str(reps)],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            if r.returncode:
                raise RuntimeError(f"link client failed: {r.stderr[-2000:]}")
            times = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    best = sorted(times)[len(times) // 2]
    achieved = nbytes / best
    return {"link_read_gbps": achieved / 1e9, "link_sum_gbps": NODES * RATE_BITS / 8 / 1e9, "link_utilisation": achieved * 8 / (NODES * RATE_BITS)}


def both(tmp: Path, reps: int) -> dict[str, float]:
    """R=2 (the default: the figure) and R=1 (``..._r1``)."""
    res = run(tmp, reps, replicas=2)
    res |= {f"{k}_r1" if k != "link_sum_gbps" else k: v for k, v in run(tmp, reps, replicas=1).items()}
    return res


if __name__ == "__main__":
    import tempfile

    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    with tempfile.TemporaryDirectory() as t:
        print(both(Path(t), int(sys.argv[1]) if len(sys.argv) > 1 else 3))
