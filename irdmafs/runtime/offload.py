"""The one way work leaves a trio loop: a call that would hold it (releasing GBs of memory, a
large copy) runs in a worker thread, in a call that releases the GIL.

A process has one ``Offload``; the fault simulator (tests/sim) makes its nodes' ``inline``, so the
work runs in the loop's own thread at the point it is asked for, and a seed replays alike (a
thread's timing is not the seed's to decide).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import trio

T = TypeVar("T")


class Offload:
    def __init__(self, *, inline: bool = False):
        self.inline = inline

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self.inline:
            await trio.lowlevel.checkpoint()
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args)
