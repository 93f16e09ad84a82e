"""``IRDMAFS_SLOW_STEPS`` (runtime/looplag.py ``SlowSteps``): a task step that held the loop is logged with
its task, where it stopped, and how much of it this thread ran (a step the host did not run
looks the same by the clock alone: chaos soaks on two cores saw both)."""

import logging
import re
import time

import trio

from irdmafs.runtime import looplag


def test_a_step_that_held_the_loop_is_logged_with_its_running_time(caplog, monkeypatch):
    monkeypatch.setenv("IRDMAFS_SLOW_STEPS", "0.05")

    async def busy() -> None:
        began = time.thread_time()
        while time.thread_time() - began < 0.1:  # 0.1 s on the CPU, never yielding
            pass
        await trio.sleep(0)

    async def quick() -> None:
        for _ in range(10):
            await trio.sleep(0)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(busy, name="busy-task")
            n.start_soon(quick, name="quick-task")

    with caplog.at_level(logging.WARNING, logger="irdmafs.runtime.looplag"):
        trio.run(main, instruments=looplag.instruments())
    lines = [r.getMessage() for r in caplog.records if "held the loop" in r.getMessage()]
    assert len(lines) == 1 and "busy-task" in lines[0] and "test_slow_steps.py" in lines[0], lines
    took, ran = map(float, re.search(r"held the loop ([\d.]+) s, ([\d.]+) s of it running", lines[0]).groups())
    assert took >= ran >= 0.1


def test_no_instrument_unless_asked(monkeypatch):
    monkeypatch.delenv("IRDMAFS_SLOW_STEPS", raising=False)
    assert looplag.instruments() == []
