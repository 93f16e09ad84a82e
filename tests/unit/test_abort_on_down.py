"""An operation cancelled because its node was counted down raises NodeDown, always.

Each operation of ``Peers`` runs against a connection that never answers; liveness aborts it
(``Peers.abort``) and then, before the cancelled task resumes, stops counting the node down (a
heartbeat answered, membership forgot it). Before issue 41's fix the abort was swallowed then:
``call_on`` died with ``UnboundLocalError`` (a node crashed rejoining), ``write`` returned as if
the bytes had landed, ``read_header(s)`` returned zeroed headers, ``read_stripes`` passed zeroed
buffers on as a verified read and ``read_stripe`` returned None.
"""

import pytest
import trio
import trio.testing

from irdmafs.config import from_dict
from irdmafs.runtime.peers import Peers
from irdmafs.errors import NodeDown
from irdmafs.transport.base import Connection


class Silent(Connection):
    """A connection whose every operation waits until cancelled."""

    peer = "a"
    incarnation = 7

    async def read(self, rkey, offset, into):
        await trio.sleep_forever()

    async def write(self, rkey, offset, data):
        await trio.sleep_forever()

    async def write_imm(self, rkey, offset, data, imm):
        await trio.sleep_forever()

    async def call(self, method, args=None, *, timeout=None, probe=False):
        await trio.sleep_forever()

    async def aclose(self):
        pass


def peers(down: set[str]) -> Peers:
    cfg = from_dict(
        {
            "nodes": [{"name": "a", "host": "mem", "port": 9601}],
            "token": "test-token-123",
            "replicas": 1,
            "transport": ["memory"],
            "coordinator": ["http://127.0.0.1:2379"],
            "op_timeout": 60.0,
        }
    )
    p = Peers(cfg, None, None, spec=lambda n: cfg.nodes[0], lost=lambda *a: None, is_down=lambda n: n in down, counts_timeouts=True)
    p._conns["a"] = Silent()
    return p


OPERATIONS = {
    "call_on": lambda p: p.call_on("a", "status"),
    "write": lambda p: p.write("a", 1, 0, b"x" * 8, 7),
    "write_imm": lambda p: p.write_imm("a", 1, 0, b"x" * 8, 5, 7),
    "read_stripe": lambda p: p.read_stripe("a", 1, 0, memoryview(bytearray(8)), 7),
    "read_header": lambda p: p.read_header("a", 1, 7),
    "read_headers": lambda p: p.read_headers("a", [(1, 7)]),
    "read_stripes": lambda p: p.read_stripes("a", [(1, 7, 0, memoryview(bytearray(8)))]),
}


@pytest.mark.parametrize("op", sorted(OPERATIONS))
@pytest.mark.parametrize("still_down", [True, False], ids=["still-down", "back-before-it-resumed"])
async def test_an_aborted_operation_raises_node_down(op, still_down):
    down = {"a"}
    p = peers(down)
    outcome: list = []

    async def run():
        try:
            outcome.append(("returned", await OPERATIONS[op](p)))
        except NodeDown as exc:
            outcome.append(("NodeDown", exc))

    async with trio.open_nursery() as n:
        n.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        assert p._inflight["a"], "the operation is under way"
        p.abort("a")
        if not still_down:
            down.discard("a")  # counted up again before the cancelled task runs
    assert outcome and outcome[0][0] == "NodeDown", outcome
    assert not p._inflight["a"]


async def test_a_cancellation_from_outside_is_not_turned_into_node_down():
    p = peers(set())
    with trio.move_on_after(0.01) as scope:
        await p.call_on("a", "status")
    assert scope.cancelled_caught
