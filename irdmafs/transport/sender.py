"""One socket's outgoing frames: a task sends its own while the socket is idle, else queues them
whole for one writer task, which sends everything queued in one go.

Under a lock, each of a few hundred tasks (a pull's reads of a GB model, their lookups) took the
socket in turn, and each turn cost a pass of trio's scheduler: a heartbeat queued behind 150 of
them waited 0.2-0.7 s for a 40-byte send, and the mount counted working nodes down (issue 41,
chaos ``--model-gib 1``). Here whatever is queued when the writer wakes leaves in one
``sendmsg`` (up to IOV_MAX buffers at a time), so a frame waits for at most the batch ahead of
it, whatever the number of senders; fewer system calls too.

Rules:
- One send at a time on the socket (a caller's own or the writer's batch), never interleaved.
- Frames leave whole and in the order they were queued (a caller's several frames together).
- ``send`` returns once its frames are in the kernel: the caller's buffers may be reused then.
- A caller cancelled before the writer took its frames takes them back: nothing was sent. One
  cancelled after (its frames may be partly out) calls ``torn``: the peer would read the next
  frame from the middle of this one, so its connection must be dropped.
- A socket error fails every frame queued or in the batch with it, and every later ``send``.

Concurrency: one trio thread; ``run`` is the one writer task, in the connection's nursery.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import trio

from .base import SOCKET_ERRORS


class _Frames:
    __slots__ = ("wire", "taken", "sent", "done")

    def __init__(self, wire: list) -> None:
        self.wire = wire
        self.taken = False  # in the writer's batch: may be partly out
        self.sent = False
        self.done = trio.Event()


class Sender:
    def __init__(self, sock, sendv: Callable[..., Awaitable[None]], torn: Callable[[], None]) -> None:
        """``sendv(sock, buffers, sent)`` sends all of them (``sent[0]``: bytes gone so far);
        ``torn()`` drops the connection."""
        self.sock, self._sendv, self._torn = sock, sendv, torn
        self._queue: list[_Frames] = []
        self._wake = trio.Event()
        self._busy = False  # a caller is sending its own frames on the socket
        self.broken: str | None = None  # why the socket failed, once it did
        self.batches = 0  # sendmsg batches so far (tests: senders share them)

    async def send(self, wire: list) -> None:
        """Send ``wire`` (one or more whole frames' buffers) and return once it is in the
        kernel; ``trio.BrokenResourceError`` if the socket broke first. With nothing queued or
        being sent, the caller sends it itself (no hand-over to the writer: a node answering
        READs one by one pays nothing); else it is queued for the writer's next batch."""
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if not self._busy and not self._queue:
            await self._send_now(wire)
            return
        frames = _Frames(wire)
        self._queue.append(frames)
        self._wake.set()
        try:
            await frames.done.wait()
        except BaseException:
            if not frames.taken:
                self._queue.remove(frames)
            elif not frames.done.is_set():
                self._torn()
            raise
        if not frames.sent:
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
            self.batches += 1
            self._wake.set()  # the writer: what was queued meanwhile

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The writer, until the socket breaks (every waiting sender then fails) or the
        connection's nursery ends. It never raises a socket's error into that nursery."""
        task_status.started()
        batch: list[_Frames] = []
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                if self.broken is not None:  # a caller's own send failed: the queued fail too
                    break
                if self._busy:  # a caller is sending its own: it wakes the writer when done
                    continue
                batch, self._queue = self._queue, []
                if not batch:  # its senders were cancelled before it woke
                    continue
                for frames in batch:
                    frames.taken = True
                self._busy = True
                try:
                    await self._sendv(self.sock, [b for frames in batch for b in frames.wire], None)
                finally:
                    self._busy = False
                self.batches += 1
                for frames in batch:
                    frames.sent = True
                    frames.done.set()
                batch = []
                if self._queue:  # queued while this batch went
                    self._wake.set()
        except SOCKET_ERRORS as exc:
            self.broken = f"send failed: {exc}"
            self._torn()
        finally:
            self.broken = self.broken or "the connection closed"
            for frames in batch + self._queue:
                frames.done.set()
            self._queue = []
