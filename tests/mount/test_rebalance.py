"""``irdmafs rebalance``: a node added, then one removed, while a mount reads and writes; nothing
lost, the new node holds its share, the old homes let go, the removed node can be killed."""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import trio

from irdmafs import config as C
from irdmafs.launch.local import LocalCluster, free_ports, node_status, wait_settled

import pytest

pytestmark = pytest.mark.mount

MiB = 1 << 20


def config_with(lc, path, names, extra=()):
    """A config like lc's with the nodes ``names`` (existing ones as they are) plus ``extra``."""
    doc = {
        "nodes": [{"name": n.name, "host": n.host, "port": n.port} for n in lc.cfg.nodes if n.name in names] + list(extra),
        "token_file": str(lc.config_path.parent / "token"),
        "replicas": lc.cfg.replicas,
        "stripe_unit": lc.cfg.stripe_unit,
        "transport": ["tcp"],
        "heartbeat": lc.cfg.heartbeat,
        "down_after": lc.cfg.down_after,
        "coordinator": lc.cfg.coordinator,
    }
    path.write_text(C.dump(C.from_dict(doc, base=path.parent)))
    return path


def rebalance(old, new):
    return subprocess.run([sys.executable, "-m", "irdmafs", "rebalance", "--from", str(old), "--to", str(new)], capture_output=True, text=True, timeout=300)


class Busy:
    """A thread writing and reading small files through the mount until stopped (bounded)."""

    def __init__(self, mp):
        self.mp, self.errors, self.done = mp, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self):
        deadline = time.monotonic() + 120
        while not self.stop.is_set() and time.monotonic() < deadline and self.done < 10_000:
            p = self.mp / "busy" / f"b{self.done % 20}"
            data = os.urandom(64 << 10)
            try:
                p.write_bytes(data)
                if p.read_bytes() != data:
                    self.errors.append(f"{p}: read back different bytes")
            except OSError as exc:
                self.errors.append(f"{p}: {exc}")
            self.done += 1

    def __enter__(self):
        (self.mp / "busy").mkdir(exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)


async def stripes_of(cfg, names):
    return {n: (await node_status(cfg, n))["stripes"] for n in names}


@pytest.mark.long  # 19 s: scripts/test --long (CI) runs it; the quick suite stays under ten minutes
async def test_add_then_remove_a_node_while_the_mount_works(local_cluster, mount, tmp_path):
    lc = await local_cluster(nodes=2, replicas=1, stripe_unit=MiB)
    m = mount(lc)
    files = {}
    for i in range(10):
        data = os.urandom(3 * MiB + i)
        (m / f"f{i}").write_bytes(data)
        files[f"f{i}"] = hashlib.sha256(data).hexdigest()

    # add n3: start it with the new config, then rebalance
    [port] = free_ports(1)
    grown = config_with(lc, lc.config_path.parent / "grown.toml", ["n1", "n2"], [{"name": "n3", "host": "127.0.0.1", "port": port}])
    lc3 = LocalCluster(grown, log_dir=tmp_path)
    lc3.start("n3")
    try:
        await wait_settled(lc3.cfg, ["n3"], whole_too=False)  # not a member yet: caught up once the rebalance makes it one
        with Busy(m) as busy:
            r = await trio.to_thread.run_sync(rebalance, lc.config_path, grown)
            time.sleep(1)
        assert r.returncode == 0, r.stderr + r.stdout
        assert "rebalanced to n1, n2, n3" in r.stdout and "rebalance: " in r.stderr  # progress lines
        # the summary says where n3's share came from: the rebalance's copies (its pre-copy
        # rounds too) and what n3 fetched as it started (it once said only "0 stripes, 0 bytes
        # copied" of a node that held its share): 5 stripes or more in all
        stripes, nbytes = (int(x) for x in r.stdout.split("): ")[1].split(" bytes copied")[0].split(" stripes, "))
        before = r.stdout.split("; n3 held ")[1].split(" bytes before it")[0]
        stripes, nbytes = stripes + int(before.split(" stripes, ")[0]), nbytes + int(before.split(" stripes, ")[1])
        assert stripes >= 5 and nbytes >= 5 * MiB, r.stdout
        assert not busy.errors and busy.done > 0, busy.errors[:3]
        # the mount's status asks n3 too, at the address its table has (no config it read names
        # n3): 'whole' is known, not "unknown", and in --json as in the table
        cmd = [sys.executable, "-m", "irdmafs", "status", str(m), "--json"]
        doc = json.loads((await trio.to_thread.run_sync(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=60))).stdout)
        assert [n["name"] for n in doc["nodes"]] == ["n1", "n2", "n3"] and all("degraded" in n for n in doc["nodes"] if n["alive"]), doc
        assert doc["whole"] is not None and not doc["whole_text"].startswith("unknown"), doc["whole_text"]
        assert {f: hashlib.sha256((m / f).read_bytes()).hexdigest() for f in files} == files
        cluster = (m / ".irdma" / "cluster").read_text()
        assert '"n3"' in cluster  # the mount follows the new membership
        # n3 holds its share; after the grace period the old homes hold one copy each (R=1)
        cfg = C.load(grown)
        await trio.sleep(20 * cfg.heartbeat + cfg.down_after + 1)
        held = await stripes_of(cfg, ["n1", "n2", "n3"])
        assert held["n3"] >= 5, held
        assert sum(held.values()) == sum(-(-(3 * MiB + i) // MiB) for i in range(10)) + 20, held  # + busy files
        assert {f: hashlib.sha256((m / f).read_bytes()).hexdigest() for f in files} == files

        # remove n1 (the metadata primary): rebalance, then kill it; nothing is lost
        shrunk = config_with(lc, lc.config_path.parent / "shrunk.toml", ["n2"], [{"name": "n3", "host": "127.0.0.1", "port": port}])
        with Busy(m) as busy:
            r = await trio.to_thread.run_sync(rebalance, grown, shrunk)
        assert r.returncode == 0, r.stderr + r.stdout
        assert not busy.errors, busy.errors[:3]
        lc.kill("n1")
        assert {f: hashlib.sha256((m / f).read_bytes()).hexdigest() for f in files} == files
        (m / "after").write_bytes(b"still writable")
        assert (m / "after").read_bytes() == b"still writable"
    finally:
        lc3.stop_all()


async def test_rebalance_refuses_when_a_node_is_not_running(local_cluster, tmp_path):
    lc = await local_cluster(nodes=2, replicas=1)
    [port] = free_ports(1)
    grown = config_with(lc, lc.config_path.parent / "grown.toml", ["n1", "n2"], [{"name": "n3", "host": "127.0.0.1", "port": port}])
    r = await trio.to_thread.run_sync(rebalance, lc.config_path, grown)
    assert r.returncode == 1 and "not running and ready: n3" in r.stderr and "Traceback" not in r.stderr
