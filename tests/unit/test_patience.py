"""A call that follows a node waits while that node's long work moves (irdmafs/runtime/silence.py,
``Patience``): a namespace primary taking a GB of stripes back answered EAGAIN for longer than the
client's fixed deadline, and every lookup sent to it got ETIMEDOUT while it fetched at full speed
(issue 41, chaos --model-gib 1). A node whose work reports nothing new is waited for the bound
and no more. Against a served node (the in-memory transport), through the client's own code."""

import pytest
import trio

from irdmafs.client.client import Client
from irdmafs.errors import RemoteError
from irdmafs.transport.memory import MemoryTransport

from .onenode import one_node_config

OP_TIMEOUT = 0.2  # a call's bound: 3 op timeouts of silence


def config(port):
    return one_node_config(port, down_after=1.0, op_timeout=OP_TIMEOUT)


def catching_up_node(seconds: float, moves: bool):
    """A node that refuses lookups (EAGAIN) for ``seconds`` while it catches up, its heartbeats
    showing its work move (or stand still), then answers them; and what it was asked."""
    state = {"begun": None, "lookups": 0}

    async def node(method, args):
        now = trio.current_time()
        if method == "heartbeat":
            done = int((now - state["begun"]) * 20) if state["begun"] is not None and moves else 0
            work = {"what": "catch-up", "done": done, "total": 10**6} if state["begun"] is None or now - state["begun"] < seconds else {}
            return {"state": "ready", "work": work, "view": 1, "view_serving": {"a": 1}}  # the view names it
        if method == "lookup":
            state["lookups"] += 1
            if state["begun"] is None:
                state["begun"] = now
            if now - state["begun"] < seconds:
                await trio.sleep(OP_TIMEOUT / 2)  # it holds the call a while, as await_takeover does
                raise RemoteError("EAGAIN", "node a is taking over from its stand-ins")
            return {"ino": 7}
        return {}

    return node, state


async def lookup_against(port, node):
    cfg = config(port)
    async with trio.open_nursery() as nursery:
        await nursery.start(MemoryTransport(cfg.token).serve, "mem", port, node)
        try:
            async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
                begun = trio.current_time()
                try:
                    return await c.lookup(1, "w.npy"), trio.current_time() - begun
                except trio.TooSlowError:
                    return None, trio.current_time() - begun
        finally:
            nursery.cancel_scope.cancel()


@pytest.mark.long  # behind --long: the quick suite took 10 min 37 s on 2026-12-02 (docs/testing.md)
async def test_a_call_waits_for_a_node_whose_catch_up_moves_past_the_fixed_bound():
    seconds = 10 * 3 * OP_TIMEOUT  # ten times the bound a call had
    node, state = catching_up_node(seconds, moves=True)
    answer, took = await lookup_against(9621, node)
    assert answer == {"ino": 7}, f"ETIMEDOUT after {took:.1f} s while the node's catch-up moved"
    assert took >= seconds and state["lookups"] > 10


async def test_a_node_whose_work_stands_still_times_the_call_out():
    node, state = catching_up_node(60.0, moves=False)
    answer, took = await lookup_against(9622, node)
    assert answer is None  # TooSlowError (ETIMEDOUT for the mount)
    assert 3 * OP_TIMEOUT <= took < 20 * OP_TIMEOUT
