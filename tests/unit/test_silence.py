"""A deadline on silence, not on size (irdmafs/runtime/silence.py): a block lives as long as what it
waits on progresses, and ends with TooSlowError once it has been silent for the bound."""

import pytest
import trio
import trio.testing

from irdmafs.runtime.silence import Moves, Patience, SilenceBound


async def test_progress_keeps_every_open_block_alive_and_silence_ends_them(autojump_clock):
    bound = SilenceBound(3.0)
    done = []

    async def long_work(name: str, seconds: float) -> None:
        with bound():
            await trio.sleep(seconds)
        done.append(name)

    async def progress(every: float, times: int) -> None:
        for _ in range(times):
            await trio.sleep(every)
            bound.progressed()

    async with trio.open_nursery() as n:
        n.start_soon(long_work, "ten seconds of work", 10.0)  # over 3 s, but never 3 s silent
        n.start_soon(long_work, "two", 2.0)
        n.start_soon(progress, 1.0, 12)
    assert sorted(done) == ["ten seconds of work", "two"]

    with pytest.raises(trio.TooSlowError):
        with bound():  # nothing progresses any more
            await trio.sleep(100.0)
    assert trio.current_time() < 200.0


def test_moves_are_counted_from_the_first_look_at_a_node():
    work = {"a": ("catch-up", 1), "b": ("catch-up", 7)}
    moves = Moves(work.get)
    assert not moves.moved("a")  # the first look: where its progress is counted from
    assert not moves.moved("a")
    work["a"] = ("catch-up", 2)
    assert moves.moved("a") and not moves.moved("a")
    assert not moves.moved("b")
    work["b"] = (None, None)  # its work ended: a change too
    assert moves.moved("a", "b")


async def test_patience_is_renewed_by_a_node_that_moves_and_ends_when_it_stands_still(autojump_clock):
    work = {"n1": 0}
    patience = Patience(work.get, 3.0)

    async def catching_up(seconds: int) -> None:
        for _ in range(seconds):
            await trio.sleep(1.0)
            work["n1"] += 1

    async with trio.open_nursery() as n:
        n.start_soon(catching_up, 20)
        with patience.bound():  # 20 s of work, never 3 s without a move: it lasts
            while work["n1"] < 20:
                await trio.sleep(0.5)
                patience.heed("n1")
    assert trio.current_time() >= 20.0
    with pytest.raises(trio.TooSlowError):
        with patience.bound():  # nothing moves any more
            while True:
                await trio.sleep(0.5)
                patience.heed("n1")
    assert patience.expired()


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)
