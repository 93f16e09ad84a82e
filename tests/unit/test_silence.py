"""A deadline on silence, not on size (irdmafs/silence.py): a block lives as long as what it
waits on progresses, and ends with TooSlowError once it has been silent for the bound."""

import pytest
import trio
import trio.testing

from irdmafs.silence import SilenceBound


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


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)
