"""batching.Batcher: items sent in batches by the tasks that queued them (pushes to a node,
replica updates to a peer)."""

import math

import pytest
import trio
import trio.testing

from irdmafs.runtime.batching import Batcher, Unsent


class Gated:
    """A ``send`` that records each batch and answers it when the test opens its gate."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.gates: list[trio.Event] = []
        self.started = trio.Event()

    async def __call__(self, values: list) -> list:
        gate = trio.Event()
        self.batches.append(values)
        self.gates.append(gate)
        self.started.set()
        self.started = trio.Event()
        await gate.wait()
        return [f"ok {v}" for v in values]

    async def wait_batches(self, n: int) -> None:
        while len(self.batches) < n:
            await self.started.wait()


async def test_a_sender_returns_once_its_own_batch_is_answered_and_hands_the_sending_on():
    send = Gated()
    b = Batcher(senders=1, limit=1, send=send)  # one item a batch, one batch at a time
    done: dict[str, str] = {}

    async def put(v: str) -> None:
        done[v] = await b.put(v, 1)

    async with trio.open_nursery() as n:
        for v in "abc":  # one at a time: tasks started together run in any order
            n.start_soon(put, v)
            await trio.testing.wait_all_tasks_blocked()
        assert send.batches == [["a"]]
        send.gates[0].set()
        await send.wait_batches(2)  # b's task sends its own now
        await trio.testing.wait_all_tasks_blocked()
        # a's caller has its answer while b and c are still on their way (a sender that
        # drained the queue answered a only after c)
        assert done == {"a": "ok a"}
        assert send.batches == [["a"], ["b"]]
        send.gates[1].set()
        await send.wait_batches(3)
        await trio.testing.wait_all_tasks_blocked()
        assert done == {"a": "ok a", "b": "ok b"}
        send.gates[2].set()
    assert done == {"a": "ok a", "b": "ok b", "c": "ok c"}


async def test_queued_items_travel_together_lowest_order_first():
    send = Gated()
    b = Batcher(senders=1, limit=100, send=send)
    results = {}

    async def put(v: str, order: float) -> None:
        results[v] = await b.put(v, 10, order)

    async with trio.open_nursery() as n:
        n.start_soon(put, "first", math.inf)
        await send.wait_batches(1)
        for v, order in (("late", 3.0), ("early", 1.0), ("middle", 2.0)):
            n.start_soon(put, v, order)
            await trio.testing.wait_all_tasks_blocked()
        send.gates[0].set()
        await send.wait_batches(2)
        assert send.batches[1] == ["early", "middle", "late"]
        send.gates[1].set()
    assert results == {v: f"ok {v}" for v in ("first", "early", "middle", "late")}


async def test_a_batch_takes_up_to_limit_bytes_and_its_first_item_whatever_its_size():
    send = Gated()
    b = Batcher(senders=1, limit=10, send=send)
    async with trio.open_nursery() as n:
        n.start_soon(b.put, "x", 1)
        await send.wait_batches(1)
        n.start_soon(b.put, "big", 50)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(b.put, "s1", 4)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(b.put, "s2", 4)
        await trio.testing.wait_all_tasks_blocked()
        send.gates[0].set()
        await send.wait_batches(2)
        assert send.batches[1] == ["big"]
        send.gates[1].set()
        await send.wait_batches(3)
        assert send.batches[2] == ["s1", "s2"]
        send.gates[2].set()


async def test_a_caller_cancelled_while_queued_takes_its_item_back():
    send = Gated()
    b = Batcher(senders=1, limit=100, send=send)
    cancel_b = trio.CancelScope()

    async def put_b() -> None:
        with cancel_b:
            await b.put("b", 1)

    async with trio.open_nursery() as n:
        n.start_soon(b.put, "a", 1)
        await send.wait_batches(1)
        n.start_soon(put_b)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(b.put, "c", 1)
        await trio.testing.wait_all_tasks_blocked()
        cancel_b.cancel()
        await trio.testing.wait_all_tasks_blocked()
        send.gates[0].set()
        await send.wait_batches(2)
        send.gates[1].set()
    assert send.batches == [["a"], ["c"]]
    assert len(b) == 0


async def test_a_task_handed_the_sending_and_cancelled_passes_it_on():
    send = Gated()
    b = Batcher(senders=1, limit=1, send=send)
    results = {}
    scopes = {v: trio.CancelScope() for v in "bc"}

    async def put(v: str) -> None:
        with scopes.get(v, trio.CancelScope()):
            results[v] = await b.put(v, 1)

    async with trio.open_nursery() as n:
        n.start_soon(put, "a")
        await send.wait_batches(1)
        n.start_soon(put, "b")
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(put, "c")
        await trio.testing.wait_all_tasks_blocked()
        send.gates[0].set()  # a answered: b is handed the sending ...
        scopes["b"].cancel()  # ... and cancelled before it runs
        await send.wait_batches(2)
        assert send.batches[1] == ["c"]
        send.gates[1].set()
    assert results == {"a": "ok a", "c": "ok c"}


async def test_a_batch_cut_off_midway_answers_unsent_to_the_items_riding_in_it():
    send = Gated()
    b = Batcher(senders=1, limit=100, send=send)
    first_cancel = trio.CancelScope()
    answers = {}

    async def put(v: str, scope: trio.CancelScope | None = None) -> None:
        with scope or trio.CancelScope():
            try:
                answers[v] = await b.put(v, 1)
            except Unsent as exc:
                answers[v] = exc

    async with trio.open_nursery() as n:
        n.start_soon(put, "a")
        await send.wait_batches(1)
        n.start_soon(put, "b", first_cancel)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(put, "c")
        await trio.testing.wait_all_tasks_blocked()
        send.gates[0].set()
        await send.wait_batches(2)  # b's task is handed the sending: b and c go together
        assert send.batches[1] == ["b", "c"]
        first_cancel.cancel()  # b's task cancelled while the batch is on its way
    assert answers["a"] == "ok a"
    assert isinstance(answers["c"], Unsent)  # it may or may not have arrived: the caller decides
    assert "b" not in answers


async def test_an_error_sending_a_batch_is_every_items_answer():
    async def fail(values: list) -> list:
        raise OSError("link down")

    b = Batcher(senders=2, limit=100, send=fail)
    with pytest.raises(OSError, match="link down"):
        await b.put("a", 1)

    async def per_item(values: list) -> list:
        return [ValueError(v) if v == "bad" else v for v in values]

    b = Batcher(senders=1, limit=100, send=per_item)
    assert await b.put("good", 1) == "good"
    with pytest.raises(ValueError, match="bad"):
        await b.put("bad", 1)


async def test_a_batch_answered_with_too_few_answers_fails_every_item_not_leaves_one_waiting():
    async def short(values: list) -> list:
        return values[:1]

    b = Batcher(senders=1, limit=100, send=short)
    got = {}

    async def put(v: str) -> None:
        try:
            got[v] = await b.put(v, 1)
        except RuntimeError as exc:
            got[v] = exc

    send = Gated()
    b.send = send
    async with trio.open_nursery() as n:
        n.start_soon(put, "a")
        await send.wait_batches(1)
        b.send = short
        n.start_soon(put, "b")
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(put, "c")
        await trio.testing.wait_all_tasks_blocked()
        send.gates[0].set()
    assert got["a"] == "ok a"
    assert isinstance(got["b"], RuntimeError) and isinstance(got["c"], RuntimeError)
