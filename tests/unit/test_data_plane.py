"""What serves a node's and a mount's data plane (runtime/dataplane.py), said and reported: the
transport, the engine (native or python) and the kernels (native C or numpy), each with why when
it is not native; in a node's status (its heartbeat), its metrics, and ``irdmafs status``."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import trio

from irdmafs import native
from irdmafs.client import nodes
from irdmafs.client.client import Client
from irdmafs.coord.memory import MemoryCoord
from irdmafs.launch.cli import data_plane_lines
from irdmafs.metrics import node_samples
from irdmafs.runtime import dataplane
from irdmafs.server.node import Node
from irdmafs.transport.memory import MemoryTransport

from .onenode import one_node_config

ENGINE_MODULE = importlib.util.find_spec("irdmafs.transport.engine") is not None
NO_ENGINE_MODULE = "irdmafs/transport/engine.py (the engine's Python side) is not there yet"


def run_python(code: str, **env: str) -> dict:
    """``code``'s last printed line, as JSON, from a fresh interpreter with ``env`` added."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


FACTS_OF_TCP = (
    "import json; from irdmafs.runtime import dataplane; from irdmafs.transport.tcp import TcpTransport;"
    " print(json.dumps(dataplane.facts(TcpTransport(b'x' * 16))))"
)


def test_kernels_are_what_native_py_says():
    assert dataplane.kernels() == {"native": native.NATIVE, "why": native.WHY}
    assert type(dataplane.kernels()["native"]) is bool


def test_irdmafs_native_0_says_numpy_and_why():
    f = run_python(FACTS_OF_TCP, IRDMAFS_NATIVE="0")
    assert f["kernels"] == {"native": False, "why": "IRDMAFS_NATIVE=0"}
    assert f["transport"] == "tcp"
    assert "kernels numpy (IRDMAFS_NATIVE=0)" in dataplane.line(f)
    assert dataplane.level(f) == logging.INFO or f["engine"]["name"] != "native"  # a choice is not a failure


def test_a_transport_that_names_no_engine_runs_python_and_says_why(monkeypatch):
    plain = SimpleNamespace(name="memory")  # no ``engine`` attribute: the Python transport
    got = dataplane.engine(plain)
    assert got["name"] == "python" and got["why"]  # never an empty why
    fake = SimpleNamespace(AVAILABLE=False, WHY="No module named 'irdmafs._engine'")
    monkeypatch.setattr(dataplane, "_engine", fake)
    assert dataplane.engine(plain) == {"name": "python", "why": "No module named 'irdmafs._engine'"}
    monkeypatch.setattr(dataplane, "_engine", SimpleNamespace(AVAILABLE=True, WHY="built"))
    assert dataplane.engine(SimpleNamespace(name="tcp", engine="native")) == {"name": "native", "why": "built"}
    served_not = dataplane.engine(SimpleNamespace(name="memory", engine="python"))
    assert served_not == {"name": "python", "why": "the memory transport does not run on the engine"}
    told = SimpleNamespace(name="tcp", engine="python", engine_why="chosen")  # the transport's own word wins
    assert dataplane.engine(told) == {"name": "python", "why": "chosen"}
    assert dataplane.level({"transport": "tcp", "engine": dataplane.engine(told), "kernels": {"native": True, "why": "built"}}) == logging.INFO
    monkeypatch.setattr(dataplane, "_engine", None)
    monkeypatch.setattr(dataplane, "_ENGINE_MISSING", "irdmafs.transport.engine does not import (boom)")
    assert dataplane.engine(SimpleNamespace(name="tcp", engine="native"))["why"] == "irdmafs.transport.engine does not import (boom)"


def test_the_line_names_all_three_and_a_failed_build_is_a_warning():
    both = {"transport": "tcp", "engine": {"name": "native", "why": "built"}, "kernels": {"native": True, "why": "built"}}
    assert dataplane.line(both) == "transport tcp, engine native, kernels native C"
    assert dataplane.level(both) == logging.INFO and dataplane.not_native(both) == []
    failed = dict(both, engine={"name": "python", "why": "No module named 'irdmafs._engine'"})
    assert dataplane.line(failed) == "transport tcp, engine python (No module named 'irdmafs._engine'), kernels native C"
    assert dataplane.level(failed) == logging.WARNING
    assert dataplane.not_native(failed) == ["engine python: No module named 'irdmafs._engine'"]
    chosen = dict(both, engine={"name": "python", "why": "IRDMAFS_ENGINE=0"}, kernels={"native": False, "why": "IRDMAFS_NATIVE=0"})
    assert dataplane.level(chosen) == logging.INFO
    assert dataplane.line(chosen) == "transport tcp, engine python (IRDMAFS_ENGINE=0), kernels numpy (IRDMAFS_NATIVE=0)"
    unbuilt = dict(both, kernels={"native": False, "why": "No module named 'irdmafs._native'"})
    assert dataplane.level(unbuilt) == logging.WARNING


async def test_a_nodes_status_and_metrics_carry_the_three_facts_and_its_start_says_them(nursery, caplog, monkeypatch):
    monkeypatch.setattr(native, "NATIVE", False)  # as a node without the C build runs
    monkeypatch.setattr(native, "WHY", "No module named 'irdmafs._native'")
    cfg = one_node_config(9711, down_after=0.3)
    node = Node(cfg, "a", MemoryTransport(cfg.token), coord=MemoryCoord())
    with caplog.at_level(logging.INFO, logger="irdmafs.server.node"):
        await nursery.start(node.run)
    status = await node.handle("heartbeat", {"from": "status"})  # checked against its reply type
    assert status["transport"] == "memory"
    assert status["kernels"] == {"native": False, "why": "No module named 'irdmafs._native'"}
    assert status["engine"]["name"] == "python" and status["engine"]["why"]  # memory: never the engine
    assert status["engine"] == dataplane.engine(node.transport)
    [started] = [r for r in caplog.records if "listening on" in r.getMessage()]
    assert "transport memory, engine python (" in started.getMessage()
    assert "kernels numpy (No module named 'irdmafs._native')" in started.getMessage()
    assert started.levelno == logging.WARNING  # a build that is missing is said loudly
    [info] = [s for s in node_samples(node) if s[0] == "irdmafs_data_plane_info"]
    _, kind, _, labels, value = info
    assert kind == "gauge" and value == 1
    assert labels["role"] == "node" and labels["transport"] == "memory" and labels["engine"] == "python"
    assert labels["kernels"] == "numpy" and labels["kernels_why"] == "No module named 'irdmafs._native'"
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as client:  # as a mount's table shows it
        with trio.fail_after(5):
            while not (row := nodes.table(client)[0]).get("alive"):
                await trio.sleep(0.02)
    assert row["transport"] == "memory" and row["kernels"] == status["kernels"] and row["engine"] == status["engine"]


def test_status_prints_each_nodes_data_plane_with_why():
    doc = {
        "mountpoint": "/mnt/ps",
        "transport": "shm",
        "engine": {"name": "python", "why": "IRDMAFS_ENGINE=0"},
        "kernels": {"native": True, "why": "built"},
        "nodes": [
            {"name": "n1", "alive": True, "transport": "tcp", "engine": {"name": "native", "why": "built"}, "kernels": {"native": True, "why": "built"}},
            {
                "name": "n2",
                "alive": True,
                "transport": "shm",
                "engine": {"name": "native", "why": "built"},
                "kernels": {"native": False, "why": "IRDMAFS_NATIVE=0"},
            },
            {"name": "n3", "alive": False},
            {"name": "n4", "alive": True, "transport": "tcp"},
        ],
    }
    assert data_plane_lines(doc) == [
        "data plane mount /mnt/ps: transport shm, engine python (IRDMAFS_ENGINE=0), kernels native C",
        "data plane n1: transport tcp, engine native, kernels native C",
        "data plane n2: transport shm, engine native, kernels numpy (IRDMAFS_NATIVE=0)",
        "data plane n4: transport tcp, engine and kernels not reported",
    ]


@pytest.mark.skipif(not ENGINE_MODULE, reason=NO_ENGINE_MODULE)
def test_irdmafs_engine_0_says_python_and_why():
    f = run_python(FACTS_OF_TCP, IRDMAFS_ENGINE="0")
    assert f["engine"] == {"name": "python", "why": "IRDMAFS_ENGINE=0"}
    assert "engine python (IRDMAFS_ENGINE=0)" in dataplane.line(f)
    on = run_python(FACTS_OF_TCP)  # not told: native if built and loaded, else python and why
    code = "import json; from irdmafs.transport import engine; print(json.dumps([engine.AVAILABLE, engine.WHY]))"
    available, why = run_python(code)
    if not available:
        assert why != "built" and on["engine"] == {"name": "python", "why": why}
    elif on["engine"]["name"] == "native":
        assert why == "built" and on["engine"]["why"] == "built"
    else:
        assert on["engine"]["why"] == "the tcp transport does not run on the engine"


@pytest.mark.skipif(os.environ.get("IRDMAFS_REQUIRE_NATIVE") != "1", reason="only where both C builds are required (IRDMAFS_REQUIRE_NATIVE=1: CI, .ci/run)")
def test_where_the_c_builds_are_required_both_import():
    import irdmafs._engine  # noqa: F401 (scripts/setup stopped before the tests if it did not)

    assert native.WHY in ("built", "IRDMAFS_NATIVE=0"), native.WHY
