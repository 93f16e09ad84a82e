"""A network partition, for real: three nodes in network namespaces, one node's veth taken down.

Clients move to the replicas within a bounded time; writes go on without the cut-off node; it
fences itself (stops serving); when the link returns it resyncs before it serves, and it never
serves the old version. Needs root and iproute2 (skips otherwise); traffic stays inside the
namespaces this test makes.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import trio

from irdmafs import config as C
from irdmafs.client.client import Client
from irdmafs.runtime.cluster import READY
from irdmafs.runtime.peers import read_verified
from irdmafs.errors import NodeDown, RemoteError
from irdmafs.launch.etcd_process import LocalEtcd
from irdmafs.launch.local import node_status, wait_settled

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from netns import namespaces  # noqa: E402

pytestmark = pytest.mark.cluster

PREFIX = "irdpart"
MiB = 1 << 20


@pytest.fixture
def netns_nodes(tmp_path):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    etcd_host = "10.79.250.1"  # on the root namespace's lo: a node's link down cuts it off from etcd too
    subprocess.run(["ip", "addr", "add", f"{etcd_host}/32", "dev", "lo"], check=True)
    with namespaces(3, None, prefix=PREFIX, net=79) as hosts, LocalEtcd(tmp_path / "etcd", host=etcd_host) as etcd:
        (tmp_path / "token").write_text(os.urandom(16).hex())
        doc = {
            "nodes": [{"name": f"n{i}", "host": h, "port": 7300} for i, h in enumerate(hosts)],
            "token_file": "token",
            "replicas": 2,
            "stripe_unit": MiB,
            "transport": ["tcp"],
            "heartbeat": 0.2,
            "down_after": 1.0,
            "op_timeout": 3.0,
            "lease_ttl": 2,
            "coordinator": [etcd.endpoint],
        }
        path = tmp_path / "cluster.toml"
        path.write_text(C.dump(C.from_dict(doc, base=tmp_path)))
        procs = []
        try:
            for i in range(3):
                with open(tmp_path / f"n{i}.log", "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            ["ip", "netns", "exec", f"{PREFIX}{i}", sys.executable, "-m", "irdmafs.server.node", "--config", str(path), "--node", f"n{i}"],
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
            yield C.load(path), tmp_path
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    subprocess.run(["ip", "addr", "del", f"{etcd_host}/32", "dev", "lo"], capture_output=True)


def link(i: int, state: str) -> None:
    subprocess.run(["ip", "link", "set", f"{PREFIX}h{i}", state], check=True)


async def stripe_from(c: Client, node: str, fid: int, idx: int) -> tuple[int, bytes]:
    """(version, data) of one stripe read straight from ``node``."""
    info = (await c.cluster.call(node, "stripe_info", {"fid": fid, "idxs": [idx]}))[str(idx)]
    buf = bytearray(info["capacity"])
    version = (await read_verified(await c.cluster.peers.conn(node), info["rkey"], 0, memoryview(buf))).version
    return version, bytes(buf)


async def test_a_partitioned_node_fences_itself_and_resyncs_before_it_serves(netns_nodes):
    cfg, tmp = netns_nodes
    await wait_settled(cfg, timeout=60)
    v1 = np.full(4 * MiB, 1, np.uint8)
    v2 = np.full(4 * MiB, 2, np.uint8)
    async with Client.connect(cfg) as c:
        attr = await c.paths.write_file("/w", v1)
        ino = attr["ino"]
        # stripes for which n1 is a home: those it must not serve stale
        homed = [i for i in range(4) if "n1" in c.cluster.roles.stripe_rank(ino, i)[: cfg.replicas]]
        assert homed

        link(1, "down")
        t0 = time.monotonic()
        got = np.frombuffer(await c.read(ino, 0, 4 * MiB), np.uint8)  # replicas answer
        assert np.array_equal(got, v1)
        await c.write(ino, 0, v2)  # writes go on without n1
        moved = time.monotonic() - t0
        assert moved < cfg.down_after + 3 * cfg.op_timeout  # bounded by down_after and op_timeout
        with trio.fail_after(cfg.lease_ttl + 5):  # n1 reaches no etcd: its lease ends, it fences itself
            while "fenced" not in (tmp / "n1.log").read_text():
                await trio.sleep(0.1)

        link(1, "up")
        with trio.fail_after(60):
            # ready and caught up: it reports ready once resynced and named by a view, then
            # takes its stripes back (hand-over, catch-up) and only then logs that it is back
            # (waiting for ready alone read the log before that line: the flake of issue 44)
            while (st := await node_status(cfg, "n1")) is None or st["state"] != READY or not st.get("caught_up"):
                # from the moment the link is back: either it refuses (syncing: EAGAIN), or what
                # it serves is the new version; never the old one
                try:
                    _, data = await stripe_from(c, "n1", ino, homed[0])
                except RemoteError as exc:
                    assert exc.code == "EAGAIN", exc
                except NodeDown:
                    pass  # not reachable yet
                else:
                    assert set(data[16 : 16 + MiB]) == {2}
                await trio.sleep(0.02)
        log = (tmp / "n1.log").read_text()
        after = log[log.index("fenced") :]  # since it fenced: resynced, then served, then back
        assert after.index("resync of node n1 done") < after.index("node n1 serves in view") < after.index("ready again after resync")
        for idx in homed:  # what n1 serves now is the new version, never the old one
            _, data = await stripe_from(c, "n1", ino, idx)
            assert set(data[16 : 16 + MiB]) == {2}, idx
        assert np.array_equal(np.frombuffer(await c.read(ino, 0, 4 * MiB), np.uint8), v2)
