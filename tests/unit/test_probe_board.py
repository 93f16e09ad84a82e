"""A node's status board (server/status.py; docs/design.md P1, P3) on real in-process nodes: it
says what the heartbeat says, a fence or a stall shows on it at once, a copy never outlives its
validity or the lease, and a probe answered from it still keeps its owner's staging leased."""

from __future__ import annotations

import json
import logging

import pytest
import trio

from irdmafs.coord.views import View
from irdmafs.runtime.cluster import READY
from irdmafs.transport import probes
from irdmafs.transport import protocol as P

from .test_cluster_inprocess import config, start_cluster


@pytest.fixture
async def node(nursery):
    cfg = config()
    nodes = await start_cluster(nursery, cfg)
    n = nodes[0]
    with trio.fail_after(30):  # its publisher runs (not in the simulator: there every heartbeat is a call)
        while n.publisher.board.answer() is None:
            await trio.sleep(0.01)
    return n


def shown(node) -> dict | None:
    doc = node.publisher.board.answer()
    return None if doc is None else json.loads(doc)


async def test_the_board_says_what_the_heartbeat_says(node):
    on_board = shown(node)
    called = await node.handle("heartbeat", {"from": "test"})
    assert on_board["state"] == called["state"] == READY
    assert set(on_board) == set(called) and on_board["incarnation"] == called["incarnation"]
    assert "degraded" not in on_board  # irdmafs status asks the call itself for what it counts


async def test_a_fence_shows_on_the_board_at_once(node):
    node.serving.fence("a test's fence", trio.current_time())
    assert shown(node)["state"] != READY  # before any other task ran


async def test_a_stall_fences_before_the_board_says_ready_again(node, caplog):
    node.serving.last_tick -= node.cfg.down_after  # as if this process had not run that long
    with trio.fail_after(30):
        while shown(node)["state"] == READY:
            await trio.sleep(0.001)
    assert any("did not run for" in r.getMessage() for r in caplog.records)  # fenced for the stall, by its checks


async def test_a_view_that_drops_the_node_leaves_no_ready_copy(node):
    roles = node.cluster.roles
    view = roles.view
    others = tuple((n, lease) for n, lease in view.serving if n != node.name)
    roles.learn_view(View(view.epoch + 1, others, ()))
    assert node.publisher.board.answer() is None  # at once: the next probe is the call, which fences


async def test_a_copy_is_valid_for_less_than_a_fencing_stall_and_never_past_the_lease(node, monkeypatch):
    pub = node.publisher
    assert pub.valid_for < 0.8 * node.cfg.down_after  # P3: a stall long enough to fence outlives any copy
    now = probes.time.monotonic()
    monkeypatch.setattr(probes.time, "monotonic", lambda: now + pub.valid_for + 0.001)
    assert pub.board.answer() is None  # a process that did not run that long answers through the checks
    monkeypatch.undo()
    monkeypatch.setattr(node.lease, "left", lambda: 0.0)  # its lease ends now
    pub.publish()
    assert pub.board.answer() is None


async def test_a_probe_answered_from_the_board_keeps_its_owners_staging(node, caplog):
    before = node.counters["heartbeat"]
    node.publisher.board.heard(P.encode_call("heartbeat", {"owner": "mount-9", "from": "m"}))
    assert node.staging.last_heard("mount-9") is not None and node.counters["heartbeat"] == before + 1
    caplog.set_level(logging.WARNING)
    node.publisher.board.heard(P.encode_call("heartbeat", {"owner": 5}))  # not a name
    node.publisher.board.heard(b"\xff not a document")
    assert node.staging.last_heard("5") is None and node.counters["heartbeat"] == before + 1
    said = [r.getMessage() for r in caplog.records]
    assert any("a probe's request dropped" in m for m in said) and any("a probe's document dropped" in m for m in said)
