"""One socket's outgoing frames: a task sends its own while the socket is idle, else queues them
whole for one writer task, which sends what is queued in groups of up to ``GROUP`` bytes, one
``sendmsg`` each.

Under a lock, each of a few hundred tasks (a pull's reads of a GB model, their lookups) took the
socket in turn, and each turn cost a pass of trio's scheduler: a heartbeat queued behind 150 of
them waited 0.2-0.7 s for a 40-byte send, and the mount counted working nodes down (issue 41,
chaos ``--model-gib 1``). Here a frame waits for the groups queued ahead of it, whatever the
number of senders; fewer system calls too.

Rules:
- One send at a time on the socket (a caller's own or the writer's group), never interleaved.
- Frames leave whole and in the order they were queued (a caller's several frames together),
  but for ``urgent`` ones (a probe's answer, probes.py): they go ahead of every frame queued and
  not yet begun.
- ``send`` returns once its frames are in the kernel: the caller's buffers may be reused then.
- A caller cancelled before its frames' group began takes them back: nothing is sent. One
  cancelled while its group goes out waits for it (shielded) up to ``patience`` seconds, so its
  buffers stay as they are until the kernel has them; past that (the link stalled), or a caller
  cancelled midway through its own send, calls ``torn``: the peer would read the next frame from
  the middle of this one, so the connection must be dropped. (A writer that sent whole batches
  tore the connection for every cancelled caller in a batch: the GB soak's pulls cancelled by
  a sibling's failure dropped a working node.)
- A socket error fails every frame queued or in the group with it, and every later ``send``.

Concurrency: one trio thread; ``run`` is the one writer task, in the connection's nursery.
"""

from __future__ import annotations

from collections import deque
from typing import Awaitable, Callable

import trio

from .base import SOCKET_ERRORS

GROUP = 256 << 10  # bytes one writer sendmsg takes at most (one frame larger than it goes alone)
QUEUED, SENDING, SENT, DROPPED = range(4)


class _Frames:
    __slots__ = ("wire", "size", "state", "done")

    def __init__(self, wire: list) -> None:
        self.wire = wire
        self.size = sum(len(memoryview(b).cast("B")) for b in wire)
        self.state = QUEUED
        self.done = trio.Event()


class Sender:
    def __init__(self, sock, sendv: Callable[..., Awaitable[None]], torn: Callable[[], None], patience: float) -> None:
        """``sendv(sock, buffers, sent)`` sends all of them (``sent[0]``: bytes gone so far);
        ``torn()`` drops the connection; ``patience``: how long a cancelled caller waits for
        its frames' group to leave."""
        self.sock, self._sendv, self._torn, self.patience = sock, sendv, torn, patience
        self._queue: deque[_Frames] = deque()
        self._wake = trio.Event()
        self._busy = False  # a send is under way on the socket (a caller's own, or a group)
        self.broken: str | None = None  # why the socket failed, once it did

    def queued(self) -> str:
        """What a send on this socket waits behind now, for a log line: a send under way, and
        the frames queued for the writer with their bytes."""
        waiting = [f for f in self._queue if f.state == QUEUED]
        busy = "a send under way, " if self._busy else ""
        return f"{busy}{len(waiting)} frames ({sum(f.size for f in waiting)} bytes) queued to send"

    async def send(self, wire: list, urgent: bool = False) -> None:
        """Send ``wire`` (one or more whole frames' buffers) and return once it is in the
        kernel; ``trio.BrokenResourceError`` if the socket broke first. With nothing queued or
        being sent, the caller sends it itself (no hand-over to the writer: a node answering
        READs one by one pays nothing); else it is queued for the writer."""
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if not self._busy and not self._queue:
            await self._send_now(wire)
            return
        frames = _Frames(wire)
        if urgent:
            self._queue.appendleft(frames)
        else:
            self._queue.append(frames)
        self._wake.set()
        try:
            await frames.done.wait()
        except BaseException:
            if frames.state == QUEUED:
                frames.state = DROPPED  # the writer skips it
            elif frames.state == SENDING:
                with trio.CancelScope(shield=True), trio.move_on_after(self.patience):
                    await frames.done.wait()
                if frames.state == SENDING:
                    self._torn()
            raise
        if frames.state != SENT:
            raise trio.BrokenResourceError(self.broken or "the connection closed")

    async def _send_now(self, wire: list) -> None:
        self._busy = True
        sent = [0]
        try:
            await self._sendv(self.sock, wire, sent)
        except SOCKET_ERRORS as exc:
            self.broken = f"send failed: {exc}"
            self._torn()
            raise trio.BrokenResourceError(self.broken) from None
        except BaseException:
            if sent[0]:  # cancelled midway
                self._torn()
            raise
        finally:
            self._busy = False
            self._wake.set()  # the writer: what was queued meanwhile

    def _next_group(self) -> list[_Frames]:
        """The frames that leave next: queued ones, in order, up to GROUP bytes (at least one)."""
        group, size = [], 0
        while self._queue:
            frames = self._queue[0]
            if frames.state != QUEUED:  # its caller was cancelled: never sent
                self._queue.popleft()
                continue
            if group and size + frames.size > GROUP:
                break
            group.append(self._queue.popleft())
            size += frames.size
        return group

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The writer, until the socket breaks (every waiting sender then fails) or the
        connection's nursery ends. It never raises a socket's error into that nursery."""
        task_status.started()
        group: list[_Frames] = []
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while self.broken is None and not self._busy:
                    group = self._next_group()
                    if not group:
                        break
                    for frames in group:
                        frames.state = SENDING
                    self._busy = True
                    try:
                        await self._sendv(self.sock, [b for frames in group for b in frames.wire], None)
                    finally:
                        self._busy = False
                    for frames in group:
                        frames.state = SENT
                        frames.done.set()
                    group = []
                if self.broken is not None:  # a caller's own send failed: the queued fail too
                    break
        except SOCKET_ERRORS as exc:
            self.broken = f"send failed: {exc}"
            self._torn()
        finally:
            self.broken = self.broken or "the connection closed"
            for frames in [*group, *self._queue]:
                frames.done.set()
            self._queue.clear()
